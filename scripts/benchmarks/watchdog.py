"""What the watchdog costs: steps/s with and without heartbeats and the watchdog thread.

    OMP_NUM_THREADS=2 python scripts/bench.py watchdog                          # the default run (SmolLM2 LoRA SFT)
    OMP_NUM_THREADS=1 python scripts/bench.py watchdog --model tiny --steps 10 --rounds 4

One runner is built; its steps run in blocks, alternating between the two variants so that load
from other processes hits both alike:
  off   the phase marks replaced by a no-op, no watchdog thread
  on    the marks as a run makes them (workbench/core/heartbeat.py) and the watchdog thread
        (workbench/guard/watchdog.py) publishing and judging every `--interval` seconds
A step is the runner's: the batch (marked `data`), forward and backward through the backend
(marked inside), the optimizer (marked), and the step mark. The result is each variant's median
step time, the cost of `on` as a share of `off`'s step, and the noise floor `off_vs_off`: the
medians of `off` in alternate rounds against each other (a cost below it is not measurable that
way). `cost_accounted` is the cost by accounting instead, which the machine's noise does not
touch: the watchdog thread's CPU time (/proc) as a share of the wall time it ran, plus the phase
marks per step times what one mark costs timed alone, over the step time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="bench.py watchdog")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=4, help="steps per block")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between the thread's beats "
                    "(a run uses 5 s or stall_timeout_s / 10): shorter is the harder case")
    a = ap.parse_args(args)
    os.environ.setdefault("WORKBENCH_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hydra import compose, initialize_config_dir

    from workbench.core import heartbeat
    from workbench.guard.watchdog import Watchdog
    from workbench.resolve.validate import validate
    from workbench.run.runner import Runner

    total = a.steps * a.rounds * 2 + 1
    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = validate(compose("train", overrides=[f"model={a.model}", "eval=none", "train.export=false",
                                                   "tracker=[]", f"train.max_steps={total}",
                                                   f"output_dir={Path(tmp) / 'run'}"]))
        runner = Runner(cfg)
        runner.build()
        be, method = runner.backend, runner.method
        real_phase = heartbeat.phase

        def block(n: int) -> list[float]:
            out = []
            for _ in range(n):
                t = time.perf_counter()
                heartbeat.step(runner.state.step)
                with heartbeat.phase("data"):
                    batch = method.next_batch(runner.state, be)
                m = be.forward_backward(batch, method.loss)
                with heartbeat.phase("optimizer"):
                    m.update(be.optimizer_step())
                runner.state.step += 1
                out.append(time.perf_counter() - t)
            return out

        block(1)  # first step: allocation, warm-up
        times: dict[str, list[float]] = {"off": [], "on": []}
        thread_cpu, thread_wall, marks = 0.0, 0.0, 0

        def counting_phase(*args, **kwargs):
            nonlocal marks
            marks += 1
            return real_phase(*args, **kwargs)
        for _ in range(a.rounds):
            for variant in times:
                dog = None
                if variant == "on":
                    heartbeat.phase = counting_phase
                    dog = Watchdog(Path(tmp) / "run", 0, 1, stall_timeout_s=600, interval_s=a.interval)
                    dog.start()
                    t0 = time.perf_counter()
                else:
                    heartbeat.phase = lambda *_a, **_k: contextlib.nullcontext()
                times[variant] += block(a.steps)
                if dog is not None:
                    thread_cpu += _thread_cpu_seconds(dog._thread.native_id)  # before it exits
                    thread_wall += time.perf_counter() - t0
                    dog.stop()
        heartbeat.phase = real_phase
        # what one phase mark costs, timed alone (the marks inside the backend are counted too)
        n = 20000
        t0 = time.perf_counter()
        for _ in range(n):
            with real_phase("bench"):
                pass
        mark_s = (time.perf_counter() - t0) / n
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    # The cost by accounting, free of the machine's noise: the thread's CPU time as a share of
    # the wall time it ran (a core it takes from the step at worst) plus the marks' own time.
    per_step_marks = marks / max(len(times["on"]), 1)
    accounted = thread_cpu / max(thread_wall, 1e-9) + per_step_marks * mark_s / off
    # the noise floor: the same variant (off) measured in alternate rounds, as two halves
    blocks = [times["off"][i:i + a.steps] for i in range(0, len(times["off"]), a.steps)]
    even = [t for b in blocks[0::2] for t in b]
    odd = [t for b in blocks[1::2] for t in b]
    noise = abs(statistics.median(even) / statistics.median(odd) - 1) if even and odd else None
    return {"benchmark": "watchdog", "model": a.model, "steps_per_variant": len(times["on"]), "interval_s": a.interval,
            "off_s_per_step": round(off, 4), "on_s_per_step": round(on, 4), "cost": round(on / off - 1, 4),
            "off_vs_off": None if noise is None else round(noise, 4),
            "thread_cpu_share": round(thread_cpu / max(thread_wall, 1e-9), 6), "marks_per_step": round(per_step_marks, 1),
            "mark_us": round(mark_s * 1e6, 2), "cost_accounted": round(accounted, 6)}


def _thread_cpu_seconds(tid: int) -> float:
    """User + system CPU seconds of one thread of this process (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0
