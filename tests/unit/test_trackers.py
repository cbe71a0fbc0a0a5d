"""Trackers record a tiny run, read back through each library's own reader; a tracker that cannot
start costs one line and nothing else; only rank 0 logs; the progress line says how far along.
No network: W&B offline, MLflow's local file store, trackio's local database."""

from __future__ import annotations

import json
import struct
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import compose, train
from tests.tolerances import F32_STORED_RTOL
from workbench.telemetry.metrics import Tracker

SECRET = "sk-test-not-a-real-key-1234"  # under a secret-looking key
TOKEN = "hf_" + "Zq7" * 12  # token-shaped, under an ordinary key
OPTIONAL = ("wandb", "mlflow", "trackio")  # extras: a tracker whose package is absent is skipped


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def wandb_records(run: Path) -> list:
    """Every record of the offline run file, parsed with wandb's own protobuf schema (the file is
    a LevelDB-style log: 32 KiB blocks of [crc32, length, type] framed chunks after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    path = next((run / "wandb").glob("offline-run-*/run-*.wandb"))
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, raws, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            raws.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            raws.append(buf + chunk)
    records = []
    for raw in raws:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        records.append(rec)
    return records


# trackio keeps one database per machine unless TRACKIO_DIR is set before its first import, and
# another test may import it first: a project name of this session's own keeps runs apart.
TRACKIO_PROJECT = f"wbtest-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """One tiny run logging to every installed tracker at once."""
    import importlib.util
    import os

    chosen = ["tensorboard"] + [n for n in OPTIONAL if importlib.util.find_spec(n) is not None]
    overrides = [f"tracker=[{','.join(chosen)}]", f"+hardware.env.WANDB_API_KEY={SECRET}", "train.max_steps=3",
                 f"+launcher.note={TOKEN}", "train.plots=true"]
    overrides += ["tracker.wandb.mode=offline"] if "wandb" in chosen else []
    overrides += [f"tracker.trackio.project={TRACKIO_PROJECT}"] if "trackio" in chosen else []

    out = tmp_path_factory.mktemp("tracked")
    saved = {k: os.environ.get(k) for k in ("TRACKIO_DIR", "WANDB_SILENT")}
    if "trackio" not in sys.modules:  # trackio reads its directory when first imported
        os.environ["TRACKIO_DIR"] = str(out / "trackio_db")
    os.environ["WANDB_SILENT"] = "true"
    try:
        yield out / "run", train(overrides, out / "run")
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def test_tensorboard_event_files_hold_every_step(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = tracked_run
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    rows = _metrics(run)
    tags = acc.Tags()
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "target_tokens"):
        assert f"train/{key}" in tags["scalars"], key
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in rows] == [1, 2, 3]
    # TensorBoard keeps scalars as float32: one rounding (tests/tolerances.py)
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=F32_STORED_RTOL)
    assert "plots/loss" in tags["images"] and "plots/throughput" in tags["images"]
    config = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "method:" in config and SECRET not in config and TOKEN not in config and "<redacted>" in config


def test_wandb_offline_run_holds_scalars_and_redacted_config(tracked_run):
    pytest.importorskip("wandb")
    run, _ = tracked_run
    records = wandb_records(run)
    history = [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    losses = [h["train/loss"] for h in history if "train/loss" in h]
    assert losses == [r["loss"] for r in _metrics(run)]  # float64 both ways
    cfg_rec = next(r for r in records if r.WhichOneof("record_type") == "run")
    config = {i.key: json.loads(i.value_json) for i in cfg_rec.run.config.update}
    assert config["model"]["name"] == "tiny"
    assert config["hardware"]["env"]["WANDB_API_KEY"] == "<redacted>"
    assert SECRET not in json.dumps(config) and TOKEN not in json.dumps(config)


def test_mlflow_file_store_holds_scalars_params_and_plots(tracked_run):
    MlflowClient = pytest.importorskip("mlflow").MlflowClient
    run, _ = tracked_run
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("workbench")
    (mrun,) = client.search_runs([exp.experiment_id])
    history = client.get_metric_history(mrun.info.run_id, "train/loss")
    assert [m.step for m in history] == [1, 2, 3]
    assert [m.value for m in history] == [r["loss"] for r in _metrics(run)]  # float64 both ways
    assert mrun.data.params["model.name"] == "tiny"
    assert mrun.data.params["hardware.env.WANDB_API_KEY"] == "<redacted>"
    assert mrun.data.params["launcher.note"] == "<redacted>"
    assert mrun.info.status == "FINISHED"
    plots = {Path(f.path).name for f in client.list_artifacts(mrun.info.run_id, "plots")}
    assert "loss.png" in plots


def test_trackio_local_run_holds_scalars_and_config(tracked_run):
    trackio = pytest.importorskip("trackio")
    from trackio.sqlite_storage import SQLiteStorage

    run, _ = tracked_run
    logs = [row for row in SQLiteStorage.get_logs(TRACKIO_PROJECT, run.name) if "train/loss" in row]
    assert [row["step"] for row in logs] == [1, 2, 3]
    assert [row["train/loss"] for row in logs] == [r["loss"] for r in _metrics(run)]  # float64 both ways
    (trun,) = [r for r in trackio.Api().runs(TRACKIO_PROJECT) if r.name == run.name]
    assert trun.config["model"]["name"] == "tiny" and SECRET not in json.dumps(trun.config, default=str)


def test_a_tracker_that_cannot_start_costs_one_line(tmp_path, monkeypatch, capfd):
    pytest.importorskip("tensorboard")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no W&B login
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if mlflow were not installed
    res = train(["tracker=[tensorboard,wandb,mlflow]", "train.max_steps=2"], tmp_path / "run")
    err = capfd.readouterr().err
    assert len(res["losses"]) == 2
    wandb_lines = [line for line in err.splitlines() if line.startswith("tracker wandb:")]
    mlflow_lines = [line for line in err.splitlines() if line.startswith("tracker mlflow:")]
    assert len(wandb_lines) == 1 and "API key" in wandb_lines[0] and "goes on" in wandb_lines[0]
    assert len(mlflow_lines) == 1 and "not installed" in mlflow_lines[0]
    assert "Traceback" not in err
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))  # the others still log


def test_only_rank_zero_starts_trackers_or_writes(tmp_path):
    cfg = compose(["tracker=[tensorboard]"], tmp_path)
    other_rank = Tracker(tmp_path / "r1", enabled=False, cfg=cfg)
    other_rank.log({"step": 1, "loss": 1.0, "tokens_per_s": 1.0}, show=True)
    other_rank.finish()
    assert other_rank.sinks == [] and not (tmp_path / "r1").exists()


def test_plain_log_line_carries_step_total_and_time_left(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_PROGRESS", "plain")
    cfg = compose(["tracker=[]", "train.max_steps=10"], tmp_path)
    t = Tracker(tmp_path, cfg=cfg)
    lines = []
    monkeypatch.setattr(t, "console", lines.append)
    for step in (1, 2, 3):
        t.log({"step": step, "loss": 2.0, "tokens_per_s": 100.0}, show=True)
    assert "[1/10 10%]" in lines[0]
    assert "[3/10 30%" in lines[2] and "left]" in lines[2]


def test_rich_bar_shows_step_loss_and_speed(tmp_path):
    import io

    from rich.console import Console

    from workbench.telemetry.progress import Progress

    buf = io.StringIO()
    p = Progress(5, 1, Console(file=buf, force_terminal=True, width=120), rich=True)
    for step in range(1, 6):
        p.update({"step": step, "loss": 1.25, "tokens_per_s": 321.0})
    p.stop()
    text = buf.getvalue()
    assert "5/5" in text and "loss 1.2500" in text and "321 tok/s" in text


def test_status_of_long_work_plain_and_under_the_bar():
    import io

    from rich.console import Console

    from workbench.telemetry.progress import Progress

    buf = io.StringIO()
    plain = Progress(5, 1, Console(file=buf, width=200), rich=False)
    with plain.status("eval [end]"):
        pass
    lines = buf.getvalue().splitlines()
    assert lines[0] == "eval [end] ..." and lines[1].startswith("eval [end]: ") and lines[1].endswith(" s")

    buf = io.StringIO()
    bar = Progress(5, 1, Console(file=buf, force_terminal=True, width=120), rich=True)
    bar.update({"step": 1, "loss": 1.0, "tokens_per_s": 1.0})
    with bar.status("checkpoint step 1"):
        bar._bar.refresh()
    bar.stop()
    assert "checkpoint step 1 ..." in buf.getvalue()
