"""Honest throughput: one step's FLOPs against a count by hand from the tiny model's shapes and
against PyTorch's own FLOP counter, and a tiny run that never logs MFU above 100%."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.conftest import compose, train
from workbench.compute.flops import FlopCount, _reference_weights
from workbench.resolve.derive import reference

# model=tiny (conf/model/tiny.yaml): 2 layers, hidden 64, 4 heads x 16, 2 kv heads, MLP 128,
# vocab 49152, tied embeddings. conf/peft/lora.yaml: r=16 on every block Linear.
H, KV, FF, V, L, R = 64, 32, 128, 49152, 2, 16
SHAPES = [(H, H), (H, KV), (H, KV), (H, H), (H, FF), (H, FF), (FF, H)]  # q k v o gate up down (in, out)
W = L * sum(i * o for i, o in SHAPES)  # 73,728 block weights
LORA = L * sum(R * (i + o) for i, o in SHAPES)  # 32,768 adapter weights (A: in x r, B: r x out)
QKV0 = sum(i * o for i, o in SHAPES[:3]) + 3 * R * H  # layer 0 q/k/v base + their LoRA A


def rope(shapes, head_dim: int = H // 4) -> int:
    """What PyTorch's counter sees besides the model FLOPs: each forward's rotary embedding
    multiplies its (rows, head_dim / 2, 1) inverse frequencies by its (rows, 1, seq) positions,
    2 x head_dim / 2 x seq FLOPs a row of position ids. `shapes`: each forward's position ids'
    (rows, seq); without position ids the model makes one row, shared by the batch."""
    return sum(rows * head_dim * seq for rows, seq in shapes)


def positions(micro: dict, key: str = "input_ids") -> tuple[int, int]:
    ids = micro[key]
    return (1, ids.shape[1]) if micro.get("position_ids") is None else tuple(micro["position_ids"].shape)


def hand_count(peft: str, rows: int, seq: int, selected: int) -> float:
    pos = rows * seq
    attention = L * 12 * H * seq * seq * rows  # QK^T and AV: 2 x 2*T*T*width forward, twice that backward
    if peft == "none":  # everything trains: forward 2, input grad 2, weight grad 2; the tied head too
        return 6 * W * pos + attention + 6 * H * V * selected
    # LoRA: the frozen base forward + input grad (4), adapters also their weight grad (6); the first
    # block's q/k/v (and their A) read the frozen embedding output, which needs no gradient; the
    # frozen head gets forward + input grad on the selected positions only.
    return 4 * W * pos + 6 * LORA * pos - 2 * QKV0 * pos + attention + 4 * H * V * selected


def _built(peft: str, tmp_path):
    from workbench.run.runner import Runner
    from workbench.train.state import TrainState

    cfg = compose([f"peft={peft}"], tmp_path / peft)
    runner = Runner(cfg)
    runner.build()
    return cfg, runner, runner.method.next_batch(TrainState(), runner.backend)


@pytest.mark.parametrize("peft", ["lora", "none"])
def test_step_flops_equal_a_count_by_hand_and_torch_flop_counter(peft, tmp_path):
    cfg, runner, batch = _built(peft, tmp_path)
    count = FlopCount.from_model(runner.model, runner.run)
    assert count.block_weights == W + (LORA if peft == "lora" else 0)
    by_hand = sum(hand_count(peft, m["input_ids"].shape[0], m["input_ids"].shape[1], int(m["select"].sum()))
                  for m in batch.micro)
    assert count.step(batch.micro) == by_hand
    # The head runs only where the loss is: far fewer positions than the batch has.
    assert int(batch.micro[0]["select"].sum()) < batch.micro[0]["input_ids"].numel() / 2

    with FlopCounterMode(display=False) as counter:  # what the matmuls of this step really did
        for m in batch.micro:
            loss, _ = runner.method.loss(runner.train_module, m)
            loss.backward()
    # equal once RoPE's position x frequency matmul, which is not a model FLOP, is added
    assert by_hand + rope(positions(m) for m in batch.micro) == counter.get_total_flops()


def test_kto_step_counts_its_reference_and_kl_passes(tmp_path):
    """KTO runs, besides forward + backward of its sequences, the reference forward of them and
    forward passes of policy and reference over the mismatched KL pairs (no gradient): the step's
    count is what PyTorch's counter sees in the loss plus the attention of those three no-grad
    passes, which run SDPA's CPU flash kernel, a kernel the counter has no formula for (the
    training pass runs the math kernel, which it counts)."""
    from workbench.run.runner import Runner
    from workbench.train.state import TrainState

    runner = Runner(compose(["method=kto", "peft=lora"], tmp_path))
    runner.build()
    batch = runner.method.next_batch(TrainState(), runner.backend)
    assert "kl_input_ids" in batch.micro[0]
    count = FlopCount.from_model(runner.model, runner.run)
    with FlopCounterMode(display=False) as counter:
        for m in batch.micro:
            loss, _ = runner.method.loss(runner.train_module, m)
            loss.backward()
    no_grad_attention = sum(L * 4 * H * ids.shape[1] ** 2 * ids.shape[0]  # QK^T and AV, forward
                            for m in batch.micro for ids in (m["input_ids"], m["kl_input_ids"], m["kl_input_ids"]))
    forwards = [positions(m, key) for m in batch.micro  # policy, reference, then both on the KL pairs
                for key in ("input_ids", "input_ids", "kl_input_ids", "kl_input_ids")]
    assert count.step(batch.micro) + rope(forwards) == counter.get_total_flops() + no_grad_attention


def test_per_token_matches_step_count_and_a_reference_pass_is_counted(tmp_path):
    cfg, runner, _ = _built("lora", tmp_path)
    count = FlopCount.from_model(runner.model, runner.run)
    ids = torch.zeros(3, 40, dtype=torch.long)
    sel = torch.zeros(3, 40, dtype=torch.bool)
    sel[:, 30:] = True
    assert count.step([{"input_ids": ids, "select": sel}]) == pytest.approx(3 * 40 * count.per_token(40, 0.25))
    dpo = compose(["method=dpo"], tmp_path / "dpo")
    assert _reference_weights(reference(dpo), count.block_weights, count.block_trainable) == W  # adapter off: the base
    pre = compose(["method=dpo", "method.reference=precomputed"], tmp_path / "pre")
    assert _reference_weights(reference(pre), count.block_weights, count.block_trainable) == 0
    with_ref = FlopCount(**{**count.__dict__, "ref_weights": W})
    assert with_ref.step([{"input_ids": ids, "select": sel}]) > count.step([{"input_ids": ids, "select": sel}])


def test_tiny_run_never_logs_mfu_above_100_percent(tmp_path):
    # The reproduction (bf16-mixed, the default precision) logged 100-500%.
    res = train(["precision=bf16-mixed", "train.max_steps=10", "train.micro_batch_size=8"], tmp_path)
    import json

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 10
    assert all(0 < r["mfu"] <= 1.0 for r in rows), [r["mfu"] for r in rows]
    assert all(r["flops"] > 0 for r in rows)
    assert res["peak_source"] == "measured matmul" and res["peak_flops"] > 0


@pytest.mark.slow
def test_smollm2_step_flops_equal_torch_flop_counter(tmp_path):
    """The same check on SmolLM2-135M (GQA, 30 layers, tied 49k head), LoRA, answer-only batch."""
    from workbench.run.runner import Runner
    from workbench.train.state import TrainState

    cfg = compose(["model=smollm2-135m", "train.micro_batch_size=2"], tmp_path)
    runner = Runner(cfg)
    runner.build()
    batch = runner.method.next_batch(TrainState(), runner.backend)
    count = FlopCount.from_model(runner.model, runner.run)
    with FlopCounterMode(display=False) as counter:
        for m in batch.micro:
            loss, _ = runner.method.loss(runner.train_module, m)
            loss.backward()
    assert count.step(batch.micro) + rope((positions(m) for m in batch.micro), head_dim=64) == \
        counter.get_total_flops()


@pytest.mark.parametrize("dedup", [False, True])
def test_rollout_forward_passes_equal_torch_flop_counter(dedup):
    """GRPO's rollouts are counted pass by pass (workbench/rollout/generate.py records them):
    the shared or HF prefill and one decode step per generated token, each attending to the
    tokens so far. Attention runs SDPA's math kernel here so that the counter sees it too."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from workbench.data.chat import setup_tokenizer
    from workbench.models.load import load_model, load_tokenizer
    from workbench.rollout.generate import generate

    cfg = compose(["method=grpo", "peft=none"])
    tok = load_tokenizer(cfg.model)
    eot = setup_tokenizer(tok).end_of_turn_id
    model = load_model(cfg.model)
    convs = [[{"role": "user", "content": t}] for t in ("What is 12 + 30?", "Hi", "What is 45 + 17? Be brief.")]
    forwards = []  # every forward reads the embedding: (rows, new positions)
    hook = model.get_input_embeddings().register_forward_hook(lambda m, a, o: forwards.append(tuple(a[0].shape)))
    passes = []
    torch.manual_seed(0)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = generate(model, tok, convs, 6, eot, do_sample=True, num_return_sequences=4, dedup=dedup, passes=passes)
    hook.remove()
    assert len(out) == 12
    assert [(f.rows, f.seq) for f in passes] == forwards
    assert [f.ctx for f in passes[1:]] == list(range(passes[1].ctx, passes[1].ctx + len(passes) - 1))
    count = FlopCount.from_model(model)
    assert count.passes(passes) + rope((f.rows, f.seq) for f in passes) == counter.get_total_flops()
    assert count.step([], passes) == count.passes(passes) > 0


def test_grpo_step_counts_its_rollout_once_per_generation(tmp_path):
    """A GRPO step's FLOPs include its rollout's passes; with num_iterations=2 the second
    optimisation step on the same rollout adds only its training."""
    from workbench.run.runner import Runner
    from workbench.train.state import TrainState

    runner = Runner(compose(["method=grpo", "method.num_iterations=2", "method.dynamic_sampling=false"], tmp_path))
    runner.build()
    first = runner.method.next_batch(TrainState(step=0), runner.backend)
    second = runner.method.next_batch(TrainState(step=1), runner.backend)
    assert second.micro is first.micro and second.forward_passes == []
    rows = runner.method.shape.completions_per_rank
    decode = [f for f in first.forward_passes if f.seq == 1 and f.rows == rows]
    assert decode, first.forward_passes  # one decode step per generated token, every row
    # num_iterations > 1: old log-probs, one forward per micro-batch, after the rollout
    olds = first.forward_passes[-len(first.micro):]
    assert [(f.rows, f.seq) for f in olds] == [tuple(m["input_ids"].shape) for m in first.micro]
    count = FlopCount.from_model(runner.model, runner.run)
    assert count.step(first.micro, first.forward_passes) > count.step(second.micro, second.forward_passes) > 0
