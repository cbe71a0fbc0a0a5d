"""What every remote launcher sends with a job, and the command the far side runs.

A job is the composed config (resolved, secrets redacted, `launcher.name=local` so the far side
trains instead of launching again) plus a small launch manifest (package versions, git commit,
the submitting machine, the command-line overrides). The far side writes both into the run dir
and runs the same CLI on that file:

    python -m workbench --config-path <run_dir>/launch --config-name job_config \
        output_dir=<run_dir> hydra.run.dir=<run_dir>

so a remote run is reproducible from its run dir alone. Secret values never travel in the job:
launchers pass environment variable *names* and read the values from the environment (or, on
Modal, from named Modal secrets) at send time.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from workbench.core.secrets import redact, redact_overrides, secret_values
from workbench.resolve.validate import _merge
from workbench.telemetry import manifest

CONFIG_NAME = "job_config"
LAUNCH_SUBDIR = "launch"


def composed_config(cfg: DictConfig) -> dict:
    """The resolved config that the far side trains with, secrets redacted (workbench/core/secrets.py)."""
    raw = OmegaConf.to_container(cfg, resolve=True)
    shipped = redact(raw, secret_values(cfg))
    shipped["launcher"] = {"name": "local"}
    return shipped


def task_overrides() -> list[str]:
    """The command-line overrides of the current Hydra job, when there is one."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return list(HydraConfig.get().overrides.task)
    except (ImportError, ValueError):
        pass
    return []


def job_spec(cfg: DictConfig, launcher: str, run_name: str | None = None) -> dict:
    """Everything a remote job needs; contains no secret values."""
    out = Path(str(cfg.output_dir))
    # a multirun job dir is a bare number (multirun/<time>/3): keep the sweep's name with it
    name = run_name or (f"{out.parent.name}-{out.name}" if out.name.isdigit() else out.name)
    secrets = secret_values(cfg)
    return {
        "name": name,
        "config_yaml": OmegaConf.to_yaml(OmegaConf.create(composed_config(cfg))),
        "manifest": redact({
            "launcher": launcher,
            "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "local_output_dir": str(cfg.output_dir),
            "overrides": redact_overrides(task_overrides(), secrets),
            "versions": manifest.versions(),
            "git": manifest.git_sha(),
            "submitted_from": manifest.hardware(),
        }, secrets),
    }


def materialize(spec: dict, run_dir: str | Path) -> Path:
    """Write the job's config and launch manifest into `<run_dir>/launch/`; return that dir."""
    d = Path(run_dir) / LAUNCH_SUBDIR
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{CONFIG_NAME}.yaml").write_text(spec["config_yaml"])
    (d / "launch.json").write_text(json.dumps(spec["manifest"], indent=1, default=str))
    return d


def command(run_dir: str, python: str = "python") -> list[str]:
    """The CLI command that trains the materialized job in `run_dir` (an absolute path)."""
    return [python, "-m", "workbench", "--config-path", f"{run_dir}/{LAUNCH_SUBDIR}", "--config-name", CONFIG_NAME,
            f"output_dir={run_dir}", f"hydra.run.dir={run_dir}"]


def env_from_host(names) -> dict[str, str]:
    """Values of the named environment variables that are set here (for the job's env)."""
    return {n: os.environ[n] for n in names or () if os.environ.get(n)}


def read_results(run_dir: str | Path) -> dict:
    path = Path(run_dir) / "results.json"
    return json.loads(path.read_text()) if path.exists() else {}


def launcher_config(schema, cfg: DictConfig):
    """`cfg.launcher` checked against a launcher module's `Config` dataclass (UserError names the field)."""
    node = OmegaConf.to_container(cfg.launcher, resolve=True) if cfg.launcher is not None else {}
    return _merge(schema, OmegaConf.create(node), "launcher")
