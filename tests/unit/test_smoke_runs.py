"""`debug=fast` is a smoke run for every method: generation is bounded (debug.max_new_tokens), so
a random tiny model, which never ends a turn on its own, cannot talk to the token limit of every
turn. Checked by the tokens generated, not by the seconds.

    python -m pytest -q tests/unit/test_smoke_runs.py
"""

from __future__ import annotations

import json

from tests.conftest import compose
from workbench.run.runner import Runner


def test_debug_fast_bounds_every_generation_knob():
    cfg = compose(["debug=fast", "method=grpo", "env=calc", "method.max_new_tokens=64", "env.max_new_tokens=48",
                   "env.max_turns=3"], base=[])
    assert cfg.debug.max_new_tokens == 8
    assert (cfg.method.max_new_tokens, cfg.env.max_new_tokens, cfg.env.max_turns) == (8, 8, 2)
    assert cfg.method.max_resample_rounds == 0
    plain = compose(["debug=fast", "method=grpo", "method.max_new_tokens=4"], base=[])
    assert plain.method.max_new_tokens == 4  # a tighter limit of the user's own stays
    assert compose(["method=grpo"], base=[]).method.max_new_tokens > 0  # without debug=fast: untouched
    assert compose(["method=grpo"], base=[]).debug.max_new_tokens is None


def test_grpo_env_smoke_run_generates_at_most_the_bound(tmp_path):
    cfg = compose(["debug=fast", "method=grpo", "env=calc", f"output_dir={tmp_path}"], base=[])
    Runner(cfg).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "episode/sampled_tokens" in r]
    assert len(steps) == 2
    for r in steps:
        # a sampled turn is at most 8 tokens and an episode at most 2 turns; no refill rounds
        assert r["completion_length_max"] <= 8 and r["episode/turns"] <= 2, r
        assert r["episode/sampled_tokens"] <= 16 and r["resample_rounds"] == 0, r
