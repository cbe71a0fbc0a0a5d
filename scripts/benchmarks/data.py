"""Tokenise + pack throughput: workbench's data path against TRL's SFT data path, same rows.

    python scripts/bench.py data                 # embedded arith rows and a 3-turn mix, 3 rounds
    python scripts/bench.py data --rounds 5 --rows 2000

Both sides start from the same JSONL file and end with best-fit-decreasing packed rows of
`--seq-len` tokens:
- workbench: `tokenise_recipe` (read, render with the chat template, loss mask on every
  assistant turn, truncate; cache off) + `packing.best_fit_decreasing`;
- TRL 1.x: rows parsed into a `datasets.Dataset`, then `SFTTrainer._prepare_dataset` with
  `packing=True, packing_strategy="bfd"` (its tokenisation map, label building and
  `pack_dataset`), called without building a trainer or a model.
TRL's default here trains on the whole sequence (the template has no generation tags), so it
does less work per row than the workbench's assistant-only mask. Rounds alternate between the
two so machine load affects both alike; the result is the median time ratio trl / workbench
(> 1: the workbench is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[2]


def _tokenizer():
    import yaml

    from workbench.config.schema import ModelConfig
    from workbench.data.chat import setup_tokenizer
    from workbench.models.load import load_tokenizer

    spec = yaml.safe_load((ROOT / "conf" / "model" / "tiny.yaml").read_text())
    spec.pop("arch", None)
    spec = {k: v for k, v in spec.items() if k in ModelConfig.__dataclass_fields__}
    tok = load_tokenizer(ModelConfig(**spec))
    return tok, setup_tokenizer(tok)


def _write_sets(tmp: Path, rows: int) -> dict[str, Path]:
    src = [json.loads(x) for x in (ROOT / "data_recipes" / "data" / "arith_add2_train.jsonl").read_text().splitlines()]
    src = (src * (rows // len(src) + 1))[:rows]
    single = tmp / "single.jsonl"
    single.write_text("".join(json.dumps(r) + "\n" for r in src))
    multi = tmp / "multi.jsonl"
    with multi.open("w") as fh:  # three question/answer turns per conversation
        for i in range(0, len(src) - 2, 3):
            msgs = [m for r in src[i:i + 3] for m in r["messages"]]
            fh.write(json.dumps({"messages": msgs}) + "\n")
    return {"single_turn": single, "three_turn": multi}


def _ours(path: Path, tok, contract, seq_len: int) -> dict:
    from workbench.data import packing
    from workbench.data.pipeline import tokenise_recipe
    from workbench.data.recipes import Recipe, Source

    recipe = Recipe("bench", path, [Source(name="s", path=path, format="messages")])
    cfg = SimpleNamespace(seq_len=seq_len, on_bad_row="error", cache=False, cache_dir=None)
    src = tokenise_recipe(recipe, tok, contract, cfg)[0]
    lengths = src.examples.lengths().tolist()
    bins, _ = packing.best_fit_decreasing(lengths, seq_len)
    return {"rows": len(lengths), "packed_rows": len(bins), "tokens": int(sum(lengths)),
            "fill": sum(lengths) / (len(bins) * seq_len), "trained_tokens": src.examples.trained_tokens()}


def _trl(path: Path, tok, seq_len: int) -> dict:
    import datasets
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    ds = datasets.Dataset.from_list(rows)
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, max_length=seq_len, packing=True, packing_strategy="bfd",
                         dataset_num_proc=None, report_to=[], use_cpu=True)
        fake = SimpleNamespace(_tokenizer=tok, chat_template=None, completion_only_loss=False,
                               _is_vision_dataset=False)
        packed = SFTTrainer._prepare_dataset(fake, ds, tok, args, True, None, "train")
    lengths = [sum(s) for s in packed["seq_lengths"]]
    return {"rows": len(rows), "packed_rows": len(packed), "tokens": int(sum(lengths)),
            "fill": sum(lengths) / (len(packed) * seq_len)}


def run(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(prog="bench.py data")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--seq-len", type=int, default=256)
    a = p.parse_args(argv)
    import trl

    tok, contract = _tokenizer()
    result: dict = {"trl_version": trl.__version__, "rows": a.rows, "seq_len": a.seq_len, "rounds": a.rounds,
                    "sets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        sets = _write_sets(Path(tmp), a.rows)
        _ours(sets["single_turn"], tok, contract, a.seq_len)  # warm imports and template compilation
        _trl(sets["single_turn"], tok, a.seq_len)
        for name, path in sets.items():
            t_ours, t_trl = [], []
            for _ in range(a.rounds):
                t = time.perf_counter()
                ours = _ours(path, tok, contract, a.seq_len)
                t_ours.append(time.perf_counter() - t)
                t = time.perf_counter()
                theirs = _trl(path, tok, a.seq_len)
                t_trl.append(time.perf_counter() - t)
            ratios = [b / a_ for a_, b in zip(t_ours, t_trl)]
            result["sets"][name] = {
                "ratio_trl_over_workbench": statistics.median(ratios), "ratios": ratios,
                "workbench": ours, "trl": theirs,
                "workbench_tokens_per_s": ours["tokens"] / statistics.median(t_ours),
                "trl_tokens_per_s": theirs["tokens"] / statistics.median(t_trl),
            }
    result["ratio"] = min(s["ratio_trl_over_workbench"] for s in result["sets"].values())
    return result
