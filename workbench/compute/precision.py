"""Precision policies: which dtype parameters live in, what matmuls run in, and loss scaling.

| name        | trainable params | frozen params | compute          | loss scaling |
|-------------|------------------|---------------|------------------|--------------|
| fp32        | fp32             | fp32          | fp32             | no           |
| bf16        | bf16             | bf16          | bf16             | no           |
| bf16-mixed  | fp32 (master)    | bf16          | bf16 autocast    | no           |
| fp16        | fp32 (master)    | fp16          | fp16 autocast    | dynamic      |
| fp8         | fp32 (master)    | bf16          | fp8 GEMMs in blocks | no (GPU only, sm>=8.9: torchao float8, else TE) |

Frozen weights (a LoRA base) need no fp32 master copy, so mixed modes keep them in the half
dtype: less memory and no cast on every forward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from workbench.core.errors import missing_package


@dataclass(frozen=True)
class Policy:
    name: str
    load_dtype: torch.dtype  # dtype the base weights are loaded in
    trainable_dtype: torch.dtype
    frozen_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    loss_scaling: bool
    fp8: str = ""  # fp8 only: torchao | transformer_engine (the installed library; "" when planning)

    @property
    def compute_dtype(self) -> torch.dtype:
        """What matmuls run in: the autocast dtype, else the parameters' own."""
        return self.autocast_dtype or self.trainable_dtype

    def bytes(self, which: str) -> int:
        """Bytes per element of `trainable`, `frozen`, `load` or `compute` values (the planner's tables)."""
        return {"trainable": self.trainable_dtype, "frozen": self.frozen_dtype, "load": self.load_dtype,
                "compute": self.compute_dtype}[which].itemsize


POLICIES = {
    "fp32": Policy("fp32", torch.float32, torch.float32, torch.float32, None, False),
    "bf16": Policy("bf16", torch.bfloat16, torch.bfloat16, torch.bfloat16, None, False),
    "bf16-mixed": Policy("bf16-mixed", torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16, False),
    "fp16": Policy("fp16", torch.float16, torch.float32, torch.float16, torch.float16, True),
    # fp8 GEMMs inside bf16 autocast; which library runs them is chosen by policy()
    "fp8": Policy("fp8", torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16, False),
}


def fp8_backend() -> str:
    """Which fp8 training library is installed: torchao float8 first, then Transformer Engine."""
    import importlib.util

    if importlib.util.find_spec("torchao") is not None:
        return "torchao"
    if importlib.util.find_spec("transformer_engine") is not None:
        return "transformer_engine"

    raise missing_package("torchao")


def cpu_bf16_units() -> str:
    """Which bf16 matmul instructions this CPU has: "AMX", "AVX512-BF16" or "" (none).

    WORKBENCH_CPU_BF16=0|1 overrides the detection for tests, so one machine can run the suite
    under both resolutions of `precision=auto` (it changes the choice, not the arithmetic: bf16
    runs on every x86 CPU, emulated where the instructions are missing)."""
    import os

    forced = os.environ.get("WORKBENCH_CPU_BF16")
    if forced is not None:
        return "AVX512-BF16 (WORKBENCH_CPU_BF16=1)" if forced == "1" else ""
    # oneDNN, which runs the bf16 matmuls, capped below AVX-512 BF16 (ONEDNN_MAX_CPU_ISA=AVX2: how
    # docs/testing.md emulates an AVX2-only CPU) has no bf16 instructions either, whatever the CPU has
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if isa and isa != "ALL" and "BF16" not in isa and "AMX" not in isa:
        return ""
    if torch.cpu._is_amx_tile_supported():
        return "AMX"
    if torch.cpu._is_avx512_bf16_supported():
        return "AVX512-BF16"
    return ""


def choose(device: str) -> tuple[str, str]:
    """What `precision=auto` trains in on `device`, and why.

    bf16-mixed where the device multiplies bf16 in hardware: CUDA GPUs that support it (a GPU
    profile planned from elsewhere is taken to, as every listed one does), and CPUs with AMX or
    AVX512-BF16. Elsewhere autocast emulates bf16 with conversions around fp32 arithmetic: on an
    AVX-512 CPU without BF16 a SmolLM2-135M LoRA step took 7.2 s in bf16-mixed against 2.2 s in
    fp32, so fp32 is both faster and exact there (pre-bf16 GPUs get fp16 with loss scaling)."""
    if device == "cpu":
        units = cpu_bf16_units()
        if units:
            return "bf16-mixed", f"this CPU multiplies bf16 in hardware ({units})"
        return "fp32", "this CPU has no bf16 matmul instructions (AMX, AVX512-BF16): fp32 is faster"
    if device == "cuda" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return "fp16", "this GPU has no bf16 support"
    return "bf16-mixed", f"{device} multiplies bf16 in hardware"


def describe(chosen: str, auto_why: str | None) -> str:
    """The line a run starts with, so a user knows which column of the precision matrix
    (docs/precision-matrix.md) they are in: "precision: bf16-mixed (auto: this CPU multiplies
    bf16 in hardware (AVX512-BF16))", or "precision: fp32 (set)". `auto_why`: choose()'s reason
    when the config said auto (the resolved run's summary), else None."""
    return f"precision: {chosen} ({'auto: ' + auto_why if auto_why else 'set'})"


def spec(name: str) -> Policy:
    """The policy's dtypes, whatever this machine has (the planner, rules, dry runs)."""
    return POLICIES[name]


def policy(name: str) -> Policy:
    """The policy a run trains with. Whether this machine can run it (fp8 needs sm >= 8.9 and
    torchao or Transformer Engine) is a rule in workbench/resolve/rules.py, checked before this."""
    if name == "fp8":
        from dataclasses import replace

        return replace(POLICIES["fp8"], fp8=fp8_backend())
    return POLICIES[name]


def _fp8_eligible(fqn: str, mod: torch.nn.Module) -> bool:
    # Decoder-block Linears whose dims fp8 GEMMs accept (multiples of 16); the head and the
    # embeddings stay bf16, where fp8's range costs the most accuracy.
    return (isinstance(mod, torch.nn.Linear) and "layers." in fqn and "lora_" not in fqn
            and mod.in_features % 16 == 0 and mod.out_features % 16 == 0)


def apply_fp8(model: torch.nn.Module, pol: Policy) -> int:
    """Swap the eligible Linears for fp8-training ones; returns how many were swapped."""
    if pol.fp8 == "torchao":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda m, fqn: _fp8_eligible(fqn, m))
        return sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")
    import transformer_engine.pytorch as te

    n = 0
    for fqn, mod in list(model.named_modules()):
        if not _fp8_eligible(fqn, mod):
            continue
        parent, child = fqn.rsplit(".", 1)
        new = te.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None,
                        params_dtype=mod.weight.dtype, device=mod.weight.device)
        with torch.no_grad():
            new.weight.copy_(mod.weight)
            new.weight.requires_grad_(mod.weight.requires_grad)
            if mod.bias is not None:
                new.bias.copy_(mod.bias)
        setattr(model.get_submodule(parent), child, new)
        n += 1
    return n


def cast_params(model: torch.nn.Module, pol: Policy) -> None:
    """Put trainable and frozen floating-point parameters into the policy's dtypes."""
    for p in model.parameters():
        if not p.is_floating_point() or type(p).__name__ == "Params4bit":
            continue  # packed 4-bit weights stay as they are, whatever their storage dtype
        want = pol.trainable_dtype if p.requires_grad else pol.frozen_dtype
        if p.dtype != want:
            p.data = p.data.to(want)


def autocast(pol: Policy, device: str):
    if pol.autocast_dtype is None:
        return contextlib.nullcontext()
    if pol.fp8 == "transformer_engine":  # TE's fp8 GEMMs run only inside its own autocast
        import transformer_engine.pytorch as te

        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(device_type=device, dtype=pol.autocast_dtype))
        stack.enter_context(te.fp8_autocast(enabled=True))
        return stack
    return torch.autocast(device_type=device, dtype=pol.autocast_dtype)
