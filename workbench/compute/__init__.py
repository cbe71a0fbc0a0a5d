"""The arithmetic a step runs on: precision (autocast, dtypes, what a CPU can do), the optimizer,
kernels, and FLOPs as computed."""
