"""What a training method is, for the rest of the workbench: its spec.

Every method module (workbench/methods/<name>.py) ends with one `SPEC = MethodSpec(...)`: its
name, its options dataclass (`Config`), its builder, and the facts other layers read without
running it (which data shape it reads, which reference model its loss needs, how many sequences
one example puts through the model, whether it generates, which extra model it loads, its
default evaluation). `workbench/methods/registry.py` gathers the specs: it is the only list of
methods, read by config validation, the rules, the resolved run (which carries the facts to the
model builder and the evaluations as `run.facts`), preflight and the planner.

A method's options (`method.*`) are read only here and in the method's own module: what another
layer needs of them is a fact the spec derives from the method node (`rollouts`,
`reference_choice`, `beta`, `loss_on`, `bound_generation`), with the method's `Config` defaults
for anything the node leaves out (tests/unit/test_layout.py keeps it so).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass

from omegaconf import OmegaConf

DATA_SHAPES = ("sft", "preference", "unpaired", "prompts")
# compare a method's data shape with these, never with a method's name ("sft" is both)
SFT_ROWS, PREFERENCE_ROWS, UNPAIRED_ROWS, PROMPT_ROWS = DATA_SHAPES
REFERENCE_NEEDS = ("none", "method", "kl")


@dataclass(frozen=True)
class MethodFacts:
    data: str  # sft (chat/text rows) | preference (prompt, chosen, rejected) | unpaired (prompt, completion, label) | prompts
    sequences: int = 1  # sequences one example puts through the model per step (chosen + rejected = 2)
    # the reference model the loss needs: none | method (method.reference: auto/adapter/copy/precomputed)
    # | kl (only when method.beta > 0: the adapter-free base under peft, a frozen copy without)
    reference: str = "none"
    # reference=method: method.reference=precomputed (the reference's log-probs computed once,
    # before training, so no reference model is held) is one of its choices
    precomputed_reference: bool = False
    generates: bool = False  # samples completions with the policy during training
    teacher: bool = False  # loads a second (teacher) model, frozen
    scalar_head: bool = False  # a value/reward head on the last hidden state instead of the LM head
    episodes: bool = False  # rolls out multi-turn episodes in an environment (env=...) that rewards can score
    eval: str = "loss"  # the default evaluation on the user's own held-out rows (workbench/evals)
    # the embedded task's evaluation where the default (eval=arith: exact match of generated
    # answers) says nothing about the trained model, as for a reward model, which does not generate
    embedded_eval: str | None = None
    # its loss completes every sum over a row's tokens across the sp group
    # (workbench/train/sequence_parallel.total), so backend.sp may cut its rows between ranks
    splits_rows: bool = False


@dataclass(frozen=True)
class Rollouts:
    """What a method that trains on its own samples asks of the planner per optimizer step, read
    from its options (MethodSpec.rollouts): each rank generates its groups at once, prompts x
    `generations` completions of at most `completion_len` tokens, once every `num_iterations`
    steps; `share_prompt`: a micro-batch's completions of one prompt are one row (the prompt once,
    the completions as branches); `old_logps`: a forward pass without gradient for the generating
    policy's log-probs; `vllm_fraction`: the GPU memory share a colocated vLLM engine reserves
    (0 with HF generate). `groups` False: one completion per row of a micro-batch, on a share of
    the steps (on-policy distillation), not whole groups per prompt trained on."""

    groups: bool
    generations: int
    completion_len: int
    prompts_per_step: int | None  # over all ranks; None: micro_batch x grad_accum / generations per rank
    num_iterations: int
    share_prompt: bool
    old_logps: bool
    engine: str  # hf | vllm
    vllm_fraction: float
    overlaps: bool = False  # generates while the step trains (GRPO's async_rollouts), not before it

    def prompts_per_rank(self, micro_batch: int, grad_accum: int, data_parallel: int) -> int:
        if self.prompts_per_step:
            return max(1, int(self.prompts_per_step) // data_parallel)
        return max(1, micro_batch * grad_accum // max(self.generations, 1))


@dataclass(frozen=True)
class RolloutTrace:
    """What `dry_run=trace` (workbench/plan/trace.py) runs of a method that generates:
    `untraced(method config)`: why its step cannot be traced, or None; `sequences(run,
    micro_batches)`: (prompts, rows) of the planner's lengths as plain lists, made before the fake
    mode; `generate(method, backend, prompts)`: the rollout's longest step; `batch(method, backend,
    rows, known)`: the step's StepBatch from the rows (workbench/methods/grpo_trace.py)."""

    untraced: Callable
    sequences: Callable
    generate: Callable
    batch: Callable


@dataclass(frozen=True)
class MethodSpec:
    name: str
    config: type  # the options dataclass; conf/method/<name>.yaml composes onto it
    build: Callable  # (method config, Context) -> a Method (workbench/methods/base.py)
    facts: MethodFacts
    # (method config) -> None, raising a UserError for an option this method refuses; run when the
    # run resolves (workbench/resolve/resolved.py), so a dry run sees what the real run would refuse
    check: Callable | None = None
    rules: tuple = ()  # workbench/config/rule.py Rules that concern this method alone
    # (method config) -> why its loss runs the model a second time per micro-batch besides a
    # reference model (KTO's KL rows), or None; a pipeline-parallel backend runs it once
    second_forward: Callable | None = None
    # (method config, micro_batch, grad_accum, dp) -> the step's batch shape, for a method whose
    # options set it (GRPO's prompts x generations); None: micro_batch x grad_accum rows per rank
    batch: Callable | None = None
    # (method config with every option set) -> Rollouts, for a method that generates what it trains on
    rollouts: Callable | None = None
    trace: RolloutTrace | None = None  # a method that generates and whose step dry_run=trace can run

    def __post_init__(self):
        """A half-made spec is an error where it is written, at import, not a fallback later."""
        problems = []
        if not (is_dataclass(self.config) and any(f.name == "name" for f in fields(self.config))):
            problems.append("config must be a dataclass with a `name` field")
        elif self.config().name != self.name:
            problems.append(f"config's name defaults to {self.config().name!r}")
        if not callable(self.build):
            problems.append("build is not callable")
        if not isinstance(self.facts, MethodFacts):
            problems.append("facts is not a MethodFacts")
        elif self.facts.data not in DATA_SHAPES or self.facts.reference not in REFERENCE_NEEDS:
            problems.append(f"facts.data must be one of {DATA_SHAPES} and facts.reference one of {REFERENCE_NEEDS}")
        if isinstance(self.facts, MethodFacts) and self.facts.generates != (self.rollouts is not None):
            problems.append("a method that generates states what it generates (rollouts), and only such a method")
        if problems:
            raise TypeError(f"method spec {self.name!r}: " + "; ".join(problems))

    def options(self, node):
        """The method node over its `Config`'s defaults: every option set, as validation leaves it
        (a config the planner changes, or a test's hand-made one, may leave options out)."""
        if node is None:
            return OmegaConf.structured(self.config)
        if OmegaConf.get_type(node) is self.config:  # validated: merged onto the Config already
            return node
        return OmegaConf.merge(OmegaConf.structured(self.config), node)

    def generation(self, node) -> Rollouts | None:
        """What the method generates per step as configured; None for a method that does not."""
        return self.rollouts(self.options(node)) if self.rollouts else None

    def reference_choice(self, node) -> str:
        """The reference model the loss asks for as configured: none | auto | adapter | copy |
        precomputed (auto: the adapter-free base under peft, a frozen copy without;
        workbench/resolve/derive.py decides it). facts.reference says which option decides:
        `method.reference` (DPO, KTO), or a KL term's `method.beta` > 0 (GRPO)."""
        if self.facts.reference == "none":
            return "none"
        opts = self.options(node)
        if self.facts.reference == "method":
            return str(opts.reference)
        return "auto" if self.beta(node) else "none"

    def beta(self, node) -> float | None:
        """The strength of the method's implicit reward or KL term (its `beta` option); None for
        a method without one."""
        opts = self.options(node)
        return float(opts.beta) if "beta" in opts and opts.beta is not None else None

    def loss_on(self, node) -> str:
        """Which tokens of a chat row train: the method's `loss_on` option, else the assistant turns."""
        opts = self.options(node)
        return str(opts.loss_on) if "loss_on" in opts else "assistant"

    def bound_generation(self, node, max_new_tokens: int) -> None:
        """debug.max_new_tokens on the method node: its completion length at most that, and no
        refill rounds (dynamic sampling's), so a smoke run's generation is bounded."""
        if "max_new_tokens" in node:
            node.max_new_tokens = min(int(node.max_new_tokens), int(max_new_tokens))
        if "max_resample_rounds" in node:
            node.max_resample_rounds = 0
