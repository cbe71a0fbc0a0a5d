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
    from workbench.resolve.validate import validate as _validate

    ov = (*base, *overrides)
    if ov not in _COMPOSED:
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            _COMPOSED[ov] = hydra_compose(config_name="train", overrides=list(ov))
    cfg = copy.deepcopy(_COMPOSED[ov])
    if out is not None:
        cfg.output_dir = str(out)
    return _validate(cfg) if validate else cfg


def train(overrides: list[str] = (), out: Path | None = None, base=TINY) -> dict:
    from workbench.run.runner import Runner

    cfg = compose(overrides, out, base=base)
    return Runner(cfg).train()


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


@pytest.fixture
def trl_on_cpu(monkeypatch):
    """TRL's trainers compute log-probs with a Triton kernel; on a CPU build, its math in plain
    torch (tests/helpers.py TorchLogProb)."""
    import trl.trainer.utils as trl_utils

    from tests.helpers import TorchLogProb

    if trl_utils._ChunkedLogProbFunction is None:
        monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", TorchLogProb)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model saved to a directory (TRL loads it from there) plus its tokenizer, contract
    and the config of method=dpo peft=none. Modules that need another method's config define
    their own `tiny`."""
    return saved_tiny(tmp_path_factory, ["method=dpo", "peft=none"])


@pytest.fixture
def saved_figures(monkeypatch):
    """file name -> what each matplotlib figure saved while the test runs drew: for each axes,
    [(label, xs, ys, color), ...] of its lines, and the figure's size in pixels (height, width).
    What a PNG shows is checked against its data, not only that a file was written."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.colors import to_hex
    from matplotlib.figure import Figure

    saved: dict[str, dict] = {}
    real = Figure.savefig

    def savefig(fig, fname, *args, **kwargs):
        real(fig, fname, *args, **kwargs)
        dpi = kwargs.get("dpi") or fig.dpi
        w, h = fig.get_size_inches()
        saved[Path(str(fname)).name] = {
            "axes": [[(line.get_label(), [float(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()],
                       to_hex(line.get_color())) for line in ax.get_lines()] for ax in fig.axes],
            "pixels": (round(h * dpi), round(w * dpi)),
        }

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def png_pixels(path):
    """The PNG's pixels, (height, width, channels) floats in [0, 1]."""
    import matplotlib.image

    return matplotlib.image.imread(str(path))


# Where the default tier's minutes go: with WORKBENCH_TEST_TIMES=<file>, each test file's share
# (setup + call + teardown of its tests, module fixtures included) is written there as JSON at
# the end of the session. `.ci/run` prints the largest shares; docs/testing.md keeps the table.
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_sessionfinish(session):
    out = os.environ.get("WORKBENCH_TEST_TIMES")
    if out and _FILE_SECONDS:
        import json

        ranked = dict(sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1]))
        Path(out).write_text(json.dumps({k: round(v, 1) for k, v in ranked.items()}, indent=1))
