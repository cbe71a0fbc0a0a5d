"""method=grpo: group relative policy optimisation with verifiable rewards.

    python -m workbench method=grpo                                  # LoRA GRPO of SmolLM2-135M, reward=arith_exact
    python -m workbench method=grpo reward=arith_format method.num_generations=8
    python -m workbench method=grpo method.loss_type=dr_grpo method.scale_rewards=none   # Dr. GRPO
    python -m workbench method=grpo method.beta=0.04                 # KL to the reference (k3 estimator)
    python -m workbench method=gspo                                  # sequence-level ratio (GSPO)
    python -m workbench method=rloo                                  # leave-one-out baseline, KL in the reward
    python -m workbench method=grpo method.loss_type=cispo method.epsilon_high=5.0   # or loss_type=sapo

Every `num_iterations` steps, `next_batch` samples `num_generations` completions per prompt with
the backend's current weights (HF `generate` with the KV cache, or vLLM with
`method.engine=vllm`), scores them with the reward functions (workbench/rollout/rewards.py,
weighted sum; `truncated_reward`, when set, stands in for the sum of a completion cut at
max_new_tokens), and turns rewards into advantages (workbench/rollout/advantages.py: group-
normalised, or RLOO's leave-one-out baseline). The loss is the clipped ratio objective
min(r A, clip(r, 1-eps_low, 1+eps_high) A) per completion token, r = pi/pi_old per token or per
completion (GSPO), or CISPO's / SAPO's surrogate (workbench/rollout/objectives.py), plus
beta * KL(pi || ref) per token (k3 estimator, times the ratio unless
kl_importance_correction=false; or, kl_in_reward=true, subtracted from the reward as RLOO does),
normalised as `loss_type` says: grpo and sapo (mean over each completion's tokens, then over
completions), dapo and cispo (over all completion tokens of the step), dr_grpo (over
completions x max_new_tokens). Log-probs use logits divided by the sampling temperature.

Layout: with `share_prompt` (the default) the completions of one prompt inside a micro-batch are
one row, the prompt once and each completion as a branch that sees the prompt and itself only
(workbench/data/pair_tree.py branch_batch): the decoder reads each prompt once instead of
num_generations times, and every log-prob is the one the row-per-completion layout
(`share_prompt=false`) gives, up to rounding.

The global batch is train.micro_batch_size x grad_accum x ranks completions, i.e. that divided
by num_generations prompts; each rank generates and scores its own whole groups. Logged: reward
mean/std per function, completion lengths, clip fractions, KL, the share of the trained groups
with reward spread (`signal_share`; steps without any are warned about and can stop the run,
workbench/train/signal.py); a few sample completions of each generation go to
<run_dir>/samples/grpo.jsonl.

Resume: a checkpoint keeps the data position and, per rank, the rollouts already generated that
the next steps train on (`rollouts_state`: the one a further pass reuses, the one generated ahead),
so a run killed mid-rollout continues with the uninterrupted run's losses; `resume_facts` is the
certificate's `rl` part (docs/guides/resume.md, "GRPO and rollouts one step ahead").
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace

import torch

from workbench.compute import precision
from workbench.core import heartbeat
from workbench.core.secrets import redact, secret_values
from workbench.data.chat import IGNORE, prompt_ids
from workbench.data.collate import pad_batch
from workbench.data.mixing import Mixture, rank_share
from workbench.data.overfit import Overfit
from workbench.data.pair_tree import branch_batch, tree_fits
from workbench.data.preference import read_prompts
from workbench.data.recipes import load_recipe
from workbench.methods import grpo_trace
from workbench.methods.base import Method
from workbench.methods.grpo_env import EpisodeRollouts
from workbench.methods.grpo_rules import RULES, BatchShape, check, step_shape
from workbench.methods.reference import Reference
from workbench.methods.spec import MethodFacts, MethodSpec, Rollouts
from workbench.rollout import advantages, objectives, pending, rewards
from workbench.rollout.async_rollouts import AsyncRollouts
from workbench.rollout.generate import generate
from workbench.rollout.vllm_engine import Options as VLLMOptions
from workbench.rollout.vllm_engine import VLLMEngine
from workbench.train import sequence_parallel
from workbench.train.batch import Forward, StepBatch
from workbench.train.distributed import all_max, reduce_scalar
from workbench.train.signal import StallWatch


@dataclass
class Config:
    name: str = "grpo"  # the method; method=grpo (or the aliases gspo, rloo) sets it
    recipe: str = "arith_grpo"  # data_recipes/<recipe>.yaml (prompt rows) when data.recipe is null
    num_generations: int = 8  # completions per prompt (a group); >= 2
    max_new_tokens: int = 8  # tokens a sampled completion may take (with env=: env.max_new_tokens per turn)
    temperature: float = 1.0  # sampling temperature; the log-probs divide the logits by it too
    top_p: float = 1.0  # nucleus sampling: the smallest token set holding this probability; 1.0: every token
    loss_type: str = "dapo"  # grpo | dapo | dr_grpo | cispo | sapo (workbench/rollout/objectives.py)
    importance_sampling_level: str = "token"  # token | sequence (GSPO) | sequence_sum (RLOO)
    advantage: str = "group"  # group | rloo (leave-one-out baseline)
    scale_rewards: str = "group"  # advantage=group: group | batch | none (Dr. GRPO)
    normalize_advantages: bool = False  # advantage=rloo: centre and scale over the batch
    epsilon: float = 0.2  # the importance ratio is clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float | None = None  # None: same as epsilon (DAPO suggests 0.28); cispo: the weight cap
    sapo_temperature_pos: float = 1.0  # loss_type=sapo: gate temperature where A > 0
    sapo_temperature_neg: float = 1.05  # ... and where A <= 0
    beta: float = 0.0  # KL coefficient; > 0 needs a reference (adapter disabled, or a frozen copy)
    # weight the per-token KL by pi/pi_old: the samples come from pi_old (TRL's default too)
    kl_importance_correction: bool = True
    kl_in_reward: bool = False  # subtract beta x summed k1 KL from each reward (RLOO) instead of the loss
    num_iterations: int = 1  # optimisation steps per generation batch
    engine: str = "hf"  # hf | vllm
    # the total reward of a completion cut at max_new_tokens without ending, in place of what the
    # reward functions give it; None: scored like any other. A reward model reads a cut
    # completion as a finished turn it never saw in training; set this below what a finished
    # completion scores (the overlong penalty of DAPO, OpenRLHF and verl in its simplest form).
    truncated_reward: float | None = None
    # completions (with env=: episodes) per generation batch written to <run_dir>/samples/grpo.jsonl
    # (episodes.jsonl), with their rewards; 0: none
    log_completions: int = 3
    # generate the next step's rollout in a background thread while this step trains, with a
    # snapshot of the weights (one step off-policy, corrected by the ratio to the behaviour
    # policy's log-probs; workbench/rollout/async_rollouts.py)
    async_rollouts: bool = False
    share_prompt: bool = True  # one row per prompt in a micro-batch, completions as branches
    # prompts per optimizer step over all ranks; None: micro_batch_size x grad_accum x ranks /
    # num_generations. When set, the step's micro-batch count follows from it (batch_shape()).
    prompts_per_step: int | None = None
    # DAPO's dynamic sampling: drop groups whose rewards do not vary (zero advantage, no
    # signal) and refill from further prompts, at most max_resample_rounds times per step.
    dynamic_sampling: bool = True
    max_resample_rounds: int = 4  # refill rounds per step at most; 0: none
    stall_warn_steps: int = 3  # warn when most groups carried no signal this many steps in a row
    # end the run after stall_stop_steps steps in a row where no group carried signal (no gradient),
    # evaluating and exporting the last weights trained with signal (workbench/train/signal.py)
    stop_on_stall: bool = True
    stall_stop_steps: int = 10  # steps in a row without signal that end the run (stop_on_stall)
    # the colocated vLLM engine (method.engine=vllm; workbench/rollout/vllm_engine.py)
    vllm_gpu_memory_utilization: float = 0.3  # share of the GPU's memory the vLLM engine may take (weights + KV cache)
    # vLLM's sleep between rollouts: 1 frees the KV cache and offloads the weights to host memory,
    # 2 discards the weights too
    vllm_sleep_level: int = 1
    # check the first weight sync and every Nth after it (layer checksums and a log-prob probe); 0: never
    vllm_verify_every: int = 1
    vllm_max_model_len: int | None = None  # None: 2 x data.seq_len
    vllm_enforce_eager: bool = False  # no CUDA graphs: slower decoding, less memory and a faster start
    # the run stops when vLLM's and the training model's log-probs on the probe prompt differ by more
    # than this (mean absolute difference per token)
    vllm_probe_tolerance: float = 0.25


def vllm_options(cfg, seq_len: int) -> VLLMOptions:
    """The colocated vLLM engine's options from the vllm_* ones of this Config (`cfg`: the method
    node; `seq_len`: data.seq_len, whose double bounds a prompt and its completion by default)."""
    return VLLMOptions(cfg.vllm_gpu_memory_utilization, cfg.vllm_sleep_level, cfg.vllm_verify_every,
                       cfg.vllm_max_model_len or 2 * seq_len, cfg.vllm_enforce_eager, cfg.vllm_probe_tolerance)


def stopped(ids: list[int], max_new_tokens: int) -> bool:
    """Whether a completion ended by itself: the rollout engines drop the end-of-turn token, so
    one that ended is shorter than max_new_tokens and one cut off is exactly that long."""
    return len(ids) < max_new_tokens


def batch_shape(cfg, batch) -> BatchShape:
    """The step's shape from the method options and the resolved run's batch (ctx.run.batch:
    micro-batch, accumulation, data-parallel ranks; a resume at another world size changes the
    accumulation to keep the global batch, workbench/checkpoints/resume.py)."""
    return step_shape(cfg, batch.micro, batch.accum, batch.dp)


def collate(seqs: list[tuple[list[int], list[int]]], G: int, first: int, pad_id: int, tree: bool) -> dict:
    """A micro-batch of completions (prompt + completion ids, labels), the `first` of the step's
    and onward: one row per completion, or (tree) one row per prompt, its completions as
    branches. Either way the targets come completion by completion (`target_seq`)."""
    if tree:  # completions first+i share a prompt when (first+i) // G is the same
        groups: dict[int, list] = {}
        for i, seq in enumerate(seqs):
            groups.setdefault((first + i) // G, []).append(seq)
        return branch_batch(list(groups.values()), pad_id)
    m = pad_batch(seqs, pad_id)
    m["n_tokens"] = m["select"].sum(dim=1)
    m["target_seq"] = m["select"].nonzero()[:, 0]
    m["real_tokens"] = int(m["attention_mask"].sum())
    return m


def token_logps(model, micro: dict, temperature: float, entropy: bool = False):
    """Log-probs of the target tokens (flat, completion by completion), logits / temperature;
    with entropy=True also the policy's per-token entropy (no gradient), for the signal log.
    Tree rows compute the head once per read position; `head_slot` says which row each target
    reads (the prompt's last position predicts every completion's first token)."""
    return model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                 position_ids=micro.get("position_ids"), select=micro["select"], targets=micro["targets"],
                 slot=micro.get("head_slot"), temperature=temperature, entropy=entropy)


class GRPO(Method):
    name = "grpo"

    def __init__(self, cfg, ctx):
        self.cfg = cfg
        self.ctx = ctx
        self.overfit = Overfit(ctx.cfg.debug.overfit_batches)  # workbench/data/overfit.py
        self.reward_fns = rewards.resolve(ctx.cfg.reward)  # options: SPEC.check, when the run resolved
        reward = ctx.cfg.reward
        self.reward_timeout = float(reward.get("timeout_s", rewards.TIMEOUT_S) if hasattr(reward, "get") else
                                    rewards.TIMEOUT_S)
        self._step = 0  # the optimizer step the rollout is for (named by a reward function that fails)
        self.engine = None
        self.ref: Reference | None = None  # only for the KL term (workbench/methods/reference.py)
        self._cached: StepBatch | None = None
        self._uses = 0
        self._passes: list[Forward] = []  # this rollout's forward passes without gradient (FLOP count)
        self._step_tokens = 1.0
        self.shape = batch_shape(cfg, ctx.run.batch)
        self._rollout_state: dict | None = None  # where the cached rollout's prompts began (checkpoints)
        self._regenerate: dict | None = None  # a rollout to make again after resuming mid-iteration
        self._version = 0  # the optimizer steps behind the weights that sampled the cached rollout
        self._resumed: dict = {}  # what a resume put back (resume_facts)
        # env=<name>: rollouts are multi-turn episodes (workbench/methods/grpo_env.py)
        self.episodes = None
        if ctx.cfg.get("env") is not None:
            self.episodes = EpisodeRollouts(self)
        self._turn_tokens = self.episodes.turn_tokens if self.episodes else cfg.max_new_tokens
        self._async = None  # method.async_rollouts (set in attach, once the backend holds the model)

    # -- data ----------------------------------------------------------------------------
    def prepare(self, ctx) -> None:
        data = ctx.cfg.data
        recipe = load_recipe(data.recipe)
        self.sources = [read_prompts(s, ctx.tokenizer, ctx.contract, data) for s in recipe.sources]
        rewards.check_columns(self.reward_fns, ((r["_where"], r) for s in self.sources for r in s.rows))
        self.mixture = Mixture([len(s.rows) for s in self.sources], [s.source.weight for s in self.sources],
                               seed=data.shuffle_seed)
        if ctx.run.layout.is_main:
            print(self.shape.describe() + (" (dynamic sampling: groups without reward spread are refilled)"
                                           if self.cfg.dynamic_sampling else ""), file=sys.stderr)
            for rf in self.reward_fns:  # reward=judge: what each step asks of its server
                if hasattr(rf.fn, "plan_line"):
                    print(rf.fn.plan_line(self.shape.prompts * self.shape.generations), file=sys.stderr)

    def data_report(self) -> dict:
        return {s.source.name: {"prompts": len(s.rows), "fingerprint": s.fingerprint} for s in self.sources}

    def attach(self, backend) -> None:
        module = backend.unwrapped()
        self.tree = self.cfg.share_prompt and tree_fits(module, self.ctx.cfg.data.seq_len + self.cfg.max_new_tokens,
                                                        "using one row per completion")
        reference = self.ctx.run.reference  # none (beta=0) | adapter | copy: workbench/resolve/resolved.py
        if reference != "none":
            self.ref = Reference(reference, module)
        if self.cfg.engine == "vllm":
            self.engine = VLLMEngine(self.ctx.cfg, self.ctx.tokenizer, self.ctx.contract,
                                     vllm_options(self.cfg, self.ctx.cfg.data.seq_len))
        if self.cfg.async_rollouts:
            self._async = AsyncRollouts(module, self._rollout, self.mixture.state_dict)

    # -- rollouts ------------------------------------------------------------------------
    def _generate(self, backend, convs: list, keys: list[int]) -> list[list[int]]:
        """Completions of each conversation; `keys`: each prompt's global sample index, which with
        train.seed and the step keys its sampling noise (the same completions at any world size)."""
        c = self.cfg
        if self.engine is not None:
            self.engine.sync_weights(backend.unwrapped().inner)
            out = self.engine.generate(convs, c.num_generations, c.max_new_tokens, c.temperature, c.top_p)
            if out and out[0] and isinstance(out[0][0], list):  # grouped per prompt -> flat
                out = [ids for group in out for ids in group]
            eot, pad = self.ctx.contract.end_of_turn_id, self.ctx.tokenizer.pad_token_id
            return [[t for t in (ids[: ids.index(eot)] if eot in ids else ids) if t != pad] for ids in out]

        with backend.generation() as (model, synced), heartbeat.phase("rollout"):
            return generate(model, self.ctx.tokenizer, convs, c.max_new_tokens, self.ctx.contract.end_of_turn_id,
                            do_sample=True, temperature=c.temperature, top_p=c.top_p,
                            num_return_sequences=c.num_generations,
                            autocast=precision.autocast(self.ctx.run.precision, self.ctx.device), synced=synced,
                            passes=self._passes, noise_keys=[(self.ctx.cfg.train.seed, self._step, k) for k in keys])

    def _draw(self, per_rank: int) -> list[tuple[int, dict]]:
        """This rank's `per_rank` prompt rows of the next global draw, each with its global sample
        index (mixing.rank_share: every rank draws all of them, so the data position is the same
        everywhere and resumes exactly)."""
        start = sum(self.mixture.taken) + self.ctx.run.layout.dp_rank * per_rank
        _, mine = rank_share(self.ctx.run.layout, per_rank, self.mixture.take)
        return [(start + i, self.sources[s].rows[r]) for i, (s, r) in enumerate(mine)]

    def _groups(self, backend, drawn: list[tuple[int, dict]]) -> list[dict]:
        """Generate num_generations completions for each prompt row and score them: one record
        per group."""
        rows = [r for _, r in drawn]
        if self.episodes is not None:
            return self.episodes.groups(self, backend, rows)
        c, G = self.cfg, self.cfg.num_generations
        convs = [r["prompt"] for r in rows]
        comp = self._generate(backend, convs, [k for k, _ in drawn])
        if len(comp) != len(rows) * G:
            raise RuntimeError(f"rollout engine returned {len(comp)} completions for {len(rows)} x {G}")
        texts = [self.ctx.tokenizer.decode(ids, skip_special_tokens=True) for ids in comp]
        prompts = [r["prompt"] for r in rows for _ in range(G)]
        extra_cols = sorted({k for r in rows for k in r if k not in ("prompt", "_where")})
        columns = {k: [r.get(k) for r in rows for _ in range(G)] for k in extra_cols}
        per_fn = rewards.score(self.reward_fns, prompts, texts, comp, columns, max_new_tokens=c.max_new_tokens,
                               step=self._step, limit_s=self.reward_timeout)
        for rf in self.reward_fns:  # reward=judge: calls, cache hits, tokens, seconds of this scoring
            for k, v in (rf.fn.metrics() if hasattr(rf.fn, "metrics") else {}).items():
                self._service[k] = self._service.get(k, 0.0) + v
        total = (per_fn * torch.tensor([f.weight for f in self.reward_fns])).sum(dim=1)
        if c.truncated_reward is not None:
            cut = torch.tensor([not stopped(ids, c.max_new_tokens) for ids in comp])
            total = torch.where(cut, torch.tensor(float(c.truncated_reward)), total)
        return [{"conv": convs[i], "comp": comp[i * G:(i + 1) * G], "texts": texts[i * G:(i + 1) * G],
                 "per_fn": per_fn[i * G:(i + 1) * G], "total": total[i * G:(i + 1) * G],
                 "signal": advantages.has_signal(total[i * G:(i + 1) * G])} for i in range(len(rows))]

    def _collect(self, backend, index: int) -> tuple[list[dict], dict]:
        """The step's groups for this rank, and the signal accounting. With dynamic sampling,
        groups whose rewards do not vary are dropped and refilled from further prompts; every
        rank runs the same number of refill rounds (generation may be a collective)."""
        c, want = self.cfg, self.shape.completions_per_rank // self.cfg.num_generations
        # debug.overfit_batches repeats the prompts (refills, below, still draw further ones)
        generated = self._groups(backend, self.overfit.take(index, lambda: self._draw(self.shape.prompts_per_rank)))
        if not c.dynamic_sampling:
            return generated, {"generated": generated, "rounds": 0, "dropped": 0}
        kept, rounds = [g for g in generated if g["signal"]], 0
        while rounds < c.max_resample_rounds:
            need = int(all_max(max(0, want - len(kept))))  # every rank runs the same refill rounds
            if need == 0:
                break
            more = self._groups(backend, self._draw(need))
            generated += more
            kept += [g for g in more if g["signal"]]
            rounds += 1
        # cap reached: fill with no-signal groups (advantage 0, so they add no gradient)
        fill = [g for g in generated if not g["signal"]][:max(0, want - len(kept))]
        dropped = sum(1 for g in generated if not g["signal"]) - len(fill)
        return (kept + fill)[:want], {"generated": generated, "rounds": rounds, "dropped": dropped}

    def _rollout(self, backend, index: int) -> StepBatch:
        c, t = self.cfg, self.ctx.cfg.train
        G, tok = c.num_generations, self.ctx.tokenizer
        self._passes = []  # the step's forward passes without gradient, for the FLOP count
        self._service = {}  # a remote reward's counts over the step's scoring calls (refills included)
        groups, acct = self._collect(backend, index)
        total = torch.cat([g["total"] for g in groups])
        per_fn = torch.cat([g["per_fn"] for g in groups])
        comp = [ids for g in groups for ids in g["comp"]]
        convs = [g["conv"] for g in groups]

        # sequences: prompt + completion (+ end-of-turn when the completion stopped by itself)
        eot = self.ctx.contract.end_of_turn_id
        seqs = [s for g in groups for s in g["seqs"]] if self.episodes else []  # labels mark the sampled tokens
        for i, ids in enumerate([] if self.episodes else comp):
            p = prompt_ids(tok, convs[i // G])
            target = ids + ([eot] if stopped(ids, c.max_new_tokens) else [])
            seqs.append((p + target, [IGNORE] * len(p) + target))
        per_rank = self.shape.completions_per_rank
        micro = []
        for i in range(0, per_rank, t.micro_batch_size):
            m = collate(seqs[i:i + t.micro_batch_size], G, i, tok.pad_token_id, self.tree)
            micro.append({k: v.to(self.ctx.device) if torch.is_tensor(v) else v for k, v in m.items()})
        kl_in_reward = c.beta and c.kl_in_reward
        # ratios (and the reward's KL) use the generating policy; with async rollouts that is the snapshot
        if c.num_iterations > 1 or kl_in_reward or self._async is not None:
            module = backend.unwrapped()
            with torch.no_grad():
                for m in micro:
                    m["old_logps"] = token_logps(module, m, c.temperature).detach()
                    rows, seq = m["input_ids"].shape
                    self._passes.append(Forward(rows, seq, seq, int(m["select"].sum())))
        shaped = total
        if kl_in_reward:
            kl = torch.cat([self._sequence_kl(backend.unwrapped(), m) for m in micro]).cpu()
            shaped = total - c.beta * kl
        if c.advantage == "rloo":
            adv = advantages.rloo_advantages(shaped, G, c.normalize_advantages)
        else:
            adv = advantages.group_advantages(shaped, G, c.scale_rewards)
        for j, m in enumerate(micro):
            m["advantages"] = adv[j * t.micro_batch_size:(j + 1) * t.micro_batch_size].to(self.ctx.device)
            if kl_in_reward and c.num_iterations == 1 and self._async is None:  # on-policy: ratio 1 by logp.detach()
                del m["old_logps"]
        info = self._signal_info(acct, total, per_fn, comp) | self._service
        if self.episodes:
            info.update(self.episodes.info(groups))
        if kl_in_reward:  # per completion token, as TRL logs it
            info["kl"] = float(kl.sum()) / float(sum(int(m["n_tokens"].sum()) for m in micro))
        self._write_samples([x for g in groups for x in g["texts"]], [g["conv"] for g in groups for _ in range(G)],
                            total)
        n_tok = float(sum(int(m["n_tokens"].sum()) for m in micro))
        denom = {"grpo": float(per_rank), "sapo": float(per_rank), "dapo": n_tok, "cispo": n_tok,
                 "dr_grpo": float(per_rank * (self.episodes.budget if self.episodes else c.max_new_tokens))}[c.loss_type]
        tokens = int(sum(m["real_tokens"] for m in micro))
        self._step_tokens = n_tok
        # over all ranks, in the row too: the run's end counts the steps that had any (workbench/run/finish.py)
        info["signal_share"] = _signal_share(info["signal_groups_trained"], len(groups))
        return StepBatch(micro=micro, denom=denom, tokens=tokens, info=info, forward_passes=self._passes,
                         signal=info["signal_share"])

    def _signal_info(self, acct: dict, total, per_fn, comp) -> dict:
        """What a person needs to see a stalled run at once: the share of generated groups with
        no reward spread (they carry no gradient), the reward level of everything generated,
        completion lengths, and what dynamic sampling did."""
        c, gen = self.cfg, acct["generated"]
        all_total = torch.cat([g["total"] for g in gen])
        lengths = torch.tensor([float(len(ids)) for ids in comp])
        zero = sum(1 for g in gen if not g["signal"]) / len(gen)
        info = {"reward": float(all_total.mean()), "reward_std": float(all_total.std()),
                "completion_length": float(lengths.mean()), "completion_length_max": float(lengths.max()),
                "stopped_fraction": sum(stopped(ids, self._turn_tokens) for ids in comp) / len(comp),
                "zero_std_groups": zero,
                "signal_groups_trained": float(sum(map(advantages.has_signal, total.view(-1, c.num_generations))))}
        if c.dynamic_sampling:
            info.update({"resample_rounds": float(acct["rounds"]), "groups_generated": float(len(gen)),
                         "groups_dropped": float(acct["dropped"])})
        for j, f in enumerate(self.reward_fns):
            info[f"rewards/{f.name}/mean"] = float(per_fn[:, j].mean())
            info[f"rewards/{f.name}/std"] = float(per_fn[:, j].std())
        return info

    def stall_watch(self):
        c = self.cfg
        tries = "more refill rounds (method.max_resample_rounds)" if c.dynamic_sampling else "method.dynamic_sampling=true"
        return StallWatch(stop_after=c.stall_stop_steps if c.stop_on_stall else 0, warn_after=c.stall_warn_steps,
                          watched=("completion_length", "entropy", "reward_std"),
                          # a run shorter than stall_warn_steps (debug=fast: 2) still warns, at its end
                          last_step=int(self.ctx.cfg.train.max_steps),
                          hint="more generations per prompt (method.num_generations), a higher method.temperature, "
                               f"a reward with partial credit, {tries}, more prompts per step "
                               "(method.prompts_per_step) or a KL term (method.beta)")

    def _write_samples(self, texts, prompts, total) -> None:
        if not self.ctx.run.layout.is_main or not self.cfg.log_completions:
            return
        path = self.ctx.run_dir / "samples" / "grpo.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        secrets = secret_values(self.ctx.cfg)  # prompts are the user's data: the one rule (workbench/core/secrets.py)
        with path.open("a") as fh:
            for i in range(min(self.cfg.log_completions, len(texts))):
                fh.write(json.dumps(redact({"prompt": prompts[i][-1]["content"], "completion": texts[i],
                                            "reward": float(total[i])}, secrets)) + "\n")

    def next_batch(self, state, backend) -> StepBatch:
        if self._regenerate is not None:  # resumed mid-iteration: the same prompts, sampled again
            again, self._regenerate = self._regenerate, None
            after = self.mixture.state_dict()
            self.mixture.load_state_dict(again["mixture_before"])
            self._step = again["step"]
            self._rollout_state = again
            self._cached, self._version = self._rollout(backend, again["index"]), state.step
            self.mixture.load_state_dict(after)  # the data position the checkpoint holds, whatever refills drew
            self._uses = again["uses"]
        if self._cached is None or self._uses >= self.cfg.num_iterations:
            self._step = state.step
            index = state.step // self.cfg.num_iterations
            # async: the position before the rollout in flight is the one before this step's draw
            before = self._async.saved_state if self._async is not None else self.mixture.state_dict()
            self._rollout_state = {"index": index, "step": state.step, "mixture_before": before}
            if self._async is None:
                self._cached, self._uses, self._version = self._rollout(backend, index), 0, state.step
            else:  # sampled by the previous step's weights while it trained (workbench/rollout/async_rollouts.py)
                more = (index + 1) * self.cfg.num_iterations < self.ctx.cfg.train.max_steps
                self._version = self._async.version if self._async.pending is not None else state.step
                self._cached, self._uses = self._async.next(backend, index, more, version=state.step), 0
                self._step_tokens = float(sum(int(m["n_tokens"].sum()) for m in self._cached.micro))
        self._uses += 1
        # the rollout's forward passes ran once: the FLOP count takes them on its first step only
        return self._cached if self._uses == 1 else replace(self._cached, forward_passes=[])

    # -- loss ----------------------------------------------------------------------------
    def _ref_logps(self, model, micro):
        return self.ref.logps(lambda m, x: token_logps(m, x, self.cfg.temperature), model, micro)

    def _sequence_kl(self, model, micro):
        """Per completion of the micro-batch, the summed k1 KL of the generating policy to the
        reference (no gradient): what kl_in_reward takes off the reward."""
        return objectives.sequence_kl(micro["old_logps"], self._ref_logps(model, micro), micro["target_seq"],
                                      micro["n_tokens"].numel())

    def loss(self, model, micro: dict):
        c = self.cfg
        ref = self._ref_logps(model, micro) if c.beta and not c.kl_in_reward else None
        logp, entropy = token_logps(model, micro, c.temperature, entropy=True)
        old = micro["old_logps"] if "old_logps" in micro else logp.detach()
        rows = micro["target_seq"]
        adv_tok = micro["advantages"][rows]
        per_tok, flags, kl = objectives.policy_loss(logp, old, adv_tok, c, rows, micro["n_tokens"], ref)
        if c.loss_type in ("grpo", "sapo"):  # each completion's token mean
            per_tok = per_tok / micro["n_tokens"][rows].clamp(min=1)
        k = self._step_tokens
        metrics = {name: float(f.float().sum()) / k for name, f in flags.items()}
        metrics["entropy"] = float(entropy.sum()) / k
        if kl is not None:
            metrics["kl"] = float(kl.detach().sum()) / k
        return sequence_parallel.total(per_tok.sum()), metrics  # whole completions under backend.sp

    def state_dict(self) -> dict:
        """The data position (with rollouts one step ahead: before the rollout in flight); mid-iteration
        (num_iterations > 1) also where the cached rollout's prompts began, so a resume that cannot
        take the rollout back (`rollouts_state`) samples its prompts again before moving on; and the
        policy version of each rollout the next steps train on (`pending`; cheap: no waiting)."""
        state = {"mixture": self._async.saved_state if self._async else self.mixture.state_dict()}
        versions = []
        if self._rollout_state is not None and 0 < self._uses < self.cfg.num_iterations:
            state["rollout"] = {**self._rollout_state, "uses": self._uses}
            versions.append(self._version)
        if self._async is not None and self._async.pending is not None:
            versions.append(self._async.version)
        state["pending"] = versions
        return state

    def load_state_dict(self, state: dict) -> None:
        self.mixture.load_state_dict(state["mixture"])
        self._regenerate = state.get("rollout")
        if self._async is not None:  # the position before the rollout in flight, until the next step moves it
            self._async.saved_state = state["mixture"]
        self._resumed = {"mixture": state["mixture"], "pending": list(state.get("pending", []))}

    def rollouts_state(self) -> dict:
        """The rollouts already generated that the next steps train on, as a checkpoint keeps them
        (workbench/rollout/pending.py): the one a further pass reuses (num_iterations > 1), and the
        one generated ahead (async; waited for: it is the next step's batch anyway), with the data
        position after it."""
        out = {}
        if self._cached is not None and 0 < self._uses < self.cfg.num_iterations:
            out["cached"] = {**pending.pack(self._cached), "uses": self._uses, "version": self._version}
        ahead = self._async.settle() if self._async is not None else None
        if ahead is not None:
            out["ahead"] = {**pending.pack(ahead[0]), "version": ahead[1], "mixture_after": self.mixture.state_dict()}
        return out

    def load_rollouts(self, saved: dict | None) -> None:
        """Take back what `rollouts_state` kept (None: a checkpoint read at another layout, or one
        without any): the resumed steps then train on the rollouts the uninterrupted run had."""
        saved = saved or {}
        if "cached" in saved:
            c = saved["cached"]
            self._cached, self._uses, self._version = pending.unpack(c, self.ctx.device), c["uses"], c["version"]
            self._rollout_state, self._regenerate = self._regenerate, None
            self._step_tokens = float(sum(int(m["n_tokens"].sum()) for m in self._cached.micro))
        if "ahead" in saved and self._async is not None:
            a = saved["ahead"]
            self._async.preload(pending.unpack(a, self.ctx.device), a["version"])
            self.mixture.load_state_dict(a["mixture_after"])
        self._resumed["restored"] = [pending.completions(saved[k]) for k in ("cached", "ahead") if k in saved]

    def resume_facts(self, state: dict) -> dict:
        """The certificate's `rl` part (manifest.json resume.certificate.rl): where the sampler
        resumed, the digest of the RNG state the resume set, the policy version of each rollout the
        resumed steps train on before generating their own, and whether those were taken back."""
        saved, restored = self._resumed.get("pending", []), self._resumed.get("restored", [])
        regenerated = "regenerated from the saved generator"
        return {"sampler_position": int(sum(self._resumed.get("mixture", {}).get("taken", []))),
                "sampler_after_pending": int(sum(self.mixture.taken)),
                "sampling_noise": f"keyed by (train.seed={self.ctx.cfg.train.seed}, step, prompt sample index)",
                "generator_sha256": state.get("generator_sha256"), "generator": state.get("generator"),
                "policy_version": saved if saved else [int(state.get("step", 0))],
                "pending_rollouts": len(saved) if saved else regenerated,
                "pending_completions": restored,
                "restored": bool(saved) and len(restored) == len(saved),
                # the resumed steps train on what the uninterrupted run did: nothing was pending (the
                # next rollout is the checkpoint's weights' own), or every pending one came back
                "same_rollouts": not saved or len(restored) == len(saved)}


def _signal_share(with_signal: float, groups: int) -> float:
    """The share of the step's trained groups, over all ranks, whose rewards vary."""
    signal, total = reduce_scalar([float(with_signal), float(groups)])
    return signal / total if total else 0.0




def build(cfg, ctx) -> GRPO:
    return GRPO(cfg, ctx)


def rollouts(cfg) -> Rollouts:
    """What a step generates, for the planner: the old policy's log-probs take a forward pass
    whenever the samples are not this step's own (several iterations per rollout, rollouts one
    step ahead) or the KL goes into the reward (computed from them before the step)."""
    old = cfg.num_iterations > 1 or cfg.async_rollouts or (cfg.beta > 0 and cfg.kl_in_reward)
    return Rollouts(groups=True, generations=int(cfg.num_generations), completion_len=int(cfg.max_new_tokens),
                    prompts_per_step=cfg.prompts_per_step, num_iterations=max(1, int(cfg.num_iterations)),
                    share_prompt=bool(cfg.share_prompt), old_logps=bool(old), engine=str(cfg.engine),
                    vllm_fraction=float(cfg.vllm_gpu_memory_utilization) if cfg.engine == "vllm" else 0.0,
                    overlaps=bool(cfg.async_rollouts))


SPEC = MethodSpec(name="grpo", config=Config, build=build, check=check, rules=RULES, batch=step_shape,
                  rollouts=rollouts, trace=grpo_trace.spec(collate, token_logps, rollouts, batch_shape),
                  facts=MethodFacts(data="prompts", reference="kl", generates=True, episodes=True,
                                                       eval="reward", splits_rows=True))
