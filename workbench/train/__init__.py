"""The parts of a training step the backends, methods and runner share: checkpoints
(checkpoint.py), preemption and bad-step handling (faults.py), train state and RNG (state.py), the
step's batch (batch.py), optimizer and schedule (optim.py), precision policies (precision.py),
fused kernels (kernels.py), process groups (distributed.py), the best evaluated checkpoint
(keep_best.py). The loop that drives them is workbench/run/runner.py."""
