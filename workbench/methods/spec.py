"""What a training method is, for the rest of the workbench: its spec.

Every method module (workbench/methods/<name>.py) ends with one `SPEC = MethodSpec(...)`: its
name, its options dataclass (`Config`), its builder, and the facts other layers read without
running it (which data shape it reads, which reference model its loss needs, how many sequences
one example puts through the model, whether it generates, which extra model it loads, its
default evaluation). `workbench/methods/registry.py` gathers the specs: it is the only list of
methods, read by config validation, the rules, the resolved run (which carries the facts to the
model builder and the evaluations as `run.facts`), preflight and the planner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass

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
class MethodSpec:
    name: str
    config: type  # the options dataclass; conf/method/<name>.yaml composes onto it
    build: Callable  # (method config, Context) -> a Method (workbench/methods/base.py)
    facts: MethodFacts
    # (method config) -> None, raising a UserError for an option this method refuses; run when the
    # run resolves (workbench/run/resolved.py), so a dry run sees what the real run would refuse
    check: Callable | None = None
    rules: tuple = ()  # workbench/config/rule.py Rules that concern this method alone
    # (method config) -> why its loss runs the model a second time per micro-batch besides a
    # reference model (KTO's KL rows), or None; a pipeline-parallel backend runs it once
    second_forward: Callable | None = None
    # (method config, micro_batch, grad_accum, dp) -> the step's batch shape, for a method whose
    # options set it (GRPO's prompts x generations); None: micro_batch x grad_accum rows per rank
    batch: Callable | None = None

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
        if problems:
            raise TypeError(f"method spec {self.name!r}: " + "; ".join(problems))
