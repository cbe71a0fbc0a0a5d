"""The plan check's CPU memory figure counts tensors, not the resident set
(workbench/telemetry/tensor_memory.py).

    python -m pytest -q tests/unit/test_tensor_memory.py
"""

from __future__ import annotations

import torch

from workbench.telemetry.tensor_memory import Window, storage_bytes

MiB = 2**20


def test_the_window_counts_what_is_alive_and_the_peak_inside_it_but_not_a_peak_before_it():
    before = torch.ones(96 * MiB, dtype=torch.uint8)  # a cold cache's conversion: big, then freed
    del before
    kept = torch.ones(32 * MiB, dtype=torch.uint8)  # the weights: alive through the window
    w = Window()
    w.start()
    alive = w.alive
    assert alive >= 32 * MiB
    inside = torch.ones(64 * MiB, dtype=torch.uint8)  # a step's activations
    del inside
    small = torch.ones(MiB, dtype=torch.uint8)
    peak = w.stop()
    # alive + the 64 MiB transient; the 1 MiB made after it is freed is below the peak. The
    # profiler's own allocations are a few KiB: 1 MiB of slack covers them.
    assert alive + 64 * MiB <= peak <= alive + 65 * MiB, (alive / MiB, peak / MiB)
    assert peak < alive + 96 * MiB  # the freed conversion is not in it
    del kept, small


def test_storage_bytes_counts_a_storage_once_and_skips_meta_tensors():
    t = torch.zeros(1024, dtype=torch.float32)
    view = t[:10]
    meta = torch.empty(10**9, device="meta")
    assert storage_bytes([t, view, meta]) == 4096
