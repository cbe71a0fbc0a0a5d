"""Every method beyond SFT, DPO and GRPO under FSDP2 and DeepSpeed ZeRO-3 with 2 gloo ranks, against
backend=single with the same global batch.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_methods_backends.py

Each backend's runs share one torchrun job (tests/helpers.py `worker_job`). The
single-process references accumulate two micro-batches, which the two ranks hold one each, so the
runs differ only in the order of the gradient reductions: losses agree to LOSS_RTOL
(tests/tolerances.py). The policy-gradient variants generate on each rank with that rank's own
sampling stream, so their reference is ZeRO-2 with 2 ranks (whole weights on every rank, as in
tests/distributed/test_backends.py's GRPO test), and their losses, signed means near zero, also
agree to NEAR_ZERO_ATOL. Two steps each, so the second loss sees the first update.
"""

from __future__ import annotations

import pytest

from tests.conftest import train
from tests.helpers import close, ov, worker_job

# The slow tier: 18 runs in two torchrun jobs (about 4 min on 2 cores). The default tier trains
# SFT, DPO and GRPO on these backends (tests/distributed/test_backends.py).
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CHAR_LENGTH = 'reward.functions=["tests.rewards:char_length"]'
PG_SHAPE = ["method.num_generations=4", "method.dynamic_sampling=false", CHAR_LENGTH]

# name -> overrides (LoRA: the methods with a reference use the adapter-free base, which shards)
METHODS: dict[str, list[str]] = {
    "rm": ["method=rm"],
    "kto": ["method=kto"],
    "cpo": ["method=cpo"],
    "simpo": ["method=simpo"],
    "orpo": ["method=orpo"],
    "gspo": ["method=gspo", *PG_SHAPE],
    "rloo": ["method=rloo", *PG_SHAPE],
    "distill": ["method=distill", "method.lmbda=0.0"],
}
BACKENDS = {"f": ["backend=fsdp2"], "z3": ["backend=deepspeed", "backend.stage=3"]}
GENERATES = ("gspo", "rloo")


def overrides(name: str, teacher) -> list[str]:
    extra = [f"method.teacher={teacher}"] if name == "distill" else []
    return [*METHODS[name], *extra, "peft=lora"]


@pytest.fixture(scope="module")
def single(tmp_path_factory, teacher):
    out = tmp_path_factory.mktemp("single_methods")
    return {n: train([*ov(*overrides(n, teacher), steps=2), "train.grad_accum=2"], out / n)["losses"]
            for n in METHODS if n not in GENERATES}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, teacher):
    runs = [{"name": f"{tag}_{n}", "overrides": ov(*backend, *overrides(n, teacher), steps=2)}
            for tag, backend in BACKENDS.items() for n in METHODS]
    runs += [{"name": f"z2_{n}", "overrides": ov("backend=deepspeed", "backend.stage=2", *overrides(n, teacher), steps=2)}
             for n in GENERATES]
    return worker_job(runs, tmp_path_factory.mktemp("sharded_methods"), timeout=1500)


@pytest.mark.parametrize("tag", sorted(BACKENDS))
@pytest.mark.parametrize("name", sorted(METHODS))
def test_method_under_sharding_equals_single(sharded, single, name, tag):
    want = sharded[f"z2_{name}"]["losses"] if name in GENERATES else single[name]
    close(sharded[f"{tag}_{name}"]["losses"], want)
