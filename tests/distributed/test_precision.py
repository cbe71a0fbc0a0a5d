"""The precision matrix (tests/precision_matrix.py): each cell trains two steps with the losses of
backend=single at the same precision, within the precision's tolerance (tests/tolerances.py), or
is refused by a named rule before weights load.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -m slow tests/distributed/test_precision.py -k default_share
    .venv/bin/python scripts/precision_matrix.py    # the whole matrix (slow tier) -> docs/precision-matrix.md

The slow tier runs DEFAULT (every backend, sp=2 included, under bf16-mixed for SFT with and
without LoRA, DPO and GRPO on Megatron, FSDP2 and sp=2) in two torchrun jobs (Megatron's, and the
rest's), and every method x backend x precision x peft, one job per backend (sequence
parallelism is in DEFAULT only). With WORKBENCH_MATRIX_JSON
set, the slow tier also writes every cell's verdict and losses there (scripts/precision_matrix.py
renders the docs from it).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.precision_matrix import DEFAULT, cells, classify, compare, run

pytestmark = pytest.mark.distributed

# rules that may refuse a cell of the matrix, each for a reason the rule states (docs/compatibility.md)
EXPECTED_REFUSALS = {"qlora-megatron", "qlora-sharded-storage", "sharded-copied-reference",
                     "megatron-pp-one-forward", "grpo-whole-groups"}


def _with_references(chosen) -> list:
    refs = {c.reference for c in chosen} - set(chosen)
    return [*chosen, *sorted(refs, key=lambda c: c.name)]


@pytest.fixture(scope="module")
def default_share(tmp_path_factory, teacher):
    return run(_with_references(DEFAULT), tmp_path_factory.mktemp("precision_default"), teacher, job_per_backend=False)


# The slow tier since the default tier outgrew CI's time: 24 cells and their references in two
# torchrun jobs, about 5 min on 2 cores. The default tier trains every backend at fp32
# (tests/distributed/test_backends.py, test_megatron_*.py, test_sequence_parallel.py) and every
# family on every backend (tests/distributed/test_family_matrix.py).
@pytest.mark.slow
@pytest.mark.parametrize("cell", DEFAULT, ids=lambda c: c.name)
def test_default_share_trains_like_single(default_share, cell):
    assert classify(cell) == ("trains", ""), cell.name
    verdict = compare(cell, default_share)
    print(f"{cell.name}: rel {verdict.get('rel', float('nan')):.1e} abs {verdict.get('abs', float('nan')):.1e}")
    assert verdict["ok"], f"{cell.name}: {verdict['why']}"


def _chosen() -> list:
    """The matrix, or the backends named in WORKBENCH_MATRIX_BACKENDS (comma-separated: a rerun
    of some backends, which scripts/precision_matrix.py --backends merges into a saved run)."""
    only = [b for b in os.environ.get("WORKBENCH_MATRIX_BACKENDS", "").split(",") if b]
    return [c for c in cells() if not only or c.backend in only]


@pytest.fixture(scope="module")
def whole(tmp_path_factory, teacher):
    """Every cell's classification, and the results of those that train (and their references)."""
    classes = {c: classify(c) for c in _chosen()}
    training = [c for c, (kind, _) in classes.items() if kind == "trains"]
    results = run(_with_references(training), tmp_path_factory.mktemp("precision_all"), teacher, timeout=5400)
    verdicts = {c: compare(c, results) if classes[c][0] == "trains" else {} for c in classes}
    dump = os.environ.get("WORKBENCH_MATRIX_JSON")
    if dump:
        rows = [{"method": c.method, "backend": c.backend, "precision": c.precision, "peft": c.peft,
                 "verdict": classes[c][0], "rule": classes[c][1], **verdicts[c],
                 "losses": results.get(c.name, {}).get("losses"),
                 "seconds": results.get(c.name, {}).get("seconds")} for c in classes]
        with open(dump, "w") as f:
            json.dump(rows, f, indent=1)
    return classes, verdicts


@pytest.mark.slow
@pytest.mark.parametrize("cell", cells(), ids=lambda c: c.name)
def test_every_cell_trains_like_single_or_is_refused(whole, cell):
    classes, verdicts = whole
    if cell not in classes:
        pytest.skip(f"{cell.backend} is not in WORKBENCH_MATRIX_BACKENDS")
    kind, rule = classes[cell]
    if kind == "refused":
        assert rule in EXPECTED_REFUSALS, f"{cell.name} refused by {rule}"
        return
    assert verdicts[cell]["ok"], f"{cell.name}: {verdicts[cell]['why']}"
