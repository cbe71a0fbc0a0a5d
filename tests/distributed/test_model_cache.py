"""The converted-model cache on a cold machine: two ranks of one job, torch.distributed
initialised in both, convert the packaged SmolLM2 GGUF at the same time over a tokenizer-only
folder (what an earlier version left behind when rank 1 won the rename). One complete entry
must come out, said to be rebuilt exactly once, and a later run must load it.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_model_cache.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve()


def _tokenizer_only_folder(entry: Path) -> None:
    """The broken entry of the original race: tokenizer files, no config or weights."""
    from workbench.models.load import zoo_entry

    pkg = zoo_entry("smollm2-135m").gguf_package
    import importlib.util

    if importlib.util.find_spec(pkg) is None:
        pytest.skip(f"{pkg} not installed")
    entry.mkdir(parents=True)
    (entry / "tokenizer_config.json").write_text("{}")
    (entry / "tokenizer.json").write_text("{}")


@pytest.mark.distributed
@pytest.mark.slow  # 2 ranks converting SmolLM2 (over a minute); tests/unit/test_data_cache.py and
# test_atomic.py hold the lock and seal in one process
def test_two_ranks_convert_once_over_a_broken_entry(tmp_path):
    cache = tmp_path / "cache"
    entry = cache / "models" / "smollm2-135m"
    _tokenizer_only_folder(entry)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "WORKBENCH_CACHE": str(cache)}
    cmd = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(HERE), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stderr.count("rebuilding it") == 1, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["kind"] for r in results] == ["converted", "converted"]
    seal = json.loads((entry / ".complete.json").read_text())["files"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "gguf_metadata.json"} <= set(seal)
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".smollm2")]  # no temp dirs left
    # a later process finds the entry complete and loads real weights from it
    from workbench.core import cache as wb_cache

    assert wb_cache.problem(entry) is None
    from safetensors import safe_open

    with safe_open(str(entry / "model.safetensors"), "pt") as f:
        assert "model.embed_tokens.weight" in f.keys()


def test_tokenizer_only_entry_is_not_trusted(tmp_path, monkeypatch):
    """locate() must not hand out a folder without a complete seal (no conversion here)."""
    from workbench.models import load

    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    _tokenizer_only_folder(load.converted_dir("smollm2-135m"))
    res = load.locate(load.zoo_entry("smollm2-135m"))
    assert res.kind == "gguf"  # convert again, rather than load a folder with no weights


def test_the_gguf_metadata_exports_copy_comes_from_the_cache(monkeypatch):
    """License and pre-tokenizer name are written once at conversion; an export reads them there
    instead of parsing the packaged GGUF's vocabulary again (about 4 s each time)."""
    import gguf

    from tests.conftest import compose
    from workbench.export import card as export
    from workbench.models import load

    cfg = compose([], base=[])  # the default model, SmolLM2 from its packaged GGUF
    load.materialise(cfg.model, load.locate(cfg.model))  # converted (once per cache) before the check

    def no_parse(*a, **k):
        raise AssertionError("the packaged GGUF was parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    meta = load.gguf_metadata(cfg.model)
    assert meta["tokenizer.ggml.pre"] == "smollm" and meta["general.license"] == "apache-2.0"
    assert export._license(cfg) == "apache-2.0"
    assert load.gguf_metadata(compose([]).model) == {}  # the tiny model comes from no GGUF


# -- worker ---------------------------------------------------------------------------------------
if __name__ == "__main__":
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    dist.init_process_group("gloo")
    from workbench.models.load import locate, materialise, zoo_entry

    out = Path(sys.argv[1])
    dist.barrier()  # both ranks start converting together
    cfg = zoo_entry("smollm2-135m")
    res = materialise(cfg, locate(cfg))
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps({"kind": res.kind, "path": res.path}))
    dist.barrier()
    dist.destroy_process_group()
