"""The peak behind MFU: a datasheet figure where the hardware profile has one, else a matmul
measured once per machine, kept, and measured again when the kept value is implausible."""

from __future__ import annotations

import json

import pytest
import torch

from workbench.compute import precision
from workbench.plan import peak as tracking

BF16 = precision.spec("bf16-mixed")
FP32 = precision.spec("fp32")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """matmul_flops replaced: `speed["now"]` is what the machine does, calls are recorded."""
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(tracking, "_PEAK", {})
    state = {"now": 1.5e12, "calls": []}

    def measure(device, dtype, trials=5, seconds=0.1):
        state["calls"].append((dtype, trials))
        return state["now"]

    monkeypatch.setattr(tracking, "matmul_flops", measure)
    return state


def _full(calls):
    return [c for c in calls if c[1] > 1]  # the quick plausibility check is one trial


def test_peak_measured_once_per_machine_then_read_back(fake, tmp_path, monkeypatch):
    assert tracking.measured_peak_flops("cpu", BF16) == 1.5e12
    cached = json.loads((tmp_path / "peak_flops.json").read_text())
    assert list(cached.values()) == [1.5e12] and "bfloat16" in next(iter(cached))
    monkeypatch.setattr(tracking, "_PEAK", {})  # a new process: read from the file
    assert tracking.measured_peak_flops("cpu", BF16) == 1.5e12
    assert len(_full(fake["calls"])) == 1
    tracking.measured_peak_flops("cpu", FP32)  # another dtype is another entry
    assert len(_full(fake["calls"])) == 2 and len(json.loads((tmp_path / "peak_flops.json").read_text())) == 2


def test_a_peak_kept_from_a_busy_machine_is_measured_again(fake, tmp_path, monkeypatch):
    key = f"{tracking.device_name('cpu')}|torch.bfloat16|{torch.get_num_threads()}"
    (tmp_path / "peak_flops.json").write_text(json.dumps({key: 2e10}))  # measured while the cores were busy
    assert tracking.measured_peak_flops("cpu", BF16) == 1.5e12
    assert json.loads((tmp_path / "peak_flops.json").read_text())[key] == 1.5e12


def test_a_peak_below_its_fewer_thread_entry_is_measured_again(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    name = tracking.device_name("cpu")
    # the cache: 37.6 GFLOP/s on 2 threads below the 1-thread entry's 64 GFLOP/s
    (tmp_path / "peak_flops.json").write_text(json.dumps({f"{name}|torch.float32|2": 3.76e10,
                                                          f"{name}|torch.float32|1": 6.4e10}))
    fake["now"] = 3e10  # and the machine is busy right now too: the quick check alone would pass it
    fake_full = {"n": 0}

    def measure(device, dtype, trials=5, seconds=0.1):
        fake_full["n"] += trials > 1
        return 1.2e11 if trials > 1 else 3e10

    monkeypatch.setattr(tracking, "matmul_flops", measure)
    assert tracking.measured_peak_flops("cpu", FP32) == 1.2e11
    assert fake_full["n"] == 1


def test_datasheet_peak_wins_where_the_profile_has_one(fake):
    from workbench.config.files import load_group_file

    h200 = load_group_file("hardware", "h200")
    peak, source = tracking.peak_flops(h200, BF16, "cuda")
    assert peak == 989e12 and "datasheet" in source and fake["calls"] == []
    assert tracking.peak_flops(h200, precision.spec("fp8"), "cuda")[0] == 1979e12
    cpu = load_group_file("hardware", "cpu")
    assert tracking.peak_flops(cpu, BF16, "cpu") == (1.5e12, "measured matmul")


def test_matmul_measurement_is_best_of_several_trials():
    quick = tracking.matmul_flops("cpu", torch.float32, trials=1, seconds=0.01)
    assert quick > 1e8


@pytest.mark.parametrize("limit, sizes", [(1e9, [256, 1024, 2048]), (1e-9, [256])])
def test_sizes_whose_product_would_take_too_long_are_skipped(monkeypatch, limit, sizes):
    """bf16 on a CPU without native bf16 multiplies several times slower than fp32: the
    measurement stops growing the size once the rate so far predicts a product over
    MAX_PRODUCT_SECONDS, instead of spending minutes on five trials of it."""
    made, randn = [], torch.randn

    def recording(*shape, **kw):
        made.append(shape[0])
        return randn(*shape, **kw)

    monkeypatch.setattr(torch, "randn", recording)
    monkeypatch.setattr(tracking, "MAX_PRODUCT_SECONDS", limit)
    assert tracking.matmul_flops("cpu", torch.float32, trials=2, seconds=0.001) > 0
    assert made[::2] == sizes  # two operands per size
