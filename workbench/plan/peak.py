"""The FLOP/s a device can do, for MFU: a datasheet figure or a matmul measured here.

    flops, source = peak_flops(cfg.hardware, run.precision, "cpu")

The peak is the hardware profile's datasheet figure where the profile has one
(conf/hardware/*.yaml `bf16_tflops`, `fp8_tflops`); otherwise (CPU, an unlisted GPU) a dense
matmul measured on this machine: best of several timed trials at two sizes, kept in
$WORKBENCH_CACHE/peak_flops.json per device, dtype and thread count, and measured again when the
kept value is implausible (a quick matmul now beats it, or a fewer-thread entry of the same
device and dtype beats it: it was taken on a busy machine).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from workbench.core import cache
from workbench.plan.catalog import peak_tflops

_PEAK: dict = {}


def peak_flops(hw, pol, device: str) -> tuple[float, str]:
    """(FLOP/s of one device, where the figure comes from): the datasheet of the hardware
    profile when it has one for this device, else the measured matmul peak."""
    if device != "cpu" and hw is not None and hw.bf16_tflops:
        return peak_tflops(hw, pol.name) * 1e12, f"datasheet ({hw.accelerator or hw.name})"
    return measured_peak_flops(device, pol), "measured matmul"


def device_name(device: str) -> str:
    if device == "cuda":
        # a plan for a GPU profile is also made on machines without one (dry runs, CI)
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda"
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
    dtype = pol.compute_dtype
    threads = torch.get_num_threads() if device == "cpu" else 0
    prefix = f"{device_name(device)}|{dtype}|"
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
