"""Backends: how the model is wrapped, stepped and saved. Each module defines its options
(`Config`), its Backend class and `build(cfg, ctx)`; the list of them is
workbench/backends/registry.py."""
