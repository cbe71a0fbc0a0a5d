"""One client's trained model (LoRA on the served base model, its AdamW) and the samplers.

Built from the workbench's own parts: the model and its adapters come from
`workbench.models.build.build_model` (the loader, LoRA wrapping and the precision policy the
runner uses), the optimizer from `workbench.compute.optim.build_optimizer`, the step from
`workbench.backends.step` (`accumulate` runs the loss under the run's autocast and LoRA input
handling; `clip_and_step` clips and steps), checkpoints in the canonical format
(`workbench.checkpoints.canonical`) published whole (`workbench.core.atomic`), and sampler weights as
a PEFT adapter folder (`adapter_model.safetensors` + `adapter_config.json`).

Everything here runs on the futures' single worker thread (workbench/serve/futures.py).

    tm = TrainedModel(model_id, lora, run)
    outputs, metrics = tm.forward_backward(request)     # gradients accumulate until optim_step
    metrics = tm.optim_step({"learning_rate": 1e-4, ...})
    tm.save_state(folder); tm.load_state(folder, optimizer=True)
    seqs, prompt_lp = sample(engine, adapter, tokenizer, run, prompt, n, params, prompt_logprobs=True)
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from omegaconf import OmegaConf

from workbench.backends.step import accumulate, clip_and_step
from workbench.checkpoints import canonical
from workbench.compute import precision as prec
from workbench.compute.optim import build_optimizer
from workbench.core import atomic
from workbench.models.build import build_model
from workbench.models.load import build_meta
from workbench.peft.lora import linear_names
from workbench.rollout.generate import gumbel_max
from workbench.serve import losses
from workbench.serve.futures import ServeError
from workbench.train.batch import StepBatch

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj", "fc1", "fc2", "w1", "w2", "w3")
# Tinker's AdamParams defaults, the optimizer's state until the first optim_step sets them
ADAM_DEFAULTS = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                 "grad_clip_norm": 0.0}


@dataclass(frozen=True)
class Lora:
    """What a LoRA training client asked for (types.LoraConfig). `train_unembed` is recorded but
    not applied: the workbench adapts the decoder blocks' linear layers only (never lm_head)."""

    rank: int = 32
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    def targets(self, available: list[str]) -> list[str]:
        want = [n for n in available if (self.train_attn and n in ATTN) or (self.train_mlp and n in MLP)]
        if not want:
            raise ServeError("LoRA needs train_attn or train_mlp: the workbench adapts the decoder blocks' "
                             f"linear layers ({', '.join(available)}), not the unembedding alone")
        return want

    def key(self) -> tuple:
        return (self.rank, self.train_mlp, self.train_attn)


def build(run, lora: Lora) -> torch.nn.Module:
    """The served base model with LoRA adapters of this rank on the chosen layers."""
    if not 1 <= lora.rank <= 512:
        raise ServeError(f"LoRA rank {lora.rank}: choose 1 to 512")
    targets = lora.targets(linear_names(build_meta(run.cfg.model)))
    cfg = OmegaConf.merge(OmegaConf.to_container(run.cfg, resolve=True),
                          {"peft": {"r": lora.rank, "target_modules": targets}})
    with torch.random.fork_rng(devices=[]):  # the adapters' initial weights: the client's seed if given
        if lora.seed is not None:
            torch.manual_seed(lora.seed)
        return build_model(replace(run, cfg=cfg))


class _Fixed:
    """The schedule clip_and_step expects, for a client that sends its learning rate every step."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def step(self) -> None:
        pass


class TrainedModel:
    def __init__(self, model_id: str, base_model: str, lora: Lora, run, micro_batch: int):
        self.model_id, self.base_model, self.lora, self.run = model_id, base_model, lora, run
        self.device = run.model_device
        self.micro_batch = max(1, int(micro_batch))
        self.model = build(run, lora)
        self.trainable = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.optimizer = self._optimizer()
        self.steps = 0  # optimizer steps taken
        self.fwdbwd = 0  # forward_backward calls since creation
        self.has_grads = False

    def _optimizer(self):
        a = ADAM_DEFAULTS
        return build_optimizer(self.model.parameters(), OmegaConf.create(
            {"name": "adamw", "lr": a["learning_rate"], "betas": [a["beta1"], a["beta2"]], "eps": a["eps"],
             "weight_decay": a["weight_decay"]}))

    def info(self) -> dict:
        return {"model_id": self.model_id, "base_model": self.base_model, "lora_rank": self.lora.rank,
                "train_mlp": self.lora.train_mlp, "train_attn": self.lora.train_attn,
                "train_unembed": self.lora.train_unembed, "seed": self.lora.seed}

    # -- training ------------------------------------------------------------------------------
    def forward_backward(self, req) -> tuple[list[dict], dict[str, float]]:
        """The request's summed loss and per-datum outputs; gradients added to the parameters'
        (forward_only: no gradient, nothing kept)."""
        outputs: list[dict] = []
        fn = losses.make(req.loss_fn, req.config, outputs)
        chunks = [req.data[i:i + self.micro_batch] for i in range(0, len(req.data), self.micro_batch)]
        micro = [losses.batch(c, self.device) for c in chunks]
        tokens = sum(len(d.tokens) for d in req.data)
        if req.forward_only:
            total = 0.0
            self.model.eval()
            with torch.no_grad(), prec.autocast(self.run.precision, self.device):
                for m in micro:
                    total += float(fn(self.model, m)[0])
            self.model.train()
        else:
            self.model.train()
            # denom 1: Tinker losses are sums, the client does any normalising (weights, advantages)
            stats = accumulate(self.model, StepBatch(micro=micro, denom=1.0, tokens=tokens), fn,
                               self.run.precision, self.device, world=1)
            total = stats["loss"]
            self.has_grads = True
            self.fwdbwd += 1
        return outputs, {"loss:sum": float(total)}

    def optim_step(self, params: dict) -> dict[str, float]:
        p = {**ADAM_DEFAULTS, **params}
        if p["learning_rate"] < 0 or not (0 <= p["beta1"] < 1 and 0 <= p["beta2"] < 1) or p["eps"] < 0:
            raise ServeError(f"optim_step: AdamParams out of range ({p})")
        for g in self.optimizer.param_groups:  # AdamW reads these from the group at every step
            g.update(lr=p["learning_rate"], betas=(p["beta1"], p["beta2"]), eps=p["eps"],
                     weight_decay=p["weight_decay"])
        if not self.has_grads:  # nothing accumulated: no update (AdamW would still decay the moments)
            return {"grad_norm": 0.0, "lr": p["learning_rate"], "skipped": 1.0}
        out = clip_and_step(self.model.parameters(), self.optimizer, _Fixed(self.optimizer), None,
                            float(p["grad_clip_norm"]))
        self.has_grads = False
        self.steps += 1
        return out

    # -- state ---------------------------------------------------------------------------------
    def adapter(self) -> dict[str, torch.Tensor]:
        """The trainable (adapter) tensors as they are now, copied to the CPU."""
        params = dict(self.model.named_parameters())
        return {n: params[n].detach().to("cpu", copy=True) for n in self.trainable}

    def _meta(self, kind: str) -> dict:
        return {"format": f"workbench-serve/{kind}/1", "model_id": self.model_id, "base_model": self.base_model,
                "lora": asdict(self.lora),
                "optimizer_steps": self.steps, "time": time.time()}

    def save_state(self, final: Path) -> None:
        """Weights and AdamW state (canonical checkpoint) plus meta.json, published whole."""
        with atomic.publishing(final) as tmp:
            canonical.write(tmp / "canonical", canonical.torch_state(self.model, self.optimizer, self.trainable))
            (tmp / "meta.json").write_text(json.dumps(self._meta("state"), indent=1))

    def load_state(self, folder: Path, optimizer: bool) -> None:
        meta = read_meta(folder)
        theirs = Lora(**{k: meta["lora"][k] for k in ("rank", "train_mlp", "train_attn")})
        if theirs.key() != self.lora.key():
            raise ServeError(f"{folder.name}: saved with LoRA rank {theirs.rank} (mlp {theirs.train_mlp}, attn "
                             f"{theirs.train_attn}); this model has rank {self.lora.rank} (mlp {self.lora.train_mlp}, "
                             f"attn {self.lora.train_attn})")
        self.optimizer = self._optimizer()
        if optimizer:
            canonical.torch_load(self.model, self.optimizer, self.trainable, canonical.reader(folder / "canonical"))
            self.steps = int(meta.get("optimizer_steps", 0))
        else:  # weights only; the optimizer starts afresh
            flat = canonical.read_all(folder / "canonical")
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for n in self.trainable:
                    params[n].copy_(flat[f"model/{canonical.canonical_name(n)}"])
            self.steps = 0
        self.model.zero_grad(set_to_none=True)
        self.has_grads = False

    def save_adapter(self, final: Path) -> None:
        """A PEFT adapter folder (loadable with peft.PeftModel.from_pretrained) plus meta.json."""
        with atomic.publishing(final) as tmp:
            self.model.save_pretrained(str(tmp))
            (tmp / "meta.json").write_text(json.dumps(self._meta("sampler"), indent=1))


def read_meta(folder: Path) -> dict:
    try:
        return json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise ServeError(f"{folder}: not a checkpoint this service wrote ({type(exc).__name__})") from None


def load_adapter(engine: torch.nn.Module, folder: Path) -> dict[str, torch.Tensor]:
    """The adapter tensors of a saved sampler folder, by the engine's parameter names."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    before = {n: p.detach().clone() for n, p in engine.named_parameters() if p.requires_grad}
    set_peft_model_state_dict(engine, load_file(str(folder / "adapter_model.safetensors")))
    after = {n: p.detach().to("cpu", copy=True) for n, p in engine.named_parameters() if p.requires_grad}
    with torch.no_grad():  # leave the engine as it was; the sampler keeps its own copy
        for n, p in engine.named_parameters():
            if n in before:
                p.copy_(before[n])
    return after


# -- sampling ------------------------------------------------------------------------------------
def _stops(tokenizer, stop) -> tuple[list[int], list[str]]:
    """Stop token ids and stop strings from SamplingParams.stop (None: the tokenizer's EOS)."""
    if stop is None:
        eos = tokenizer.eos_token_id
        return ([eos] if isinstance(eos, int) else list(eos or [])), []
    if isinstance(stop, str):
        return [], [stop]
    stop = list(stop)
    if all(isinstance(s, int) for s in stop):
        return stop, []
    if all(isinstance(s, str) for s in stop):
        return [], stop
    raise ServeError("SamplingParams.stop: a string, a list of strings or a list of token ids")


@torch.no_grad()
def sample(engine, adapter: dict | None, tokenizer, run, prompt: list[int], n: int, params: dict,
           prompt_logprobs: bool, max_position: int):
    """`n` completions of `prompt` with their token log-probs (the model's, at temperature 1) and
    stop reasons; the prompt's log-probs when asked (NaN at position 0)."""
    if not prompt:
        raise ServeError("sample: an empty prompt")
    if not 1 <= n <= 64:
        raise ServeError(f"sample: num_samples={n}; choose 1 to 64")
    room = max_position - len(prompt)
    max_new = min(int(params.get("max_tokens") or 64), room)
    if max_new < 1:
        raise ServeError(f"sample: the prompt has {len(prompt)} tokens, the model's context is {max_position}")
    stop_ids, stop_strs = _stops(tokenizer, params.get("stop"))
    temperature = float(params.get("temperature", 1.0))
    top_k, top_p = int(params.get("top_k", -1)), float(params.get("top_p", 1.0))
    device, pol = run.model_device, run.precision
    saved = None
    if adapter is not None:
        live = dict(engine.named_parameters())
        saved = {k: live[k].detach().clone() for k in adapter}
        for k, v in adapter.items():
            live[k].copy_(v)
    ctx = engine.disable_adapter() if adapter is None and hasattr(engine, "disable_adapter") else _null()
    engine.eval()
    cfg = engine.config
    old_cache, cfg.use_cache = cfg.use_cache, True
    try:
        with ctx, torch.random.fork_rng(devices=[]), prec.autocast(pol, device):
            if params.get("seed") is not None:
                torch.manual_seed(int(params["seed"]))
            ids = torch.tensor([prompt] * n, device=device)
            do_sample = temperature > 0
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop_ids or [0])[0]
            out = engine.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=do_sample,
                temperature=temperature if do_sample else None, top_p=top_p if do_sample else None,
                top_k=top_k if (do_sample and top_k > 0) else None, eos_token_id=stop_ids or None, pad_token_id=pad,
                stop_strings=stop_strs or None, tokenizer=tokenizer if stop_strs else None,
                logits_processor=gumbel_max() if do_sample else None)
            rows = []
            for row in out[:, len(prompt):].tolist():
                rows.append(_cut(row, stop_ids, stop_strs, tokenizer, max_new))
            width = len(prompt) + max(len(t) for t, _ in rows)
            full = torch.full((n, width), pad, dtype=torch.long, device=device)
            for i, (toks, _) in enumerate(rows):
                full[i, :len(prompt) + len(toks)] = torch.tensor(prompt + toks)
            logits = engine(input_ids=full, attention_mask=(torch.arange(width, device=device)[None, :] <
                            torch.tensor([len(prompt) + len(t) for t, _ in rows], device=device)[:, None]).long()).logits
            logp = torch.log_softmax(logits.float(), dim=-1)
    finally:
        cfg.use_cache = old_cache
        if saved is not None:
            live = dict(engine.named_parameters())
            for k, v in saved.items():
                live[k].copy_(v)
    seqs = []
    for i, (toks, reason) in enumerate(rows):
        pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(toks), device=device)
        lp = logp[i, pos, torch.tensor(toks, dtype=torch.long, device=device)].tolist() if toks else []
        seqs.append((toks, lp, reason))
    plp = None
    if prompt_logprobs:
        pos = torch.arange(0, len(prompt) - 1, device=device)
        plp = [float("nan")] + logp[0, pos, torch.tensor(prompt[1:], dtype=torch.long, device=device)].tolist()
    return seqs, plp


def _cut(row: list[int], stop_ids: list[int], stop_strs: list[str], tokenizer, max_new: int) -> tuple[list[int], str]:
    """A generated row up to and including its first stop token (or the token that completes a
    stop string), and why it ended."""
    for j, t in enumerate(row):
        if t in stop_ids:
            return row[: j + 1], "stop"
        if stop_strs and any(s in tokenizer.decode(row[: j + 1]) for s in stop_strs):
            return row[: j + 1], "stop"
    return row[:max_new], "length"


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
