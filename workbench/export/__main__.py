"""`python -m workbench.export <run_dir> [step=N] [overrides]`: export a saved checkpoint again.

    python -m workbench.export runs/<run>              # export its newest valid checkpoint again
    python -m workbench.export runs/<run> step=200 export.gguf=[f16]   # a given step, more formats
    python -m workbench.export runs/<run> backend=single hardware.procs=1   # any checkpoint, on one process
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from workbench.core.errors import UserError
from workbench.train import checkpoint


def main(argv: list[str]) -> int:
    """Export a saved checkpoint without training: the run's own config (its config.yaml) with
    the checkpoint as the resume point and max_steps at its step, through the normal entry
    point, so sharded FSDP2 / DeepSpeed / Megatron checkpoints are gathered by the backend that
    wrote them (torchrun is started with the run's hardware.procs). Output:
    <run_dir>/exports/step-N/export/."""
    if not argv or argv[0] in ("-h", "--help"):
        print(main.__doc__)
        return 2
    run_dir, extra, step = Path(argv[0]).resolve(), [], None
    for a in argv[1:]:
        if a.startswith("step="):
            step = int(a.split("=", 1)[1])
        elif a.startswith("backend="):
            # the run's config.yaml is flat (no group defaults): another backend replaces the node,
            # its own options taking their defaults (every layout reads every checkpoint)
            extra += ["~backend", f"+backend.name={a.split('=', 1)[1]}"]
        else:
            extra.append(a)
    try:
        if not (run_dir / "config.yaml").exists():
            raise UserError(f"{run_dir}: no config.yaml (not a workbench run directory)")
        path = (checkpoint.ckpt_root(run_dir) / f"step-{step:08d}") if step is not None else checkpoint.latest(run_dir)
        if path is None or not path.is_dir():
            raise UserError(f"{run_dir}: no checkpoint {f'step-{step:08d}' if step is not None else 'to export'}")
        why = checkpoint.verify(path)
        if why is not None:
            raise UserError(f"{path}: not a usable checkpoint ({why})")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n = int(path.name.split("-")[1])
    cmd = [sys.executable, "-m", "workbench", "--config-path", str(run_dir), "--config-name", "config",
           f"train.resume={path}", f"train.max_steps={n}", "train.export=true", "eval.at_start=false",
           "eval.at_end=false", "eval.every_n_steps=0", f"output_dir={run_dir / 'exports' / path.name}", *extra]
    return subprocess.call(cmd)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
