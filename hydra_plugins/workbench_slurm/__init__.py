"""Hydra's submitit Slurm launcher with its jobs followed to their end on clusters without Slurm
accounting (workbench/launch/slurm_follow.py); conf/launcher/slurm.yaml selects it. Hydra finds
launchers only in the `hydra_plugins` namespace package, hence this small module."""

from __future__ import annotations

from hydra.plugins.launcher import Launcher


class FollowedSlurmLauncher(Launcher):
    """Holds Hydra's `SlurmLauncher` (the callable each job runs, pickled as submitit does) and
    replaces only how the jobs are waited for."""

    def __init__(self, **params) -> None:
        from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher

        self.inner = SlurmLauncher(**params)

    def setup(self, *, hydra_context, task_function, config) -> None:
        self.inner.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def launch(self, job_overrides, initial_job_idx):
        from workbench.launch import slurm_follow

        return slurm_follow.launch(self.inner, job_overrides, initial_job_idx)
