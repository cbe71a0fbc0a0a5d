"""What method=grpo refuses: its options (SPEC.check), the whole-group arithmetic of its step,
and the rules of how its options combine with the rest of the run (SPEC.rules).

    from workbench.methods import grpo_rules
    grpo_rules.make_shape(8, None, 4, 2, dp=1)     # BatchShape: 1 prompt x 8 generations per step
    grpo_rules.RULES                               # grpo-*, async-rollouts-*, vllm-*

These hold only when method=grpo (the method's spec carries them), so they read GRPO's own
fields (method.engine, method.async_rollouts, ...) without asking which method runs. The batch
arithmetic lives here rather than in workbench/methods/grpo.py because the rules read it and
the method module lists these rules in its spec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workbench.config.rule import Rule, backend_name, device, peft, rewards
from workbench.config.schema import pick
from workbench.core.errors import UserError
from workbench.rollout import advantages, objectives
from workbench.train.layout import layout


def check(cfg) -> None:
    """GRPO's options (SPEC.check): run when the run resolves, before any weights load."""
    objectives.check(cfg)
    if cfg.scale_rewards not in advantages.SCALES:
        raise UserError(f"method.scale_rewards={cfg.scale_rewards!r} is not one of {list(advantages.SCALES)}")
    if cfg.advantage not in advantages.KINDS:
        raise UserError(f"method.advantage={cfg.advantage!r} is not one of {list(advantages.KINDS)}")
    if cfg.advantage == "rloo" and cfg.scale_rewards != "none":  # no option is silently ignored
        raise UserError("method.scale_rewards applies to method.advantage=group; with advantage=rloo set "
                        "method.scale_rewards=none (method.normalize_advantages=true scales over the batch)")
    if cfg.advantage == "group" and cfg.normalize_advantages:
        raise UserError("method.normalize_advantages applies to method.advantage=rloo; with advantage=group use "
                        "method.scale_rewards")
    if cfg.engine not in ("hf", "vllm"):
        raise UserError(f"method.engine={cfg.engine!r} is not one of ['hf', 'vllm']")
    if cfg.num_iterations < 1 or cfg.max_new_tokens < 1 or cfg.temperature <= 0:
        raise UserError("method.num_iterations and method.max_new_tokens must be >= 1, method.temperature > 0")
    if cfg.beta < 0:
        raise UserError(f"method.beta must be >= 0 (got {cfg.beta})")
    if cfg.max_resample_rounds < 0:
        raise UserError(f"method.max_resample_rounds must be >= 0 (got {cfg.max_resample_rounds})")
    if cfg.stall_warn_steps < 0 or cfg.stall_stop_steps < 0:  # 0 turns each off; below that would silently too
        raise UserError(f"method.stall_warn_steps and method.stall_stop_steps must be >= 0, 0 for never "
                        f"(got {cfg.stall_warn_steps} and {cfg.stall_stop_steps})")
    if cfg.truncated_reward is not None and not math.isfinite(cfg.truncated_reward):
        raise UserError(f"method.truncated_reward must be a finite number or null (got {cfg.truncated_reward})")
    # how these options combine with train.* and the rank layout are the rules below
    # (grpo-whole-groups, grpo-deepspeed-accum), checked with the rest before anything loads




@dataclass(frozen=True)
class BatchShape:
    """The global-batch arithmetic of a GRPO step, decided once from the config."""

    prompts: int  # per optimizer step, all ranks
    generations: int
    dp: int  # data-parallel ranks (the resolved layout's)
    micro_batch_size: int
    grad_accum: int  # micro-batches per rank per step
    # the prompts come from method.prompts_per_step: the step is that many groups at any layout,
    # whatever train.grad_accum says (a resume keeps it without recomputing the accumulation)
    fixed: bool = False

    @property
    def group(self) -> int:
        """Rows that stay together on one data-parallel rank: a prompt's completions."""
        return self.generations

    @property
    def prompts_per_rank(self) -> int:
        return self.prompts // self.dp

    @property
    def completions_per_rank(self) -> int:
        return self.prompts * self.generations // self.dp

    def describe(self) -> str:
        return (f"grpo batch: {self.prompts} prompts x {self.generations} generations = "
                f"{self.prompts * self.generations} completions per optimizer step; per rank "
                f"({self.dp}): {self.completions_per_rank} = {self.grad_accum} micro-batches of "
                f"{self.micro_batch_size}")


def shape_problem(generations: int, prompts_per_step: int | None, micro_batch_size: int, grad_accum: int,
                  dp: int) -> str | None:
    """Why method.num_generations / prompts_per_step, train.micro_batch_size x grad_accum and
    `dp` data-parallel ranks do not make whole groups per rank, naming the fields; None when
    they do. The rule grpo-whole-groups below refuses a run with it."""
    G, mb = generations, micro_batch_size
    if prompts_per_step is None:
        per_rank = mb * grad_accum
        if per_rank % G:
            return (f"train.micro_batch_size x train.grad_accum = {per_rank} completions per rank must be "
                    f"a multiple of method.num_generations={G} (whole groups per rank), or set "
                    "method.prompts_per_step")
        return None
    if prompts_per_step < 1 or prompts_per_step % dp:
        return (f"method.prompts_per_step={prompts_per_step} must be a positive multiple of the {dp} "
                "data-parallel rank(s) (whole groups per rank)")
    per_rank = prompts_per_step * G // dp
    if per_rank % mb:
        return (f"method.prompts_per_step x method.num_generations / ranks = {per_rank} completions per "
                f"rank must be a multiple of train.micro_batch_size={mb}")
    return None


def make_shape(generations: int, prompts_per_step: int | None, micro_batch_size: int, grad_accum: int,
               dp: int) -> BatchShape:
    """Prompts per step either from method.prompts_per_step or from the micro-batch settings,
    over `dp` data-parallel ranks."""
    problem = shape_problem(generations, prompts_per_step, micro_batch_size, grad_accum, dp)
    if problem:  # a resolved run was refused by the rule already; this guards other callers
        raise UserError(problem)
    G, mb = generations, micro_batch_size
    if prompts_per_step is None:
        return BatchShape(mb * grad_accum * dp // G, G, dp, mb, grad_accum)
    return BatchShape(prompts_per_step, G, dp, mb, prompts_per_step * G // dp // mb, fixed=True)


def step_shape(cfg, micro_batch_size: int, grad_accum: int, dp: int) -> BatchShape:
    """GRPO's MethodSpec.batch: the step's shape from the method config `cfg` at `dp`
    data-parallel ranks; a UserError where the options make no whole groups per rank. The
    resolved run's accumulation (workbench/resolve/derive.py) and a resume's global batch
    (workbench/checkpoints/resume.py) ask here."""
    if cfg.num_generations < 1:  # the rule grpo-group-size refuses it; nothing divides into no group
        raise UserError(f"method.num_generations={cfg.num_generations} makes no group")
    return make_shape(cfg.num_generations, cfg.prompts_per_step, micro_batch_size, grad_accum, dp)



# -- rules -------------------------------------------------------------------------------------
def _generations(c) -> int:
    return int(pick(c, "method.num_generations", 8))  # 8: Config.num_generations (workbench/methods/grpo.py)


def _args(c) -> tuple:
    """GRPO's batch settings (method.num_generations, prompts_per_step, train.micro_batch_size,
    grad_accum) and the run's data-parallel ranks, as make_shape takes them."""
    return (_generations(c), pick(c, "method.prompts_per_step", None), int(c.train.micro_batch_size),
            int(c.train.grad_accum), layout(c).dp)


def _shape(c) -> str | None:
    """Why the batch does not divide into whole groups per data-parallel rank, or None."""
    if _generations(c) < 2:
        return None  # grpo-group-size says what is wrong
    return shape_problem(*_args(c))


def _accum(c) -> int:
    """The micro-batches per rank method.prompts_per_step makes (train.grad_accum without it)."""
    return make_shape(*_args(c)).grad_accum


def _vllm(c) -> bool:
    return pick(c, "method.engine", "hf") == "vllm"


def _async(c) -> bool:
    return bool(pick(c, "method.async_rollouts", False))


RULES = (
    Rule("grpo-needs-reward", {"method": "grpo"},
         lambda c, e: not rewards(c),
         "method=grpo needs at least one reward: add reward=arith_exact (or reward.functions=[{name: module:function}])"),
    Rule("grpo-group-size", {"method": "grpo"},
         lambda c, e: _generations(c) < 2,
         "method=grpo compares completions within a group: set method.num_generations>=2"),
    Rule("grpo-whole-groups", {"method": "grpo", "hardware": "data-parallel ranks",
                               "other": "train.micro_batch_size x grad_accum, method.prompts_per_step"},
         lambda c, e: _shape(c) is not None,
         lambda c, e: _shape(c)),
    # a backend that counts accumulation boundaries from its own config (DeepSpeed), which
    # train.grad_accum sets, must count the micro-batches prompts_per_step makes
    Rule("grpo-deepspeed-accum", {"method": "grpo (prompts_per_step)", "backend": "deepspeed",
                                  "other": "train.grad_accum"},
         lambda c, e: _shape(c) is None and pick(c, "method.prompts_per_step", None) is not None
         and _accum(c) != c.train.grad_accum,
         lambda c, e: f"method.prompts_per_step={pick(c, 'method.prompts_per_step', None)} makes {_accum(c)} "
                      f"micro-batches per step; with backend={backend_name(c)} set train.grad_accum={_accum(c)} to match",
         backend_fact="own_accumulation"),
    Rule("async-rollouts-one-process", {"method": "grpo (async_rollouts)", "hardware": "more than 1 process"},
         lambda c, e: _async(c) and layout(c).world > 1,
         "method.async_rollouts=true generates in a second thread with a copy of the weights in one process; with "
         "several ranks (DDP, FSDP2, ZeRO) generation is a collective the training thread's collectives would "
         "interleave with: use method.async_rollouts=false there"),
    Rule("async-rollouts-vllm", {"method": "grpo (async_rollouts, vLLM rollouts)"},
         lambda c, e: _async(c) and _vllm(c),
         "method.async_rollouts=true overlaps HF generation with training; with method.engine=vllm use "
         "method.async_rollouts=false"),
    Rule("async-rollouts-kl-in-reward", {"method": "grpo (async_rollouts, kl_in_reward)"},
         lambda c, e: _async(c) and bool(pick(c, "method.kl_in_reward", False)) and float(pick(c, "method.beta", 0)) > 0,
         "method.kl_in_reward=true reads the reference off the live model while the rollout runs ahead in its own "
         "thread; use method.async_rollouts=false, or the KL in the loss (method.kl_in_reward=false)"),
    Rule("vllm-needs-cuda", {"method": "grpo (vLLM rollouts)", "hardware": "cpu"},
         lambda c, e: _vllm(c) and device(c) != "cuda",
         "method.engine=vllm needs a CUDA GPU; on CPU use method.engine=hf (generate with KV cache)", machine=True),
    Rule("vllm-needs-package", {"method": "grpo (vLLM rollouts)"},
         lambda c, e: _vllm(c) and not e.has("vllm"),
         "method.engine=vllm needs vllm: pip install -e '.[vllm]' (or use method.engine=hf)", machine=True),
    Rule("vllm-dora", {"method": "grpo (vLLM rollouts)", "peft": "dora"},
         lambda c, e: _vllm(c) and peft(c) == "dora",
         "method.engine=vllm syncs lora, qlora or full weights; use method.engine=hf with peft=dora"),
)
