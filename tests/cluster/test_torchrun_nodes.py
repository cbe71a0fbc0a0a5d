"""torchrun across two nodes with their own network stacks: the c10d rendezvous on node 1's
address, gloo between 198.18.x.11 and .12, and a rendezvous that cannot fill stopping in its
budget with one line. Real `python -m workbench` processes on each node (CPU, gloo).

    .venv/bin/python -m pytest -q -m cluster tests/cluster/test_torchrun_nodes.py
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from tests.cluster.runs import on, one_process_losses
from tests.conftest import TINY
from tests.helpers import ROOT, dist_env, logged_losses
from tests.tolerances import LOSS_RTOL

RUN = [*TINY, "backend=fsdp2", "peft=none", "train.max_steps=3", "hardware.procs=1", "hardware.nodes=2",
       "++hardware.timeout_minutes=4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    return one_process_losses(tmp_path_factory.mktemp("ref"), 3)


def test_two_nodes_train_as_one_job_with_the_losses_of_one_process(cluster, tmp_path, reference):
    endpoint = f"{cluster.addr('n1')}:29400"
    runs = {n: on(cluster, n, [*RUN, f"hardware.node_rank={i}", f"hardware.rdzv_endpoint={endpoint}",
                               f"output_dir={tmp_path}"]) for i, n in enumerate(cluster.nodes)}
    logs = {n: p.communicate(timeout=600)[0] for n, p in runs.items()}
    for n, p in runs.items():
        assert p.returncode == 0, f"{n}:\n{logs[n][-3000:]}"
    # each node advertised its own address on its own interface, not a hostname or loopback
    assert f"this node n1 {cluster.addr('n1')} (eth0)" in logs["n1"], logs["n1"][-2000:]
    assert f"this node n2 {cluster.addr('n2')} (eth0)" in logs["n2"], logs["n2"][-2000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert logged_losses(tmp_path) == pytest.approx(reference, rel=LOSS_RTOL)  # tests/tolerances.py


def test_a_rendezvous_that_cannot_fill_stops_in_its_budget_naming_the_missing_node(cluster, tmp_path):
    endpoint = f"{cluster.addr('n1')}:29401"
    t = time.monotonic()
    proc = on(cluster, "n1", [*RUN, "hardware.node_rank=0", f"hardware.rdzv_endpoint={endpoint}",
                              "hardware.rdzv_timeout_s=15", f"output_dir={tmp_path}"])
    out = proc.communicate(timeout=300)[0]
    waited = time.monotonic() - t
    assert proc.returncode != 0
    assert "node_rank 1 never joined" in out and "hardware.rdzv_timeout_s" in out, out[-2000:]
    assert "Traceback" not in out, out[-3000:]
    assert waited < 15 + 60, f"stopped after {waited:.0f} s"  # the budget plus interpreter and import time


def test_an_endpoint_no_node_resolves_is_one_line_before_anything_starts(cluster, tmp_path):
    done = cluster.run("n2", [sys.executable, "-m", "workbench", *RUN, "hardware.node_rank=1",
                              "hardware.rdzv_endpoint=nosuchhost:29400", f"output_dir={tmp_path}"],
                       cwd=ROOT, env=dist_env(), timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "hardware.rdzv_endpoint: 'nosuchhost' does not resolve on n2" in out, out[-2000:]
    assert "Traceback" not in out
