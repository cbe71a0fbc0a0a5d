"""A collective that breaks because a peer left names the peer's own failure when the peer wrote
it to the store before leaving (workbench/guard/watchdog.py Watchdog.blame), not "stopped
answering": on a loaded machine the collective can break before the watchdog's tick reads it.

    python -m pytest -q tests/unit/test_watchdog_blame.py
"""

from __future__ import annotations

import json

import torch.distributed as dist

from workbench.guard.watchdog import RankFailure, Watchdog


def test_a_broken_collective_names_the_peers_own_failure(tmp_path):
    dog = Watchdog(tmp_path, rank=1, world=2, interval_s=0.05)
    dog.store = dist.HashStore()
    dog.store.set("error", json.dumps({"rank": 0, "where": "checkpoint at step 2",
                                       "error": "UserError: disk full", "own": True}))
    got = dog.blame(RuntimeError("Connection closed by peer [127.0.0.1]:29500"))
    assert isinstance(got, RankFailure) and got.ranks == (0,)
    assert str(got).startswith("rank 1 stops: rank 0 failed in checkpoint at step 2: UserError: disk full")


def test_without_a_word_from_the_peer_the_transports_error_stands(tmp_path):
    dog = Watchdog(tmp_path, rank=1, world=2, interval_s=0.05)
    dog.store = dist.HashStore()
    err = RuntimeError("Connection closed by peer")
    assert dog.blame(err) is err


def test_a_peer_that_only_stopped_with_another_is_not_the_cause(tmp_path):
    """A survivor that stopped because a third rank went records that too; it is not why."""
    dog = Watchdog(tmp_path, rank=1, world=3, interval_s=0.05)
    dog.store = dist.HashStore()
    dog.store.set("error", json.dumps({"rank": 0, "where": "step 3", "own": False,
                                       "error": "RankFailure: rank(s) 2 stopped answering (process gone)"}))
    err = RuntimeError("Connection closed by peer")
    assert dog.blame(err) is err  # no beats here: nothing gone either, so the transport's error stands


def test_a_survivors_verdict_on_a_lost_rank_is_said_the_same_here(tmp_path):
    """Rank 0 found rank 2's node gone and left; rank 1's socket then broke on rank 0. Rank 1 says
    rank 0's verdict (rank 2 lost), not that rank 0 stopped answering."""
    dog = Watchdog(tmp_path, rank=1, world=3, interval_s=0.05)
    dog.store = dist.HashStore()
    verdict = "rank(s) 2 stopped answering (its node closed the connection): rank 2 on n3 (198.18.0.3) in step"
    rank0 = Watchdog(tmp_path, rank=0, world=3, interval_s=0.05)
    rank0.store = dog.store
    rank0.fail(RankFailure(verdict, ranks=[2]))
    got = dog.blame(RuntimeError("Connection closed by peer [198.18.0.1]:29500"))
    assert isinstance(got, RankFailure) and got.ranks == (2,) and str(got) == verdict


def test_a_verdict_naming_this_rank_is_not_adopted(tmp_path):
    dog = Watchdog(tmp_path, rank=2, world=3, interval_s=0.05)
    dog.store = dist.HashStore()
    dog.store.set("error", json.dumps({"rank": 0, "where": "step 3", "own": False, "ranks": [2],
                                       "error": "RankFailure: rank(s) 2 stopped answering", "verdict": "x"}))
    err = RuntimeError("Connection closed by peer")
    assert dog.blame(err) is err
