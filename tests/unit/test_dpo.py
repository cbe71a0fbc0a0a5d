"""method=dpo: loss and gradients equal TRL's DPOTrainer; data shapes; reference strategies; errors.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_dpo.py
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import ROOT, train
from tests.helpers import DPO_PAIRS, dpo_pairs
from tests.tolerances import LOSS_RTOL, difference_atol, grad_atol
from workbench.core.errors import UserError
from workbench.data.preference import tokenise_preferences
from workbench.data.recipes import Source
from workbench.methods import dpo, logps
from workbench.resolve.derive import derive

# loss_type -> (our method options, TRL's loss_type and loss_weights for the same loss).
# rpo: sigmoid plus rpo_alpha x the chosen NLL, which TRL spells loss_type=[sigmoid, sft].
# smoothing: conservative DPO, -(1-e) log s(b d) - e log s(-b d). TRL's `sigmoid` has no label
# smoothing; its `robust` loss is (-(1-e) log s(b d) + e log s(-b d)) / (1-2e), so
# 2(1-e) sigmoid - (1-2e) robust = -2(1-e) log s(b d) + (1-e) log s(b d) - e log s(-b d), which is ours.
ALPHA, SMOOTHING = 0.7, 0.2
TRL_LOSSES = {
    "sigmoid": ({}, dict(loss_type=["sigmoid"])),
    "ipo": ({"loss_type": "ipo"}, dict(loss_type=["ipo"])),
    "hinge": ({"loss_type": "hinge"}, dict(loss_type=["hinge"])),
    "rpo": ({"rpo_alpha": ALPHA}, dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, ALPHA])),
    "smoothing": ({"label_smoothing": SMOOTHING},
                  dict(loss_type=["sigmoid", "robust"], loss_weights=[2 * (1 - SMOOTHING), -(1 - 2 * SMOOTHING)],
                       label_smoothing=SMOOTHING)),
}


@pytest.mark.parametrize("loss_type", list(TRL_LOSSES))
def test_loss_grads_and_metrics_equal_trl(tiny, tmp_path, loss_type, trl_on_cpu):
    """Both sides score the policy against the same perturbed reference (tests/helpers.py), so the
    log-ratio difference d is not zero: at d = 0 the sigmoid loss is log 2 whatever beta and the
    smoothing, the hinge is 1 and every reward accuracy is 0."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from tests.helpers import perturbed_model
    from workbench.methods.reference import Reference
    from workbench.models.head import SelectiveLM

    beta = 0.3
    ours_opts, trl_losses = TRL_LOSSES[loss_type]
    pairs = dpo_pairs(tiny, n=4, two_digit_chosen=loss_type == "rpo")
    ref_model = perturbed_model(tiny.path, scale=0.01)
    # TRL: its own trainer on the saved model, its collator on our token ids, its loss.
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=beta, **trl_losses, report_to=[],
                     use_cpu=True, bf16=False, max_length=None, per_device_train_batch_size=len(pairs),
                     dataset_num_proc=None)
    row = {"prompt": [{"role": "user", "content": "1+1?"}], "chosen": [{"role": "assistant", "content": "2"}],
           "rejected": [{"role": "assistant", "content": "3"}]}
    trainer = DPOTrainer(model=str(tiny.path), ref_model=copy.deepcopy(ref_model), args=args,
                         train_dataset=Dataset.from_list([row]), processing_class=tiny.tok)
    examples = [{"prompt_ids": p.chosen[0][:p.prompt_len], "chosen_ids": p.chosen[0][p.prompt_len:],
                 "rejected_ids": p.rejected[0][p.prompt_len:]} for p in pairs]
    batch = trainer.data_collator(examples)
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, batch)
    trl_loss.backward()
    trl_grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    # Ours: the method's own loss against the same reference, divided by the pair count as the backend does.
    model = AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.float32)
    cfg = copy.deepcopy(tiny.cfg.method)
    OmegaConf.set_readonly(cfg, False)  # the loss under test reads these fields; set them by hand
    cfg.beta = beta
    for k, v in ours_opts.items():
        setattr(cfg, k, v)
    dpo.check(cfg)  # the options are a valid combination
    ctx = SimpleNamespace(cfg=tiny.cfg, run=derive(tiny.cfg))  # the reference strategy as a run resolves it
    method = dpo.DPO(cfg, ctx)
    policy = SelectiveLM(model).train()
    method.attach(SimpleNamespace(unwrapped=lambda: policy))
    method.ref = Reference.frozen(SelectiveLM(ref_model).eval())
    micro = logps.collate(pairs, tiny.tok.pad_token_id)
    method._pairs_in_step = float(len(pairs))
    loss_sum, metrics = method.loss(policy, micro)
    loss = loss_sum / len(pairs)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(trl_loss.detach()), rel=LOSS_RTOL)
    ours = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(ours) == set(trl_grads) and len(ours) > 10
    # TRL's loss is a weighted sum of losses (smoothing: 1.6 sigmoid - 0.6 robust, which cancel), so its
    # gradient carries the rounding of the weighted terms, up to sum |w| times its own scale (difference_atol)
    spread = sum(abs(w) for w in trl_losses.get("loss_weights", [1.0]))
    for n, g in ours.items():
        # summation order differs (index_add vs TRL's masked sums): tests/tolerances.py
        torch.testing.assert_close(g, trl_grads[n], rtol=LOSS_RTOL, atol=spread * grad_atol(trl_grads[n]))
    # the logged rewards are TRL's: beta x the log-ratios, their margin and how often chosen wins
    # each reward is beta x a difference of log-prob sums: it carries their rounding (tests/tolerances.py)
    atol = difference_atol(beta * trl_metrics["logps/chosen"], beta * trl_metrics["logps/rejected"])
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert metrics[key] == pytest.approx(trl_metrics[key], rel=LOSS_RTOL, abs=atol), key
    assert metrics["rewards/accuracies"] == trl_metrics["rewards/accuracies"]


def test_accuracies_count_the_pairs_whose_chosen_reward_is_higher(tiny):
    """rewards/accuracies on a batch where the policy prefers chosen for some pairs only (the
    reference's log-probs handed in, so the rewards are known): 3 pairs of 4 by hand."""
    from transformers import AutoModelForCausalLM

    from workbench.models.head import SelectiveLM

    pairs = dpo_pairs(tiny, n=4)
    policy = SelectiveLM(AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.float32)).train()
    micro = logps.collate(pairs, tiny.tok.pad_token_id)
    with torch.no_grad():
        pi_c, pi_r = logps.pair_logps(policy, micro).chunk(2)
    # reference log-probs such that beta (pi - ref) is +1 / -1 for chosen / rejected, except pair 2 flipped
    sign = torch.tensor([1.0, 1.0, -1.0, 1.0])
    micro["ref_chosen"], micro["ref_rejected"] = pi_c - sign / 0.5, pi_r + sign / 0.5
    cfg = copy.deepcopy(tiny.cfg.method)
    OmegaConf.set_readonly(cfg, False)
    cfg.beta, cfg.reference = 0.5, "precomputed"
    method = dpo.DPO(cfg, SimpleNamespace(cfg=tiny.cfg, run=SimpleNamespace(reference="precomputed")))
    method.ref_logps, method._pairs_in_step = [], 4.0
    _, metrics = method.loss(policy, micro)
    assert metrics["rewards/accuracies"] == 0.75
    assert metrics["rewards/chosen"] == pytest.approx(0.5) and metrics["rewards/rejected"] == pytest.approx(-0.5)
    assert metrics["rewards/margins"] == pytest.approx(1.0)


def test_losses_of_hand_worked_pairs():
    """Values worked out on paper, not by the code's formula. With b d = ln 3, s(b d) = 3/4 and
    s(-b d) = 1/4: conservative DPO with a label flipped with probability e = 0.2 is the expected
    cross-entropy 0.8 ln(4/3) + 0.2 ln 4; the hinge relu(1 - b d) is 0.5 at b d = 0.5 and 0 once
    the margin b d reaches 1."""
    import math

    cfg = SimpleNamespace(loss_type="sigmoid", beta=0.5, label_smoothing=0.2)
    zero = torch.zeros(1)
    d = torch.tensor([2 * math.log(3)])  # chosen log-ratio; the rejected one is 0, so b d = ln 3
    got = dpo.dpo_loss(d, zero, zero, zero, cfg)
    assert float(got) == pytest.approx(0.8 * math.log(4 / 3) + 0.2 * math.log(4), rel=LOSS_RTOL)
    cfg.label_smoothing = 0.0
    assert float(dpo.dpo_loss(d, zero, zero, zero, cfg)) == pytest.approx(math.log(4 / 3), rel=LOSS_RTOL)
    cfg.loss_type = "hinge"
    # log-ratios (chosen, rejected) = (0.25, -0.75) and (-1, -3): d = 1 and 2, b d = 0.5 and 1
    got = dpo.dpo_loss(torch.tensor([0.25, -1.0]), torch.tensor([-0.75, -3.0]), torch.zeros(2), torch.zeros(2), cfg)
    assert got.tolist() == [0.5, 0.0]


def test_accepted_row_shapes_normalise_alike(tiny, tmp_path):
    q = [{"role": "user", "content": "What is 2 + 2?"}]
    rows = [
        {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"},
        {"prompt": q, "chosen": [{"role": "assistant", "content": "4"}],
         "rejected": [{"role": "assistant", "content": "5"}]},
        {"chosen": q + [{"role": "assistant", "content": "4"}], "rejected": q + [{"role": "assistant", "content": "5"}]},
    ]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = SimpleNamespace(on_bad_row="error", seq_len=256)
    got = tokenise_preferences(Source("p", f, format="auto"), tiny.tok, tiny.contract, data).pairs
    assert len(got) == 3 and got[0] == got[1] == got[2]
    ids, labels = got[0].chosen
    trained = [t for t, lab in zip(ids, labels) if lab != -100]
    assert tiny.tok.decode(trained[:-1]) == "4" and trained[-1] == tiny.contract.end_of_turn_id


def test_sft_shaped_data_is_refused_with_schemas(tmp_path):
    sft = ROOT / "data_recipes" / "data" / "arith_add2_train.jsonl"
    recipe = tmp_path / "sft_auto.yaml"
    recipe.write_text(f"sources:\n  - path: {sft}\n")
    with pytest.raises(UserError, match=r"arith_add2_train.jsonl:1: not a preference row.*accepts.*chosen.*rejected"):
        train(["method=dpo", f"method.recipe={recipe}", "train.max_steps=1"], tmp_path)
    with pytest.raises(UserError, match=r"format 'messages' is not usable.*chosen.*rejected"):
        train(["method=dpo", "method.recipe=arith_sft", "train.max_steps=1"], tmp_path)


def test_bad_preference_options(tmp_path):
    for ov, pat in [(["method.loss_type=kto"], "loss_type"), (["peft=none", "method.reference=adapter"], "adapter"),
                    (["method.beta=0"], "beta"), (["method.loss_type=ipo", "method.label_smoothing=0.1"], "smoothing")]:
        with pytest.raises(UserError, match=pat):
            train(["method=dpo", "train.max_steps=1", *ov], tmp_path)


def test_reference_strategies_agree_and_cache(tmp_path):
    """copy == precomputed on the full model; the precomputed cache is written once and reused."""
    recipe = tmp_path / "small.yaml"
    recipe.write_text(f"sources:\n  - path: {DPO_PAIRS}\n    format: preference\n    max_samples: 24\n")
    base = ["method=dpo", "peft=none", "train.max_steps=2", f"method.recipe={recipe}", "train.resume=never"]
    a = train(base + ["method.reference=copy"], tmp_path / "a")["losses"]
    b = train(base + ["method.reference=precomputed"], tmp_path / "b")["losses"]
    # the reference log-probs come from batches of another size (padding): tests/tolerances.py
    assert a == pytest.approx(b, rel=LOSS_RTOL)
    from workbench.core import cache

    cached = sorted((cache.root() / "ref_logps").glob("*/logps.safetensors"))
    assert cached
    c = train(base + ["method.reference=precomputed"], tmp_path / "c")["losses"]
    assert c == b  # the cached values themselves: the same arithmetic
