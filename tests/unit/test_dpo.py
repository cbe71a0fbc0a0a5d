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

from tests.conftest import ROOT, saved_tiny, train
from tests.tolerances import LOSS_RTOL, grad_atol
from workbench.config.run import derive
from workbench.core.errors import UserError
from workbench.data.preference import Pair, pairs_from_rows, tokenise_preferences
from workbench.data.recipes import Source
from workbench.methods import dpo

PAIRS = ROOT / "data_recipes" / "data" / "arith_dpo_train.jsonl"


class TorchLogProb:
    """The math of TRL's Triton `ChunkedLogProbFunction` in plain torch (Triton is absent on CPU builds).

    TRL's trainers call it through their fused LM head for per-token log-probs; everything around it
    (batching, masks, reference handling, the loss) stays TRL's own code.
    """

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs):
        z = hidden @ weight.t() + (bias if bias is not None else 0)
        z = z.float() * logit_scale
        if softcap:
            z = softcap * torch.tanh(z / softcap)
        logp = torch.log_softmax(z / temperature, dim=-1)
        lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        p = logp.exp()
        return (lp,
                (-(p * logp).sum(-1)).detach() if "entropy" in outputs else None,
                torch.log((p * p).sum(-1)).detach() if "log_sum_sq_probs" in outputs else None,
                z.mean(-1).detach() if "mean_logits" in outputs else None,
                (z.argmax(-1) == targets) if "is_top1" in outputs else None)


@pytest.fixture
def trl_on_cpu(monkeypatch):
    import trl.trainer.utils as trl_utils

    if trl_utils._ChunkedLogProbFunction is None:
        monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", TorchLogProb)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model saved to a directory (TRL loads it from there) plus its tokenizer and contract."""
    return saved_tiny(tmp_path_factory, ["method=dpo", "peft=none"])


def _pairs(tiny, n=3, two_digit_chosen=False) -> list[Pair]:
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    if two_digit_chosen:  # equal chosen lengths: TRL's batch token-mean NLL = our mean of per-pair means
        rows = [r for r in rows if len(r["chosen"]) == 2]
    return pairs_from_rows(rows[:n], tiny.tok, tiny.contract)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "rpo"])
def test_loss_and_grads_equal_trl(tiny, tmp_path, loss_type, trl_on_cpu):
    """rpo: sigmoid plus rpo_alpha x the chosen NLL, which TRL spells loss_type=[sigmoid, sft]."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from workbench.models.head import SelectiveLM

    beta, alpha = 0.3, 0.7
    pairs = _pairs(tiny, two_digit_chosen=loss_type == "rpo")
    trl_losses = dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, alpha]) if loss_type == "rpo" else \
        dict(loss_type=[loss_type])
    # TRL: its own trainer on the saved model, its collator on our token ids, its loss.
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=beta, **trl_losses, report_to=[],
                     use_cpu=True, bf16=False, max_length=None, per_device_train_batch_size=len(pairs),
                     dataset_num_proc=None)
    row = {"prompt": [{"role": "user", "content": "1+1?"}], "chosen": [{"role": "assistant", "content": "2"}],
           "rejected": [{"role": "assistant", "content": "3"}]}
    trainer = DPOTrainer(model=str(tiny.path), args=args, train_dataset=Dataset.from_list([row]),
                         processing_class=tiny.tok)
    examples = [{"prompt_ids": p.chosen[0][:p.prompt_len], "chosen_ids": p.chosen[0][p.prompt_len:],
                 "rejected_ids": p.rejected[0][p.prompt_len:]} for p in pairs]
    batch = trainer.data_collator(examples)
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, batch)
    trl_loss.backward()
    trl_grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    # Ours: the method's own loss with a frozen-copy reference, divided by the pair count as the backend does.
    model = AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.float32)
    cfg = copy.deepcopy(tiny.cfg.method)
    OmegaConf.set_readonly(cfg, False)  # the loss under test reads these fields; set them by hand
    cfg.beta, cfg.loss_type = beta, "sigmoid" if loss_type == "rpo" else loss_type
    cfg.rpo_alpha = alpha if loss_type == "rpo" else 0.0
    ctx = SimpleNamespace(cfg=tiny.cfg, run=derive(tiny.cfg))  # the reference strategy as a run resolves it
    method = dpo.DPO(cfg, ctx)
    policy = SelectiveLM(model).train()
    method.attach(SimpleNamespace(unwrapped=lambda: policy))
    micro = dpo.collate(pairs, tiny.tok.pad_token_id)
    method._pairs_in_step = float(len(pairs))
    loss_sum, metrics = method.loss(policy, micro)
    loss = loss_sum / len(pairs)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(trl_loss.detach()), rel=LOSS_RTOL)
    ours = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(ours) == set(trl_grads) and len(ours) > 10
    for n, g in ours.items():
        # summation order differs (index_add vs TRL's masked sums): tests/tolerances.py
        torch.testing.assert_close(g, trl_grads[n], rtol=LOSS_RTOL, atol=grad_atol(trl_grads[n]))
    assert metrics["rewards/accuracies"] in (0.0, 1 / 3, 2 / 3, 1.0)


def test_label_smoothing_and_hinge_formulas():
    cfg = SimpleNamespace(loss_type="sigmoid", beta=0.5, label_smoothing=0.2)
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-1.0, -3.0, -2.0, -2.5))
    d = (pc - rc) - (pr - rr)
    want = -0.8 * torch.nn.functional.logsigmoid(0.5 * d) - 0.2 * torch.nn.functional.logsigmoid(-0.5 * d)
    torch.testing.assert_close(dpo.dpo_loss(pc, pr, rc, rr, cfg), want)
    cfg.loss_type, cfg.label_smoothing = "hinge", 0.0
    torch.testing.assert_close(dpo.dpo_loss(pc, pr, rc, rr, cfg), torch.relu(1 - 0.5 * d))


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
    recipe.write_text(f"sources:\n  - path: {PAIRS}\n    format: preference\n    max_samples: 24\n")
    base = ["method=dpo", "peft=none", "train.max_steps=2", f"method.recipe={recipe}", "train.resume=never"]
    a = train(base + ["method.reference=copy"], tmp_path / "a")["losses"]
    b = train(base + ["method.reference=precomputed"], tmp_path / "b")["losses"]
    assert a == pytest.approx(b, rel=1e-6)
    from workbench.core import cache

    cached = sorted((cache.root() / "ref_logps").glob("*/logps.safetensors"))
    assert cached
    c = train(base + ["method.reference=precomputed"], tmp_path / "c")["losses"]
    assert c == pytest.approx(b, rel=1e-6)
