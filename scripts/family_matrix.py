"""The family matrix: a random-initialised small model of each family transformers ships and people
fine-tune, on each backend, under each training method. Every cell either trains with the losses
of backend=single (within tests/tolerances.py), or is refused by a named rule of
workbench/resolve/rules.py before any weights load; the run writes docs/family-matrix.md.

    python scripts/family_matrix.py                              # the whole matrix -> docs/family-matrix.md
    python scripts/family_matrix.py --families gemma2,phi3       # a share: these families only
    python scripts/family_matrix.py --backends fsdp2 --methods sft-lora --out /tmp/share.json --no-doc
    python scripts/family_matrix.py --merge OLD.json             # rerun a share, keep OLD.json's other cells
    python scripts/family_matrix.py --render OLD.json            # the page from a saved run only

A model is `model=tiny` with `model.arch.family=<family>` (workbench/models/load.py `hf_config`
builds that family's own config class from tiny's numbers: 2 layers, hidden 64, 4 heads, 2 KV
heads of 16, MLP 128, SmolLM2's 49,152-token vocabulary), mixtral with 4 experts routed top-2.
Every run: fp32, plain SGD at lr 0.2 (a weight's error stays proportional to its gradient's, and
the step moves the next losses visibly, so a wrong gradient, scale or reduction shows in them),
3 steps of 4 rows of at most 64 tokens.

References: a cell on 2 ranks holds one micro-batch of 2 rows per rank where backend=single
accumulates the same two (train.grad_accum=2), so both see the same global batch; Megatron at
tp=2 holds one replica on its 2 ranks and accumulates like single. GRPO samples its rollouts with
noise keyed by (seed, step, prompt, generation), so its completions, and its losses, are the
same at any world size.

tests/distributed/test_family_matrix.py loads this file: its default tier runs DEFAULT, its slow
tier the rest of `cells()`, both judged by `compare` here.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DOC = ROOT / "docs" / "family-matrix.md"

# family -> overrides on top of model=tiny. gemma3 is the text model's type (gemma3_text): the
# model type `gemma3` is the multimodal Gemma3Config, refused by hf_config (it names gemma3_text).
MOE = ("model.arch.experts=4", "model.arch.experts_per_token=2")
FAMILIES: dict[str, tuple[str, ...]] = {
    "llama": ("model.arch.family=llama",),
    "mistral": ("model.arch.family=mistral",),
    "qwen2": ("model.arch.family=qwen2",),
    "qwen3": ("model.arch.family=qwen3",),
    "gemma2": ("model.arch.family=gemma2",),
    "gemma3_text": ("model.arch.family=gemma3_text",),
    "phi3": ("model.arch.family=phi3",),
    "mixtral": ("model.arch.family=mixtral", *MOE),
}
EXPERTS = ("mixtral",)

# name -> processes. DDP is backend=single on 2 processes. Megatron splits a dense model's layers
# over its 2 ranks (tp=2, one replica) and a mixture of experts' experts (ep=2, two replicas of
# everything else): tp=2 on a MoE model needs sequence parallelism, a GPU feature (rule
# megatron-moe-tp-needs-sp).
BACKENDS: dict[str, int] = {"single": 1, "ddp": 2, "fsdp2": 2, "zero3": 2, "megatron": 2}
REWARD = 'reward.functions=["tests.rewards:char_length"]'  # varies on a random model; arith rewards are 0
METHODS: dict[str, tuple[str, ...]] = {
    "sft-lora": ("method=sft", "peft=lora"),
    "sft-full": ("method=sft", "peft=none"),
    "dpo-lora": ("method=dpo", "peft=lora"),
    # two passes per rollout so the second step's ratios are live; beta > 0 so the reference (the
    # adapter-free model) is computed too
    "grpo-lora": ("method=grpo", "peft=lora", REWARD, "method.num_generations=2", "method.dynamic_sampling=false",
                  "method.num_iterations=2", "method.beta=0.1"),
}
NEAR_ZERO = ("grpo-lora",)  # signed means near zero: judged by their absolute difference (NEAR_ZERO_ATOL)
STEPS = 3
SHAPE = ("precision=fp32", "optim.name=sgd", "optim.lr=0.2", f"train.max_steps={STEPS}", "train.micro_batch_size=2",
         "data.seq_len=64", "++hardware.timeout_minutes=6")


@dataclass(frozen=True)
class Cell:
    family: str
    backend: str
    method: str

    @property
    def name(self) -> str:
        return f"{self.family}-{self.backend}-{self.method}"

    @property
    def procs(self) -> int:
        return BACKENDS[self.backend]

    @property
    def reference(self) -> Cell:
        return Cell(self.family, "single", self.method)


def backend_overrides(cell: Cell) -> tuple[tuple[str, ...], bool]:
    """(overrides, whether the 2 ranks hold one replica between them)."""
    if cell.backend == "megatron":
        if cell.family in EXPERTS:
            return ("backend=megatron", "backend.ep=2"), False
        return ("backend=megatron", "backend.tp=2"), True
    return {"single": ("backend=single",), "ddp": ("backend=single",), "fsdp2": ("backend=fsdp2",),
            "zero3": ("backend=deepspeed", "backend.stage=3")}[cell.backend], False


def overrides(cell: Cell) -> list[str]:
    """The cell's overrides on top of tests/conftest.py's TINY."""
    backend, one_replica = backend_overrides(cell)
    accum = "train.grad_accum=2" if cell.procs == 1 or one_replica else "train.grad_accum=1"
    return [*FAMILIES[cell.family], *METHODS[cell.method], *backend, *SHAPE, accum, f"hardware.procs={cell.procs}"]


def cells(families=None, backends=None, methods=None) -> list[Cell]:
    return [Cell(f, b, m) for f in FAMILIES for b in BACKENDS for m in METHODS
            if (not families or f in families) and (not backends or b in backends) and (not methods or m in methods)]


# The default tier's share: every family at least once off backend=single, every backend and
# every method at least twice, and one refused cell (a family Megatron has no mapping for).
DEFAULT = [Cell("llama", "megatron", "sft-lora"), Cell("mixtral", "megatron", "sft-full"),
           Cell("mistral", "fsdp2", "sft-full"), Cell("qwen2", "zero3", "dpo-lora"),
           Cell("qwen3", "ddp", "grpo-lora"), Cell("gemma2", "fsdp2", "dpo-lora"),
           Cell("gemma3_text", "zero3", "sft-lora"), Cell("phi3", "fsdp2", "grpo-lora"),
           Cell("gemma2", "ddp", "sft-lora"), Cell("phi3", "megatron", "sft-lora")]


def classify(cell: Cell, env=None) -> tuple[str, str]:
    """("trains", "") or ("refused", rule id): the rule table's verdict, before any weights load
    (what `resolve()` runs for every entry point). `env`: the machine as the rules see it."""
    from tests.conftest import compose
    from workbench.resolve import rules

    broken = rules.violations(compose(overrides(cell)), env)
    return ("refused", broken[0][0].id) if broken else ("trains", "")


def run(cells_: list[Cell], out, timeout: int = 3600, job_per_backend: bool = True) -> dict[str, dict]:
    """Train `cells_` and return name -> rank 0's result ({"losses": [...], "seconds": s} or
    {"error": ...}). One-process cells run in this process; the 2-process ones share torchrun jobs
    (tests/distributed/_worker.py): one per backend, so a job that dies takes only its backend's
    cells with it, or (job_per_backend=False, for a few cells) Megatron's and the rest's: Megatron's
    model-parallel state is process-global, so its runs share a job of their own. A cell that
    fails is recorded; the cells after it still run."""
    from tests.conftest import train
    from tests.helpers import worker_jobs

    out = Path(out)
    results: dict[str, dict] = {}
    for cell in (c for c in cells_ if c.procs == 1):
        start = time.perf_counter()
        try:
            results[cell.name] = {"losses": train(overrides(cell), out / cell.name)["losses"]}
        except Exception as exc:  # noqa: BLE001 - recorded for the matrix; the next cell still runs
            results[cell.name] = {"error": f"{type(exc).__name__}: {exc}"}
        results[cell.name]["seconds"] = round(time.perf_counter() - start, 2)
    multi = [c for c in cells_ if c.procs == 2]
    if job_per_backend:
        jobs = {b: [c for c in multi if c.backend == b] for b in BACKENDS}
    else:
        jobs = {"megatron": [c for c in multi if c.backend == "megatron"],
                "others": [c for c in multi if c.backend != "megatron"]}
    results.update(worker_jobs({tag: [(c.name, overrides(c)) for c in job] for tag, job in jobs.items()}, out, timeout))
    return results


def tolerance(cell: Cell) -> tuple[float, float]:
    """(rtol, atol) of the cell's losses against its reference's (tests/tolerances.py): only the
    summation order differs (1 rank against 2, sharded reductions, split matmuls), all in fp32."""
    from tests.tolerances import LOSS_RTOL, NEAR_ZERO_ATOL

    return LOSS_RTOL, NEAR_ZERO_ATOL


def compare(cell: Cell, results: dict[str, dict]) -> dict:
    """The cell's verdict: {"ok", "why", "rel", "abs"} (the largest relative and absolute loss
    differences against backend=single's). A backend=single cell is the reference: ok when its
    losses are finite and moved (a step that did not happen would leave nothing to compare)."""
    got = results.get(cell.name, {})
    if "error" in got or "losses" not in got:
        return {"ok": False, "why": got.get("error", "not run")}
    a = got["losses"]
    if len(a) != STEPS or not all(math.isfinite(x) for x in a):
        return {"ok": False, "why": f"losses {a}"}
    if cell.backend == "single":
        ok = len(set(a)) > 1
        return {"ok": ok, "why": "" if ok else f"losses did not move: {a}", "rel": 0.0, "abs": 0.0}
    ref = results.get(cell.reference.name, {})
    if "error" in ref or "losses" not in ref:
        return {"ok": False, "why": f"reference {cell.reference.name}: {ref.get('error', 'not run')}"}
    b = ref["losses"]
    if len(b) != len(a):
        return {"ok": False, "why": f"losses {a} against single's {b}"}
    rtol, atol = tolerance(cell)
    rel = max(abs(x - y) / abs(y) if y else 0.0 for x, y in zip(a, b))
    diff = max(abs(x - y) for x, y in zip(a, b))
    ok = all(abs(x - y) <= max(rtol * abs(y), atol) for x, y in zip(a, b))
    return {"ok": ok, "why": "" if ok else f"losses {a} against single's {b} (rtol {rtol:.0e}, atol {atol:.0e})",
            "rel": rel, "abs": diff}


def judge(chosen: list[Cell], out, timeout: int = 3600, job_per_backend: bool = True) -> list[dict]:
    """Classify, train what trains (with the references it needs), compare: one row per cell."""
    classes = {c: classify(c) for c in chosen}
    training = [c for c, (kind, _) in classes.items() if kind == "trains"]
    needed = training + sorted({c.reference for c in training} - set(training), key=lambda c: c.name)
    results = run(needed, out, timeout, job_per_backend)
    rows = []
    for c, (kind, rule) in classes.items():
        row = {"family": c.family, "backend": c.backend, "method": c.method, "verdict": kind, "rule": rule}
        if kind == "trains":
            got = results.get(c.name, {})
            row.update(losses=got.get("losses"), error=got.get("error", "" if "losses" in got else "not run"),
                       seconds=got.get("seconds"))
        rows.append(row)
    extra = {c.name: results[c.name] for c in needed if c not in classes and c.name in results}
    return rejudge(rows, extra)


def rejudge(rows: list[dict], extra: dict[str, dict] | None = None) -> list[dict]:
    """Each trained row's verdict from the losses (or error) it holds, under the tolerances now in
    tests/tolerances.py: after a merge, a cell is judged against the reference the page shows.
    `extra`: results of references that are not rows themselves."""
    results = dict(extra or {})
    for r in rows:
        if r["verdict"] == "trains":
            results[Cell(r["family"], r["backend"], r["method"]).name] = (
                {"error": r["error"]} if r.get("error") else {"losses": r.get("losses")})
    out = []
    for r in rows:
        if r["verdict"] == "trains":
            r = {**{k: v for k, v in r.items() if k not in ("ok", "why", "rel", "abs")},
                 **compare(Cell(r["family"], r["backend"], r["method"]), results)}
        out.append(r)
    return out


# -- the page ----------------------------------------------------------------------------------
def _short(why: str) -> str:
    """A failure's last line (an exception's message, not its traceback), cut for a table cell."""
    lines = [x.strip() for x in why.splitlines() if x.strip()]
    return (lines[-1] if lines else "?")[:140].replace("|", "\\|")


def mark(row: dict) -> str:
    if row["verdict"] == "refused":
        return f"refused: `{row['rule']}`"
    if not row.get("ok"):
        return f"**fails**: {_short(row.get('why', ''))}"
    if row["backend"] == "single":
        return "ok (reference)"
    if row["method"] in NEAR_ZERO:  # near-zero losses: the absolute difference is the one that says something
        return f"ok (abs diff {_num(row['abs'])})"
    return f"ok (rel diff {_num(row['rel'])})"


def _num(x: float) -> str:
    return "0" if x == 0 else f"{x:.0e}"


def machine() -> str:
    """This machine in words: CPU model, cores, memory, and the versions that compute the cells."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor() or "?") if Path("/proc/cpuinfo").exists() else "?"
    mem = next((int(ln.split()[1]) / 2**20 for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal")), 0.0) if Path("/proc/meminfo").exists() else 0.0
    import importlib.metadata as md

    def v(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "absent"

    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB; torch {v('torch')}, transformers {v('transformers')}, "
            f"peft {v('peft')}, deepspeed {v('deepspeed')}, megatron-core {v('megatron-core')}")


def summary(rows: list[dict]) -> list[str]:
    refused = collections.Counter(r["rule"] for r in rows if r["verdict"] == "refused")
    ok = [r for r in rows if r["verdict"] == "trains" and r.get("ok")]
    fails = [r for r in rows if r["verdict"] == "trains" and not r.get("ok")]
    out = [f"{len(rows)} cells: {len(ok)} train with backend=single's losses, {sum(refused.values())} are refused "
           f"before weights load, {len(fails)} fail.", ""]
    if refused:
        out += ["| refused by | cells |", "|---|---|", *(f"| `{rule}` | {n} |" for rule, n in refused.most_common()), ""]
    worst = max((r["rel"] for r in ok if r["method"] not in NEAR_ZERO and r["backend"] != "single"), default=0.0)
    worst_abs = max((r["abs"] for r in ok if r["method"] in NEAR_ZERO and r["backend"] != "single"), default=0.0)
    out += [f"Largest relative loss difference against backend=single: {worst:.1e} (LOSS_RTOL 1e-05); GRPO's "
            f"(losses near zero), absolute: {worst_abs:.1e} (NEAR_ZERO_ATOL 1.9e-06).", ""]
    if fails:
        out += ["Failures:", ""]
        out += [f"- {r['family']} x {r['backend']} x {r['method']}: {' '.join(r.get('why', '?').split())[:600]}"
                for r in fails]
        out.append("")
    return out


def render(rows: list[dict], seconds: float | None = None, where: str | None = None) -> str:
    timing = f" The whole matrix ran in {seconds / 60:.0f} min." if seconds else ""
    lines = ["# Family matrix", "",
             "Generated by `scripts/family_matrix.py` (regenerate with the command below), on "
             f"{where or machine()}.{timing}", "",
             "A random-initialised small model of each family (`model=tiny model.arch.family=<family>`: 2",
             "layers, hidden 64, 4 heads and 2 KV heads of 16, SmolLM2's vocabulary; mixtral with 4 experts",
             "routed top-2) trains 3 steps of plain SGD (lr 0.2, fp32, 4 rows of at most 64 tokens a step) on",
             "each backend: single (1 process), DDP (`backend=single hardware.procs=2`), FSDP2",
             "(`backend=fsdp2`), ZeRO-3 (`backend=deepspeed backend.stage=3`) and Megatron (`backend=megatron`,",
             "tp=2; ep=2 for mixtral), each on 2 gloo processes on CPU. A cell is `ok` when its losses equal",
             "backend=single's at the same global batch within tests/tolerances.py (LOSS_RTOL relative;",
             "GRPO's, near zero, NEAR_ZERO_ATOL absolute), with the largest difference shown; `refused` names",
             "the rule of [compatibility.md](compatibility.md) that stops it before any weights load. The model",
             "type `gemma3` is transformers' multimodal Gemma 3 and is refused in one line naming",
             "`gemma3_text`, the text model, which is the family here.", "",
             f"**Needs:** 2 CPU cores, about {max(1, round(seconds / 60)) if seconds else 10} minutes; megatron-core and "
             "deepspeed for their columns.", "",
             "```bash", "python scripts/family_matrix.py                                     # the whole matrix, this page",
             "python scripts/family_matrix.py --out runs.json                     # ... keeping every cell's losses",
             "python scripts/family_matrix.py --families phi3 --merge runs.json   # one family again", "```", "",
             *summary(rows)]
    by = {(r["family"], r["backend"], r["method"]): r for r in rows}
    families = list(dict.fromkeys(r["family"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    for m in dict.fromkeys(r["method"] for r in rows):
        lines += [f"## {m}", "", f"`{' '.join(METHODS[m])}`", "",
                  "| family | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
        for f in families:
            lines.append(f"| {f} | " + " | ".join(mark(by[(f, b, m)]) if (f, b, m) in by else "not run"
                                                  for b in backends) + " |")
        lines.append("")
    return "\n".join(lines)


def _names(given: str) -> list[str]:
    return [x for x in given.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="", help=f"comma-separated, of {','.join(FAMILIES)}")
    ap.add_argument("--backends", default="", help=f"comma-separated, of {','.join(BACKENDS)}")
    ap.add_argument("--methods", default="", help=f"comma-separated, of {','.join(METHODS)}")
    ap.add_argument("--default", action="store_true", help="the default tier's share (DEFAULT) only")
    ap.add_argument("--out", metavar="JSON", help="keep the run's rows here")
    ap.add_argument("--merge", metavar="JSON", help="a saved run whose other cells the page keeps")
    ap.add_argument("--render", metavar="JSON", help="write the page from a saved run instead of running")
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/family-matrix.md")
    ap.add_argument("--work", metavar="DIR", help="where the runs write (default: a temporary directory)")
    args = ap.parse_args()
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        DOC.write_text(render(rejudge(saved["rows"]), saved.get("seconds"), saved.get("machine")))
        return 0
    for given, known in ((args.families, FAMILIES), (args.backends, BACKENDS), (args.methods, METHODS)):
        unknown = set(_names(given)) - set(known)
        if unknown:
            ap.error(f"unknown: {sorted(unknown)} (known: {', '.join(known)})")
    chosen = DEFAULT if args.default else cells(_names(args.families), _names(args.backends), _names(args.methods))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)  # the one-process cells too: no oversubscription beside the torchrun jobs
    torch.use_deterministic_algorithms(True, warn_only=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="family_matrix_"))
    start = time.time()
    rows = judge(chosen, work)
    seconds = time.time() - start
    if args.merge:  # the saved run's other cells; this run's for the cells it ran
        fresh = {(r["family"], r["backend"], r["method"]): r for r in rows}
        old = json.loads(Path(args.merge).read_text())["rows"]
        keys = {(r["family"], r["backend"], r["method"]) for r in old}
        rows = rejudge([fresh.get((r["family"], r["backend"], r["method"]), r) for r in old]
                       + [r for k, r in fresh.items() if k not in keys])
        seconds = None  # two runs: no one wall time
    saved = {"rows": rows, "seconds": seconds, "machine": machine()}
    if args.out:
        Path(args.out).write_text(json.dumps(saved, indent=1))
    for line in summary(rows):
        print(line)
    if not args.no_doc:
        DOC.write_text(render(rows, seconds, saved["machine"]))
        print(f"wrote {DOC.relative_to(ROOT)} (runs in {work})")
    return 0 if all(r["verdict"] == "refused" or r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
