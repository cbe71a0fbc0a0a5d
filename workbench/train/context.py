"""What a method or a backend receives when it is built: `Context`, the contract between the
runner and the engines it builds (workbench/methods/spec.py and workbench/backends/spec.py:
`build(options, ctx)`).

A low-level module on purpose: the engines read it without importing the run layer that makes
it (workbench/run/runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig


@dataclass(frozen=True)
class Context:
    """What methods and backends may read while they set themselves up: the resolved run
    (precision, peft, reference, layout; workbench/resolve/derive.py Run) and the tokenizer."""

    run: object
    tokenizer: object
    contract: object  # the chat contract (workbench/data/chat.py ChatContract)
    run_dir: Path

    @property
    def cfg(self) -> DictConfig:
        return self.run.cfg

    @property
    def device(self) -> str:
        return self.run.device
