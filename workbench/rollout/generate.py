"""Batched generation with HF `generate` (KV cache), left-padded, with the model's end-of-turn.

Used by evaluation hooks and GRPO rollouts (`generate(..., num_return_sequences=G)`). The model
is switched to eval mode with the KV cache on for the call and restored afterwards.

Shared prefill (`dedup=True`, the default): HF's own path repeats every prompt G times before
the prefill, so a GRPO rollout pays for G identical prefills per prompt. Here each distinct
prompt is prefilled once (all but its last token), the KV cache is expanded to the G
continuations, and HF `generate` continues from that cache: its first forward feeds just the
last prompt token of every row. The rows, their order (prompt i's continuations are rows
i*G .. i*G+G-1, as in HF's expansion) and the random draws are the same as on the plain path;
the logits can differ from it only by rounding (other batch shapes), which the Gumbel-max draw
below is stable under, so the sampled completions are the same under a fixed seed.
`dedup=False` selects the plain path (tests/unit/test_generate_dedup.py compares the two).
Under sharded weights (synced=True) every rank still makes one prefill forward, so the
ranks' collectives stay matched.

Stopping: HF stops the loop as soon as every row has produced the end-of-turn (the
`eos_token_id` stopping criterion), so short completions do not run to max_new_tokens. A
static KV cache (`cache_implementation="static"`) was slower on CPU for these short rollouts
and is not used.

Sampling draws each token by the Gumbel-max rule (argmax of the warped logits plus Gumbel
noise), which picks token i with exactly probability softmax(logits)_i, like HF's own
multinomial draw. It is used because it is stable under rounding: the multinomial draw inverts
a cumulative sum over the whole vocabulary, so a last-bit difference in the logits (another
CPU's matmul kernels, another thread count) moves every boundary of that sum and flips about
one draw in a thousand on a flat distribution; an argmax flips only when the top two perturbed
scores are within rounding of each other. Rollouts, and so GRPO runs, then repeat on any machine.

The noise: with `noise_keys` (one per conversation; GRPO passes (train.seed, step, the prompt's
global sample index)), each completion draws from a generator of its own keyed by its
conversation's key and its index among the G (workbench/train/noise.py), so the same prompt at
the same step gets the same completions on 1 rank or 4, in any batch. Without keys the noise
comes from the process's generator (evaluation, distillation).
"""

from __future__ import annotations

import contextlib

import torch

from workbench.data.chat import prompt_ids
from workbench.peft.lora import base_model
from workbench.train import noise
from workbench.train.batch import Forward


def gumbel_max(rows: list[tuple] | None = None):
    """A logits processor that makes the draw deterministic given the noise: all mass on
    argmax(scores + Gumbel noise). It runs after HF's temperature and top-p warpers. `rows`: a
    key per output row (its uniforms come from a generator of its own), else the process's
    generator draws them."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class GumbelMax(LogitsProcessor):
        gens: list | None = None

        def uniforms(self, scores):
            if rows is None:
                return torch.rand(scores.shape, device=scores.device, dtype=torch.float32)
            if self.gens is None:
                self.gens = [noise.generator(*k, device=scores.device) for k in rows]
            return torch.stack([torch.rand(scores.shape[-1], generator=g, device=scores.device) for g in self.gens])

        def __call__(self, input_ids, scores):
            u = self.uniforms(scores)
            u = u.clamp_(torch.finfo(torch.float32).tiny, 1.0 - torch.finfo(torch.float32).eps)
            pick = (scores.float() - torch.log(-torch.log(u))).argmax(-1, keepdim=True)
            out = torch.full_like(scores, float("-inf"))
            return out.scatter_(-1, pick, 0.0)

    return LogitsProcessorList([GumbelMax()])


def _left_pad(prompts: list[list[int]], width: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    return ids, attn


def _contiguous_input(module, args):
    """The output head's input, made contiguous when it is a slice. HF's causal LMs hand the head
    `hidden[:, -1:, :]` under `logits_to_keep=1`: a [rows, 1, hidden] view with the prompt's stride.
    torch's matmul folds that into one mm only when the weight requires grad; a frozen head (LoRA)
    fed the view itself (bf16 weights: autocast makes no copy) gets its weight expanded to one copy
    per row and a bmm (Gemma 3 270M, 50 rows: 16.7 GB and 20 s for one prefill, instead of 0.03 s)."""
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None


def _keeps_logits(model) -> bool:
    """Whether the causal LM's forward takes `logits_to_keep` (HF generate asks the same)."""
    import inspect


    return "logits_to_keep" in inspect.signature(base_model(model).forward).parameters


def _shared_prefill(model, ids: torch.Tensor, attn: torch.Tensor, rows: torch.Tensor, keep_one: bool):
    """KV cache of all but the last column of the distinct prompts `ids`, expanded so that
    row j of the result is prompt rows[j]. Position ids follow HF generate's rule (count of
    real tokens so far; padding at 0) so the cache holds what HF's own prefill would.
    keep_one: the model takes `logits_to_keep` (see _keeps_logits)."""
    ids, attn = ids[:, :-1], attn[:, :-1]
    pos = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 0)
    # only the cache is wanted: the head on the last position alone where the model allows it, as
    # HF's own prefill does (its logits over every prompt position would be thrown away)
    keep = {"logits_to_keep": 1} if keep_one else {}
    cache = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **keep).past_key_values
    cache.reorder_cache(rows.to(ids.device))  # index_select on the batch dim of every layer
    return cache


def _forward_passes(distinct: int | None, width: int, rows: int, generated: int, keep_one: bool) -> list:
    """The forward passes of one generate call: the shared prefill of `distinct` prompts (all
    but their last token) or HF's own prefill of every row, the head on each prefilled row's
    last position (keep_one) or on all of them, then one decode step per generated token after
    the first, each row attending to the prompt and the tokens so far. On the shared path the
    first "decode" step is the prompts' last token."""
    if distinct is not None:
        prefill = Forward(distinct, width - 1, width - 1, distinct * (1 if keep_one else width - 1))
        return [prefill] + [Forward(rows, 1, width + t, rows) for t in range(generated)]
    prefill = Forward(rows, width, width, rows * (1 if keep_one else width))
    return [prefill] + [Forward(rows, 1, width + t, rows) for t in range(1, generated)]


@contextlib.contextmanager
def _generating(model):
    """The model in eval mode with its KV cache on and the head's input made contiguous, for one
    generation call; restored afterwards."""
    was_training = model.training
    model.eval()
    head = getattr(base_model(model), "get_output_embeddings", lambda: None)()
    hook = head.register_forward_pre_hook(_contiguous_input) if isinstance(head, torch.nn.Module) else None
    cfg = getattr(model, "config", None)
    old_cache = getattr(cfg, "use_cache", None)
    if cfg is not None:
        cfg.use_cache = True
    try:
        yield
    finally:
        if hook is not None:
            hook.remove()
        if cfg is not None:
            cfg.use_cache = old_cache
        model.train(was_training)


@torch.no_grad()
def generate(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int, eot_id: int,
             do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
             num_return_sequences: int = 1, autocast=None, synced: bool = False,
             dedup: bool = True, passes: list | None = None, noise_keys: list[tuple] | None = None) -> list[list[int]]:
    """Completion token ids (end-of-turn and padding stripped) for each conversation; with
    num_return_sequences=G, G per conversation, conversation i's at [i*G, (i+1)*G).

    synced: every rank keeps stepping until all ranks are done (parameters sharded over ranks).
    dedup: prefill each distinct prompt once and share its KV cache (see the module docstring);
    False: HF's plain path, which prefills every one of the len(conversations) x G rows.
    passes: a list that receives the forward passes made (workbench.train.batch.Forward), for the FLOP count.
    noise_keys: one key per conversation for the sampling noise (see the module docstring)."""
    prompts = [prompt_ids(tokenizer, c) for c in conversations]
    return generate_ids(model, prompts, max_new_tokens, eot_id, tokenizer.pad_token_id, do_sample=do_sample,
                        temperature=temperature, top_p=top_p, num_return_sequences=num_return_sequences,
                        autocast=autocast, synced=synced, dedup=dedup, passes=passes, noise_keys=noise_keys)


@torch.no_grad()
def generate_ids(model, prompts: list[list[int]], max_new_tokens: int, eot_id: int, pad: int,
                 do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
                 num_return_sequences: int = 1, autocast=None, synced: bool = False,
                 dedup: bool = True, passes: list | None = None, noise_keys: list[tuple] | None = None) -> list[list[int]]:
    """`generate` on prompts already tokenised (distillation's on-policy completions)."""
    width = max(len(p) for p in prompts)
    G = num_return_sequences
    # output rows are prompt-major on both paths: row j continues prompt j // G as its (j % G)-th
    row_keys = [(*noise_keys[j // G], j % G) for j in range(len(prompts) * G)] if noise_keys is not None else None
    ids, attn = _left_pad(prompts, width, pad)
    # distinct prompts, and for every output row the distinct prompt it continues
    first: dict[tuple, int] = {}
    owner = [first.setdefault(tuple(p), len(first)) for p in prompts]
    shared = dedup and width > 1 and len(first) < len(prompts) * G
    keep_one = _keeps_logits(model)  # the head on the last prefilled position only
    device = next(model.parameters()).device
    with _generating(model), (autocast or contextlib.nullcontext()):
        extra = {}
        if shared:
            distinct = [list(k) for k in first]  # in order of first appearance
            u_ids, u_attn = _left_pad(distinct, width, pad)  # same width: same positions and masks
            rows = torch.tensor([owner[i] for i in range(len(prompts)) for _ in range(G)])
            extra["past_key_values"] = _shared_prefill(model, u_ids.to(device), u_attn.to(device), rows,
                                                       keep_one)
            ids, attn, G = ids.repeat_interleave(G, dim=0), attn.repeat_interleave(G, dim=0), 1
        out = model.generate(
            input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max_new_tokens,
            do_sample=do_sample, temperature=temperature if do_sample else None,
            top_p=top_p if do_sample else None, top_k=None,
            num_return_sequences=G, eos_token_id=eot_id, pad_token_id=pad,
            synced_gpus=synced, logits_processor=gumbel_max(row_keys) if do_sample else None, **extra,
        )
    if passes is not None:
        passes += _forward_passes(len(first) if shared else None, width, int(out.shape[0]), int(out.shape[1]) - width,
                                  keep_one)
    completions = []
    for row in out[:, width:].tolist():
        if eot_id in row:
            row = row[: row.index(eot_id)]
        completions.append([t for t in row if t != pad])
    return completions


@torch.no_grad()
def longest_step(model, prompts: list[list[int]], max_new_tokens: int, pad: int, num_return_sequences: int,
                 temperature: float = 1.0, autocast=None) -> torch.Tensor:
    """What `dry_run=trace` executes of a rollout (workbench/plan/trace_rollout.py): the passes of
    `generate_ids` that hold the most memory when every row runs to max_new_tokens. The shared
    prefill of the distinct prompts, as above; the KV cache grown through the cache's own update
    to its length two steps before the end; the last two decode steps, each with the sampler as HF
    generate's loop runs it (an fp32 copy of the logits, the warpers and the Gumbel-max scores, a
    softmax and a draw), whose tensors the loop holds until the next step replaces them. The decode
    steps before differ from these only by a shorter cache, and HF generate decides whether to run
    them from token values, which fake tensors do not carry: none of them runs here. Returns the
    drawn tokens."""
    width, G = max(len(p) for p in prompts), num_return_sequences
    ids, attn = _left_pad(prompts, width, pad)
    device = next(model.parameters()).device
    rows = torch.arange(len(prompts)).repeat_interleave(G)
    keep_one = _keeps_logits(model)
    sampler = gumbel_max()
    steps = min(2, max_new_tokens)
    grown = max_new_tokens - steps  # the decode steps not run: the prompt's last token and those drawn before
    with _generating(model), (autocast or contextlib.nullcontext()):
        cache = _shared_prefill(model, ids.to(device), attn.to(device), rows.to(device), keep_one)
        for i, layer in enumerate(cache.layers):
            shape = (*layer.keys.shape[:-2], grown, layer.keys.shape[-1])
            cache.update(layer.keys.new_zeros(shape), layer.values.new_zeros(shape), i)
        token = torch.full((len(rows), 1), pad, dtype=torch.long, device=device)
        for k in range(steps):
            mask = torch.cat([attn[rows], torch.ones(len(rows), grown + k, dtype=attn.dtype)], dim=1).to(device)
            out = model(input_ids=token, attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                        past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1, :].to(dtype=torch.float32, copy=True)
            scores = sampler(token, logits / temperature if temperature != 1.0 else logits)
            probs = torch.softmax(scores, dim=-1)
            token = torch.multinomial(probs, num_samples=1)
            del out  # as HF's loop: the step's logits, scores and probabilities live on into the next step
        return token
