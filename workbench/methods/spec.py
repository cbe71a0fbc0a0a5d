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
REFERENCE_NEEDS = ("none", "method", "kl")


@dataclass(frozen=True)
class MethodFacts:
    data: str  # sft (chat/text rows) | preference (prompt, chosen, rejected) | unpaired (prompt, completion, label) | prompts
    sequences: int = 1  # sequences one example puts through the model per step (chosen + rejected = 2)
    # the reference model the loss needs: none | method (method.reference: auto/adapter/copy/precomputed)
    # | kl (only when method.beta > 0: the adapter-free base under peft, a frozen copy without)
    reference: str = "none"
    generates: bool = False  # samples completions with the policy during training
    teacher: bool = False  # loads a second (teacher) model, frozen
    scalar_head: bool = False  # a value/reward head on the last hidden state instead of the LM head
    eval: str = "loss"  # the default evaluation on the user's own held-out rows (workbench/evals)
    # the embedded task's evaluation where the default (eval=arith: exact match of generated
    # answers) says nothing about the trained model, as for a reward model, which does not generate
    embedded_eval: str | None = None


@dataclass(frozen=True)
class MethodSpec:
    name: str
    config: type  # the options dataclass; conf/method/<name>.yaml composes onto it
    build: Callable  # (method config, Context) -> a Method (workbench/methods/base.py)
    facts: MethodFacts

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
