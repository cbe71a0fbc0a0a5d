"""The family matrix (scripts/family_matrix.py): a random-initialised small model of each family
(llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3, mixtral) on each backend (single, DDP,
FSDP2, ZeRO-3, Megatron) under SFT with LoRA and in full, DPO and GRPO with LoRA. Each cell trains
with backend=single's losses within tests/tolerances.py, or a named rule refuses it before any
weights load.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_family_matrix.py            # default share
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -m slow tests/distributed/test_family_matrix.py    # the rest
    .venv/bin/python scripts/family_matrix.py      # the whole matrix -> docs/family-matrix.md

The default tier runs DEFAULT (every family, backend and method at least once) in two torchrun
jobs (Megatron's, and the rest's), its references in this process. Also here: the multimodal
`gemma3` model type refused in one line naming its text family (it built the default-size Gemma 3
with a vision tower, 11 GB per process), and a rank the kernel kills for its memory reported in
one line as that.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import sys

import pytest

from tests.conftest import ROOT, TINY
from tests.helpers import one_error_line

pytestmark = pytest.mark.distributed


def _load_matrix():
    spec = importlib.util.spec_from_file_location("family_matrix", ROOT / "scripts" / "family_matrix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module of the classes they build
    spec.loader.exec_module(module)
    return module


FM = _load_matrix()
# the rules that may refuse a cell, each for a reason it states (docs/compatibility.md)
EXPECTED_REFUSALS = {"megatron-family"}


def test_default_share_covers_every_family_backend_and_method():
    multi = [c for c in FM.DEFAULT if c.backend != "single"]
    assert {c.family for c in multi} == set(FM.FAMILIES)
    assert {c.backend for c in multi} == set(FM.BACKENDS) - {"single"}  # single: every cell's reference
    assert {c.method for c in multi} == set(FM.METHODS)


@pytest.fixture(scope="module")
def default_share(tmp_path_factory):
    return {(r["family"], r["backend"], r["method"]): r
            for r in FM.judge(FM.DEFAULT, tmp_path_factory.mktemp("family_default"), timeout=900,
                              job_per_backend=False)}


@pytest.mark.parametrize("cell", FM.DEFAULT, ids=lambda c: c.name)
def test_default_share_trains_like_single_or_is_refused(default_share, cell):
    row = default_share[(cell.family, cell.backend, cell.method)]
    print(f"{cell.name}: {FM.mark(row)}")
    if row["verdict"] == "refused":
        assert row["rule"] in EXPECTED_REFUSALS, f"{cell.name} refused by {row['rule']}"
        return
    assert row["ok"], f"{cell.name}: {row['why']}"


@pytest.fixture(scope="module")
def rest(tmp_path_factory):
    chosen = [c for c in FM.cells() if c not in FM.DEFAULT]
    rows = FM.judge(chosen, tmp_path_factory.mktemp("family_rest"), timeout=3600)
    return {(r["family"], r["backend"], r["method"]): r for r in rows}


@pytest.mark.slow
@pytest.mark.parametrize("cell", [c for c in FM.cells() if c not in FM.DEFAULT], ids=lambda c: c.name)
def test_every_cell_trains_like_single_or_is_refused(rest, cell):
    row = rest[(cell.family, cell.backend, cell.method)]
    if row["verdict"] == "refused":
        assert row["rule"] in EXPECTED_REFUSALS, f"{cell.name} refused by {row['rule']}"
        return
    assert row["ok"], f"{cell.name}: {row['why']}"


# -- gemma3: the multimodal model type ---------------------------------------------------------
def test_multimodal_family_is_refused_naming_its_text_family():
    """`gemma3` is transformers' multimodal Gemma3Config: the flat numbers never reached its
    text_config, so the default 2.7B-parameter Gemma 3 and a vision tower were built. Refused in
    one line naming gemma3_text, on the meta device (dry runs and the planner too)."""
    from tests.conftest import compose
    from workbench.core.errors import UserError
    from workbench.models.load import build_meta, hf_config

    with pytest.raises(UserError, match=r"model.arch.family='gemma3' is a multimodal .* use model.arch.family="
                                        r"gemma3_text$"):
        build_meta(compose(["model.arch.family=gemma3"]).model)
    text = hf_config(compose(["model.arch.family=gemma3_text"]).model.arch)  # the numbers reach it
    assert (type(text).__name__, text.hidden_size, text.num_hidden_layers) == ("Gemma3TextConfig", 64, 2)


def test_a_mixture_of_experts_family_gets_its_experts_by_its_own_names():
    """qwen3_moe names its experts num_experts (mixtral: num_local_experts) and their width
    moe_intermediate_size: model.arch's numbers reach them, and a MoE family given no experts is
    refused in one line rather than built with its default 128 experts."""
    from tests.conftest import compose
    from workbench.core.errors import UserError
    from workbench.models.load import build_meta, hf_config

    arch = ["model.arch.family=qwen3_moe", "model.arch.experts=4", "model.arch.experts_per_token=2"]
    c = hf_config(compose(arch).model.arch)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (4, 2, 128)
    moe = build_meta(compose(arch).model)
    assert sum(p.numel() for p in moe.parameters()) < 20e6  # its default 128 experts of width 768: 38M more
    with pytest.raises(UserError, match=r"model.arch.family='qwen3_moe' is a mixture of experts: set "
                                        r"model.arch.experts and model.arch.experts_per_token \(its own default "
                                        r"would build 128 experts\)"):
        hf_config(compose(["model.arch.family=qwen3_moe"]).model.arch)


# -- a rank the kernel kills -------------------------------------------------------------------
HOG_MIB = 1536  # well above a worker's own peak (about 0.7 GiB here), so the figure must include it


def hog_and_die(completions, **_) -> list[float]:
    """A reward function that, on rank 1, touches HOG_MIB MiB and then dies by SIGKILL, as the
    kernel's out-of-memory killer ends a process (no exception, no traceback, no exit handler)."""
    if os.environ.get("RANK") == "1":
        hog = bytearray(HOG_MIB * 2**20)
        for i in range(0, len(hog), 4096):  # resident, not only reserved
            hog[i] = 1
        os.kill(os.getpid(), signal.SIGKILL)
    return [float(len(c)) for c in completions]


def test_a_rank_killed_by_sigkill_is_one_line_with_its_memory(tmp_path):
    args = [*TINY, "backend=fsdp2", "peft=none", "hardware.procs=2", "train.max_steps=2", "++hardware.timeout_minutes=4",
            "method=grpo", "method.num_generations=2", "train.micro_batch_size=2", "train.grad_accum=1",
            "method.max_new_tokens=4", f"reward.functions=[{__name__}:hog_and_die]", f"output_dir={tmp_path}"]
    line, log = one_error_line(args)
    assert line.startswith("error: rank 1 was killed by SIGKILL (exit -9)"), line
    assert "out-of-memory killer" in line, line
    # the largest peak of the launcher's reaped processes (the kernel's accounting): at least the hog
    peak = re.search(r"the largest process this launcher ran \(its workers\) peaked at ([0-9.]+) GiB resident", line)
    assert peak and float(peak.group(1)) >= HOG_MIB / 1024, line
    assert "Error executing job" not in log and "Traceback (most recent call last)" not in log, log[-4000:]
    assert "exitcode" not in log and "Root Cause" not in log, log[-4000:]  # torchrun's agent table


def test_the_line_for_an_ended_rank_reads_its_beat_only_if_it_is_that_process(tmp_path):
    """The launcher's line (workbench/guard/watchdog.py `ended`) takes the phase and memory of the
    rank's last heartbeat from stall.json only when the beat is that process's (pid and host):
    after an elastic restart the same rank is another process."""
    import json
    import socket
    import time

    from workbench.guard.watchdog import ended

    beat = {"phase": "forward", "detail": "", "step": 2, "since": time.time(), "beat": time.time(), "pid": 4242,
            "host": socket.gethostname(), "rss": 3 * 2**30}
    (tmp_path / "stall.json").write_text(json.dumps({"beats": {"1": beat}}))
    line = ended(1, 4242, 17, tmp_path)
    assert line.startswith("rank 1 exited with status 17 without raising (no traceback): "), line
    assert "had it in forward at step 3 with 3.0 GiB resident" in line and "out-of-memory" not in line, line
    other = ended(1, 4243, -signal.SIGKILL, tmp_path)
    assert other.startswith("rank 1 was killed by SIGKILL (exit -9): SIGKILL is what the kernel's out-of-memory "
                            "killer sends"), other
    assert "heartbeat" not in other and "hardware.procs" in other, other
