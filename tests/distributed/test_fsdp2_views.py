"""The module FSDP2 wraps returns no view that needs a gradient, and an in-place op on what it
returns trains like backend=single.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_fsdp2_views.py

FSDP2 attaches its pre-backward hook to each output tensor of a wrapped module's forward. An
in-place op on an output that is a view replaces the view's autograd node and drops the hook:
torch then warns "FSDP2-wrapped module (...) returned a view tensor" on every forward, and a
caller that does modify the output in place gets a failed backward ("setStorage: ... out of
bounds for storage of size 0") instead of a step. SelectiveLM (workbench/models/head.py)
returns its target log-probs as a tensor of their own for that reason.

This file is also the torchrun job of its 2-process test (`torchrun --nproc_per_node=2
tests/distributed/test_fsdp2_views.py OUT`): SFT under backend=fsdp2 whose loss multiplies the
wrapped module's output by 1 in place, with every warning recorded; rank r writes
OUT/<run>.rank<r>.json. The same runs at backend=single (grad_accum=2: the same global batch)
run in the test's own process.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# the slow tier (a regression of one FSDP2 hook; test_backends trains FSDP2 like single in the default tier)
pytestmark = pytest.mark.slow

VIEW_WARNING = "returned a view tensor"
RUNS = {"none": ["peft=none"], "lora": ["peft=lora"]}


def in_place(loss):
    """`loss` (a method's loss(self, model, micro)) called with a model whose every output is
    multiplied by 1 in place, a no-op on the values, before the loss reads it."""
    def wrapped(self, model, micro):
        def call(*args, **kwargs):
            out = model(*args, **kwargs)
            out.mul_(1.0)
            return out
        return loss(self, call, micro)
    return wrapped


def _train(overrides: list[str], out: Path) -> dict:
    """A 3-step run: its losses, grad norms and the messages of the warnings it raised."""
    from tests.conftest import compose
    from workbench.run.runner import Runner

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        runner = Runner(compose([*overrides, "train.max_steps=3", "++hardware.timeout_minutes=4"], out))
        res = runner.train()
    return {"losses": res["losses"], "grad_norms": [r["grad_norm"] for r in runner.tracker.rows if "grad_norm" in r],
            "warnings": [str(w.message) for w in seen]}


def test_selective_lm_returns_no_view_that_needs_a_gradient():
    """Each output of SelectiveLM that needs a gradient owns its storage: the target log-probs
    (at once, in checkpointed pieces, with entropies) and the logits."""
    import torch

    from tests.conftest import compose
    from workbench.models.head import SelectiveLM
    from workbench.models.load import load_model

    model = load_model(compose([]).model)
    ids = torch.randint(0, 1000, (2, 12))
    select = torch.zeros_like(ids, dtype=torch.bool)
    select[:, 4:11] = True
    targets = ids[:, 1:][select[:, :-1]]
    for chunk, kw in ((0, {}), (0, {"entropy": True}), (14, {}), (5, {})):
        out = SelectiveLM(model, chunk=chunk)(ids, select=select, targets=targets, **kw)
        grads = [t for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad]
        assert grads and all(t._base is None for t in grads), (chunk, kw)
    for sel in (select, None):
        assert SelectiveLM(model)(ids, select=sel)._base is None


@pytest.mark.distributed
def test_fsdp2_output_modified_in_place_trains_like_single_without_warning(tmp_path, monkeypatch):
    from tests.helpers import ROOT, close, torchrun
    from tests.tolerances import LOSS_RTOL
    from workbench.methods import sft

    torchrun(ROOT / "tests" / "distributed" / "test_fsdp2_views.py", [tmp_path / "fsdp2"], timeout=600)
    monkeypatch.setattr(sft.SFT, "loss", in_place(sft.SFT.loss))
    for name, overrides in RUNS.items():
        single = _train([*overrides, "train.grad_accum=2"], tmp_path / "single" / name)
        ranks = [json.loads((tmp_path / "fsdp2" / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]
        for run in ranks:
            assert "error" not in run, run.get("traceback")
            assert not [w for w in run["warnings"] if VIEW_WARNING in w], run["warnings"]
            close(run["losses"], single["losses"])
        # rank 0 logs each step's gradient norm: the gradients agree, not only the losses
        assert ranks[0]["grad_norms"] == pytest.approx(single["grad_norms"], rel=LOSS_RTOL), name


def main(out: Path) -> None:
    import os
    import traceback

    import torch

    from workbench.methods import sft

    torch.use_deterministic_algorithms(True, warn_only=True)
    sft.SFT.loss = in_place(sft.SFT.loss)
    out.mkdir(parents=True, exist_ok=True)
    for name, overrides in RUNS.items():
        try:
            result = _train(["backend=fsdp2", *overrides], out / name)
        except Exception as exc:  # the test shows it
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        (out / f"{name}.rank{os.environ['RANK']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
