"""The precision matrix: every method x backend x precision x peft as a cell that either trains two
steps with the losses of backend=single at the same precision, or is refused by a named rule of
workbench/resolve/rules.py before any weights load.

    from tests.precision_matrix import cells, classify, DEFAULT
    for cell in cells():                 # the slow tier's whole matrix
        print(cell.name, classify(cell)) # ("trains", "") or ("refused", "<rule id>")

Every cell forces its precision: nothing inherits what `precision=auto` resolves to on the machine
that runs the tests, so the matrix means the same on an AMX, an AVX512-BF16 and an AVX2-only CPU
(bf16 arithmetic works on every x86 CPU, emulated where the instructions are missing).

References: a cell on 2 ranks holds one micro-batch per rank where backend=single accumulates the
same two (train.grad_accum=2), so they see the same global batch. Methods that generate (GRPO)
sample with each rank's own stream, so their reference is the same method on 2 DDP ranks
(backend=single launched on 2 processes), never the 1-process run. `scripts/precision_matrix.py`
runs the whole matrix and writes docs/precision-matrix.md; tests/distributed/test_precision.py
runs DEFAULT, a quick share (`-k default_share`), and the rest, all in the slow tier.
"""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("fp32", "bf16-mixed", "bf16")
PEFTS = ("none", "lora", "qlora")

# name -> (overrides, processes). DDP is backend=single on 2 processes.
BACKENDS: dict[str, tuple[tuple[str, ...], int]] = {
    "single": (("backend=single",), 1),
    "ddp": (("backend=single",), 2),
    "fsdp2": (("backend=fsdp2",), 2),
    "zero1": (("backend=deepspeed", "backend.stage=1"), 2),
    "zero2": (("backend=deepspeed", "backend.stage=2"), 2),
    "zero3": (("backend=deepspeed", "backend.stage=3"), 2),
    "megatron-tp2": (("backend=megatron", "backend.tp=2"), 2),
    "megatron-pp2": (("backend=megatron", "backend.pp=2"), 2),
    "sp2": (("backend=single", "backend.sp=2"), 2),
}
# backends whose 2 processes hold one replica between them (data-parallel size 1): they take
# both micro-batches by accumulation, as backend=single does
ONE_REPLICA = ("megatron-tp2", "megatron-pp2", "sp2")
# sequence parallelism is in the quick share (DEFAULT) only: the whole matrix and its
# generated page (docs/precision-matrix.md) cover the other backends
MATRIX_BACKENDS = tuple(b for b in BACKENDS if b != "sp2")

REWARD = 'reward.functions=["tests.rewards:char_length"]'
# name -> overrides; distill's teacher is added by `overrides` (a directory the tests make)
METHODS: dict[str, tuple[str, ...]] = {
    "sft": ("method=sft",),
    "dpo": ("method=dpo",),
    "kto": ("method=kto",),
    "cpo": ("method=cpo",),
    "orpo": ("method=orpo",),
    "simpo": ("method=simpo",),
    "rm": ("method=rm",),
    "distill": ("method=distill", "method.lmbda=0.0"),
    "grpo": ("method=grpo", REWARD, "method.num_generations=2", "method.dynamic_sampling=false",
             "method.num_iterations=2"),
}
GENERATES = ("grpo",)
# losses of a margin between two sequences' summed log-probs or rewards (tests/tolerances.py HALF_PAIR_RTOL)
PAIRS = ("dpo", "kto", "cpo", "orpo", "simpo", "rm")

# Two steps of plain SGD at a learning rate that moves the second loss visibly (a wrong gradient,
# scale or reduction shows there), two micro-batches per step.
SHAPE = ("optim.name=sgd", "optim.lr=0.2", "train.max_steps=2", "train.micro_batch_size=2",
         "++hardware.timeout_minutes=6")


@dataclass(frozen=True)
class Cell:
    method: str
    backend: str
    precision: str
    peft: str

    @property
    def name(self) -> str:
        return f"{self.method}-{self.backend}-{self.precision}-{self.peft}"

    @property
    def procs(self) -> int:
        return BACKENDS[self.backend][1]

    @property
    def reference(self) -> Cell:
        """The cell this one's losses must equal: backend=single (DDP for a method that generates,
        except under sp, whose ranks draw the rollouts of one replica, as one process does)."""
        ddp = self.method in GENERATES and self.backend != "sp2"
        return Cell(self.method, "ddp" if ddp else "single", self.precision, self.peft)


def overrides(cell: Cell, teacher=None) -> list[str]:
    """The cell's overrides on top of tests/conftest.py's TINY (which pins precision=fp32: the
    cell's precision comes after it and wins)."""
    extra = [f"method.teacher={teacher}"] if cell.method == "distill" and teacher else []
    accum = "train.grad_accum=2" if cell.procs == 1 or cell.backend in ONE_REPLICA else "train.grad_accum=1"
    return [*METHODS[cell.method], *extra, *BACKENDS[cell.backend][0], f"precision={cell.precision}",
            f"peft={cell.peft}", *SHAPE, accum, f"hardware.procs={cell.procs}"]


def cells() -> list[Cell]:
    return [Cell(m, b, p, f) for m in METHODS for b in MATRIX_BACKENDS for p in PRECISIONS for f in PEFTS]


# The quick share: every backend under bf16-mixed for SFT with and without LoRA, and one
# preference and one RL method under bf16-mixed on Megatron, FSDP2 and sp=2 (DPO with LoRA on FSDP2,
# where a full copy of the reference is refused: rule sharded-copied-reference).
DEFAULT = ([Cell("sft", b, "bf16-mixed", f) for b in BACKENDS for f in ("none", "lora")]
           + [Cell("dpo", "megatron-tp2", "bf16-mixed", "none"), Cell("dpo", "fsdp2", "bf16-mixed", "lora"),
              Cell("grpo", "megatron-tp2", "bf16-mixed", "none"), Cell("grpo", "fsdp2", "bf16-mixed", "none"),
              Cell("dpo", "sp2", "bf16-mixed", "lora"), Cell("grpo", "sp2", "bf16-mixed", "none")])


def classify(cell: Cell, env=None) -> tuple[str, str]:
    """("trains", "") or ("refused", rule id): the rule table's verdict, before any weights load.
    `env` is the machine as the rules see it (workbench.resolve.rules.Env); default: this one."""
    from tests.conftest import compose
    from workbench.core.errors import UserError
    from workbench.resolve import rules

    try:
        cfg = compose(overrides(cell, teacher="/nonexistent/teacher"))
    except UserError as e:  # a method's own option check in the schema
        return "refused", str(e).split("]")[0].lstrip("[") if str(e).startswith("[") else str(e)
    broken = rules.violations(cfg, env)
    return ("refused", broken[0][0].id) if broken else ("trains", "")


def run(cells_: list[Cell], out, teacher=None, timeout: int = 3600, job_per_backend: bool = True) -> dict[str, dict]:
    """Train `cells_` and return name -> rank 0's result ({"losses": [...]} or {"error": ...}).
    One-process cells run in this process; the 2-process ones share torchrun jobs
    (tests/distributed/_worker.py): one per backend, so a job that dies takes only its backend's
    cells with it, or (job_per_backend=False, the default tier's few cells) Megatron's and the
    rest's, to pay for fewer launches. A cell that fails is recorded; the cells after it still run."""
    from pathlib import Path

    from tests.conftest import train
    from tests.helpers import worker_jobs

    out = Path(out)
    results: dict[str, dict] = {}
    for cell in (c for c in cells_ if c.procs == 1):
        try:
            results[cell.name] = {"losses": train(overrides(cell, teacher), out / cell.name)["losses"]}
        except Exception as exc:  # noqa: BLE001 - recorded for the matrix; the next cell still runs
            results[cell.name] = {"error": f"{type(exc).__name__}: {exc}"}
    if job_per_backend:
        jobs = {b: [c for c in cells_ if c.procs == 2 and c.backend == b] for b in BACKENDS}
    else:  # Megatron's model-parallel state is process-global: its runs share a job of their own
        jobs = {"megatron": [c for c in cells_ if c.procs == 2 and c.backend.startswith("megatron")],
                "others": [c for c in cells_ if c.procs == 2 and not c.backend.startswith("megatron")]}
    results.update(worker_jobs({tag: [(c.name, overrides(c, teacher)) for c in job] for tag, job in jobs.items()},
                               out, timeout))
    return results


def tolerance(cell: Cell) -> tuple[float, float]:
    """(rtol, atol) for the cell's losses against its reference's (tests/tolerances.py)."""
    from tests.tolerances import HALF_LOSS_RTOL, HALF_NEAR_ZERO_ATOL, HALF_PAIR_RTOL, LOSS_RTOL, NEAR_ZERO_ATOL

    if cell.precision == "fp32":
        return LOSS_RTOL, NEAR_ZERO_ATOL
    return HALF_PAIR_RTOL if cell.method in PAIRS else HALF_LOSS_RTOL, HALF_NEAR_ZERO_ATOL


def compare(cell: Cell, results: dict[str, dict]) -> dict:
    """The cell's verdict from a run's results: {"ok", "why", "rel", "abs"} (rel/abs: the largest
    relative and absolute loss differences against the reference)."""
    import math

    got, ref = results.get(cell.name, {}), results.get(cell.reference.name, {})
    if "error" in got or "losses" not in got:
        return {"ok": False, "why": got.get("error", "not run")[:300]}
    if "error" in ref or "losses" not in ref:
        return {"ok": False, "why": f"reference {cell.reference.name}: {ref.get('error', 'not run')[:300]}"}
    a, b = got["losses"], ref["losses"]
    if len(a) != len(b) or not all(math.isfinite(x) for x in a):
        return {"ok": False, "why": f"losses {a} against {b}"}
    rtol, atol = tolerance(cell)
    rel = max(abs(x - y) / abs(y) if y else 0.0 for x, y in zip(a, b))
    diff = max(abs(x - y) for x, y in zip(a, b))
    ok = all(abs(x - y) <= max(rtol * abs(y), atol) for x, y in zip(a, b))
    return {"ok": ok, "why": "" if ok else f"losses {a} against {b} (rtol {rtol:.0e}, atol {atol:.0e})",
            "rel": rel, "abs": diff}


def make_teacher(path):
    """The distillation teacher the matrix uses: the tiny model with another init seed, saved."""
    from tests.conftest import compose
    from workbench.models.load import load_model, load_tokenizer

    cfg = compose(["model.init_seed=7"])
    load_model(cfg.model).save_pretrained(path)
    load_tokenizer(cfg.model).save_pretrained(path)
    return path
