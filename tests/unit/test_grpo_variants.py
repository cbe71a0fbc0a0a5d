"""method=grpo's variants: GSPO's sequence-level ratio, CISPO and SAPO, RLOO; equal to TRL's trainers.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_grpo_variants.py

TRL's own trainer classes compute their side on the same tiny saved model and the same
completions: GRPOTrainer (importance_sampling_level="sequence", loss_type cispo/sapo) and
RLOOTrainer (leave-one-out advantages with the KL in the reward, its generation replaced by the
fixed completions). Ours is the method's loss divided by its denom, as the runner does.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import compose, train
from tests.golden import GRPO_SHAPE
from tests.helpers import MAX_NEW, G, grpo_completions, perturbed_model
from tests.tolerances import LOSS_RTOL, NEAR_ZERO_ATOL, grad_atol
from workbench.core.errors import UserError
from workbench.data.chat import IGNORE, prompt_ids
from workbench.methods import grpo
from workbench.methods.reference import Reference
from workbench.rollout.advantages import group_advantages, rloo_advantages

TEMPERATURE, BETA = 0.7, 0.05
PROMPTS = [[{"role": "user", "content": "What is 12 + 30?"}], [{"role": "user", "content": "What is 45 + 17?"}]]
REWARDS = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.2, 1.0, 0.3])


def _batch(saved):
    """Prompt ids (equal lengths: TRL left-pads prompts and scores them without position ids,
    we right-pad), completions, and TRL's padded tensors of them."""
    tok, pad = saved.tok, saved.tok.pad_token_id
    p_ids = [prompt_ids(tok, p) for p in PROMPTS]
    assert len(p_ids[0]) == len(p_ids[1])
    comps = grpo_completions(tok, saved.contract.end_of_turn_id)
    pw, cw = len(p_ids[0]), max(len(c) for c in comps)
    comp_t, comp_m = torch.full((8, cw), pad), torch.zeros((8, cw), dtype=torch.long)
    for i, c in enumerate(comps):
        comp_t[i, :len(c)], comp_m[i, :len(c)] = torch.tensor(c), 1
    prompt_t = torch.tensor([p_ids[i // G] for i in range(8)])
    return p_ids, comps, prompt_t, torch.ones((8, pw), dtype=torch.long), comp_t, comp_m


def _ours(saved, overrides: dict, ref_model):
    """Our method object, its config set by hand (the loss reads only cfg and the reference),
    the policy and the micro-batch of the fixed completions, one row per prompt (the layout
    method.share_prompt trains with; tests/unit/test_grpo.py checks both layouts against TRL)."""
    from transformers import AutoModelForCausalLM

    from workbench.models.head import SelectiveLM

    cfg = copy.deepcopy(compose(["method=grpo"]).method)
    OmegaConf.set_readonly(cfg, False)
    cfg.temperature, cfg.beta, cfg.max_new_tokens = TEMPERATURE, BETA, MAX_NEW
    for k, v in overrides.items():
        setattr(cfg, k, v)
    method = grpo.GRPO.__new__(grpo.GRPO)
    method.cfg, method.ref = cfg, Reference.frozen(SelectiveLM(ref_model).eval())
    p_ids, comps = _batch(saved)[:2]
    seqs = [(p_ids[i // G] + c, [IGNORE] * len(p_ids[i // G]) + c) for i, c in enumerate(comps)]
    micro = grpo.collate(seqs, G, 0, saved.tok.pad_token_id, tree=True)  # the default layout (share_prompt)
    model = AutoModelForCausalLM.from_pretrained(saved.path, dtype=torch.float32)
    return method, model, SelectiveLM(model).train(), micro


def _assert_same(loss, model, trl_loss, trl_grads):
    # GRPO-type losses are signed means of advantage-weighted terms that partly cancel: rtol for
    # the terms that do not, NEAR_ZERO_ATOL for those that do (tests/tolerances.py)
    assert abs(float(trl_loss.detach())) > 100 * NEAR_ZERO_ATOL  # the comparison is not of two zeros
    assert float(loss.detach()) == pytest.approx(float(trl_loss.detach()), rel=LOSS_RTOL, abs=NEAR_ZERO_ATOL)
    ours = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(ours) == set(trl_grads)
    for n, g in ours.items():
        # summation order differs (index_add vs TRL's masked sums): tests/tolerances.py
        torch.testing.assert_close(g, trl_grads[n], rtol=LOSS_RTOL, atol=grad_atol(trl_grads[n]))


# (importance_sampling_level, loss_type, epsilon, epsilon_high): GSPO with the clipped loss (per
# completion and per token normalisation) at the paper's clip range, which the perturbed old
# log-probs below cross both ways; CISPO and SAPO at both levels. CISPO's cap on the weight, 1.1,
# is crossed by some of the 0.3-sd perturbed token ratios and not by others.
CASES = [("sequence", "grpo", 3e-4, 4e-4), ("sequence", "dapo", 3e-4, 4e-4), ("token", "cispo", 0.2, 1.1),
         ("sequence", "cispo", 0.2, 1.1), ("token", "sapo", 0.2, 0.28), ("sequence", "sapo", 0.2, 0.28)]


@pytest.mark.parametrize("level,loss_type,eps,eps_high", CASES)
def test_grpo_variants_equal_trl(tiny, tmp_path, level, loss_type, eps, eps_high, trl_on_cpu):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    p_ids, comps, prompt_t, prompt_m, comp_t, comp_m = _batch(tiny)
    adv = group_advantages(REWARDS, G, "group")
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                      num_generations=G, per_device_train_batch_size=8, max_completion_length=MAX_NEW,
                      temperature=TEMPERATURE, beta=BETA, epsilon=eps, epsilon_high=eps_high, loss_type=loss_type,
                      importance_sampling_level=level, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05)
    trainer = GRPOTrainer(model=str(tiny.path), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                          args=args, train_dataset=Dataset.from_list([{"prompt": PROMPTS[0]}] * 8),
                          processing_class=tiny.tok)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    full_ids, full_m, cw = torch.cat([prompt_t, comp_t], 1), torch.cat([prompt_m, comp_m], 1), comp_t.shape[1]
    ref_model = perturbed_model(tiny.path)
    saved = copy.deepcopy(trainer.model.state_dict())
    trainer.model.load_state_dict(ref_model.state_dict())
    with torch.no_grad():
        ref_2d = trainer._get_per_token_logps_and_entropies(trainer.model, full_ids, full_m, cw)[0]
    trainer.model.load_state_dict(saved)
    with torch.no_grad():
        cur_2d = trainer._get_per_token_logps_and_entropies(trainer.model, full_ids, full_m, cw)[0]
    torch.manual_seed(4)
    old_2d = cur_2d + 0.3 * torch.randn_like(cur_2d)  # off-policy, so ratios and clipping matter
    inputs = {"prompt_ids": prompt_t, "prompt_mask": prompt_m, "completion_ids": comp_t, "completion_mask": comp_m,
              "advantages": adv, "old_per_token_logps": old_2d, "ref_per_token_logps": ref_2d,
              "num_items_in_batch": comp_m.sum()}
    trl_loss = trainer.compute_loss(trainer.model, inputs)
    trl_loss.backward()
    trl_grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    method, model, policy, micro = _ours(tiny, {"loss_type": loss_type, "importance_sampling_level": level,
                                                "epsilon": eps, "epsilon_high": eps_high}, ref_model)
    micro["advantages"], micro["old_logps"] = adv, old_2d[comp_m.bool()]
    n_tok = float(comp_m.sum())
    method._step_tokens = n_tok
    loss_sum, metrics = method.loss(policy, micro)
    loss = loss_sum / {"grpo": 8.0, "sapo": 8.0, "dapo": n_tok, "cispo": n_tok}[loss_type]
    loss.backward()
    _assert_same(loss, model, trl_loss, trl_grads)
    assert metrics["kl"] > 0
    if loss_type == "cispo":
        assert 0 < metrics["clip/cispo"] < 1  # the cap bound some tokens, not all
    elif loss_type != "sapo":
        assert 0 < metrics["clip/region"] < 1 and metrics["clip/low"] > 0 and metrics["clip/high"] > 0


@pytest.mark.parametrize("normalize", [False, True])
def test_rloo_equals_trl(tiny, tmp_path, normalize, trl_on_cpu):
    """RLOOTrainer scores the fixed completions (its generation replaced): leave-one-out advantages of
    rewards minus beta x the summed k1 KL, then its per-completion clipped likelihood-ratio loss."""
    from datasets import Dataset
    from trl import RLOOConfig, RLOOTrainer

    p_ids, comps, prompt_t, prompt_m, comp_t, comp_m = _batch(tiny)
    args = RLOOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                      num_generations=G, per_device_train_batch_size=8, max_completion_length=MAX_NEW,
                      temperature=TEMPERATURE, beta=BETA, epsilon=0.2, epsilon_high=0.28,
                      normalize_advantages=normalize)
    trainer = RLOOTrainer(model=str(tiny.path), reward_funcs=lambda completions, **_: REWARDS.tolist(),
                          args=args, train_dataset=Dataset.from_list([{"prompt": PROMPTS[0]}] * 8),
                          processing_class=tiny.tok)
    trainer.model.train()
    ref_model = perturbed_model(tiny.path)
    trainer.ref_model.load_state_dict(ref_model.state_dict())
    texts = tiny.tok.batch_decode(comps, skip_special_tokens=True)
    trainer._generate = lambda prompts: ([p_ids[i // G] for i in range(8)], comps,
                                         [[{"role": "assistant", "content": t}] for t in texts])
    out = trainer._generate_and_score_completions([{"prompt": PROMPTS[i // G]} for i in range(8)])
    assert torch.equal(out["completion_ids"], comp_t) and torch.equal(out["prompt_ids"], prompt_t)
    # off-policy by a per-completion log-ratio offset, so the clipping matters
    torch.manual_seed(4)
    offset = 0.3 * torch.randn(8)
    out["old_logps"] = out["old_logps"] + offset
    trl_loss = trainer.compute_loss(trainer.model, out)
    trl_loss.backward()
    trl_grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    rloo = compose(["method=rloo"]).method
    opts = {k: rloo[k] for k in ("advantage", "scale_rewards", "kl_in_reward", "importance_sampling_level",
                                 "loss_type", "epsilon")}
    method, model, policy, micro = _ours(tiny, {**opts, "epsilon_high": 0.28, "normalize_advantages": normalize},
                                         ref_model)
    # what the rollout does: the generating policy's log-probs, the reward's KL, the advantages
    with torch.no_grad():
        micro["old_logps"] = grpo.token_logps(policy, micro, TEMPERATURE)
    kl = method._sequence_kl(policy, micro)
    micro["advantages"] = rloo_advantages(REWARDS - BETA * kl, G, normalize)
    assert kl.abs().min() > 0  # the KL moved the rewards
    first = torch.cat([torch.zeros(1, dtype=torch.long), micro["n_tokens"].cumsum(0)[:-1]])
    micro["old_logps"][first] += offset  # the same offset on each completion's summed log-ratio
    method._step_tokens = float(comp_m.sum())
    loss_sum, metrics = method.loss(policy, micro)
    loss = loss_sum / 8.0  # loss_type=grpo: per completion
    loss.backward()
    _assert_same(loss, model, trl_loss, trl_grads)
    assert metrics["clip/region"] > 0 and "kl" not in metrics  # clipped; no KL in the loss


def test_rloo_advantage_is_reward_minus_mean_of_the_others():
    r = torch.tensor([1.0, 0.0, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0])
    want = torch.tensor([r[[j for j in range(4 * (i // 4), 4 * (i // 4) + 4) if j != i]].mean() for i in range(8)])
    torch.testing.assert_close(rloo_advantages(r, 4), r - want)
    torch.testing.assert_close(rloo_advantages(r, 4), group_advantages(r, 4, "none") * 4 / 3)
    normed = rloo_advantages(r, 4, normalize=True)
    # mean: a signed mean of terms of size ~1 that cancel (tests/tolerances.py NEAR_ZERO_ATOL);
    # std: RLOOTrainer's + 1e-4 in the divisor leaves s / (s + 1e-4) of the raw advantages' s
    s = float((r - want).std())
    assert abs(float(normed.mean())) <= NEAR_ZERO_ATOL
    assert float(normed.std()) == pytest.approx(s / (s + 1e-4), rel=LOSS_RTOL)


@pytest.mark.parametrize("overrides,message", [
    (["method.importance_sampling_level=seq"], "method.importance_sampling_level='seq' is not one of"),
    (["method.loss_type=cispo"], "method.loss_type=cispo caps the importance weight at method.epsilon_high"),
    (["method.loss_type=clip"], "method.loss_type='clip' is not one of"),
    (["method.advantage=rloo", "method.scale_rewards=group"], "with advantage=rloo set method.scale_rewards=none"),
    (["method.normalize_advantages=true"], "method.normalize_advantages applies to method.advantage=rloo"),
    (["method.advantage=loo", "method.scale_rewards=none"], "method.advantage='loo' is not one of"),
])
def test_bad_variant_options_fail_before_weights(tmp_path, monkeypatch, overrides, message):
    import workbench.models.build as build

    def no_weights(*a, **k):
        raise AssertionError("weights were loaded before the option error")

    monkeypatch.setattr(build, "load_model", no_weights)
    with pytest.raises(UserError, match=re.escape(message)):
        train(["method=grpo", *overrides, "train.max_steps=1"], tmp_path)


CHAR_REWARD = 'reward.functions=["tests.rewards:char_length"]'


@pytest.mark.parametrize("alias", ["gspo", "rloo"])
@pytest.mark.parametrize("peft", ["none", "lora"])
def test_aliases_train(tmp_path, alias, peft):
    """method=gspo and method=rloo train on the tiny model: finite, changing losses; rloo logs the
    reward's KL (its reference: a frozen copy without peft, the adapter-free base with lora)."""
    import json
    import math

    res = train([f"method={alias}", f"peft={peft}", CHAR_REWARD, *GRPO_SHAPE, "train.max_steps=2",
                 "train.resume=never"], tmp_path)
    losses = [float(x) for x in res["losses"]]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"eval"' not in x]
    if alias == "rloo":
        # step 1 on-policy from the base: policy and reference run the same arithmetic on the same
        # weights (LoRA's B starts at 0), so the KL is exactly 0; after the first update it is not
        assert rows[0]["kl"] == 0.0 and rows[1]["kl"] != 0.0
        assert "clip/region" in rows[0]
