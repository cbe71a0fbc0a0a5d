"""Imports on the user's behalf: optional engines kept out of a process that did not choose
them (bitsandbytes out of a CLI job that quantises nothing), and a user's own
`package.module:function` (rewards, evaluation hooks) found by name.

Some libraries import an engine only because it is installed: transformers' `save_pretrained`
calls accelerate's `extract_model_from_parallel`, which imports DeepSpeed (and DeepSpeed prints
an accelerator warning and spends a second on import) just to test `isinstance` against its
engine class. `hidden("deepspeed")` makes such probes answer "not installed" for the duration
of a block, unless the engine is already imported because the run chose it.

    with hidden("deepspeed"):
        model.save_pretrained(path)
    import_without_incidentals("transformers.modeling_utils")  # without scipy and boto3 (INCIDENTAL)
    skip_bitsandbytes(needs_bitsandbytes(cfg))                 # in the CLI's Hydra job, before each job
    quiet_bitsandbytes()                                       # before anything imports bitsandbytes
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
    """peft imports bitsandbytes whenever it is installed (peft.helpers), and bitsandbytes imports
    torch._inductor and, on a CPU with AVX512-BF16, logs a warning about an optional kernel (see
    quiet_bitsandbytes): about a second and a warning line before the first step of a run that
    quantises nothing. Called by the CLI's Hydra job before each job with `needed` from
    workbench/resolve/derive.py needs_bitsandbytes: a job that is not QLoRA hides bitsandbytes
    unless an earlier job of this process imported it; a QLoRA job after one that hid it (a
    multirun in one process) brings it back. run_job called from Python leaves the process as it
    is (only the CLI calls this)."""
    if needed:
        if "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is None:
            del sys.modules["bitsandbytes"]
            _forget_bitsandbytes_probes()
        return
    if "bitsandbytes" not in sys.modules:
        sys.modules["bitsandbytes"] = None  # import raises ImportError; find_spec answers None


def _forget_bitsandbytes_probes() -> None:
    """peft and transformers cache whether bitsandbytes is installed (functools.lru_cache): an
    answer given while it was hidden would keep peft from dispatching to its 4-bit layers."""
    probes = (("peft.import_utils", ("is_bnb_available", "is_bnb_4bit_available")),
              ("transformers.utils.import_utils", ("is_bitsandbytes_available",)))
    for module, names in probes:
        mod = sys.modules.get(module)
        for name in names:
            clear = getattr(getattr(mod, name, None), "cache_clear", None)
            if clear is not None:
                clear()


class _OptionalKernelNotice:
    """Drops bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" record.

    On a CPU with AVX512-BF16, bitsandbytes' CPU backend (bitsandbytes/backends/cpu/ops.py) tries
    at import to fetch an optional fused 4-bit GEMM from the `kernels` package (a Hub download)
    and logs a warning when that package is absent. Nothing is lost: without it the same op runs
    the bundled C library's 4-bit GEMV (gemv_4bit_inference_cpu_nf4_bf16), and that op serves only
    4-bit weights repacked for CPU inference, which this workbench never makes (workbench/peft/
    lora.py quantize_nf4 turns the repacking off). The line is not the user's to act on."""

    def filter(self, record) -> bool:
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


def quiet_bitsandbytes() -> None:
    """Before bitsandbytes is imported (by peft or by workbench/peft/lora.py): keep its optional-kernel
    notice (_OptionalKernelNotice) off the console and the logs; its other records pass."""
    import logging

    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _OptionalKernelNotice) for f in log.filters):
        log.addFilter(_OptionalKernelNotice())


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
