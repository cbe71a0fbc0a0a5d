"""GRPO with an environment on the tiny model: only sampled tokens enter the loss, both layouts;
asynchronous rollouts use the behaviour policy's log-probs; preview, evaluation and refusals.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_grpo_env.py
"""

from __future__ import annotations

import torch

from tests.conftest import compose, train
from tests.unit.test_episodes import ROW, scripted
from workbench.data.chat import IGNORE, setup_tokenizer
from workbench.envs.registry import load
from workbench.envs.tools import ToolCall
from workbench.methods import grpo
from workbench.models.head import SelectiveLM
from workbench.models.load import load_model, load_tokenizer
from workbench.rollout import episodes
from workbench.rollout.turns import Turns

ENV = ["method=grpo", "env=calc", "env.max_new_tokens=8", "method.num_generations=4", "train.micro_batch_size=8",
       "method.dynamic_sampling=false", 'reward.functions=["tests.unit.test_rewards:char_length"]']


def test_logps_are_taken_at_sampled_tokens_only_in_both_layouts():
    """Two groups of two 2- or 3-turn episodes, collated as rows and as branches of one row per
    prompt: the log-probs GRPO computes are exactly those of the sampled tokens, read off a plain
    forward of each whole episode."""
    cfg = compose(["method=grpo", "env=calc"])
    tok = load_tokenizer(cfg.model)
    contract = setup_tokenizer(tok)
    env = load(cfg.env)
    turns = Turns(tok, contract, env.tools)
    call = turns.format.render(ToolCall("calc", {"expression": "347 + 589"}))
    scripts = [[call, "936"], [call, "1000"], ["no tool", "x"], [call, "bad <tool_call>", "936"]]
    eps = []
    for script in scripts:
        eps += episodes.run(env, turns, [ROW], scripted(tok, script), max_new_tokens=64)
    assert [e.turns for e in eps] == [2, 2, 1, 3]
    seqs = [(e.ids, e.labels) for e in eps]
    torch.manual_seed(0)
    model = SelectiveLM(load_model(cfg.model)).eval()
    want = []
    with torch.no_grad():
        for ids, labels in seqs:
            logits = model.inner(input_ids=torch.tensor([ids])).logits[0].float() / 0.7
            logp = torch.log_softmax(logits, -1)
            pos = [t for t in range(len(ids) - 1) if labels[t + 1] != IGNORE]
            want.append(logp[pos, torch.tensor(ids)[[p + 1 for p in pos]]])
        for tree in (False, True):
            micro = grpo.collate(seqs, 2, 0, tok.pad_token_id, tree)
            got = grpo.token_logps(model, micro, 0.7)
            assert micro["n_tokens"].tolist() == [e.sampled for e in eps]
            flat = torch.cat(want)
            assert got.shape == flat.shape
            assert torch.allclose(got, flat, atol=2e-5), (tree, (got - flat).abs().max())
            assert micro["targets"].tolist() == [y for e in eps for y in e.labels if y != IGNORE]


def build(tmp_path, extra=()):
    from workbench.run.runner import Runner
    from workbench.train.state import TrainState

    runner = Runner(compose([*ENV, "train.max_steps=3", *extra], tmp_path))
    runner.build()
    return runner, TrainState()


def test_rollout_batches_train_the_episodes_sampled_tokens(tmp_path):
    runner, state = build(tmp_path)
    method = runner.method
    assert method.episodes is not None and method.tree
    batch = method.next_batch(state, runner.backend)
    n_tok = sum(int(m["n_tokens"].sum()) for m in batch.micro)
    # the random tiny model never ends a turn within 8 tokens: every episode is one cut turn of 8
    # sampled tokens (no end-of-turn), and those are all the batch trains
    assert n_tok == 8 * method.shape.completions_per_rank and batch.info["episode/cut_max_new_tokens"] == 1.0
    assert {"episode/turns", "episode/answer_after_tool", "episode/sampled_tokens"} <= set(batch.info)
    assert (tmp_path / "samples" / "episodes.jsonl").exists()


def test_async_rollouts_use_the_behaviour_policys_logps(tmp_path):
    import copy

    runner, state = build(tmp_path, ["method.async_rollouts=true"])
    method, backend = runner.method, runner.backend
    live = backend.unwrapped()
    first = method.next_batch(state, backend)
    with torch.no_grad():  # step 0 is generated at once, on-policy: the behaviour policy is the live one
        for m in first.micro:
            assert torch.equal(m["old_logps"], grpo.token_logps(live, m, method.cfg.temperature))
    behaviour = copy.deepcopy(live)  # the weights step 1's rollout is sampling with right now
    with torch.no_grad():  # "train" step 0: the live weights move on
        for p in live.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    state.step = 1
    second = method.next_batch(state, backend)
    with torch.no_grad():
        for m in second.micro:
            old = grpo.token_logps(behaviour, m, method.cfg.temperature)
            now = grpo.token_logps(live, m, method.cfg.temperature)
            assert torch.allclose(m["old_logps"], old, atol=1e-6)  # the behaviour policy's log-probs ...
            assert not torch.allclose(m["old_logps"], now, atol=1e-3)  # ... not the policy being trained
    method._async.close()


def test_grpo_env_runs_and_evaluates(tmp_path):
    res = train([*ENV, "train.max_steps=2", "eval.at_end=true", "eval.tasks=[env]", "eval.num_samples=4",
                 "method.async_rollouts=true"], tmp_path)
    assert len(res["losses"]) == 2
    end = res["eval_end"]
    assert end["eval/env/n"] == 4 and 0.0 <= end["eval/env/accuracy"] <= 1.0 and "eval/env/answer_after_tool" in end


def test_preview_shows_an_episode_with_its_trained_tokens(tmp_path, capsys):
    from workbench.cli import run_job

    out = run_job(compose(["method=grpo", "env=calc", "data.preview=true", "data.preview_samples=1"], tmp_path,
                          validate=False))
    text = out["preview"][0]["text"]
    assert out["preview"][0]["turns"] == 2
    trained = [part.split("⟧")[0] for part in text.split("⟦")[1:]]
    assert len(trained) == 2 and trained[0].startswith("<tool_call>{") and trained[0].endswith("</tool_call><|im_end|>")
    assert trained[1].removesuffix("<|im_end|>").isdigit()
    assert "⟦" not in text.split("<|im_start|>assistant")[0]  # prompt and tools: context
    assert "episodes of its demonstrations" in capsys.readouterr().out
