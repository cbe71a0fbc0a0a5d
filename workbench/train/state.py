"""TrainState: the small, explicit state the loop advances (and a checkpoint restores)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    samples_seen: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def rng_state() -> dict:
    """Every RNG this process draws from (python, numpy, torch CPU and CUDA)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    v, internal, g = state["python"]
    random.setstate((v, tuple(internal), g))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
