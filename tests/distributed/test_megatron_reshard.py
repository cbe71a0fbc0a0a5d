"""A backend=megatron checkpoint written at tp=2, pp=2 resumes at tp=1, pp=4 and at tp=4, pp=1 and
continues with the uninterrupted run's losses (4 CPU processes, gloo).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -m slow tests/distributed/test_megatron_reshard.py

One 4-rank torchrun job (tests/helpers.py worker_job) runs the tp=2 x pp=2 run for 4 steps with a
checkpoint at step 2, then the two resumed runs from that checkpoint. The checkpoint is the
canonical one (Hugging Face names through DCP, workbench/checkpoints/canonical.py): every rank reads
the whole HF tensors of its stage and cuts its own shards of the weights and of the Adam moments
through the bridge (workbench/backends/megatron.py load_canonical).

AdamW, so the moments matter: a resumed run that dropped them would take a first Adam step
(lr * sign(g) for every weight) at step 3 instead of the uninterrupted run's, and its step-4
loss would differ by far more than LOSS_RTOL at lr 1e-2. The losses of the resumed steps agree
to LOSS_RTOL (another summation order, tests/tolerances.py): a weight whose gradient is near 0
may move differently under AdamW, but such weights change the loss by about their gradient
times that move, orders below it.
"""

from __future__ import annotations

import pytest

from tests.helpers import worker_job
from tests.tolerances import LOSS_RTOL

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # 3 runs on 4 ranks, ~8 min on 2 cores

# 4 layers and 4 KV heads: tp=4 splits the heads, pp=4 the layers
BASE = ["peft=none", "model.arch.layers=4", "model.arch.kv_heads=4", "optim.name=adamw", "optim.lr=1e-2",
        "train.micro_batch_size=2", "train.grad_accum=2", "train.checkpoint_every=2", "train.keep_checkpoints=3",
        "backend=megatron", "++hardware.timeout_minutes=10"]


def test_tp2pp2_checkpoint_resumes_at_tp1pp4_and_tp4(tmp_path):
    out = tmp_path / "job"
    step2 = out / "full" / "checkpoints" / "step-00000002"
    resumed = ["train.max_steps=4", f"train.resume={step2}"]
    runs = [{"name": "full", "overrides": [*BASE, "backend.tp=2", "backend.pp=2", "train.max_steps=4"]},
            {"name": "tp1pp4", "overrides": [*BASE, "backend.tp=1", "backend.pp=4", *resumed]},
            {"name": "tp4pp1", "overrides": [*BASE, "backend.tp=4", "backend.pp=1", *resumed]}]
    got = worker_job(runs, out, timeout=2400, procs=4)
    full = got["full"]["losses"]
    assert len(full) == 4 and full[-1] < full[0]
    for name in ("tp1pp4", "tp4pp1"):
        assert got[name]["resumed_from"] == str(step2), got[name]["resumed_from"]
        diff = max(abs(a - b) / abs(b) for a, b in zip(got[name]["losses"], full[2:]))
        print(f"{name}: resumed losses {got[name]['losses']} vs uninterrupted {full[2:]}, rel diff {diff:.2e}")
        assert got[name]["losses"] == pytest.approx(full[2:], rel=LOSS_RTOL), name


# LoRA and the distributed optimizer write the same canonical format: adapters whole under PEFT's
# names (so backend=single reads them as its own), the distributed optimizer its fp32 main weights
# and moments, gathered from their data-parallel shards.
MOVES = ["model.arch.layers=2", "optim.name=adamw", "optim.lr=1e-2", "train.micro_batch_size=2",
         "train.checkpoint_every=2", "train.keep_checkpoints=3", "++hardware.timeout_minutes=10"]
LORA = ["peft=lora", "peft.r=4", "peft.alpha=8"]


def test_lora_and_distributed_optimizer_checkpoints_move(tmp_path):
    out = tmp_path / "job"

    def step2(name):
        return f"train.resume={out / name / 'checkpoints' / 'step-00000002'}"

    runs = [{"name": "lora-tp2", "overrides": [*MOVES, *LORA, "backend=megatron", "backend.tp=2",
                                               "train.grad_accum=2", "train.max_steps=4"]},
            {"name": "lora-tp1", "overrides": [*MOVES, *LORA, "backend=megatron", "train.grad_accum=1",
                                               "train.max_steps=4", step2("lora-tp2")]},
            {"name": "lora-single", "overrides": [*MOVES, *LORA, "backend=single", "train.grad_accum=1",
                                                  "train.max_steps=4", step2("lora-tp2")]},
            {"name": "distopt-dp2", "overrides": [*MOVES, "peft=none", "optim.max_grad_norm=0", "backend=megatron",
                                                  "backend.distributed_optimizer=true", "train.grad_accum=1",
                                                  "train.max_steps=4"]},
            {"name": "distopt-tp2", "overrides": [*MOVES, "peft=none", "optim.max_grad_norm=0", "backend=megatron",
                                                  "backend.tp=2", "train.grad_accum=2", "train.max_steps=4",
                                                  step2("distopt-dp2")]}]
    got = worker_job(runs, out, timeout=2400, procs=2)
    for source, movers in (("lora-tp2", ("lora-tp1", "lora-single")), ("distopt-dp2", ("distopt-tp2",))):
        full = got[source]["losses"]
        assert len(full) == 4 and full[-1] < full[0], (source, full)
        for name in movers:
            assert got[name]["resumed_from"].endswith("step-00000002"), got[name]["resumed_from"]
            diff = max(abs(a - b) / abs(b) for a, b in zip(got[name]["losses"], full[2:]))
            print(f"{source} -> {name}: resumed {got[name]['losses']} vs uninterrupted {full[2:]}, rel diff {diff:.2e}")
            assert got[name]["losses"] == pytest.approx(full[2:], rel=LOSS_RTOL), name
