"""Keep the best evaluated checkpoint apart from the rolling ones: `train.keep_best=<metric>`.

    python -m workbench data.path=chat.jsonl eval.tasks=[loss] eval.every_n_steps=50 \
        train.checkpoint_every=50 train.keep_best=loss/loss            # min for losses, else max
    python -m workbench ... train.keep_best=my_hook/score train.keep_best_mode=max train.export_best=true

After every evaluation the metric (`eval/<task>/<key>`; the `eval/` may be left out) is compared
with the best so far; when it is better, the committed checkpoint of that step is copied to
`<output_dir>/checkpoints/best/` together with `best.json` (metric, mode, value, step), published
as one directory (workbench/core/atomic.py), so the weights and the record that describes them
are replaced together or not at all: `best_dir(run_dir)` finds the complete one even after a
crash mid-publish. Rolling checkpoints (`step-*`, pruned to train.keep_checkpoints) never touch
it, and a resumed run reads best.json and goes on comparing. `train.export_best=true` exports
the best weights instead of the last ones.

The copy needs the step's checkpoint on disk, so evaluations must fall on checkpoint steps
(eval.every_n_steps a multiple of train.checkpoint_every); `check` says so before training, and
that the metric is one the configured tasks report (preflight hands it what they report:
workbench/evals/hooks.py `metrics`), so a misspelt name stops the run before weights load rather
than at its first evaluation.
"""

from __future__ import annotations

import difflib
import json
import shutil
from pathlib import Path

from workbench.core import atomic
from workbench.core.errors import UserError

LOWER_IS_BETTER = ("loss", "perplexity", "error", "wer", "cer")
RECORD = "best.json"  # inside best/, so it always describes the weights beside it


EVAL_PREFIX = "eval/"  # what an evaluation's metric keys begin with (eval/<task>/<metric>)


def metric_key(name: str) -> str:
    """The metric key of a name given with or without its prefix (train.keep_best=arith_add2/accuracy)."""
    return name if name.startswith(EVAL_PREFIX) else f"{EVAL_PREFIX}{name}"


def metric_name(key: str) -> str:
    """A metric key as the console says it: <task>/<metric>."""
    return key.removeprefix(EVAL_PREFIX)


def mode_of(name: str, mode: str) -> str:
    if mode in ("min", "max"):
        return mode
    return "min" if any(w in name.rsplit("/", 1)[-1] for w in LOWER_IS_BETTER) else "max"


def check(cfg, reported: dict[str, tuple[str, ...] | None]) -> None:
    """Preflight: the metric is one an evaluated task reports and evaluations fall on checkpoints.
    `reported`: each task's metric names by its key name, None where they are known only when the
    task runs (workbench/evals/hooks.py `metrics`)."""
    t = cfg.train
    if not t.keep_best:
        if t.export_best:
            raise UserError("train.export_best=true needs train.keep_best=<metric> (e.g. loss/loss)")
        return
    if t.keep_best_mode not in ("auto", "min", "max"):
        raise UserError(f"train.keep_best_mode={t.keep_best_mode!r} must be auto, min or max")
    check_metric(t.keep_best, list(cfg.eval.tasks), reported)
    if not cfg.eval.every_n_steps and not cfg.eval.at_end:  # only before training, or never: nothing to keep
        raise UserError(f"train.keep_best={t.keep_best} keeps nothing: no evaluation runs after a training step "
                        "(eval.every_n_steps=0 and eval.at_end=false; debug=fast and eval=none turn evaluation off); "
                        "add eval.at_end=true, or eval.every_n_steps=N with train.checkpoint_every dividing N")
    if cfg.eval.every_n_steps and (not t.checkpoint_every or cfg.eval.every_n_steps % t.checkpoint_every):
        raise UserError(f"train.keep_best copies the checkpoint of the evaluated step: make eval.every_n_steps "
                        f"({cfg.eval.every_n_steps}) a multiple of train.checkpoint_every ({t.checkpoint_every})")


def check_metric(name: str, tasks: list, reported: dict[str, tuple[str, ...] | None]) -> None:
    """UserError unless `name` (<task>/<metric>, `eval/` optional) is a metric `reported` lists,
    naming the ones there are and the closest."""
    wanted = metric_key(name)[len("eval/"):]
    task, _, metric = wanted.partition("/")
    if task in reported and metric and (reported[task] is None or metric in reported[task]):
        return
    if not tasks:
        raise UserError(f"train.keep_best={name!r}: eval.tasks=[] evaluates nothing; add the task that reports "
                        "it (e.g. eval.tasks=[loss] with data.eval_split, or your own module:function)")
    known = [f"{k}/{m}" for k, ms in reported.items() if ms is not None for m in ms]
    close = difflib.get_close_matches(wanted, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    anything = [f"{k}/<metric>" for k, ms in reported.items() if ms is None]  # known when the hook runs
    raise UserError(f"train.keep_best={name!r}: no task in eval.tasks={tasks} reports that metric; {hint}"
                    f"they report: {', '.join(known + anything)}")


def best_dir(run_dir) -> Path | None:
    """The run's kept best checkpoint (a complete directory holding best.json), or None."""
    return atomic.current(Path(run_dir) / "checkpoints" / "best")


def record(run_dir) -> dict | None:
    """best.json of the kept best checkpoint: metric, mode, value, step; None before one is kept."""
    found = best_dir(run_dir)
    if found is None:
        return None
    inside = found / RECORD
    # runs from before the record moved inside best/ kept it beside the directory
    path = inside if inside.is_file() else Path(run_dir) / "checkpoints" / RECORD
    return json.loads(path.read_text()) if path.is_file() else None


class Keeper:
    """Rank 0's record of the best evaluation; `update` after each evaluation."""

    def __init__(self, run_dir, metric: str, mode: str = "auto"):
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / "checkpoints"
        self.key = metric_key(metric)
        self.mode = mode_of(self.key, mode)
        self.best = record(self.run_dir)

    @property
    def path(self) -> Path | None:
        return self.root / "best" if self.best else None

    def better(self, value: float) -> bool:
        if self.best is None:
            return True
        old = self.best["value"]
        return value < old if self.mode == "min" else value > old

    def update(self, results: dict, step: int) -> bool:
        """Copy step `step`'s checkpoint to best/ when `results` improve the metric; True if it did."""
        if self.key not in results:
            raise UserError(f"train.keep_best={metric_name(self.key)!r}: the evaluation at step {step} reported no such "
                            f"metric; it reported {sorted(k for k in results if k.startswith('eval/'))}")
        value = float(results[self.key])
        src = self.root / f"step-{step:08d}"
        if step == 0 or not src.is_dir() or not self.better(value):
            return False  # nothing trained yet, or this step's checkpoint is written after this evaluation
        best = {"metric": self.key, "mode": self.mode, "value": value, "step": step, "from": src.name}
        with atomic.publishing(self.root / "best") as tmp:
            shutil.copytree(src, tmp, dirs_exist_ok=True)
            (tmp / RECORD).write_text(json.dumps(best, indent=1))
        self.best = best
        return True
