"""Reward functions that runs under test name as `tests.rewards:<function>` (reward.functions).

The golden GRPO curves (tests/golden.py), the distributed runs and the unit tests score
completions with these, so they live here rather than in a test module.
"""

from __future__ import annotations


def char_length(completions, **_) -> list[float]:
    """A reward with spread on a random model's text (used by the grpo golden curves)."""
    return [len(c) / 50.0 for c in completions]


_CALLS = {"n": 0}


def char_length_stalling(completions, **_) -> list[float]:
    """char_length, and a rollout that stalls on request: with WORKBENCH_TEST_STALL="K:path" the
    K-th call of the process (0-based: the K-th rollout it scores) writes `path` and sleeps, so a
    test can SIGKILL the run while that rollout is in progress (tests/integration/test_grpo_kill.py)."""
    import os
    import time
    from pathlib import Path

    stall = os.environ.get("WORKBENCH_TEST_STALL")
    if stall:
        at, path = stall.split(":", 1)
        if _CALLS["n"] == int(at):
            Path(path).write_text(str(_CALLS["n"]))
            time.sleep(120)  # well inside reward.timeout_s (300 s): killed before it ends
        _CALLS["n"] += 1
    return char_length(completions)
