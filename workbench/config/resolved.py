"""Resolving a run: the rule table checked, then every decision derived (workbench/config/run.py).

    from workbench.config.resolved import resolve
    run = resolve(cfg)        # cfg from config.validate(); a UserError for a broken combination

Every entry point (preflight, the runner, export from a checkpoint) resolves through here, so a
combination is refused in one place (workbench/config/rules.py) and derived in one place.
"""

from __future__ import annotations

from dataclasses import replace

from omegaconf import DictConfig

from workbench.config import rules
from workbench.config.run import Run, derive


def resolve(cfg: DictConfig, rank: int | None = None, world: int | None = None, planning: bool = False,
            env=None) -> Run:
    """Check the rule table (the one place a combination is refused), then derive.
    `planning`: rules about this machine only warn (dry_run, or a launcher sends the run away)."""
    warnings = rules.check(cfg, env, planning=planning)
    return replace(derive(cfg, rank, world, here=not planning and rules.runs_here(cfg)), warnings=tuple(warnings))
