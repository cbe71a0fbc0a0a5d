"""Python's cyclic garbage collector, paused while a command-line launch imports and loads.

Importing torch, transformers and peft and building the model create about 800k Python objects
(modules, classes, functions). CPython's collector runs a full pass over everything young each
time the allocation count crosses its thresholds, so during start-up it walks that growing heap
again and again: about 0.7 s of a ~6 s launch to the first step on a 2-core CPU, finding only
small cycles (a full pass at the first step frees ~50k objects and no measurable memory).

    python -m workbench         # __main__ calls pause() before the first import
    Runner.run                  # training(): before the first step
    cli._hydra_main             # after_job(): when the job returns, however it ends

At the first step the objects made so far move to the collector's permanent generation
(`gc.freeze`), so the collector runs again without rescanning them on every later pass; when
the job ends they go back (`gc.unfreeze`), so a multirun's next job in the same process can
still free the previous job's model. Code that imports the runner without `python -m workbench`
(tests, notebooks) never pauses, and the other two calls then do nothing.

Measured with `python scripts/bench.py startup`: the bare import line goes 4.5 -> 3.8 s with the
collector paused (3.3-3.4 s with workbench/core/imports.py's INCIDENTAL hidden as well).
"""

from __future__ import annotations

import gc
import time

_paused = False
_frozen = False
_started: float | None = None  # when this launch's job began (time.time()); None outside `python -m workbench`


def started() -> float | None:
    """When the current command-line job began: the process start (pause(), before the imports),
    or for a multirun's later jobs the end of the one before. What report.md's wall time counts
    from (conversion, training, export and the parity gate: the whole job). None for code that
    runs the runner without `python -m workbench`."""
    return _started


def pause() -> None:
    global _paused, _started
    _started = time.time()
    if gc.isenabled():
        gc.disable()
        _paused = True


def training() -> None:
    """The first step is about to run: freeze what start-up made and collect again."""
    global _paused, _frozen
    if _paused:
        gc.freeze()
        gc.enable()
        _paused, _frozen = False, True


def after_job() -> None:
    """The job is over (or never trained: a dry run, a remote launch, an error)."""
    global _paused, _frozen, _started
    if _started is not None:  # a multirun's next job, if any, starts now
        _started = time.time()
    if _frozen:
        gc.unfreeze()
        _frozen = False
    if _paused:
        gc.enable()
        _paused = False
