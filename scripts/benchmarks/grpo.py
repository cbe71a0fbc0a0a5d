"""workbench method=grpo vs TRL's GRPOTrainer (SmolLM2-135M, LoRA, CPU): s/step and where it goes.

    python scripts/bench.py grpo                                  # 6 steps x 2 rounds, 16 completions/step
    python scripts/bench.py grpo --steps 2 --rounds 1             # smoke test
    python scripts/bench.py grpo --completions 32 --precision bf16-mixed
    python scripts/bench.py grpo --plain-rollouts                 # workbench without the shared prefill
    python scripts/bench.py grpo --rows                           # workbench trains one row per completion
    python scripts/bench.py grpo --reward-model                   # both scored by a reward model

Both sides: LoRA r=16 alpha=32 on every linear layer, the prompts of
data_recipes/data/arith_grpo_train.jsonl, 8 generations per prompt, at most 16 new tokens,
temperature 1, top-p 1, HF `generate` with the KV cache, the same reward function
(workbench.rollout.rewards.digits: partial credit, so groups have reward spread and the
backward pass does real work from the first step, which exact match on the untrained model
would not give), group-scaled advantages, the dapo loss, beta 0 (no
reference forward), one optimizer step per generation batch, micro-batches of 16 completions,
AdamW lr 2e-4 with warmup 5 then cosine, no gradient checkpointing. The workbench runs without
dynamic sampling, so each step is exactly one generation round on both sides. Precision: `auto`
by default, as a default run here resolves it (bf16-mixed on CPUs with AMX or AVX512-BF16, else
fp32; see scripts/benchmarks/dpo.py), the same on both sides.

The workbench step is split, by timing its pieces from here (no change to the method):
  generation   GRPO._generate (rollouts), with generated tokens/s (completion tokens, the
               end-of-turn included); the workbench prefills each prompt once for its 8
               continuations (workbench/rollout/generate.py), TRL prefills all 8 copies;
               --plain-rollouts turns the shared prefill off
  scoring      rewards.score (the reward functions), completions tokens scored/s
  other_rollout  the rest of next_batch: decoding to text, advantages, tokenising, collation
  training     forward, backward and optimizer step (the runner's step time minus next_batch),
               trained tokens/s (the tokens the decoder reads: with method.share_prompt, the
               default, each prompt once per micro-batch and its completions as branches;
               --rows: every completion's row with its own copy of the prompt)
TRL's generation is timed by wrapping its model's `generate`, with its generated tokens/s.

--reward-model replaces the `digits` function on both sides by a reward model: a sequence
classifier built from the same SmolLM2 with a random scalar head (scripts/benchmarks/_common.py
reward_model), saved with its tokenizer; the workbench reads it with `reward=model` (one row per
prompt, 16 completions a forward), TRL with `reward_funcs=<that directory>` (its own loading, one
right-padded row per completion, every completion of the step in one forward).

The sides run alternately in rounds in this one process; the first step of every run is dropped.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks._common import (
    add_common_args,
    alternate,
    jsonl,
    model_dir,
    resolve_precision,
    reward_classifier,
    step_timer,
    summary,
    trl_args,
    trl_lora,
    trl_tokenizer,
    workbench_rows,
)

G, MAX_NEW, MICRO = 8, 16, 16


def trl_reward(completions, **_) -> list[float]:
    """workbench's `digits` reward on TRL's conversational completions ([{"role", "content"}])."""
    from workbench.rollout.rewards import digits

    return digits([c[-1]["content"] if isinstance(c, list) else c for c in completions])


class Split:
    """Times GRPO._generate, rewards.score and GRPO.next_batch of the runs started while active
    (patched on the class / module, restored on exit)."""

    def __init__(self, plain: bool = False):
        self.steps: list[dict] = []
        self.plain = plain  # rollouts without the shared prefill (generate(..., dedup=False))

    def __enter__(self):
        from workbench.methods import grpo
        from workbench.rollout import rewards

        self._undo = []
        split = self

        def patch(owner, name, wrap):
            orig = getattr(owner, name, None)
            if orig is None:
                raise RuntimeError(f"{owner.__name__}.{name} is gone: update scripts/benchmarks/grpo.py's split")
            setattr(owner, name, wrap(orig))
            self._undo.append((owner, name, orig))

        def next_batch(orig):
            def timed(method, state, backend):
                split.steps.append({"generation": 0.0, "scoring": 0.0, "generated_tokens": 0, "prompt_tokens": 0,
                                    "scored": 0})
                t = time.perf_counter()
                batch = orig(method, state, backend)
                split.steps[-1].update(rollout=time.perf_counter() - t, trained_tokens=batch.tokens)
                return batch
            return timed

        def generate(orig):
            def timed(method, backend, convs):
                from workbench.data.chat import prompt_ids

                t = time.perf_counter()
                out = orig(method, backend, convs)
                s = split.steps[-1]
                s["generation"] += time.perf_counter() - t
                new = method.cfg.max_new_tokens
                s["generated_tokens"] += sum(len(ids) + (len(ids) < new) for ids in out)  # + end-of-turn
                per_prompt = 1 if not split.plain else method.cfg.num_generations  # shared prefill: once
                s["prompt_tokens"] += per_prompt * sum(len(prompt_ids(method.ctx.tokenizer, c)) for c in convs)
                return out
            return timed

        def score(orig):
            def timed(fns, prompts, completions, completion_ids, columns, **extra):
                t = time.perf_counter()
                out = orig(fns, prompts, completions, completion_ids, columns, **extra)
                s = split.steps[-1]
                s["scoring"] += time.perf_counter() - t
                s["scored"] += len(completions)
                return out
            return timed

        patch(grpo.GRPO, "next_batch", next_batch)
        patch(grpo.GRPO, "_generate", generate)
        patch(rewards, "score", score)
        if self.plain:  # grpo imports generate at call time, so the module attribute is what it gets
            import functools

            from workbench.rollout import generate as gen_module

            patch(gen_module, "generate", lambda orig: functools.partial(orig, dedup=False))
        return self

    def __exit__(self, *exc):
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)


def reward_model_dir(out: Path) -> str:
    """A sequence classifier (SmolLM2, random scalar head) and its tokenizer saved in `out`."""
    clf, tok, _ = reward_classifier()
    clf.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def workbench_times(steps: int, model: str, precision: str, completions: int, out: Path,
                    parts: list[dict], plain: bool = False, rows_layout: bool = False,
                    rm: str | None = None) -> list[float]:
    reward = ["reward=model", f"reward.path={rm}"] if rm else ['reward.functions=["digits"]']
    overrides = [f"model={model}", "method=grpo", "peft=lora", f"precision={precision}", *reward,
                 f"method.num_generations={G}", f"method.max_new_tokens={MAX_NEW}", "method.dynamic_sampling=false",
                 "method.beta=0.0", "method.num_iterations=1", "method.log_completions=0",
                 f"method.prompts_per_step={completions // G}", f"train.micro_batch_size={MICRO}",
                 f"train.grad_accum={completions // MICRO}", f"train.max_steps={steps}",
                 f"method.share_prompt={not rows_layout}"]
    with Split(plain) as split:
        rows = workbench_rows(overrides, out)
    assert len(rows) == len(split.steps) == steps, f"workbench ran {len(rows)} steps, expected {steps}"
    for row, s in zip(rows, split.steps):
        s["step"] = row["step_seconds"]
        s["training"] = row["step_seconds"] - s["rollout"]
        s["other_rollout"] = s["rollout"] - s["generation"] - s["scoring"]
    parts += split.steps[1:]
    return [row["step_seconds"] for row in rows]


def trl_times(steps: int, path: str, precision: str, completions: int, out: Path, gens: list[dict],
              rm: str | None = None) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    tok = trl_tokenizer(path)
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in jsonl("arith_grpo_train.jsonl")])
    args = trl_args(GRPOConfig, out, precision, MICRO, steps, accum=completions // MICRO, num_generations=G,
                    max_completion_length=MAX_NEW, temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1,
                    loss_type="dapo", scale_rewards="group", epsilon=0.2, log_completions=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    lora = trl_lora()
    times: list[float] = []
    trainer = GRPOTrainer(model=model, reward_funcs=rm or trl_reward, args=args, train_dataset=data, processing_class=tok,
                          peft_config=lora, callbacks=[step_timer(times)])
    calls: list[dict] = []
    eos = tok.eos_token_id
    orig = trainer.model.generate

    def timed_generate(*a, **k):  # the unwrapped model TRL generates with is this object on one CPU process
        t = time.perf_counter()
        ids = orig(*a, **k)
        seconds = time.perf_counter() - t
        comp = ids[:, k["input_ids"].shape[1]:]
        ended = (comp == eos).int()
        first = torch.where(ended.any(1), ended.argmax(1) + 1, torch.full_like(ended[:, 0], comp.shape[1]))
        calls.append({"seconds": seconds, "generated_tokens": int(first.sum()),
                      "prompt_tokens": int(k["attention_mask"].sum())})
        return ids

    trainer.model.generate = timed_generate
    trainer.train()
    assert len(times) == steps, f"TRL ran {len(times)} steps, expected {steps}"
    if len(calls) != steps:
        raise RuntimeError(f"TRL generated {len(calls)} times in {steps} steps (expected one batch per step)")
    gens += calls[1:]
    return times


def _rate(parts: list[dict], tokens: str, seconds: str) -> float:
    return sum(p[tokens] for p in parts) / max(1e-9, sum(p[seconds] for p in parts))


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="bench.py grpo")
    add_common_args(ap)
    ap.add_argument("--plain-rollouts", action="store_true", help="workbench rollouts without the shared prefill")
    ap.add_argument("--rows", action="store_true", help="workbench trains one row per completion")
    ap.add_argument("--completions", type=int, default=16, help="completions per optimizer step (multiple of 16)")
    ap.add_argument("--reward-model", action="store_true", help="both sides scored by a reward model")
    args = ap.parse_args(argv)
    args.precision = resolve_precision(args.precision)
    if args.completions % MICRO or args.completions < MICRO:
        ap.error(f"--completions must be a positive multiple of {MICRO}")
    import torch

    path = model_dir(args.model)
    parts: list[dict] = []  # workbench steps' split (first step of each run dropped)
    gens: list[dict] = []  # TRL generate calls (first of each run dropped)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rm = reward_model_dir(tmp / "rm") if args.reward_model else None
        sides = {
            "workbench": lambda r: workbench_times(args.steps, args.model, args.precision, args.completions,
                                                   tmp / f"wb{r}", parts, args.plain_rollouts, args.rows, rm),
            "trl": lambda r: trl_times(args.steps, path, args.precision, args.completions, tmp / f"trl{r}", gens, rm),
        }
        med = summary(alternate(args.rounds, sides))
    split = {}
    if parts:
        split = {k: statistics.median(p[k] for p in parts)
                 for k in ("generation", "scoring", "other_rollout", "training", "step")}
        split.update(generated_tokens_per_s=_rate(parts, "generated_tokens", "generation"),

                     completions_scored_per_s=_rate(parts, "scored", "scoring"),
                     trained_tokens_per_s=_rate(parts, "trained_tokens", "training"),
                     generated_tokens_per_step=statistics.median(p["generated_tokens"] for p in parts),
                     prefilled_prompt_tokens_per_step=statistics.median(p["prompt_tokens"] for p in parts))
    trl_gen = {}
    if gens:
        trl_gen = {"generation_seconds": statistics.median(g["seconds"] for g in gens),
                   "generated_tokens_per_s": _rate(gens, "generated_tokens", "seconds"),
                   "generated_tokens_per_step": statistics.median(g["generated_tokens"] for g in gens),
                   "prefilled_prompt_tokens_per_step": statistics.median(g["prompt_tokens"] for g in gens)}
    return {"model": args.model, "precision": args.precision, "steps_per_round": args.steps, "rounds": args.rounds,
            "completions_per_step": args.completions, "num_generations": G, "max_new_tokens": MAX_NEW,
            "threads": torch.get_num_threads(), "workbench_shared_prefill": not args.plain_rollouts,
            "workbench_share_prompt": not args.rows, "reward": "reward model" if args.reward_model else "digits",
            "median_seconds_per_step": med,
            "ratio_throughput_workbench_over_trl": med["trl"] / med["workbench"],
            "workbench_split_median_seconds": split, "trl_generation": trl_gen}
