"""No file a run writes holds a secret given on the command line, whatever key holds it.

One rule (workbench/core/secrets.py): a value under a secret-looking key, or a token-shaped value
(`hf_...`, `sk-...`, `ghp_...`) under any key, anywhere in a longer string too. Each run below goes
through the real CLI and then every file under its directory is read as bytes: config.yaml,
manifest.json, Hydra's `.hydra/`, metrics.jsonl, the tensorboard events (the config text), the
model card, report.md and results.json; for a multirun also `multirun.yaml`, `sweep_job.json` and
the sweep summary. Run: `pytest tests/integration/test_hydra_secrets.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT

HF = "hf_" + "Zq7" * 12  # token-shaped: redacted whatever key holds it
SK = "sk-" + "Wv4" * 9
GH = "ghp_" + "Kx2" * 9
PLAIN = "plain-s3cret-value"  # not token-shaped: redacted because its key is `api_key`
SECRETS = (HF, SK, GH, PLAIN)
# an innocent key, a nested one, token shapes inside longer strings, and the old cases
GIVEN = [f"+launcher.note={HF}", f"+launcher.extra.deep.note={SK}",
         f"+launcher.endpoint='https://user:{GH}@example.com/repo.git'", f"+launcher.header='Bearer {HF}'",
         f"+launcher.env={{HF_TOKEN: {HF}}}", f"+launcher.api_key={PLAIN}"]


def _workbench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "workbench", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for secret in SECRETS:
        assert secret not in proc.stdout + proc.stderr, f"{secret} printed"
    return proc


def _leaks(folder) -> list[str]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return [f"{s} in {p}" for p in files for s in SECRETS if s.encode() in p.read_bytes()]


def test_no_file_in_the_run_dir_holds_the_secret(tmp_path):
    out = tmp_path / "run"
    _workbench("model=tiny", "precision=fp32", "train.max_steps=2", "train.micro_batch_size=4", "eval=none",
               "tracker=[tensorboard]", "train.export=true", "eval.max_new_tokens=12",
               "model.tokenizer=smollm2-135m", *GIVEN, f"output_dir={out}")
    written = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert {".hydra/overrides.yaml", ".hydra/config.yaml", ".hydra/hydra.yaml", "config.yaml", "manifest.json",
            "metrics.jsonl", "report.md", "results.json", "export/merged/README.md"} <= written, written
    assert any(p.startswith("tensorboard/events.out.tfevents") for p in written), written
    assert _leaks(out) == []
    # redacted where they were, not dropped; settings that merely mention tokens stay as given
    config = (out / "config.yaml").read_text()
    assert "note: <redacted>" in config and "header: Bearer <redacted>" in config
    assert "endpoint: https://user:<redacted>@example.com/repo.git" in config
    assert "<redacted>" in (out / ".hydra" / "overrides.yaml").read_text()
    card = (out / "export" / "merged" / "README.md").read_text()
    assert "eval.max_new_tokens=12" in card and "model.tokenizer=smollm2-135m" in card
    assert "+launcher.note=<redacted>" in card and "+launcher.api_key=<redacted>" in card


def test_multirun_sweep_dir_holds_no_secret(tmp_path):
    """-m: Hydra's multirun.yaml and log lines, each job's .hydra and sweep_job.json, and the sweep
    summary copy the command line."""
    _workbench("-m", "model=tiny", "debug=fast", "train.max_steps=1", "train.seed=0", *GIVEN,
               f"hydra.sweep.dir={tmp_path / 'sweep'}")
    files = [p for p in (tmp_path / "sweep").rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"multirun.yaml", "sweep_job.json", "sweep_summary.md", "sweep_summary.csv", "overrides.yaml",
            "config.yaml", "manifest.json"} <= names, names
    assert _leaks(tmp_path / "sweep") == []
