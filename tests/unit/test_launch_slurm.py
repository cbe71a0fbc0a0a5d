"""launcher=slurm, offline: config composition, the sbatch script Hydra's submitit launcher
would submit (rendered by submitit itself, not sent), requeue settings, and the job side
(torch.distributed variables exported from a simulated Slurm task environment).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_launch_slurm.py
"""

from __future__ import annotations

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from tests.conftest import CONF, TINY, compose
from workbench.config.schema import register_resolvers
from workbench.core.errors import UserError

register_resolvers()  # conf/train.yaml's output_dir resolver (importing workbench.config.schema registers it)

submitit = pytest.importorskip("submitit")
pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

GPU_JOB = ["launcher=slurm", "hardware.device=cuda", "hardware.procs=8", "hardware.nodes=2",
           "launcher.partition=gpu", "launcher.account=proj", "launcher.time_minutes=90", "launcher.max_requeues=5"]


def _with_hydra(overrides, sweep_dir):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return hydra_compose(config_name="train", overrides=[*TINY, *overrides, f"hydra.sweep.dir={sweep_dir}"],
                             return_hydra_config=True)


def test_launcher_group_selects_submitit_and_maps_resources(tmp_path):
    cfg = _with_hydra(GPU_JOB, tmp_path)
    hl = cfg.hydra.launcher
    assert hl._target_ == "hydra_plugins.workbench_slurm.FollowedSlurmLauncher"  # submitit's, followed
    assert (hl.nodes, hl.tasks_per_node, hl.gpus_per_node) == (2, 8, 8)
    assert (hl.timeout_min, hl.partition, hl.account, hl.max_num_timeout) == (90, "gpu", "proj", 5)
    assert cfg.launcher.name == "slurm"


def test_sbatch_script_rendered_by_submitit(tmp_path, monkeypatch):
    """Run the plugin's own launch() up to submission and render the sbatch file it would send."""
    from hydra.utils import instantiate

    cfg = _with_hydra(GPU_JOB, tmp_path)
    launcher = instantiate(cfg.hydra.launcher)
    launcher.setup(hydra_context=None, task_function=lambda c: None, config=cfg)
    captured = {}

    def fake_map_array(self, fn, *args):
        captured["executor"] = self
        captured["sbatch"] = self._executor._make_submission_file_text("python -m submitit.core._submit x", "uid")
        captured["job_args"] = args
        raise RuntimeError("not submitting")

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", fake_map_array)
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 2))  # no srun here
    with pytest.raises(RuntimeError, match="not submitting"):
        launcher.launch([["optim.lr=1e-4"], ["optim.lr=3e-4"]], initial_job_idx=0)
    sbatch = captured["sbatch"]
    for line in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --time=90",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --signal=USR2@120", "#SBATCH --open-mode=append"]:
        assert line in sbatch, line
    assert str(tmp_path) in sbatch  # logs under the sweep dir's .submitit/
    # requeue after timeouts is bounded by launcher.max_requeues; preemption requeues always
    assert captured["executor"]._executor.max_num_timeout == 5
    overrides, dir_keys, nums = captured["job_args"][:3]
    assert list(overrides) == [["optim.lr=1e-4"], ["optim.lr=3e-4"]] and list(nums) == [0, 1]
    # on preemption submitit calls checkpoint(): the same job (same sweep dir and job number, so the
    # same output_dir) is resubmitted, and train.resume=auto continues from its last checkpoint
    again = launcher.inner.checkpoint(["optim.lr=1e-4"], "hydra.sweep.dir", 0, "id", {})
    assert isinstance(again, submitit.helpers.DelayedSubmission) and again.args[2] == 0


def test_job_dir_is_the_sweep_subdir_in_multirun(tmp_path, monkeypatch):
    """What makes a requeued job find its checkpoints: output_dir follows the Hydra job dir
    (tests/integration/test_sweep.py shows it in a real multirun)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    cfg = _with_hydra(GPU_JOB, tmp_path)
    for mode, expected in [(RunMode.MULTIRUN, str(tmp_path / "3")), (RunMode.RUN, None)]:
        fake = OmegaConf.create({"mode": mode, "runtime": {"output_dir": str(tmp_path / "3")}})
        monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
        monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda fake=fake: fake))
        got = cfg.output_dir
        assert got == expected if expected else got.startswith("runs/")


def test_outside_slurm_asks_for_multirun(tmp_path, monkeypatch):
    from workbench.launch import slurm

    for var in ("SUBMITIT_EXECUTOR", "SLURM_JOB_ID", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(UserError, match="add -m"):
        slurm.launch(compose(["launcher.name=slurm"], tmp_path))


def test_inside_a_slurm_task_exports_ranks_and_records_the_job(tmp_path):
    import json
    import os
    import signal

    from workbench.launch import slurm

    env = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    dist = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
    before = {k: os.environ.get(k) for k in (*env, *dist)}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        for k in dist:
            # setenv first so that monkeypatch removes what submitit exports here when the test ends
            # (a leaked WORLD_SIZE would make every later run in this process wait for a rendezvous)
            mp.setenv(k, "unset")
            mp.delenv(k)
        # gpu07 resolves nowhere here: the route to the first node is tests/cluster/'s (real nodes)
        mp.setattr(slurm.network, "prepare", lambda *a, **k: None)
        mp.setattr(slurm.faults, "ON_PREEMPTED", [])
        usr2 = signal.getsignal(signal.SIGUSR2)
        cfg = compose(["launcher=slurm", "launcher.partition=gpu"], tmp_path / "job")
        assert slurm.launch(cfg) is None  # train in this process, as rank 0 of 4
        signal.signal(signal.SIGUSR2, usr2)
        assert slurm.faults.ON_PREEMPTED == [slurm._requeue]  # a preemption checkpoint requeues the job
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("0", "4", "0")
        assert os.environ["MASTER_ADDR"] == "gpu07"
        record = json.loads((tmp_path / "job" / "launch" / "launch.json").read_text())
        assert record["slurm"]["SLURM_JOB_ID"] == "4242" and record["dist"]["WORLD_SIZE"] == 4
        assert (tmp_path / "job" / "launch" / "job_config.yaml").exists()
    # what the launch exported is gone again: the environment is as before the test
    assert {k: os.environ.get(k) for k in (*env, *dist)} == before
