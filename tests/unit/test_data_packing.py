"""Best-fit-decreasing packing: capacity and boundaries, packed loss == unpacked loss, fill, SFT run.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_data_packing.py
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import data_cfg, tiny_tokenizer
from tests.tolerances import F64_SUM_ATOL, LOSS_RTOL
from workbench.data import collate, packing, pair_tree
from workbench.data.chat import IGNORE


def test_bfd_respects_capacity_and_places_everything():
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(500)]
    bins, left = packing.best_fit_decreasing(lengths, 128)
    assert left == []
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    # best fit never opens a bin while an existing one has room: at most one bin is half empty
    assert sum(1 for b in bins if sum(lengths[i] for i in b) <= 64) <= 1
    assert len(bins) <= -(-sum(lengths) // 128) + 2  # within 2 bins of the volume bound here


def test_bfd_with_a_bin_limit_leaves_the_rest():
    bins, left = packing.best_fit_decreasing([60, 60, 60, 10], 70, max_bins=2)
    assert len(bins) == 2 and sorted(left) == [2] and sorted(i for b in bins for i in b) == [0, 1, 3]
    with pytest.raises(ValueError, match="exceeds the row capacity"):
        packing.best_fit_decreasing([65], 64)


def _examples():
    return [([5, 6, 7, 8], [IGNORE, IGNORE, 7, 8]), ([9, 10, 11], [9, 10, 11]), ([12, 13], [IGNORE, 13])]


def test_pack_rows_boundaries_positions_and_mask():
    b = collate.pack_rows([_examples()[:2], _examples()[2:]], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11], [12, 13, 0, 0, 0, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4]]
    # the first token of the second example (9) is not predicted from the end of the first one
    assert b["targets"].tolist() == [7, 8, 10, 11, 13]
    m = b["attention_mask"][0, 0]
    assert m[4, :4].sum() == 0 and m[4, 4] and m[6, 4:7].all() and not m[3, 4]
    assert b["real_tokens"] == 9
    flat = collate.pack_rows([_examples()[:2], _examples()[2:]], pad_id=0, layout="flat", mask="position_ids")
    assert flat["input_ids"].shape == (1, 9) and flat["attention_mask"] is None
    assert flat["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1]]


@pytest.mark.parametrize("mask", ["4d", "position_ids"])
def test_packed_loss_equals_unpacked_loss_on_the_tiny_model(mask):
    from tests.conftest import compose
    from workbench.models.head import SelectiveLM
    from workbench.models.load import load_model

    cfg = compose([])
    torch.manual_seed(0)
    lm = SelectiveLM(load_model(cfg.model, dtype=torch.float32, device="cpu")).eval()
    rng = random.Random(1)
    examples = []
    for n in (9, 14, 5, 21, 12, 7):
        ids = [rng.randrange(10, 4000) for _ in range(n)]
        labels = [IGNORE] * (n // 2) + ids[n // 2:]
        examples.append((ids, labels))

    def summed(batch):
        logits = lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch.get("position_ids"), select=batch["select"])
        return F.cross_entropy(logits.float(), batch["targets"], reduction="sum"), batch["targets"].numel()

    with torch.no_grad():
        ref, n_ref = summed(collate.pad_batch(examples, pad_id=0))
        bins, _ = packing.best_fit_decreasing([len(x) for x, _ in examples], 32)
        assert len(bins) < len(examples)  # really packed
        rows = [[examples[i] for i in b] for b in bins]
        packed = collate.pack_rows(rows, pad_id=0, mask=mask)
        packed.pop("real_tokens")
        got, n_got = summed(packed)
    assert n_got == n_ref
    # a sum of positive cross-entropies, each computed under another attention mask: tests/tolerances.py
    torch.testing.assert_close(got, ref, rtol=LOSS_RTOL, atol=0.0)


def _tiny_gemma3(window: int):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=window,
                           layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=256,
                           attn_implementation="sdpa")
    return Gemma3ForCausalLM(cfg).eval()


def test_packed_rows_keep_a_sliding_window_inside_each_example():
    """A tiny Gemma 3 whose local layers see 4 tokens, examples of up to 21: packed with the layout
    attention_layout picks for it, the loss equals the same examples unpacked; with a 4-D mask
    (what a model without a window gets) it does not, since that mask replaces the window."""
    from workbench.models.head import SelectiveLM

    model = _tiny_gemma3(window=4)
    assert packing.sliding_window(model.config) == 4
    lm = SelectiveLM(model)
    rng = random.Random(1)
    examples = []
    for n in (9, 14, 5, 21, 12, 7):
        ids = [rng.randrange(10, 4000) for _ in range(n)]
        examples.append((ids, [IGNORE] * (n // 2) + ids[n // 2:]))

    def summed(batch):
        logits = lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch.get("position_ids"), select=batch["select"])
        return F.cross_entropy(logits.float(), batch["targets"], reduction="sum")

    layout, mask = packing.attention_layout("sdpa", packing.sliding_window(model.config))
    assert (layout, mask) == ("rows", "position_ids") and packing.attention_layout("sdpa") == ("rows", "4d")
    with torch.no_grad():
        ref = summed(collate.pad_batch(examples, pad_id=0))
        bins, _ = packing.best_fit_decreasing([len(x) for x, _ in examples], 32)
        rows = [[examples[i] for i in b] for b in bins]
        packed = {m: summed({k: v for k, v in collate.pack_rows(rows, pad_id=0, layout=layout, mask=m).items()
                             if k != "real_tokens"}) for m in ("position_ids", "4d")}
    torch.testing.assert_close(packed["position_ids"], ref, rtol=LOSS_RTOL, atol=0.0)  # tests/tolerances.py
    # the 4-D mask lets the local layers see the whole example: the loss moves by far more than LOSS_RTOL
    assert abs(float(packed["4d"]) - float(ref)) > 100 * LOSS_RTOL * float(ref)


def test_real_token_fraction_on_the_embedded_mix(tmp_path):
    from workbench.data.pipeline import tokenise_recipe
    from workbench.data.recipes import load_recipe

    tokenizer, contract = tiny_tokenizer()
    src = tokenise_recipe(load_recipe("arith_sft"), tokenizer, contract, data_cfg(tmp_path))[0]
    lengths = src.examples.lengths().tolist()
    # arithmetic examples are 49-50 tokens, so a 256-token row holds at most 5: BFD reaches that bound
    bins, _ = packing.best_fit_decreasing(lengths, 256)
    assert len(bins) == -(-len(lengths) // 5)
    assert packing.fill_fraction(lengths, 4096) >= 0.97


def test_sft_trains_packed_and_logs_mix_and_fill(tmp_path):
    from tests.conftest import train

    res = train(["data.recipe=formats_demo", "data.packing=true", "data.pack_len=512", "train.max_steps=2",
                 "train.micro_batch_size=2", f"data.cache_dir={tmp_path / 'cache'}"], tmp_path / "run")
    assert len(res["losses"]) == 2 and all(x == x and x > 0 for x in res["losses"])
    import json

    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in rows if "pack/fill" in r][-1]
    mix = {k: v for k, v in step.items() if k.startswith("mix/")}
    assert len(mix) == 6 and sum(mix.values()) == pytest.approx(1.0, rel=0, abs=F64_SUM_ATOL * len(mix))
    assert step["pack/fill"] >= 0.9 and step["tokens"] > 0


def test_pad_free_packs_mixed_lengths_and_leaves_uniform_ones_padded():
    rng = random.Random(2)

    def ex(n):
        ids = [rng.randrange(10, 4000) for _ in range(n)]
        return ids, [IGNORE] * (n // 2) + ids[n // 2:]

    mixed = [ex(n) for n in (9, 14, 5, 21, 12, 7)]
    m = packing.pad_free(mixed, 0, "rows", "4d")
    # rows of 21 (the longest): 21 | 14+7 | 12+9 | 5, 4 x 21 positions instead of 6 x 21
    assert m is not None and m["input_ids"].shape == (4, 21)
    assert m["real_tokens"] == sum(len(x) for x, _ in mixed)
    padded = collate.pad_batch(mixed, 0)
    assert sorted(m["targets"].tolist()) == sorted(padded["targets"].tolist())  # the same targets
    flat = packing.pad_free(mixed, 0, "flat", "position_ids")
    assert flat["input_ids"].shape == (1, m["real_tokens"])
    assert packing.pad_free([ex(n) for n in (20, 21, 19, 21)], 0, "rows", "4d") is None  # nothing to save


def test_pad_free_sft_steps_equal_padded_ones(tmp_path, monkeypatch):
    """data.pad_free trains on each step's own examples, as padded batches do, so the curve is the
    padded one up to the rounding of another attention mask (tests/tolerances.py LOSS_RTOL); and
    the micro-batches the loss sees are packed: fewer rows and positions, the same targets and
    real tokens. The data: one long conversation and five short ones, all six in every step (a
    micro-batch is the whole file, reshuffled), so a row of the long one's width holds all five
    short ones (the embedded arithmetic data is near-uniform and is not packed)."""
    import json

    from tests.conftest import train
    from workbench.methods import sft

    def conv(question, answer):
        return json.dumps({"messages": [{"role": "user", "content": question},
                                        {"role": "assistant", "content": answer}]}) + "\n"

    data = tmp_path / "mixed.jsonl"
    data.write_text(conv("Tell me a story.", " ".join(f"word{i}" for i in range(60)))
                    + "".join(conv(f"Say {i}.", str(i)) for i in range(5)))
    seen: list[dict] = []
    loss = sft.SFT.loss

    def spy(self, model, micro):
        ids = micro["input_ids"]
        seen.append({"rows": ids.shape[0], "positions": ids.numel(), "packed": micro.get("position_ids") is not None,
                     "targets": int(micro["targets"].numel())})
        return loss(self, model, micro)

    monkeypatch.setattr(sft.SFT, "loss", spy)
    common = [f"data.path={data}", "train.max_steps=3", "train.micro_batch_size=6",
              f"data.cache_dir={tmp_path / 'cache'}", "data.share_prefix=false"]  # pad_free alone
    free = train([*common, "data.pad_free=true"], tmp_path / "free")
    free_micro, seen[:] = list(seen), []
    padded = train([*common, "data.pad_free=false"], tmp_path / "padded")
    assert free["losses"] == pytest.approx(padded["losses"], rel=LOSS_RTOL)

    assert len(free_micro) == len(seen) == 3  # one micro-batch a step
    assert all(m["rows"] == 6 and not m["packed"] for m in seen), seen
    assert all(m["packed"] and m["rows"] == 2 for m in free_micro), free_micro  # the long one | the five short
    assert all(3 * f["positions"] == s["positions"] for f, s in zip(free_micro, seen)), (free_micro, seen)
    assert [m["targets"] for m in free_micro] == [m["targets"] for m in seen]  # the same loss positions

    def tokens(run):
        return [json.loads(x)["tokens"] for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
                if "tokens" in x]

    assert tokens("free") == tokens("padded")  # the same real tokens each step


def test_prefix_tree_needs_a_prefix_worth_sharing():
    rng = random.Random(3)
    head = [rng.randrange(10, 4000) for _ in range(20)]
    alike = [(head + [rng.randrange(10, 4000) for _ in range(6)], [IGNORE] * 23 + [5, 6, 7]) for _ in range(4)]
    tree = pair_tree.prefix_tree(alike, 0, width=64)
    # 20 shared tokens once, then four branches of 6: one row of 44 positions instead of 4 x 26
    assert tree["input_ids"].shape == (1, 44) and tree["real_tokens"] == 44
    assert sorted(tree["targets"].tolist()) == sorted(collate.pad_batch(alike, 0)["targets"].tolist())
    rows = pair_tree.prefix_tree(alike, 0, width=32)  # no row past 32 tokens: two rows of 20 + 2 x 6
    assert rows["input_ids"].shape == (2, 32) and rows["real_tokens"] == 64
    unlike = [([rng.randrange(10, 4000) for _ in range(26)], [IGNORE] * 23 + [5, 6, 7]) for _ in range(4)]
    assert pair_tree.prefix_tree(unlike, 0, width=64) is None  # nothing in common: the padded batch stands
    assert pair_tree.prefix_tree(alike[:1], 0, width=64) is None


def test_shared_prefix_sft_steps_equal_padded_ones(tmp_path, monkeypatch):
    """data.share_prefix reads a micro-batch's common prefix (here a system prompt and the
    question's opening words) once, each example a branch of one tree row; every token sees
    the tokens and positions it sees in its own row, so the curve is the padded one up to the
    rounding of another attention mask (tests/tolerances.py LOSS_RTOL), from fewer positions."""
    import json

    from tests.conftest import train
    from workbench.methods import sft

    system = "You are a careful assistant. Answer every question with the number only, and nothing else."
    data = tmp_path / "alike.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"What is {i} + {i + 3}?"},
        {"role": "assistant", "content": str(2 * i + 3)}]}) + "\n" for i in range(8)))
    seen: list[dict] = []
    loss = sft.SFT.loss

    def spy(self, model, micro):
        seen.append({"positions": micro["input_ids"].numel(), "tree": "head_slot" in micro,
                     "targets": int(micro["targets"].numel())})
        return loss(self, model, micro)

    monkeypatch.setattr(sft.SFT, "loss", spy)
    common = [f"data.path={data}", "train.max_steps=3", "train.micro_batch_size=8", f"data.cache_dir={tmp_path / 'c'}"]
    shared = train([*common, "data.share_prefix=true"], tmp_path / "shared")
    shared_micro, seen[:] = list(seen), []
    padded = train([*common, "data.share_prefix=false"], tmp_path / "padded")
    assert shared["losses"] == pytest.approx(padded["losses"], rel=LOSS_RTOL)
    assert all(m["tree"] for m in shared_micro) and not any(m["tree"] for m in seen)
    assert all(2 * s["positions"] < p["positions"] for s, p in zip(shared_micro, seen)), (shared_micro, seen)
    assert [m["targets"] for m in shared_micro] == [m["targets"] for m in seen]
