"""Metrics of a run: metrics.jsonl in the run directory, the progress display, the experiment
trackers chosen with `tracker=[...]` (workbench/trackers.py), and the throughput arithmetic
(tokens/s, MFU and its peak).

    tracker = Tracker(run_dir, enabled=is_rank0, cfg=cfg)   # starts the configured trackers
    tracker.log(row, show=True)                             # one training step
    tracker.log_eval(results, step)                         # an evaluation
    tracker.finish(run_dir / "plots")                       # plots to the trackers, close them

MFU is this rank's FLOPs of the step (workbench/flops.py: counted as computed) over the step
time and the device's peak. The peak is the hardware profile's datasheet figure where the
profile has one (conf/hardware/*.yaml `bf16_tflops`, `fp8_tflops`); otherwise (CPU, an
unlisted GPU) a dense matmul measured on this machine: best of several timed trials at two
sizes, kept in $WORKBENCH_CACHE/peak_flops.json per device, dtype and thread count, and
measured again when the kept value is implausible (a quick matmul now beats it, or a
fewer-thread entry of the same device and dtype beats it: it was taken on a busy machine).
"""

from __future__ import annotations

import atexit
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console

from workbench.progress import Progress

_console = Console(stderr=True, highlight=False)

# Row keys that are bookkeeping rather than curves (kept in metrics.jsonl, not sent as scalars).
NOT_SCALARS = {"step", "time"}


class Tracker:
    def __init__(self, run_dir: Path, enabled: bool = True, cfg=None):
        self.enabled = enabled
        self.rows: list[dict] = []
        self.path = Path(run_dir) / "metrics.jsonl"
        self.price: tuple[list[float], int] | None = None  # ([low, high] $/device-hour, devices)
        self.sinks: list = []
        total = int(cfg.train.max_steps) if cfg is not None else 0
        every = int(cfg.train.log_every) if cfg is not None else 10
        self.progress = Progress(total, every, _console, enabled=enabled and cfg is not None)
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if cfg is not None and cfg.get("tracker"):
                from workbench import trackers

                self.sinks = trackers.start(cfg, Path(run_dir), self.console)
                if self.sinks:  # a run that dies still closes its trackers (files flushed, runs ended)
                    atexit.register(self.finish)

    def set_price(self, price_per_hour, devices: int) -> None:
        """With a hardware price, every logged row with tokens_per_s also gets $ per million tokens."""
        self.price = (list(price_per_hour), int(devices)) if price_per_hour else None

    def console(self, text: str) -> None:
        if self.enabled:
            self.progress.print(text)

    def log(self, row: dict, show: bool = False) -> None:
        if not self.enabled:
            return
        if self.price and row.get("tokens_per_s"):
            prices, devices = self.price
            row["usd_per_mtok"] = [usd_per_million_tokens(row["tokens_per_s"], devices, p) for p in prices]
        self.rows.append(row)
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.sinks:
            self._send("train", row, int(row.get("step", len(self.rows))))
        self.progress.update(row)
        if show:
            self.console(format_row(row) + ("" if self.progress.rich else self.progress.suffix(int(row["step"]))))

    def log_eval(self, results: dict, step: int) -> None:
        """Numeric eval results (accuracies, eval seconds) under eval/ at the training step."""
        if self.enabled and self.sinks:
            self._send("eval", results, step)

    def _send(self, prefix: str, row: dict, step: int) -> None:
        scalars = scalar_items(row, prefix)
        for sink in list(self.sinks):
            try:
                sink.scalars(scalars, step)
            except Exception as exc:  # a tracker failing mid-run must not stop training
                self.console(f"tracker {sink.name}: stopped logging ({type(exc).__name__}: {exc})")
                self.sinks.remove(sink)

    def finish(self, plots_dir: Path | None = None) -> None:
        """Send the run's plots to the trackers and close them; stop the progress display."""
        self.progress.stop()
        images = sorted(Path(plots_dir).glob("*.png")) if plots_dir and Path(plots_dir).is_dir() else []
        for sink in self.sinks:
            try:
                if images:
                    sink.images(images, len(self.rows))
                sink.close()
            except Exception as exc:
                self.console(f"tracker {sink.name}: could not close cleanly ({type(exc).__name__}: {exc})")
        self.sinks = []
        atexit.unregister(self.finish)


def scalar_items(row: dict, prefix: str) -> dict[str, float]:
    """`prefix/key` -> float for every numeric value of the row (bools and bookkeeping dropped;
    a key already under `prefix/`, like the eval hooks' `eval/<task>/<metric>`, is kept as is)."""
    out = {}
    for k, v in row.items():
        if k in NOT_SCALARS or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        out[k if k.startswith(f"{prefix}/") else f"{prefix}/{k}"] = float(v)
    return out


def format_row(row: dict) -> str:
    extra = f" mfu={row['mfu']:.1%}" if row.get("mfu") else ""
    if row.get("usd_per_mtok"):
        lo, hi = row["usd_per_mtok"][0], row["usd_per_mtok"][-1]
        extra += f" $/Mtok={lo:.2f}-{hi:.2f}"
    return (f"step {row['step']:>5}  loss={row['loss']:.4f}  grad_norm={row.get('grad_norm', 0):.3f}  "
            f"lr={row.get('lr', 0):.2e}  tok/s={row['tokens_per_s']:.0f}{extra}")


def usd_per_million_tokens(tokens_per_s: float, devices: int, price_per_hour: float) -> float:
    """Dollars per million trained tokens at this throughput on `devices` priced per device-hour."""
    from workbench.plan.speed import cost_per_million_tokens

    return cost_per_million_tokens(tokens_per_s, devices, price_per_hour)


def throughput(count, batch, seconds: float, peak: float, ranks: int) -> dict:
    """`flops` (the StepBatch's FLOPs over all `ranks`, counted as computed: training and the
    forward passes of its rollouts) and `mfu` (this rank's FLOPs over the step time and one
    device's peak) for a metrics row."""
    mine = count.step(batch.micro, batch.forward_passes)
    return {"flops": mine * ranks, "mfu": mine / seconds / peak if peak and seconds > 0 else None}


def flops_per_token(model, seq_len: int, head_fraction: float = 1.0, run=None) -> float:
    """Training FLOPs per position of `model` at `seq_len`, the LM head on `head_fraction` of the
    positions; the accounting of workbench/flops.py (the runner counts each step's batch)."""
    from workbench.flops import FlopCount

    return FlopCount.from_model(model, run).per_token(seq_len, head_fraction)


# -- the peak ------------------------------------------------------------------------------
_PEAK: dict = {}


def peak_flops(hw, pol, device: str) -> tuple[float, str]:
    """(FLOP/s of one device, where the figure comes from): the datasheet of the hardware
    profile when it has one for this device, else the measured matmul peak."""
    if device != "cpu" and hw is not None and hw.bf16_tflops:
        from workbench.plan.catalog import peak_tflops

        return peak_tflops(hw, pol.name) * 1e12, f"datasheet ({hw.accelerator or hw.name})"
    return measured_peak_flops(device, pol), "measured matmul"


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return device


def measured_peak_flops(device: str, pol) -> float:
    """Dense matmul FLOP/s of this device in the policy's compute dtype, kept per machine
    (device model, dtype, threads) in $WORKBENCH_CACHE/peak_flops.json and re-measured when the
    kept value is implausible."""
    from workbench import cache

    dtype = pol.compute_dtype
    threads = torch.get_num_threads() if device == "cpu" else 0
    prefix = f"{_device_name(device)}|{dtype}|"
    key = f"{prefix}{threads}"
    if key not in _PEAK:
        path = cache.root() / "peak_flops.json"
        quick = matmul_flops(device, dtype, trials=1, seconds=0.03)  # what this machine does right now
        floor = _fewer_thread_best(path, prefix, threads)

        def plausible(v: float) -> bool:
            # A kept figure below what a 30 ms matmul reaches now, or below the same device with
            # fewer threads, was measured while something else held the cores.
            return v > 0 and v >= quick / 1.15 and v >= floor / 1.15

        # More threads do at least what fewer do: on a machine too busy to show it, the
        # fewer-thread figure is the better estimate of the peak.
        _PEAK[key] = cache.update_json(path, key, lambda: max(matmul_flops(device, dtype), quick, floor), plausible)
    return _PEAK[key]


def _fewer_thread_best(path: Path, prefix: str, threads: int) -> float:
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return 0.0
    best = 0.0
    for k, v in (table.items() if isinstance(table, dict) else []):
        if k.startswith(prefix) and isinstance(v, (int, float)):
            try:
                n = int(k[len(prefix):])
            except ValueError:
                continue
            if 0 < n < threads:
                best = max(best, float(v))
    return best


# Longest single product the measurement runs: bf16 on a CPU without native bf16 (AVX2 only)
# runs ~7x slower than fp32 (a 2048 product ~1.1 s); a size predicted to exceed this is skipped
# and the smaller sizes' figure stands.
MAX_PRODUCT_SECONDS = 1.0


def matmul_flops(device: str, dtype, trials: int = 5, seconds: float = 0.1) -> float:
    """Dense matmul FLOP/s measured now, through `F.linear` as the models' layers run it (on an
    AVX2-only CPU a bf16 `a @ b` takes a path ~10x slower than bf16 F.linear, so a peak taken
    from it put MFU above 100%): the best of `trials` timed runs of at least `seconds` each, at
    growing sizes (a small one fits cache, a large one amortises overheads) up to the
    largest whose product the rate so far predicts within MAX_PRODUCT_SECONDS; the best is what
    the device can do, slower trials are other work sharing it. `trials=1` (a quick look): all
    sizes but the largest."""
    sizes = (256, 1024, 2048) if device == "cpu" else (4096, 8192)
    best = 0.0
    # A generator of its own: whether and how often this runs depends on the cache and the load,
    # and drawing from the global one would change what a run samples after it (GRPO rollouts).
    gen = torch.Generator(device=device).manual_seed(0)
    for n in sizes if trials > 1 else sizes[:-1]:
        if best and 2 * n**3 / best > MAX_PRODUCT_SECONDS:
            break
        a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        F.linear(a, b)  # warm-up: first-call allocation, kernel selection
        for _ in range(trials):
            if device == "cuda":
                torch.cuda.synchronize()
            reps, t = 0, time.perf_counter()
            while True:
                F.linear(a, b)
                reps += 1
                if device == "cuda":
                    torch.cuda.synchronize()
                if time.perf_counter() - t >= seconds:
                    break
            best = max(best, 2 * n**3 * reps / (time.perf_counter() - t))
    return best
