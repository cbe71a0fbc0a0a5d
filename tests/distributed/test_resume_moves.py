"""Resume anywhere: a checkpoint written by one backend and world size continues under another, on
CPU with gloo and at most 2 ranks, and the resumed run's per-step losses equal the uninterrupted
run's on the source layout.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_resume_moves.py              # 3 moves + GRPO
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -m "slow or not slow" tests/distributed/test_resume_moves.py

Every writer trains 4 steps with a checkpoint at step 2 (its curve is the uninterrupted run); every
reader resumes that step-2 checkpoint (`train.resume=<dir>`) into its own directory under another
layout and trains steps 3 and 4. The global batch is 4 rows everywhere (2 per micro-batch; the
reader's grad_accum is recomputed from the checkpoint), so the resumed losses must equal the
source's at LOSS_RTOL (tests/tolerances.py: only the order of reductions differs). Megatron moves
use SGD, as tests/distributed/test_megatron_train.py does: under AdamW a last-bit difference of a
tensor-parallel sum is amplified by up to lr/eps and no bound from the arithmetic holds.
Every resumed run's manifest.json must carry a passing replay certificate, and re-saving a loaded
checkpoint under another layout must give back the same tensors bit for bit.

WB_MOVES_OUT=<file.json> appends each move's numbers there (the README's moves table).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import train
from tests.helpers import worker_job
from tests.tolerances import LOSS_RTOL, NEAR_ZERO_ATOL
from workbench.checkpoints import checkpoint
from workbench.checkpoints.canonical import read_all

pytestmark = pytest.mark.distributed
ADAM = ["peft=none", "train.micro_batch_size=2", "optim.lr=1e-3", "++hardware.timeout_minutes=4"]
LORA = ["peft=lora", "train.micro_batch_size=2", "optim.lr=1e-3", "++hardware.timeout_minutes=4"]
SGD = ["peft=none", "train.micro_batch_size=2", "optim.name=sgd", "optim.lr=0.1", "++hardware.timeout_minutes=4"]
WRITE = ["train.max_steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=2"]
F2, Z1, Z2, Z3 = (["backend=fsdp2"], ["backend=deepspeed", "backend.stage=1"], ["backend=deepspeed", "backend.stage=2"],
                  ["backend=deepspeed", "backend.stage=3"])
M2 = ["backend=megatron", "backend.tp=2"]
ONE_RANK = ["train.grad_accum=2"]  # a 1-rank (or TP-only) writer's 4-row global batch
# LoRA dropout at a learning rate where the adapters move the loss (dropout 0.1 changes step 3's
# loss by 1% here), so masks that differed between layouts would show far above LOSS_RTOL
DROPOUT = ["peft=lora", "peft.dropout=0.1", "train.micro_batch_size=2", "optim.lr=2e-2", "train.max_steps=3",
           "++hardware.timeout_minutes=4"]
GRPO = ["method=grpo", "peft=none", 'reward.functions=["tests.unit.test_rewards:char_length"]',
        "method.num_generations=4", "method.dynamic_sampling=false", "train.micro_batch_size=4", "train.grad_accum=1",
        "method.log_completions=8", "++hardware.timeout_minutes=4"]


def step2(run_dir: Path) -> str:
    return f"train.resume={checkpoint.ckpt_root(run_dir) / 'step-00000002'}"


def writer(name: str, *overrides: str) -> dict:
    return {"name": name, "overrides": [*overrides, *WRITE]}


def reader(name: str, source: Path, *overrides: str, steps: int = 4) -> dict:
    return {"name": name, "overrides": [*overrides, f"train.max_steps={steps}", step2(source)]}


# -- the runs -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def single_writer(tmp_path_factory):
    out = tmp_path_factory.mktemp("single_writer")
    return out, train([*ADAM, *ONE_RANK, *WRITE], out)["losses"]


@pytest.fixture(scope="module")
def job(tmp_path_factory, single_writer):
    """One torchrun job: the 2-rank writers, the default tier's 2-rank readers, GRPO's writer."""
    out = tmp_path_factory.mktemp("moves")
    runs = [writer("f2", *ADAM, *F2), writer("z2", *ADAM, *Z2),
            reader("z3_from_single", single_writer[0], *ADAM, *Z3),
            reader("f2_from_z2", out / "z2", *ADAM, *F2),
            {"name": "grpo_ddp2", "overrides": [*GRPO, "train.max_steps=3", "train.checkpoint_every=2"]}]
    return out, worker_job(runs, out, timeout=1200)


@pytest.fixture(scope="module")
def bf16_writer(tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16_writer")
    return out, train([*ADAM, *ONE_RANK, *WRITE, "precision=bf16-mixed"], out)["losses"]


@pytest.fixture(scope="module")
def slow_job(tmp_path_factory, job, bf16_writer):
    """The slow tier's 2-rank runs: more writers (ZeRO-3, LoRA) and readers, dropout under DDP."""
    out = tmp_path_factory.mktemp("moves_slow")
    src = job[0]
    runs = [writer("z3", *ADAM, *Z3), writer("f2_lora", *LORA, *F2), writer("z3_lora", *LORA, *Z3),
            reader("f2_lora_from_z3_lora", out / "z3_lora", *LORA, *F2),
            reader("z1_from_f2", src / "f2", *ADAM, *Z1),
            reader("f2_resave_from_z2", src / "z2", *ADAM, *F2, steps=2),
            reader("f2_bf16_from_single_bf16", bf16_writer[0], *ADAM, *F2, "precision=bf16-mixed", steps=2),
            {"name": "ddp_dropout", "overrides": DROPOUT}]
    return out, worker_job(runs, out, timeout=1500)


@pytest.fixture(scope="module")
def megatron_job(tmp_path_factory):
    """Megatron's parallel state is process-wide: its runs (tp=2) get a job of their own."""
    pytest.importorskip("megatron.core")
    out = tmp_path_factory.mktemp("moves_megatron")
    runs = [writer("f2_sgd", *SGD, *F2), writer("m2", *SGD, *M2, *ONE_RANK),
            reader("m2_from_f2", out / "f2_sgd", *SGD, *M2),
            reader("z3_from_m2", out / "m2", *SGD, *Z3)]
    return out, worker_job(runs, out, timeout=1500)


@pytest.fixture(scope="module")
def megatron_pp_job(tmp_path_factory, megatron_job):
    """Pipeline stages (pp=2) read the FSDP2 writer's checkpoint, and write it again stage by stage."""
    out = tmp_path_factory.mktemp("moves_megatron_pp")
    src = megatron_job[0] / "f2_sgd"
    pp = ["backend=megatron", "backend.pp=2"]
    runs = [reader("pp2_from_f2", src, *SGD, *pp), reader("pp2_resave_from_f2", src, *SGD, *pp, steps=2)]
    return out, worker_job(runs, out, timeout=1500)


# -- the checks ---------------------------------------------------------------------------------
def certified(run_dir: Path, source: str, target: str) -> dict:
    cert = json.loads((run_dir / "manifest.json").read_text())["resume"]["certificate"]
    assert (cert["from"], cert["to"], cert["ok"]) == (source, target, True), cert
    return cert


def moved(pair: str, source: list[float], resumed: list[float], run_dir: Path, rtol: float = LOSS_RTOL) -> None:
    """Steps 3 and 4 after the move against the source's uninterrupted steps 3 and 4."""
    want = source[2:]
    assert len(resumed) == len(want) == 2, (resumed, want)
    rel = max(abs(a - b) / abs(b) for a, b in zip(resumed, want))
    assert rel <= rtol, (pair, resumed, want)
    src, dst = (side.replace(" (lora)", "") for side in pair.split(" -> "))
    cert = certified(run_dir, src, dst)
    if os.environ.get("WB_MOVES_OUT"):
        with open(os.environ["WB_MOVES_OUT"], "a") as fh:
            fh.write(json.dumps({"pair": pair, "source": want, "resumed": resumed, "max_rel_diff": rel,
                                 "tolerance": rtol, "certificate_rel_diff": cert["rel_diff"]}) + "\n")


def same_tensors(a: Path, b: Path) -> None:
    """Two checkpoints' canonical tensors, bit for bit."""
    x, y = (read_all(checkpoint.ckpt_root(d) / "step-00000002" / checkpoint.CANONICAL) for d in (a, b))
    assert sorted(x) == sorted(y) and x
    assert [k for k in x if not torch.equal(x[k], y[k])] == []


def _losses(res: dict, name: str) -> list[float]:
    return res[name]["losses"]


# default tier: three moves, GRPO's completions, one bitwise round trip
def test_fsdp2x2_to_single(job, tmp_path):
    """The move of the issue: a 2-rank FSDP2 run continued with backend=single on one process."""
    src, res = job
    out = tmp_path / "single"
    resumed = train([*ADAM, "train.max_steps=4", step2(src / "f2")], out)["losses"]
    moved("fsdp2x2 -> single", _losses(res, "f2"), resumed, out)
    again = tmp_path / "resave"  # loaded and written again on one process: the same tensors
    train([*ADAM, "train.max_steps=2", step2(src / "f2")], again)
    same_tensors(src / "f2", again)


def test_single_to_zero3x2(job, single_writer):
    src, res = job
    moved("single -> zero3x2", single_writer[1], _losses(res, "z3_from_single"), src / "z3_from_single")


def test_zero2x2_to_fsdp2x2(job):
    src, res = job
    moved("zero2x2 -> fsdp2x2", _losses(res, "z2"), _losses(res, "f2_from_z2"), src / "f2_from_z2")


def test_grpo_moved_from_2_ranks_to_1_samples_the_same_completions(job, tmp_path):
    """Keyed sampling noise (workbench/train/noise.py): step 3 on one process samples the
    completions the 2-rank run sampled at step 3 (rank 0 logs its 4, the first prompt's)."""
    src, res = job
    out = tmp_path / "grpo1"
    resumed = train([*GRPO, "train.max_steps=3", step2(src / "grpo_ddp2")], out)
    two = [json.loads(x) for x in (src / "grpo_ddp2" / "samples" / "grpo.jsonl").read_text().splitlines()]
    one = [json.loads(x) for x in (out / "samples" / "grpo.jsonl").read_text().splitlines()]
    assert len(two) == 12 and len(one) == 8  # 3 rollouts x rank 0's 4; 1 rollout x all 8
    assert one[:4] == two[8:12]  # prompt, completion and reward; the process's generator would not repeat them
    assert resumed["losses"] == pytest.approx(_losses(res, "grpo_ddp2")[2:], rel=LOSS_RTOL, abs=NEAR_ZERO_ATOL)
    certified(out, "ddp x2", "single")


# slow tier: the other moves (every backend as source and target), LoRA, bitwise round trips
@pytest.mark.slow
def test_zero3x2_to_single(slow_job, tmp_path):
    src, res = slow_job
    out = tmp_path / "single"
    moved("zero3x2 -> single", _losses(res, "z3"), train([*ADAM, "train.max_steps=4", step2(src / "z3")], out)["losses"],
          out)


@pytest.mark.slow
def test_fsdp2x2_to_zero1x2(job, slow_job):
    src, res = slow_job
    moved("fsdp2x2 -> zero1x2", _losses(job[1], "f2"), _losses(res, "z1_from_f2"), src / "z1_from_f2")


@pytest.mark.slow
def test_zero2x2_to_fsdp2x2_gives_back_the_same_tensors(job, slow_job):
    same_tensors(job[0] / "z2", slow_job[0] / "f2_resave_from_z2")


@pytest.mark.slow
def test_bf16_certificate_across_layouts(slow_job):
    """bf16 autocast on one process against FSDP2's bf16 parameters on 2: the probe agrees within
    the bf16 bound (workbench/checkpoints/replay.py RTOL_HALF)."""
    cert = certified(slow_job[0] / "f2_bf16_from_single_bf16", "single", "fsdp2x2")
    assert cert["tolerance"] == 2.0**-6
    if os.environ.get("WB_MOVES_OUT"):
        with open(os.environ["WB_MOVES_OUT"], "a") as fh:
            fh.write(json.dumps({"pair": "single -> fsdp2x2 (bf16-mixed, certificate only)",
                                 "certificate_rel_diff": cert["rel_diff"], "tolerance": cert["tolerance"]}) + "\n")


@pytest.mark.slow
def test_dropout_masks_do_not_depend_on_the_world_size(slow_job, tmp_path):
    """LoRA dropout 0.1: 2 DDP ranks and 1 process with grad_accum=2 draw the same masks
    (each micro-batch seeds the generator from its first row's global sample index)."""
    one = train([*DROPOUT, "train.grad_accum=2"], tmp_path)["losses"]
    assert _losses(slow_job[1], "ddp_dropout") == pytest.approx(one, rel=LOSS_RTOL)


@pytest.mark.slow
def test_lora_fsdp2x2_to_single(slow_job, tmp_path):
    src, res = slow_job
    out = tmp_path / "single"
    resumed = train([*LORA, "train.max_steps=4", step2(src / "f2_lora")], out)["losses"]
    moved("fsdp2x2 (lora) -> single", _losses(res, "f2_lora"), resumed, out)


@pytest.mark.slow
def test_lora_zero3x2_to_fsdp2x2(slow_job):
    src, res = slow_job
    moved("zero3x2 (lora) -> fsdp2x2", _losses(res, "z3_lora"), _losses(res, "f2_lora_from_z3_lora"),
          src / "f2_lora_from_z3_lora")


@pytest.mark.slow
def test_fsdp2x2_to_megatron_tp2(megatron_job):
    src, res = megatron_job
    moved("fsdp2x2 -> megatron tp2", _losses(res, "f2_sgd"), _losses(res, "m2_from_f2"), src / "m2_from_f2")


@pytest.mark.slow
def test_megatron_tp2_to_single(megatron_job, tmp_path):
    src, res = megatron_job
    out = tmp_path / "single"
    resumed = train([*SGD, "train.max_steps=4", step2(src / "m2")], out)["losses"]
    moved("megatron tp2 -> single", _losses(res, "m2"), resumed, out)


@pytest.mark.slow
def test_megatron_tp2_to_zero3x2(megatron_job):
    src, res = megatron_job
    moved("megatron tp2 -> zero3x2", _losses(res, "m2"), _losses(res, "z3_from_m2"), src / "z3_from_m2")


@pytest.mark.slow
def test_fsdp2x2_to_megatron_pp2_and_back_bit_for_bit(megatron_job, megatron_pp_job):
    src, res = megatron_pp_job
    moved("fsdp2x2 -> megatron pp2", _losses(megatron_job[1], "f2_sgd"), _losses(res, "pp2_from_f2"),
          src / "pp2_from_f2")
    same_tensors(megatron_job[0] / "f2_sgd", src / "pp2_resave_from_f2")  # each stage wrote its own layers


@pytest.mark.slow
def test_kill9_fsdp2x2_resumed_on_one_process(tmp_path):
    """kill -9 of every process of a 2-rank FSDP2 run (the launcher and both workers) once step 3's
    checkpoint is committed; relaunched with backend=single on one process, it finishes with the
    uninterrupted 2-rank run's losses."""
    import time

    from tests.conftest import TINY
    from tests.helpers import finish, workbench
    from tests.helpers import logged_losses as losses

    run = [*TINY, *ADAM, "train.max_steps=8", "train.checkpoint_every=1", "train.keep_checkpoints=2"]
    full = tmp_path / "full"
    finish(workbench([*run, *F2, "hardware.procs=2", f"output_dir={full}"]))
    out = tmp_path / "run"
    proc = workbench([*run, *F2, "hardware.procs=2", f"output_dir={out}"])
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        latest = checkpoint.latest_valid(out) if (checkpoint.ckpt_root(out) / "latest").exists() else None
        if latest is not None and int(latest.name.split("-")[1]) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    killed = _kill9(out)
    proc.communicate()
    assert killed >= 3 and len(losses(out)) < 8  # the launcher and 2 workers, mid-run
    finish(workbench([*run, "backend=single", "hardware.procs=1", f"output_dir={out}"]))
    assert losses(out) == pytest.approx(losses(full), rel=LOSS_RTOL)
    man = json.loads((out / "manifest.json").read_text())
    assert man["resume"]["certificate"]["ok"] and man["resume"]["certificate"]["from"] == "fsdp2x2"
    shutil.rmtree(full, ignore_errors=True)


def _kill9(out: Path) -> int:
    """SIGKILL every process whose command line names this output_dir; how many there were."""
    import signal

    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if f"output_dir={out}".encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)
