"""Multi-turn episodes with 2 ranks: no rank hangs when another's episodes run longer, and a GRPO
run with the calculator environment ends with both ranks at the same step under FSDP2 and ZeRO-3.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_episodes_ranks.py

The first test runs the episode loop itself in two gloo processes with a scripted policy whose
every call is a collective (as a forward through FSDP2's sharded weights is): rank 1's episodes
take three turns, rank 0's one. The second trains the tiny model for two steps (its random turns
end at max_new_tokens, so it checks the wiring under sharding: generation through the sharded
model, episodes collated and trained, both ranks stepping together).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.helpers import free_port, ov, worker_job

pytestmark = pytest.mark.distributed


def _episodes_rank(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from tests.conftest import compose
    from tests.unit.test_episodes import ROW
    from workbench.data.chat import setup_tokenizer
    from workbench.envs.registry import load
    from workbench.envs.tools import ToolCall
    from workbench.models.load import load_tokenizer
    from workbench.rollout import episodes
    from workbench.rollout.turns import Turns

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    tok = load_tokenizer(compose().model)
    contract = setup_tokenizer(tok)
    env = load({"name": "calc", "max_turns": 4, "max_new_tokens": 64})
    turns = Turns(tok, contract, env.tools)
    call = turns.format.render(ToolCall("calc", {"expression": "347 + 589"}))
    script = [call, call, "936"] if rank == 1 else ["936"]
    calls = []

    def sample(prompts, first):
        t = torch.ones(1)
        dist.all_reduce(t)  # a forward through sharded weights: every rank must join
        calls.append(len(prompts))
        return [tok(script.pop(0) if script else "unused", add_special_tokens=False)["input_ids"] for _ in prompts]

    eps = episodes.run(env, turns, [ROW], sample, max_new_tokens=64, synced=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"calls": calls, "turns": eps[0].turns, "final": eps[0].final}))
    dist.destroy_process_group()


def test_ranks_with_episodes_of_different_lengths_make_the_same_calls(tmp_path):
    ctx = mp.start_processes(_episodes_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    for _ in range(300):  # a rank waiting in a collective the other never joins would hang here
        if ctx.join(timeout=1):
            break
    else:
        for p in ctx.processes:
            p.kill()
        pytest.fail("a rank hung in the episode loop")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (r0["turns"], r1["turns"]) == (1, 3) and r0["final"] == r1["final"] == "936"
    assert r0["calls"] == [1, 1, 1] and r1["calls"] == [1, 1, 1]  # rank 0 joined turns 2 and 3 with a stand-in


ENV = ("method=grpo", "env=calc", "env.max_new_tokens=6", "env.max_turns=2", "method.num_generations=4",
       'reward.functions=["tests.rewards:char_length"]', "train.micro_batch_size=4", "train.grad_accum=1")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    runs = [{"name": "f_env", "overrides": ov("backend=fsdp2", "peft=lora", *ENV, steps=2)},
            {"name": "z3_env", "overrides": ov("backend=deepspeed", "backend.stage=3", "peft=lora", *ENV, steps=2)}]
    return worker_job(runs, tmp_path_factory.mktemp("env_ranks"), timeout=1500)


@pytest.mark.parametrize("name", ["f_env", "z3_env"])
def test_calculator_env_ends_with_both_ranks_in_step(sharded, name):
    r0, r1 = sharded[name], sharded[name]["rank1"]
    assert len(r0["losses"]) == len(r1["losses"]) == 2
    assert r0["losses"] == r1["losses"]  # the loss is reduced over ranks: both log the same step's
