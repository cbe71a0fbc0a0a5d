"""`python -m workbench.export <run_dir> [step=N] [overrides]`: export a saved checkpoint again.

`--help` prints the usage (status 0); no run directory, a step that is not a number or a
checkpoint that is not there is one `error:` line (status 2), naming the steps there are.

    python -m workbench.export runs/<run>              # export its newest valid checkpoint again
    python -m workbench.export runs/<run> step=200 export.gguf=[f16]   # a given step, more formats
    python -m workbench.export runs/<run> backend=single hardware.procs=1   # any checkpoint, on one process
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

from workbench.checkpoints import checkpoint
from workbench.core.errors import UserError

USAGE = "usage: python -m workbench.export <run_dir> [step=N] [key=value ...]"


def _steps(run_dir: Path) -> str:
    """The committed checkpoint steps of a run, for the error that names a missing one."""
    steps = sorted(int(p.name.split("-")[1]) for p in checkpoint.ckpt_root(run_dir).glob("step-*")
                   if p.is_dir() and p.name.split("-")[1].isdigit())
    return f"steps saved: {', '.join(map(str, steps))}" if steps else "it holds no checkpoint"


def main(argv: list[str]) -> int:
    """Export a saved checkpoint without training: the run's own config (its config.yaml) with
    the checkpoint as the resume point and max_steps at its step, through the normal entry
    point, so sharded FSDP2 / DeepSpeed / Megatron checkpoints are gathered by the backend that
    wrote them (torchrun is started with the run's hardware.procs). Output:
    <run_dir>/exports/step-N/export/."""
    if any(a in ("-h", "--help") for a in argv):
        print(f"{USAGE}\n\n{inspect.cleandoc(main.__doc__)}\n\n{inspect.cleandoc(__doc__)}")
        return 0
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        print(f"{USAGE}\nerror: the first argument is the run directory to export from", file=sys.stderr)
        return 2
    run_dir, extra, step = Path(argv[0]).resolve(), [], None
    for a in argv[1:]:
        if a.startswith("step="):
            value = a.split("=", 1)[1]
            if not value.isdigit():
                print(f"error: step={value!r}: a checkpoint's step number; {_steps(run_dir)}", file=sys.stderr)
                return 2
            step = int(value)
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
            raise UserError(f"{run_dir}: no checkpoint {f'at step {step}' if step is not None else 'to export'}; "
                            f"{_steps(run_dir)}")
        why = checkpoint.verify(path)
        if why is not None:
            raise UserError(f"{path}: not a usable checkpoint ({why})")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n = int(path.name.split("-")[1])
    out = run_dir / "exports" / path.name
    # hydra.run.dir: the run's config.yaml has no hydra section, and Hydra's own default would
    # leave ./outputs/<date>/<time>/ (its .hydra/ and log) wherever the command was typed
    cmd = [sys.executable, "-m", "workbench", "--config-path", str(run_dir), "--config-name", "config",
           f"train.resume={path}", f"train.max_steps={n}", "train.export=true", "eval.at_start=false",
           "eval.at_end=false", "eval.every_n_steps=0", "eval.tasks=[]",
           # this checkpoint is what is exported: no evaluation, so no best to keep or export instead
           "train.keep_best=null", "train.export_best=false",
           f"output_dir={out}", f"hydra.run.dir={out}", *extra]
    code = subprocess.call(cmd)
    if code == 0:
        print(f"exported step {n}: {out / 'export'}")
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
