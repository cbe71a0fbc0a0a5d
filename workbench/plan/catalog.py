"""The hardware catalog: every profile in conf/hardware/*.yaml merged onto HardwareConfig.

Profiles may extend another (`defaults: [h100-80gb]`), as Hydra would compose them. The CPU
profile's memory is this machine's total memory, read at plan time.
"""

from __future__ import annotations

from pathlib import Path

from workbench.config.files import load_group_file

HW_DIR = Path(__file__).resolve().parents[2] / "conf" / "hardware"


def _load(name: str):
    return load_group_file("hardware", name)


def host_memory_gb() -> float:
    """This machine's total memory: what a run may count on when it has the machine to itself
    (what is free right now depends on other processes of the moment)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def memory_gb(hw) -> float:
    return float(hw.memory_gb) if hw.memory_gb else (host_memory_gb() if hw.device == "cpu" else 0.0)


def profiles() -> dict:
    """name -> HardwareConfig node, for every profile in the catalog."""
    return {p.stem: _load(p.stem) for p in sorted(HW_DIR.glob("*.yaml"))}


# Memory bandwidth per device, TB/s, from the vendors' datasheets, by the profile's accelerator
# (conf/hardware/*.yaml `accelerator`): what bounds a decode step, which reads every weight.
BANDWIDTH_TBS = {"H100": 3.35, "H200": 4.8, "B200": 8.0, "GB200": 8.0, "MI300X": 5.3, "MI325X": 6.0,
                 "Gaudi 3": 3.7, "TPU v5p": 2.76, "Trainium2": 2.9}


def bandwidth_tbs(hw) -> float:
    """The datasheet memory bandwidth of the profile's device; 0 when the catalog has none."""
    acc = str(hw.accelerator or "")
    return max((v for k, v in BANDWIDTH_TBS.items() if acc.startswith(k)), default=0.0)


def peak_tflops(hw, precision: str) -> float:
    if precision == "fp8" and hw.fp8_tflops:
        return float(hw.fp8_tflops)
    if precision == "fp32":
        return float(hw.bf16_tflops) / 2 if hw.device != "cpu" else 0.0  # TF32 tensor cores
    return float(hw.bf16_tflops)
