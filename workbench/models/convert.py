"""Dequantise a packaged GGUF into an ordinary HF directory (safetensors + tokenizer), in a
process of its own.

    python -m workbench.models.convert <gguf_dir> <gguf_file> <out_dir>

workbench/models/load.py runs this as a child process, under the cache's file lock, whenever the
converted entry is missing or broken. A child process because transformers' `save_pretrained`
writes weights only on rank 0 once torch.distributed is initialised: converted inside rank 1 of
a job, the folder would hold a tokenizer and no weights. A fresh process has no process group,
and it keeps accelerate's DeepSpeed probe (inside save_pretrained) out of the training process.

A SentencePiece vocabulary (Gemma's) gets its tokenizer from workbench/models/gguf_tokenizer.py,
not from transformers' GGUF conversion, which splits Gemma's words into fragments.

Before anything is saved, the import check (workbench/models/import_check.py) compares the
converted model and tokenizer with llama.cpp's reading of the same file; a conversion that fails
it exits with status 3 and its one line, and nothing is cached. Its report is kept as
import_check.json.

Beside the weights it writes gguf_metadata.json, the GGUF's scalar fields (license, llama.cpp
pre-tokenizer name, ...), which exports copy: reading them from the GGUF again would parse all
of its vocabulary metadata, about 4 s a time on a 2-core CPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from workbench.models import gguf_tokenizer, import_check

METADATA = "gguf_metadata.json"
CHECK_FAILED = 3  # the exit status of a conversion the import check refused (its line on stderr)


def scalar_fields(reader) -> dict:
    """The GGUF's metadata fields that hold one value (strings and numbers, not arrays)."""
    from gguf import GGUFValueType

    fields = reader.fields.values()
    return {f.name: f.contents() for f in fields if f.types and f.types[0] != GGUFValueType.ARRAY}


def convert(gguf_dir: str, gguf_file: str, out_dir: str) -> None:
    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reader = GGUFReader(str(Path(gguf_dir, gguf_file)))  # metadata read once, for the tokenizer and METADATA
    vocab = gguf_tokenizer.read_vocab(reader)
    # a SentencePiece vocabulary: rebuilt as llama.cpp reads it (gguf_tokenizer.py)
    if vocab.model == gguf_tokenizer.SENTENCEPIECE:
        tok = gguf_tokenizer.spm_tokenizer(vocab, out_dir)
    else:
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    # transformers keeps a GGUF quantizer marker on the model although the weights are plain
    # dequantised Linear weights; save_pretrained refuses while it is there.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # checked before it is saved: a conversion that fails is never cached
    report = import_check.check(Path(gguf_dir, gguf_file), model, tok)
    if not report["passed"]:
        print(import_check.line(report), file=sys.stderr)
        raise SystemExit(CHECK_FAILED)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    Path(out_dir, METADATA).write_text(json.dumps(scalar_fields(reader), indent=1))
    Path(out_dir, import_check.REPORT).write_text(json.dumps(report, indent=1))
    if not any(Path(out_dir).glob("*.safetensors")):
        raise SystemExit(f"convert: no weights were written to {out_dir}")


if __name__ == "__main__":
    convert(*sys.argv[1:4])
