"""Faults during a run: damaged checkpoints, a full disk, NaN losses, preemption signals.

Each test trains the tiny model (fp32, constant lr) in-process or as a subprocess, breaks
something, and checks that the run either recovers with the same per-step losses as an
uninterrupted run or stops with one clear message.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/integration/test_faults.py
"""

from __future__ import annotations

import errno

import pytest

from tests.conftest import train
from workbench.checkpoints import checkpoint

CKPT = ["train.checkpoint_every=2", "train.keep_checkpoints=3"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Per-step losses of an uninterrupted 4-step run."""
    return train([], tmp_path_factory.mktemp("baseline"))["losses"]


def _damaged_run(tmp_path, damage):
    """Train 4 steps (checkpoints at 2 and 4), damage step 4, run again: it must resume from 2."""
    out = tmp_path / "run"
    train(CKPT, out)
    step4 = checkpoint.ckpt_root(out) / "step-00000004"
    assert checkpoint.verify(step4) is None
    damage(step4)
    return train(CKPT, out)


def _tensor_file(step):
    """The checkpoint's (one-process) file of weights and optimizer state (workbench/checkpoints/canonical.py)."""
    return next((step / checkpoint.CANONICAL).glob("*.safetensors"))


def test_truncated_file_falls_back_to_the_previous_checkpoint(tmp_path, baseline, capsys):
    name = []

    def truncate(step):
        f = _tensor_file(step)
        name.append(str(f.relative_to(step)))
        f.write_bytes(f.read_bytes()[:100])

    res = _damaged_run(tmp_path, truncate)
    assert res["resumed_from"].endswith("step-00000002")
    assert res["losses"] == baseline[2:]  # exact: the same steps 3 and 4
    err = capsys.readouterr().err
    assert "resuming from step-00000002" in err and "step-00000004" in err and f"{name[0]} is truncated" in err


def test_missing_file_falls_back_to_the_previous_checkpoint(tmp_path, baseline, capsys):
    res = _damaged_run(tmp_path, lambda step: (step / "rng.pt").unlink())
    assert res["resumed_from"].endswith("step-00000002")
    assert res["losses"] == baseline[2:]
    assert "rng.pt is missing" in capsys.readouterr().err


def test_changed_bytes_are_caught_by_the_checksum(tmp_path):
    out = tmp_path / "run"
    train(["train.max_steps=2"], out)
    step = checkpoint.ckpt_root(out) / "step-00000002"
    f = step / "rng.pt"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    f.write_bytes(bytes(data))
    assert "rng.pt does not match its sha256" in checkpoint.verify(step)
    assert checkpoint.latest_valid(out) is None


def test_explicit_resume_path_that_does_not_verify_is_refused(tmp_path):
    from workbench.core.errors import UserError

    out = tmp_path / "run"
    train(["train.max_steps=2"], out)
    step = checkpoint.ckpt_root(out) / "step-00000002"
    (step / "files.json").unlink()
    with pytest.raises(UserError, match=r"train.resume=.*step-00000002: not a usable checkpoint "
                                         r"\(files.json is missing\)"):
        checkpoint.resume_point(out, str(step))


def test_disk_full_keeps_the_previous_checkpoint(tmp_path, baseline, monkeypatch):
    from torch.distributed.checkpoint import filesystem

    out = tmp_path / "run"
    real = filesystem._write_item

    def full_disk(transforms, stream, data, *a, **k):  # where DCP writes each tensor's bytes
        if "step-00000004" in str(getattr(stream, "name", "")):
            stream.write(b"\0" * 64)  # a partial file, as a full disk leaves it
            raise OSError(errno.ENOSPC, "No space left on device", stream.name)
        return real(transforms, stream, data, *a, **k)

    monkeypatch.setattr(filesystem, "_write_item", full_disk)
    with pytest.raises(checkpoint.CheckpointWriteError) as exc:
        train(CKPT, out)
    msg = str(exc.value)
    assert "step-00000004" in msg and "disk full" in msg and "step-00000002 is intact" in msg
    root = checkpoint.ckpt_root(out)
    assert not (root / "step-00000004.tmp").exists() and not (root / "step-00000004").exists()
    assert checkpoint.verify(root / "step-00000002") is None
    monkeypatch.setattr(filesystem, "_write_item", real)  # space is back: relaunch
    res = train(CKPT, out)
    assert res["resumed_from"].endswith("step-00000002") and res["losses"] == baseline[2:]


# -- numerical faults --------------------------------------------------------------------------
def test_nan_step_is_skipped_and_counted(tmp_path, baseline):
    import json
    import math

    res = train(["debug.nan_at_step=1", "train.max_bad_steps=1"], tmp_path)
    assert res["bad_steps"] == 1
    assert res["losses"][0] == baseline[0] and math.isnan(res["losses"][1])
    assert all(math.isfinite(x) for x in res["losses"][2:])  # the poisoned gradients never reached the weights
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("bad_step", 0) for r in rows] == [0, 1, 0, 0]


def test_nan_beyond_max_bad_steps_stops_naming_the_last_good_checkpoint(tmp_path):
    from workbench.guard.faults import NumericalFault

    with pytest.raises(NumericalFault, match=r"step 4: loss=nan; .*last good checkpoint is .*step-00000002"):
        train(["debug.nan_at_step=3", "train.checkpoint_every=2"], tmp_path)
    assert not (checkpoint.ckpt_root(tmp_path) / "step-00000004").exists()  # nothing written after the fault


@pytest.mark.slow
def test_fp16_overflow_is_left_to_the_loss_scaler(tmp_path):
    """fp16: the scaler skips the poisoned step itself; the guard neither counts nor stops.
    (slow: the first fp16 run on a CPU measures its fp16 matmul peak, minutes, then caches it)"""
    import math

    res = train(["precision=fp16", "debug.nan_at_step=1"], tmp_path)
    assert res["bad_steps"] == 0 and math.isnan(res["losses"][1])
    assert all(math.isfinite(x) for x in res["losses"][2:])


# -- preemption --------------------------------------------------------------------------------
def _launch(out, steps: int = 40, every: int = 20):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    cmd = [sys.executable, "-m", "workbench", "model=tiny", "precision=fp32", "eval=none", "train.export=false",
           f"train.max_steps={steps}", "train.micro_batch_size=4", "train.log_every=1000",
           f"train.checkpoint_every={every}", "optim.warmup_steps=0", "optim.scheduler=constant",
           f"output_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _losses(out) -> dict[int, float]:
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _signal_after(proc, out, n_rows: int, *signals):
    import time

    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n_rows:
            for sig in signals:
                proc.send_signal(sig)
            break
        time.sleep(0.02)
    return proc.communicate(timeout=120)


def test_sigterm_in_process_checkpoints_and_resumes_exactly(tmp_path, baseline, monkeypatch, capsys):
    """Fast variant: the signal arrives during step 2 (sent by the process to itself)."""
    import os
    import signal

    from workbench.guard import faults

    real_judge = faults.Guard.judge

    def judge(self, m, step, last_good):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode boundary, mid-step
        return real_judge(self, m, step, last_good)

    monkeypatch.setattr(faults.Guard, "judge", judge)
    out = tmp_path / "run"
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exc:
        train([], out)
    assert exc.value.code == faults.PREEMPTED_EXIT
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back
    assert "preempted at step 2" in capsys.readouterr().err
    assert checkpoint.latest_valid(out).name == "step-00000002"
    monkeypatch.setattr(faults.Guard, "judge", real_judge)
    res = train([], out)
    assert res["resumed_from"].endswith("step-00000002") and res["losses"] == baseline[2:]


@pytest.mark.slow
def test_sigterm_checkpoints_exits_75_and_resumes_exactly(tmp_path):
    """End to end, as a scheduler does it: three subprocess runs (about 45 s on 2 busy cores)."""
    import signal

    from workbench.guard.faults import PREEMPTED_EXIT

    full = _launch(tmp_path / "full")
    assert full.communicate(timeout=300) is not None and full.returncode == 0
    out = tmp_path / "run"
    proc = _launch(out)
    _, err = _signal_after(proc, out, 5, signal.SIGTERM)
    assert proc.returncode == PREEMPTED_EXIT, err[-2000:]
    assert "SIGTERM: finishing this step" in err and "preempted at step" in err
    stopped = max(_losses(out))
    assert 5 <= stopped < 40  # stopped mid-run, not at the end
    assert checkpoint.latest_valid(out).name == f"step-{stopped:08d}"
    again = _launch(out)
    assert again.communicate(timeout=300) is not None and again.returncode == 0
    assert _losses(out) == _losses(tmp_path / "full")  # every step's loss, exactly


def test_second_signal_exits_at_once(tmp_path):
    import signal

    out = tmp_path / "run"
    proc = _launch(out)
    # two different signals: the same one sent twice at once may be delivered once (POSIX merges them)
    _, err = _signal_after(proc, out, 3, signal.SIGINT, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "exiting at once" in err


@pytest.mark.slow
def test_kill9_at_20_random_points_resumes_exactly(tmp_path):
    """kill -9 a tiny run (a checkpoint every step) 20 times, half of them while a checkpoint is
    being written; relaunch each time; every step's loss equals the uninterrupted run's."""
    import json
    import random
    import signal
    import time

    steps, rng = 60, random.Random(0)
    full = _launch(tmp_path / "full", steps, 1)
    assert full.communicate(timeout=600) is not None and full.returncode == 0
    want = _losses(tmp_path / "full")
    out, kills, in_save = tmp_path / "run", 0, 0
    root = checkpoint.ckpt_root(out)
    launches = 0
    while launches < 60:
        launches += 1
        metrics = out / "metrics.jsonl"
        seen = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        proc = _launch(out, steps, 1)
        if kills < 20:
            while proc.poll() is None and (not metrics.exists() or len(metrics.read_text().splitlines()) <= seen):
                time.sleep(0.01)  # wait for this launch's first step: startup is not the point
            during_save = kills % 2 == 0
            deadline = time.time() + (2.0 if during_save else rng.uniform(0.0, 0.4))
            while proc.poll() is None and time.time() < deadline:
                if during_save and any(p.name.endswith(".tmp") for p in root.glob("step-*")):
                    break
                time.sleep(0.001 if during_save else 0.005)
            if proc.poll() is None:
                caught = any(p.name.endswith(".tmp") for p in root.glob("step-*"))
                proc.send_signal(signal.SIGKILL)
                proc.communicate()
                kills += 1
                in_save += caught
                continue
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
        break
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert kills == 20 and in_save >= 5, (kills, in_save)
    for r in rows:  # a step re-run after a kill logs again: every copy equals the uninterrupted loss
        assert r["loss"] == want[r["step"]], r["step"]
    assert sorted({r["step"] for r in rows}) == list(range(1, steps + 1))
    print(f"kill -9: {kills} kills, {in_save} during a checkpoint write, {launches} launches")
