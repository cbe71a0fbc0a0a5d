"""method=distill: loss and gradients equal TRL's DistillationTrainer (and its GKD loss); the teacher's
tokenizer is checked before weights load; tiny runs train with and without on-policy steps.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_distill.py
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import ROOT, compose, train
from tests.tolerances import LOSS_RTOL, SELF_DIVERGENCE_ATOL, binomial_band, grad_atol
from workbench.core.errors import UserError
from workbench.data.chat import tokenize_chat
from workbench.methods import distill
from workbench.resolve.derive import derive

ROWS = ROOT / "data_recipes" / "data" / "arith_add2_train.jsonl"
TEMPERATURE = 0.7  # not 1, so the test sees where the temperature enters


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny student and a tiny teacher of the same architecture with another init seed, saved
    with the (shared) tokenizer, as TRL and `method.teacher` load them."""
    from workbench.data.chat import setup_tokenizer
    from workbench.models.load import load_model, load_tokenizer

    cfg = compose(["method=distill", "peft=none"])
    tok = load_tokenizer(cfg.model)
    contract = setup_tokenizer(tok)
    out = {}
    for name, seed in (("student", 0), ("teacher", 1)):
        model_cfg = compose(["method=distill", "peft=none", f"model.init_seed={seed}"]).model
        path = tmp_path_factory.mktemp(name)
        load_model(model_cfg).save_pretrained(path)
        tok.save_pretrained(path)
        out[name] = path
    return SimpleNamespace(tok=tok, contract=contract, **out)


def _examples(tiny):
    """Two rows each of two answer lengths; all prompts of one length (no left padding on TRL's side)."""
    by_length: dict[int, list] = {}
    for line in ROWS.read_text().splitlines():
        ids, labels = tokenize_chat(tiny.tok, json.loads(line)["messages"], tiny.contract)
        by_length.setdefault(len(ids) - distill.prompt_length(labels), []).append((ids, labels))
    short, long = sorted(by_length)[:2]
    out = by_length[short][:2] + by_length[long][:2]
    assert len(out) == 4 and len({distill.prompt_length(lab) for _, lab in out}) == 1
    return out


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.3, 1.0])  # 0.3: the mixture is not symmetric
def test_loss_and_grads_equal_trl(tiny, tmp_path, beta):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DistillationConfig, DistillationTrainer

    from workbench.data.collate import pad_batch
    from workbench.models.head import SelectiveLM

    examples = _examples(tiny)
    # TRL: its own trainer on the saved student and teacher, its loss on our token ids.
    args = DistillationConfig(output_dir=str(tmp_path / "trl"), beta=beta, temperature=TEMPERATURE, report_to=[],
                              use_cpu=True, bf16=False, per_device_train_batch_size=len(examples))
    trainer = DistillationTrainer(model=str(tiny.student), teacher_model=str(tiny.teacher), args=args,
                                  train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1?"}]}]),
                                  processing_class=tiny.tok)
    p = distill.prompt_length(examples[0][1])
    width = max(len(ids) for ids, _ in examples) - p
    completion = torch.full((len(examples), width), tiny.tok.pad_token_id)
    mask = torch.zeros_like(completion)
    for i, (ids, _) in enumerate(examples):
        completion[i, :len(ids) - p] = torch.tensor(ids[p:])
        mask[i, :len(ids) - p] = 1
    inputs = {"prompt_ids": torch.tensor([ids[:p] for ids, _ in examples]),
              "prompt_mask": torch.ones(len(examples), p, dtype=torch.long),
              "completion_ids": completion, "completion_mask": mask}
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, inputs)
    trl_loss.backward()
    trl_grads = {n: q.grad.clone() for n, q in trainer.model.named_parameters() if q.grad is not None}

    # Ours: the method's loss with the teacher it loads itself, divided by the token count as the backend does.
    cfg = compose(["method=distill", "peft=none", f"method.teacher={tiny.teacher}", f"method.beta={beta}",
                   f"method.temperature={TEMPERATURE}"])
    ctx = SimpleNamespace(cfg=cfg, run=derive(cfg), tokenizer=tiny.tok, contract=tiny.contract, device="cpu")
    method = distill.Distill(cfg.method, ctx)
    method.teacher_cfg = distill.teacher_config(cfg.method.teacher, cfg.model)
    method.attach(None)
    model = AutoModelForCausalLM.from_pretrained(tiny.student, dtype=torch.float32)
    micro = pad_batch(examples, tiny.tok.pad_token_id)
    n_tokens = int(micro["targets"].numel())
    assert n_tokens == int(mask.sum())
    method._step_tokens = float(n_tokens)
    loss_sum, metrics = method.loss(SelectiveLM(model).train(), micro)
    loss = loss_sum / n_tokens
    loss.backward()
    # two different models: a divergence 1000x what rounding leaves of a zero one (tests/tolerances.py)
    assert float(trl_loss.detach()) > 1000 * SELF_DIVERGENCE_ATOL
    assert float(loss.detach()) == pytest.approx(float(trl_loss.detach()), rel=LOSS_RTOL)
    ours = {n: q.grad for n, q in model.named_parameters() if q.grad is not None}
    assert set(ours) == set(trl_grads) and len(ours) > 10
    for n, g in ours.items():
        # TRL's chunked kernel sums in another order (analytic backward): tests/tolerances.py
        torch.testing.assert_close(g, trl_grads[n], rtol=LOSS_RTOL, atol=grad_atol(trl_grads[n]))
    assert 0 < metrics["entropy"] <= math.log(len(tiny.tok))


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_divergence_equals_gkd_loss(beta):
    """The per-token divergence summed and token-averaged is GKDTrainer.generalized_jsd_loss (labels -100 masked)."""
    from trl.experimental.gkd import GKDTrainer

    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 11, generator=g) * 3, torch.randn(2, 5, 11, generator=g) * 3
    labels = torch.tensor([[1, 2, 3, -100, -100], [4, 5, 6, 7, 8]])
    want = GKDTrainer.generalized_jsd_loss(s, t, labels=labels, beta=beta, temperature=TEMPERATURE)
    keep = labels != -100
    got = distill.generalised_jsd(s[keep], t[keep], beta, TEMPERATURE).sum() / keep.sum()
    torch.testing.assert_close(got, want, rtol=LOSS_RTOL, atol=0)
    # a teacher equal to the student is no divergence at all
    assert float(distill.generalised_jsd(s[keep], s[keep], beta, TEMPERATURE).abs().max()) <= SELF_DIVERGENCE_ATOL


def test_prompt_length_is_before_the_last_trained_span():
    x = -100
    assert distill.prompt_length([x, x, 5, 6, x, x, 7, 8]) == 6  # multi-turn: earlier turns are context
    assert distill.prompt_length([x, x, x, 9]) == 3
    assert distill.prompt_length([1, 2, 3]) == 0  # plain text: no prompt


# -- the teacher -------------------------------------------------------------------------------
def _teacher_without_weights(tiny, tmp_path, extra_token=None, vocab=None, stand_in=True):
    """A teacher directory with config.json and tokenizer files but no real weights: a check that
    passes it on to loading fails there, so these tests prove the check runs before weights load.
    `stand_in`: a one-tensor model.safetensors, so the directory passes the check that weights
    exist (workbench/models/local_path.py) and the check under test is the one that answers."""
    import copy

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    d = tmp_path / "teacher"
    config = AutoConfig.from_pretrained(tiny.teacher)
    if vocab is not None:
        config.vocab_size = vocab
    config.save_pretrained(d)
    tok = copy.deepcopy(tiny.tok)
    if extra_token:
        tok.add_tokens([extra_token])
    tok.save_pretrained(d)
    if stand_in:
        save_file({"stand_in": torch.zeros(1)}, str(d / "model.safetensors"))
    return d


def test_teacher_with_another_tokenizer_is_refused_before_weights_load(tiny, tmp_path):
    d = _teacher_without_weights(tiny, tmp_path, extra_token="<|teacher_only|>")
    with pytest.raises(UserError, match=r"teacher .*teacher.* and student model=tiny have different tokenizers "
                                        r"\(49153 vs 49152 tokens; e.g. '<\|teacher_only\|>' only in the teacher"):
        train(["method=distill", f"method.teacher={d}", "train.max_steps=1"], tmp_path / "run")


def test_teacher_with_another_logit_width_is_refused(tiny, tmp_path):
    d = _teacher_without_weights(tiny, tmp_path, vocab=49216)
    with pytest.raises(UserError, match=r"49216 output logits and student model=tiny 49152"):
        train(["method=distill", f"method.teacher={d}", "train.max_steps=1"], tmp_path / "run")


def test_teacher_without_weights_is_a_user_error(tiny, tmp_path):
    d = _teacher_without_weights(tiny, tmp_path, stand_in=False)  # same tokenizer: passes that check
    with pytest.raises(UserError, match=r"method.teacher=.*has config.json but no weights"):
        train(["method=distill", f"method.teacher={d}", "train.max_steps=1"], tmp_path / "run")


@pytest.mark.parametrize("overrides, pattern", [
    ([], r"method=distill needs method.teacher"),
    (["method.teacher=/nonexistent/teacher"], r"method.teacher='/nonexistent/teacher': not a directory"),
    (["method.teacher={empty}"], r"no config.json in .*merged or .*export/merged"),
    (["method.teacher=tiny", "method.beta=1.5"], r"method.beta must be in \[0, 1\]"),
    (["method.teacher=tiny", "method.lmbda=-0.1"], r"method.lmbda must be in \[0, 1\]"),
    (["method.teacher=tiny", "method.temperature=0"], r"method.temperature must be > 0"),
    (["method.teacher=tiny", "data.packing=true"], r"data.packing=false"),
])
def test_bad_options(tmp_path, overrides, pattern):
    (tmp_path / "empty").mkdir()
    overrides = [o.format(empty=tmp_path / "empty") for o in overrides]
    with pytest.raises(UserError, match=pattern):
        train(["method=distill", "train.max_steps=1", *overrides], tmp_path / "run")


# -- runs ----------------------------------------------------------------------------------------
def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("peft", ["none", "lora"])
@pytest.mark.parametrize("lmbda", [0, 1])
def test_trains(tiny, tmp_path, peft, lmbda):
    base = ["method=distill", f"peft={peft}", f"method.teacher={tiny.teacher}", f"method.lmbda={lmbda}",
            "method.max_new_tokens=6", "train.max_steps=2", "train.resume=never"]
    res = train(base, tmp_path / "a")
    losses = res["losses"]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 1000 * SELF_DIVERGENCE_ATOL for x in losses)
    rows = _rows(tmp_path / "a")
    assert [r["on_policy"] for r in rows] == [float(lmbda)] * 2
    if lmbda:
        assert all(0 <= r["completion_length"] <= 6 for r in rows)
        # the student's samples repeat under the run's seed
        again = train(base, tmp_path / "b")["losses"]
        assert again == losses
    if peft == "none":
        assert losses[1] != losses[0]


def test_teacher_equal_to_student_gives_no_loss(tmp_path):
    """method.teacher=tiny (a conf/model/ entry) is the student's own initial model: nothing to learn."""
    res = train(["method=distill", "peft=lora", "method.teacher=tiny", "method.lmbda=0", "train.max_steps=1"],
                tmp_path)
    assert abs(res["losses"][0]) <= SELF_DIVERGENCE_ATOL


def test_on_policy_steps_follow_the_seed():
    cfg = compose(["method=distill", "method.teacher=tiny", "method.lmbda=0.5"])
    ctx = SimpleNamespace(cfg=cfg, run=derive(cfg))
    m = distill.Distill(cfg.method, ctx)
    draws = [m.on_policy(s) for s in range(400)]
    assert draws == [m.on_policy(s) for s in range(400)]  # a function of (seed, step)
    low, high = binomial_band(0.5, len(draws))  # 0.4 .. 0.6 for 400 draws
    assert low < sum(draws) / len(draws) < high
    other = compose(["method=distill", "method.teacher=tiny", "method.lmbda=0.5", "train.seed=1"])
    assert draws != [distill.Distill(other.method, SimpleNamespace(cfg=other, run=derive(other))).on_policy(s)
                     for s in range(400)]
