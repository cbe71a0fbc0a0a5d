"""The planner's predicted peak memory against the measured peak, on CPU.

Measured: the bytes of the model's parameters and buffers after the build (counted from their
storages) plus the growth of the torch CPU allocator's running total ("Total Allocated" of the
profiler's memory events, profile_memory=True) during two training steps, at its maximum (the
second step is the steady state: forward and backward with AdamW's state alive), with the total
kept for every thread (workbench/plan/tensor_memory.py, which the plan check measures with
too). This is what tensors occupy - the quantity the
planner models - without the Python heap, libraries or allocator slack that RSS would add. Predicted:
workbench.plan.memory.estimate for the same config, given the batch's real shape (tokens, loss
positions and padded length, which picks the attention kernel on CPU), since arithmetic examples
are far shorter than data.seq_len.

    OMP_NUM_THREADS=1 pytest -q tests/integration/test_plan_memory.py            # tiny
    OMP_NUM_THREADS=1 pytest -q -m slow tests/integration/test_plan_memory.py    # SmolLM2-135M, megatron

Each runs single and 2-rank fsdp2, peft none and lora, fp32 and bf16-mixed; and 2-rank megatron
(tp=2 with a torch AdamW, peft none and lora; the distributed optimizer at dp=2, fp32 and bf16).

The 2-rank fsdp2 cases run this file as their torchrun worker (`--worker OUT`), the four tiny
cases in one job; each rank reports its peak and the test holds the prediction against the larger one.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":  # a torchrun worker (see below) imports the tests package from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.conftest import compose  # noqa: E402
from tests.helpers import torchrun  # noqa: E402
from tests.tolerances import PLAN_MEMORY_RTOL as TOLERANCE  # noqa: E402
from workbench.plan.tensor_memory import count_every_thread, growth, storage_bytes  # noqa: E402


def _model_bytes(*models, extra=()) -> int:
    return storage_bytes([t for m in models for t in (*m.parameters(), *m.buffers())] + list(extra))


def measure(overrides, tmp_path, steps: int = 2) -> dict:
    """Build a run, train `steps` steps under the profiler; measured and predicted peak in bytes."""
    from torch.profiler import ProfilerActivity, profile

    from workbench.plan.counts import count, probe
    from workbench.plan.make import from_cfg
    from workbench.plan.memory import estimate
    from workbench.run.runner import Runner
    from workbench.telemetry.metrics import Tracker

    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = compose(overrides, tmp_path)
    runner = Runner(cfg)  # under torchrun this joins the process group
    runner.tracker = Tracker(runner.run_dir, enabled=False)
    runner.build()
    # The profiler's running total counts only allocations made on this thread while a profiler
    # runs (from_pretrained loads weights on worker threads), so what the build left alive is
    # counted directly and the total's growth during the steps is added to it.
    gpt = getattr(runner.backend, "gpt", None)  # backend=megatron: its GPTModel shard and DDP's gradient buffer
    alive = _model_bytes(runner.backend.unwrapped(), *([gpt] if gpt is not None else []),
                         extra=[p.main_grad for p in (gpt.parameters() if gpt is not None else ())
                                if getattr(p, "main_grad", None) is not None])
    shapes = []
    with count_every_thread(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.empty(8, dtype=torch.uint8)  # the first event gives the total's starting value
        for _ in range(steps):
            batch = runner.method.next_batch(runner.state, runner.backend)
            runner.backend.forward_backward(batch, runner.method.loss)
            runner.backend.optimizer_step()
            runner.state.step += 1
            shapes.append(max((int(m["input_ids"].numel()), int(m["targets"].numel()), int(m["input_ids"].shape[-1]))
                              for m in batch.micro))
    growth_ = growth(prof)
    assert growth_, "the profiler recorded no CPU memory events"
    # Memory alive before the steps but not counted in `alive` would show as the total dipping
    # below its start when it is freed; then the baseline is wrong and the peak understated.
    assert min(growth_) > -2**20, f"{-min(growth_) / 2**20:.1f} MiB freed that the baseline did not count"
    totals = [alive + g for g in growth_]
    tokens, selected, seq = max(shapes)
    counts = count(probe(cfg.model), cfg.model.arch, cfg.peft)
    est = estimate(counts, cfg.model.arch, from_cfg(cfg), tokens=tokens, selected=selected, seq=seq)
    assert runner.n_params == counts.total + counts.lora  # the meta count is the real model's count
    return {"measured": float(max(totals)), "predicted": est.peak, "terms": est.terms(), "tokens": tokens,
            "selected": selected}


def _check(result, label):
    err = result["predicted"] / result["measured"] - 1
    print(f"{label}: predicted {result['predicted'] / 2**20:.1f} MiB, measured {result['measured'] / 2**20:.1f} MiB, "
          f"error {err:+.1%} (tokens {result['tokens']}, loss positions {result['selected']})")
    assert abs(err) <= TOLERANCE, f"{label}: {err:+.1%} off; terms {result['terms']}"


PRECISIONS = ["fp32", "bf16-mixed"]  # bf16-mixed: autocast on one device, MixedPrecisionPolicy under fsdp2


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("peft", ["none", "lora"])
def test_tiny_single(peft, precision, tmp_path):
    _check(measure([f"peft={peft}", f"precision={precision}"], tmp_path), f"tiny single {peft} {precision}")


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("peft", ["none", "lora"])
def test_smollm2_135m_single(peft, precision, tmp_path):
    _check(measure(["model=smollm2-135m", f"peft={peft}", f"precision={precision}", "train.micro_batch_size=8"],
                   tmp_path), f"smollm2-135m single {peft} {precision}")


def run_fsdp2(cases: dict[str, list[str]], out: Path) -> dict[str, dict]:
    """Measure each case (name -> overrides, the backend's among them) on 2 ranks in one torchrun
    job, so the job's processes, imports and process group are paid for once; the larger rank's
    result per case."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "cases.json").write_text(json.dumps(cases))
    torchrun(Path(__file__).resolve(), ["--worker", out], timeout=900)
    worst = {}
    for name in cases:
        ranks = [json.loads((out / name / f"rank{r}.json").read_text()) for r in range(2)]
        print(f"{name}: per-rank measured MiB:", [round(r["measured"] / 2**20, 1) for r in ranks])
        worst[name] = max(ranks, key=lambda r: r["measured"])
    return worst


def fsdp2_case(model: str, micro: int, peft: str, precision: str) -> list[str]:
    return [f"model={model}", f"peft={peft}", f"precision={precision}", f"train.micro_batch_size={micro}",
            "backend=fsdp2"]


@pytest.fixture(scope="module")
def tiny_fsdp2(tmp_path_factory):
    cases = {f"{peft}-{precision}": fsdp2_case("tiny", 4, peft, precision)
             for peft in ("none", "lora") for precision in PRECISIONS}
    return run_fsdp2(cases, tmp_path_factory.mktemp("fsdp2"))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("peft", ["none", "lora"])
def test_fsdp2_two_ranks(tiny_fsdp2, peft, precision):
    _check(tiny_fsdp2[f"{peft}-{precision}"], f"tiny fsdp2x2 {peft} {precision}")


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("peft", ["none", "lora"])
def test_smollm2_135m_fsdp2_two_ranks(peft, precision, tmp_path):
    name = f"{peft}-{precision}"
    _check(run_fsdp2({name: fsdp2_case("smollm2-135m", 8, peft, precision)}, tmp_path)[name],
           f"smollm2-135m fsdp2x2 {peft} {precision}")


# backend=megatron, 2 ranks: tensor parallel with a torch AdamW (full fine-tune and LoRA), and
# Megatron-Core's distributed optimizer over 2 data-parallel ranks (fp32 and bf16 parameters
# with fp32 main weights)
MEGATRON = {"tp2-none-fp32": ["backend.tp=2", "peft=none", "precision=fp32"],
            "tp2-lora-fp32": ["backend.tp=2", "peft=lora", "precision=fp32"],
            "dp2-distopt-fp32": ["backend.distributed_optimizer=true", "peft=none", "precision=fp32"],
            "dp2-distopt-bf16-mixed": ["backend.distributed_optimizer=true", "peft=none", "precision=bf16-mixed"]}


@pytest.fixture(scope="module")
def tiny_megatron(tmp_path_factory):
    pytest.importorskip("megatron.core")
    cases = {name: ["model=tiny", "train.micro_batch_size=4", "backend=megatron", *ov] for name, ov in MEGATRON.items()}
    return run_fsdp2(cases, tmp_path_factory.mktemp("megatron"))


@pytest.mark.slow  # one 2-rank job, ~1 min on 2 cores
@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(MEGATRON))
def test_megatron_two_ranks(tiny_megatron, case):
    _check(tiny_megatron[case], f"tiny megatron x2 {case}")


def _worker(out: str) -> None:
    """One rank of the fsdp2 comparisons: measure each case in turn, write <case>/rank<r>.json."""
    import gc

    rank = int(os.environ["RANK"])
    for name, overrides in json.loads(Path(out, "cases.json").read_text()).items():
        gc.collect()  # the last case's runner is freed before this one's baseline is taken
        res = measure([*overrides, "hardware.procs=2"], Path(out) / name / f"r{rank}")
        Path(out, name, f"rank{rank}.json").write_text(json.dumps(res, default=float))


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker(sys.argv[sys.argv.index("--worker") + 1])
