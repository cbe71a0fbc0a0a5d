"""Write a merged HF model directory as GGUF (llama.cpp, Ollama, LM Studio), with the tokenizer,
chat template and the end-of-turn token as EOS, so a serving engine stops where training taught
the model to stop.

    python -m workbench export.gguf=[f16,q8_0]       # at the end of a run: export/gguf/model-<type>.gguf
    python -m workbench.to_gguf <merged_dir> <out.gguf> [f16|bf16|f32|q8_0]

The `gguf` package (from the llama.cpp project) writes the file, names the tensors
(`TensorNameMap`), reads the merges (`SpecialVocab`) and quantises (`gguf.quants`). What is
written here by hand is only what the package leaves to llama.cpp's own conversion script,
which is not part of any package: the architecture's metadata keys, the Q/K row permutation that
llama.cpp's rotary layout expects for Llama-family weights, Gemma's norm weights stored as the
1 + w its RMSNorm multiplies by, and token types. A byte-level BPE vocabulary (SmolLM2, Qwen) is
written from the tokenizer's merges; a SentencePiece one (Gemma) from the `tokenizer.model` that
the export keeps beside the weights (workbench/export/write.py), its pieces, scores and piece
types as they came. Quantisation types
are those gguf.quants can produce in Python; the K-quants (q4_k_m, ...) need llama.cpp's
`llama-quantize` binary, which the workbench does not build. The types offered are those
llama.cpp's own converter writes (f32, f16, bf16, q8_0); gguf.quants can also write q4_0/q5_0, but
applied to every matrix, embeddings included, they cost SmolLM2-135M 39% of its next-token
argmax agreement, so they are left to llama-quantize, which keeps sensitive tensors wider.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np

from workbench.config.schema import GGUF_TYPES
from workbench.core.errors import UserError
from workbench.families import registry as families
from workbench.families.spec import Gguf
from workbench.models.gguf_tokenizer import SENTENCEPIECE

# What each family needs written (architecture, Q/K permutation, norms, split rule) is its spec's
# (workbench/families/); the types are those the schema offers (workbench/config/schema.py GGUF_TYPES).


def check_types(types) -> list[str]:
    bad = [t for t in types if str(t).lower() not in GGUF_TYPES]
    if bad:
        raise UserError(f"export.gguf: {bad} not writable here; choose from {list(GGUF_TYPES)} (K-quants such as "
                        "q4_k_m need llama.cpp's llama-quantize)")
    return [str(t).lower() for t in types]


def check_model(model_type: str) -> Gguf:
    """The family's GGUF rules; UserError for a family the writer has none for."""
    spec = families.get(model_type)
    if spec is None or spec.gguf is None:
        raise UserError(f"export.gguf: model_type {model_type!r} has no GGUF mapping here; supported: "
                        f"{families.gguf_model_types()}")
    return spec.gguf


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # HF stores each head's rotary pairs as two halves; llama.cpp's kernels want them
    # interleaved (transformers' GGUF loader undoes exactly this).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _qtype(name: str, kind: str, ndim: int):
    import gguf

    # 1-D tensors (norms, biases) stay f32, as llama.cpp's converter keeps them
    if ndim == 1 or kind == "f32":
        return gguf.GGMLQuantizationType.F32
    return getattr(gguf.GGMLQuantizationType, kind.upper())


def _vocab(tokenizer) -> tuple[list[bytes], list[int]]:
    """Tokens in id order and their GGUF types: control for special tokens (so engines do not
    parse them out of plain text), user-defined for other added tokens, normal otherwise."""
    import gguf

    n = len(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(n)))
    special = set(tokenizer.all_special_ids)
    added = {i: t for i, t in tokenizer.added_tokens_decoder.items()}
    types = []
    for i in range(n):
        if i in special or (i in added and added[i].special):
            types.append(gguf.TokenType.CONTROL)
        elif i in added:
            types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    return [t.encode("utf-8") for t in tokens], [int(t) for t in types]


def _rope_base(cfg) -> float:
    """The rotary base of the model's global (full-attention) layers: transformers 5 keeps it in
    `rope_parameters`, per layer type where local layers have their own."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)
    return float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def _byte_bpe(w, merged_dir: Path, tok, pre: str) -> None:
    import gguf

    tokens, types = _vocab(tok)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(merged_dir, load_merges=True, n_vocab=len(tok))
    if not special.merges:
        raise UserError(f"export.gguf: {merged_dir} has neither BPE merges nor a tokenizer.model (SentencePiece); "
                        "one of them is needed to write the vocabulary")
    w.add_token_merges(special.merges)
    w.add_add_bos_token(False)  # the chat template writes the sequence's first token itself


def _sentencepiece(w, model_file: Path, tok) -> None:
    """A SentencePiece vocabulary as llama.cpp's `llama` tokenizer reads it: every piece with its
    score and type (normal, control, user-defined, byte), the space-prefix rule, and BOS added as
    the tokenizer adds it."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.ParseFromString(model_file.read_bytes())
    pieces = [p.piece.encode("utf-8") for p in m.pieces]
    scores = [float(p.score) for p in m.pieces]
    types = [int(p.type) for p in m.pieces]  # SentencePiece's piece types are llama.cpp's numbers
    # tokens the tokenizer added past the SentencePiece model: matched whole, as llama.cpp's own
    # converter writes a model's added tokens (control when special)
    added = tok.added_tokens_decoder
    for i in range(len(m.pieces), len(tok)):
        if i not in added:
            raise UserError(f"export.gguf: token id {i} is neither in {model_file} nor an added token")
        pieces.append(added[i].content.encode("utf-8"))
        scores.append(-1000.0)
        types.append(3 if added[i].special else 4)  # CONTROL | USER_DEFINED
    w.add_tokenizer_model(SENTENCEPIECE)
    w.add_tokenizer_pre("default")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_add_space_prefix(bool(m.normalizer_spec.add_dummy_prefix))
    # as the tokenizer does it (its add_bos_token attribute need not say what its post-processor adds)
    probe = list(tok("a")["input_ids"])
    w.add_add_bos_token(bool(probe) and probe[0] == tok.bos_token_id)
    w.add_add_eos_token(bool(probe) and tok.eos_token_id is not None and probe[-1] == tok.eos_token_id)


def write(merged_dir: Path, out: Path, kind: str, eos_id: int | None = None, pre: str | None = None) -> Path:
    """Write `merged_dir` (an HF causal-LM folder) as one GGUF file of type `kind`."""
    import gguf
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    kind = check_types([kind])[0]
    # its writer logs each file at INFO, which Hydra's console handler would print mid-summary
    logging.getLogger("gguf").setLevel(logging.WARNING)
    merged_dir, out = Path(merged_dir), Path(out)
    cfg = AutoConfig.from_pretrained(merged_dir)
    rules = check_model(cfg.model_type)
    arch, permute = rules.arch, rules.permute_qk
    tok = AutoTokenizer.from_pretrained(merged_dir)
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    scalar = getattr(cfg, "query_pre_attn_scalar", None)
    if rules.query_scale_from_head_dim and scalar is not None and int(scalar) != head_dim:
        # GGUF has no key for it: llama.cpp (and transformers' GGUF reader) scale queries by
        # 1/sqrt(head_dim) (27B excepted), so such a file would run a different model
        raise UserError(f"export.gguf: {merged_dir}/config.json has query_pre_attn_scalar={scalar} but "
                        f"head_dim={head_dim}; GGUF readers scale attention by 1/sqrt(head_dim), so this "
                        "model cannot be written as GGUF faithfully; export it as safetensors only")

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(merged_dir.parent.parent.name if merged_dir.name == "merged" else merged_dir.name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(_rope_base(cfg))
    if getattr(cfg, "sliding_window", None) and rules.sliding_window:
        # llama.cpp's gemma3 takes the 5 local : 1 global layer pattern and the local layers'
        # rope base (10,000) as fixed; the window is the file's
        w.add_sliding_window(int(cfg.sliding_window))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(len(tok))
    w.add_file_type({"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}[kind])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    if (merged_dir / "tokenizer.model").exists():
        _sentencepiece(w, merged_dir / "tokenizer.model", tok)
    else:
        _byte_bpe(w, merged_dir, tok, pre or rules.pre_tokenizer)
    eos = eos_id if eos_id is not None else tok.eos_token_id
    for setter, value in ((w.add_bos_token_id, tok.bos_token_id), (w.add_eos_token_id, eos),
                          (w.add_eot_token_id, eos), (w.add_pad_token_id, tok.pad_token_id),
                          (w.add_unk_token_id, tok.unk_token_id)):
        if value is not None:
            setter(int(value))
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)

    names = gguf.TensorNameMap(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for shard in sorted(merged_dir.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for hf_name in f.keys():
                if tied and hf_name == "lm_head.weight":
                    continue  # GGUF ties by leaving output.weight out
                t = f.get_tensor(hf_name).to(torch.float32).numpy()
                if rules.norm_plus_one and hf_name.endswith("norm.weight"):
                    t = t + 1.0
                if permute and hf_name.endswith("q_proj.weight"):
                    t = _permute(t, n_head)
                elif permute and hf_name.endswith("k_proj.weight"):
                    t = _permute(t, n_kv)
                name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise UserError(f"export.gguf: no GGUF name for tensor {hf_name} of {cfg.model_type}")
                qtype = _qtype(name, kind, t.ndim)
                if qtype == gguf.GGMLQuantizationType.F16:
                    w.add_tensor(name, t.astype(np.float16))
                elif qtype == gguf.GGMLQuantizationType.F32:
                    w.add_tensor(name, t)
                else:
                    w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


if __name__ == "__main__":
    a = sys.argv[1:]
    if len(a) < 2:
        print(__doc__)
        raise SystemExit(2)
    try:
        path = write(Path(a[0]), Path(a[1]), a[2] if len(a) > 2 else "f16")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps({"gguf": str(path), "bytes": path.stat().st_size}))
