"""method=kto: loss and gradients equal TRL's KTOTrainer; data shapes; batching across ranks; errors.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_kto.py
"""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import ROOT, compose, train
from tests.tolerances import LOSS_RTOL, grad_atol
from workbench.core.errors import UserError
from workbench.data.recipes import Source
from workbench.data.unpaired import tokenise_unpaired, unpaired_rows
from workbench.methods import kto
from workbench.resolve.derive import derive

PAIRS = ROOT / "data_recipes" / "data" / "arith_dpo_train.jsonl"
DATA = SimpleNamespace(on_bad_row="error", seq_len=256)


def _rows(n: int) -> list[dict]:
    return [json.loads(line) for line in PAIRS.read_text().splitlines()[:n]]


def _unpaired(labels: list[bool]) -> list[dict]:
    """Conversational unpaired rows from the shipped pairs: row i's chosen or rejected by labels[i]."""
    return [{"prompt": r["prompt"], "completion": [{"role": "assistant", "content": r["chosen" if good else "rejected"]}],
             "label": good} for r, good in zip(_rows(len(labels)), labels)]


def _write(path, rows: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model saved twice (TRL loads from directories): `policy`, and `ref`, the same
    weights moved by a fixed perturbation, so that the log-ratios and the KL reference point are
    not zero as they are at initialisation. Random perturbations of this model lower the
    log-probs of the shipped completions, so with the perturbed weights as the reference the
    KL estimate is well above its clamp at 0 (about 2; the test asserts it). Both sides use a chat template that ends an
    assistant turn at its end-of-turn token: TRL counts everything after the generation prompt
    as the completion, the trailing newline of the default template included, which the
    workbench never trains (chat.py); without it the two tokenisations are the same."""
    from workbench.data.chat import setup_tokenizer
    from workbench.models.load import load_model, load_tokenizer

    cfg = compose(["method=kto", "peft=none"])
    tok = load_tokenizer(cfg.model)
    old = "'<|im_end|>' + '\n'"  # the template's quoted newline is a newline character
    assert old in tok.chat_template
    tok.chat_template = tok.chat_template.replace(old, "'<|im_end|>' + ('' if message['role'] == 'assistant' else '\n')")
    contract = setup_tokenizer(tok)
    ref, policy = tmp_path_factory.mktemp("ref"), tmp_path_factory.mktemp("policy")
    model = load_model(cfg.model)
    model.save_pretrained(policy)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(2.0 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    model.save_pretrained(ref)
    for d in (ref, policy):
        tok.save_pretrained(d)
    return SimpleNamespace(cfg=cfg, tok=tok, contract=contract, ref=ref, policy=policy)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_loss_and_grads_equal_trl(tiny, tmp_path, loss_type, trl_on_cpu):
    """TRL tokenises, pairs for KL and collates the rows itself; ours reads the same rows from a file."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import KTOConfig, KTOTrainer

    from workbench.models.head import SelectiveLM

    beta, w_good, w_bad = 0.5, 1.3, 0.7
    rows = _unpaired([True, False, True, True, False])  # unbalanced, mixed order
    n = len(rows)
    args = KTOConfig(output_dir=str(tmp_path / "trl"), beta=beta, loss_type=loss_type, desirable_weight=w_good,
                     undesirable_weight=w_bad, report_to=[], use_cpu=True, bf16=False, max_length=None,
                     per_device_train_batch_size=n, gradient_checkpointing=False, dataset_num_proc=None)
    trainer = KTOTrainer(model=str(tiny.policy), ref_model=AutoModelForCausalLM.from_pretrained(tiny.ref),
                         args=args, train_dataset=Dataset.from_list(rows), processing_class=tiny.tok)
    prepared = [trainer.train_dataset[i] for i in range(n)]
    batch = trainer.data_collator(prepared)
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, batch)
    trl_loss.backward()
    trl_grads = {k: p.grad.clone() for k, p in trainer.model.named_parameters() if p.grad is not None}
    trl_kl = trainer._metrics["train"]["kl"][-1]

    # Ours: the same rows read from a file; the reference is the frozen copy attach makes of the
    # model as it is then (the `ref` weights), after which the policy gets the `policy` weights.
    examples = tokenise_unpaired(Source("rows", _write(tmp_path / "rows.jsonl", rows)), tiny.tok, tiny.contract,
                                 DATA).examples
    assert [(e.prompt, e.completion[0]) for e in examples] == [(r["prompt_ids"], r["completion_ids"]) for r in prepared]
    cfg = copy.deepcopy(tiny.cfg.method)
    OmegaConf.set_readonly(cfg, False)  # the loss under test reads these fields; set them by hand
    cfg.beta, cfg.loss_type, cfg.desirable_weight, cfg.undesirable_weight = beta, loss_type, w_good, w_bad
    method = kto.KTO(cfg, SimpleNamespace(cfg=tiny.cfg, run=derive(tiny.cfg)))
    model = AutoModelForCausalLM.from_pretrained(tiny.ref, dtype=torch.float32)
    policy = SelectiveLM(model).train()
    method.attach(SimpleNamespace(unwrapped=lambda: policy))
    model.load_state_dict(AutoModelForCausalLM.from_pretrained(tiny.policy, dtype=torch.float32).state_dict())
    micro = kto.collate(examples, tiny.tok.pad_token_id, DATA.seq_len, kl=loss_type == "kto")
    good = sum(r["label"] for r in rows)
    method._counts = (float(n), float(good), float(n - good))
    loss_sum, metrics = method.loss(policy, micro)
    loss = loss_sum / n  # what the backend divides by (StepBatch.denom)
    loss.backward()

    assert float(loss.detach()) == pytest.approx(float(trl_loss.detach()), rel=LOSS_RTOL)
    if loss_type == "kto":  # the KL reference point is in play (not clamped to 0) and equal
        assert trl_kl > 1.0
        assert metrics["kl"] == pytest.approx(trl_kl, rel=LOSS_RTOL)
    ours = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert set(ours) == set(trl_grads) and len(ours) > 10
    for k, g in ours.items():
        # summation order differs (index_add vs TRL's masked sums): tests/tolerances.py
        torch.testing.assert_close(g, trl_grads[k], rtol=LOSS_RTOL, atol=grad_atol(trl_grads[k]))


def test_kl_pairs_rotate_within_the_micro_batch(tiny, tmp_path):
    rows = _unpaired([True, False, True])
    ex = tokenise_unpaired(Source("r", _write(tmp_path / "r.jsonl", rows)), tiny.tok, tiny.contract, DATA).examples
    micro = kto.collate(ex, tiny.tok.pad_token_id, DATA.seq_len, kl=True)
    for i, other in enumerate([2, 0, 1]):
        want = ex[i].prompt + ex[other].completion[0]
        assert micro["kl_input_ids"][i, :len(want)].tolist() == want
        assert int(micro["kl_attention_mask"][i].sum()) == len(want)
    assert micro["label"].tolist() == [True, False, True]
    assert "kl_input_ids" not in kto.collate(ex, tiny.tok.pad_token_id, DATA.seq_len, kl=False)


def test_paired_and_unpaired_rows_normalise_alike(tiny, tmp_path):
    """A preference row (any accepted shape) is the desirable row then the undesirable one."""
    q = [{"role": "user", "content": "What is 2 + 2?"}]
    a4, a5 = [{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]
    paired = [{"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"},
              {"chosen": q + a4, "rejected": q + a5}]
    unpaired = [{"prompt": q, "completion": a4, "label": True}, {"prompt": "What is 2 + 2?", "completion": "5",
                                                                 "label": False}]
    read = lambda name, rows: tokenise_unpaired(Source(name, _write(tmp_path / f"{name}.jsonl", rows)),  # noqa: E731
                                                tiny.tok, tiny.contract, DATA)
    p, u = read("p", paired), read("u", unpaired)
    assert len(p.examples) == 4 and p.desirable == 2
    assert p.examples[:2] == p.examples[2:] == u.examples
    ids, labels = u.examples[0].completion
    trained = [t for t, lab in zip(ids, labels) if lab != -100]
    assert tiny.tok.decode(trained[:-1]) == "4" and trained[-1] == tiny.contract.end_of_turn_id
    assert [lab for lab in u.examples[0].completion[1]] == u.examples[0].completion[0]  # the whole completion trains


@pytest.mark.parametrize("row, message", [
    ({"prompt": "hi", "completion": "yo"}, r"r\.jsonl:1: unpaired row without \['label'\]"),
    ({"prompt": "hi", "completion": "yo", "label": 1}, r"r\.jsonl:1: 'label' must be true .* or false"),
    ({"prompt": "hi", "completion": [{"role": "user", "content": "yo"}], "label": True}, "end with an assistant"),
    ({"prompt": "hi", "answer": "yo"}, r"r\.jsonl:1: not an unpaired or preference row.*accepts.*label"),
])
def test_wrong_row_shapes_name_file_line(tiny, tmp_path, row, message):
    with pytest.raises(UserError, match=message):
        tokenise_unpaired(Source("r", _write(tmp_path / "r.jsonl", [row])), tiny.tok, tiny.contract, DATA)
    assert len(unpaired_rows({"prompt": "x", "chosen": "a", "rejected": "b"}, "here")) == 2


def test_sft_shaped_data_is_refused_with_schemas(tmp_path):
    sft = ROOT / "data_recipes" / "data" / "arith_add2_train.jsonl"
    recipe = tmp_path / "sft_auto.yaml"
    recipe.write_text(f"sources:\n  - path: {sft}\n")
    with pytest.raises(UserError, match=r"arith_add2_train.jsonl:1: not an unpaired or preference row \(this looks "
                                        r"like SFT data\).*accepts.*completion.*label.*chosen.*rejected"):
        train(["method=kto", f"method.recipe={recipe}", "train.max_steps=1"], tmp_path)
    with pytest.raises(UserError, match=r"format 'messages' is not usable.*completion.*label"):
        train(["method=kto", "method.recipe=arith_sft", "train.max_steps=1"], tmp_path)


def test_bad_kto_options(tmp_path):
    for ov, pat in [(["method.loss_type=sigmoid"], "loss_type"), (["method.reference=precomputed"], "precomputed"),
                    (["peft=none", "method.reference=adapter"], "adapter"), (["method.beta=0"], "beta"),
                    (["method.undesirable_weight=-1"], "undesirable_weight"),
                    (["train.micro_batch_size=1"], r"micro_batch_size >= 2")]:
        with pytest.raises(UserError, match=pat):
            train(["method=kto", "train.max_steps=1", *ov], tmp_path)


def test_micro_batches_do_not_depend_on_the_rank_count(tiny, tmp_path):
    """2 data-parallel ranks x 1 micro-batch hold exactly the micro-batches (hence the KL pairs)
    of 1 rank x grad_accum 2, and together the same global denominator."""
    recipe = tmp_path / "small.yaml"
    recipe.write_text(f"sources:\n  - path: {PAIRS}\n    max_samples: 40\n")

    def batches(accum: int, rank: int, world: int):
        cfg = compose(["method=kto", "peft=none", f"method.recipe={recipe}", "train.micro_batch_size=3",
                       f"train.grad_accum={accum}"])
        run = derive(cfg, rank=rank, world=world)
        ctx = SimpleNamespace(cfg=cfg, run=run, device="cpu", tokenizer=tiny.tok, contract=tiny.contract)
        method = kto.build(cfg.method, ctx)
        method.prepare(ctx)
        return [method.next_batch(SimpleNamespace(step=s), None) for s in range(2)]

    one, r0, r1 = batches(2, 0, 1), batches(1, 0, 2), batches(1, 1, 2)
    for step in range(2):
        assert one[step].denom == r0[step].denom + r1[step].denom == 6
        for ours, theirs in zip(one[step].micro, r0[step].micro + r1[step].micro):
            assert ours.keys() == theirs.keys() and "kl_input_ids" in ours
            assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_trains_on_the_shipped_pairs(tmp_path, peft):
    losses = train(["method=kto", f"peft={peft}", "train.max_steps=2"], tmp_path)["losses"]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    # policy = reference (the same arithmetic on the same weights), z = 0: exactly 1 - sigmoid(0) per example
    assert losses[0] == 0.5
    assert losses[1] != losses[0]


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_unpaired_held_out_rows_are_evaluated(tmp_path, peft):
    """KTO on the user's own unpaired rows with a held-out split: its default evaluation
    (`preference`, workbench/methods/spec.py) reads the held-out unpaired rows, before and after training, with no pairs
    to compare: the ranking accuracy of desirable over undesirable rewards starts at 0.5 (the
    policy is its own reference) and every metric is finite."""
    rows = _unpaired([i % 3 != 0 for i in range(40)])
    path = _write(tmp_path / "unpaired.jsonl", rows)
    res = train(["method=kto", f"peft={peft}", f"data.path={path}", "data.eval_split=12", "train.max_steps=2",
                 "train.micro_batch_size=4", "eval.tasks=[preference]", "eval.at_start=true", "eval.at_end=true"],
                tmp_path / "run")
    start, end = res["eval_start"], res["eval_end"]
    assert start["eval/preference/accuracy"] == 0.5 and start["eval/preference/margin"] == 0.0
    assert start["eval/preference/n"] == end["eval/preference/n"] == 12
    assert all(math.isfinite(v) for k, v in end.items() if k.startswith("eval/preference/"))
