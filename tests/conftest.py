"""Shared test helpers: compose a run like the CLI does, and run it in-process on the tiny model.

    cfg = compose(["method=sft", "peft=lora"], tmp_path)   # validated config, tiny model, fp32
    results = train(["train.max_steps=4"], tmp_path)        # a real run, results dict

Tests never touch a hub: the tiny model has random weights and borrows SmolLM2's tokenizer
from the packaged GGUF (converted once into the workbench cache).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
os.environ.setdefault("WORKBENCH_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The fast, deterministic baseline every test starts from.
TINY = [
    "model=tiny", "precision=fp32", "eval=none", "train.max_steps=4", "train.micro_batch_size=4",
    "train.log_every=1", "train.export=false", "optim.warmup_steps=0", "optim.scheduler=constant",
    "train.plots=false",  # 0.5-1 s a run; tests/unit/test_report.py and test_trackers.py turn them on
]


# Composed configs by their overrides. Hydra's compose reads and merges every group's YAML each
# time (about 0.35 s on a 2-core CPU) and the tier composes the same few hundred override lists
# over and over; composition does not resolve interpolations, so a copy of a cached result is
# what a fresh compose would give.
_COMPOSED: dict[tuple[str, ...], object] = {}


def compose(overrides: list[str] = (), out: Path | None = None, validate: bool = True, base=TINY):
    from workbench.config.validate import validate as _validate

    ov = (*base, *overrides)
    if ov not in _COMPOSED:
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            _COMPOSED[ov] = hydra_compose(config_name="train", overrides=list(ov))
    cfg = copy.deepcopy(_COMPOSED[ov])
    if out is not None:
        cfg.output_dir = str(out)
    return _validate(cfg) if validate else cfg


def train(overrides: list[str] = (), out: Path | None = None, base=TINY) -> dict:
    from workbench.train.runner import Runner

    cfg = compose(overrides, out, base=base)
    return Runner(cfg).run()


@pytest.fixture(scope="session", autouse=True)
def _threads():
    import torch

    # Deterministic CPU kernels and no oversubscription when tests run beside other work.
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield


def saved_tiny(tmp_path_factory, overrides: list[str]):
    """The tiny model saved to a directory (TRL's trainers load it from there), with its tokenizer
    and chat contract, and the composed config of `overrides`."""
    from types import SimpleNamespace

    from workbench.data.chat import setup_tokenizer
    from workbench.models.load import load_model, load_tokenizer

    cfg = compose(overrides)
    tok = load_tokenizer(cfg.model)
    contract = setup_tokenizer(tok)
    path = tmp_path_factory.mktemp("tiny_model")
    load_model(cfg.model).save_pretrained(path)
    tok.save_pretrained(path)
    return SimpleNamespace(cfg=cfg, tok=tok, contract=contract, path=path)
