"""The run report embeds PNG plots of the run's curves (the method's own ones too), and
`python -m workbench.report` compares several runs in one table and one figure
(workbench/telemetry/compare.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, png_pixels, train
from workbench.telemetry import compare, plots

PNG = b"\x89PNG\r\n\x1a\n"


def drawn(path: Path, saved_figures: dict) -> None:
    """The PNG has the pixel size of the figure saved to it and is not blank."""
    pixels = png_pixels(path)
    assert pixels.shape[:2] == saved_figures[path.name]["pixels"], path
    assert len({tuple(p) for p in pixels.reshape(-1, pixels.shape[2])[::7].tolist()}) > 10, path  # not one colour


def _fake_run(run: Path, lr: float, peft: str, losses: list[float], extra: dict | None = None) -> Path:
    """A run directory as the runner leaves it (config.yaml, metrics.jsonl, results.json)."""
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"optim:\n  lr: {lr}\npeft:\n  kind: {peft}\nmodel:\n  name: tiny\n"
                                     f"output_dir: {run}\n")
    rows = [{"step": i + 1, "loss": v, "lr": lr, "grad_norm": 1.0, "tokens_per_s": 100.0 + i, "mfu": 0.1,
             **(extra or {})} for i, v in enumerate(losses)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "results.json").write_text(json.dumps({"eval_end": {"eval/arith_add2/accuracy": 0.5}, "losses": losses}))
    return run


def test_report_embeds_the_plots_of_a_tiny_run(tmp_path, saved_figures):
    train(["train.max_steps=3", "train.plots=true"], tmp_path)
    text = (tmp_path / "report.md").read_text()
    embedded = re.findall(r"!\[[^\]]*\]\((plots/[^)]+\.png)\)", text)
    assert {"plots/loss.png", "plots/lr.png", "plots/grad_norm.png", "plots/throughput.png"} <= set(embedded)
    for rel in embedded:
        assert (tmp_path / rel).read_bytes()[:8] == PNG
        drawn(tmp_path / rel, saved_figures)
    assert "MFU" in text and "measured matmul" in text
    # each figure draws the run's own numbers (metrics.jsonl)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [1.0, 2.0, 3.0]
    for name, key in (("loss.png", "loss"), ("lr.png", "lr"), ("grad_norm.png", "grad_norm"),
                      ("throughput.png", "tokens_per_s")):
        (label, xs, ys, _), *_ = saved_figures[name]["axes"][0]
        assert (xs, ys) == (steps, [r[key] for r in rows]), name
    assert saved_figures["throughput.png"]["axes"][1][0][2] == [r["mfu"] for r in rows]  # MFU on the twin axis


def test_plots_false_writes_no_figures(tmp_path):
    train(["train.max_steps=2", "train.plots=false"], tmp_path)
    assert "## Plots" not in (tmp_path / "report.md").read_text() and not (tmp_path / "plots").exists()


def test_method_curves_get_their_own_figures(tmp_path):
    rows = [{"step": s, "loss": 1.0 / s, "lr": 1e-4, "rewards/chosen": 0.1 * s, "rewards/rejected": -0.1 * s,
             "rewards/margins": 0.2 * s, "completion_length": 5.0 + s, "mix/arith": 1.0} for s in (1, 2, 3)]
    evals = [{"step": 0, "eval/arith_add2/accuracy": 0.1},
             {"step": 3, "eval/arith_add2/accuracy": 0.4, "eval/arith_add2/n": 50, "eval_seconds": 2.0}]
    made = {path.name for _, path in plots.run_plots(rows, evals, tmp_path)}
    assert {"loss.png", "lr.png", "eval.png", "method.png"} <= made
    groups = plots.method_keys(rows)  # one panel each in method.png
    assert groups == {"rewards": ["rewards/chosen", "rewards/rejected", "rewards/margins"],
                      "completion": ["completion_length"]}  # mixture shares are bookkeeping, not curves


def test_compare_runs_in_one_table_and_one_figure(tmp_path, saved_figures):
    sweep = tmp_path / "multirun"
    for i, (lr, peft) in enumerate([(1e-4, "lora"), (1e-4, "none"), (3e-4, "lora"), (3e-4, "none")]):
        _fake_run(sweep / str(i), lr, peft, [2.0, 1.5 - i * 0.1])
    out = subprocess.run([sys.executable, "-m", "workbench.report", str(sweep)], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    lines = [line for line in out.splitlines() if line.startswith("|")]
    assert "optim.lr" in lines[0] and "peft.kind" in lines[0] and "output_dir" not in lines[0]
    assert len(lines) == 2 + 4
    assert "| 0.0003 | none |" in lines[-1] and "1.2000" in lines[-1] and "50.0%" in lines[-1]
    assert (sweep / "comparison.png").read_bytes()[:8] == PNG
    assert "comparison.png" in (sweep / "comparison.md").read_text()
    # the figure, drawn again in this process: a line per run in each panel, with that run's values
    _, fig = compare.compare([str(sweep)], tmp_path / "cmp")
    loss_panel, speed_panel = saved_figures["comparison.png"]["axes"]
    assert [ys for _, _, ys, _ in loss_panel] == [[2.0, 1.5 - i * 0.1] for i in range(4)]
    assert [ys for _, _, ys, _ in speed_panel] == [[100.0, 101.0]] * 4
    assert len({color for *_, color in loss_panel}) == 4  # four runs told apart
    # the command line's PNG is that figure, pixel for pixel
    assert (png_pixels(sweep / "comparison.png") == png_pixels(fig)).all()
    drawn(fig, saved_figures)
    with pytest.raises(SystemExit):
        compare.compare([str(tmp_path / "nothing")])


@pytest.mark.slow
def test_compare_a_real_2x2_multirun(tmp_path):
    """`python -m workbench -m ...` on the tiny model, then the comparison of its four jobs."""
    sweep = tmp_path / "sweep"
    subprocess.run([sys.executable, "-m", "workbench", "-m", "model=tiny", "eval=none", "train.max_steps=3",
                    "train.export=false", "tracker=[]", "optim.lr=1e-4,3e-4", "peft=lora,none",
                    f"hydra.sweep.dir={sweep}"], cwd=ROOT, check=True, capture_output=True)
    table, fig = compare.compare([str(sweep)], tmp_path / "cmp")
    rows = [line for line in table.splitlines() if line.startswith("|")][2:]
    assert len(rows) == 4 and fig.exists()
    for job in range(4):
        assert (sweep / str(job) / "plots" / "loss.png").exists()
