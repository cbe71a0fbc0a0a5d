"""torch.compile (inductor) vs eager: training-step time, side by side in one process.

    OMP_NUM_THREADS=1 python scripts/bench.py compile                                # tiny model, full FT
    OMP_NUM_THREADS=1 python scripts/bench.py compile --model smollm2-135m --peft lora --steps 6

Two runners are built from the same config, one with `train.compile=true`. Both train on the
same pre-drawn batches; timed steps alternate eager, compiled, eager, ... so load from other
processes hits both alike. Compilation (and recompiles while shapes settle) happens in the
warm-up steps and is reported separately. The result is the median step-time ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from workbench.resolve.validate import validate

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return validate(compose(config_name="train", overrides=overrides))


def run(args: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="bench.py compile")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--peft", default="none")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant (compilation)")
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    a = ap.parse_args(args)
    os.environ.setdefault("WORKBENCH_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from workbench.run.runner import Runner

    runners = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("eager", "compiled"):
            cfg = _compose([f"model={a.model}", f"peft={a.peft}", f"precision={a.precision}", "eval=none",
                            f"train.micro_batch_size={a.mbs}", f"data.seq_len={a.seq}", "optim.warmup_steps=0",
                            f"train.max_steps={a.warmup + a.steps}", "train.export=false",
                            f"train.compile={'true' if variant == 'compiled' else 'false'}",
                            f"output_dir={tmp}/{variant}"])
            r = Runner(cfg)
            r.build()
            runners[variant] = r
        ref = runners["eager"]
        batches = [ref.method.next_batch(ref.state, ref.backend) for _ in range(a.warmup + a.steps)]

        def step(r, b) -> float:
            t = time.perf_counter()
            m = r.backend.forward_backward(b, r.method.loss)
            r.backend.optimizer_step()
            return time.perf_counter() - t, m["loss"]

        warm = {v: sum(step(r, b)[0] for b in batches[: a.warmup]) for v, r in runners.items()}
        times = {"eager": [], "compiled": []}
        losses = {"eager": [], "compiled": []}
        for b in batches[a.warmup:]:
            for v, r in runners.items():
                dt, loss = step(r, b)
                times[v].append(dt)
                losses[v].append(loss)
    med = {v: statistics.median(t) for v, t in times.items()}
    return {
        "benchmark": "compile", "model": a.model, "peft": a.peft, "precision": a.precision,
        "micro_batch_size": a.mbs, "seq_len": a.seq, "timed_steps": a.steps, "warmup_steps": a.warmup,
        "eager_step_s": med["eager"], "compiled_step_s": med["compiled"],
        "speedup_eager_over_compiled": med["eager"] / med["compiled"],
        "warmup_s": warm, "compile_overhead_s": warm["compiled"] - warm["eager"],
        "max_loss_diff": max(abs(x - y) for x, y in zip(losses["eager"], losses["compiled"])),
        "tokens_per_step": statistics.mean(b.tokens for b in batches),
        "conditions": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                       "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
    }
