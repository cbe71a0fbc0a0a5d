"""SFT batch layouts on a mixed-length chat set: padded, padding-free, packed.

    python scripts/bench.py packing                              # SmolLM2-135M LoRA, fp32
    python scripts/bench.py packing --steps 3 --rounds 3 --model tiny

The set is the embedded arithmetic rows joined into conversations of 1 to `--max-turns`
question/answer turns (seeded), so lengths spread from ~40 to ~350 tokens, as chat data does.
Three runners train on it, their steps in blocks, alternating, so machine load hits all alike:
  padded    `--mbs` conversations per step, padded to the longest (data.pad_free=false)
  pad_free  the same conversations per step, packed into as few rows as the longest allows
            (data.pad_free=true, the default: workbench/data/packing.py pad_free)
  packed    rows of `data.seq_len` tokens (data.packing=true: best-fit-decreasing over the
            stream, several conversations per row, leftovers carried to the next step), as many
            rows per step as hold about the real tokens of a padded step
None attends across conversations. Reported: real (non-padding) tokens per second of each, the
ratios to padded, and padding's share of the positions each computes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "data_recipes" / "data" / "arith_add2_train.jsonl"


def mixed_set(path: Path, rows: int, max_turns: int, seed: int = 0) -> None:
    src = [json.loads(x)["messages"] for x in SRC.read_text().splitlines()]
    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(rows):
            turns = rng.randint(1, max_turns)
            fh.write(json.dumps({"messages": [m for t in rng.sample(src, turns) for m in t]}) + "\n")


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="bench.py packing")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--steps", type=int, default=3, help="steps per block")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mbs", type=int, default=16, help="conversations per padded step")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-turns", type=int, default=8)
    a = ap.parse_args(argv)
    os.environ.setdefault("WORKBENCH_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hydra import compose, initialize_config_dir

    from workbench.resolve.validate import validate
    from workbench.run.runner import Runner

    total = a.steps * a.rounds + 1
    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        tmp = Path(tmp)
        data = tmp / "mixed.jsonl"
        mixed_set(data, 2000, a.max_turns)
        base = [f"model={a.model}", f"precision={a.precision}", "eval=none", "tracker=[]", "train.export=false",
                f"data.path={data}", f"data.seq_len={a.seq_len}", "data.cache=false", f"train.max_steps={total}"]
        runners = {}
        for name, extra in (("padded", [f"train.micro_batch_size={a.mbs}", "data.pad_free=false"]),
                            ("pad_free", [f"train.micro_batch_size={a.mbs}", "data.pad_free=true"]),
                            ("packed", ["data.packing=true"])):
            if name == "packed":  # rows holding about as many real tokens as a padded step
                mean = statistics.mean(runners["padded"].method.sources[0].examples.lengths().tolist())
                extra.append(f"train.micro_batch_size={max(1, round(a.mbs * mean / a.seq_len))}")
            r = Runner(validate(compose("train", overrides=base + extra + [f"output_dir={tmp / name}"])))
            r.build()
            runners[name] = r

        def step(r) -> tuple[float, int, int]:
            t = time.perf_counter()
            batch = r.method.next_batch(r.state, r.backend)
            r.backend.forward_backward(batch, r.method.loss)
            r.backend.optimizer_step()
            r.state.step += 1
            slots = sum(int(m["input_ids"].numel()) for m in batch.micro)
            return time.perf_counter() - t, batch.tokens, slots

        for r in runners.values():
            step(r)  # first step: allocation, warm-up
        seen: dict[str, list] = {k: [] for k in runners}
        for _ in range(a.rounds):
            for name, r in runners.items():
                seen[name] += [step(r) for _ in range(a.steps)]
    out: dict = {"model": a.model, "precision": a.precision, "seq_len": a.seq_len, "steps_per_block": a.steps,
                 "rounds": a.rounds, "variants": {}}
    for name, rows in seen.items():
        secs = sum(r[0] for r in rows)
        tokens = sum(r[1] for r in rows)
        out["variants"][name] = {"real_tokens_per_s": tokens / secs, "median_step_seconds": statistics.median(r[0] for r in rows),
                                 "real_tokens_per_step": tokens / len(rows),
                                 "padding_share": 1 - tokens / sum(r[2] for r in rows)}
    v = out["variants"]
    for name in ("pad_free", "packed"):
        out[f"ratio_{name}_over_padded"] = v[name]["real_tokens_per_s"] / v["padded"]["real_tokens_per_s"]
    return out
