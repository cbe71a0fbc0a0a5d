"""The one list of environments `env=<name>` can name; anything else is `package.module:Class`.

    from workbench.envs import registry
    env = registry.load(cfg.env)        # UserError for an unknown name or a bad class, before weights load
"""

from __future__ import annotations

from workbench.core.errors import UserError
from workbench.core.imports import user_function
from workbench.envs.base import Environment, check_node
from workbench.envs.calculator import Calculator
from workbench.envs.openenv import OpenEnv

# openenv: a client of an OpenEnv server; websockets (and openenv-core, to serve) are imported only when chosen
ENVS: dict[str, type] = {"calc": Calculator, "openenv": OpenEnv}


def load(node) -> Environment:
    """The environment `env.name` names (a registered one or `package.module:Class`), built from
    its config node; UserError for an unknown name or a class that is not an Environment."""
    cfg = check_node(node)
    name = cfg["name"]
    known = ENVS
    if name in known:
        cls = known[name]
    elif ":" in name:
        cls = user_function(name, "env.name")
    else:
        raise UserError(f"env.name={name!r}: unknown environment; shipped ones are {sorted(known)} (conf/env/), "
                        "or name your own as 'package.module:Class'")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise UserError(f"env.name={name!r} is not a subclass of workbench.envs.base.Environment")
    env = cls(cfg)
    if not env.tools:
        raise UserError(f"env.name={name!r} declares no tools (TOOLS)")
    return env
