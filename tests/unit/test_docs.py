"""The docs site (mkdocs.yml, docs/): it builds with `mkdocs build --strict`, the configuration
reference equals what scripts/gen_config_docs.py writes, every command block says what it needs,
and the blocks marked runnable run.

A runnable block is a ```bash fence right after `<!-- exec -->` (default tier) or
`<!-- exec slow -->` (slow tier); `expect="text"` in the marker also requires that text in its
output. Each runs with bash in an empty directory, `python` being this interpreter.

    python -m pytest -q tests/unit/test_docs.py
    python -m pytest -q -m slow tests/unit/test_docs.py     # the slow tier's blocks
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCS = ROOT / "docs"
GENERATED = {"compatibility.md", "reference/config.md", "precision-matrix.md"}  # written by scripts
MARKER = re.compile(r"^<!-- exec( slow)?(?: expect=\"([^\"]*)\")? -->$")
FENCE = re.compile(r"^(\s*)```(\S*)")
NEEDS = "**Needs:**"


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if p.relative_to(DOCS).as_posix() not in GENERATED)


def fences(path: Path):
    """(line number, language, the line before it that is not blank or a marker, marker match, body)."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        body = "\n".join(ln[len(indent):] for ln in lines[i + 1:end])
        k, marker = i - 1, None
        while k >= 0 and (not lines[k].strip() or MARKER.match(lines[k].strip())):
            marker = marker or MARKER.match(lines[k].strip())
            k -= 1
        yield i + 1, lang, (lines[k].strip() if k >= 0 else ""), marker, body
        i = end + 1


def runnable():
    out = []
    for path in pages():
        for line, _lang, _, marker, body in fences(path):
            if marker:
                slow, expect = marker.groups()
                where = f"{path.relative_to(DOCS)}:{line}"
                out.append(pytest.param(body, expect, id=where, marks=[pytest.mark.slow] if slow else []))
    return out


def test_mkdocs_builds_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs / mkdocs-material not installed (pip install -e '.[dev]')")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "index.html").exists() and (tmp_path / "site" / "reference" / "config.html").exists()


def test_config_reference_is_generated():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (DOCS / "reference" / "config.md").read_text() == module.render(), \
        "docs/reference/config.md is stale: run python scripts/gen_config_docs.py"


KEY_HEADER = "| key | type | default | description |"


def undescribed_keys(page: str) -> list[str]:
    """The keys of a configuration reference's key tables whose description cell is empty."""
    empty, in_table = [], False
    for line in page.splitlines():
        if line.strip() == KEY_HEADER:
            in_table = True
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if in_table and cells[0].startswith("`") and not cells[-1]:
            empty.append(cells[0].strip("`"))
    return empty


def test_every_config_key_is_described():
    """Every key in docs/reference/config.md has a description: a comment on the field of its schema
    dataclass or on the key in the conf/ file that sets it (scripts/gen_config_docs.py reads both)."""
    sample = f"{KEY_HEADER}\n|---|---|---|---|\n| `a` | int | `1` | one |\n| `b` | str \\| None | `null` |  |\n"
    assert undescribed_keys(sample) == ["b"]  # the check itself finds an empty cell
    missing = undescribed_keys((DOCS / "reference" / "config.md").read_text())
    assert missing == [], f"{len(missing)} keys without a description (comment their field or YAML key): {missing}"


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if p.relative_to(DOCS).as_posix() not in nav]
    assert missing == []


def test_every_command_block_says_what_it_needs():
    """Each fence names its language; each shell block is runnable or says what it needs (a GPU, a
    cluster, the network, minutes of CPU) in a `**Needs:**` line before it."""
    unlabelled, bare = [], []
    for path in pages():
        for line, lang, before, marker, _ in fences(path):
            where = f"{path.relative_to(DOCS)}:{line}"
            if not lang:
                bare.append(where)
            if marker and lang != "bash":
                unlabelled.append(f"{where} (a runnable block must be bash)")
            if lang in ("bash", "sh", "console", "shell") and not before.startswith(NEEDS):
                unlabelled.append(where)
    assert bare == [] and unlabelled == []


def test_some_blocks_run_in_the_default_tier():
    default = [p for p in runnable() if not p.marks]
    assert 1 <= len(default) <= 6, [p.id for p in default]


@pytest.mark.parametrize("body, expect", runnable())
def test_doc_block_runs(body, expect, tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "WORKBENCH_PROGRESS": "plain", "HYDRA_FULL_ERROR": "1"}
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    if expect:
        assert expect in out, out[-4000:]


def test_recovery_table_is_the_measured_records():
    """docs/guides/multi-node.md's recovery table is what scripts/recovery_table.py makes of
    docs/measurements/recovery.json (the cluster tier's records), not edited by hand."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "recovery_table.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
