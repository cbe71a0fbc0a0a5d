"""Regenerate golden loss curves (tests/assets/losses/*.json).

    python scripts/update_golden.py            # every case in tests/golden.py
    python scripts/update_golden.py sft_lora   # just one

The only sanctioned way to change a golden file. Commit the result with the reason.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import golden  # noqa: E402


def main(names: list[str]) -> int:
    import torch

    # the mode the tests run in (tests/conftest.py): curves made in another mode need not match
    torch.use_deterministic_algorithms(True, warn_only=True)
    for name in names or list(golden.CASES):
        with tempfile.TemporaryDirectory() as tmp:
            losses = golden.run_case(name, Path(tmp))
        print(name, [round(x, 6) for x in losses], "->", golden.write(name, losses))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
