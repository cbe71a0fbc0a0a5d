"""method=cpo (and its SimPO alias) and method=orpo: loss and gradients equal TRL's trainers; runs; errors.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_cpo_orpo.py

TRL's side is its own trainer class (trl.experimental.cpo.CPOTrainer, trl.experimental.orpo.ORPOTrainer)
on the tiny model saved to a directory: its collator pads our token ids, its compute_loss runs
the model and the loss. Ours is the method's loss on the same pairs divided by the pair count, as
the backend does. The NLL terms are matched exactly, not on chosen rows of equal length: both
sides average it over every NLL token of the batch (workbench/methods/pairs.py, PairStream), and
the pairs below have chosen completions of different lengths and prompts of different lengths,
so a per-pair mean would fail the comparison. Both trainers score completions with full logits
and selective_log_softmax, so the Triton log-prob shim of tests/helpers.py is not needed.
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import compose, train
from tests.helpers import DPO_PAIRS
from tests.tolerances import F64_FUNC_RTOL, LOSS_RTOL, difference_atol, grad_atol
from workbench.core.errors import UserError
from workbench.data.chat import prompt_ids
from workbench.data.preference import Pair, preference_row, tokenise_completion
from workbench.methods import cpo, orpo
from workbench.resolve.derive import derive


def _features(pairs) -> list[dict]:
    """TRL's tokenised-row layout (what its tokenize_row produces) built from our pairs."""
    rows = []
    for p in pairs:
        row = {"prompt_input_ids": p.chosen[0][:p.prompt_len], "prompt_attention_mask": [1] * p.prompt_len}
        for side, (ids, labels) in (("chosen", p.chosen), ("rejected", p.rejected)):
            row[f"{side}_input_ids"] = list(ids)
            row[f"{side}_attention_mask"] = [1] * len(ids)
            row[f"{side}_labels"] = list(labels)
        rows.append(row)
    return rows


def _trl_loss_and_grads(trainer_cls, config_cls, tiny, tmp_path, pairs, **options):
    from datasets import Dataset

    args = config_cls(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, max_length=512,
                      per_device_train_batch_size=len(pairs), dataset_num_proc=None, **options)
    row = {"prompt": [{"role": "user", "content": "1+1?"}], "chosen": [{"role": "assistant", "content": "2"}],
           "rejected": [{"role": "assistant", "content": "3"}]}
    trainer = trainer_cls(model=str(tiny.path), args=args, train_dataset=Dataset.from_list([row]),
                          processing_class=tiny.tok)
    batch = trainer.data_collator(_features(pairs))
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, trainer


def _our_loss_and_grads(module, method_name, tiny, pairs, tree=False, **options):
    from transformers import AutoModelForCausalLM

    from workbench.models.head import SelectiveLM

    cfg = compose([f"method={method_name}", "peft=none"])
    model = AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.float32)
    mcfg = copy.deepcopy(cfg.method)
    OmegaConf.set_readonly(mcfg, False)  # the loss under test reads these fields; set them by hand
    for k, v in options.items():
        setattr(mcfg, k, v)
    method = module.build(mcfg, SimpleNamespace(cfg=cfg, run=derive(cfg)))
    assert not hasattr(method, "ref") and derive(cfg).reference == "none"
    stream = method.stream
    stream.measure(pairs, pairs)  # a one-rank step of these pairs, as PairStream.step records it
    policy = SelectiveLM(model).train()
    if tree:  # method.share_prompt: one row per pair (workbench/data/pair_tree.py), as attach selects it
        default = stream.collate
        method.attach(SimpleNamespace(unwrapped=lambda: policy))
        assert stream.collate is not default
    micro = stream.collate(pairs, tiny.tok.pad_token_id)
    assert ("head_slot" in micro) == tree
    micro.pop("real_tokens", None)
    loss_sum, metrics = method.loss(policy, micro)
    loss = loss_sum / len(pairs)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, metrics


def _assert_equal(ours, trl):
    loss, grads = ours
    trl_loss, trl_grads = trl
    assert float(loss) == pytest.approx(float(trl_loss), rel=LOSS_RTOL)
    assert set(grads) == set(trl_grads) and len(grads) > 10
    for n, g in grads.items():
        # summation order differs (index_add vs TRL's masked sums): tests/tolerances.py
        torch.testing.assert_close(g, trl_grads[n], rtol=LOSS_RTOL, atol=grad_atol(trl_grads[n]))


def _mixed_lengths(tiny):
    """Four shipped pairs with chosen completions of 2 and 3 digits, and one whose prompt is shorter."""
    rows = [json.loads(line) for line in DPO_PAIRS.read_text().splitlines()]
    rows = [rows[0], rows[4], rows[7], {"prompt": "What is 7 + 5?", "chosen": "12", "rejected": "The sum is 13."}]
    pairs = []
    for i, row in enumerate(rows):
        p, c, r = preference_row(row, f"row {i}")
        ids = prompt_ids(tiny.tok, p)
        pairs.append(Pair(tokenise_completion(tiny.tok, tiny.contract, p, c, ids),
                          tokenise_completion(tiny.tok, tiny.contract, p, r, ids), len(ids)))
    lengths = {len(p.chosen[0]) - p.prompt_len for p in pairs}
    prompts = {p.prompt_len for p in pairs}
    assert len(lengths) > 1 and len(prompts) > 1, "the NLL normalisation is only tested on unequal lengths"
    return pairs


@pytest.mark.parametrize("case", [
    dict(loss_type="sigmoid", beta=0.3, cpo_alpha=0.7, label_smoothing=0.1),
    dict(loss_type="simpo", beta=2.0, cpo_alpha=0.0, simpo_gamma=1.0),
    dict(loss_type="simpo", beta=2.0, cpo_alpha=0.5, simpo_gamma=0.4),
    dict(loss_type="hinge", beta=0.2, cpo_alpha=1.0),
    dict(loss_type="ipo", beta=0.5, cpo_alpha=0.0),
], ids=lambda c: f"{c['loss_type']}-alpha{c['cpo_alpha']}")
@pytest.mark.parametrize("tree", [False, True], ids=["two-rows", "shared-prompt"])
def test_cpo_loss_and_grads_equal_trl(tiny, tmp_path, case, tree):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    pairs = _mixed_lengths(tiny)
    trl_loss, trl_grads, trainer = _trl_loss_and_grads(CPOTrainer, CPOConfig, tiny, tmp_path, pairs, **case)
    loss, grads, metrics = _our_loss_and_grads(cpo, "cpo", tiny, pairs, tree=tree, **case)
    _assert_equal((loss, grads), (trl_loss, trl_grads))
    trl_metrics = {k: v[-1] for k, v in trainer._stored_metrics["train"].items()}
    # rewards are beta x log-prob sums (or means) and margins their differences: they carry the
    # rounding of the log-probs, not their own size (tests/tolerances.py)
    logps = [trl_metrics["logps/chosen"], trl_metrics["logps/rejected"]]
    atol = difference_atol(*logps, *(case["beta"] * x for x in logps))
    for ours, theirs in [("rewards/chosen", "rewards/chosen"), ("rewards/margins", "rewards/margins"),
                         ("logps/rejected", "logps/rejected"), ("rewards/accuracies", "rewards/accuracies")]:
        assert metrics[ours] == pytest.approx(trl_metrics[theirs], rel=LOSS_RTOL, abs=atol)
    if case["cpo_alpha"]:
        assert metrics["nll/chosen"] == pytest.approx(trl_metrics["nll_loss"], rel=LOSS_RTOL)


@pytest.mark.parametrize("tree", [False, True], ids=["two-rows", "shared-prompt"])
def test_orpo_loss_and_grads_equal_trl(tiny, tmp_path, tree):
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    pairs = _mixed_lengths(tiny)
    trl_loss, trl_grads, trainer = _trl_loss_and_grads(ORPOTrainer, ORPOConfig, tiny, tmp_path, pairs, beta=0.25)
    loss, grads, metrics = _our_loss_and_grads(orpo, "orpo", tiny, pairs, tree=tree, beta=0.25)
    _assert_equal((loss, grads), (trl_loss, trl_grads))
    trl_metrics = {k: v[-1] for k, v in trainer._stored_metrics["train"].items()}
    for key in ("rewards/chosen", "rewards/margins", "logps/rejected", "nll_loss", "log_odds_ratio",
                "log_odds_chosen"):
        ours = metrics["nll/chosen" if key == "nll_loss" else key]
        assert ours == pytest.approx(trl_metrics[key], rel=LOSS_RTOL)


@pytest.mark.parametrize("tree", [False, True], ids=["two-rows", "shared-prompt"])
def test_orpo_nll_on_completion_only(tiny, tree):
    """nll_on_prompt=false: the NLL term is the token-mean NLL of the chosen completions alone,
    and the odds-ratio part of the loss is the same as with the prompt included."""
    from transformers import AutoModelForCausalLM

    from workbench.methods.logps import collate, sequence_logps
    from workbench.models.head import SelectiveLM

    pairs = _mixed_lengths(tiny)
    whole, _, m_whole = _our_loss_and_grads(orpo, "orpo", tiny, pairs, tree=tree, beta=0.25)
    part, _, m_part = _our_loss_and_grads(orpo, "orpo", tiny, pairs, tree=tree, beta=0.25, nll_on_prompt=False)
    lm = SelectiveLM(AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.float32))
    micro = collate(pairs, tiny.tok.pad_token_id)
    with torch.no_grad():
        pi_c, _ = sequence_logps(lm, micro).chunk(2)
    want = float(-pi_c.sum() / micro["n_tokens"].chunk(2)[0].sum())
    assert m_part["nll/chosen"] == pytest.approx(want, rel=LOSS_RTOL)
    # the prompt's tokens count there: far beyond rounding, 100x the tolerance of equal values
    assert abs(m_whole["nll/chosen"] - want) > 100 * LOSS_RTOL * abs(want)
    assert m_part["log_odds_ratio"] == pytest.approx(m_whole["log_odds_ratio"], rel=LOSS_RTOL)
    for loss, m in ((whole, m_whole), (part, m_part)):  # loss = NLL term + beta x mean -log s(log odds ratio)
        assert float(loss) == pytest.approx(m["nll/chosen"] - 0.25 * m["log_odds_ratio"], rel=LOSS_RTOL)


def test_log1mexp_is_stable():
    """log(1 - exp(x)) against 50-digit decimal arithmetic, at both ends where fp64 cancels or underflows."""
    from decimal import Decimal, getcontext

    getcontext().prec = 50
    xs = [-50.0, -1.0, -0.6931, -0.6932, -1e-3, -1e-7]
    want = torch.tensor([float((1 - Decimal(x).exp()).ln()) for x in xs], dtype=torch.float64)
    # a few fp64 roundings of the exp/log1p/expm1 it is made of (tests/tolerances.py)
    torch.testing.assert_close(orpo.log1mexp(torch.tensor(xs, dtype=torch.float64)), want, rtol=F64_FUNC_RTOL, atol=0)
    assert float(torch.log(1 - torch.exp(torch.tensor(-50.0, dtype=torch.float64)))) == 0.0  # what it avoids


@pytest.mark.parametrize("method", ["cpo", "simpo", "orpo"])
@pytest.mark.parametrize("peft", ["none", "lora"])
def test_trains_without_reference(tmp_path, method, peft):
    overrides = [f"method={method}", f"peft={peft}", "train.max_steps=2", "train.resume=never"]
    cfg = compose(overrides)
    assert derive(cfg).reference == "none"
    assert cfg.method.name == ("cpo" if method == "simpo" else method)
    out = train(overrides, tmp_path)
    losses = out["losses"]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))) and losses[0] != losses[1]


@pytest.mark.parametrize("overrides, field", [
    (["method=cpo", "method.loss_type=kto"], "loss_type"),
    (["method=cpo", "method.beta=0"], "beta"),
    (["method=cpo", "method.loss_type=hinge", "method.label_smoothing=0.1"], "label_smoothing"),
    (["method=cpo", "method.label_smoothing=0.5"], "label_smoothing"),
    (["method=cpo", "method.cpo_alpha=-1"], "cpo_alpha"),
    (["method=simpo", "method.simpo_gamma=-0.5"], "simpo_gamma"),
    (["method=orpo", "method.beta=-0.1"], "beta"),
    (["method=orpo", "+method.reference=copy"], "reference"),
])
def test_bad_options_name_the_field(tmp_path, overrides, field):
    with pytest.raises(UserError, match=field):
        train([*overrides, "train.max_steps=1"], tmp_path)


@pytest.mark.parametrize("method", ["cpo", "orpo"])
def test_nll_is_a_step_token_mean_whatever_the_micro_batches(tmp_path, method):
    """One micro-batch of 4 pairs or two of 2 (gradient accumulation): the same step losses, since
    the NLL is averaged over the step's tokens, not per micro-batch (which would differ here: the
    shipped pairs' chosen completions have 2 and 3 digits)."""
    base = [f"method={method}", "peft=none", "train.max_steps=2", "train.resume=never"]
    one = train(base + ["train.micro_batch_size=4", "train.grad_accum=1"], tmp_path / "one")["losses"]
    two = train(base + ["train.micro_batch_size=2", "train.grad_accum=2"], tmp_path / "two")["losses"]
    # same sums in another order and padding width: tests/tolerances.py
    assert two == pytest.approx(one, rel=LOSS_RTOL)
