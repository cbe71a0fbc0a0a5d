"""`launcher=ray` across two nodes: a Ray head on n1 and a worker node on n2 (each with one CPU,
so Ray Train places one rank on each), the driver on n1, gloo between the nodes' own
interfaces. Ends with the losses of one process at the same global batch.

    .venv/bin/python -m pytest -q -m cluster tests/cluster/test_ray_nodes.py
"""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path

import pytest

from tests.cluster.runs import one_process_losses
from tests.conftest import TINY
from tests.helpers import ROOT, dist_env, logged_losses
from tests.tolerances import LOSS_RTOL

RAY = Path(sys.executable).with_name("ray")
# A cluster across machines needs Ray's token authentication (Ray 2.5x+): head, worker node and
# driver share one token, made for this test run only.
TOKEN = secrets.token_hex(16)


def ray_env() -> dict:
    return {**dist_env(), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}


@pytest.fixture(scope="module")
def ray_cluster(cluster, tmp_path_factory):
    pytest.importorskip("ray")
    head = f"{cluster.addr('n1')}:6379"
    common = ["--num-cpus=1", "--disable-usage-stats"]
    env = ray_env()
    for node, args in (("n1", ["--head", "--port=6379", "--include-dashboard=false"]), ("n2", [f"--address={head}"])):
        temp = tmp_path_factory.mktemp(f"ray-{node}")  # one session dir per node: /tmp/ray is shared here
        done = cluster.run(node, [str(RAY), "start", *args, f"--node-ip-address={cluster.addr(node)}",
                                  f"--temp-dir={temp}", *common], env=env, timeout=180)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    yield head
    for node in ("n2", "n1"):
        cluster.run(node, [str(RAY), "stop", "--force"], env=env, timeout=120)


def test_ray_across_two_nodes_ends_with_one_process_losses(cluster, ray_cluster, tmp_path):
    reference = one_process_losses(tmp_path / "ref", 3)
    out = tmp_path / "run"
    done = cluster.run("n1", [sys.executable, "-m", "workbench", *TINY, "backend=fsdp2", "peft=none", "train.max_steps=3",
                              "launcher=ray", f"launcher.address={ray_cluster}", "hardware.nodes=2", "hardware.procs=1",
                              "++hardware.timeout_minutes=4", f"output_dir={out}"],
                       cwd=ROOT, env=ray_env(), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert logged_losses(out) == pytest.approx(reference, rel=LOSS_RTOL)
