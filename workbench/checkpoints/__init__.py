"""Checkpoints, resume and replay: the format (`checkpoint.py`) and the layout-free form every
layout reads (`canonical.py`), resuming at another layout (`resume.py`), what a resume may change
(`resume_changes.py`), the replay certificate (`replay.py`), the best checkpoint (`keep_best.py`),
and a run's checkpoints as the loop uses them (`run.py`)."""
