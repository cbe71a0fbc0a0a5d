"""Elastic on three nodes: one lost and the run goes on on two with its global batch kept, then
the node comes back and is admitted, and the run ends on three with one process's losses.

    .venv/bin/python -m pytest -q -m cluster tests/cluster/test_elastic_nodes.py -s

3 nodes x 1 process, FSDP2, `hardware.min_nodes=2`, micro-batch 4: a global batch of 12. Node 3
is killed (every process, as losing the machine does) at step 3; the survivors cannot split 12
rows with micro-batch 4 on 2 ranks, so they take 3 x 2 (workbench/checkpoints/resume.py `split`) and
say so. Once they train again, node 3's command is started again: torchrun's agents see it
waiting, the workers checkpoint at the end of their step and the rendezvous admits it. Each
phase's times go to tests/cluster/recovery.py's records (docs/guides/multi-node.md's table).
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.cluster import recovery
from tests.cluster.nodes import Cluster, unavailable
from tests.cluster.runs import on
from tests.conftest import TINY, train
from tests.helpers import logged_losses
from tests.tolerances import LOSS_RTOL

STEPS, STALL_S = 14, 20
RUN = [*TINY, "backend=fsdp2", "peft=none", f"train.max_steps={STEPS}", "hardware.procs=1", "hardware.nodes=3",
       "hardware.min_nodes=2", "hardware.max_restarts=2", "train.checkpoint_every=1", "debug.step_sleep_s=1",
       f"hardware.stall_timeout_s={STALL_S}", "++hardware.timeout_minutes=4"]


@pytest.fixture(scope="module")
def cluster3():
    why = unavailable()
    if why:
        pytest.skip(why)
    c = Cluster(3).up()
    try:
        yield c
    finally:
        c.down()
    assert c.leftovers() == [], f"the cluster left {c.leftovers()}"


class Node:
    """A node's `python -m workbench` with its output lines read as they come, each with its time."""

    def __init__(self, cluster, name: str, args: list[str]):
        self.proc = on(cluster, name, args)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def first(self, text: str, after: float = 0.0) -> float | None:
        return next((t for t, line in self.lines if t >= after and text in line), None)

    def text(self) -> str:
        return "".join(line for _, line in self.lines)


def steps_logged(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return sum('"loss"' in x for x in path.read_text().splitlines()) if path.exists() else 0


def wait_for(what, timeout: float, nodes: dict, say: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(0.2)
    for n in nodes.values():
        n.proc.kill()
    said = "".join(f"\n--- {n} said:\n{node.text()[-3000:]}" for n, node in nodes.items())
    pytest.fail(f"{say} within {timeout:.0f} s{said}")


def keep_logs(nodes: dict, where) -> dict:
    """Each node's output, kept beside the run for whoever reads a failure."""
    logs = {n: nodes[n].text() for n in nodes}
    for n, text in logs.items():
        (where / f"{n}.log").write_text(text)
    return logs


def test_three_nodes_lose_one_keep_the_batch_on_two_and_take_it_back(cluster3, tmp_path):
    out = tmp_path / "run"
    endpoint = f"{cluster3.addr('n1')}:29420"
    args = [*RUN, f"hardware.rdzv_endpoint={endpoint}", f"output_dir={out}"]
    nodes = {n: Node(cluster3, n, args) for n in cluster3.nodes}
    wait_for(lambda: steps_logged(out) >= 3, 300, nodes, "step 3 never came")
    cluster3.kill("n3")
    lost = time.monotonic()
    # the survivors: each names the lost rank, then training goes on at 2 ranks with 3 x 2
    said = lambda: [nodes[n].first("rank 2 on n3", lost) for n in ("n1", "n2")]  # noqa: E731
    named = wait_for(lambda: all(said()) and max(said()), 120, nodes,
                     "the survivors did not both name rank 2 on n3")
    resumed = wait_for(lambda: nodes["n1"].first("= 3 x 2 x 2 data-parallel", lost), 180, nodes,
                       "the survivors did not resume at 3 x 2 x 2")
    at = steps_logged(out)
    wait_for(lambda: steps_logged(out) >= at + 2, 120, nodes, "no step after the survivors resumed")
    training = nodes["n1"].first("step ", resumed)
    back = time.monotonic()
    nodes["n3"] = Node(cluster3, "n3", args)  # the node returns: the same command again
    joined = wait_for(lambda: nodes["n1"].first("node(s) joining", back), 120, nodes, "node 3 was not admitted")
    try:
        for n in nodes.values():
            n.proc.wait(timeout=300)
    finally:
        logs = keep_logs(nodes, tmp_path)
    assert all(nodes[n].proc.returncode == 0 for n in nodes), "".join(f"--- {n}\n{t[-2500:]}" for n, t in logs.items())
    for n in ("n1", "n2"):  # every survivor's restart line names the loss, not "a worker exited"
        assert "restart 1 of 2: rank(s) 2 stopped answering" in logs[n] and "a worker exited" not in logs[n], logs[n]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["world_size"] == 3 and manifest["resumed_from"], manifest  # ended on three again
    assert manifest["resume"]["certificate"]["ok"], manifest["resume"]
    reference = train(["peft=none", f"train.max_steps={STEPS}", "train.grad_accum=3"], tmp_path / "ref")["losses"]
    losses = logged_losses(out)
    assert losses == pytest.approx(reference, rel=LOSS_RTOL)
    recovery.record("node killed (3 -> 2 nodes, then back to 3)", "torchrun", named=named - lost,
                    training=training - lost, steps_lost=_steps_lost(out), final=(losses[-1], reference[-1]),
                    readmitted=joined - back)


def _steps_lost(run_dir) -> int:
    """Steps trained twice: logged more than once in metrics.jsonl (a restart goes back to its checkpoint)."""
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    return len(steps) - len(set(steps))
