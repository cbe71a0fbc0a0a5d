"""Training methods: one module each, with its options (`Config`), its Method class and its
`SPEC`; the list of them is workbench/methods/registry.py."""
