"""The plan check's CPU memory figure counts tensors, not the resident set
(workbench/plan/tensor_memory.py).

    python -m pytest -q tests/unit/test_tensor_memory.py
"""

from __future__ import annotations

import torch

from workbench.plan.tensor_memory import Window, alive_bytes, storage_bytes

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


def test_the_plan_checks_window_is_the_checks_own_step():
    from workbench.plan.check import Memory

    m = Memory("cpu", check_after=3, max_steps=5)
    base = alive_bytes()  # what the window will find alive: whatever earlier tests left
    sizes = {1: 128 * MiB, 3: 64 * MiB}  # step 2's peak is bigger but outside the window
    for done in range(5):
        m.before(done)
        t = torch.ones(sizes.get(done + 1, MiB), dtype=torch.uint8)
        del t
        m.after(done + 1)
        assert (m.window is not None) is False  # closed again after every step
    assert m.profiled == {3}
    assert base + 64 * MiB <= m.peak < base + 128 * MiB

    late = Memory("cpu", check_after=10, max_steps=5)  # no check in this run: nothing profiled
    for done in range(5):
        late.before(done)
        late.after(done + 1)
    assert late.profiled == set() and late.peak_gib() == 0.0


def test_tensors_built_before_a_frozen_collector_are_counted():
    """`python -m workbench` freezes the collector's objects at the start of training
    (workbench/core/startup.py); the weights are among them and must stay counted."""
    import gc

    weights = torch.ones(48 * MiB, dtype=torch.uint8)
    gc.freeze()
    try:
        w = Window()
        w.start()
        peak = w.stop()
        assert peak >= 48 * MiB and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    del weights
