"""Losing a node mid-run, with nobody at the keyboard: node 2's processes all killed at step 3 of
8, and separately node 2's link taken down. torchrun's elastic agent on each node
(`hardware.min_nodes=1`), the watchdog naming the lost node, and resume anywhere continuing on
node 1 alone with the global batch kept.

    .venv/bin/python -m pytest -q -m cluster tests/cluster/test_node_loss.py
"""

from __future__ import annotations

import json
import time

import pytest

from tests.cluster import recovery
from tests.cluster.runs import on, one_process_losses
from tests.conftest import TINY
from tests.helpers import logged_losses
from tests.tolerances import LOSS_RTOL

STEPS, STALL_S = 8, 20
RUN = [*TINY, "backend=fsdp2", "peft=none", f"train.max_steps={STEPS}", "hardware.procs=1", "hardware.nodes=2",
       "hardware.min_nodes=1", "hardware.max_restarts=2", "train.checkpoint_every=1", "debug.step_sleep_s=1",
       f"hardware.stall_timeout_s={STALL_S}", "++hardware.timeout_minutes=4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """The uninterrupted run: one process at the same global batch."""
    return one_process_losses(tmp_path_factory.mktemp("ref"), STEPS)


def lose_node_2(cluster, tmp_path, port: int, how) -> tuple[str, float, float, float]:
    """Start both nodes, do `how` to node 2 once step 3 is logged; (node 1's log, seconds from the
    loss until node 1 named it, until it logged a step again, until it finished)."""
    endpoint = f"{cluster.addr('n1')}:{port}"
    nodes = {n: on(cluster, n, [*RUN, f"hardware.rdzv_endpoint={endpoint}", f"output_dir={tmp_path}"])
             for n in cluster.nodes}
    metrics, deadline, lost = tmp_path / "metrics.jsonl", time.monotonic() + 300, None
    while time.monotonic() < deadline and nodes["n1"].poll() is None:
        if metrics.exists() and sum('"loss"' in x for x in metrics.read_text().splitlines()) >= 3:
            how("n2")
            lost = time.monotonic()
            break
        time.sleep(0.1)
    if lost is None:
        for p in nodes.values():
            p.kill()
        pytest.fail(f"step 3 never came; node 1 said:\n{nodes['n1'].communicate()[0][-3000:]}")
    named, training, lines = None, None, []
    for line in nodes["n1"].stdout:  # node 1's output as it comes
        lines.append(line)
        if named is None and "rank 1 on n2" in line:
            named = time.monotonic() - lost
        elif named is not None and training is None and line.startswith("step "):
            training = time.monotonic() - lost
    nodes["n1"].wait(timeout=60)
    return "".join(lines), named, training, time.monotonic() - lost


@pytest.mark.parametrize("loss", ["killed", "cut off"])
def test_a_lost_node_is_named_and_the_run_finishes_on_the_other(cluster, tmp_path, reference, loss):
    how = cluster.kill if loss == "killed" else cluster.cut
    log, named, training, finished = lose_node_2(cluster, tmp_path, 29410 + (loss == "cut off"), how)
    print(f"\nnode 2 {loss}: named after {named} s, training after {training} s, run finished {finished:.0f} s "
          "after the loss")
    assert named is not None and named <= STALL_S + 30, log[-4000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["world_size"] == 1 and manifest["resumed_from"], log[-6000:]  # continued alone, from a checkpoint
    assert manifest["resume"]["certificate"]["ok"], manifest["resume"]
    losses = logged_losses(tmp_path)
    assert losses == pytest.approx(reference, rel=LOSS_RTOL)
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    recovery.record(f"node {'killed' if loss == 'killed' else 'link down'} (2 -> 1 node)", "torchrun", named=named,
                    training=training, steps_lost=len(steps) - len(set(steps)), final=(losses[-1], reference[-1]))
