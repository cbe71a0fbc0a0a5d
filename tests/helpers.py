"""Helpers shared by several test modules (the shared fixtures are in tests/conftest.py).

- data: the tiny model's tokenizer and chat contract, a data config, the data assets
- preference pairs and GRPO completions that the TRL comparisons share, a perturbed reference
- processes: a free port, the environment of CPU workers, torchrun jobs (the 2-rank tests),
  `python -m workbench` processes and the losses they log
"""

from __future__ import annotations

import copy
import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA_ASSETS = ROOT / "tests" / "assets" / "data"
DPO_PAIRS = ROOT / "data_recipes" / "data" / "arith_dpo_train.jsonl"


# -- data -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    """(tokenizer, chat contract) of model=tiny (SmolLM2's tokenizer)."""
    from tests.conftest import compose
    from workbench.data import chat
    from workbench.models.load import load_tokenizer

    tok = load_tokenizer(compose([]).model)
    return tok, chat.setup_tokenizer(tok)


def data_cfg(tmp_path, **kw):
    base = dict(seq_len=256, on_bad_row="error", cache=True, cache_dir=str(tmp_path / "cache"))
    return SimpleNamespace(**{**base, **kw})


def source(name, fmt="auto", **kw):
    from workbench.data.recipes import Source

    return Source(name=name, path=DATA_ASSETS / name, format=fmt, **kw)


# -- preference pairs, completions, models --------------------------------------------------
def dpo_pairs(tiny, n=3, two_digit_chosen=False) -> list:
    """The first `n` shipped arithmetic pairs. two_digit_chosen: equal chosen lengths (TRL's batch
    token-mean NLL is then our mean of per-pair means)."""
    from workbench.data.preference import pairs_from_rows

    rows = [json.loads(line) for line in DPO_PAIRS.read_text().splitlines()]
    if two_digit_chosen:
        rows = [r for r in rows if len(r["chosen"]) == 2]
    return pairs_from_rows(rows[:n], tiny.tok, tiny.contract)


def varied_pairs(tiny, n=8) -> list:
    """Shipped pairs; every other prompt lengthened so prompts differ in length too."""
    from workbench.data.chat import prompt_ids
    from workbench.data.preference import Pair, preference_row, tokenise_completion

    rows = [json.loads(line) for line in DPO_PAIRS.read_text().splitlines()[:n]]
    out = []
    for i, row in enumerate(rows):
        row = copy.deepcopy(row)
        row["prompt"][0]["content"] += " Think first." * (i % 3)
        p, c, r = preference_row(row, f"row {i}")
        ids = prompt_ids(tiny.tok, p)
        out.append(Pair(tokenise_completion(tiny.tok, tiny.contract, p, c, ids),
                        tokenise_completion(tiny.tok, tiny.contract, p, r, ids), len(ids)))
    assert len({p.prompt_len for p in out}) > 1
    assert len({len(p.chosen[0]) - p.prompt_len for p in out} | {len(p.rejected[0]) - p.prompt_len for p in out}) > 2
    return out


G, MAX_NEW = 4, 8  # GRPO group size and completion budget of the TRL comparisons


def grpo_completions(tok, eot):
    """Two prompts x G completions of different lengths; some stopped (end-of-turn), some cut at MAX_NEW."""
    texts = ["12", "3 4", "five six seven eight nine ten eleven", "7", "", "99 bottles of beer on the wall", "1",
             "x"]
    out = []
    for t in texts:
        ids = tok(t, add_special_tokens=False)["input_ids"][:MAX_NEW]
        out.append(ids + ([eot] if len(ids) < MAX_NEW else []))
    return out


def perturbed_model(path, seed: int = 3, scale: float = 0.05):
    """The saved model at `path` with N(0, scale) added to every weight: a reference that differs
    from the policy, so log-ratios, rewards and the KL are not zero."""
    import torch
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for prm in ref.parameters():
            prm.add_(scale * torch.randn_like(prm))
    return ref


class TorchLogProb:
    """The math of TRL's Triton `ChunkedLogProbFunction` in plain torch (Triton is absent on CPU builds).

    TRL's trainers call it through their fused LM head for per-token log-probs; everything around it
    (batching, masks, reference handling, the loss) stays TRL's own code.
    """

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs):
        import torch

        z = hidden @ weight.t() + (bias if bias is not None else 0)
        z = z.float() * logit_scale
        if softcap:
            z = softcap * torch.tanh(z / softcap)
        logp = torch.log_softmax(z / temperature, dim=-1)
        lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        p = logp.exp()
        return (lp,
                (-(p * logp).sum(-1)).detach() if "entropy" in outputs else None,
                torch.log((p * p).sum(-1)).detach() if "log_sum_sq_probs" in outputs else None,
                z.mean(-1).detach() if "mean_logits" in outputs else None,
                (z.argmax(-1) == targets) if "is_top1" in outputs else None)


# -- processes ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_env() -> dict:
    """The environment of a CPU worker process: one thread each, DeepSpeed on CPU, the repo importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": str(ROOT)}


def torchrun(script: Path, args: list[str], timeout: int, python_flags: tuple[str, ...] = (), procs: int = 2) -> str:
    """`python -m torch.distributed.run` with `procs` processes on loopback; the job must succeed. Its output."""
    cmd = [sys.executable, *python_flags, "-m", "torch.distributed.run", f"--nproc_per_node={procs}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script), *map(str, args)]
    proc = subprocess.run(cmd, env=dist_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def worker_jobs(jobs: dict[str, list[tuple[str, list[str]]]], out: Path, timeout: int) -> dict[str, dict]:
    """Each job's runs, (name, overrides), in one torchrun job of 2 processes
    (tests/distributed/_worker.py) under `out/<job>`: name -> rank 0's result, or {"error": ...}.
    Unlike `worker_job`, a job that dies keeps its finished runs' results and the next job still
    runs: the matrices (tests/precision_matrix.py, scripts/family_matrix.py) record failures."""
    results: dict[str, dict] = {}
    for tag, runs in jobs.items():
        if not runs:
            continue
        where = Path(out) / tag
        where.mkdir(parents=True, exist_ok=True)
        spec = where / "spec.json"
        spec.write_text(json.dumps({"out": str(where), "runs": [{"name": n, "overrides": o} for n, o in runs]}))
        try:
            torchrun(ROOT / "tests" / "distributed" / "_worker.py", [spec], timeout)
        except AssertionError as exc:  # the job died: its finished runs keep their results
            failed = " ".join(str(exc)[-600:].split())
        else:
            failed = ""
        for name, _ in runs:
            f = where / "results" / f"{name}.rank0.json"
            results[name] = json.loads(f.read_text()) if f.exists() else {"error": f"job ended first: {failed}"}
    return results


def one_error_line(args: list[str], timeout: int = 600) -> tuple[str, str]:
    """`python -m workbench ARGS` run to its failure: it must exit non-zero with exactly one
    `error:` line on its console. That line, and the whole console."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "WORKBENCH_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "workbench", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    errors = [x for x in log.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, log[-4000:]
    return errors[0], log


def write_jsonl(path, rows):
    """`rows` as a JSONL file at `path` (a test's own data); returns the path."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def ov(*items: str, steps: int = 3) -> list[str]:
    """Overrides of a short run for tests/distributed/_worker.py jobs."""
    return [*items, f"train.max_steps={steps}", "++hardware.timeout_minutes=4"]


def worker_job(runs: list[dict], out: Path, timeout: int = 900, procs: int = 2) -> dict[str, dict]:
    """Run `runs` in one torchrun job of `procs` ranks (tests/distributed/_worker.py); name ->
    rank 0's results, with rank r's under "rank<r>"."""
    spec = out / "spec.json"
    out.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"out": str(out), "runs": runs}))
    torchrun(ROOT / "tests" / "distributed" / "_worker.py", [spec], timeout, procs=procs)
    results = {}
    for run in runs:
        ranks = [json.loads((out / "results" / f"{run['name']}.rank{r}.json").read_text()) for r in range(procs)]
        for r, res in enumerate(ranks):
            assert "error" not in res, f"{run['name']} rank {r}: {res.get('traceback', res.get('error'))}"
        results[run["name"]] = {**ranks[0], **{f"rank{r}": res for r, res in enumerate(ranks) if r}}
    return results


def close(a, b, rtol=None):
    """Two loss curves of the same run in another summation order (tests/tolerances.py): LOSS_RTOL,
    and NEAR_ZERO_ATOL for on-policy GRPO losses near 0."""
    from tests.tolerances import LOSS_RTOL, NEAR_ZERO_ATOL

    assert len(a) == len(b), (a, b)
    assert a == pytest.approx(b, rel=LOSS_RTOL if rtol is None else rtol, abs=NEAR_ZERO_ATOL), (a, b)


def sgd_weight_bound(run_dir: Path, weights: dict) -> float:
    """How far plain SGD's weights may drift between two summation orders of the same run: each
    step moves a weight by lr * g, where g's error is <= SUM_ULPS of the largest gradient element
    (itself <= the step's gradient norm, read from metrics.jsonl), and rounds the new weight
    once (1 ulp of the largest weight). A weight bridged to the wrong place, or not bridged
    back, differs by its own size, far beyond this."""
    from tests.tolerances import EPS32, SUM_ULPS

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    w_max = max(float(v.abs().max()) for v in weights.values())
    return sum(r["lr"] * SUM_ULPS * EPS32 * r["grad_norm"] + EPS32 * w_max for r in rows if "grad_norm" in r)


def workbench(args: list[str]) -> subprocess.Popen:
    """`python -m workbench ARGS` as a child process (stdout and stderr together)."""
    return subprocess.Popen([sys.executable, "-m", "workbench", *args], cwd=ROOT, env=dist_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: int = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def logged_losses(run_dir: Path) -> list[float]:
    """The loss of each step in metrics.jsonl (a resumed step is logged again: the last one counts)."""
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row and "eval" not in row:
            by_step[row["step"]] = row["loss"]
    return [by_step[k] for k in sorted(by_step)]
