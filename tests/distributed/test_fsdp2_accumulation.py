"""backend=fsdp2 accumulating gradients over micro-batches, against backend=single.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_fsdp2_accumulation.py

Two ranks, train.grad_accum=2, a full fine-tune: with backend.sync_each_micro_batch=auto (a
reduce-scatter after every micro-batch, the shards summed: workbench/backends/spec.py) and false
(the whole gradient summed on each rank, one reduce-scatter); one process at grad_accum=4 sees
the same global batch. Only the order of the gradient sums differs, so the losses agree to
LOSS_RTOL (tests/tolerances.py), as in tests/distributed/test_backends.py.
"""

from __future__ import annotations

import pytest

from tests.conftest import train
from tests.helpers import close, ov, worker_job

pytestmark = pytest.mark.distributed

FULL = ("backend=fsdp2", "peft=none", "train.grad_accum=2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2_accum")
    two = worker_job([{"name": f"sync_{v}", "overrides": ov(*FULL, f"backend.sync_each_micro_batch={v}")}
                      for v in ("auto", "false")], out / "fsdp2")
    one = train([*ov("peft=none"), "train.grad_accum=4"], out / "single")
    return two, one["losses"]


@pytest.mark.parametrize("sync", ["auto", "false"])
def test_fsdp2_accumulation_equals_single(runs, sync):
    two, single = runs
    close(two[f"sync_{sync}"]["losses"], single)
    assert two[f"sync_{sync}"]["rank1"]["losses"] == two[f"sync_{sync}"]["losses"]
