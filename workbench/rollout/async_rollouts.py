"""Rollouts one step ahead (`method.async_rollouts=true`): step k+1's generation runs while step k trains.

    ahead = AsyncRollouts(module, make)        # make(view, step) -> StepBatch, with view a backend-like
    batch = ahead.next(backend, step, more)    # this step's batch; starts the next one when `more`

A background thread generates (and scores) the next step's rollout with a snapshot of the
policy: a frozen copy of the model whose trainable weights (the LoRA adapters, or every weight
under full fine-tuning) are copied from the training model at the start of each step, after the
previous optimizer step. Step k's batch was therefore sampled by the weights of step k-1 (one
step off-policy, as TRL's, verl's and prime-rl's asynchronous GRPO), and the snapshot also
computes the behaviour policy's log-probs of the sampled tokens when it generates them. GRPO's
loss takes those as `old_logps`, so the importance ratio pi_theta / pi_behaviour corrects for
the lag and the clipped objective bounds it. The first step has nothing to overlap with and is
generated at once (on-policy: the snapshot equals the weights).

Costs: a second copy of the model's weights in memory, and on a CPU the two threads share the
cores (docs/measurements/throughput.md, `python scripts/bench.py async_rollouts`). Sampling draws from
torch's global generator in the background thread while the training thread draws nothing (no
dropout), so a run repeats; the rules (workbench/resolve/rules.py) refuse it where a second
thread or copy cannot work: sharded weights (FSDP2, ZeRO-3: generation is a collective), more
than one data-parallel rank (the thread's collectives would interleave with the training's),
vLLM (its own engine), and a KL term in the reward (it reads the reference off the live model).

Resume: a checkpoint waits for the rollout in flight (`settle`) and keeps it with the policy
version that sampled it (the optimizer steps behind the weights the snapshot held); a resumed run
takes it back (`preload`) and trains on exactly what the uninterrupted run would have. Where it
cannot be taken back (a checkpoint read at another layout), `saved_state` is the data position
before it, so the resumed run generates that rollout again, with the resumed weights.

Repeatability: the training thread picks SDPA's math kernel for short CPU sequences
(workbench/models/head.py), and that choice is a process-wide flag; a snapshot forward that
overlapped it would run another kernel than one that did not, and its log-probs would differ in
the last bits from run to run. With rollouts one step ahead the training model keeps the default
kernels (`math_for_short` off), so both threads compute the same numbers whatever the timing.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Snapshot:
    """A frozen copy of the policy, refreshed from the training model's trainable weights."""

    def __init__(self, module: torch.nn.Module):
        self.module = copy.deepcopy(module)
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        for p in self.module.parameters():
            p.requires_grad_(False)
        self._mine = dict(self.module.named_parameters())

    @torch.no_grad()
    def sync(self, module: torch.nn.Module) -> None:
        live = dict(module.named_parameters())
        for n in self.names:
            self._mine[n].copy_(live[n].detach())

    # what GRPO's rollout reads from a backend
    def unwrapped(self) -> torch.nn.Module:
        return self.module

    def generation(self):
        return contextlib.nullcontext((self.module.inner, False))


class AsyncRollouts:
    def __init__(self, module: torch.nn.Module, make, data_state=None):
        """make(view, step) -> StepBatch; data_state() -> the data position to checkpoint."""
        module.math_for_short = False  # no process-wide kernel switch while the snapshot thread runs (above)
        self.snapshot = Snapshot(module)
        self.make = make
        self.data_state = data_state
        self.pending: Future | None = None
        self.version = 0  # the optimizer steps behind the weights that sampled the pending rollout
        self.saved_state = data_state() if data_state else None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")
        self.lock = threading.Lock()
        self.waited = 0.0  # seconds the training thread waited for a rollout, all steps

    def next(self, backend, step: int, more: bool, version: int = 0):
        """`version`: the optimizer steps trained so far (the weights the snapshot takes now)."""
        import time

        if self.pending is None:
            self.snapshot.sync(backend.unwrapped())
            batch = self.make(self.snapshot, step)
        else:
            t = time.perf_counter()
            batch = self.pending.result()  # re-raises what the thread raised
            self.waited += time.perf_counter() - t
            self.pending = None
        # the weights this step trains from: the next rollout samples with them while it trains
        self.snapshot.sync(backend.unwrapped())
        if self.data_state:
            self.saved_state = self.data_state()
        if more:
            self.pending, self.version = self.pool.submit(self.make, self.snapshot, step + 1), version
        return batch

    def settle(self):
        """The rollout in flight once it is done, with its policy version: (batch, version), or None
        when none is pending or it failed (the next step raises what it raised, as it would have)."""
        if self.pending is None:
            return None
        try:
            return self.pending.result(), self.version
        except Exception:  # noqa: BLE001 - re-raised by next(), where the step that needs it asks
            return None

    def preload(self, batch, version: int) -> None:
        """A rollout a checkpoint kept: the next call of next() takes it instead of generating one."""
        done: Future = Future()
        done.set_result(batch)
        self.pending, self.version = done, version

    def close(self) -> None:
        if self.pending is not None:
            self.pending.cancel()
            with contextlib.suppress(Exception):
                self.pending.result()
        self.pool.shutdown(wait=True)
