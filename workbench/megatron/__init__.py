"""Megatron-Core support: model construction from HF configs (model.py), the HF <-> Megatron
weight bridge (bridge.py) and the CPU shim (cpu_shim.py). Used by backend=megatron."""
