"""A supervised run whose loss stops falling says so, once, and its end repeats it
(workbench/telemetry/stall.py): the rule on made-up loss curves, then real runs of the tiny model.

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/test_stall_warning.py
"""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from tests.conftest import train
from workbench.telemetry import stall
from workbench.telemetry.stall import LossWatch

WARNING = "warning: the training loss has not improved for"


def watch(losses: list[float], stall_steps: int = 100) -> tuple[LossWatch, list[tuple[int, str]]]:
    """The watch fed `losses` as steps 1, 2, ...; with the (step, line) of every warning."""
    w = LossWatch(stall_steps=stall_steps, window=stall.window_for(stall_steps))
    lines = [(step, line) for step, loss in enumerate(losses, 1) if (line := w.after(step, loss))]
    return w, lines


def band(rng: random.Random, n: int, lo: float = 0.8, hi: float = 1.0) -> list[float]:
    return [rng.uniform(lo, hi) for _ in range(n)]


# -- the rule on made-up curves -----------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_a_flat_noisy_loss_warns_once(seed):
    # Gemma's stalled seed: between 0.8 and 1.0 for 170 steps
    w, lines = watch(band(random.Random(seed), 300))
    assert len(lines) == 1, lines
    step, line = lines[0]
    assert step <= 200  # judged from step S + W = 120 on; flat noise is a stall well before 200
    assert line.startswith(WARNING) and "train.stall_steps" in line
    assert w.stalls[0]["recovered_at"] is None


@pytest.mark.parametrize("seed", range(20))
def test_a_noisy_but_improving_loss_never_warns(seed):
    # the default run's shape, 2 -> 0.1 in 150 steps (each step 0.6-1.4x its trend), and on to
    # 300 steps 22% lower per 100 (0.7-1.3x: at 0.6-1.4x one seed in 200 warns after step 200)
    rng = random.Random(seed)
    trend = [(0.1 + 1.9 * math.exp(-t / 15)) * math.exp(-t / 400) for t in range(1, 301)]
    assert watch([v * rng.uniform(0.6, 1.4) for v in trend[:150]])[1] == []
    assert watch([v * rng.uniform(0.7, 1.3) for v in trend])[1] == []


@pytest.mark.parametrize("seed", range(10))
def test_gemmas_healthy_curve_never_warns(seed):
    # 11.8 -> 0.12 by step 100 -> 0.004 by step 300 (geometric), each step 0.5-1.5x its trend
    rng = random.Random(seed)
    trend = [11.8 * (0.12 / 11.8) ** (t / 100) if t <= 100 else 0.12 * (0.004 / 0.12) ** ((t - 100) / 200)
             for t in range(1, 301)]
    assert watch([v * rng.uniform(0.5, 1.5) for v in trend])[1] == []


def test_improving_then_flat_warns_naming_when_it_stopped():
    rng = random.Random(0)
    falling = [0.9 + 2.0 * math.exp(-t / 8) for t in range(1, 51)]  # ~2.9 -> 0.9 over 50 steps
    w, lines = watch(falling + band(rng, 200))
    assert len(lines) == 1
    s = w.stalls[0]
    # within 5% of the plateau from step 30 (2 e^(-t/8) < 0.045): the best mean before the S steps
    # is one on the plateau, not on the slope
    assert 30 <= s["since"] <= 120, s
    assert s["step"] - s["since"] >= 100 and s["best_steps"] == [s["since"] - 19, s["since"]]
    assert s["recent_best"] > 0.95 * s["best"]
    line = lines[0][1]
    # what stalled, since which step, the best loss and when, the current window
    for part in (f"(since step {s['since']})", f"best 20-step mean loss was {s['best']:.4g} (steps {s['best_steps'][0]}-",
                 f"the last 20 steps' loss: mean {s['last_mean']:.4g}, "):
        assert part in line


@pytest.mark.parametrize("per_100,warns", [(0.03, True), (0.08, False)])
def test_the_threshold_is_five_percent_per_stall_window(per_100, warns):
    # a smooth decline of 3% per 100 steps is a stall; 8% is learning
    losses = [(1 - per_100) ** (t / 100) for t in range(1, 301)]
    assert bool(watch(losses)[1]) is warns


def test_a_stall_that_ends_is_said_at_the_end_with_when_it_ended():
    rng = random.Random(1)
    w, lines = watch(band(rng, 150) + band(rng, 50, 0.3, 0.4))
    assert len(lines) == 1
    s = w.stalls[0]
    assert 150 < s["recovered_at"] <= 160 and s["recovered_mean"] < 0.95 * s["best"]
    end = stall.end_lines({"loss_stall": w.stalls})
    assert len(end) == 1 and end[0].startswith(WARNING)
    assert f"; it improved again at step {s['recovered_at']}" in end[0]


def test_a_second_stall_warns_again():
    rng = random.Random(2)
    w, lines = watch(band(rng, 150) + band(rng, 150, 0.3, 0.4))
    assert len(lines) == 2 and w.stalls[0]["recovered_at"] and w.stalls[1]["recovered_at"] is None


def test_a_fitted_loss_near_zero_is_no_stall():
    rng = random.Random(3)
    assert watch(band(rng, 300, 0.002, 0.006))[1] == []


def test_non_finite_losses_are_skipped():
    rng = random.Random(4)
    losses = band(rng, 300)
    losses[120:125] = [math.nan] * 5
    w, lines = watch(losses)
    assert len(lines) == 1 and len(w.losses) == 295


def test_who_is_watched():
    def run(steps: int, generates: bool):
        cfg = OmegaConf.create({"train": {"stall_steps": steps}})
        return SimpleNamespace(cfg=cfg, facts=SimpleNamespace(generates=generates))

    assert LossWatch.of(run(100, False)).window == 20
    assert LossWatch.of(run(0, False)) is None  # off
    assert LossWatch.of(run(100, True)) is None  # GRPO, on-policy distillation: their own watch or none
    assert LossWatch.of(run(4, False)).window == 1


# -- real runs -----------------------------------------------------------------------------------
# The tiny model (random weights, SFT loss ~10.5) for 10 steps with train.stall_steps=4 (1-step
# means): at lr 1e-9 its loss moves only with the batch (well under 5%; DPO's stays at log 2);
# fully fine-tuned at lr 1e-2 it falls 10.5 -> ~2.4 in 10 steps, far more than 5% every 4 steps.

STALL = ["train.stall_steps=4", "train.max_steps=10", "eval=none"]


def warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(WARNING)]


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_a_stalled_run_warns_once_and_its_end_repeats_it(tmp_path, capsys, method):
    res = train([f"method={method}", "optim.lr=1e-9", *STALL], tmp_path)
    err = capsys.readouterr().err
    lines = warnings(err)
    # the warning mid-run (with what to try), then the end's line (with how the run ended)
    assert len(lines) == 2, err
    assert "train.stall_steps" in lines[0] and "it had not improved again when the run ended" in lines[1]
    assert err.index(lines[0]) < err.index("done: 10 steps") < err.index(lines[1]) < err.index("run directory:")
    s = res["loss_stall"][0]
    assert (s["step"], s["stall_steps"], s["window"]) == (5, 4, 1) and s["recovered_at"] is None
    assert lines[1].startswith("warning: " + stall.describe(s))
    report = (tmp_path / "report.md").read_text()
    assert f"- **{lines[1]}**" in report
    assert json.loads((tmp_path / "results.json").read_text())["loss_stall"][0]["since"] == s["since"]


def test_a_learning_run_does_not_warn(tmp_path, capsys):
    res = train(["peft=none", "optim.lr=1e-2", *STALL], tmp_path)
    err = capsys.readouterr().err
    assert res["losses"][-1] < 0.5 * res["losses"][0]  # it learned
    assert warnings(err) == [] and "loss_stall" not in res
    assert "has not improved" not in (tmp_path / "report.md").read_text()


def test_stall_steps_0_turns_it_off(tmp_path, capsys):
    res = train(["optim.lr=1e-9", *STALL, "train.stall_steps=0"], tmp_path)
    assert warnings(capsys.readouterr().err) == [] and "loss_stall" not in res
