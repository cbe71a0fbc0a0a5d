"""Metrics: metrics.jsonl in the run directory, a console line every `train.log_every` steps,
and the throughput arithmetic (tokens/s, MFU).

MFU on CPU is measured against the bf16 (or fp32) matmul peak measured on this machine (once,
then cached), so it says how much of what this machine can actually do the run uses. On a GPU
the peak is the same measurement unless a hardware profile gives a datasheet number.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from rich.console import Console

_console = Console(stderr=True, highlight=False)


class Tracker:
    def __init__(self, run_dir: Path, enabled: bool = True):
        self.enabled = enabled
        self.rows: list[dict] = []
        self.path = Path(run_dir) / "metrics.jsonl"
        self.price: tuple[list[float], int] | None = None  # ([low, high] $/device-hour, devices)
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def set_price(self, price_per_hour, devices: int) -> None:
        """With a hardware price, every logged row with tokens_per_s also gets $ per million tokens."""
        self.price = (list(price_per_hour), int(devices)) if price_per_hour else None

    def console(self, text: str) -> None:
        if self.enabled:
            _console.print(text)

    def log(self, row: dict, show: bool = False) -> None:
        if not self.enabled:
            return
        if self.price and row.get("tokens_per_s"):
            prices, devices = self.price
            row["usd_per_mtok"] = [usd_per_million_tokens(row["tokens_per_s"], devices, p) for p in prices]
        self.rows.append(row)
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        if show:
            mfu = f" mfu={row['mfu']:.1%}" if row.get("mfu") else ""
            if row.get("usd_per_mtok"):
                lo, hi = row["usd_per_mtok"][0], row["usd_per_mtok"][-1]
                mfu += f" $/Mtok={lo:.2f}-{hi:.2f}"
            self.console(f"step {row['step']:>5}  loss={row['loss']:.4f}  grad_norm={row.get('grad_norm', 0):.3f}  "
                         f"lr={row.get('lr', 0):.2e}  tok/s={row['tokens_per_s']:.0f}{mfu}")


def usd_per_million_tokens(tokens_per_s: float, devices: int, price_per_hour: float) -> float:
    """Dollars per million trained tokens at this throughput on `devices` priced per device-hour."""
    from workbench.plan.speed import cost_per_million_tokens

    return cost_per_million_tokens(tokens_per_s, devices, price_per_hour)


def flops_per_token(n_params: int, n_trainable: int, peft_kind: str) -> float:
    """Training FLOPs per token: 6N for full fine-tuning; 4N when the base is frozen
    (forward 2N + backward through activations 2N, no weight gradients for the base)."""
    return 6.0 * n_params if peft_kind == "none" else 4.0 * n_params + 2.0 * n_trainable


_PEAK: dict = {}


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
    """Dense matmul FLOP/s of this device in the policy's compute dtype: measured once per
    machine (device model, dtype, threads) and kept in $WORKBENCH_CACHE/peak_flops.json, so
    later runs do not spend the measurement before their first step."""
    from workbench.models.load import cache_root

    dtype = pol.autocast_dtype or pol.trainable_dtype
    key = f"{_device_name(device)}|{dtype}|{torch.get_num_threads() if device == 'cpu' else 0}"
    if key in _PEAK:
        return _PEAK[key]
    path = Path(cache_root()) / "peak_flops.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = matmul_flops(device, dtype)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{time.time_ns()}.tmp")
            tmp.write_text(json.dumps(known, indent=1))
            tmp.replace(path)
        except OSError:
            pass
    _PEAK[key] = float(known[key])
    return _PEAK[key]


def matmul_flops(device: str, dtype) -> float:
    """Dense 1024x1024 matmul FLOP/s measured now (no cache; scripts/bench.py reads it too)."""
    n = 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    reps, t = 0, time.perf_counter()
    while time.perf_counter() - t < 0.2:
        a @ b
        reps += 1
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t)
