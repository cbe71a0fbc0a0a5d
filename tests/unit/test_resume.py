"""Resume anywhere, the parts that need no second rank: canonical names against PEFT's own, the
global batch kept at another world size (and its one-line refusal), the LR schedule, the refusals
of another model / adapter / tokenizer and of an old-format checkpoint at another layout, the
certificate's tolerances, and sampling noise that does not depend on how prompts are batched.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_resume.py

The moves between backends and world sizes themselves: tests/distributed/test_resume_moves.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.conftest import compose
from tests.tolerances import LOSS_RTOL, PROBE_RTOL_HALF
from workbench.checkpoints import canonical, checkpoint, replay, resume
from workbench.core.errors import UserError
from workbench.resolve.derive import derive
from workbench.train.layout import Layout


# -- names ------------------------------------------------------------------------------------
def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))


class Wrapped(torch.nn.Module):  # SelectiveLM's naming: the model under `inner`
    def __init__(self, inner):
        super().__init__()
        self.inner = inner


@pytest.mark.parametrize("dora", [False, True])
def test_adapter_names_are_the_keys_peft_saves(dora):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    model = get_peft_model(_tiny_llama(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"], use_dora=dora))
    ours = {canonical.canonical_name(n) for n, p in Wrapped(model).named_parameters() if p.requires_grad}
    assert ours == set(get_peft_model_state_dict(model)) and ours


def test_full_fine_tuning_names_are_the_hf_state_dict_keys():
    model = _tiny_llama()
    ours = {canonical.canonical_name(n) for n, _ in Wrapped(model).named_parameters()}
    assert ours == set(model.state_dict()) - {"lm_head.weight"}  # tied: the embedding is the head


def test_flatten_round_trip_and_sgd_without_state():
    model = {"a.weight": torch.ones(2)}
    optim = {"a.weight": {"exp_avg": torch.zeros(2), "step": 3.0, "momentum_buffer": None}}
    flat = canonical.flatten(model, optim)
    assert sorted(flat) == ["model/a.weight", "optim/a.weight/exp_avg", "optim/a.weight/step"]
    m, o = canonical.unflatten(flat)
    assert torch.equal(m["a.weight"], model["a.weight"]) and float(o["a.weight"]["step"]) == 3.0


def test_write_read_and_refusals(tmp_path):
    flat = {"model/w": torch.arange(6.0).view(2, 3), "optim/w/step": torch.tensor(2.0)}
    canonical.write(tmp_path / "c", flat)
    assert canonical.describe(tmp_path / "c") == {"model/w": ((2, 3), torch.float32), "optim/w/step": ((), torch.float32)}
    back = canonical.read_all(tmp_path / "c")
    assert all(torch.equal(back[k], flat[k]) for k in flat)
    with pytest.raises(UserError, match=r"lacks 1 tensor.*'model/v'"):
        canonical.reader(tmp_path / "c")({"model/v": torch.empty(1)})
    with pytest.raises(UserError, match=r"model/w has shape \(2, 3\) in the checkpoint, \(3, 2\) in this run"):
        canonical.reader(tmp_path / "c")({"model/w": torch.empty(3, 2)})


# -- the global batch ---------------------------------------------------------------------------
def test_accum_for_and_nearest_layouts():
    assert resume.accum_for(8, 2, 1) == 4 and resume.accum_for(8, 2, 2) == 2 and resume.accum_for(8, 2, 3) is None
    assert resume.nearest(8, 2, 3) == ["hardware.procs=2 (train.grad_accum=2)", "hardware.procs=4 (train.grad_accum=1)"]
    assert resume.nearest(8, 4, 4) == ["hardware.procs=2 (train.grad_accum=1)",
                                       "train.micro_batch_size=2 (train.grad_accum=1)"]
    assert resume.accum_for(12, 2, 8, model_parallel=2) is None  # 4 data-parallel ranks x 3 rows: not whole micro-batches
    assert resume.accum_for(8, 2, 2, group=4) == 2 and resume.accum_for(8, 2, 4, group=4) is None  # GRPO: whole groups


def _rec(size=8, micro=2, accum=2, dp=2):
    return {"format": canonical.FORMAT, "name": "step-00000004", "global_batch": size,
            "layout": {"backend": "fsdp2", "world": dp, "dp": dp, "micro": micro, "accum": accum}}


def test_keep_global_batch_recomputes_grad_accum(tmp_path):
    cfg = compose(["train.micro_batch_size=2", "train.grad_accum=2"], tmp_path)
    kept = resume.keep_global_batch(cfg, _rec(), Layout(world=1))
    assert kept.train.grad_accum == 4 and cfg.train.grad_accum == 2  # a copy, the config stays as given
    from omegaconf.errors import ReadonlyConfigError

    with pytest.raises(ReadonlyConfigError):
        kept.train.grad_accum = 1  # read-only like the config it copies
    assert resume.keep_global_batch(cfg, _rec(), Layout(world=2)) is cfg  # nothing to change
    assert resume.keep_global_batch(cfg, None, Layout(world=1)) is cfg  # a fresh run


def test_a_layout_that_cannot_keep_the_global_batch_is_refused_naming_the_nearest(tmp_path):
    cfg = compose(["train.micro_batch_size=2", "train.grad_accum=2"], tmp_path)
    with pytest.raises(UserError) as exc:
        resume.keep_global_batch(cfg, _rec(), Layout(world=3))
    msg = str(exc.value)
    assert msg.startswith("resuming step-00000004 (global batch 8 = 2 x 2 x 2 dp, written by fsdp2x2) at 3 ")
    assert msg.endswith("use hardware.procs=2 (train.grad_accum=2) or hardware.procs=4 (train.grad_accum=1) or "
                        "train.keep_global_batch=false") and "\n" not in msg
    free = compose(["train.micro_batch_size=2", "train.grad_accum=2", "train.keep_global_batch=false"], tmp_path)
    assert resume.keep_global_batch(free, _rec(), Layout(world=3)) is free


def test_grpo_prompts_per_step_fixes_the_global_batch_at_any_layout(tmp_path):
    base = ["method=grpo", "method.prompts_per_step=4", "method.num_generations=4", "train.micro_batch_size=4"]
    for procs, accum in ((1, 4), (2, 2), (4, 1)):
        b = derive(compose([*base, f"hardware.procs={procs}"], tmp_path)).batch
        assert (b.accum, b.size) == (accum, 16), procs


# -- the schedule -------------------------------------------------------------------------------
def test_schedule_continues_with_the_restored_lr():
    from workbench.compute.optim import build_optimizer, build_scheduler

    cfg = compose(["optim.warmup_steps=2", "optim.scheduler=cosine"]).optim

    def fresh():
        opt = build_optimizer([torch.nn.Parameter(torch.ones(2))], cfg)
        return opt, build_scheduler(opt, cfg, 10)

    opt, sched = fresh()
    for _ in range(3):
        opt.step()
        sched.step()
    state = canonical.schedule_state(sched)
    opt2, sched2 = fresh()
    canonical.apply_schedule(sched2, opt2, state)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] != cfg.lr * 0.5  # the group lr, not just the record
    sched.step()
    sched2.step()
    assert sched2.get_last_lr() == sched.get_last_lr()


# -- what a checkpoint belongs to -----------------------------------------------------------------
def _identity(tmp_path, overrides, template="t1", vocab=("a", "b")):
    cfg = compose(overrides, tmp_path)
    tok = type("Tok", (), {"get_vocab": lambda self: {v: i for i, v in enumerate(vocab)},
                           "__len__": lambda self: len(vocab)})()
    return resume.identity(cfg, derive(cfg), tok, SimpleNamespace(template_hash=template, end_of_turn_id=1))


@pytest.mark.parametrize("now,match", [
    (["peft=none"], r"holds a LoRA adapter \(peft=lora\); this run is peft=none, which cannot continue it: resume "
                    r"with peft=lora, or export it"),
    (["peft=dora"], r"holds a LoRA adapter \(peft=lora\); this run is peft=dora, which cannot continue it"),
    (["peft=lora", "peft.r=4"], r"holds an adapter with peft.r=16; this run's is peft.r=4"),
    (["peft=lora", "model.arch.hidden=32"], r"was written for model=tiny \(hidden=64\); this run is model=tiny"),
])
def test_another_model_or_adapter_is_refused(tmp_path, now, match):
    rec = {"format": canonical.FORMAT, "name": "step-00000002", "identity": _identity(tmp_path, ["peft=lora"])}
    resume.check_identity(rec, _identity(tmp_path, ["peft=lora"]))  # the same: accepted
    with pytest.raises(UserError, match=match):
        resume.check_identity(rec, _identity(tmp_path, now))


def test_another_tokenizer_or_chat_template_is_refused(tmp_path):
    rec = {"format": canonical.FORMAT, "name": "step-00000002", "identity": _identity(tmp_path, [])}
    with pytest.raises(UserError, match=r"trained with another chat template"):
        resume.check_identity(rec, _identity(tmp_path, [], template="t2"))
    with pytest.raises(UserError, match=r"trained with another tokenizer"):
        resume.check_identity(rec, _identity(tmp_path, [], vocab=("a", "c")))


def test_an_old_format_checkpoint_resumes_only_at_its_own_layout(tmp_path):
    step = tmp_path / "step-00000002"
    (step / "dcp").mkdir(parents=True)
    for f in ("state.json", "state.rank1.json"):
        (step / f).write_text("{}")
    assert checkpoint.is_legacy(step) and checkpoint.legacy_layout(step) == {"backend": "fsdp2", "world": 2}
    rec = {"format": "legacy", "name": step.name, "layout": checkpoint.legacy_layout(step)}
    resume.check_legacy(rec, compose(["backend=fsdp2"]), 2)  # its own layout: read as it was written
    with pytest.raises(UserError, match=r"step-00000002 is from before the canonical checkpoint format, written by "
                                        r"fsdp2x2; resume with that layout once \(backend=fsdp2 hardware.procs=2\)"):
        resume.check_legacy(rec, compose([]), 1)


# -- the certificate, the noise -------------------------------------------------------------------
def test_certificate_tolerances_are_the_derived_ones():
    assert replay.RTOL_FP32 == LOSS_RTOL and replay.RTOL_HALF == PROBE_RTOL_HALF
    assert replay.tolerance("fp32", "fp32") == LOSS_RTOL and replay.tolerance("bf16-mixed", "fp32") == PROBE_RTOL_HALF
    cert = replay.certificate({"loss": 2.0}, 2.0 * (1 + 2 * LOSS_RTOL), "fsdp2x2", "single", ("fp32", "fp32"))
    assert not cert["ok"] and cert["rel_diff"] == pytest.approx(2 * LOSS_RTOL)


def test_deepspeed_state_initialiser_is_still_there():
    """backends/deepspeed.py links a fresh ZeRO-1/2 engine's Adam state with this private call."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    assert callable(getattr(stage_1_and_2.DeepSpeedZeroOptimizer, "_lazy_init_hp_params_optimizer_state", None))


def test_keyed_noise_samples_the_same_completions_in_any_batch():
    """What lets GRPO move between world sizes: a prompt's completions depend on its key, not on the
    other prompts in the call (one call of 3 prompts = 1 + 2 calls), and a new key samples anew."""
    from workbench.data.chat import setup_tokenizer
    from workbench.models.load import load_model, load_tokenizer
    from workbench.rollout.generate import generate

    cfg = compose(["method=grpo", "peft=none"])
    tok = load_tokenizer(cfg.model)
    eot = setup_tokenizer(tok).end_of_turn_id
    model = load_model(cfg.model)
    convs = [[{"role": "user", "content": t}] for t in ("What is 12 + 30?", "Hi", "7 + 8, please")]
    keys = [(0, 5, 10), (0, 5, 11), (0, 5, 12)]

    def run(c, k, seed):
        torch.manual_seed(seed)  # the process's generator must not matter
        return generate(model, tok, c, 12, eot, do_sample=True, num_return_sequences=3, noise_keys=k)

    whole = run(convs, keys, 0)
    assert run(convs[:1], keys[:1], 1) + run(convs[1:], keys[1:], 2) == whole
    assert run(convs, [(0, 6, k[2]) for k in keys], 0) != whole  # another step: other noise


# -- shrinking to fewer nodes -------------------------------------------------------------------
def test_survivors_that_cannot_split_with_this_micro_batch_take_a_smaller_one(tmp_path):
    # 3 nodes x 1 rank at micro-batch 4 wrote a global batch of 12; 2 survivors cannot take 4-row
    # micro-batches (6 rows each), so they take 3 x 2: the same 12 rows a step, the same gradient sum
    cfg = compose(["train.micro_batch_size=4", "train.grad_accum=1"], tmp_path)
    kept = resume.keep_global_batch(cfg, _rec(size=12, micro=4, accum=1, dp=3), Layout(world=2))
    assert (kept.train.micro_batch_size, kept.train.grad_accum) == (3, 2)
    assert resume.split(12, 4, 2) == (3, 2) and resume.split(12, 4, 3) == (4, 1) and resume.split(8, 2, 3) == (2, None)
    assert resume.split(16, 4, 2, group=8) == (4, 2) and resume.split(12, 4, 2, group=4) == (4, None)  # whole groups


def test_a_run_that_cannot_keep_its_batch_at_min_nodes_is_refused_at_start(tmp_path):
    from workbench.resolve.resolved import resolve_run

    ok = compose(["hardware.nodes=3", "hardware.min_nodes=2", "train.micro_batch_size=4"], tmp_path)
    assert resolve_run(ok, planning=True).batch.size == 12  # 12 rows: 3 x 4 at 3 nodes, 2 x 3 x 2 at 2
    bad = compose(["hardware.nodes=3", "hardware.min_nodes=2", "train.micro_batch_size=3"], tmp_path)
    with pytest.raises(UserError) as exc:
        resolve_run(bad, planning=True)
    assert str(exc.value) == (
        "hardware.min_nodes=2: at 2 node(s) (2 ranks) no micro-batch splits the global batch of 9 rows evenly, so "
        "losing a node there would stop the run; use train.grad_accum=2 (global batch 18, which every node count "
        "from 2 to 3 splits), or hardware.min_nodes=3")
    rigid = compose(["hardware.nodes=3", "train.micro_batch_size=3"], tmp_path)  # min_nodes unset: no shrinking
    assert resolve_run(rigid, planning=True).batch.size == 9


def test_the_survivors_of_a_lost_node_resolve_their_run(tmp_path):
    # inside a worker after node 2 of 2 was lost: one rank left, hardware.nodes still says 2
    from workbench.resolve.resolved import resolve_run

    cfg = compose(["hardware.nodes=2", "hardware.min_nodes=1", "hardware.procs=1", "train.micro_batch_size=4",
                   "train.grad_accum=1", "hardware.rdzv_endpoint=127.0.0.1:29400"], tmp_path)
    assert resolve_run(cfg, rank=0, world=1).layout.world == 1
