"""Where a run goes in the plan: the table's rows (plan.compare), whole-job time and cost on a
profile's whole cluster, a CPU run asking for more processes than cores, and GRPO's generation.

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/test_plan_where.py
"""

from __future__ import annotations

import io
from dataclasses import replace
from types import SimpleNamespace

import pytest
from rich.console import Console

from tests.conftest import compose
from workbench.plan import make as run_plan
from workbench.plan.check import Shapes
from workbench.plan.make import from_cfg, make_plan, refusal, rollout_of
from workbench.plan.memory import estimate
from workbench.plan.speed import Decoder, Rollout, generation_seconds
from workbench.plan.tables import show
from workbench.train.batch import Forward


def table(plan: dict) -> str:
    out = io.StringIO()
    show(plan, Console(file=out, width=250, highlight=False))
    return out.getvalue()


def test_the_table_shows_the_asked_hardware_unless_compare():
    one = make_plan(compose(["plan.hardware=[8xh100,b200]"]))
    text = table(one)
    assert not one["compare"] and "cpu" in text
    assert "8xh100" not in text and "b200" not in text
    both = make_plan(compose(["plan.hardware=[8xh100,b200]", "plan.compare=true"]))
    text = table(both)
    assert both["compare"] and "8xh100" in text and "b200" in text and "cpu" in text
    assert "whole job" in text


def test_time_and_cost_are_the_whole_jobs_on_the_whole_cluster():
    plan = make_plan(compose(["plan.hardware=[b200,8xb200]", "plan.compare=true"]))
    rows = {r["hardware"]: r for r in plan["profiles"]}
    one, eight = rows["b200"], rows["8xb200"]
    assert one["fits"] and eight["fits"] and (one["devices"], eight["devices"]) == (1, 8)
    assert eight["tokens_per_s"] == pytest.approx(8 * one["tokens_per_s"])
    assert eight["hours"] == pytest.approx(one["hours"] / 8)
    # the same device-hours at the same price: the same money
    assert eight["cost_usd"] == pytest.approx(one["cost_usd"])
    assert one["cost_usd"][0] == pytest.approx(one["hours"] * 1 * one["price_per_hour"][0])
    assert eight["cost_usd"][1] == pytest.approx(eight["hours"] * 8 * eight["price_per_hour"][1])


def test_a_profile_where_it_does_not_fit_gives_the_time_on_the_devices_it_needs():
    plan = make_plan(compose(["model=70b", "method=dpo", "plan.hardware=[b200,h100-80gb,8xb200]",
                              "plan.compare=true"]))
    rows = {r["hardware"]: r for r in plan["profiles"]}
    h100 = rows["h100-80gb"]  # no change fits on its one device: no time there
    assert not h100["fits"] and not h100["fix"] and h100["hours"] is None and h100["cost_usd"] is None
    need = h100["needed"]
    assert need["devices"] > 1 and need["hours"] > 0 and need["backend"] == "fsdp2"
    assert need["cost_usd"][0] == pytest.approx(need["hours"] * need["devices"] * h100["price_per_hour"][0])
    text = " ".join(table(plan).split())  # lines wrap at 100 columns
    assert f"h100-80gb: does not fit; smallest change that fits: {need['devices']} devices" in text
    # a change fits on b200's one device: its time is the changed run's, and the row says so
    b200 = rows["b200"]
    assert not b200["fits"] and b200["fix"] == "peft=qlora" and b200["hours"] > 0
    assert f"or {b200['needed']['devices']} devices with activation checkpointing and backend=fsdp2" in text
    assert "with change" in text


def test_more_cpu_processes_than_cores_is_refused_for_the_cores(monkeypatch):
    monkeypatch.setattr(run_plan.os, "cpu_count", lambda: 2)
    cfg = compose(["hardware.procs=64"])
    plan = make_plan(cfg)
    over = plan["here"]["cores"]
    assert over["available"] == 2 and over["asked"] == 64 and over["fits"]
    msg = refusal(plan)
    assert "64 processes" in msg and "2 CPU cores" in msg and "hardware.procs<=2" in msg
    assert "MI300X" not in msg and "hardware=" not in msg
    assert "hardware.procs<=2" in table(plan)
    assert "cores" not in make_plan(compose(["hardware.procs=2"]))["here"]


def grpo(*overrides):
    return from_cfg(compose(["method=grpo", "model=smollm2-135m", "precision=bf16-mixed", "train.micro_batch_size=16",
                             *overrides]))


def test_grpo_plans_its_generation():
    s = grpo()
    assert s.rollouts and s.share_prompt and s.rollout_prompts * s.generations == 32 and not s.old_logps
    cpu = run_plan.decoder(compose([]).hardware, compose(["model=smollm2-135m"]).model.arch, 4e11, 0.4, "lora")

    def seconds(setup):
        return generation_seconds(rollout_of(setup), 1.35e8, 2.7e8, cpu)

    base = seconds(s)
    # decode steps follow max_new_tokens, rows num_generations (prompts per step fixed)
    assert rollout_of(grpo("method.max_new_tokens=16")).decode_steps == 2 * rollout_of(s).decode_steps
    decode = generation_seconds(replace(rollout_of(s), prefill_tokens=0, calls=0), 1.35e8, 2.7e8, cpu)
    assert 0 < decode < base and seconds(grpo("method.max_new_tokens=16")) == pytest.approx(base + decode)
    fixed = grpo("method.prompts_per_step=4")
    wide = grpo("method.prompts_per_step=4", "method.num_generations=16")
    assert rollout_of(wide).rows == 2 * rollout_of(fixed).rows
    assert seconds(wide) > seconds(fixed)
    # a rollout reused for num_iterations steps is generated once for them, and the ratios
    # then need the generating policy's log-probs
    again = grpo("method.num_iterations=2")
    assert again.old_logps and seconds(again) == pytest.approx(base / 2)
    # the KV cache holds every completion of the rank's rollout, prompt and completion
    m = compose(["model=smollm2-135m"]).model
    from workbench.plan.counts import count, probe

    c = count(probe(m), m.arch, compose(["model=smollm2-135m"]).peft)
    g8 = estimate(c, m.arch, fixed).generation
    g16 = estimate(c, m.arch, wide).generation
    assert g16 == pytest.approx(2 * g8)
    assert estimate(c, m.arch, grpo("method.max_new_tokens=64")).generation > estimate(c, m.arch, s).generation
    # the completions' tokens, not every position, carry a loss (logits)
    assert estimate(c, m.arch, s).logits == pytest.approx(s.micro_batch * s.completion_len * m.arch.vocab * 12)


def test_generation_is_bound_by_the_weights_or_the_flops():
    d = Decoder(flops=1e12, bandwidth=1e12, step_s=0.0)
    small = generation_seconds(Rollout(0, 10, 1), 1e9, 2e9, d)
    assert small == pytest.approx(10 * 2e9 / 1e12)  # one row: the weights' read
    many = generation_seconds(Rollout(0, 10, 1000), 1e9, 2e9, d)
    assert many == pytest.approx(10 * 1000 * 2e9 / 1e12)  # many rows: their FLOPs


def test_the_plan_check_plans_what_the_rollouts_generated():
    shapes = Shapes()
    passes = [Forward(4, 39, 39, 4), *[Forward(32, 1, 40 + t, 32) for t in range(8)],
              Forward(2, 39, 39, 2), *[Forward(16, 1, 40 + t, 16) for t in range(8)]]
    batch = SimpleNamespace(micro=[], forward_passes=passes)
    shapes.update(batch)
    shapes.update(batch)  # the same rollout again (num_iterations=2): generated once
    r = shapes.rollout()
    assert r.decode_steps == 8 and r.rows == 24 and r.prefill_tokens == (4 * 39 + 2 * 39) / 2 and r.calls == 1
    assert make_plan(compose(["method=grpo"]), others=False, rollout=r)["here"]["generation_s_per_token"] > 0
