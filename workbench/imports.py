"""Optional engines stay out of a process that did not choose them.

Some libraries import an engine only because it is installed: transformers' `save_pretrained`
calls accelerate's `extract_model_from_parallel`, which imports DeepSpeed (and DeepSpeed prints
an accelerator warning and spends a second on import) just to test `isinstance` against its
engine class. `hidden("deepspeed")` makes such probes answer "not installed" for the duration
of a block, unless the engine is already imported because the run chose it.

    with hidden("deepspeed"):
        model.save_pretrained(path)
"""

from __future__ import annotations

import sys
from contextlib import contextmanager


@contextmanager
def hidden(*names: str):
    # A None entry in sys.modules makes `import` raise ImportError and
    # importlib.util.find_spec answer None, which is what "not installed" checks read.
    hide = [n for n in names if n not in sys.modules]
    for n in hide:
        sys.modules[n] = None
    try:
        yield
    finally:
        for n in hide:
            if n in sys.modules and sys.modules[n] is None:
                del sys.modules[n]
