"""The plan checked against the run: what the planner predicted for this layout, and what happened.

After `plan.check_after_steps` steps (default 10; 0 turns it off) the runner measures, on every
rank, the peak memory of a device (CUDA: the allocator's max allocated; CPU: what tensors occupy
at their peak during the check's step, the same quantity, workbench/plan/tensor_memory.py),
the median step time and tokens/s (the first step left out: it compiles and touches memory for
the first time; on CPU the profiled step too), and compares them with
the planner's prediction for exactly this run on its hardware
(workbench/plan/make.py; tokens/s at `plan.mfu` of the device's peak, the peak the run's MFU is
taken against). One console line, `plan_check` in results.json and a table in report.md; a
figure worse than planned by more than `TOLERANCE` (more memory, a slower step) is named in a
warning, one better than planned in the plain line.

`plan.calibrate=true` stores measured/predicted per hardware (the profile, the device's model
and the precision) in $WORKBENCH_CACHE/plan_calibration.json; a later dry run on that hardware
multiplies its prediction by them and says so (`calibrated(...)`).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from omegaconf import OmegaConf

from workbench.core import cache
from workbench.plan.peak import device_name
from workbench.plan.speed import Rollout
from workbench.plan.tensor_memory import Window

TOLERANCE = 0.20  # the bar: a prediction more than 20% off is worth a warning
FILE = "plan_calibration.json"


class Shapes:
    """The longest row and the share of positions with a loss over the steps seen so far; for a
    method that trains on rollouts also the prompts and completions it trained on and what its
    rollouts generated (the decode steps, with dynamic sampling's refills, and their rows)."""

    def __init__(self):
        self.longest, self.selected, self.positions = 0, 0, 0
        self.steps, self.prompt, self.completions, self.completion_tokens = 0, 0, 0, 0
        self.rows, self.micros = 0, 0
        self.prefill, self.decodes, self.decode_rows, self.calls = 0, 0, 0, 0
        self._last = None

    def update(self, batch) -> None:
        self.steps += 1
        for micro in batch.micro:
            ids, select = micro.get("input_ids"), micro.get("select")
            if ids is None:
                continue
            self.longest = max(self.longest, int(ids.shape[-1]))
            self.positions += int(ids.numel())
            self.rows, self.micros = self.rows + (int(ids.shape[0]) if ids.dim() > 1 else 1), self.micros + 1
            self.selected += int(select.sum()) if select is not None else int(ids.numel())
            n_tokens = micro.get("n_tokens")
            if n_tokens is not None and select is not None:
                # a row's first target is read at its prompt's last position
                first = select.float().argmax(dim=-1)
                self.prompt = max(self.prompt, int(first.max()) + 1)
                self.completions += int(n_tokens.numel())
                self.completion_tokens += int(n_tokens.sum())
        passes = getattr(batch, "forward_passes", None) or []
        if batch is self._last:  # a rollout reused for num_iterations steps was generated once
            return
        self._last = batch
        for i, p in enumerate(passes):
            if p.seq == 1:
                self.decodes += 1
                self.decode_rows += p.rows
            elif i + 1 < len(passes) and passes[i + 1].seq == 1:  # a generate call's prefill
                self.prefill += p.rows * p.seq
                self.calls += 1

    def rollout(self):
        """What a rank generated per optimizer step, for the planner (None: nothing seen)."""
        if not self.steps or not self.decodes:
            return None
        return Rollout(prefill_tokens=self.prefill / self.steps, decode_steps=self.decodes / self.steps,
                       rows=self.decode_rows / self.decodes, calls=self.calls / self.steps)

    def config(self, cfg, generates: bool):
        """`cfg` with data.seq_len and plan.select_fraction as the run had them: a method that
        trains on rollouts with its longest prompt as data.seq_len (its completions come from
        completion_len()), another with its longest row."""
        out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        if generates and self.completions:
            out.data.seq_len = self.prompt
        elif self.longest and not generates:
            out.data.seq_len = self.longest
            # SFT examples packed or sharing a prefix (data.pad_free, data.share_prefix) fill
            # fewer rows than train.micro_batch_size; the plan is of the rows the run computed
            rows = -(-self.rows // max(1, self.micros))
            if 0 < rows < int(out.train.micro_batch_size):
                out.train.micro_batch_size = rows
        if self.positions:
            out.plan.select_fraction = self.selected / self.positions
        return out

    def completion_len(self) -> int | None:
        """The mean completion the run generated (end-of-turn included), the tokens it trained on
        per completion; None where it generated none."""
        return max(1, round(self.completion_tokens / self.completions)) if self.completions else None


class Memory:
    """The plan check's measured peak. CUDA: the allocator's max allocated. CPU: the tensors'
    peak over the check's own step, under the profiler (before() opens the window, after()
    closes it before that step's checkpoint or evaluation). The step is past the first, so the
    optimizer's state is already alive and counted. The resident set is read beside it for the
    record, never held to the plan: it also holds the Python heap and what glibc keeps after a
    free (a cold cache's model conversion, GRPO's rollouts), which no plan models; on a CPU a
    large excess is named (resident_note)."""

    def __init__(self, device: str, check_after: int, max_steps: int):
        # no window when there is no check to read it: off (0), or past the run's last step
        self.step = check_after if 0 < check_after <= max_steps else None
        self.device, self.window, self.profiled, self.peak = device, None, set(), None
        self.shapes = Shapes()  # the window's batch: the peak is planned for the step it measured

    def before(self, step: int) -> None:
        """Called before each step with the number of steps done."""
        if self.device != "cuda" and self.step is not None and step + 1 == self.step:
            self.window = Window()
            self.window.start()
            self.profiled.add(self.step)  # its row: slower under the profiler

    def after(self, step: int) -> None:
        """Called after each step with the number of steps done."""
        if self.window is not None and step == self.step:
            self.peak, self.window = self.window.stop(), None

    def seen(self, batch) -> None:
        if self.window is not None:
            self.shapes.update(batch)

    def planned_shapes(self, whole_run: Shapes) -> Shapes:
        """What the peak is planned for: the window's batches (CPU), the whole run's (CUDA's
        max allocated covers every step)."""
        return self.shapes if self.shapes.steps else whole_run

    def peak_gib(self) -> float:
        """0.0 where nothing was measured (every rank calls this: the peak is reduced over ranks)."""
        if self.device == "cuda":
            import torch

            return torch.cuda.max_memory_allocated() / 2**30
        return (self.peak or 0) / 2**30

    def close(self) -> None:
        """Stop a window the check never read (a run the stall watch ended before it)."""
        if self.window is not None:
            self.window.stop()
            self.window = None


def resident_gib() -> float | None:
    """This process's resident high-water mark (VmHWM), in GiB; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


# A CPU process's resident set beyond its tensor peak that is worth a sentence. With freed memory
# returned at once (MALLOC_MMAP_THRESHOLD_ set) SmolLM2 runs held about 0.5 GiB beyond their tensors
# (Python, torch, libraries); a cold cache's model conversion adds hundreds of MB. glibc's default,
# which keeps freed blocks for reuse, held 1.6-1.9x the tensor peak on rows of 8-21k tokens
# (docs/guides/long-context.md): the host, not the plan, then decides what fits.
SLACK_GIB, SLACK_SHARE = 2.0, 0.5


def resident_note(resident: float | None, tensors: float | None, device: str) -> str:
    """A sentence when a CPU run's resident set is well beyond its tensors, else ''."""
    if device == "cuda" or not resident or not tensors:
        return ""
    slack = resident - tensors
    if slack <= max(SLACK_GIB, SLACK_SHARE * tensors):
        return ""
    return (f"the process holds {resident:.3g} GiB resident, {slack:.3g} beyond its tensors: freed memory "
            "glibc keeps for reuse, which the plan does not count (MALLOC_MMAP_THRESHOLD_=131072 returns it, "
            "slower; docs/guides/long-context.md)")


def compare(predicted: dict, measured: dict) -> dict:
    """{figure: {predicted, measured, ratio, off}} and the figures off by more than TOLERANCE."""
    out: dict = {"figures": {}, "off": []}
    for key, want in predicted.items():
        got = measured.get(key)
        if not want or got is None:
            continue
        ratio = got / want
        out["figures"][key] = {"predicted": want, "measured": got, "ratio": ratio}
        if abs(ratio - 1) > TOLERANCE:
            out["off"].append(key)
    return out


def line(check: dict, steps: int, note: str = "") -> str:
    names = {"peak_gib": ("peak memory", "GiB"), "step_seconds": ("step", "s"), "tokens_per_s": ("tokens/s", "")}
    parts = []
    for key, f in check["figures"].items():
        label, unit = names.get(key, (key, ""))
        parts.append(f"{label} {f['measured']:.3g}{unit} measured vs {f['predicted']:.3g}{unit} predicted "
                     f"({f['ratio'] - 1:+.0%})")
    head = f"plan check after {steps} steps: " + ("; ".join(parts) or "nothing to compare")
    if check.get("calibrated"):
        head += f" (prediction calibrated: {check['calibrated']})"
    if note:
        head += f"; {note}"
    worse = [k for k in check["off"] if _worse(k, check["figures"][k]["ratio"])]
    better = [k for k in check["off"] if k not in worse]
    if better:
        head += f"; better than planned by more than {TOLERANCE:.0%}: {', '.join(better)}"
    if worse:
        return f"warning: {head}; off by more than {TOLERANCE:.0%}: {', '.join(worse)}"
    return head


def _worse(key: str, ratio: float) -> bool:
    """Whether measured/predicted `ratio` is a surprise that costs: more memory or a slower step
    than planned. A run faster than its plan is one plain line, not a warning: nothing to act on."""
    return ratio < 1 if key == "tokens_per_s" else ratio > 1


def step_figures(rows: list[dict], skip=()) -> dict:
    """Median step time and tokens/s over the logged steps, the first and `skip` (steps run
    under the memory profiler) left out."""
    timed = [r for r in rows if "step_seconds" in r]
    rows = [r for r in timed[1:] if r.get("step") not in skip] or timed[1:] or timed
    if not rows:
        return {}
    return {"step_seconds": statistics.median(r["step_seconds"] for r in rows),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows)}


# -- calibration --------------------------------------------------------------------------
def hardware_key(hw, precision: str, model: str) -> str:
    """Ratios hold for one model on one hardware: a tiny model's memory ratio says nothing
    about a 7B's, so each model gets its own entry."""
    return f"{hw.name}|{device_name(hw.device)}|{precision}|{model}"


def store(hw, precision: str, model: str, check: dict, run_dir) -> dict:
    """Keep measured/predicted for this hardware (plan.calibrate=true); returns the entry."""
    entry = {key: f["ratio"] for key, f in check["figures"].items()}
    entry.update(run=str(run_dir), time=time.strftime("%Y-%m-%d %H:%M"))
    path = table_path()
    with cache.lock(path):
        table = _read(path)
        table[hardware_key(hw, precision, model)] = entry
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(path)
    return entry


def calibration(hw, precision: str, model: str) -> dict | None:
    """The stored ratios for this model on this hardware, or None."""
    return _read(table_path()).get(hardware_key(hw, precision, model))


def table_path() -> Path:
    return cache.root() / FILE


def _read(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}
