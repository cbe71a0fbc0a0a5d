"""What keeps a run safe around its steps: the judgement of each step between backward and the
update, bad steps and preemption (`faults.py`), whether gradients are finite (`finite.py`),
hangs (`watchdog.py`)."""
