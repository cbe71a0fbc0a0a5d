"""`python -m workbench.serve [serve.key=value ...] [model=... other overrides]`: a Tinker-compatible
training service on the workbench's own model loading, LoRA, optimizer and checkpoints.

    python -m workbench.serve model=tiny serve.port=8123
    TINKER_BASE_URL=http://127.0.0.1:8123 TINKER_API_KEY=tml-local python my_tinker_script.py

`serve.*` settings (host, port, ...; `ServeConfig` below) are this command's own; every other
argument is a Hydra override composed onto conf/train.yaml exactly as for a run (`model=`,
`peft.alpha=`, `precision=`, `hardware.threads=`, `output_dir=`), then validated and resolved
the same way, so a mistake is the same one `error:` line (exit 2) before anything loads.
The run directory (`output_dir`) gets manifest.json (what was served and what every client did),
metrics.jsonl (a line per forward_backward and optim_step), checkpoints/ and the tokenizer.

Stopping: SIGINT/SIGTERM first fails every unfinished future with "the service is stopping", so
a client waiting on one gets that error instead of polling a server that is gone; then uvicorn
closes. A service killed outright (SIGKILL) cannot say anything: the SDK retries a lost
connection with backoff and never gives up on its own, so a client should bound its waits
(`future.result(timeout=...)`; docs/guides/tinker.md).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from workbench.core import atomic
from workbench.core.errors import UserError, missing_package
from workbench.core.secrets import scrub_text

USAGE = "usage: python -m workbench.serve [serve.host=H] [serve.port=P] [model=NAME] [key=value ...]"


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"  # loopback by default: the service runs the client's requests as code on this machine's model
    port: int = 8000  # 0: pick a free port (printed, and written to <run>/serve.json)
    lora_rank: int = 32  # the rank of the adapters a base-model sampler is built with (clients send their own)
    poll_s: float = 10.0  # how long retrieve_future waits for a result before answering "try again"
    micro_batch_size: int = 16  # datums per forward pass within one forward_backward (gradients accumulate)
    api_key_env: str | None = None  # an environment variable holding the one API key accepted; null: any key
    log_level: str = "warning"  # uvicorn's


def split_args(argv: list[str]) -> tuple[dict, list[str]]:
    """(serve.* settings, Hydra overrides)."""
    from omegaconf import OmegaConf

    mine = [a.removeprefix("serve.") for a in argv if a.startswith("serve.")]
    bad = [a for a in mine if "=" not in a]
    if bad:
        raise UserError(f"serve.{bad[0]}: give a value (serve.key=value)")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(ServeConfig), OmegaConf.from_dotlist(mine))
    except Exception as exc:  # omegaconf's ConfigKeyError / ValidationError
        fields = ", ".join(ServeConfig.__dataclass_fields__)
        raise UserError(f"{str(exc).splitlines()[0]} (serve.* settings: {fields})") from None
    return cfg, [a for a in argv if not a.startswith("serve.")]


def compose(overrides: list[str]):
    """The run config as `python -m workbench` would compose and validate it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    # deferred, as in workbench/cli.py: --help and a refused serve.* setting answer without them
    from workbench.config import commandline  # deferred: see above
    from workbench.config.files import CONF_DIR  # deferred: see above
    from workbench.resolve.validate import validate  # deferred: see above

    overrides = commandline.nulls_as_deletions(overrides)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="serve"):
            cfg = hydra_compose(config_name="train", overrides=overrides, return_hydra_config=False)
    except HydraException as exc:
        raise UserError(str(exc).splitlines()[0]) from None
    OmegaConf.set_struct(cfg, False)
    cfg.pop("hydra", None)
    return validate(cfg)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(f"{USAGE}\n\n{__doc__}")
        return 0
    try:
        serve_cfg, overrides = split_args(argv)
        cfg = compose(overrides)
        svc = _service(cfg, serve_cfg)
    except UserError as exc:
        print(f"error: {scrub_text(str(exc))}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    return _serve(svc)


def _service(cfg, serve_cfg):
    import importlib.util

    # deferred: the model's modules load once the config is known good (as workbench/cli.py does)
    from workbench.core.imports import import_without_incidentals  # deferred: see above
    from workbench.models.load import load_tokenizer  # deferred: see above
    from workbench.resolve.resolved import resolve_run  # deferred: see above

    for package in ("tinker", "uvicorn", "starlette"):
        if importlib.util.find_spec(package) is None:
            raise missing_package(package, "serve")
    run = resolve_run(cfg)
    if not run.peft.adapter:
        raise UserError(f"peft={run.peft.kind}: the service trains LoRA adapters only; start it with peft=lora "
                        "(the default) or peft=dora / peft=qlora")
    import_without_incidentals("transformers.modeling_utils")
    threads = int(cfg.hardware.threads)
    if threads > 0:
        import torch

        torch.set_num_threads(threads)
    run_dir = Path(cfg.output_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    from workbench.serve.app import Service  # deferred: uvicorn, starlette and the model stack

    return Service(cfg, run, load_tokenizer(cfg.model), run_dir, serve_cfg,
                   log=lambda m: print(f"workbench.serve: {m}", file=sys.stderr, flush=True))


def _serve(svc) -> int:
    import json
    import socket

    import uvicorn

    from workbench.serve.app import build_app  # deferred: see _service

    sock = socket.socket(socket.AF_INET6 if ":" in svc.serve.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((svc.serve.host, int(svc.serve.port)))
    except OSError as exc:
        print(f"error: serve.host={svc.serve.host} serve.port={svc.serve.port}: {exc.strerror}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    url = f"http://{svc.serve.host}:{port}"
    atomic.write_text(svc.run_dir / "serve.json", json.dumps({"url": url, "port": port}))

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # fail the waiting futures while the polls can still answer
            failed = svc.store.fail_pending(f"the service is stopping (signal {int(sig)}); results of "
                                            "unfinished requests are lost")
            if failed:
                svc.log(f"stopping: {failed} unfinished request(s) failed")
            super().handle_exit(sig, frame)

    config = uvicorn.Config(build_app(svc), log_level=svc.serve.log_level, access_log=False,
                            timeout_graceful_shutdown=5)
    print(f"workbench.serve: {svc.base_name} on {url} (run directory {svc.run_dir}); "
          f"point the SDK at it with TINKER_BASE_URL={url}", file=sys.stderr, flush=True)
    try:
        Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it held back once it has shut down
        pass
    svc.event(event="stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
