"""`torchrun ... tests/distributed/fault_entry.py <overrides>`: the workbench's command line under
the user's own torchrun, with one fault the command line cannot ask for injected first.

    WB_TEST_FAULT=disk_full_rank0   # rank 0's checkpoint listing (the checksums) hits a full disk
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

if os.environ.get("WB_TEST_FAULT") == "disk_full_rank0" and os.environ.get("RANK") == "0":
    from workbench.checkpoints import checkpoint

    def _full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    checkpoint._inventory = _full

from workbench.cli import main  # noqa: E402

sys.argv = ["workbench", *sys.argv[1:]]
main()
