"""Runs several short trainings in one torchrun job, so the 2-process tests pay for process start,
imports and the process group once.

    torchrun --nproc_per_node=2 tests/distributed/_worker.py SPEC.json

SPEC.json: {"runs": [{"name": ..., "overrides": [...], "dir": optional}, ...], "out": DIR}. Each
run's output_dir is DIR/<dir or name> (two runs sharing a dir: the second resumes the first);
results go to DIR/results/<name>.rank<r>.json: losses, grad norms, what the backend wrapped the
model in, the bytes of parameters and optimizer state this rank held after training, and the
run's wall seconds (where a job's time goes); with "save_trainable": true, rank 0 also writes the
HF model's trainable tensors after training to DIR/<name>/trainable.safetensors. Two observations of options whose losses do not
show them:
- block_calls (backend=fsdp2): how many times each decoder block's forward started (a forward
  pre-hook: the recomputation stops early, once it has what backward needs, so a hook at the end
  of forward would not see it). A block under activation checkpointing runs its forward again
  in the backward pass, so its count doubles.
- saves: for each checkpoint, whether its directory was on disk when `checkpoint.save` returned
  and whether it was on disk once the run finished. An async save returns before its shards are written
  and is committed later, by `checkpoint.flush`; a synchronous one is on disk at once.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402


def held_bytes(backend) -> dict[str, int]:
    if hasattr(backend, "local_bytes"):
        return backend.local_bytes()
    params = sum(p.numel() * p.element_size() for p in backend.unwrapped().parameters())
    optim = sum(t.numel() * t.element_size() for s in backend.optimizer.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    return {"params": params, "optimizer": optim}


BLOCK_CALLS: list[int] = []
SAVES: list[dict] = []


def observe() -> None:
    """Count decoder-block forwards under backend=fsdp2 and record when checkpoints reach the disk."""
    from workbench.backends import fsdp2
    from workbench.checkpoints import checkpoint

    wrap, save = fsdp2.FSDP2Backend.wrap, checkpoint.save

    def counting_wrap(self, model, ctx):
        wrap(self, model, ctx)
        BLOCK_CALLS[:] = [0] * len(fsdp2.decoder_blocks(model))
        for i, block in enumerate(fsdp2.decoder_blocks(model)):
            block.register_forward_pre_hook(lambda *_, i=i: BLOCK_CALLS.__setitem__(i, BLOCK_CALLS[i] + 1))

    def recorded_save(*args, **kwargs):
        path = save(*args, **kwargs)
        SAVES.append({"path": str(path), "on_disk_at_return": Path(path).is_dir()})
        return path

    fsdp2.FSDP2Backend.wrap, checkpoint.save = counting_wrap, recorded_save


def main(spec_path: str) -> None:
    from tests.conftest import compose
    from workbench.run.runner import Runner

    torch.use_deterministic_algorithms(True, warn_only=True)
    observe()
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    for run in spec["runs"]:
        out = Path(spec["out"]) / run.get("dir", run["name"])
        result: dict = {}
        start = time.perf_counter()
        BLOCK_CALLS.clear()
        SAVES.clear()
        try:
            runner = Runner(compose(run["overrides"], out))
            res = runner.train()
            result = {"losses": res["losses"], "grad_norms": [r.get("grad_norm") for r in runner.tracker.rows]
                      if runner.is_main else [], "bytes": held_bytes(runner.backend),
                      "resumed_from": res["resumed_from"], "export": res.get("export"),
                      "wrapper": type(getattr(runner.backend, "ddp", None) or runner.backend.unwrapped()).__name__,
                      "block_calls": list(BLOCK_CALLS),
                      "saves": [{**s, "on_disk_after_run": Path(s["path"]).is_dir()} for s in SAVES]}
            if run.get("save_trainable") and rank == 0:
                from safetensors.torch import save_file

                save_file({k: v.detach().contiguous() for k, v in runner.model.named_parameters() if v.requires_grad},
                          out / "trainable.safetensors")
        except Exception as exc:  # recorded for the test to show; later runs still go ahead
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - start, 2)
        runner = res = None
        gc.collect()  # engines of finished runs hold buffers; free them before the next run
        where = Path(spec["out"]) / "results"
        where.mkdir(parents=True, exist_ok=True)
        (where / f"{run['name']}.rank{rank}.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
