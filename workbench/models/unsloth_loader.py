"""`model.loader=unsloth`: load with unsloth's FastLanguageModel and let it patch LoRA/QLoRA.

    python -m workbench ++model.loader=unsloth peft=qlora hardware=h200   # one CUDA GPU

(`++` because the model configs in conf/model/ do not list `loader`; Hydra adds it.)

Unsloth rewrites the model's attention, MLP and LoRA paths with its own kernels; the model it
returns is an ordinary (PEFT-wrapped) HF model, so the shared runner, methods and single-GPU
backend train it unchanged. It is CUDA-only and single-GPU, and it pins the libraries around
it (unsloth 2026.10.9: transformers<=5.17.0, trl<=1.15.0, datasets<5); each of those is
checked in preflight, before weights load, with one line saying what to change.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from workbench.core.errors import UserError
from workbench.models.load import load_model, locate, materialise
from workbench.peft.lora import target_names

# What unsloth 2026.10.9 declares for the libraries around it.
PINS = {"transformers": "<=5.17.0", "trl": "<=1.15.0", "datasets": "<5"}


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def pin_problems(versions: dict[str, str | None]) -> list[str]:
    """Which of unsloth's pins the given installed versions break, as 'pkg X (needs <=Y)'."""
    from packaging.specifiers import SpecifierSet

    return [f"{pkg} {versions[pkg]} (needs {spec})" for pkg, spec in PINS.items()
            if versions.get(pkg) and not SpecifierSet(spec).contains(versions[pkg], prereleases=True)]


def check_versions() -> None:
    """The installed versions against unsloth's pins (which combinations are refused is a rule:
    workbench/resolve/rules.py, unsloth-*)."""
    bad = pin_problems({p: _version(p) for p in PINS})
    if bad:
        raise UserError("model.loader=unsloth: installed versions break unsloth's pins: " + ", ".join(bad)
                        + "; install with pip install -e '.[unsloth]'")


def _weights_dir(cfg, run_dir: Path) -> str:
    """A directory FastLanguageModel can load: the resolved weights, or the tiny model saved once."""
    res = materialise(cfg.model, locate(cfg.model))
    if res.kind != "tiny":
        return res.path
    out = Path(run_dir) / "unsloth_base"
    if not (out / "config.json").exists():
        load_model(cfg.model).save_pretrained(out, safe_serialization=True)
    return str(out)


def load(run, run_dir: Path):
    """The model to train: FastLanguageModel weights, with LoRA/QLoRA patched by unsloth."""
    check_versions()
    from unsloth import FastLanguageModel


    cfg, p = run.cfg, run.cfg.peft
    model, _tokenizer = FastLanguageModel.from_pretrained(
        model_name=_weights_dir(cfg, run_dir), max_seq_length=cfg.data.seq_len, dtype=run.precision.load_dtype,
        load_in_4bit=run.peft.quantised, full_finetuning=not run.peft.adapter,
    )
    model.config.use_cache = False
    if not run.peft.adapter:
        return model
    return FastLanguageModel.get_peft_model(
        model, r=p.r, lora_alpha=p.alpha, lora_dropout=p.dropout, bias="none",
        target_modules=target_names(model, p.target_modules),
        use_gradient_checkpointing="unsloth" if cfg.model.gradient_checkpointing else False,
        random_state=cfg.train.seed,
    )
