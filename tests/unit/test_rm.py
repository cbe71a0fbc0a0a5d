"""method=rm and reward=model: loss and gradients equal TRL's RewardTrainer; export round trip;
a trained reward model as GRPO's reward; margins from data; errors.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_rm.py
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import ROOT, compose, saved_tiny, train
from tests.tolerances import LOSS_RTOL, difference_atol, grad_atol, scale_atol
from workbench.core.errors import UserError
from workbench.data.preference import Pair, pairs_from_rows, tokenise_preferences
from workbench.data.recipes import Source
from workbench.methods import rm
from workbench.models import value_head

PAIRS = ROOT / "data_recipes" / "data" / "arith_dpo_train.jsonl"
HELD_OUT = ROOT / "data_recipes" / "data" / "arith_pref_eval.jsonl"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return saved_tiny(tmp_path_factory, ["method=rm", "peft=none"])


def _pairs(tiny, path=PAIRS, n=4, margins=None) -> list[Pair]:
    rows = [json.loads(line) for line in path.read_text().splitlines()][:n]
    pairs = pairs_from_rows(rows, tiny.tok, tiny.contract)
    return [replace(p, margin=margins[i]) for i, p in enumerate(pairs)] if margins else pairs


@pytest.mark.parametrize("margin,center", [(False, 0.0), (True, 0.0), (False, 0.3), (True, 0.3)])
def test_loss_and_grads_equal_trl(tiny, tmp_path, margin, center):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import RewardConfig, RewardTrainer

    from workbench.models.head import SelectiveLM

    # pairs of different lengths, so padding and the pooled position are exercised
    margins = [0.5, -0.25, 1.5, 0.0] if margin else None
    pairs = _pairs(tiny, margins=margins)
    assert len({len(p.chosen[0]) for p in pairs} | {len(p.rejected[0]) for p in pairs}) > 1
    # TRL: its own trainer on the saved model (a LlamaForSequenceClassification with a fresh
    # `score`), its collator on our token ids, its loss and metrics.
    args = RewardConfig(output_dir=str(tmp_path / "trl"), center_rewards_coefficient=center or None, report_to=[],
                        use_cpu=True, bf16=False, max_length=None, per_device_train_batch_size=len(pairs),
                        dataset_num_proc=None)
    row = {"prompt": [{"role": "user", "content": "1+1?"}], "chosen": [{"role": "assistant", "content": "2"}],
           "rejected": [{"role": "assistant", "content": "3"}]}
    trainer = RewardTrainer(model=str(tiny.path), args=args, train_dataset=Dataset.from_list([row]),
                            processing_class=tiny.tok)
    examples = [{"chosen_ids": p.chosen[0], "rejected_ids": p.rejected[0], **({"margin": p.margin} if margin else {})}
                for p in pairs]
    batch = trainer.data_collator(examples)
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, batch)
    trl_loss.backward()
    trl_grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    # Ours: the causal LM with the scalar head (TRL's initial `score` copied in), the method's
    # loss through SelectiveLM, divided by the pair count as the backend does.
    model = AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.float32)
    value_head.attach(model)
    with torch.no_grad():
        model.lm_head.weight.copy_(trainer.model.score.weight)
    cfg = copy.deepcopy(tiny.cfg.method)
    OmegaConf.set_readonly(cfg, False)
    cfg.center_rewards_coefficient = center
    method = rm.RewardModel(cfg, SimpleNamespace(cfg=tiny.cfg))
    method.stream.pairs = float(len(pairs))
    micro = rm.collate(pairs, tiny.tok.pad_token_id)
    assert torch.equal(micro["input_ids"], batch["input_ids"])  # same rows, same padding
    loss_sum, metrics = method.loss(SelectiveLM(model).train(), micro)
    loss = loss_sum / len(pairs)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(trl_loss.detach()), rel=LOSS_RTOL)
    ours = {("score.weight" if n == "lm_head.weight" else n): p.grad for n, p in model.named_parameters()
            if p.grad is not None}
    assert set(ours) == set(trl_grads) and "score.weight" in ours and len(ours) > 10
    for n, g in ours.items():
        # the same fp32 sums in another order (SDPA with / without the padding mask): tests/tolerances.py
        torch.testing.assert_close(g, trl_grads[n], rtol=LOSS_RTOL, atol=grad_atol(trl_grads[n]))
    assert metrics["rewards/accuracies"] == pytest.approx(trl_metrics["accuracy"])
    # a mean of differences r_c - r_r: it carries the rounding of the rewards (tests/tolerances.py)
    atol = difference_atol(metrics["rewards/chosen"], metrics["rewards/rejected"])
    assert metrics["rewards/margins"] == pytest.approx(trl_metrics["margin"], rel=LOSS_RTOL, abs=atol)


def test_losses_of_hand_worked_pairs():
    """Values worked out on paper, not by the code's formula. Pair 1: rewards 2 and 1 with a
    margin of 1 leave nothing to prefer, -log s(0) = ln 2, and the rewards' sum 3 costs
    0.1 x 3^2 = 0.9 of centring. Pair 2: the rejected completion wins by 1, -log s(-1) = ln(1 + e),
    and the rewards cancel (no centring). Pair 3: r_c - r_r - m = ln 3, -log(3/4) = ln(4/3),
    centring 0.1 x (0.25 + ln 3)^2."""
    import math

    r_c = torch.tensor([2.0, -0.5, 0.25 + math.log(3)])
    r_r = torch.tensor([1.0, 0.5, 0.0])
    m = torch.tensor([1.0, 0.0, 0.25])
    want = [math.log(2) + 0.9, math.log(1 + math.e), math.log(4 / 3) + 0.1 * (0.25 + math.log(3)) ** 2]
    assert rm.rm_loss(r_c, r_r, m, 0.1).tolist() == pytest.approx(want, rel=LOSS_RTOL)
    assert rm.rm_loss(r_c, r_r, m, 0.0).tolist() == pytest.approx([math.log(2), math.log(1 + math.e),
                                                                   math.log(4 / 3)], rel=LOSS_RTOL)


def test_pool_is_the_last_non_pad_token():
    ids = torch.tensor([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9], [0, 5, 0, 0, 0]])
    assert value_head.pool(ids, 0).nonzero()[:, 1].tolist() == [2, 4, 1]


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory):
    """A 2-step method=rm run on the tiny model with LoRA, exported, evaluated on 8 held-out pairs."""
    from workbench.run.runner import Runner

    out = tmp_path_factory.mktemp("rm_run")
    cfg = compose(["method=rm", "peft=lora", "train.max_steps=2", "train.export=true", "train.resume=never",
                   "eval=heldout", "eval.tasks=[reward_accuracy]", "data.eval_split=8", "optim.lr=1e-2"], out)
    runner = Runner(cfg)
    results = runner.train()
    return SimpleNamespace(dir=out, results=results, runner=runner, cfg=cfg)


def test_rm_trains_with_lora_head_trainable_and_checkpointed(rm_run):
    from workbench.checkpoints.canonical import read_all

    losses = rm_run.results["losses"]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses) and losses[0] != losses[1]
    head = rm_run.runner.model.get_base_model().lm_head
    assert head.weight.shape == (1, 64) and head.weight.requires_grad
    lora = sum(p.numel() for n, p in rm_run.runner.model.named_parameters() if "lora_" in n)
    assert rm_run.results["n_trainable"] == lora + 64
    saved = read_all(rm_run.dir / "checkpoints" / "step-00000002" / "canonical")
    key = next(k for k in saved if k.startswith("model/") and k.endswith("lm_head.weight"))
    torch.testing.assert_close(saved[key], head.weight.detach())
    rows = [json.loads(x) for x in (rm_run.dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "eval" not in r]
    assert len(steps) == 2 and all({"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"}
                                   <= set(r) for r in steps)


def test_rm_trains_full_fine_tuning(tmp_path):
    res = train(["method=rm", "peft=none", "train.max_steps=2", "method.center_rewards_coefficient=0.01"], tmp_path)
    assert len(res["losses"]) == 2 and all(math.isfinite(v) for v in res["losses"])
    assert res["losses"][0] != res["losses"][1]


def _classifier_scores(clf, pairs, pad_id) -> torch.Tensor:
    micro = rm.collate(pairs, pad_id)
    with torch.no_grad():
        return clf(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits[:, 0].view(2, -1)


def test_export_is_a_sequence_classifier_with_the_same_scores(rm_run, tiny):
    from transformers import AutoModelForSequenceClassification

    merged = rm_run.dir / "export" / "merged"
    clf = AutoModelForSequenceClassification.from_pretrained(merged, dtype=torch.float32)
    assert type(clf).__name__ == "LlamaForSequenceClassification" and clf.config.num_labels == 1
    assert clf.config.pad_token_id == tiny.tok.pad_token_id
    pairs = _pairs(tiny, HELD_OUT, n=12)
    ours = rm.pair_rewards(rm_run.runner.model, pairs, tiny.tok.pad_token_id)  # the trained PEFT model
    theirs = _classifier_scores(clf, pairs, tiny.tok.pad_token_id)
    assert float(ours.std()) > 0
    # fp32 weights, adapters merged (W + BA reordered): tests/tolerances.py
    torch.testing.assert_close(theirs, ours, rtol=LOSS_RTOL, atol=grad_atol(ours))
    gate = rm_run.results["export"]["parity"]["merged"]
    assert gate["passed"] and gate["rounding"] == "exact"
    # the gate fails when the head did not make it into the file
    from workbench.export.reward_model import compare_scores

    with torch.no_grad():
        clf.score.weight.mul_(-1.0)
    assert not compare_scores(rm_run.runner.model, clf, pairs, tiny.tok.pad_token_id, "exact")["passed"]


def test_evaluation_reads_each_prompt_once_with_the_rewards_of_two_rows(rm_run, tiny, monkeypatch):
    """pair_rewards (the reward_accuracy and arith_rm evaluations) scores a pair as one row, its
    prompt read once, as training does; the rewards are those of two rows per pair to the
    tolerance of test_shared_prompt_rows_equal_two_rows (only the rounding differs)."""
    pairs = _pairs(tiny, HELD_OUT, n=12)
    pad, model = tiny.tok.pad_token_id, rm_run.runner.model
    widths = []
    real = rm.tree_collate

    def spy(chunk, pad_id):
        micro = real(chunk, pad_id)
        widths.append(micro["input_ids"].shape[0])
        return micro

    monkeypatch.setattr(rm, "tree_collate", spy)
    tree = rm.pair_rewards(model, pairs, pad, batch_size=5)
    assert widths == [5, 5, 2]  # one row per pair, in batches of 5
    rows = rm.pair_rewards(model, pairs, pad, batch_size=5, share_prompt=False)
    assert len(widths) == 3 and tree.shape == rows.shape == (2, 12) and float(rows.std()) > 0
    torch.testing.assert_close(tree, rows, rtol=LOSS_RTOL, atol=scale_atol(rows))


def test_reward_accuracy_eval_matches_the_exported_classifier(rm_run, tiny):
    from transformers import AutoModelForSequenceClassification

    from workbench.evals.builtin import eval_recipe

    end = rm_run.results["eval_end"]
    assert end["eval/reward_accuracy/n"] == 8
    held = [p for s in eval_recipe(rm_run.cfg).eval_sources
            for p in tokenise_preferences(s, tiny.tok, tiny.contract, rm_run.cfg.data).pairs]
    clf = AutoModelForSequenceClassification.from_pretrained(rm_run.dir / "export" / "merged", dtype=torch.float32)
    r = _classifier_scores(clf, held, tiny.tok.pad_token_id)
    assert end["eval/reward_accuracy/accuracy"] == pytest.approx(float((r[0] > r[1]).float().mean()))
    # the evaluation scores one row per pair, the classifier two padded rows: tests/tolerances.py
    assert end["eval/reward_accuracy/margin"] == pytest.approx(float((r[0] - r[1]).mean()), rel=LOSS_RTOL,
                                                               abs=scale_atol(r))


def test_reward_model_scores_grpo_rollouts(rm_run, tiny, tmp_path):
    from transformers import AutoModelForSequenceClassification

    res = train(["method=grpo", "reward=model", f"reward.path={rm_run.dir}", "train.max_steps=2",
                 "train.micro_batch_size=8", "train.grad_accum=1", "method.num_generations=4",
                 "method.max_new_tokens=4", "train.resume=never"], tmp_path)
    assert len(res["losses"]) == 2 and all(math.isfinite(v) for v in res["losses"])
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"eval"' not in x]
    assert all("rewards/model/mean" in r and r["rewards/model/std"] > 0 for r in rows)
    # every logged sample's reward is the exported classifier's score of the prompt + completion,
    # rendered here independently: the chat template's text up to the completion's end-of-turn
    clf = AutoModelForSequenceClassification.from_pretrained(rm_run.dir / "export" / "merged", dtype=torch.float32)
    samples = [json.loads(x) for x in (tmp_path / "samples" / "grpo.jsonl").read_text().splitlines()]
    assert samples
    eot = tiny.contract.end_of_turn_id
    wants = []
    for s in samples:
        conv = [{"role": "user", "content": s["prompt"]}, {"role": "assistant", "content": s["completion"]}]
        ids = tiny.tok.apply_chat_template(conv, tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        ids = ids[:len(ids) - ids[::-1].index(eot)]
        with torch.no_grad():
            wants.append(float(clf(input_ids=torch.tensor([ids])).logits[0, 0]))
    # one row per prompt against each completion alone: the same sums in another order (tests/tolerances.py)
    atol = scale_atol(torch.tensor(wants))
    assert [s["reward"] for s in samples] == pytest.approx(wants, rel=LOSS_RTOL, abs=atol)


def test_grpo_reward_reads_each_prompt_once_with_the_classifier_scores(rm_run, monkeypatch):
    """reward=model scores the completions of one prompt as one row (the prompt read once, each
    completion a branch) and gives the classifier's scores of right-padded rows to the tolerance
    of test_shared_prompt_rows_equal_two_rows; forwards hold whole groups up to reward.batch_size
    completions; a classifier whose attention takes no 4-D mask scores rows."""
    from transformers import AutoModelForSequenceClassification

    from workbench.data import pair_tree
    from workbench.rollout import reward_model as rmod

    reward = rmod.ModelReward(rmod.model_dir(rm_run.dir), batch_size=8)
    reward.load()
    q = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in ((12, 30), (7, 8), (61, 19))]
    # interleaved prompts; a repeated completion, an empty one, one the prefix of another
    prompts = [q[0], q[1], q[0], q[2], q[0], q[1], q[2], q[0], q[1], q[2], q[1], q[2]]
    completions = ["42", "15", "42", "80", "4", "1", "", "4200 is it", "15 because", "80", "16", "81"]
    widths = []
    real = pair_tree.branch_batch

    def spy(groups, pad_id):
        out = real(groups, pad_id)
        widths.append([len(g) for g in groups])
        return out

    monkeypatch.setattr(pair_tree, "branch_batch", spy)
    tree = reward(prompts=prompts, completions=completions)
    assert widths == [[4, 4], [4]]  # one row per prompt, at most 8 completions a forward
    rows = reward.row_scores(reward.encode(prompts, completions))
    assert len(set(rows)) > 3  # the scores tell completions apart
    torch.testing.assert_close(torch.tensor(tree), torch.tensor(rows), rtol=LOSS_RTOL,
                               atol=scale_atol(torch.tensor(rows)))

    eager = AutoModelForSequenceClassification.from_pretrained(reward.dir, dtype=torch.float32,
                                                               attn_implementation="eager")
    assert "4-D mask" in rmod.tree_unsupported(eager, 32)
    reward.model = eager
    widths.clear()
    again = reward(prompts=prompts, completions=completions)
    assert widths == []  # rows, not trees
    torch.testing.assert_close(torch.tensor(again), torch.tensor(rows), rtol=LOSS_RTOL,
                               atol=scale_atol(torch.tensor(rows)))


# tiny random classifiers of other families (the shapes of tests/unit/test_own_model.py)
CLASSIFIERS = {"qwen2": {}, "mistral": {}, "gemma2": {"head_dim": 16}, "phi3": {}, "qwen3": {"head_dim": 16}}


@pytest.mark.parametrize("family", [*CLASSIFIERS, "gemma3_text-window8"])
def test_grpo_reward_layouts_agree_across_classifier_families(tiny, family):
    """Each family's sequence classifier scores one row per prompt as it scores right-padded rows;
    a sliding window shorter than the sequences (Gemma 3 with 8 tokens here) would drop part of
    the tree's mask, so that classifier is routed to rows."""
    import transformers as tf

    from workbench.rollout.reward_model import ModelReward, tree_unsupported

    name, _, window = family.partition("-window")
    extra = {"head_dim": 16, "sliding_window": int(window)} if window else CLASSIFIERS[name]
    torch.manual_seed(0)
    config = tf.AutoConfig.for_model(name, vocab_size=49152, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=512, num_labels=1, pad_token_id=tiny.tok.pad_token_id,
                                     **extra)
    model = tf.AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa").eval()
    reward = ModelReward(".", batch_size=8)
    reward.model, reward.tokenizer, reward.contract = model, tiny.tok, tiny.contract
    q = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in ((12, 30), (7, 8))]
    prompts, completions = [q[0], q[1], q[0], q[1], q[0]], ["42", "15", "4200 is it", "", "42"]
    seqs = reward.encode(prompts, completions)
    rows = torch.tensor(reward.row_scores(seqs))
    tree = torch.tensor(reward.tree_scores(prompts, seqs))
    assert float(rows.std()) > 0
    if window:
        assert "sliding-window" in tree_unsupported(model, max(map(len, seqs)))
        assert not torch.allclose(tree, rows, rtol=LOSS_RTOL, atol=scale_atol(rows))  # why it is refused
        torch.testing.assert_close(torch.tensor(reward(prompts=prompts, completions=completions)), rows)
    else:
        assert tree_unsupported(model, max(map(len, seqs))) is None
        torch.testing.assert_close(tree, rows, rtol=LOSS_RTOL, atol=scale_atol(rows))


def test_reward_path_errors_before_the_policy_loads(tmp_path, tiny, monkeypatch):
    import workbench.run.runner

    def no_weights(*_a, **_k):
        raise AssertionError("the policy's weights were loaded before the reward path was checked")

    monkeypatch.setattr(workbench.run.runner, "build_model", no_weights)
    base = ["method=grpo", "reward=model", "train.max_steps=1"]
    with pytest.raises(UserError, match="reward=model needs reward.path"):
        train(base, tmp_path / "a")
    with pytest.raises(UserError, match=r"reward.path=.*nowhere: not found"):
        train(base + [f"reward.path={tmp_path / 'nowhere'}"], tmp_path / "b")
    with pytest.raises(UserError, match=r"not a reward model.*LlamaForCausalLM.*causal LM"):
        train(base + [f"reward.path={tiny.path}"], tmp_path / "c")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("method: {name: rm}\n")
    with pytest.raises(UserError, match="has no export/merged"):
        train(base + [f"reward.path={run_dir}"], tmp_path / "d")


def test_margin_column_is_read_and_checked(tiny, tmp_path):
    row = {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"}
    f = tmp_path / "m.jsonl"
    f.write_text(json.dumps({**row, "margin": 1.5}) + "\n" + json.dumps(row) + "\n")
    data = SimpleNamespace(on_bad_row="error", seq_len=256)
    got = tokenise_preferences(Source("m", f, format="auto"), tiny.tok, tiny.contract, data).pairs
    assert [p.margin for p in got] == [1.5, None]
    assert rm.collate(got, tiny.tok.pad_token_id)["margin"].tolist() == [1.5, 0.0]
    f.write_text(json.dumps({**row, "margin": "big"}) + "\n")
    with pytest.raises(UserError, match=r"m.jsonl:1: 'margin' must be a finite number"):
        tokenise_preferences(Source("m", f, format="auto"), tiny.tok, tiny.contract, data)


def test_bad_rm_options(tmp_path):
    with pytest.raises(UserError, match="center_rewards_coefficient"):
        train(["method=rm", "method.center_rewards_coefficient=-1", "train.max_steps=1"], tmp_path)
    from workbench.evals import builtin

    dpo_cfg = compose(["method=dpo", "eval=heldout", "eval.tasks=[reward_accuracy]", "data.eval_split=8"])
    with pytest.raises(UserError, match="'reward_accuracy' is for method=rm"):
        builtin.check("reward_accuracy", dpo_cfg)  # preflight
    with pytest.raises(UserError, match="'reward_accuracy' needs a reward model"):
        train(["method=dpo", "eval=heldout", "eval.tasks=[reward_accuracy]", "data.eval_split=8",
               "train.max_steps=1"], tmp_path)  # the task itself, when preflight was skipped


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_shared_prompt_rows_equal_two_rows(tiny, peft):
    """method.share_prompt: one row per pair (rm.tree_collate) gives the rewards, loss and
    gradients of two rows per pair (rm.collate). Tolerance as tests/unit/test_pair_tree.py's:
    only the rounding of attention under a 4-D mask and of matmuls over other rows differs, so
    each reward agrees to LOSS_RTOL relative (rewards near zero: scale_atol, LOSS_RTOL of the
    batch's largest reward, the scale of the products each reward sums) and gradients to grad_atol."""
    from tests.helpers import varied_pairs
    from workbench.models.head import SelectiveLM
    from workbench.models.load import load_model
    from workbench.peft import lora
    from workbench.resolve.derive import derive

    pairs = varied_pairs(tiny)  # prompts and completions of several lengths
    pairs[1] = replace(pairs[1], margin=0.75)
    cfg = compose(["method=rm", f"peft={peft}"])
    model = lora.apply(value_head.attach(load_model(cfg.model)), derive(cfg))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "lm_head" in n:  # adapters and head away from their zero start
                p.normal_(0, 0.05)
    lm = SelectiveLM(model).train()
    method = rm.RewardModel(copy.deepcopy(cfg.method), SimpleNamespace(cfg=cfg))
    method.stream.pairs = float(len(pairs))
    pad = tiny.tok.pad_token_id
    two, tree = rm.collate(pairs, pad), rm.tree_collate(pairs, pad)
    assert "reward_slot" in tree and tree["input_ids"].shape[0] == len(pairs)
    assert tree.pop("real_tokens") < int(two["attention_mask"].sum())

    def run(micro):
        lm.zero_grad(set_to_none=True)
        r = value_head.scores(lm, micro)
        loss, _ = method.loss(lm, micro)
        loss.backward()
        return r.detach(), loss.detach(), {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}

    (r2, l2, g2), (rt, lt, gt) = run(two), run(tree)
    torch.testing.assert_close(rt, r2, rtol=LOSS_RTOL, atol=scale_atol(r2))
    torch.testing.assert_close(lt, l2, rtol=LOSS_RTOL, atol=0.0)
    assert set(gt) == set(g2) and len(g2) > 4
    for n, g in g2.items():
        torch.testing.assert_close(gt[n], g, rtol=LOSS_RTOL, atol=grad_atol(g))


def test_identical_completions_fall_back_to_two_rows(tiny):
    pairs = _pairs(tiny)
    same = replace(pairs[0], rejected=pairs[0].chosen)
    micro = rm.tree_collate([pairs[1], same], tiny.tok.pad_token_id)
    assert "reward_slot" not in micro and micro["input_ids"].shape[0] == 4
