"""Command line: `python -m workbench [group=choice ...] [key=value ...]` (Hydra).

    python -m workbench                         # LoRA SFT of SmolLM2-135M on CPU (the default)
    python -m workbench --cfg job               # print the composed config and exit
    python -m workbench -m optim.lr=1e-4,3e-4   # multirun sweep
    python -m workbench dry_run=true            # preflight only: no weights loaded

A mistake in config, data or environment prints one `error:` line and exits with status 2.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from workbench.config import CONF_DIR, validate
from workbench.errors import UserError


def _skip_bitsandbytes(cfg: DictConfig) -> None:
    """peft imports bitsandbytes whenever it is installed, and bitsandbytes imports
    torch._inductor: about a second before the first step of a run that quantises nothing.
    A single command-line job that is not QLoRA hides it (a multirun may still reach QLoRA in
    this process; run_job called from Python leaves the process as it is)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if cfg.peft.kind == "qlora" or cfg.model.loader != "hf" or "peft" in sys.modules or "bitsandbytes" in sys.modules:
        return
    if HydraConfig.get().mode != RunMode.RUN:
        return
    sys.modules["bitsandbytes"] = None  # import raises ImportError; find_spec answers None


def run_job(cfg: DictConfig) -> dict | None:
    from workbench import preflight

    cfg = validate(cfg)
    if cfg.data.preview:  # tokenizer only: render samples with their loss mask and stop
        from workbench.data.preview import preview

        return preview(cfg)
    facts = preflight.check(cfg)
    if cfg.dry_run:
        from workbench.plan import render, to_json

        if cfg.plan.json:  # machine-readable: the plan plus what preflight found
            print(to_json({k: v for k, v in facts.items()}))
            return facts
        print(f"preflight ok: model={cfg.model.name} ({facts['n_params']:,} parameters, weights from "
              f"{facts['model_source']}), method={cfg.method.name}, peft={cfg.peft.kind}, backend={cfg.backend.name}")
        for w in facts.get("warnings", []):
            print(f"warning: {w}")
        render(facts["plan"])
        return facts
    from workbench.launch import dispatch

    remote = dispatch(cfg)
    if remote is not None:
        return remote
    from workbench.runner import Runner

    return Runner(cfg).run()




@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def _hydra_main(cfg: DictConfig):
    try:
        _skip_bitsandbytes(cfg)
        results = run_job(cfg)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    # Hydra's Optuna sweeper and the sweep summary read the job's return value.
    if isinstance(results, dict):
        end = results.get("eval_end") or {}
        acc = [v for k, v in end.items() if k.endswith("/accuracy")]
        losses = results.get("losses") or []
        return acc[0] if acc else (losses[-1] if losses else None)
    return None


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
