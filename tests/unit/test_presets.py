"""Every `debug` and `experiment` preset reaches the composed config.

A preset is `# @package _global_`: each key it sets (and each group it overrides in its
defaults list) must win over conf/train.yaml's own values, and the command line must still win
over the preset. Run: `pytest tests/unit/test_presets.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from tests.conftest import CONF, compose

PRESETS = sorted((g, p.stem) for g in ("debug", "experiment") for p in (Path(CONF) / g).glob("*.yaml"))


def _leaves(node: dict, prefix: str = ""):
    """(dotted key, value) for every scalar or list the preset sets."""
    for key, value in node.items():
        if prefix == "" and key == "defaults":
            continue
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _leaves(value, dotted + ".")
        else:
            yield dotted, value


def _group_overrides(node: dict):
    """(group, choice) for each `override /group: choice` in the preset's defaults list."""
    for entry in node.get("defaults", []):
        if isinstance(entry, dict):
            for key, choice in entry.items():
                if key.startswith("override /"):
                    yield key.removeprefix("override /"), choice


@pytest.mark.parametrize("group,name", PRESETS, ids=[f"{g}={n}" for g, n in PRESETS])
def test_preset_keys_reach_the_config(group, name):
    body = yaml.safe_load((Path(CONF) / group / f"{name}.yaml").read_text())
    cfg = compose([f"{group}={name}"], base=())
    leaves = list(_leaves(body))
    assert leaves or list(_group_overrides(body)), f"{group}/{name}.yaml sets nothing"
    for key, want in leaves:
        got = OmegaConf.select(cfg, key)
        if OmegaConf.is_config(got):
            got = OmegaConf.to_container(got)
        assert got == want, f"{group}={name}: {key} is {got!r}, the preset says {want!r}"
    for grp, choice in _group_overrides(body):
        # each group records its choice as a field (`model.name`, `precision.name`, `peft.kind`)
        node = cfg[grp]
        names = {str(node.get(f)) for f in ("name", "kind") if f in node}
        assert choice in names or (grp == "eval" and choice == "none" and not node.tasks), \
            f"{group}={name}: /{grp} override to {choice!r} did not apply ({names})"


def test_command_line_beats_preset():
    cfg = compose(["debug=fast", "train.max_steps=7"], base=())
    assert cfg.train.max_steps == 7
    assert cfg.train.micro_batch_size == 4  # from the preset


def test_debug_fast_is_a_two_step_run():
    """The README's smoke run: `python -m workbench model=tiny debug=fast` trains 2 steps."""
    cfg = compose(["model=tiny", "debug=fast"], base=())
    assert (cfg.train.max_steps, cfg.train.micro_batch_size, cfg.train.export) == (2, 4, False)
