"""What `dry_run=trace` (workbench/plan/trace.py) runs of a GRPO step: the rollout's longest
step and the training micro-batches it makes, at their real shape.

    python -m workbench method=grpo model=8b hardware=8xh100 backend=fsdp2 dry_run=trace

The rollout: this rank's prompts of data.seq_len tokens each (the planner's prompt length), every
completion running to method.max_new_tokens, through the backend's own `generation()` (FSDP2
gathers the root for the call and each block in its forward) and
workbench/rollout/generate.py `longest_step`: the shared prefill, the KV cache at the length of
the last decode step, that step and the sampler. Then the training micro-batches the rollout
would hand the step: each completion max_new_tokens long after its prompt, in the layout the run
trains on (one row per prompt with its completions as branches under share_prompt, where the
model takes tree rows, else one row per completion), advantages in the group shape, and the
generating policy's log-probs where the run computes them (several iterations per rollout, the
KL in the reward); the method's own loss then runs on them, its reference pass included.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from workbench.compute import precision
from workbench.data.chat import IGNORE
from workbench.methods.spec import RolloutTrace
from workbench.rollout.generate import longest_step
from workbench.train.batch import StepBatch


def spec(collate, token_logps, rollouts, batch_shape) -> RolloutTrace:
    """GRPO's MethodSpec.trace; workbench/methods/grpo.py hands in its row builders, the
    generating policy's log-probs and its shapes (so this module does not import it back)."""
    return RolloutTrace(
        untraced=untraced,
        sequences=lambda run, micro_batches: sequences(batch_shape(run.cfg.method, run.batch), run, micro_batches),
        generate=generate,
        batch=lambda method, backend, seqs, known=lambda tree: tree: batch(
            method, backend, seqs, known, collate=collate, token_logps=token_logps,
            old_logps=rollouts(method.cfg).old_logps,
            completions=batch_shape(method.cfg, method.ctx.run.batch).completions_per_rank))


def untraced(cfg) -> str | None:
    """Why a GRPO step with method options `cfg` cannot be traced, or None."""
    if cfg.engine != "hf":
        return f"method.engine={cfg.engine}: the engine's own memory (its reserved share) is not traced"
    if cfg.async_rollouts:
        return "method.async_rollouts=true: the weights' snapshot generating beside the step is not traced"
    return None


def sequences(shape, run, micro_batches: int) -> tuple[list[list[int]], list[tuple[list[int], list[int]]]]:
    """(this rank's prompts, the first `micro_batches` micro-batches' completions as (ids, labels)),
    random token ids of the planner's lengths; made before the fake mode, as plain lists.
    `shape`: the step's BatchShape (workbench/methods/grpo_rules.py)."""
    cfg = run.cfg
    gen = torch.Generator().manual_seed(0)
    vocab, seq, new = int(cfg.model.arch.vocab), int(cfg.data.seq_len), int(cfg.method.max_new_tokens)
    prompts = [torch.randint(vocab, (seq,), generator=gen).tolist() for _ in range(shape.prompts_per_rank)]
    rows = min(shape.completions_per_rank, micro_batches * int(cfg.train.micro_batch_size))
    seqs = []
    for i in range(rows):
        prompt, completion = prompts[i // shape.generations], torch.randint(vocab, (new,), generator=gen).tolist()
        seqs.append((prompt + completion, [IGNORE] * seq + completion))  # cut at max_new_tokens: no end-of-turn
    return prompts, seqs


def generate(method, backend, prompts: list[list[int]]) -> None:
    """The rollout's longest step on the backend's model (its peak is the rollout's)."""
    c, ctx = method.cfg, method.ctx
    with backend.generation() as (model, _synced):
        longest_step(model, prompts, int(c.max_new_tokens), 0, int(c.num_generations), float(c.temperature),
                     autocast=precision.autocast(ctx.run.precision, ctx.device))


def batch(method, backend, seqs: list, known, *, collate, token_logps, old_logps: bool, completions: int) -> StepBatch:
    """The micro-batches of `seqs` as the method trains on them. `known`: makes their real index
    tensors the fake mode's (workbench/plan/fake.py TraceMode.known); collated outside the fake
    mode, since the layout reads their values. `old_logps`: the run takes the generating
    policy's log-probs (a forward pass without gradient); `completions`: this rank's per step."""
    c, ctx = method.cfg, method.ctx
    mb, G = int(ctx.cfg.train.micro_batch_size), int(c.num_generations)
    gen = torch.Generator().manual_seed(1)
    micro = []
    with unset_fake_temporarily():
        for first in range(0, len(seqs), mb):
            rows = seqs[first:first + mb]
            m = collate(rows, G, first, 0, method.tree)
            m["advantages"] = torch.randn(len(rows), generator=gen)
            micro.append(m)
    micro = known(micro)
    if old_logps:
        with torch.no_grad():
            for m in micro:
                m["old_logps"] = token_logps(backend.unwrapped(), m, c.temperature).detach()
    return StepBatch(micro=micro, denom=float(completions), tokens=sum(int(m["input_ids"].numel()) for m in micro))
