"""method=distill: knowledge distillation from a frozen teacher (generalised KD, Agarwal et al. 2024).

    python -m workbench method=distill method.teacher=/models/teacher           # a local HF directory
    python -m workbench method=distill method.teacher=runs/big                  # a run's export/merged/
    python -m workbench method=distill method.teacher=smollm2-135m model=tiny   # a conf/model/ entry
    python -m workbench method=distill method.teacher=owner/name method.beta=1 method.lmbda=1   # on-policy reverse KL

The student learns the teacher's whole next-token distribution on the completion (label) tokens
of SFT-shaped data (data_recipes/<method.recipe>.yaml). Per completion token, with
p_s = softmax(z_s / T) and p_t = softmax(z_t / T) (T = `temperature`), the loss is the
generalised Jensen-Shannon divergence

    beta = 0:     KL(p_t || p_s)                                   (forward KL)
    beta = 1:     KL(p_s || p_t)                                   (reverse KL)
    otherwise:    beta KL(p_t || m) + (1 - beta) KL(p_s || m),     m = beta p_t + (1 - beta) p_s

summed over the step's completion tokens and divided by their number in the global batch
(StepBatch.denom): TRL's "batchmean over tokens", gradient-accumulation correct. The math is
that of TRL's GKDTrainer.generalized_jsd_loss and DistillationTrainer; `temperature` scales both
distributions in the divergence and is the sampling temperature, as in DistillationTrainer
(GKDTrainer samples at it but computes its loss at T = 1). tests/unit/test_distill.py holds the
loss and its gradients to DistillationTrainer's.

One number, `beta`, chooses the divergence (as in TRL) instead of a separate `kl: forward |
reverse | jsd` switch: the three named cases are beta = 0, 1 and 0.5, and a second option
would only add combinations to refuse (kl=forward with beta=0.3).

On-policy data (GKD): each optimizer step is, with probability `lmbda`, on-policy: the student
generates the completion of every drawn example's prompt (the tokens before its last trained
span) with the backend's current weights, at `temperature`, up to `max_new_tokens`, and the loss
runs on those tokens; otherwise on the dataset's completions. The draw is a function of
(train.seed, step), the same on every rank (sharded generation is a collective) and after a
resume. Sampling uses workbench/rollout/generate.py's Gumbel-max draw on the run's RNG, as GRPO
does. Logged: on_policy (0/1 per step), completion_length (on-policy steps), entropy (the
student's per-token entropy at T).

The teacher (`method.teacher`: a model directory, an export or run directory, a conf/model/
entry or a hub id) must share the student's tokenizer: its vocabulary is compared with the
student's, and its logit width with the student's, before any weights load. It is loaded once
in attach(), frozen, in eval mode, on the run's device, in the precision's frozen dtype.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from workbench.compute import precision
from workbench.config.files import CONF_DIR, load_group_file
from workbench.config.rule import Rule
from workbench.config.schema import ModelConfig, pick
from workbench.core.errors import UserError
from workbench.data.chat import IGNORE
from workbench.data.collate import pad_batch
from workbench.data.mixing import Mixture
from workbench.data.pipeline import tokenise_recipe
from workbench.data.recipes import load_recipe
from workbench.methods.base import Method
from workbench.methods.batching import Batcher
from workbench.methods.spec import MethodFacts, MethodSpec, Rollouts
from workbench.models import load
from workbench.models.auto import adopt
from workbench.models.head import SelectiveLM
from workbench.rollout.generate import generate_ids
from workbench.train.batch import StepBatch


@dataclass
class Config:
    name: str = "distill"  # the method; method=distill sets it
    recipe: str = "arith_sft"  # data_recipes/<recipe>.yaml (SFT-shaped rows) when data.recipe is null
    teacher: str | None = None  # model directory | run or export directory | conf/model/ name | hub id
    beta: float = 0.5  # 0: forward KL(teacher||student), 1: reverse KL(student||teacher), between: JSD
    temperature: float = 1.0  # of both distributions in the divergence, and of sampling
    lmbda: float = 0.5  # share of steps on which the student generates the completions (on-policy)
    max_new_tokens: int = 16  # on-policy completion length at most


def check(cfg) -> None:
    """The options (SPEC.check, run when the run resolves, before any data or weights are read).
    A missing teacher and packed rows are the rules distill-needs-teacher and distill-packing below."""
    for field, value in (("beta", cfg.beta), ("lmbda", cfg.lmbda)):
        if not 0.0 <= value <= 1.0:
            raise UserError(f"method.{field} must be in [0, 1] (got {value})")
    if cfg.temperature <= 0:
        raise UserError(f"method.temperature must be > 0 (got {cfg.temperature})")
    if cfg.max_new_tokens < 1:
        raise UserError(f"method.max_new_tokens must be >= 1 (got {cfg.max_new_tokens})")


# -- the teacher: which model, and is its vocabulary the student's --------------------------
def teacher_config(spec: str, student):
    """The teacher as a model config (workbench/config/schema.py ModelConfig), read from files only."""
    from omegaconf import OmegaConf


    where = f"method.teacher={spec!r}"
    local = Path(spec).expanduser()
    if local.is_dir():
        # a model directory, an export directory (merged/) or a run directory (export/merged/)
        found = next((d for d in (local, local / "merged", local / "export" / "merged")
                      if (d / "config.json").exists()), None)
        if found is None:
            raise UserError(f"{where}: no config.json in {local}, {local}/merged or {local}/export/merged "
                            "(a Hugging Face model directory, an export directory or a run directory)")
        # not named after the directory: the name `tiny` means a random model to the loader
        node = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"name": "teacher", "path": str(found.resolve())})
    elif (CONF_DIR / "model" / f"{spec}.yaml").exists():
        node = load_group_file("model", spec)
    elif spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        node = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"name": spec.replace("/", "--"), "hub_id": spec})
    else:
        raise UserError(f"{where}: not a directory here, not a model in conf/model/, and not a hub id (owner/name)")
    node.attn_implementation = student.attn_implementation
    node.trust_remote_code = student.trust_remote_code
    try:
        adopt(node)  # a model by path or hub id: its architecture from its own config.json
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    return node


def _label(model_cfg, spec: str | None = None) -> str:
    if spec is not None:
        return f"teacher {spec!r}"
    return f"student model={model_cfg.name}" + (f" ({model_cfg.path})" if model_cfg.path else "")


def check_teacher(spec: str, teacher_cfg, student_cfg, student_tok) -> None:
    """UserError unless the teacher's tokenizer and logit width are the student's. Reads
    tokenizer files and config.json only: it runs before any weights load."""
    try:
        tok = load.load_tokenizer(teacher_cfg)
    except UserError as exc:
        raise UserError(f"method.teacher={spec!r}: {exc}") from None
    mine, theirs = student_tok.get_vocab(), tok.get_vocab()
    if mine != theirs:
        only_t = sorted(set(theirs) - set(mine))
        only_s = sorted(set(mine) - set(theirs))
        moved = sorted(t for t in set(mine) & set(theirs) if mine[t] != theirs[t])
        example = (f"{only_t[0]!r} only in the teacher's" if only_t else f"{only_s[0]!r} only in the student's"
                   if only_s else f"{moved[0]!r} has id {theirs[moved[0]]} vs {mine[moved[0]]}")
        raise UserError(f"{_label(teacher_cfg, spec)} and {_label(student_cfg)} have different tokenizers "
                        f"({len(theirs)} vs {len(mine)} tokens; e.g. {example}): distillation compares the "
                        "next-token distributions token by token, so the teacher must use the student's vocabulary")
    if int(teacher_cfg.arch.vocab) != int(student_cfg.arch.vocab):
        raise UserError(f"{_label(teacher_cfg, spec)} has {teacher_cfg.arch.vocab} output logits and "
                        f"{_label(student_cfg)} {student_cfg.arch.vocab}: the same tokenizer, but embedding "
                        "matrices of different sizes; distillation needs the same logit width")


# -- the loss ----------------------------------------------------------------------------
def generalised_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                    temperature: float = 1.0) -> torch.Tensor:
    """Per-token divergence (N,) between N x V student and teacher logits (module docstring).
    Student logits split over the vocabulary (backend=megatron's VocabShard) compute it
    vocabulary-parallel, on each rank's columns."""
    if not isinstance(student_logits, torch.Tensor):
        return student_logits.generalised_jsd(teacher_logits, beta, temperature)
    ls = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    lt = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if beta == 0.0:
        return (lt.exp() * (lt - ls)).sum(-1)
    if beta == 1.0:
        return (ls.exp() * (ls - lt)).sum(-1)
    lm = torch.logaddexp(ls + math.log(1.0 - beta), lt + math.log(beta))  # log of the mixture
    return beta * (lt.exp() * (lt - lm)).sum(-1) + (1.0 - beta) * (ls.exp() * (ls - lm)).sum(-1)


def token_entropy(logits, temperature: float = 1.0) -> torch.Tensor:
    """Per-token entropy (N,) of softmax(logits / T); vocabulary-parallel for a VocabShard."""
    if not isinstance(logits, torch.Tensor):
        return logits.entropy(temperature)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


# -- on-policy rows ------------------------------------------------------------------------
def prompt_length(labels: list[int]) -> int:
    """Tokens before the last trained span: the generation prompt of the example's last
    assistant turn (earlier turns, trained or not, are its context)."""
    end = max((i for i, lab in enumerate(labels) if lab != IGNORE), default=-1)
    start = end
    while start > 0 and labels[start - 1] != IGNORE:
        start -= 1
    return max(start, 0)


class Distill(Method):
    name = "distill"

    def __init__(self, cfg, ctx):
        self.cfg = cfg
        self.ctx = ctx
        self.batch = Batcher(ctx)  # the step's rows and micro-batches (workbench/methods/batching.py)
        self.teacher_cfg = None
        self.teacher = None
        self._step_tokens = 1.0

    # -- data ----------------------------------------------------------------------------
    def prepare(self, ctx) -> None:
        # the teacher's tokenizer first: a wrong teacher stops the run before data or weights load
        self.teacher_cfg = teacher_config(self.cfg.teacher, ctx.cfg.model)
        check_teacher(self.cfg.teacher, self.teacher_cfg, ctx.cfg.model, ctx.tokenizer)
        recipe = load_recipe(ctx.cfg.data.recipe)
        self.sources = tokenise_recipe(recipe, ctx.tokenizer, ctx.contract, ctx.cfg.data, "assistant")
        self.mixture = Mixture([len(s.examples) for s in self.sources], [s.source.weight for s in self.sources],
                               seed=ctx.cfg.data.shuffle_seed)
        if self.cfg.lmbda > 0:
            for s in self.sources:
                ex = s.examples
                # a row whose first token is trained (format text) has no prompt to generate from
                if len(ex) and ex.mask[ex.offsets[:-1]].any():
                    raise UserError(f"method.lmbda={self.cfg.lmbda}: on-policy steps generate completions for the "
                                    f"rows' prompts, but source {s.source.name!r} has rows without a prompt "
                                    "(plain text); use prompt/completion or chat rows, or method.lmbda=0")

    def data_report(self) -> dict:
        return {s.source.name: {**s.report(), "weight": s.source.weight} for s in self.sources}

    # -- teacher -------------------------------------------------------------------------
    def attach(self, backend) -> None:
        """Load the teacher once, frozen, in eval mode, on the run's device."""
        run = self.ctx.run
        try:
            # a random (catalog tiny) teacher seeds its init: the run's RNG must not move
            with torch.random.fork_rng(devices=[]):
                model = load.load_model(self.teacher_cfg, dtype=run.precision.load_dtype, device=run.device)
        except OSError as exc:
            raise UserError(f"method.teacher={self.cfg.teacher!r}: cannot load its weights "
                            f"({str(exc).splitlines()[0][:200]})") from None
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        precision.cast_params(model, run.precision)  # frozen parameters: the policy's frozen dtype
        self.teacher = SelectiveLM(model).eval()

    # -- batches -------------------------------------------------------------------------
    def on_policy(self, step: int) -> bool:
        """Whether step `step` trains on the student's own completions: a function of the run's
        seed and the step only, so every rank agrees and a resumed run repeats it."""
        lmbda = self.cfg.lmbda
        if lmbda <= 0.0 or lmbda >= 1.0:
            return lmbda >= 1.0
        return random.Random(f"distill:{self.ctx.cfg.train.seed}:{step}").random() < lmbda

    def _student_rows(self, backend, examples: list) -> tuple[list, list[int], list]:
        """(prompt + sampled completion, labels on the completion) for each example, the
        completions' lengths and the generation's forward passes (workbench.train.batch.Forward)."""
        c, tok, eot = self.cfg, self.ctx.tokenizer, self.ctx.contract.end_of_turn_id
        prompts = [ids[:prompt_length(labels)] for ids, labels in examples]
        passes = []  # the rollout's forward passes, for the FLOP count
        with backend.generation() as (model, synced):
            comp = generate_ids(model, prompts, c.max_new_tokens, eot, tok.pad_token_id, do_sample=True,
                                temperature=c.temperature, synced=synced,
                                autocast=precision.autocast(self.ctx.run.precision, self.ctx.device), passes=passes)
        rows = []
        for p, ids in zip(prompts, comp):
            # end-of-turn is trained when the completion stopped by itself (as GKD keeps its EOS)
            target = ids + ([eot] if len(ids) < c.max_new_tokens else [])
            rows.append((p + target, [IGNORE] * len(p) + target))
        return rows, [len(ids) for ids in comp], passes

    def next_batch(self, state, backend) -> StepBatch:
        _, mine = self.batch.draw(state.step, self.mixture.take)
        examples = [self.sources[s].examples[r] for s, r in mine]
        info = {f"mix/{s.source.name}": r for s, r in zip(self.sources, self.mixture.realised())}
        on = self.on_policy(state.step)
        info["on_policy"] = float(on)
        passes = []
        if on:
            examples, lengths, passes = self._student_rows(backend, examples)
            info["completion_length"] = sum(lengths) / len(lengths)
        pad = self.ctx.tokenizer.pad_token_id
        micro = self.batch.cut(examples, lambda rows: pad_batch(rows, pad))
        denom = float(sum(int(m["targets"].numel()) for m in micro))
        self._step_tokens = max(denom, 1.0)
        tokens = int(sum(int(m["attention_mask"].sum()) for m in micro))
        return StepBatch(micro=micro, denom=denom, tokens=tokens, info=info, forward_passes=passes)

    # -- loss ----------------------------------------------------------------------------
    def loss(self, model, micro: dict):
        c = self.cfg
        logits = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"], select=micro["select"])
        with torch.no_grad():
            teacher = self.teacher(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                                   select=micro["select"])
        per_token = generalised_jsd(logits, teacher, c.beta, c.temperature)
        with torch.no_grad():
            entropy = float(token_entropy(logits, c.temperature).sum())
        return per_token.sum(), {"entropy": entropy / self._step_tokens}

    def state_dict(self) -> dict:
        return {"mixture": self.mixture.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.mixture.load_state_dict(state["mixture"])


def build(cfg, ctx) -> Distill:
    return Distill(cfg, ctx)


RULES = (
    Rule("distill-needs-teacher", {"method": "distill"},
         lambda c, e: not pick(c, "method.teacher", None),
         "method=distill needs method.teacher: set it to a model dir, run dir, conf/model name or hub id "
         "(with model='s tokenizer)"),
    Rule("distill-packing", {"method": "distill", "data": "packing"},
         lambda c, e: bool(pick(c, "data.packing", False)),
         "method=distill compares the teacher's and the student's next-token distributions row by row: set "
         "data.packing=false"),
)

def rollouts(cfg) -> Rollouts:
    """What an on-policy step generates, for the planner: one completion of at most
    max_new_tokens per row of the micro-batch, with HF generate."""
    return Rollouts(groups=False, generations=1, completion_len=int(cfg.max_new_tokens), prompts_per_step=None,
                    num_iterations=1, share_prompt=False, old_logps=False, engine="hf", vllm_fraction=0.0)


SPEC = MethodSpec(name="distill", config=Config, build=build, check=check, rules=RULES, rollouts=rollouts,
                  facts=MethodFacts(data="sft", teacher=True, generates=True))  # on-policy on a share (lmbda) of steps
