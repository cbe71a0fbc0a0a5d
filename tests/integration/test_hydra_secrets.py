"""No file in a run directory holds a secret given on the command line, Hydra's own included.

Hydra writes `<run>/.hydra/{config,hydra,overrides}.yaml` before the job starts (and a multirun's
`multirun.yaml`, `sweep_job.json`, sweep summary); the CLI and its Hydra callback rewrite them
with secret-looking values redacted. Run: `pytest tests/integration/test_hydra_secrets.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT
from workbench.cli import scrub_files, secret_values

TOKEN = "hf_" + "Zq7" * 12  # token-shaped: redacted whatever key holds it
PLAIN = "plain-s3cret-value"  # not token-shaped: redacted because its key is `api_key`


def test_no_file_in_the_run_dir_holds_the_secret(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "workbench", "model=tiny", "debug=fast", "train.max_steps=1",
         f"+launcher.env={{HF_TOKEN: {TOKEN}}}", f"+launcher.api_key={PLAIN}", f"output_dir={out}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert (out / ".hydra" / "overrides.yaml") in files and (out / "config.yaml") in files
    for path in files:
        data = path.read_bytes()
        assert TOKEN.encode() not in data and PLAIN.encode() not in data, f"secret in {path}"
    assert "<redacted>" in (out / ".hydra" / "overrides.yaml").read_text()
    assert TOKEN not in proc.stdout + proc.stderr


def test_multirun_sweep_dir_holds_no_secret(tmp_path):
    """-m: Hydra's multirun.yaml, each job's sweep_job.json and the sweep summary copy the command line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "workbench", "-m", "model=tiny", "debug=fast", "train.max_steps=1", "train.seed=0",
         f"+launcher.env={{HF_TOKEN: {TOKEN}}}", f"+launcher.api_key={PLAIN}",
         f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = [p for p in (tmp_path / "sweep").rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"multirun.yaml", "sweep_job.json", "sweep_summary.csv", "overrides.yaml"} <= names, names
    for path in files:
        data = path.read_bytes()
        assert TOKEN.encode() not in data and PLAIN.encode() not in data, f"secret in {path}"


def test_scrub_keeps_everything_else(tmp_path):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"launcher": {"env": {"WANDB_API_KEY": "abc123xyz", "HF_TOKEN": "${oc.env:HF_TOKEN}"},
                                         "name": "local"}, "model": {"tokenizer": "keep-me"}})
    assert secret_values(cfg) == {"abc123xyz"}  # an interpolation names a secret, it is not one
    f = tmp_path / "overrides.yaml"
    f.write_text("- launcher.env.WANDB_API_KEY=abc123xyz\n- model.tokenizer=keep-me\n")
    scrub_files([f, tmp_path / "absent.yaml"], secret_values(cfg))
    assert f.read_text() == "- launcher.env.WANDB_API_KEY=<redacted>\n- model.tokenizer=keep-me\n"
