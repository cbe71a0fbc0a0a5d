"""Experiment trackers, chosen with the `tracker` config group (conf/tracker/), several at once:

    python -m workbench                                          # tracker=[tensorboard] (default)
    python -m workbench tracker=[tensorboard,wandb] tracker.wandb.project=arith
    python -m workbench tracker=[mlflow,trackio]                 # MLflow file store + trackio, both local
    python -m workbench tracker=[]                               # metrics.jsonl only
    tensorboard --logdir runs/                                   # look at the event files

Each tracker gets, from rank 0 only: every step's scalars under `train/` (loss, lr, grad norm,
tokens/s, MFU, the method's metrics), evaluations under `eval/`, the resolved config with secrets
removed (the rule of workbench/core/secrets.py), and the run's plots when it ends. Optional packages
are imported only when their tracker is chosen (`pip install -e .[wandb]`, `.[mlflow]`,
`.[trackio]`; tensorboard is a base dependency). A tracker that cannot start (package missing,
no W&B API key, bad MLflow URI) says so in one line and the run goes on with the others.

Where the data goes: tensorboard `<run_dir>/tensorboard/`; wandb `<run_dir>/wandb/` (online
syncs to W&B; `tracker.wandb.mode=offline` keeps it local for `wandb sync`); mlflow
`<run_dir>/mlruns/` (a file store) unless `tracker.mlflow.tracking_uri` names a server or
database; trackio its local database (`$TRACKIO_DIR`, default ~/.cache/huggingface/trackio),
viewed with `trackio show`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from workbench.core.imports import import_without_incidentals
from workbench.core.secrets import redact, secret_values

INSTALL = {"wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio", "tensorboard": "tensorboard"}


class StartError(Exception):
    """A tracker that cannot start, with the one line that says why."""


# -- the trackers --------------------------------------------------------------------------
class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, opts, run_dir: Path, config: dict):
        SummaryWriter = import_without_incidentals("torch.utils.tensorboard").SummaryWriter  # noqa: N806

        self.dir = run_dir / opts.dir
        self.writer = SummaryWriter(log_dir=str(self.dir), flush_secs=opts.flush_secs)
        self.writer.add_text("config", "```\n" + _yaml(config) + "\n```", 0)

    def scalars(self, values: dict, step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def images(self, paths: list[Path], step: int) -> None:
        import numpy as np
        from PIL import Image

        for p in paths:
            self.writer.add_image(f"plots/{p.stem}", np.asarray(Image.open(p).convert("RGB")), step,
                                  dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    name = "wandb"

    def __init__(self, opts, run_dir: Path, config: dict):
        if opts.mode == "online" and not _wandb_key():
            raise StartError("no W&B API key (set WANDB_API_KEY or run `wandb login`; "
                             "tracker.wandb.mode=offline logs locally for `wandb sync`)")
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=opts.project, entity=opts.entity, name=opts.name or run_dir.name,
                              mode=opts.mode, dir=str(run_dir), config=config, tags=opts.tags or None,
                              settings=wandb.Settings(init_timeout=90, console="off", silent=True,
                                                      x_disable_stats=True))
        self.last = 0

    def scalars(self, values: dict, step: int) -> None:
        self.last = max(self.last, step)  # W&B drops rows whose step goes backwards
        self.run.log(values, step=self.last)

    def images(self, paths: list[Path], step: int) -> None:
        self.run.log({f"plots/{p.stem}": self.wandb.Image(str(p)) for p in paths}, step=max(self.last, step))

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    name = "mlflow"

    def __init__(self, opts, run_dir: Path, config: dict):
        uri = opts.tracking_uri
        if not uri:
            uri = (run_dir / "mlruns").resolve().as_uri()
            # MLflow 3 keeps the file store behind an opt-in; a run-local store is what we want here.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param

        self.Metric = Metric
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(opts.experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(opts.experiment)
        self.run_id = self.client.create_run(exp_id, run_name=opts.run_name or run_dir.name).info.run_id
        params = [Param(k, (json.dumps(v) if isinstance(v, list) else str(v))[:500]) for k, v in flatten(config).items()]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params per call
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_dict(self.run_id, config, "config.json")

    def scalars(self, values: dict, step: int) -> None:
        ts = int(time.time() * 1000)
        # MLflow metric names may not contain some characters; '/' is allowed.
        self.client.log_batch(self.run_id, metrics=[self.Metric(k, v, ts, step) for k, v in values.items()])

    def images(self, paths: list[Path], step: int) -> None:
        for p in paths:
            self.client.log_artifact(self.run_id, str(p), "plots")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioSink:
    name = "trackio"

    def __init__(self, opts, run_dir: Path, config: dict):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=opts.project, name=opts.name or run_dir.name, config=config, embed=False,
                                auto_log_cpu=False, auto_log_gpu=False)

    def scalars(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def images(self, paths: list[Path], step: int) -> None:
        self.run.log({f"plots/{p.stem}": self.trackio.Image(str(p)) for p in paths}, step=step)

    def close(self) -> None:
        self.run.finish()


SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink, "mlflow": MlflowSink, "trackio": TrackioSink}


def start(cfg, run_dir: Path, say) -> list:
    """Start every chosen tracker; one that fails is reported by `say` in one line and skipped."""
    from omegaconf import OmegaConf


    chosen = {k: v for k, v in (cfg.get("tracker") or {}).items() if v is not None}
    if not chosen:
        return []
    config = redact(OmegaConf.to_container(cfg, resolve=True), secret_values(cfg))
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    sinks = []
    for name, opts in chosen.items():
        try:
            sinks.append(SINKS[name](opts, run_dir, config))
        except ImportError as exc:
            say(f"tracker {name}: not started ({exc.name or exc} is not installed: "
                f"pip install -e .[{INSTALL[name]}]); the run goes on without it")
        except StartError as exc:
            say(f"tracker {name}: not started ({exc}); the run goes on without it")
        except Exception as exc:  # a server that does not answer, a bad URI: never stop the run
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            say(f"tracker {name}: not started ({type(exc).__name__}: {first[:200]}); the run goes on without it")
    return sinks


def _wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def flatten(obj, prefix: str = "") -> dict:
    """A nested config as {"optim.lr": 1e-4, ...}; lists stay values (MLflow's params, the run comparison)."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def _yaml(config: dict) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(config))
