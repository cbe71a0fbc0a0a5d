"""Evaluation hooks as a registry: built-ins on the held-out split (loss, preference, reward,
generate), the arith tasks, and a user's `module:function`, whose metrics reach metrics.jsonl
and the report; a hook that raises names itself and the step, and the checkpoint is kept.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_eval_registry.py
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys

import pytest

from tests.conftest import compose, train
from tests.tolerances import f32_roundings
from workbench.core.errors import UserError
from workbench.evals.hooks import EvalHookError, check_tasks

HOOKS = '''
def answer_len(ctx):
    out = ctx.generate(["Say hi"], max_new_tokens=3)
    return {"chars": len(out[0]), "seen_step": ctx.step}

def boom(ctx):
    if ctx.step >= 2:
        raise RuntimeError("the metric server is down")
    return {"ok": 1}
'''
HH = "\n\nHuman: {q}\n\nAssistant: {a}"
ON = ["eval.at_start=true", "eval.at_end=true"]  # the test baseline has eval=none


@pytest.fixture
def hook_module(tmp_path, monkeypatch):
    (tmp_path / "my_eval_hooks.py").write_text(HOOKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_eval_hooks"
    sys.modules.pop("my_eval_hooks", None)


@pytest.fixture
def chat_file(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"item {i}?"},
                                                  {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
                         for i in range(24)))
    return f


def test_unknown_and_unimportable_tasks_are_one_line(hook_module):
    with pytest.raises(UserError, match=r"unknown task 'los'.*'loss'"):
        check_tasks(["los"])
    with pytest.raises(UserError, match="cannot import module 'no_such_mod'"):
        check_tasks(["no_such_mod:f"])
    with pytest.raises(UserError, match="has no function 'nope'"):
        check_tasks([f"{hook_module}:nope"])
    check_tasks(["loss", "generate", "arith_add2", f"{hook_module}:answer_len"])


def test_builtins_check_the_run_before_weights_load(chat_file):
    from workbench.run import preflight

    with pytest.raises(UserError, match="needs held-out rows; set data.eval_split"):
        preflight.check(compose(["eval.tasks=[loss]"]))  # a named recipe has no split unless asked
    with pytest.raises(UserError, match="is for method=sft, distill; with method=dpo use 'preference'"):
        preflight.check(compose([f"data.path={chat_file}", "data.eval_split=4", "method=dpo", "eval.tasks=[loss]"]))
    with pytest.raises(UserError, match="needs eval.prompts"):
        preflight.check(compose(["eval.tasks=[generate]"]))


def test_a_malformed_eval_prompts_file_names_its_line(tmp_path):
    """eval.prompts=<file>.jsonl goes through the data reader: every problem names file:line,
    before any weights load (preflight checks the task)."""
    from workbench.evals.builtin import prompts

    f = tmp_path / "prompts.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"prompt": "2+2="}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert prompts(compose(["eval.tasks=[generate]", f"eval.prompts={f}"]).eval) == [
        [{"role": "user", "content": "2+2="}], [{"role": "user", "content": "hi"}]]  # a BOM, a blank line
    f.write_text('{"prompt": "2+2="}\n{"prompt": "3+3=",}\n')
    with pytest.raises(UserError, match=rf"^{re.escape(str(f))}:2: malformed JSON .*one JSON object per line"):
        check_tasks(["generate"], compose(["eval.tasks=[generate]", f"eval.prompts={f}"]))
    f.write_text('{"prompt": "2+2="}\n{"question": "3+3="}\n')
    with pytest.raises(UserError, match=rf"^{re.escape(str(f))}:2: expected"):
        check_tasks(["generate"], compose(["eval.tasks=[generate]", f"eval.prompts={f}"]))
    f.write_text('{"prompt": "2+2="}\n{"prompt": "3+')
    with pytest.raises(UserError, match=rf"^{re.escape(str(f))}:2: the last line is truncated"):
        check_tasks(["generate"], compose(["eval.tasks=[generate]", f"eval.prompts={f}"]))


def test_sft_loss_generate_and_user_hook_reach_metrics_and_report(chat_file, hook_module, tmp_path):
    out = tmp_path / "run"
    res = train([f"data.path={chat_file}", "data.eval_split=0.25", "train.max_steps=2", "eval.every_n_steps=1",
                 f"eval.tasks=[loss,generate,{hook_module}:answer_len]", "eval.prompts=[Hello there]",
                 "eval.generate_max_new_tokens=4", *ON], out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval" in r]
    assert [(r["step"], r["eval"]) for r in evals] == [(0, "start"), (1, "step"), (2, "step"), (2, "end")]
    for r in evals:
        assert r["eval/loss/n"] == 6 and math.isclose(r["eval/loss/perplexity"], math.exp(r["eval/loss/loss"]))
        assert r["eval/answer_len/seen_step"] == r["step"]
    assert evals[0]["eval/loss/loss"] != evals[-1]["eval/loss/loss"]  # the model changed in between
    assert len([r for r in rows if "loss" in r]) == 2  # training rows are untouched
    report = (out / "report.md").read_text()
    assert "| answer_len/seen_step | 0 | 2 |" in report and "| loss/loss |" in report
    assert "**Hello there**" in report and "- before:" in report and "- after:" in report
    assert res["eval_end"]["generations"][0]["prompt"] == "Hello there"


def test_a_raising_hook_names_itself_and_the_step_and_keeps_the_checkpoint(hook_module, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(EvalHookError, match=rf"eval hook '{hook_module}:boom' raised at step 2 .*metric server "
                                            r"is down.*checkpoint is kept: .*step-00000002"):
        train(["train.max_steps=4", "eval.every_n_steps=1", f"eval.tasks=[{hook_module}:boom]"], out)
    assert (out / "checkpoints" / "step-00000002").is_dir()


def test_dpo_preference_on_held_out_pairs(tmp_path):
    f = tmp_path / "hh.jsonl"
    f.write_text("".join(json.dumps({"chosen": HH.format(q=f"q{i}", a=f"good {i}"),
                                     "rejected": HH.format(q=f"q{i}", a="bad")}) + "\n" for i in range(12)))
    res = train([f"data.path={f}", "data.eval_split=4", "method=dpo", "train.max_steps=2",
                 "eval.tasks=[preference]", "optim.lr=1e-2", *ON], tmp_path / "run")
    start, end = res["eval_start"], res["eval_end"]
    assert start["eval/preference/n"] == 4
    # LoRA starts as the identity: policy == reference, every reward and margin is 0
    assert start["eval/preference/margin"] == 0.0 and start["eval/preference/accuracy"] == 0.0
    assert end["eval/preference/margin"] != 0.0 and "eval/preference/chosen_reward" in end


def test_grpo_reward_of_greedy_completions(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"What is {i} + 1? Answer with the number only.",
                                     "answer": str(i + 1)}) + "\n" for i in range(10)))
    # arith_exact is 0 on the random tiny model's text; char_length (len / 50) has spread
    res = train([f"data.path={f}", "data.eval_split=3", "method=grpo", "train.max_steps=1",
                 'reward.functions=[arith_exact,"tests.rewards:char_length"]',
                 "eval.tasks=[reward]", "eval.at_end=true", "method.max_new_tokens=4"], tmp_path / "run")
    end = res["eval_end"]
    samples = end["samples"]["reward"]
    assert end["eval/reward/n"] == 3 and len(samples) == 3  # every held-out prompt is reported
    # each sample's reward is the functions' sum on its completion, recomputed here from the text
    answers = {f"What is {i} + 1? Answer with the number only.": str(i + 1) for i in range(10)}
    exact = [float(s["completion"].strip() == answers[s["prompt"]]) for s in samples]
    length = [len(s["completion"]) / 50.0 for s in samples]
    assert any(length), samples  # the completions are not all empty: the check below has values
    # the evaluation scores in float32: a cast, a sum of 2 and a mean of 3 (tests/tolerances.py)
    rtol = f32_roundings(6)
    for s, e, n in zip(samples, exact, length):
        assert s["reward"] == pytest.approx(e + n, rel=rtol), s
    # the reported means are the means over those prompts
    assert end["eval/reward/arith_exact"] == pytest.approx(sum(exact) / 3, rel=rtol)
    assert end["eval/reward/tests.rewards:char_length"] == pytest.approx(sum(length) / 3, rel=rtol)
    assert end["eval/reward/mean"] == pytest.approx((sum(exact) + sum(length)) / 3, rel=rtol)


PEAK = '''
def peak(ctx):
    return {"score": -abs(ctx.step - 1)}  # best right after the first step
'''


def test_keep_best_keeps_the_best_evaluated_checkpoint_apart_and_exports_it(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from workbench.checkpoints.canonical import read_all

    (tmp_path / "peak_hook.py").write_text(PEAK)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    res = train(["train.max_steps=3", "eval.every_n_steps=1", "train.checkpoint_every=1", "train.keep_checkpoints=1",
                 "eval.tasks=[peak_hook:peak]", "train.keep_best=peak/score", "train.export_best=true",
                 "train.export=true", "train.export_merged=false", "optim.lr=1e-2", *ON], out)
    sys.modules.pop("peak_hook", None)
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000003"]  # rolling: only the last
    best = json.loads((ckpts / "best" / "best.json").read_text())  # the record moves with the weights
    assert best["step"] == 1 and best["mode"] == "max" and best["value"] == 0
    kept = {k[6:]: t for k, t in read_all(ckpts / "best" / "canonical").items() if k.startswith("model/")}
    last = read_all(ckpts / "step-00000003" / "canonical")
    assert any(not (kept[k] == last[f"model/{k}"]).all() for k in kept)
    exported = load_file(out / "export" / "adapter" / "adapter_model.safetensors")
    total = lambda d: sorted(round(float(t.double().abs().sum()), 6) for t in d.values())  # noqa: E731
    assert res["exported_from"].endswith("best") and total(exported) == total(kept)


def test_keep_best_is_checked_before_training(chat_file):
    from workbench.run import preflight

    base = [f"data.path={chat_file}", "data.eval_split=4", "eval.tasks=[loss]"]
    with pytest.raises(UserError, match=r"train.keep_best='acc/x'.*eval.tasks=\['loss'\]"):
        preflight.check(compose([*base, "train.keep_best=acc/x"]))
    with pytest.raises(UserError, match="multiple of train.checkpoint_every"):
        preflight.check(compose([*base, "train.keep_best=loss/loss", "eval.every_n_steps=3",
                                 "train.checkpoint_every=2"]))
    from workbench.checkpoints.keep_best import mode_of

    assert mode_of("eval/loss/loss", "auto") == "min" and mode_of("eval/preference/accuracy", "auto") == "max"


MC_TASK = """task: my_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def test_lm_eval_is_an_optional_extra_checked_before_weights_load(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    with pytest.raises(UserError, match=r"'lm-eval' is not installed.*\.\[eval\]"):
        check_tasks(["lm_eval:arc_easy"])


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                    reason="lm-eval is an optional extra (.[eval]) and is not installed")
def test_lm_eval_task_file_is_checked_before_weights_load(tmp_path):
    with pytest.raises(UserError, match="task file not found"):
        check_tasks([f"lm_eval:{tmp_path / 'none.yaml'}"])


@pytest.mark.slow
def test_lm_eval_local_task_in_process_equals_its_cli_on_the_merged_export(tmp_path):
    """A local task YAML over a local jsonl (no downloads): in-process after training, then
    lm-eval's own CLI on export/merged with the same task and limit."""
    import os
    import subprocess

    pytest.importorskip("lm_eval")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tasks / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} plus {i}?", "choices": [str(2 * i), str(i), "7"],
                                        "label": 0}) + "\n" for i in range(16)))
    (tasks / "my_mc.yaml").write_text(MC_TASK.format(data=data))
    out = tmp_path / "run"
    res = train(["train.max_steps=2", "optim.lr=1e-2", f"eval.tasks=[lm_eval:{tasks / 'my_mc.yaml'}]",
                 "eval.lm_eval.limit=12", "eval.lm_eval.batch_size=4", "train.export=true", "eval.at_end=true"], out)
    mine = {k: v for k, v in res["eval_end"].items() if k.startswith("eval/lm_eval/my_mc/")}
    assert set(mine) == {"eval/lm_eval/my_mc/acc", "eval/lm_eval/my_mc/acc_norm"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "HF_DATASETS_OFFLINE": "1"}
    cli = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                          f"pretrained={out / 'export' / 'merged'},dtype=float32", "--tasks", "my_mc",
                          "--include_path", str(tasks), "--limit", "12", "--batch_size", "4", "--seed", "0",
                          "--output_path", str(tmp_path / "cli")], env=env, capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr[-2000:]
    found = sorted((tmp_path / "cli").rglob("results*.json"))
    theirs = json.loads(found[-1].read_text())["results"]["my_mc"]
    assert mine["eval/lm_eval/my_mc/acc"] == theirs["acc,none"]
    assert mine["eval/lm_eval/my_mc/acc_norm"] == theirs["acc_norm,none"]


def test_needle_found_tells_a_sentence_from_a_miss(monkeypatch):
    """`needle`'s exact match counts only the bare code; `found` also counts the code given in a
    sentence, and neither counts a wrong code or a code that merely contains the right digits."""
    from types import SimpleNamespace

    from workbench.evals import hooks

    rows = hooks.eval_rows("needle", 4)
    texts = [rows[0]["answer"], f"The access code of Station X is {rows[1]['answer']}.",
             "The access code of Station X is 1000.", f"{rows[3]['answer']}7"]
    monkeypatch.setattr(hooks, "generate", lambda model, tok, prompts, *a, **k: [[i] for i in range(len(prompts))])
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: texts[ids[0]])
    cfg = SimpleNamespace(num_samples=4, batch_size=4, max_new_tokens=24)
    res = hooks.exact_match(None, tok, SimpleNamespace(end_of_turn_id=0), "needle", cfg)
    assert res["eval/needle/accuracy"] == 0.25
    assert res["eval/needle/found"] == 0.5
    assert res["eval/needle/n"] == 4
