"""Sequence parallelism (backend.sp, workbench/train/sequence_parallel.py) against whole rows.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_sequence_parallel.py
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -m slow tests/distributed/test_sequence_parallel.py

Default tier: the methods' own loss functions on rows of 2,048+ tokens at sp=2, loss and every
gradient element against sp=1 (tests/distributed/sp_cases.py), on two head layouts. Slow tier:
whole runs through each backend (single/DDP, FSDP2, DeepSpeed ZeRO-3) at sp=2 and at dp=2 x sp=2
on four processes, against backend=single on one process with the same global batch.

Tolerances (tests/tolerances.py): only the order of sums differs (the attention's softmax runs
over the same keys in another layout, the loss's per-row sums are completed by an all-reduce),
so losses agree to LOSS_RTOL and gradient elements to scale_atol.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import train
from tests.helpers import ROOT, close, ov, torchrun, worker_job, write_jsonl
from tests.tolerances import LOSS_RTOL

pytestmark = pytest.mark.distributed

CASES = ("sft_packed", "dpo", "orpo", "grpo_token", "grpo_sequence")


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp") / "parity.json"
    torchrun(ROOT / "tests" / "distributed" / "sp_cases.py", [out], timeout=300)
    return json.loads(out.read_text())


def test_sp2_losses_and_gradients_equal_whole_rows(parity):
    assert {k.split("/")[1] for k in parity} == set(CASES)
    for name, r in parity.items():
        assert r["tokens"] >= 2048, name
        assert r["loss"] == pytest.approx(r["whole_loss"], rel=LOSS_RTOL), name
        assert len(r["grads"]) >= 20, name  # every parameter of the 2-layer Llama
        for param, (diff, largest) in r["grads"].items():
            assert largest > 0, (name, param)
            assert diff <= LOSS_RTOL * largest, (name, param, diff, largest)  # scale_atol of the reference


# -- whole runs through each backend (slow tier) ------------------------------------------------
# Words of one token each in SmolLM2's tokenizer (the tiny model's): a prompt of N of them is N
# tokens plus the chat template's, so 2,040 words put every row past 2,048 tokens.
WORDS = ("river stone garden window silver morning paper yellow market quiet north island letter orange "
         "bridge winter candle forest music harbor").split()
LONG = 2040


def long_files(tmp) -> dict[str, str]:
    import random

    rng = random.Random(0)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(LONG))

    pairs = [{"prompt": text() + " Which word came first?", "chosen": rng.choice(WORDS),
              "rejected": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))} for _ in range(16)]
    prompts = [{"prompt": text() + " Name a word."} for _ in range(16)]
    return {"dpo": str(write_jsonl(tmp / "pairs.jsonl", pairs)), "grpo": str(write_jsonl(tmp / "prompts.jsonl", prompts))}


def runs_of(files: dict[str, str]) -> dict[str, list[str]]:
    """name -> overrides of one short run at >= 2,048 tokens a row (packed SFT, DPO, GRPO's pass)."""
    seq = "data.seq_len=2304"  # the prompts' 2,040 words and the template, within the model's 4,096 positions
    longer = "model.arch.max_position=4096"
    return {
        "sft": ["peft=none", "data.packing=true", "data.seq_len=2048", "train.micro_batch_size=1"],
        "dpo": ["method=dpo", "peft=lora", f"data.path={files['dpo']}", seq, longer, "train.micro_batch_size=2",
                "method.share_prompt=false"],
        "grpo": ["method=grpo", "peft=lora", f"data.path={files['grpo']}", seq, longer,
                 'reward.functions=["tests.rewards:char_length"]', "method.num_generations=4",
                 "method.dynamic_sampling=false", "method.max_new_tokens=8", "method.num_iterations=2",
                 "train.micro_batch_size=4"],
    }


def one_process(overrides: list[str], out) -> dict:
    losses = train(overrides, out)["losses"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"losses": losses, "grad_norms": [r["grad_norm"] for r in rows if "grad_norm" in r]}


# A backend's gradient norm is its own sum over its shards: at sp=1 FSDP2's and DeepSpeed's differ
# from backend=single's by up to 1.6e-5 of it (full fine-tuning of the tiny model), beyond
# LOSS_RTOL. So an sp=2 run's norms are held against the same backend at sp=1 on the same two
# processes (dp=2, the same global batch), which isolates the sequence split. GRPO at dp=2 draws
# its rollouts per data-parallel rank, another batch: its norms are held against the one-process
# run, which every backend's sp=2 run matches.
SAME_BATCH_AT_DP2 = ("sft", "dpo")
SP_BACKENDS = {"single": ["backend=single"], "fsdp2": ["backend=fsdp2"],
               "zero3": ["backend=deepspeed", "backend.stage=3"]}


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sp_runs")
    runs = runs_of(long_files(tmp))
    whole = {n: one_process([*ov(*o, steps=2), "train.grad_accum=2"], tmp / f"whole_{n}") for n, o in runs.items()}
    jobs = [{"name": f"{b}_{n}", "overrides": ov(*backend, "backend.sp=2", *o, "train.grad_accum=2", steps=2)}
            for b, backend in SP_BACKENDS.items() for n, o in runs.items()]
    # the same backend at sp=1 on the same two processes: dp=2, the same global batch
    jobs += [{"name": f"{b}_{n}_sp1", "overrides": ov(*backend, *runs[n], steps=2)}
             for b, backend in SP_BACKENDS.items() for n in SAME_BATCH_AT_DP2]
    two = worker_job(jobs, tmp / "sp2", timeout=1800)
    # dp=2 x sp=2 on four processes: each data-parallel rank takes one of the two micro-batches
    four = worker_job([{"name": f"dp2_{n}", "overrides": ov("backend=fsdp2", "backend.sp=2", *runs[n], steps=2)}
                       for n in ("sft", "dpo")], tmp / "dp2sp2", timeout=1800, procs=4)
    return whole, {**two, **four}


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(SP_BACKENDS))
@pytest.mark.parametrize("name", ["sft", "dpo", "grpo"])
def test_sp2_run_equals_one_process(long_runs, backend, name):
    whole, sharded = long_runs
    got = sharded[f"{backend}_{name}"]
    close(got["losses"], whole[name]["losses"])
    norms = sharded[f"{backend}_{name}_sp1"] if name in SAME_BATCH_AT_DP2 else whole[name]
    close(got["grad_norms"], norms["grad_norms"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sft", "dpo"])
def test_dp2_by_sp2_on_four_processes_equals_one_process(long_runs, name):
    whole, sharded = long_runs
    close(sharded[f"dp2_{name}"]["losses"], whole[name]["losses"])
    close(sharded[f"dp2_{name}"]["grad_norms"], sharded[f"fsdp2_{name}"]["grad_norms"])  # FSDP2, dp=1 x sp=2
