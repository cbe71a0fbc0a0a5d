"""GGUF export of a Gemma 3 text model (workbench/export/gguf.py): a random six-layer Gemma 3 (five
local layers with a 4-token window, one global) and a small SentencePiece vocabulary made here are
written as GGUF f32, then read back by transformers' GGUF loader and, where llama-cpp-python is
installed, by llama.cpp, on a text longer than the window.

    .venv/bin/python -m pytest -q tests/unit/test_gguf_export_gemma.py

The packaged Gemma 3 270M, trained and exported, is checked in llama.cpp by
scripts/method_seeds.py runs (docs/learning.md) and tests/integration/test_import_check.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.unit.test_gguf_tokenizer import _vocab
from workbench.export import gguf as to_gguf
from workbench.models import gguf_tokenizer as g

TEXT = "The quick The quick  The quick The"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    out = tmp_path_factory.mktemp("gemma")
    tok = g.spm_tokenizer(_vocab(), out / "merged")
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=256, query_pre_attn_scalar=256,
                           sliding_window=4, max_position_embeddings=256, bos_token_id=2, eos_token_id=1,
                           pad_token_id=0, tie_word_embeddings=True)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from their zero init, so that a missing 1 + w shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(out / "merged")
    path = to_gguf.write(out / "merged", out / "model-f32.gguf", "f32", eos_id=5)
    return model, tok, path


def _logprobs(logits, ids):
    lp = torch.log_softmax(torch.as_tensor(np.asarray(logits), dtype=torch.float32), -1)
    return [float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)]


def test_the_file_carries_the_sentencepiece_vocabulary_and_gemma_norms(exported):
    from gguf import GGUFReader

    model, tok, path = exported
    fields = GGUFReader(str(path)).fields
    read = g.read_vocab(str(path))  # the project's own reader of a GGUF's SentencePiece vocabulary
    assert fields["general.architecture"].contents() == "gemma3"
    made = _vocab()
    # every piece with its score and type; then the token transformers' GemmaTokenizer adds (<mask>),
    # as a control token matched whole
    assert read.model == "llama" and read.pieces == [*made.pieces, "<mask>"] and len(tok) == len(made.pieces) + 1
    assert read.scores[:-1] == made.scores and read.types == [*made.types, g.CONTROL]
    assert read.add_bos and not read.add_space_prefix
    assert fields["gemma3.attention.sliding_window"].contents() == 4
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 5  # the end-of-turn token given
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    norm = np.asarray(tensors["blk.0.attn_norm.weight"].data)
    expected = model.model.layers[0].input_layernorm.weight.detach().numpy() + 1.0
    assert np.allclose(norm, expected)  # llama.cpp multiplies by the weight; Gemma by 1 + weight


def test_transformers_reads_back_the_same_model(exported):
    from transformers import AutoModelForCausalLM

    model, tok, path = exported
    back = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    assert ids.shape[1] > 4  # past the sliding window
    with torch.no_grad():
        diff = (model(input_ids=ids).logits - back(input_ids=ids).logits).abs().max()
    assert diff < 1e-4, diff  # f32 written, f32 read: only the norms' + 1 - 1 rounds


def test_llama_cpp_reads_the_tokens_and_the_model_alike(exported):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp is the GGUF reference; `make` installs it")
    model, tok, path = exported
    ids = list(tok(TEXT)["input_ids"])
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    try:
        assert llm.tokenize(TEXT.encode(), add_bos=True, special=False) == ids  # <bos> added, whole "  "
        llm.eval(ids)
        theirs = _logprobs(llm.scores[: len(ids)], ids)
    finally:
        llm.close()
    with torch.no_grad():
        mine = _logprobs(model(input_ids=torch.tensor([ids])).logits[0], ids)
    worst = max(abs(a - b) for a, b in zip(mine, theirs, strict=True))
    # f32 in both: what is left is the order of sums in two engines (measured 1e-6 .. 1e-5); a
    # wrong window, norm or rope base moves a log-prob by 0.1 and more
    assert worst < 1e-3 and all(math.isfinite(x) for x in theirs), (worst, mine, theirs)


def test_a_query_scale_gguf_cannot_carry_is_refused(exported, tmp_path):
    import json
    import shutil

    from workbench.core.errors import UserError

    _, _, path = exported
    changed = tmp_path / "merged"
    shutil.copytree(path.parent / "merged", changed)
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config, "query_pre_attn_scalar": 64}))
    with pytest.raises(UserError, match="query_pre_attn_scalar=64 but head_dim=256"):
        to_gguf.write(changed, tmp_path / "x.gguf", "f32")
    assert not (tmp_path / "x.gguf").exists()
