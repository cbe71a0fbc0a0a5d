"""What a compatibility rule is, and the machine it is checked on.

A rule refuses one combination of options (method x peft x backend x precision x hardware) that
cannot work, with a message naming the fix. The rules that concern one backend or one method
alone are part of its spec (`BackendSpec.rules`, workbench/backends/spec.py; `MethodSpec.rules`,
workbench/methods/spec.py), written next to its options; the rest cut across them. The table
(workbench/resolve/rules.py) checks the cross-cutting ones plus those of the run's chosen backend and
method, and writes docs/compatibility.md from all of them.

    from workbench.config.rule import Rule, device
    Rule("x-needs-gpu", {"backend": "x"}, lambda c, e: device(c) != "cuda", "backend=x needs a GPU")

A rule reads the config through the readers below (`pick` with a default), so it holds for any
config a test writes by hand, and through `Env` for what the machine offers.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workbench.config.schema import pick


@dataclass(frozen=True)
class Env:
    """What the machine offers; tests pass their own."""

    cuda: bool = False
    gpus: int = 0
    packages: frozenset = frozenset()
    hub_token: bool = False  # $HF_TOKEN is set (its value is never read here)
    capability: tuple = ()  # CUDA compute capability of device 0; () not known

    def has(self, package: str) -> bool:
        return package in self.packages


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ValueError, ImportError):  # a module blocked in sys.modules, or a broken parent
        return False


def current_env() -> Env:
    cuda = torch.cuda.is_available()
    names = ("bitsandbytes", "deepspeed", "megatron", "unsloth", "vllm", "liger_kernel", "torchao",
             "transformer_engine", "apex", "flash_attn", "flash_attn_interface")
    found = frozenset(n for n in names if _installed(n))
    token = bool(os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN"))
    return Env(cuda=cuda, gpus=torch.cuda.device_count() if cuda else 0, packages=found, hub_token=token,
               capability=tuple(torch.cuda.get_device_capability()) if cuda else ())


@dataclass(frozen=True)
class Rule:
    id: str
    covers: dict[str, str]  # axis -> value(s) the rule is about, for the docs table
    broken: Callable  # (cfg, env) -> bool
    fix: Callable | str  # message naming the fix; callable gets (cfg, env)
    why: str = ""
    # concerns this machine only (a GPU, a package, a path): with dry_run=true, or a launcher
    # that runs the job elsewhere, it warns so the run can still be planned
    machine: bool = False
    # a method's rule that holds only under backends with this BackendFacts field true (GRPO's
    # step size against a backend that counts accumulation itself); the method reads no backend
    backend_fact: str | None = None

    def message(self, cfg, env) -> str:
        return self.fix(cfg, env) if callable(self.fix) else self.fix


# -- readers: fields a rule shares with others, by their schema names with a default ------------
def device(c) -> str:
    return c.hardware.device


def backend_name(c) -> str:
    return pick(c, "backend.name", "single")


def launcher_name(c) -> str:
    return pick(c, "launcher.name", "local")


def method_name(c) -> str:
    return pick(c, "method.name", "sft")


def peft(c) -> str:
    """peft.kind: none | lora | qlora | dora."""
    return c.peft.kind


def precision(c) -> str:
    """precision.name as configured (`auto` unresolved: fp8 is only ever chosen by name)."""
    return c.precision.name


def par(c, key: str) -> int:
    """A parallel degree of the backend (backend.tp, pp, cp, ep); 1 where its options have none."""
    return int(pick(c, f"backend.{key}", 1))


def degrees(c) -> dict[str, int]:
    """The parallel degrees a run's ranks are laid out by (workbench/train/layout.py): the
    backend's tp / pp / cp / sp, 1 where its options have none."""
    return {key: par(c, key) for key in ("tp", "pp", "cp", "sp")}


def stage(c) -> int:
    return int(pick(c, "backend.stage", 0))


def rewards(c) -> list:
    return list(pick(c, "reward.functions", []) or [])
