"""Where a run executes: `dispatch.py` chooses (here, under torchrun, or a launcher's module);
torchrun, Slurm, Ray, Modal and RunPod each have a module; `sweep.py` summarises a multirun."""
