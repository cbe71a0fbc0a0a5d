"""The embedded default's SFT steps with and without `data.share_prefix`: seconds per step.

    python scripts/bench.py share_prefix                          # SmolLM2-135M LoRA, the run's precision
    python scripts/bench.py share_prefix --precision fp32 --rounds 3
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python scripts/bench.py share_prefix   # AVX2 emulated

Two runners of `python -m workbench` (the arithmetic task, 16 examples a step) differ only in
`data.share_prefix`: each micro-batch as one tree row that reads the examples' common prefix
(SmolLM2's default system prompt and "What is ") once, or as 16 padded rows. Their steps go in
blocks, alternating, so machine load hits both alike; both draw the same examples and compute
the same loss up to rounding (tests/unit/test_data_packing.py). Reported: the median seconds
per step of each, positions computed per step, and the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="bench.py share_prefix")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--steps", type=int, default=3, help="steps per block")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    os.environ.setdefault("WORKBENCH_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hydra import compose, initialize_config_dir

    from workbench.resolve.validate import validate
    from workbench.run.runner import Runner

    total = a.steps * a.rounds + 2
    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        base = [f"model={a.model}", f"precision={a.precision}", "eval=none", "tracker=[]", "train.export=false",
                f"train.max_steps={total}"]
        runners = {}
        for name, on in (("padded", "false"), ("shared", "true")):
            r = Runner(validate(compose("train", overrides=[*base, f"data.share_prefix={on}",
                                                            f"output_dir={Path(tmp) / name}"])))
            r.build()
            runners[name] = r

        def step(r) -> tuple[float, int]:
            t = time.perf_counter()
            batch = r.method.next_batch(r.state, r.backend)
            r.backend.forward_backward(batch, r.method.loss)
            r.backend.optimizer_step()
            r.state.step += 1
            return time.perf_counter() - t, sum(int(m["input_ids"].numel()) for m in batch.micro)

        for r in runners.values():
            step(r)  # first step: allocation, warm-up
        seen: dict[str, list] = {k: [] for k in runners}
        for _ in range(a.rounds):
            for name, r in runners.items():
                seen[name] += [step(r) for _ in range(a.steps)]
        precision = runners["padded"].run.precision.name
    out: dict = {"model": a.model, "precision": precision, "steps_per_block": a.steps, "rounds": a.rounds}
    for name, rows in seen.items():
        out[name] = {"median_step_seconds": round(statistics.median(r[0] for r in rows), 3),
                     "positions_per_step": statistics.median(r[1] for r in rows)}
    out["ratio_shared_over_padded_seconds"] = round(out["shared"]["median_step_seconds"]
                                                    / out["padded"]["median_step_seconds"], 3)
    return out
