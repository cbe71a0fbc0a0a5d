"""A dry run's verdict: `python -m workbench dry_run=true ...` prints the whole plan and exits 4
(workbench/plan/make.py DOES_NOT_FIT_EXIT) when it does not fit the configured hardware, with one
`error:` line ending with the smallest change that fits (Megatron's included: its own layouts,
then the backend that shards parameters), and the change named really fits and passes the rules.
The tables keep to 100 columns; the token count says why it follows the devices; Megatron's
weights say why they are two models.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_plan_verdict.py

Each CLI case is a fresh Python process (~6 s of CPU; no weights load in a dry run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, compose
from workbench.plan.make import DOES_NOT_FIT_EXIT, make_plan
from workbench.plan.tables import WIDTH, tokens_line
from workbench.resolve import rules

DPO = ["method=dpo", "model=70b", "hardware=8xh100"]
GRPO_MEGATRON = ["method=grpo", "model=70b", "backend=megatron", "hardware=8xh100"]


def dry_run(overrides: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "WORKBENCH_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "workbench", "dry_run=true", *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def error_line(proc: subprocess.CompletedProcess) -> str:
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def plan_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """stdout from the plan's first line on (the preflight and warning lines before it are not tables)."""
    lines = proc.stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("plan model="))
    return lines[start:]


def change_in(error: str) -> str:
    """The overrides of 'smallest change that fits here: <overrides> (N GiB per device)'."""
    return error.split("smallest change that fits here: ", 1)[1].split(" (", 1)[0]


def fits_with(overrides: list[str], change: str) -> dict:
    """The plan of the run with `change` applied on the command line, and the rules it breaks."""
    cfg = compose([*overrides, *change.split()], base=())
    broken = [r.id for r, _ in rules.violations(cfg, rules.Env()) if not r.machine]
    return {"fits": make_plan(cfg, others=False)["here"]["fits"], "broken": broken}


def test_dpo_70b_on_8xh100_exits_4_with_the_whole_plan_and_the_change(tmp_path):
    proc = dry_run(DPO, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == DOES_NOT_FIT_EXIT == 4, out[-3000:]
    assert "Traceback" not in out
    err = error_line(proc)
    assert err.startswith("error: the plan does not fit hardware=8xh100 as configured"), err
    change = change_in(err)
    assert change and err.rstrip().endswith("GiB per device)"), err
    assert fits_with(DPO, change) == {"fits": True, "broken": []}, change
    lines = plan_lines(proc)
    text = " ".join(" ".join(lines).split())
    assert "memory per device" in text and "where it runs" in text and f"smallest change that fits here: {change}" in text
    assert all(len(ln) <= WIDTH for ln in lines), max(lines, key=len)
    # no advice to add what is set already; the weights line says what is true of them
    assert "add dry_run=true" not in out
    assert "weights from not found here" not in out and "weights: not on this machine (the plan needs none)" in out
    # where the count is shown: it is per data-parallel rank times the ranks
    assert "x 8 data-parallel ranks" in text and "grows with the devices" in text


def test_grpo_70b_on_megatron_names_a_change_and_why_the_weights_are_two_models(tmp_path):
    proc = dry_run(GRPO_MEGATRON, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == DOES_NOT_FIT_EXIT, out[-3000:]
    change = change_in(error_line(proc))
    # no tp/pp splits the HF model generation decodes with: the change leaves Megatron
    assert change.startswith("backend=fsdp2"), change
    assert fits_with(GRPO_MEGATRON, change) == {"fits": True, "broken": []}, change
    lines = plan_lines(proc)
    text = " ".join(" ".join(lines).split())
    assert "weights (2 models, see below)" in text
    assert "for the whole HF model, kept on every device because generation decodes with it" in text
    assert all(len(ln) <= WIDTH for ln in lines), max(lines, key=len)


def test_json_says_it_does_not_fit_and_exits_alike(tmp_path):
    proc = dry_run([*GRPO_MEGATRON, "plan.json=true"], tmp_path)
    assert proc.returncode == DOES_NOT_FIT_EXIT, proc.stderr[-3000:]
    facts = json.loads(proc.stdout)
    assert facts["fits"] is False and facts["exit_status"] == DOES_NOT_FIT_EXIT and facts["plan"]["fits"] is False
    assert facts["plan"]["here"]["fix"].startswith("backend=fsdp2")
    assert facts["plan"]["hf_copy_gb"] > 100 and facts["plan"]["notes"]
    assert error_line(proc).startswith("error: the plan does not fit hardware=8xh100")


def test_a_run_that_fits_has_no_refusal_and_the_tokens_follow_the_devices():
    fixed = make_plan(compose([*DPO, "backend=fsdp2", "train.micro_batch_size=1", "train.grad_accum=16"], base=()),
                      others=False)
    assert fixed["fits"] and "refusal" not in fixed
    cpu = make_plan(compose(["method=dpo", "model=70b", "hardware=cpu"], base=()), others=False)
    eight = make_plan(compose(DPO, base=()), others=False)
    assert eight["tokens"] == 8 * cpu["tokens"]
    assert "x 1 data-parallel rank x" in tokens_line(cpu) and "x 8 data-parallel ranks x" in tokens_line(eight)


@pytest.mark.parametrize("backend", ["single", "fsdp2"])
def test_no_weights_note_without_a_second_model(backend):
    plan = make_plan(compose([*GRPO_MEGATRON[:2], f"backend={backend}", "hardware=8xh100"], base=()), others=False)
    # the one note left is the chunked loss the 128,256-token vocabulary gets (resolve/derive.py Run.loss_chunk)
    assert plan["hf_copy_gb"] == 0 and not [n for n in plan["notes"] if n.startswith("weights")], plan["notes"]


def test_megatron_is_changed_by_its_own_options_before_it_is_left():
    # LoRA SFT keeps no HF copy on Megatron: a larger TP is the change, and it composes and fits
    sft = ["method=sft", "model=70b", "backend=megatron", "hardware=8xh100"]
    fix = make_plan(compose(sft, base=()), others=False)["here"]["fix"]
    assert fix.startswith("backend.tp="), fix
    assert fits_with(sft, fix) == {"fits": True, "broken": []}
    # what the search may name on Megatron, by the overrides that give it
    from workbench.plan.fit import _steps, label
    from workbench.plan.setup import Setup

    arch = compose(sft, base=()).model.arch
    s = Setup(backend="megatron", devices=8, micro_batch=2, peft="lora")
    tried = {label(s, s.but(**kw)) for kw in _steps(s, arch)}
    assert {"backend.recompute=full", "backend.tp=8", "backend.pp=2", "backend.distributed_optimizer=true"} <= tried
    assert not any("qlora" in t for t in tried)  # no 4-bit Megatron layers (rule qlora-megatron)
    # leaving it for FSDP2 names FSDP2's own checkpointing option (rule fsdp2-model-checkpointing)
    from workbench.plan.fit import off_model_parallel

    assert label(s, off_model_parallel(s).but(checkpointing="full")) == "backend=fsdp2 backend.activation_checkpointing=full"
