"""Fixtures of the 2-process tests: a distillation teacher, and the default tier's Megatron runs in
one torchrun job (tests/distributed/megatron_cases.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def teacher(tmp_path_factory):
    """A teacher for method=distill: the tiny model with another init seed, saved to a directory."""
    from tests.conftest import compose
    from workbench.models.load import load_model, load_tokenizer

    cfg = compose(["model.init_seed=7"])
    path = tmp_path_factory.mktemp("teacher")
    load_model(cfg.model).save_pretrained(path)
    load_tokenizer(cfg.model).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def megatron_default(tmp_path_factory, teacher):
    """(results by run name, the job's directory) of megatron_cases.default_runs."""
    pytest.importorskip("megatron.core")
    from tests.distributed.megatron_cases import default_runs
    from tests.helpers import worker_job

    out = tmp_path_factory.mktemp("megatron_default") / "meg"
    return worker_job(default_runs(teacher), out, timeout=2400), out
