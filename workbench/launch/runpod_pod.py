"""launcher=runpod: the same run on a RunPod GPU pod, through the runpod SDK.

    export RUNPOD_API_KEY=...   HF_TOKEN=...
    python -m workbench launcher=runpod hardware=8xh100 launcher.image=ghcr.io/me/workbench:<sha> \
        launcher.network_volume_id=<id>

One pod per job: GPU type and count (`launcher.gpu_type`, or from hardware.accelerator x procs),
the image (this checkout's code and locked dependencies), a network volume at /workspace for run
dirs, checkpoints and model caches, and env values copied from this shell for the names in
`launcher.env` (never from the config). The pod's start command writes the shipped config and
launch manifest into `/workspace/runs/<name>/launch/` and runs the same CLI there; when the job
ends it stops its own pod (`runpodctl stop pod $RUNPOD_POD_ID`). Here the status is polled until
the pod has stopped; if the wait times out or is interrupted, the pod is stopped from here.
"""

from __future__ import annotations

import base64
import shlex
import time
from dataclasses import dataclass, field

from workbench.core.errors import UserError, missing_package
from workbench.launch import remote

# hardware.accelerator -> RunPod gpuTypeId
GPU_TYPES = {"H100": "NVIDIA H100 80GB HBM3", "H100-SXM": "NVIDIA H100 80GB HBM3", "H100-PCIE": "NVIDIA H100 PCIe",
             "H200": "NVIDIA H200", "B200": "NVIDIA B200", "A100": "NVIDIA A100 80GB PCIe",
             "A100-80GB": "NVIDIA A100-SXM4-80GB", "L40S": "NVIDIA L40S", "L4": "NVIDIA L4",
             "RTX4090": "NVIDIA GeForce RTX 4090", "A6000": "NVIDIA RTX A6000"}
ENDED = {"EXITED", "TERMINATED", "STOPPED"}


@dataclass
class Config:
    name: str = "runpod"
    image: str = "ghcr.io/workbench/workbench:latest"  # an image with this checkout at /workspace/workbench
    gpu_type: str | None = None  # a RunPod gpuTypeId; None: from hardware.accelerator
    cloud_type: str = "SECURE"  # SECURE | COMMUNITY | ALL
    network_volume_id: str | None = None
    volume_gb: int = 0  # pod volume when there is no network volume
    container_disk_gb: int = 50
    workdir: str = "/workspace/workbench"  # where the image holds the checkout
    runs_dir: str = "/workspace/runs"
    env: list[str] = field(default_factory=lambda: ["HF_TOKEN", "WANDB_API_KEY"])
    poll_seconds: float = 30.0
    start_timeout_minutes: float = 20.0  # from create to the container running
    timeout_minutes: float = 1440.0  # from create to the pod stopping by itself
    terminate: bool = False  # true: delete the pod (not only stop it) when the job ends


def _import_runpod():
    try:
        import runpod
    except ImportError:
        raise missing_package("runpod", "runpod") from None
    return runpod


def gpu_type(cfg, lc: Config) -> str:
    if lc.gpu_type:
        return lc.gpu_type
    key = str(cfg.hardware.accelerator).upper().replace("NVIDIA ", "").replace(" ", "-")
    if cfg.hardware.device != "cuda" or key not in GPU_TYPES:
        raise UserError(f"hardware.accelerator={cfg.hardware.accelerator!r} has no RunPod GPU type; set "
                        f"launcher.gpu_type (a RunPod gpuTypeId such as 'NVIDIA H100 80GB HBM3')")
    return GPU_TYPES[key]


def start_command(spec: dict, lc: Config) -> str:
    """The pod's start command. No double quotes: the SDK puts it inside a GraphQL string."""
    run_dir = f"{lc.runs_dir}/{spec['name']}"
    launch_dir = f"{run_dir}/{remote.LAUNCH_SUBDIR}"
    cli = " ".join(shlex.quote(a) for a in remote.command(run_dir))
    script = (f"mkdir -p {launch_dir} && cd {lc.workdir} && "
              f"echo $WORKBENCH_JOB_CONFIG | base64 -d > {launch_dir}/{remote.CONFIG_NAME}.yaml && "
              f"echo $WORKBENCH_JOB_MANIFEST | base64 -d > {launch_dir}/launch.json && "
              f"{cli} > {run_dir}/stdout.log 2>&1; echo $? > {run_dir}/exit_code; "
              f"runpodctl stop pod $RUNPOD_POD_ID")
    return f"bash -c {shlex.quote(script)}"


def pod_env(spec: dict, lc: Config) -> dict[str, str]:
    import json

    env = remote.env_from_host(lc.env)
    for k, v in env.items():
        if '"' in v or "\\" in v:
            raise UserError(f"environment variable {k} contains a quote or backslash, which RunPod's API cannot carry")
    env["WORKBENCH_JOB_CONFIG"] = base64.b64encode(spec["config_yaml"].encode()).decode()
    env["WORKBENCH_JOB_MANIFEST"] = base64.b64encode(json.dumps(spec["manifest"], default=str).encode()).decode()
    env["HF_HOME"] = "/workspace/hf-cache"
    env["WORKBENCH_CACHE"] = "/workspace/workbench-cache"
    return env


def _explain(exc: Exception, what: str) -> UserError | None:
    """A one-line UserError for the API failures a user can act on; None for anything else."""
    import requests
    import runpod.error as rp_error

    msg = str(exc)
    if isinstance(exc, rp_error.AuthenticationError):
        return UserError(f"RunPod {what}: authentication failed ({msg}); set RUNPOD_API_KEY to a valid API key")
    if isinstance(exc, rp_error.QueryError):
        low = msg.lower()
        if "no longer any instances" in low or "not enough" in low or "no available" in low or "capacity" in low:
            return UserError(f"RunPod {what}: no capacity for this GPU request ({msg}); try another "
                             f"launcher.gpu_type, launcher.cloud_type=ALL, fewer GPUs, or later")
        return UserError(f"RunPod {what}: the API refused the request: {msg}")
    if isinstance(exc, requests.Timeout):
        return UserError(f"RunPod {what}: the API did not answer in time ({msg}); check the network or "
                         f"RUNPOD_API_BASE_URL and retry")
    if isinstance(exc, requests.ConnectionError):
        return UserError(f"RunPod {what}: cannot reach the API ({msg})")
    if isinstance(exc, ValueError) and "No GPU found" in msg:
        return UserError(f"RunPod {what}: unknown GPU type; set launcher.gpu_type to an id from runpod.get_gpus()")
    return None


def _call(what: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - translated below when the user can act on it
        err = _explain(exc, what)
        if err is None:
            raise
        raise err from None


def launch(cfg, sleep=time.sleep, clock=time.monotonic) -> dict:
    runpod = _import_runpod()
    import os

    lc = remote.launcher_config(Config, cfg)
    if cfg.hardware.nodes > 1:
        raise UserError(f"launcher=runpod runs one pod; hardware.nodes={cfg.hardware.nodes} needs launcher=slurm or ray")
    if lc.cloud_type not in ("SECURE", "COMMUNITY", "ALL"):
        raise UserError(f"config field 'launcher.cloud_type' must be SECURE, COMMUNITY or ALL (got {lc.cloud_type!r})")
    key = os.environ.get("RUNPOD_API_KEY") or runpod.api_key
    if not key:
        raise UserError("launcher=runpod needs the RUNPOD_API_KEY environment variable (a RunPod API key)")
    runpod.api_key = key
    spec = remote.job_spec(cfg, "runpod")
    gpu, count = gpu_type(cfg, lc), cfg.hardware.procs
    spec["manifest"]["runpod"] = {"gpu_type": gpu, "gpu_count": count, "image": lc.image, "cloud_type": lc.cloud_type,
                                  "network_volume_id": lc.network_volume_id, "env_names": sorted(remote.env_from_host(lc.env))}
    remote.materialize(spec, cfg.output_dir)  # the local record of what was sent
    pod = _call("create pod", runpod.create_pod, name=f"workbench-{spec['name']}"[:60], image_name=lc.image,
                gpu_type_id=gpu, gpu_count=count, cloud_type=lc.cloud_type, volume_in_gb=lc.volume_gb,
                container_disk_in_gb=lc.container_disk_gb, network_volume_id=lc.network_volume_id,
                volume_mount_path="/workspace", docker_args=start_command(spec, lc), env=pod_env(spec, lc),
                support_public_ip=False, start_ssh=False)
    pod_id = pod["id"]
    print(f"runpod: pod {pod_id} created ({count} x {gpu}); polling every {lc.poll_seconds:g} s", flush=True)
    t0, started, status, ended = clock(), False, None, False
    try:
        while True:
            info = _call("poll pod", runpod.get_pod, pod_id) or {}
            status = info.get("desiredStatus")
            started = started or bool(info.get("runtime"))
            if status in ENDED or not info:
                ended = True
                break
            waited = (clock() - t0) / 60
            if not started and waited > lc.start_timeout_minutes:
                raise UserError(f"RunPod pod {pod_id} did not start within launcher.start_timeout_minutes="
                                f"{lc.start_timeout_minutes:g} (last status {status}); it was stopped")
            if waited > lc.timeout_minutes:
                raise UserError(f"RunPod pod {pod_id} still running after launcher.timeout_minutes="
                                f"{lc.timeout_minutes:g}; it was stopped (the run dir on the volume keeps its checkpoints)")
            sleep(lc.poll_seconds)
    finally:
        if not ended:  # a timeout, an error or Ctrl-C here: do not leave a GPU pod billing
            _call("stop pod", runpod.stop_pod, pod_id)
    if lc.terminate:
        _call("terminate pod", runpod.terminate_pod, pod_id)
    return {"runpod": {**spec["manifest"]["runpod"], "pod_id": pod_id, "final_status": status,
                       "run_dir": f"{lc.runs_dir}/{spec['name']}"}}
