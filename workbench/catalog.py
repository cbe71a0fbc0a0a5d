"""What each training method needs from the rest of the workbench, decided once.

The method modules (workbench/methods/) hold the losses; this table holds the facts the layers
below and beside them read without importing a method: which data shape a method reads, which
reference model its loss needs, how many sequences one example puts in a micro-batch, whether
it generates, which extra model it loads, and its default evaluation on the user's own data.
Config (default eval), preflight (the first row rendered), resolved (the reference), the rules
and the planner (memory and FLOPs) all read `facts(name)`.
"""

from __future__ import annotations

from dataclasses import dataclass


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


METHODS: dict[str, MethodFacts] = {
    "sft": MethodFacts(data="sft"),
    "dpo": MethodFacts(data="preference", sequences=2, reference="method", eval="preference"),
    "kto": MethodFacts(data="unpaired", sequences=2, reference="method", eval="preference"),
    "cpo": MethodFacts(data="preference", sequences=2, eval="preference"),
    "orpo": MethodFacts(data="preference", sequences=2, eval="preference"),
    "rm": MethodFacts(data="preference", sequences=2, scalar_head=True, eval="reward_accuracy", embedded_eval="arith_rm"),
    "grpo": MethodFacts(data="prompts", reference="kl", generates=True, eval="reward"),
    "distill": MethodFacts(data="sft", teacher=True, generates=True),  # on-policy on a share (lmbda) of steps
}


def facts(name: str | None) -> MethodFacts:
    """A method's facts; an unknown name reads as SFT's (config validation names the bad value)."""
    return METHODS.get(name or "sft", METHODS["sft"])
