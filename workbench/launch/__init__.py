"""Where a run executes. `launcher=local` runs here, or under torchrun when more than one process
is asked for; other launchers (conf/launcher/) send the same composed config elsewhere.

`dispatch(cfg)` returns the results of a run it started elsewhere, or None when the run should
proceed in this process.
"""

from __future__ import annotations

import importlib
import os

# launcher name -> module in this package with `launch(cfg) -> dict`
LAUNCHERS: dict[str, str] = {"slurm": "slurm", "ray": "ray_train", "modal": "modal_app", "runpod": "runpod_pod"}


def under_distributed_launcher() -> bool:
    """True inside torchrun / accelerate launch / a Ray or Slurm worker that set up ranks."""
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def dispatch(cfg):
    name = cfg.launcher.name if cfg.launcher is not None else "local"
    if name != "local":
        if name not in LAUNCHERS:
            from workbench.errors import UserError

            raise UserError(f"launcher={name!r} is not one of {['local', *sorted(LAUNCHERS)]}")
        return importlib.import_module(f"workbench.launch.{LAUNCHERS[name]}").launch(cfg)
    if cfg.hardware.procs * cfg.hardware.nodes > 1 and not under_distributed_launcher():
        return importlib.import_module("workbench.launch.torchrun").launch(cfg)
    return None
