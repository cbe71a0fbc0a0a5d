"""Imports on the user's behalf: optional engines kept out of a process that did not choose
them (bitsandbytes out of a CLI run that quantises nothing), and a user's own
`package.module:function` (rewards, evaluation hooks) found by name.

Some libraries import an engine only because it is installed: transformers' `save_pretrained`
calls accelerate's `extract_model_from_parallel`, which imports DeepSpeed (and DeepSpeed prints
an accelerator warning and spends a second on import) just to test `isinstance` against its
engine class. `hidden("deepspeed")` makes such probes answer "not installed" for the duration
of a block, unless the engine is already imported because the run chose it.

    with hidden("deepspeed"):
        model.save_pretrained(path)
    import_without_incidentals("transformers.modeling_utils")  # without scipy and boto3 (INCIDENTAL)
    skip_bitsandbytes(needs_bitsandbytes(cfg))                 # in the CLI's Hydra job, before the run
    fn = user_function("mypkg.rewards:brevity", "reward")   # UserError naming `reward` if absent
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from workbench.core.errors import UserError


@contextmanager
def hidden(*names: str):
    # A None entry in sys.modules makes `import` raise ImportError and
    # importlib.util.find_spec answer None, which is what "not installed" checks read.
    hide = [n for n in names if n not in sys.modules]
    for n in hide:
        sys.modules[n] = None
    try:
        yield
    finally:
        for n in hide:
            if n in sys.modules and sys.modules[n] is None:
                del sys.modules[n]


# Packages that transformers, accelerate and tensorboard import whenever they are installed, for
# features no run here uses: scipy (transformers' object-detection losses; installed for optuna,
# the sweeper) and boto3 (accelerate's SageMaker config, tensorboard's s3:// log dirs; installed
# for runpod, a launcher). Together about 0.3 s of every launch's start-up; the sweeper and the
# launcher still import them as usual when chosen.
INCIDENTAL = ("scipy", "boto3")


def import_without_incidentals(module: str):
    """`module`, imported with INCIDENTAL hidden unless it is already imported."""
    import importlib

    if module in sys.modules:
        return sys.modules[module]
    with hidden(*INCIDENTAL):
        return importlib.import_module(module)


def skip_bitsandbytes(needed: bool) -> None:
    """peft imports bitsandbytes whenever it is installed, and bitsandbytes imports
    torch._inductor: about a second before the first step of a run that quantises nothing.
    A single command-line job that is not QLoRA (`needed`: workbench/run/derive.py
    needs_bitsandbytes) hides it for the rest of the process; a multirun may still reach QLoRA
    in this process, and run_job called from Python leaves the process as it is (only the CLI
    calls this)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if needed or "peft" in sys.modules or "bitsandbytes" in sys.modules:
        return
    if HydraConfig.get().mode != RunMode.RUN:
        return
    sys.modules["bitsandbytes"] = None  # import raises ImportError; find_spec answers None


def user_function(spec: str, field: str):
    """The callable `package.module:function` names; a UserError naming `field` otherwise."""
    import importlib


    mod_name, _, fn_name = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise UserError(f"{field}: cannot import module {mod_name!r} for {spec!r}: {exc}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise UserError(f"{field}: module {mod_name!r} has no function {fn_name!r}")
    return fn
