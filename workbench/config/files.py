"""Reading one file of a schema-backed config group outside of a Hydra run.

    load_group_file("hardware", "8xh100")     # the planner reads every hardware profile
    load_group_file("model", "smollm2-135m")  # a tiny model borrows a catalog entry's tokenizer
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from workbench.config.schema import SCHEMA_GROUPS
from workbench.core.errors import UserError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def load_group_file(group: str, name: str) -> DictConfig:
    """One file of a schema-backed group, with its defaults list applied."""
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.exists():
        choices = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        raise UserError(f"{group}={name!r} does not exist; choose one of {choices}")
    node = OmegaConf.load(path)
    merged = OmegaConf.structured(SCHEMA_GROUPS[group])
    for parent in node.pop("defaults", []) or []:
        if parent not in ("_schema", "_self_"):
            merged = OmegaConf.merge(merged, load_group_file(group, parent))
    return OmegaConf.merge(merged, node)
