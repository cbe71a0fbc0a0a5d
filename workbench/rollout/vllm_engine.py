"""Colocated vLLM engine for GRPO rollouts (`method=grpo method.engine=vllm`), in the training process.

    engine = VLLMEngine(cfg, tokenizer, contract)          # after the model is built
    engine.sync_weights(model)                              # after every optimizer step
    ids = engine.generate(convs, num_generations=8, max_new_tokens=64, temperature=1.0, top_p=1.0)

Phases alternate: generate (engine awake) -> sleep (KV cache freed, weights offloaded) ->
train -> wake -> sync weights -> generate ... `sync_weights` pushes the training model's
current weights, LoRA/QLoRA adapters merged (computed W + BA, the training model is never
modified), into the engine's model.

A rollout engine that silently keeps its old weights trains on stale samples and nothing
crashes. So every `verify_every`-th sync (and the first) is checked: the sum and the sum of
squares (float64) of every decoder-layer weight the engine holds must equal those of the
weights sent. Both are invariant under vLLM's fused q/k/v and gate/up concatenations, so
they compare across the two layouts exactly. A log-prob probe (a fixed prompt scored by
both models) is recorded beside it as an end-to-end check.

Options (read from the method config when present): vllm_gpu_memory_utilization (0.3),
vllm_sleep_level (1), vllm_verify_every (1; 0 = never), vllm_max_model_len (data.seq_len x 2),
vllm_enforce_eager (false), vllm_probe_tolerance (0.25, mean |delta log-prob|).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from workbench.data.chat import prompt_ids
from workbench.models.load import load_model, locate, materialise
from workbench.peft.lora import base_model

PROBE = [{"role": "user", "content": "What is 12 + 30? Answer with the number only."},
         {"role": "assistant", "content": "42"}]


@dataclass
class Options:
    """What the engine is given: the method maps its own options onto these (GRPO's vllm_*:
    workbench/methods/grpo.py vllm_options), so this module reads no method option."""

    gpu_memory_utilization: float = 0.3
    sleep_level: int = 1
    verify_every: int = 1
    max_model_len: int = 512
    enforce_eager: bool = False
    probe_tolerance: float = 0.25


# -- merged weights ---------------------------------------------------------------------------
def _dense(weight: torch.Tensor) -> torch.Tensor:
    """A frozen base weight as a plain tensor (NF4 weights dequantised)."""
    if type(weight).__name__ == "Params4bit":
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(weight.data, weight.quant_state)
    return weight.detach()


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF-named weights of `model` with active LoRA adapters added in (W + scale * B A).

    The training model is not modified (merge/unmerge in place would drift a bf16 base a
    little on every step)."""
    lm = base_model(model)
    out: dict[str, torch.Tensor] = {}
    lora_layers = {}
    try:
        from peft.tuners.lora import LoraLayer

        lora_layers = {n: m for n, m in lm.named_modules() if isinstance(m, LoraLayer)}
    except ImportError:
        pass
    for name, mod in lora_layers.items():
        if getattr(mod, "use_dora", {}) and any(mod.use_dora.values()):
            raise RuntimeError("weight sync merges LoRA adapters; DoRA adapters reach here only past rule vllm-dora")
        base = mod.get_base_layer()
        dense = _dense(base.weight)
        w = dense.float()
        if not getattr(mod, "merged", False):
            for adapter in mod.active_adapters:
                if adapter in mod.lora_A:
                    w = w + mod.get_delta_weight(adapter).float()
        out[f"{name}.weight"] = w.to(dense.dtype)  # one layer at a time in fp32, stored as the base
        if getattr(base, "bias", None) is not None:
            out[f"{name}.bias"] = base.bias.detach()
    for pname, p in lm.named_parameters():
        if "lora_" in pname or ".base_layer." in pname:
            continue
        out[pname] = p.detach()
    return out


def layer_checksum(named: dict[str, torch.Tensor] | list, dtype=torch.bfloat16) -> tuple[float, float]:
    """(sum, sum of squares) in float64 of every decoder-layer tensor, after a cast to `dtype`."""
    items = named.items() if isinstance(named, dict) else named
    s = sq = 0.0
    for name, t in items:
        if "layers." not in name:
            continue
        x = t.detach().to(dtype).double()
        s += float(x.sum())
        sq += float((x * x).sum())
    return s, sq


@torch.no_grad()
def hf_prompt_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 under the training model."""
    lm = base_model(model)
    was = lm.training
    lm.eval()
    device = next(lm.parameters()).device
    try:
        logits = lm(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0].float()
    finally:
        lm.train(was)
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return logp.gather(1, torch.tensor(ids[1:], device=device)[:, None])[:, 0].tolist()


# -- the engine ---------------------------------------------------------------------------------
class VLLMEngine:
    """Rollouts through an in-process vLLM model that mirrors the training weights."""

    def __init__(self, cfg, tokenizer, contract, opts: Options | None = None, adapter=None):
        """`opts`: the engine's options, which the method maps from its own (workbench/methods/grpo.py
        vllm_options); None: the defaults, with room for a prompt and a completion of data.seq_len each."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.contract = contract
        self.opts = opts or Options(max_model_len=2 * cfg.data.seq_len)
        if adapter is None:
            adapter = _VLLMAdapter(_weights_dir(cfg, tokenizer), self.opts, cfg.train.seed)
        self.llm = adapter
        self.awake = True
        self.syncs = 0
        self.last_check: dict = {}

    # phases
    def sleep(self) -> None:
        if self.awake:
            self.llm.sleep(self.opts.sleep_level)
            self.awake = False

    def wake(self) -> None:
        if not self.awake:
            self.llm.wake_up()
            self.awake = True

    def sync_weights(self, model: torch.nn.Module) -> dict:
        """Push the current (merged) weights; verify the engine holds them when due."""
        self.wake()
        weights = merged_state_dict(model)
        self.llm.load_weights([(n, t.to(torch.bfloat16)) for n, t in weights.items()])
        self.syncs += 1
        every = self.opts.verify_every
        if every and (self.syncs == 1 or self.syncs % every == 0):
            self.last_check = self.verify(model, weights)
        return self.last_check

    def verify(self, model: torch.nn.Module, weights: dict | None = None) -> dict:
        """Raise RuntimeError when the engine's weights are not the training model's."""
        sent = layer_checksum(weights if weights is not None else merged_state_dict(model))
        held = self.llm.layer_checksum()
        ok = all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6) for a, b in zip(sent, held))
        if not ok:
            raise RuntimeError(f"vLLM rollout engine does not hold the synced weights (layer checksum sent "
                               f"{sent}, engine has {held}); rollouts would come from stale weights")
        ids = _probe_ids(self.tokenizer)
        ref = hf_prompt_logprobs(model, ids)
        got = self.llm.prompt_logprobs(ids)
        diff = sum(abs(a - b) for a, b in zip(ref, got)) / max(len(ref), 1)
        if diff > self.opts.probe_tolerance:
            raise RuntimeError(f"vLLM rollout engine scores the probe differently from the training model "
                               f"(mean |delta log-prob| {diff:.3f} > {self.opts.probe_tolerance})")
        return {"sync": self.syncs, "checksum": held, "probe_logprob_delta": diff}

    def generate(self, conversations: list[list[dict]], num_generations: int, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0) -> list[list[int]]:
        """Completion ids, grouped per prompt: prompt 0's generations, then prompt 1's, ...

        End-of-turn and anything after it are stripped, as in rollout.generate."""
        self.wake()
        prompts = [prompt_ids(self.tokenizer, c) for c in conversations]
        eot, pad = self.contract.end_of_turn_id, self.tokenizer.pad_token_id
        groups = self.llm.generate(prompts, num_generations, max_new_tokens, temperature, top_p, [eot])
        self.sleep()
        out = []
        for group in groups:
            if len(group) != num_generations:
                raise RuntimeError(f"rollout engine returned {len(group)} generations, wanted {num_generations}")
            for row in group:
                row = list(row)
                if eot in row:
                    row = row[: row.index(eot)]
                out.append([t for t in row if t != pad])
        return out


    def generate_ids(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                     top_p: float = 1.0) -> list[list[int]]:
        """One completion per prompt given as token ids (a turn of multi-turn episodes,
        workbench/methods/grpo_env.py), end-of-turn stripped; the caller wakes the engine for
        the whole episode loop and puts it to sleep after, not per turn."""
        eot, pad = self.contract.end_of_turn_id, self.tokenizer.pad_token_id
        out = []
        for group in self.llm.generate(prompts, 1, max_new_tokens, temperature, top_p, [eot]):
            row = list(group[0])
            out.append([t for t in (row[: row.index(eot)] if eot in row else row) if t != pad])
        return out


def _probe_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(PROBE, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _weights_dir(cfg, tokenizer) -> str:
    """A directory vLLM can load: the resolved weights, or the tiny model saved once."""
    res = materialise(cfg.model, locate(cfg.model))
    if res.kind != "tiny":
        return res.path
    out = Path(cfg.output_dir) / "vllm_base"
    if not (out / "config.json").exists():
        load_model(cfg.model).save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    return str(out)


class _VLLMAdapter:
    """The few vLLM calls the engine needs, in one place (vLLM's internals move between versions)."""

    def __init__(self, path: str, opts: Options, seed: int):
        # In-process engine core: the model lives in this process, so weights load directly.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.llm = LLM(model=path, dtype="bfloat16", gpu_memory_utilization=opts.gpu_memory_utilization,
                       enable_sleep_mode=True, seed=seed, max_model_len=opts.max_model_len,
                       enforce_eager=opts.enforce_eager, skip_tokenizer_init=True)

    def _model(self):
        """The engine's torch model, reached in-process (V0 executor, or V1's in-process core)."""
        engine = self.llm.llm_engine
        core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
        for executor in (getattr(engine, "model_executor", None), getattr(core, "model_executor", None)):
            worker = getattr(executor, "driver_worker", None)
            worker = getattr(worker, "worker", worker)
            runner = getattr(worker, "model_runner", None)
            if runner is not None:
                return runner.model
        return None

    def _apply(self, fn):
        model = self._model()
        return fn(model) if model is not None else self.llm.apply_model(fn)[0]

    def load_weights(self, items) -> None:
        items = [(n, t.cuda()) for n, t in items]
        self._apply(lambda m: m.load_weights(weights=iter(items)))

    def layer_checksum(self) -> tuple[float, float]:
        return self._apply(lambda m: layer_checksum(list(m.named_parameters())))

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
        return [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]

    def generate(self, prompts, n, max_new_tokens, temperature, top_p, stop_ids):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(n=n, max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                            stop_token_ids=stop_ids, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs]

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        self.llm.wake_up()
