"""Reports that describe the whole of what ran: report.md's wall time counts the export and its
parity gate (and the export says what it is doing before it starts), a run resumed twice is
reported as one run of all its steps, `python -m workbench.report` refuses a path with no run in
one `error:` line, and exported weights are readable as the user's umask says.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_reports_whole_run.py
"""

from __future__ import annotations

import json
import os
import time

from tests.conftest import train
from workbench.report import main as report_main


def _rows(out) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_wall_time_counts_the_export_and_the_export_says_what_it_does(tmp_path, monkeypatch, capsys):
    from workbench.run import finish

    real, ended = finish.export, []

    def export(*args, **kwargs):  # the real export, made slower than the rest of a tiny run's end
        out = real(*args, **kwargs)
        time.sleep(1.0)
        ended.append(time.time())
        return out

    monkeypatch.setattr(finish, "export", export)
    launched = time.time()
    res = train(["peft=lora", "train.max_steps=1", "train.export=true", "export.parity_prompts=2"], tmp_path)
    # the wall time was taken after the export (and its parity gate) ended, from the job's start
    # (the launch, when the run does not record where it started)
    assert res.get("started", launched) + res["wall_seconds"] >= ended[0]
    assert f"wall {res['wall_seconds']:.0f} s" in (tmp_path / "report.md").read_text()
    err = capsys.readouterr().err
    assert f"export: writing adapter, merged safetensors to {tmp_path / 'export'}, then the parity gate on 2 " \
           "prompts" in err, err
    assert "export: done in " in err
    # transformers writes model.safetensors 0600 (through a private temporary file): the export is
    # readable as the umask says, like every other file it writes
    mask = os.umask(0o022)
    os.umask(mask)
    for f in ("merged/model.safetensors", "adapter/adapter_model.safetensors", "merged/config.json"):
        assert (tmp_path / "export" / f).stat().st_mode & 0o777 == 0o666 & ~mask, f


def test_a_run_resumed_twice_is_reported_as_one_run(tmp_path):
    out = tmp_path / "run"
    train(["train.max_steps=2"], out)
    train(["train.max_steps=4"], out)
    train(["train.max_steps=6", "optim.lr=1e-3", "train.resume_changes=allow"], out)
    report = (out / "report.md").read_text()
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert f"- steps: 6; 2 in this launch, resumed from {out / 'checkpoints' / 'step-00000004'}" in report, report
    assert ("- launches: 3; steps 1-2: a new run; steps 3-4: resumed from step-00000002, `train.max_steps` 2 -> 4; "
            "steps 5-6: resumed from step-00000004, `optim.lr` 0.0002 -> 0.001, `train.max_steps` 4 -> 6") in report
    assert f"- loss: first {rows[0]['loss']:.4f}, last {rows[-1]['loss']:.4f}" in report
    assert len(json.loads((out / "results.json").read_text())["losses"]) == 2  # results.json: this launch's, as returned


def test_report_command_errors_in_one_line(tmp_path, capsys):
    good = tmp_path / "runs" / "lr-small"
    train(["train.max_steps=1"], good)
    capsys.readouterr()

    def errors(argv):
        status = report_main(argv)
        return status, [x for x in capsys.readouterr().err.splitlines() if x.strip()]

    # a misspelled run directory beside a good one: not dropped in silence
    missing = tmp_path / "runs" / "lr-smal"
    assert errors([str(good), str(missing)]) == (2, [f"error: {missing}: no such directory; did you mean {good}?"])
    # a sweep whose jobs all failed
    failed = tmp_path / "sweep-failed" / "0"
    failed.mkdir(parents=True)
    (failed / "sweep_job.json").write_text(json.dumps({"status": "FAILED", "error": "optim.lr=-1 must be > 0"}))
    status, lines = errors([str(failed.parent)])
    assert status == 2 and lines == [f"error: {failed.parent}: no job of this sweep trained (job 0: optim.lr=-1 must "
                                     "be > 0)"]
    # a sweep given output_dir: its jobs trained elsewhere, and sweep_job.json says where
    sweep = tmp_path / "multirun" / "0"
    sweep.mkdir(parents=True)
    (sweep / "sweep_job.json").write_text(json.dumps({"status": "COMPLETED", "output_dir": str(good)}))
    assert report_main([str(sweep.parent), "--out", str(tmp_path / "cmp")]) == 0
    assert str(good) in capsys.readouterr().out
