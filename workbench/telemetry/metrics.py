"""Metrics of a run: metrics.jsonl in the run directory, the progress display, the experiment
trackers chosen with `tracker=[...]` (workbench/telemetry/trackers.py), and the throughput arithmetic
(tokens/s, MFU; its peak is workbench/plan/peak.py).

    tracker = Tracker(run_dir, enabled=is_rank0, cfg=cfg)   # starts the configured trackers
    tracker.log(row, show=True)                             # one training step
    tracker.log_eval(results, step)                         # an evaluation
    tracker.finish(run_dir / "plots")                       # plots to the trackers, close them

MFU is this rank's FLOPs of the step (workbench/compute/flops.py: counted as computed) over the
step time and the device's peak (workbench/plan/peak.py).
"""

from __future__ import annotations

import atexit
import json
from pathlib import Path

from rich.console import Console

from workbench.compute.flops import FlopCount
from workbench.core.secrets import redact, scrub_text, secret_values
from workbench.plan.speed import cost_per_million_tokens
from workbench.telemetry import trackers
from workbench.telemetry.progress import Progress

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
        # metrics.jsonl rows and console lines can quote data and config (source names, paths)
        self.secrets = secret_values(cfg) if cfg is not None else set()
        total = int(cfg.train.max_steps) if cfg is not None else 0
        every = int(cfg.train.log_every) if cfg is not None else 10
        self.progress = Progress(total, every, _console, enabled=enabled and cfg is not None)
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if cfg is not None and cfg.get("tracker"):
                self.sinks = trackers.start(cfg, Path(run_dir), self.console)
                if self.sinks:  # a run that dies still closes its trackers (files flushed, runs ended)
                    atexit.register(self.finish)

    def set_price(self, price_per_hour, devices: int) -> None:
        """With a hardware price, every logged row with tokens_per_s also gets $ per million tokens."""
        self.price = (list(price_per_hour), int(devices)) if price_per_hour else None

    def console(self, text: str) -> None:
        if self.enabled:
            self.progress.print(scrub_text(text, self.secrets))

    def log(self, row: dict, show: bool = False) -> None:
        if not self.enabled:
            return
        if self.price and row.get("tokens_per_s"):
            prices, devices = self.price
            row["usd_per_mtok"] = [usd_per_million_tokens(row["tokens_per_s"], devices, p) for p in prices]
        self.rows.append(row)
        with self.path.open("a") as fh:
            fh.write(json.dumps(redact(row, self.secrets)) + "\n")
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
    return cost_per_million_tokens(tokens_per_s, devices, price_per_hour)


def throughput(count, batch, seconds: float, peak: float, ranks: int) -> dict:
    """`flops` (the StepBatch's FLOPs over all `ranks`, counted as computed: training and the
    forward passes of its rollouts) and `mfu` (this rank's FLOPs over the step time and one
    device's peak) for a metrics row."""
    mine = count.step(batch.micro, batch.forward_passes)
    return {"flops": mine * ranks, "mfu": mine / seconds / peak if peak and seconds > 0 else None}


def flops_per_token(model, seq_len: int, head_fraction: float = 1.0, run=None) -> float:
    """Training FLOPs per position of `model` at `seq_len`, the LM head on `head_fraction` of the
    positions; the accounting of workbench/compute/flops.py (the runner counts each step's batch)."""
    return FlopCount.from_model(model, run).per_token(seq_len, head_fraction)
