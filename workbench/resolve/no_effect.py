"""Settings that would have no effect in the composed run: refused naming why, or warned by name.

A setting the run never reads is worse than a typo: the run trains, and its records say the
setting was given. Each check here names the setting, what makes it inert in this run and the
fix; the choice between refusing and warning follows what the user asked for:

- `data.recipe` beside `data.path` (data.path replaces the recipe): refused, before validation
  fills in the method's own recipe (`before_defaults`);
- `reward` with a method that samples nothing to score (sft, dpo, ...): refused (`check`);
- `eval.tasks` where no evaluation ever runs (eval.at_start, eval.at_end false and
  eval.every_n_steps 0, as debug=fast and eval=none set them): warned (`warnings`), since
  presets such as debug=overfit keep the default task list with evaluation off;
- `train.keep_best` with no evaluation after a step: refused in workbench/checkpoints/keep_best.py.

    from workbench.resolve import no_effect
    no_effect.before_defaults(merged)   # validate(), before the method's recipe is filled in
    no_effect.check(cfg)                # validate(), on the merged config
    no_effect.warnings(cfg)             # preflight: lines to print as `warning: ...`
"""

from __future__ import annotations

from workbench.core.errors import UserError
from workbench.methods import registry


def _inline(recipe) -> bool:
    """A recipe validation wrote for data.path (JSON), as a launched job re-validates it."""
    return str(recipe).lstrip().startswith("{")


def before_defaults(merged) -> None:
    """Checks that must see the config as composed, before validation fills in defaults."""
    data = merged.data
    if data.path is not None and data.recipe is not None and not _inline(data.recipe):
        raise UserError(f"data.recipe={data.recipe} and data.path={data.path}: data.path replaces the recipe, so "
                        "data.recipe would not be read; give one of them (data.recipe=null to train on data.path)")


def _samplers() -> list[str]:
    return [n for n, s in registry.SPECS.items() if s.facts.data == "prompts"]


def _reward_names(reward) -> list[str]:
    fns = (reward.get("functions") or []) if hasattr(reward, "get") else []
    return [str(f if isinstance(f, str) else f.get("name")) for f in fns]


def check(cfg) -> None:
    """Refuse a setting the composed run would not read."""
    reward = cfg.get("reward")
    method = cfg.method.name
    # an environment scores its own episodes; env=... with another method is refused by the
    # env-needs-grpo rule, which says more than this would
    if reward is not None and cfg.get("env") is None and method not in _samplers():
        names = _reward_names(reward)
        which = f" ({', '.join(names)})" if names else ""
        raise UserError(f"reward{which}: method={method} samples no completions to score, so the reward functions "
                        f"would not be read; drop reward (reward=null), or use method={'/'.join(_samplers())}")


def never_evaluated(cfg) -> bool:
    """No evaluation runs at all: not before training, not during, not after."""
    e = cfg.eval
    return not (e.at_start or e.at_end or e.every_n_steps)


def warnings(cfg) -> list[str]:
    """Settings the run accepts but would not use, as `warning:` lines."""
    out = []
    tasks = list(cfg.eval.tasks)
    if tasks and never_evaluated(cfg):
        out.append(f"eval.tasks={tasks} will not run: eval.at_start and eval.at_end are false and "
                   "eval.every_n_steps is 0 (debug=fast and eval=none turn evaluation off); add eval.at_end=true "
                   "to evaluate after training")
    return out
