"""Reward functions that runs under test name as `tests.rewards:<function>` (reward.functions).

The golden GRPO curves (tests/golden.py), the distributed runs and the unit tests score
completions with these, so they live here rather than in a test module.
"""

from __future__ import annotations


def char_length(completions, **_) -> list[float]:
    """A reward with spread on a random model's text (used by the grpo golden curves)."""
    return [len(c) / 50.0 for c in completions]
