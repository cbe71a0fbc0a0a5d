"""launcher=modal: the same run in a Modal container with GPUs.

    python -m workbench launcher=modal hardware=8xh100 launcher.secrets=[huggingface,wandb]
    python -m workbench -m launcher=modal optim.lr=1e-5,3e-5      # one Modal call per sweep job

`build(cfg)` makes the Modal objects (nothing is sent until `app.run()`):
- Image: Debian slim + the locked dependencies of this checkout (constraints.txt, installed
  with --no-deps so exactly the lock is installed), then this checkout's code, conf and data;
- Function: `gpu="<accelerator>:<procs>"` from `hardware=` (or `launcher.gpu`), the Volume at
  `launcher.volume_mount` for run dirs, checkpoints and the model caches (HF_HOME,
  WORKBENCH_CACHE), Modal Retries, and Modal secrets by *name* (`launcher.secrets`); secret
  values never pass through the config or this machine.

The remote function writes the shipped config + launch manifest into `<volume>/runs/<name>/` and
runs the same CLI there (`workbench.launch.remote.command`). A retry finds the same run dir on the
Volume, and train.resume=auto continues from its last checkpoint.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from workbench.core.errors import UserError, missing_package
from workbench.launch import remote

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "/root/project"
# hardware.accelerator (catalog names) -> Modal GPU type
GPU_TYPES = {"H100": "H100", "H100-SXM": "H100", "H100-80GB": "H100", "H200": "H200", "B200": "B200",
             "A100": "A100-40GB", "A100-40GB": "A100-40GB", "A100-80GB": "A100-80GB", "L40S": "L40S", "L4": "L4",
             "A10G": "A10G", "A10": "A10", "T4": "T4"}
IGNORE = [".venv", ".git", "runs", "multirun", "outputs", "**/__pycache__", "*.egg-info", "tests"]


@dataclass
class Config:
    name: str = "modal"
    app_name: str = "workbench"
    gpu: str | None = None  # a Modal GPU spec such as "H100:8"; None: from hardware.accelerator x procs
    volume: str = "workbench"
    volume_mount: str = "/vol"
    secrets: list[str] = field(default_factory=list)  # names of Modal secrets (modal secret create ...)
    retries: int = 2
    timeout_minutes: int = 1440
    python_version: str = "3.11"
    detach: bool = False


def _import_modal():
    try:
        import modal
    except ImportError:
        raise missing_package("modal", "modal") from None
    return modal


def gpu_spec(cfg, lc: Config) -> str | None:
    """`"H100:8"`-style spec from the hardware profile; None for a CPU container."""
    hw = cfg.hardware
    if hw.nodes > 1:
        raise UserError(f"launcher=modal runs one container; hardware.nodes={hw.nodes} needs launcher=slurm or ray")
    if lc.gpu:
        return lc.gpu
    if hw.device != "cuda":
        return None
    key = str(hw.accelerator).upper().replace("NVIDIA ", "").replace(" ", "-")
    if key not in GPU_TYPES:
        raise UserError(f"hardware.accelerator={hw.accelerator!r} has no Modal GPU type; set launcher.gpu "
                        f"(one of {sorted(set(GPU_TYPES.values()))}, e.g. launcher.gpu=H100:8)")
    if not 1 <= hw.procs <= 8:
        raise UserError(f"hardware.procs={hw.procs}: a Modal container has 1 to 8 GPUs")
    return f"{GPU_TYPES[key]}:{hw.procs}"


def image(lc: Config):
    modal = _import_modal()
    mount = lc.volume_mount
    return (
        modal.Image.debian_slim(python_version=lc.python_version)
        .pip_install_from_requirements(str(ROOT / "constraints.txt"), extra_options="--no-deps")
        .env({"HF_HOME": f"{mount}/hf-cache", "WORKBENCH_CACHE": f"{mount}/workbench-cache",
              "PYTHONPATH": PROJECT, "TOKENIZERS_PARALLELISM": "false"})
        .workdir(PROJECT)
        .add_local_dir(str(ROOT), PROJECT, ignore=IGNORE)
    )


def run_remote(spec: dict, volume_mount: str, volume_name: str) -> dict:
    """Body of the Modal function: train the shipped job on the Volume, return its results."""
    run_dir = f"{volume_mount}/runs/{spec['name']}"
    remote.materialize(spec, run_dir)
    proc = subprocess.run(remote.command(run_dir, sys.executable), cwd=PROJECT)
    try:
        import modal

        modal.Volume.from_name(volume_name).commit()  # checkpoints survive for the retry / the user
    except Exception as exc:  # noqa: BLE001 - the run's own status matters more than the commit
        print(f"volume commit failed: {exc}", file=sys.stderr)
    if proc.returncode != 0:
        # Raising lets Modal retry; the retry resumes from the run dir's last checkpoint.
        raise RuntimeError(f"workbench exited with status {proc.returncode}; run dir {run_dir}")
    return {**remote.read_results(run_dir), "run_dir": run_dir}


def build(cfg, lc: Config | None = None):
    """(app, function) for this config, built offline."""
    modal = _import_modal()
    lc = lc or remote.launcher_config(Config, cfg)
    if lc.retries < 0:
        raise UserError(f"config field 'launcher.retries' must be >= 0 (got {lc.retries})")
    app = modal.App(lc.app_name)
    volume = modal.Volume.from_name(lc.volume, create_if_missing=True)
    fn = app.function(
        image=image(lc),
        gpu=gpu_spec(cfg, lc),
        volumes={lc.volume_mount: volume},
        secrets=[modal.Secret.from_name(n) for n in lc.secrets],
        retries=modal.Retries(max_retries=lc.retries, initial_delay=10.0, backoff_coefficient=2.0)
        if lc.retries else None,
        timeout=60 * lc.timeout_minutes,
        serialized=True,  # built at run time from the config, not at import time of a module
        name="train",
    )(run_remote)
    return app, fn


def launch(cfg) -> dict:
    modal = _import_modal()
    lc = remote.launcher_config(Config, cfg)
    app, fn = build(cfg, lc)
    spec = remote.job_spec(cfg, "modal")
    spec["manifest"]["modal"] = {"app": lc.app_name, "gpu": gpu_spec(cfg, lc), "volume": lc.volume,
                                 "secrets": list(lc.secrets), "retries": lc.retries}
    remote.materialize(spec, cfg.output_dir)  # the local record of what was sent
    try:
        with modal.enable_output(), app.run(detach=lc.detach):
            results = fn.remote(spec, lc.volume_mount, lc.volume)
    except modal.exception.AuthError as exc:
        raise UserError(f"Modal rejected the credentials ({exc}); run `modal token new` or set "
                        "MODAL_TOKEN_ID / MODAL_TOKEN_SECRET") from None
    except modal.exception.NotFoundError as exc:
        raise UserError(f"Modal: {exc} (launcher.secrets names must exist: `modal secret list`)") from None
    results["modal"] = spec["manifest"]["modal"]
    return results
