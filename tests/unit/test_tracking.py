"""Throughput arithmetic: the machine's matmul peak is measured once and then read back."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from workbench import tracking


def test_peak_flops_measured_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(tracking, "_PEAK", {})
    calls = []

    def fake_measure(device, dtype):
        calls.append((device, dtype))
        return 1.5e12

    monkeypatch.setattr(tracking, "matmul_flops", fake_measure)
    pol = SimpleNamespace(autocast_dtype=torch.bfloat16, trainable_dtype=torch.float32)
    assert tracking.measured_peak_flops("cpu", pol) == 1.5e12
    cached = json.loads((tmp_path / "peak_flops.json").read_text())
    assert list(cached.values()) == [1.5e12] and "bfloat16" in next(iter(cached))
    monkeypatch.setattr(tracking, "_PEAK", {})  # a new process: read from the file, no measurement
    assert tracking.measured_peak_flops("cpu", pol) == 1.5e12
    assert len(calls) == 1
    fp32 = SimpleNamespace(autocast_dtype=None, trainable_dtype=torch.float32)
    tracking.measured_peak_flops("cpu", fp32)  # another dtype is another entry
    assert len(calls) == 2 and len(json.loads((tmp_path / "peak_flops.json").read_text())) == 2


def test_matmul_measurement_is_positive():
    assert tracking.matmul_flops("cpu", torch.float32) > 1e8
