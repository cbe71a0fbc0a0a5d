"""A Tinker-compatible training service (`python -m workbench.serve`, docs/guides/tinker.md).

Nothing is imported here: the service's modules (and uvicorn, starlette, the `tinker` wire
format) load only when the command runs, never with `import workbench`.
"""
