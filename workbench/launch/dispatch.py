"""Where a run executes. `launcher=local` runs here, or under torchrun when more than one process
is asked for or the backend needs a launcher's environment even on one (backend=deepspeed reads
LOCAL_RANK); other launchers (conf/launcher/) send the same composed config elsewhere.

`dispatch(cfg)` returns the results of a run it started elsewhere, or None when the run should
proceed in this process.
"""

from __future__ import annotations

from workbench.backends import registry as backends
from workbench.config.rule import backend_name, launcher_name
from workbench.core.errors import UserError
from workbench.train.distributed import requested_procs, under_distributed_launcher


# Each launcher besides local, by name: a function that imports its module when chosen (its engine
# is an optional extra: submitit, ray, modal, runpod); every module has `launch(cfg) -> dict`.
# Functions, not module names: nothing in the workbench is imported by name (tests/unit/test_layout.py).
def _slurm():
    from workbench.launch import slurm  # submitit

    return slurm


def _ray():
    from workbench.launch import ray_train  # ray

    return ray_train


def _modal():
    from workbench.launch import modal_app  # modal

    return modal_app


def _runpod():
    from workbench.launch import runpod_pod  # runpod

    return runpod_pod


LAUNCHERS = {"slurm": _slurm, "ray": _ray, "modal": _modal, "runpod": _runpod}


def torchrun_reason(cfg) -> str | None:
    """Why `launcher=local` starts this run under torchrun, or None when it runs in this process.
    A backend that only runs inside a launched process (its facts: DeepSpeed's engine refuses to
    start without LOCAL_RANK, which torchrun sets) is started through torchrun on one process too."""
    backend = backend_name(cfg)
    if launcher_name(cfg) != "local" or under_distributed_launcher():
        return None
    procs = requested_procs(cfg.hardware)
    if procs > 1:
        return f"{procs} processes"
    if backends.spec(backend).facts.needs_launcher:
        return f"backend={backend} runs only in a launched process, so its one process is started by torchrun"
    return None


def dispatch(cfg):
    name = launcher_name(cfg)
    if name != "local":
        if name not in LAUNCHERS:
            raise UserError(f"launcher={name!r} is not one of {['local', *sorted(LAUNCHERS)]}")
        return LAUNCHERS[name]().launch(cfg)
    if torchrun_reason(cfg) is not None:
        # each launcher module is imported when chosen: torchrun's imports the resolved run, the
        # others reach their optional engines (submitit, ray, modal, runpod)
        from workbench.launch import torchrun

        return torchrun.launch(cfg)
    return None

