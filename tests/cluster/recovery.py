"""What the cluster tier measured about each fault it survived, for docs/guides/multi-node.md's
recovery table: time until named, time until training again, steps trained twice, final loss
against the uninterrupted run. Each test appends one record per run; the table is made from them
by `python scripts/recovery_table.py` (never by hand).

    WORKBENCH_RECOVERY_RECORDS=/tmp/r.jsonl .venv/bin/python -m pytest -q -m cluster tests/cluster
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from tests.helpers import ROOT

RECORDS = Path(os.environ.get("WORKBENCH_RECOVERY_RECORDS", ROOT / "runs" / "cluster-recovery.jsonl"))


def record(fault: str, launcher: str, *, named: float | None, training: float | None, steps_lost: int | None,
           final: tuple[float, float] | None, **extra) -> None:
    """One measured recovery; seconds from the fault, `final`: (this run's last loss, the uninterrupted run's)."""
    row = {"fault": fault, "launcher": launcher, "named_s": _r(named), "training_s": _r(training),
           "steps_lost": steps_lost, "final_loss": list(final) if final else None,
           **{k: _r(v) if isinstance(v, float) else v for k, v in extra.items()},
           "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "when": time.strftime("%Y-%m-%d")}
    RECORDS.parent.mkdir(parents=True, exist_ok=True)
    with RECORDS.open("a") as fh:
        fh.write(json.dumps(row) + "\n")


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)
