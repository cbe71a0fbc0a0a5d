"""launcher=ray: the same run on a Ray cluster through Ray Train's TorchTrainer.

    python -m workbench launcher=ray hardware.procs=4                      # local Ray, 4 workers
    python -m workbench launcher=ray launcher.address=auto hardware=8xh100 hardware.nodes=2 \
        launcher.max_failures=3 train.checkpoint_every=100 output_dir=/shared/runs/x

Ray Train starts `hardware.procs * hardware.nodes` workers (ScalingConfig), sets up the torch
process group (gloo on CPU, nccl on GPU), and each worker runs the workbench Runner on the
composed config. When a worker dies, Ray restarts the group (FailureConfig(max_failures)) and
the runner resumes from the last checkpoint in output_dir (train.resume=auto), so output_dir must
be storage every node sees. Ray's own run state goes under launcher.storage_path (RunConfig).

Fault injection (debug.crash_at_step) fires on the first attempt only, the way a real transient
failure would not repeat after the restart.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from workbench.core.errors import UserError, missing_package
from workbench.launch import network, remote
from workbench.resolve.validate import validate
from workbench.run.runner import Runner
from workbench.train.distributed import requested_procs

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Config:
    name: str = "ray"
    address: str | None = None  # None: start (or reuse) a local Ray; "auto" or ray://host:port: a cluster
    max_failures: int = 2
    storage_path: str | None = None  # None: <output_dir>/ray
    cpus_per_worker: float = 1.0
    ship_code: bool = False  # send this checkout as the Ray job's working_dir (cluster without the package)
    # Environment variables forwarded from this shell to every worker (values are read at launch).
    env: list[str] = field(default_factory=lambda: [
        "HF_TOKEN", "HF_HOME", "HF_HUB_OFFLINE", "WORKBENCH_OFFLINE", "WANDB_API_KEY", "TOKENIZERS_PARALLELISM",
        "OMP_NUM_THREADS", "MKL_NUM_THREADS"])


def _import_ray():
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError:
        raise missing_package("ray", "ray") from None
    return ray, FailureConfig, RunConfig, ScalingConfig, TorchConfig, TorchTrainer


def _attempt(run_dir: Path, rank: int) -> int:
    """How many times this rank has started in this run dir before (0 on the first attempt)."""
    marker = run_dir / remote.LAUNCH_SUBDIR / f"ray_attempts.rank{rank}"
    marker.parent.mkdir(parents=True, exist_ok=True)
    n = len(marker.read_text().splitlines()) if marker.exists() else 0
    with marker.open("a") as fh:
        fh.write(f"{os.getpid()}\n")
    return n


def worker(loop_cfg: dict) -> None:
    """Ray Train worker: one rank of the run."""
    import ray.train
    from omegaconf import OmegaConf


    os.environ.update(loop_cfg["env"])
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    config = dict(loop_cfg["config"])
    attempt = _attempt(Path(config["output_dir"]), rank)
    if attempt > 0:
        config["debug"] = {**config["debug"], "crash_at_step": -1}
    cfg = validate(OmegaConf.create(config))
    results = Runner(cfg).train()
    losses = results.get("losses") or []
    ray.train.report({"attempt": attempt, "final_loss": losses[-1] if losses else None,
                      "resumed_from": results.get("resumed_from") or ""})


def pin_network() -> None:
    """Ray's worker_process_setup_hook on a cluster: before Ray Train creates the process group in
    this worker, point GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME at the interface that reaches the
    Ray head (workbench/launch/network.py); resolving the hostname may give loopback."""
    import ray

    network.prepare(ray.get_runtime_context().gcs_address, field="launcher.address")


def build_trainer(cfg, lc: Config | None = None):
    """The TorchTrainer for this config (nothing runs until .fit())."""
    lc = lc or remote.launcher_config(Config, cfg)
    _, FailureConfig, RunConfig, ScalingConfig, TorchConfig, TorchTrainer = _import_ray()
    out = Path(str(cfg.output_dir)).resolve()
    config = remote.composed_config(cfg)
    config["output_dir"] = str(out)
    n = requested_procs(cfg.hardware)
    gpu = cfg.hardware.device == "cuda"
    storage = Path(lc.storage_path).resolve() if lc.storage_path else out / "ray"
    return TorchTrainer(
        worker,
        train_loop_config={"config": config, "env": remote.env_from_host(lc.env)},
        torch_config=TorchConfig(backend="nccl" if gpu else "gloo", timeout_s=60 * cfg.hardware.timeout_minutes),
        scaling_config=ScalingConfig(num_workers=n, use_gpu=gpu, resources_per_worker={
            "CPU": lc.cpus_per_worker, **({"GPU": 1} if gpu else {})}),
        run_config=RunConfig(name=out.name, storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=lc.max_failures)),
    )


def launch(cfg) -> dict:
    lc = remote.launcher_config(Config, cfg)
    ray = _import_ray()[0]
    if lc.max_failures < 0:
        raise UserError(f"config field 'launcher.max_failures' must be >= 0 (got {lc.max_failures})")
    out = Path(str(cfg.output_dir)).resolve()
    remote.materialize(remote.job_spec(cfg, "ray"), out)
    if not ray.is_initialized():
        runtime_env = {"working_dir": str(ROOT), "excludes": [".venv", ".git", "runs", "multirun"]} \
            if lc.ship_code else {}
        if lc.address:  # a cluster: every worker pins gloo/NCCL to its node's way to the head first
            runtime_env["worker_process_setup_hook"] = "workbench.launch.ray_train.pin_network"
        try:
            ray.init(address=lc.address, runtime_env=runtime_env or None, log_to_driver=True)
        except ConnectionError as exc:
            raise UserError(f"launcher.address={lc.address!r}: cannot reach a Ray cluster ({exc})") from None
    trainer = build_trainer(cfg, lc)
    try:
        result = trainer.fit()
    except Exception as exc:
        if type(exc).__name__ == "TrainingFailedError":
            raise RuntimeError(f"Ray Train run failed after launcher.max_failures={lc.max_failures} restarts: "
                               f"{exc}") from exc
        raise
    results = remote.read_results(out)
    results["ray"] = {"metrics": dict(result.metrics or {}),
                      "storage_path": str(Path(lc.storage_path).resolve() if lc.storage_path else out / "ray")}
    return results
