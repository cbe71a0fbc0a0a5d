"""Megatron-Core support: model construction from HF configs (model.py), the HF <-> Megatron
weight bridge (bridge.py), the attention core (attention.py) and the CPU shim (cpu_shim.py).
Used by backend=megatron."""
