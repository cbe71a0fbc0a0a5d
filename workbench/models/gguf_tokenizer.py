"""A GGUF's tokenizer as llama.cpp reads it, for GGUFs whose vocabulary is a SentencePiece model.

    vocab = read_vocab("gemma-3-270m-q4_k_m.gguf")    # pieces, scores, types, special ids, BOS/EOS rules
    tok = spm_tokenizer(vocab, out_dir)               # a transformers tokenizer saved in out_dir

transformers' own GGUF path rebuilds a SentencePiece vocabulary (`tokenizer.ggml.model = llama`:
Gemma, Llama 2, Mistral) as a BPE whose merges it guesses from the pieces; for Gemma 3 the
guess splits words into fragments ("The quick brown fox" -> The, ▁qu, ick, ▁b, ro, wn, ...) and
drops the `<bos>` the GGUF asks for (`tokenizer.ggml.add_bos_token`), so a model fine-tuned on
those ids would be trained on ids llama.cpp never produces. Here the GGUF's pieces, scores and
piece types go back into a SentencePiece model (BPE over the scores, byte fallback, the GGUF's
space-prefix rule), the format these vocabularies were made in, and transformers builds its
tokenizer from that. The import check (workbench/models/import_check.py) compares the ids with
llama.cpp's before anything trains on them.

GGUFs with a byte-level BPE vocabulary (`gpt2`: SmolLM2, Qwen, Llama 3) keep transformers'
conversion, whose ids match llama.cpp's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from workbench.families import registry as families
from workbench.families.spec import FamilySpec


def _family(vocab) -> FamilySpec:
    """The family a GGUF's architecture names (its tokenizer class and template); a plain
    SentencePiece family (LlamaTokenizer, no template) where none is known."""
    return families.by_any_name(vocab.family) or FamilySpec(model_type=vocab.family)


# tokenizer.ggml.model of a SentencePiece vocabulary (llama.cpp names the tokenizer kind after the
# first model that used it; every SentencePiece family writes it)
SENTENCEPIECE = "llama"
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types, the same numbers as SentencePiece's piece types


@dataclass
class Vocab:
    model: str  # tokenizer.ggml.model: llama (SentencePiece) | gpt2 (byte-level BPE) | ...
    family: str  # general.architecture
    pieces: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    types: list[int] = field(default_factory=list)
    special: dict = field(default_factory=dict)  # bos / eos / unk / pad -> id
    add_bos: bool = True
    add_eos: bool = False
    add_space_prefix: bool = True
    chat_template: str | None = None


def _array(fields, name: str) -> list:
    f = fields.get(name)
    return [] if f is None else [f.parts[i] for i in f.data]


def read_vocab(gguf) -> Vocab:
    """The tokenizer a GGUF describes (its `tokenizer.ggml.*` fields); `gguf`: its path, or a
    gguf.GGUFReader of it (reading a 262k-piece vocabulary takes ~25 s on 2 cores: once)."""
    from gguf import GGUFReader

    fields = (gguf if isinstance(gguf, GGUFReader) else GGUFReader(str(gguf))).fields

    def scalar(name: str, default=None):
        f = fields.get(name)
        return default if f is None else f.contents()

    vocab = Vocab(model=str(scalar("tokenizer.ggml.model", "")), family=str(scalar("general.architecture", "")))
    if vocab.model != SENTENCEPIECE:
        return vocab  # only SentencePiece vocabularies are rebuilt here
    vocab.pieces = [bytes(p).decode("utf-8", errors="replace") for p in _array(fields, "tokenizer.ggml.tokens")]
    vocab.scores = [float(s[0]) for s in _array(fields, "tokenizer.ggml.scores")] or [0.0] * len(vocab.pieces)
    vocab.types = [int(t[0]) for t in _array(fields, "tokenizer.ggml.token_type")] or [1] * len(vocab.pieces)
    for role in ("bos", "eos", "unknown", "padding"):
        value = scalar(f"tokenizer.ggml.{role}_token_id")
        if value is not None:
            vocab.special[{"unknown": "unk", "padding": "pad"}.get(role, role)] = int(value)
    vocab.add_bos = bool(scalar("tokenizer.ggml.add_bos_token", True))
    vocab.add_eos = bool(scalar("tokenizer.ggml.add_eos_token", False))
    vocab.add_space_prefix = bool(scalar("tokenizer.ggml.add_space_prefix", True))
    vocab.chat_template = scalar("tokenizer.chat_template")
    return vocab


def spm_model(vocab: Vocab) -> bytes:
    """The SentencePiece model (serialised ModelProto) of a GGUF's SentencePiece vocabulary."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    t = m.trainer_spec
    t.model_type = pb.TrainerSpec.BPE  # merges by piece score, as llama.cpp's SentencePiece tokenizer does
    t.vocab_size = len(vocab.pieces)
    t.byte_fallback = True  # <0x..> pieces for text the vocabulary has no piece for
    t.unk_id, t.bos_id, t.eos_id = (vocab.special.get(k, -1) for k in ("unk", "bos", "eos"))
    t.pad_id = vocab.special.get("pad", -1)
    n = m.normalizer_spec
    n.name = "identity"  # llama.cpp applies no normalisation beyond spaces -> ▁
    n.add_dummy_prefix = vocab.add_space_prefix
    n.remove_extra_whitespaces = False
    n.escape_whitespaces = True
    for piece, score, kind in zip(vocab.pieces, vocab.scores, vocab.types, strict=True):
        p = m.pieces.add()
        p.piece, p.score, p.type = piece, score, kind
    return m.SerializeToString()


def spm_tokenizer(vocab: Vocab, out_dir: str | Path):
    """Write the vocabulary's SentencePiece model and tokenizer settings into `out_dir`, and
    return the transformers tokenizer built from them (saved there as tokenizer.json too)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.model").write_bytes(spm_model(vocab))
    name = {k: vocab.pieces[i] for k, i in vocab.special.items() if 0 <= i < len(vocab.pieces)}
    # the turn markers and other control pieces written as <...> in text: matched whole, as
    # llama.cpp matches them in a chat template's output
    markers = [p for p, kind in zip(vocab.pieces, vocab.types, strict=True)
               if kind in (CONTROL, USER_DEFINED) and p.startswith("<") and p.endswith(">")
               and p not in name.values() and not p.startswith("<unused")]
    family = _family(vocab)
    config = {"tokenizer_class": family.tokenizer_class,
              "add_bos_token": vocab.add_bos, "add_eos_token": vocab.add_eos,
              "bos_token": name.get("bos"), "eos_token": name.get("eos"), "unk_token": name.get("unk"),
              "pad_token": name.get("pad"), "additional_special_tokens": markers,
              "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False}
    template = vocab.chat_template or family.chat_template
    if template:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    tok = AutoTokenizer.from_pretrained(str(out))
    # llama.cpp matches user-defined pieces whole before splitting the rest ("  " and "\n\n" are
    # one piece each in Gemma's vocabulary): the same as added tokens, matched as written
    whole = [p for p, kind in zip(vocab.pieces, vocab.types, strict=True)
             if kind == USER_DEFINED and p not in markers]
    tok.add_tokens([AddedToken(p, normalized=False, special=False) for p in whole])
    tok.save_pretrained(str(out))
    return tok
