"""Layout-free randomness: random draws keyed by what they are for, not by which rank draws them.

    g = noise.generator(seed, step, sample, generation)    # a torch.Generator of its own
    noise.seed_micro(seed, step, first_sample)             # the global generator, for a micro-batch's dropout

A process-wide generator hands out numbers in the order the process asks for them, so what a
draw gets depends on how many draws this rank made before: on 1 rank a prompt's completions
follow the other prompts' and on 2 ranks they do not. A generator seeded by (train.seed, step,
global sample index, generation index) gives the same numbers to the same completion on any
number of ranks, which is what lets a run move to another world size and still sample the same
completions (workbench/rollout/generate.py) and draw the same dropout masks
(workbench/backends/step.py).
"""

from __future__ import annotations

import hashlib

import torch


def key(*parts) -> int:
    """A 63-bit seed from the parts (stable across processes, Python versions and machines)."""
    digest = hashlib.blake2b("/".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator(*parts, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(key(*parts))


def seed_micro(seed: int, step: int, first_sample: int) -> None:
    """Seed the global generator for the micro-batch whose first row is global sample `first_sample`
    of step `step`: dropout inside its forward then draws the same masks at any world size (the
    micro-batch holds the same rows whichever rank runs it)."""
    torch.manual_seed(key(seed, step, first_sample, 1 << 20))
