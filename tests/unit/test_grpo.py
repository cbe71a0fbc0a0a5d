"""method=grpo: the loss equals TRL's GRPOTrainer on the same completions and advantages; errors.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_grpo.py
"""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import compose, train
from tests.helpers import MAX_NEW, G, grpo_completions
from tests.tolerances import LOSS_RTOL, grad_atol
from workbench.core.errors import UserError
from workbench.data.chat import IGNORE, prompt_ids
from workbench.methods import grpo
from workbench.methods.reference import Reference
from workbench.rollout.advantages import group_advantages


@pytest.mark.parametrize("tree", [False, True], ids=["rows", "tree"])  # method.share_prompt
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_loss_and_grads_equal_trl(tiny, tmp_path, loss_type, tree, trl_on_cpu):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from workbench.models.head import SelectiveLM

    tok, eot, pad = tiny.tok, tiny.contract.end_of_turn_id, tiny.tok.pad_token_id
    temperature, beta, eps, eps_high = 0.7, 0.05, 0.2, 0.28
    # equal-length prompts: TRL scores left-padded prompts without position ids, we right-pad
    prompts = [[{"role": "user", "content": "What is 12 + 30?"}], [{"role": "user", "content": "What is 45 + 17?"}]]
    p_ids = [prompt_ids(tok, p) for p in prompts]
    assert len(p_ids[0]) == len(p_ids[1])
    comps = grpo_completions(tok, eot)
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.2, 1.0, 0.3])
    adv = group_advantages(rewards, G, "group")

    # TRL: its trainer, its per-token log-probs and its loss on injected completions
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                      num_generations=G, per_device_train_batch_size=G * 2, max_completion_length=MAX_NEW,
                      temperature=temperature, beta=beta, epsilon=eps, epsilon_high=eps_high, loss_type=loss_type)
    trainer = GRPOTrainer(model=str(tiny.path), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                          args=args, train_dataset=Dataset.from_list([{"prompt": prompts[0]}] * 8),
                          processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    pw = max(len(p) for p in p_ids)
    cw = max(len(c) for c in comps)
    prompt_t = torch.full((8, pw), pad)
    prompt_m = torch.zeros((8, pw), dtype=torch.long)
    comp_t = torch.full((8, cw), pad)
    comp_m = torch.zeros((8, cw), dtype=torch.long)
    for i, c in enumerate(comps):
        p = p_ids[i // G]
        prompt_t[i, pw - len(p):], prompt_m[i, pw - len(p):] = torch.tensor(p), 1  # left-padded prompts
        comp_t[i, :len(c)], comp_m[i, :len(c)] = torch.tensor(c), 1
    full_ids, full_m = torch.cat([prompt_t, comp_t], 1), torch.cat([prompt_m, comp_m], 1)

    # a reference that differs from the policy (so KL matters), and old log-probs off the policy (so clipping does)
    ref_model = AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.float32)
    torch.manual_seed(3)
    with torch.no_grad():
        for prm in ref_model.parameters():
            prm.add_(0.05 * torch.randn_like(prm))
    saved = copy.deepcopy(trainer.model.state_dict())
    trainer.model.load_state_dict(ref_model.state_dict())
    with torch.no_grad():
        ref_2d = trainer._get_per_token_logps_and_entropies(trainer.model, full_ids, full_m, cw)[0]
    trainer.model.load_state_dict(saved)
    with torch.no_grad():
        cur_2d = trainer._get_per_token_logps_and_entropies(trainer.model, full_ids, full_m, cw)[0]
    torch.manual_seed(4)
    old_2d = cur_2d + 0.3 * torch.randn_like(cur_2d)
    inputs = {"prompt_ids": prompt_t, "prompt_mask": prompt_m, "completion_ids": comp_t, "completion_mask": comp_m,
              "advantages": adv, "old_per_token_logps": old_2d, "ref_per_token_logps": ref_2d,
              "num_items_in_batch": comp_m.sum()}
    trl_loss = trainer.compute_loss(trainer.model, inputs)
    trl_loss.backward()
    trl_grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    # Ours: the method's loss on right-padded prompt+completion rows (or one row per prompt with
    # its completions as branches), divided by its denom
    model = AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.float32)
    cfg = copy.deepcopy(compose(["method=grpo"]).method)
    OmegaConf.set_readonly(cfg, False)  # the loss under test reads these fields; set them by hand
    cfg.loss_type, cfg.temperature, cfg.beta, cfg.epsilon, cfg.epsilon_high = loss_type, temperature, beta, eps, eps_high
    cfg.max_new_tokens = MAX_NEW
    method = grpo.GRPO.__new__(grpo.GRPO)
    method.cfg, method.ref = cfg, Reference.frozen(SelectiveLM(ref_model).eval())
    seqs = [(p_ids[i // G] + c, [IGNORE] * len(p_ids[i // G]) + c) for i, c in enumerate(comps)]
    micro = grpo.collate(seqs, G, 0, pad, tree)
    assert ("head_slot" in micro) == tree
    micro["advantages"] = adv
    micro["old_logps"] = old_2d[comp_m.bool()]
    n_tok = float(comp_m.sum())
    method._step_tokens = n_tok
    denom = {"grpo": 8.0, "dapo": n_tok, "dr_grpo": 8.0 * MAX_NEW}[loss_type]
    policy = SelectiveLM(model).train()
    loss_sum, metrics = method.loss(policy, micro)
    loss = loss_sum / denom
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(trl_loss.detach()), rel=LOSS_RTOL)
    ours = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(ours) == set(trl_grads)
    for n, g in ours.items():
        # summation order differs (index_add vs TRL's masked sums): tests/tolerances.py
        torch.testing.assert_close(g, trl_grads[n], rtol=LOSS_RTOL, atol=grad_atol(trl_grads[n]))
    assert metrics["clip/region"] > 0 and metrics["kl"] > 0  # the comparison exercised clipping and KL


def test_group_advantages_match_trl_formula():
    from trl.trainer.utils import nanstd

    r = torch.tensor([1.0, 0.0, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0])
    g = r.view(-1, 4)
    want = (r - g.mean(1).repeat_interleave(4)) / (nanstd(g, dim=1).repeat_interleave(4) + 1e-4)
    torch.testing.assert_close(group_advantages(r, 4, "group"), want)
    torch.testing.assert_close(group_advantages(r, 4, "none"), r - g.mean(1).repeat_interleave(4))
    assert group_advantages(r, 4, "group")[4:].abs().max() == 0  # a uniform group carries no signal


def test_num_generations_below_two_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"\[grpo-group-size\].*num_generations>=2"):
        train(["method=grpo", "method.num_generations=1", "train.max_steps=1"], tmp_path)


def test_missing_and_unknown_rewards_fail_before_weights(tmp_path, monkeypatch):
    import workbench.models.build as build

    def no_weights(*a, **k):
        raise AssertionError("weights were loaded before the reward error")

    monkeypatch.setattr(build, "load_model", no_weights)
    with pytest.raises(UserError, match=r"\[grpo-needs-reward\] method=grpo needs at least one reward"):
        train(["method=grpo", "~reward", "train.max_steps=1"], tmp_path)
    with pytest.raises(UserError, match="unknown reward function 'exactt'"):
        train(["method=grpo", "reward.functions=[exactt]", "train.max_steps=1"], tmp_path)
    with pytest.raises(UserError, match="multiple of method.num_generations"):
        train(["method=grpo", "train.micro_batch_size=6", "train.max_steps=1"], tmp_path)


def test_sft_shaped_data_is_refused_for_grpo(tmp_path):
    with pytest.raises(UserError, match="format 'messages' is not usable.*prompt"):
        train(["method=grpo", "method.recipe=arith_sft", "train.max_steps=1"], tmp_path)


def test_grpo_runs_with_kl_and_several_iterations(tmp_path):
    """peft=lora: adapter-disabled reference; num_iterations=2 reuses one generation batch for two steps."""
    res = train(["method=grpo", 'reward.functions=["tests.rewards:char_length"]', "method.beta=0.1",
                 "method.num_iterations=2", "train.max_steps=2", "train.resume=never"], tmp_path)
    import json

    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["reward"] == rows[1]["reward"]  # same generation batch
    assert rows[1]["kl"] > 0 and all(torch.isfinite(torch.tensor(res["losses"])))
    assert (tmp_path / "samples" / "grpo.jsonl").exists()
