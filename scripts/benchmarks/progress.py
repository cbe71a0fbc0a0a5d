"""Does watching the run slow it? Steps/s with and without the progress display and trackers.

    OMP_NUM_THREADS=1 python scripts/bench.py progress                      # tiny model
    OMP_NUM_THREADS=1 python scripts/bench.py progress --model smollm2-135m --steps 4 --rounds 2

One runner is built; its steps run in blocks, alternating between variants so that load from
other processes hits all of them alike:
  bare         metrics.jsonl only (no progress display, no trackers)
  progress     the rich progress bar (forced on even when stdout is not a terminal) + log lines
  tensorboard  the bar and the default tracker (TensorBoard event files)
Each step's time includes its `Tracker.log` call; the rich bar redraws from its own thread while
its block runs. The result is each variant's median step time and its ratio to `bare`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="bench.py progress")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=6, help="steps per block")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--mbs", type=int, default=8)
    a = ap.parse_args(args)
    os.environ.setdefault("WORKBENCH_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hydra import compose, initialize_config_dir

    from workbench.resolve.validate import validate
    from workbench.run.runner import Runner
    from workbench.telemetry.metrics import Tracker

    total = a.steps * a.rounds * 3 + 1
    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        tmp = Path(tmp)
        cfg = validate(compose("train", overrides=[f"model={a.model}", "eval=none", "train.export=false",
                                                   f"train.micro_batch_size={a.mbs}", f"train.max_steps={total}",
                                                   "train.log_every=10", f"output_dir={tmp / 'run'}"]))
        bare_cfg = validate(compose("train", overrides=[f"model={a.model}", "eval=none", "tracker=[]",
                                                        f"train.max_steps={total}", f"output_dir={tmp / 'bare'}"]))
        runner = Runner(cfg)
        runner.build()
        be, method = runner.backend, runner.method

        def block(tracker, n: int) -> list[float]:
            out = []
            for _ in range(n):
                t = time.perf_counter()
                batch = method.next_batch(runner.state, be)
                m = be.forward_backward(batch, method.loss)
                m.update(be.optimizer_step())
                runner.state.step += 1
                dt = time.perf_counter() - t
                row = {"step": runner.state.step, "loss": m.pop("loss"), **m, "tokens_per_s": batch.tokens / dt,
                       "step_seconds": dt}
                tracker.log(row, show=runner.state.step % cfg.train.log_every == 0)
                out.append(time.perf_counter() - t)  # the step and its logging
            return out

        block(Tracker(tmp / "warm", cfg=bare_cfg), 1)  # first step: allocation, warm-up
        times: dict[str, list[float]] = {"bare": [], "progress": [], "tensorboard": []}
        for r in range(a.rounds):
            for variant in times:
                if variant == "bare":
                    tracker = Tracker(tmp / f"bare{r}", cfg=bare_cfg)
                    tracker.progress.enabled = False
                else:
                    tracker = Tracker(tmp / f"{variant}{r}", cfg=cfg if variant == "tensorboard" else bare_cfg)
                    tracker.progress.rich = True
                times[variant] += block(tracker, a.steps)
                tracker.finish()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"model": a.model, "steps_per_block": a.steps, "rounds": a.rounds, "median_step_seconds": med,
            "ratio_to_bare": {k: v / med["bare"] for k, v in med.items()},
            "steps_per_s": {k: 1 / v for k, v in med.items()}}
