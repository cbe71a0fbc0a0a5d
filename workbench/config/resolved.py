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
from workbench.config.run import Run, derive, layout
from workbench.train import resume


def resolve(cfg: DictConfig, rank: int | None = None, world: int | None = None, planning: bool = False,
            env=None) -> Run:
    """Check the rule table (the one place a combination is refused), then derive.
    `planning`: rules about this machine only warn (dry_run, or a launcher sends the run away).
    Resuming a checkpoint: its global batch is kept at this layout (train.grad_accum recomputed,
    workbench/train/resume.py), and the run's `cfg` is then a copy with that grad_accum, so the
    rules, the batch arithmetic and DeepSpeed's config all see the accumulation the run uses."""
    rec = resume.record_of(cfg.output_dir, cfg.train.resume)
    lay = layout(cfg, rank, world)
    resume.check_legacy(rec, cfg, lay.world)
    cfg = resume.keep_global_batch(cfg, rec, lay)
    warnings = rules.check(cfg, env, planning=planning)
    return replace(derive(cfg, rank, world, here=not planning and rules.runs_here(cfg)), warnings=tuple(warnings))
