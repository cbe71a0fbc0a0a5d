"""Resolving a run: the method's options and the rule table checked, then every decision derived
(workbench/resolve/derive.py).

    from workbench.resolve.resolved import resolve_run
    run = resolve_run(cfg)        # cfg from config.validate(); a UserError for a broken combination

Every entry point (preflight, the runner, export from a checkpoint) resolves through here, so a
method's options (its SPEC.check) and a combination (workbench/resolve/rules.py) are refused in one
place, before anything loads, a dry run included, and derived in one place.
"""

from __future__ import annotations

from dataclasses import replace

from omegaconf import DictConfig, OmegaConf

from workbench.checkpoints import resume
from workbench.methods import registry
from workbench.resolve import rules
from workbench.resolve.derive import Run, derive
from workbench.train.layout import layout


def resolve_run(cfg: DictConfig, rank: int | None = None, world: int | None = None, planning: bool = False,
            env=None) -> Run:
    """Check the method's options and the rule table (the one place a combination is refused),
    then derive.
    `planning`: rules about this machine only warn (dry_run, or a launcher sends the run away).
    Resuming a checkpoint: its global batch is kept at this layout (train.grad_accum recomputed,
    workbench/checkpoints/resume.py), and the run's `cfg` is then a copy with that grad_accum, so the
    rules, the batch arithmetic and DeepSpeed's config all see the accumulation the run uses."""
    rec = resume.record_of(cfg.output_dir, cfg.train.resume)
    lay = layout(cfg, rank, world)
    resume.check_legacy(rec, cfg, lay.world)
    # a method whose options shape the step's batch (GRPO's groups) keeps it in whole groups
    cfg = resume.keep_global_batch(cfg, rec, lay, registry.spec(cfg.method.name).batch)
    resume.check_shrink(cfg, lay, registry.spec(cfg.method.name).batch)  # hardware.min_nodes: every size keeps it
    method = registry.spec(cfg.method.name)
    if method.check is not None:
        # over the options' defaults: a validated config has them all, one written by hand
        # (a test's variant, a planner's sketch) is checked like it
        method.check(OmegaConf.merge(OmegaConf.structured(method.config), cfg.method))
    warnings = rules.check(cfg, env, planning=planning)
    return replace(derive(cfg, rank, world, here=not planning and rules.runs_here(cfg)), warnings=tuple(warnings))
