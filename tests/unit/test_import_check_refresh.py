"""A cached import-check verdict made without its reference is redone once the reference is there:
a converted GGUF checked only against the perplexity bound (llama-cpp-python missing at the time)
is checked against llama.cpp on the first run that has it, once, and the cache entry keeps the
new report (resealed); a check that now disagrees stops the run in one line naming the entry.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_import_check_refresh.py
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -m slow tests/unit/test_import_check_refresh.py   # real llama.cpp
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import compose
from workbench.core import cache
from workbench.core.errors import UserError
from workbench.models import import_check, load

STALE = {"passed": True, "against": "a perplexity bound of 60 (llama-cpp-python is not installed)", "tokens": 25,
         "perplexity": 14.3, "problem": None}
CHECKED = {"passed": True, "against": "llama.cpp (llama-cpp-python 0.3.36)", "tokens": 25,
           "mean_abs_logprob_diff": 0.064, "max_abs_logprob_diff": 0.23, "perplexity": 14.3,
           "perplexity_llama_cpp": 14.4, "problem": None}


def _entry(tmp_path, monkeypatch, files=None):
    """A sealed converted-model entry for smollm2-135m in a cache of its own, its verdict STALE."""
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    cfg = compose(["model=smollm2-135m"]).model
    entry = load.converted_dir(cfg.name)
    if files is not None:
        shutil.copytree(files, entry)
    else:
        entry.mkdir(parents=True)
        for name in load.CONVERTED_FILES:
            (entry / name).write_text("{}")
    (entry / import_check.REPORT).write_text(json.dumps(STALE))
    cache.seal(entry)
    return cfg, entry


def test_a_verdict_without_llama_cpp_is_redone_once_it_is_installed(tmp_path, monkeypatch):
    cfg, entry = _entry(tmp_path, monkeypatch)
    if load.locate(cfg).kind != "converted":
        pytest.skip("smollm2-135m resolves to weights other than a converted GGUF on this machine")
    calls = []
    monkeypatch.setattr(import_check, "reference_available", lambda: True)
    monkeypatch.setattr(import_check, "_run_child", lambda gguf, where: calls.append(where) or dict(CHECKED))
    assert load.import_report(cfg) == CHECKED
    assert calls == [entry]
    # kept: the entry holds the new report and its seal still matches (it is not rebuilt)
    assert json.loads((entry / import_check.REPORT).read_text()) == CHECKED
    assert cache.problem(entry, load.CONVERTED_FILES) is None
    assert load.import_report(cfg) == CHECKED and calls == [entry]  # once
    assert import_check.line(CHECKED).startswith("import check passed against llama.cpp")


def test_without_llama_cpp_the_verdict_stands_and_a_disagreement_is_one_line(tmp_path, monkeypatch):
    cfg, entry = _entry(tmp_path, monkeypatch)
    if load.locate(cfg).kind != "converted":
        pytest.skip("smollm2-135m resolves to weights other than a converted GGUF on this machine")
    monkeypatch.setattr(import_check, "reference_available", lambda: False)
    assert load.import_report(cfg) == STALE
    monkeypatch.setattr(import_check, "reference_available", lambda: True)
    bad = {**CHECKED, "passed": False, "problem": "next-token log-probs differ from llama.cpp's by 17.000"}
    monkeypatch.setattr(import_check, "_run_child", lambda gguf, where: bad)
    with pytest.raises(UserError, match=rf"^model=smollm2-135m: import check failed against llama.cpp .*; the weights "
                                        rf"cached at {entry} were converted before llama-cpp-python was installed: "
                                        "remove that directory to convert again$"):
        load.import_report(cfg)
    assert json.loads((entry / import_check.REPORT).read_text()) == STALE  # nothing cached from a failed check


@pytest.mark.slow
def test_the_real_smollm2_conversion_is_rechecked_against_llama_cpp(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp", reason="the import check's reference; `make` installs it")
    real = cache.root() / "models" / "smollm2-135m"
    if cache.problem(real, load.CONVERTED_FILES) is not None:
        pytest.skip("no converted SmolLM2 in the workbench cache (any tiny-model run makes it)")
    cfg, entry = _entry(tmp_path, monkeypatch, files=real)
    report = load.import_report(cfg)
    assert report["passed"] and report["against"].startswith("llama.cpp"), report
    assert report["mean_abs_logprob_diff"] < import_check.LOGPROB_TOLERANCE
    assert cache.problem(entry, load.CONVERTED_FILES) is None
