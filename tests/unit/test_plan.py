"""The planner: exact counts, the memory terms, sharding, verdicts and fixes, speed and cost.

    OMP_NUM_THREADS=1 pytest -q tests/unit/test_plan.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import CONF, compose
from tests.tolerances import QUOTED_FIGURE_RTOL
from workbench.config.schema import ModelConfig, PeftConfig
from workbench.models.load import zoo_entry
from workbench.plan import catalog
from workbench.plan.counts import build_full, count, probe
from workbench.plan.fit import verdict
from workbench.plan.make import make_plan, refusal
from workbench.plan.memory import estimate, nf4_bytes_per_param
from workbench.plan.setup import Setup
from workbench.plan.speed import cost_per_million_tokens, speed, train_flops_per_token
from workbench.telemetry.metrics import Tracker, usd_per_million_tokens


def model_cfg(name: str, **arch):
    node = OmegaConf.merge(OmegaConf.structured(ModelConfig), zoo_entry(name))
    for k, v in arch.items():
        node.arch[k] = v
    return node


def lora(kind="lora", r=16):
    return OmegaConf.structured(PeftConfig(kind=kind, r=r))


def llama_formula(a) -> int:
    """Parameter count of a Llama-family model written out by hand (no torch)."""
    d = a.head_dim or a.hidden // a.heads
    attn = a.hidden * a.heads * d * 2 + a.hidden * a.kv_heads * d * 2
    block = attn + 3 * a.hidden * a.intermediate + 2 * a.hidden
    embed = a.vocab * a.hidden * (1 if a.tie_embeddings else 2)
    return a.layers * block + embed + a.hidden


@pytest.mark.parametrize("name,arch", [("tiny", {}), ("smollm2-135m", {}), ("mixtral-8x22b", {"layers": 3})])
def test_one_block_probe_equals_full_meta_build(name, arch):
    m = model_cfg(name, **arch)
    full = sum(p.numel() for p in build_full(m).parameters())
    assert count(probe(m), m.arch).total == full


def test_70b_exact_count_matches_the_formula_and_loads_nothing():
    m = model_cfg("70b")
    model = probe(m)
    assert all(p.device.type == "meta" for p in model.parameters())
    c = count(model, m.arch, lora())
    assert c.total == llama_formula(m.arch) == 70_553_706_496
    # LoRA r=16 on all 7 linear layers of 80 blocks
    a, d = m.arch, m.arch.head_dim
    per = 16 * ((a.hidden + a.heads * d) * 2 + (a.hidden + a.kv_heads * d) * 2 + 3 * (a.hidden + a.intermediate))
    assert c.lora == 80 * per


def test_moe_active_parameters():
    m = model_cfg("mixtral-8x22b")
    c = count(probe(m), m.arch)
    assert 140e9 < c.total < 142e9  # "141B"
    assert 38.5e9 < c.active < 39.5e9  # "39B active"


def test_nf4_constants_match_bitsandbytes():
    bnb = pytest.importorskip("bitsandbytes")
    for dq in (True, False):
        w = bnb.nn.Params4bit(torch.randn(512, 1024), requires_grad=False, quant_type="nf4",
                              compress_statistics=dq).to("cpu")
        qs = w.quant_state
        nbytes = w.data.numel() * w.data.element_size() + qs.absmax.numel() * qs.absmax.element_size()
        if dq:
            nbytes += qs.state2.absmax.numel() * qs.state2.absmax.element_size()
        # 512 x 1024 is a whole number of 64-weight blocks and of 256-block groups: no partial
        # block, so the per-parameter bytes are exactly the asymptotic figure
        assert nbytes / (512 * 1024) == nf4_bytes_per_param(dq)


def _est(name="70b", **kw):
    m = model_cfg(name)
    peft = kw.pop("peft_cfg", None)
    c = count(probe(m), m.arch, peft)
    return c, m.arch, estimate(c, m.arch, Setup(**kw))


def test_full_finetune_bytes_per_param():
    c, _, e = _est(peft="none", precision="bf16-mixed", micro_batch=1, seq_len=16)
    # fp32 params + fp32 grads + 2 fp32 Adam moments = 16 bytes per parameter
    assert (e.weights + e.grads + e.optimizer) / c.total == pytest.approx(16)
    c, _, e = _est(peft="none", precision="bf16-mixed", backend="deepspeed", stage=0, micro_batch=1, seq_len=16)
    assert (e.weights + e.grads + e.optimizer + e.master) / c.total == pytest.approx(16)  # 2+2+8+4
    assert e.master / c.total == pytest.approx(4)


def test_megatron_terms_follow_what_the_backend_holds():
    kw = dict(peft="none", precision="bf16-mixed", backend="megatron", devices=8, tp=2, micro_batch=1, seq_len=16,
              hf_copy=True)
    c, _, torch_opt = _est(**kw)
    per_dev = c.total / 2  # tp=2 (the 70B's embedding is split over TP like the blocks)
    # a torch AdamW over this rank's shard: fp32 params, grads and 2 moments on every data-parallel rank
    assert (torch_opt.grads + torch_opt.optimizer) / per_dev == pytest.approx(12)
    assert torch_opt.master == 0
    # plus the runner's HF model, whole, in the trainable dtype (export reads the weights bridged back)
    assert torch_opt.weights == pytest.approx(per_dev * 4 + c.total * 4)
    _, _, dist = _est(**kw, distributed_optimizer=True)
    # Megatron's optimizer: bf16 params, fp32 gradient buffer, fp32 main weights and moments over dp=4
    assert dist.grads / per_dev == pytest.approx(4) and dist.master / per_dev == pytest.approx(4 / 4)
    assert dist.optimizer / per_dev == pytest.approx(8 / 4)
    assert dist.weights == pytest.approx(per_dev * 2 + c.total * 4)


def test_megatron_lora_layout_and_released_base():
    peft = lora()
    c, _, e = _est(peft="lora", peft_cfg=peft, precision="bf16-mixed", backend="megatron", devices=8, tp=8,
                   micro_batch=1, seq_len=16)
    # column projections' A and row projections' B are whole on every TP rank, the rest split
    m = model_cfg("70b")
    a = m.arch
    d = a.head_dim or a.hidden // a.heads
    q, kv = a.heads * d, a.kv_heads * d
    whole = a.layers * 16 * 7 * a.hidden  # A of q, k, v, gate, up (r x hidden); B of o, down (hidden x r)
    split = a.layers * 16 * (q + 2 * kv + 2 * a.intermediate + q + a.intermediate)
    assert c.lora == whole + split and c.lora_split == split
    assert e.grads / 4 == pytest.approx(whole + split / 8)
    # the HF model kept only its adapters, on the host (run.keeps_hf_base): the device holds the shards
    assert e.weights == pytest.approx(c.total / 8 * 2 + (whole + split / 8) * 4) and e.host == c.lora * 4
    kept = estimate(c, a, Setup(peft="lora", precision="bf16-mixed", backend="megatron", devices=8, tp=8,
                                micro_batch=1, seq_len=16, hf_copy=True))
    assert kept.weights - e.weights == pytest.approx(c.total * 2 + c.lora * 4)


def test_sharding_ladder_and_offload():
    kw = dict(peft="none", precision="bf16-mixed", backend="deepspeed", devices=8, micro_batch=1, seq_len=512)
    c = _est(**kw)[0]
    peaks = [_est(stage=s, **kw)[2] for s in (0, 1, 2, 3)]
    assert peaks[0].peak > peaks[1].peak > peaks[2].peak > peaks[3].peak
    assert peaks[1].optimizer == pytest.approx(peaks[0].optimizer / 8)
    assert peaks[2].grads == pytest.approx(peaks[0].grads / 8)
    # ZeRO-3 keeps 1/8 of the bf16 weights plus a full copy of the root unit and two blocks
    gathered = (c.embed + 2 * c.per_block) * 2
    assert peaks[3].weights == pytest.approx(peaks[0].weights / 8 + gathered)
    fsdp = _est(peft="none", precision="bf16-mixed", backend="fsdp2", devices=8, micro_batch=1, seq_len=512)[2]
    single = _est(peft="none", precision="bf16-mixed", devices=8, micro_batch=1, seq_len=512)[2]
    assert fsdp.grads + fsdp.optimizer == pytest.approx((single.grads + single.optimizer) / 8)
    assert fsdp.weights < single.weights / 4
    off = _est(stage=3, offload_optimizer=True, **kw)[2]
    assert off.optimizer == 0 and off.host == pytest.approx(peaks[3].optimizer + peaks[3].master)


def test_activations_scale_and_checkpointing():
    base = dict(peft="lora", peft_cfg=lora(), precision="bf16-mixed", micro_batch=1, seq_len=1024)
    a1 = _est(**base)[2].activations
    a2 = _est(**{**base, "seq_len": 2048})[2].activations
    a4 = _est(**{**base, "micro_batch": 4})[2].activations
    ck = _est(**{**base, "checkpointing": "full"})[2].activations
    assert a2 == pytest.approx(2 * a1) and a4 == pytest.approx(4 * a1)
    assert ck < a1 / 5


def test_qlora_70b_fits_one_h100_and_full_does_not():
    m = model_cfg("70b")
    h100 = catalog.profiles()["h100-80gb"]
    s = Setup(peft="qlora", precision="bf16-mixed", micro_batch=1, seq_len=2048, checkpointing="full")
    c = count(probe(m), m.arch, lora("qlora"))
    v = verdict(c, m.arch, s, h100.memory_gb, "cuda")
    assert v.fits and 35 < v.peak_gb < 60
    full = verdict(count(probe(m), m.arch), m.arch, s.but(peft="none"), h100.memory_gb, "cuda", node_size=8)
    assert not full.fits
    # 70B x 16 bytes = 1.1 TB of state: sharded over whole 8-GPU nodes it needs 16 or more GPUs
    assert full.devices_needed and full.devices_needed >= 16 and full.devices_needed % 8 == 0


def test_smallest_fix_is_found_and_really_fits():
    m = model_cfg("llama3-8b")
    c = count(probe(m), m.arch, lora())
    s = Setup(peft="lora", precision="bf16-mixed", micro_batch=4, seq_len=4096)
    v = verdict(c, m.arch, s, 80, "cuda")
    assert not v.fits and v.fix == "model.gradient_checkpointing=true"
    assert v.fix_peak_gb < v.usable_gb


def test_megatron_fix_is_a_larger_tp_never_a_refused_peft():
    # backend=megatron shards by TP and has no 4-bit layers: the 70B at tp=1 on 8 H100s is fixed by
    # the TP the heads and devices allow, and no fix names peft=qlora (rule qlora-megatron)
    m = model_cfg("70b")
    c = count(probe(m), m.arch, lora())
    s = Setup(peft="lora", precision="bf16-mixed", backend="megatron", devices=8, micro_batch=4, seq_len=2048)
    v = verdict(c, m.arch, s, 80, "cuda")
    assert not v.fits and v.fix.startswith("backend.tp=") and "qlora" not in v.fix, v.fix
    tp = int(v.fix.split("=")[1])
    assert verdict(c, m.arch, s.but(tp=tp), 80, "cuda").fits
    assert not verdict(c, m.arch, s.but(tp=tp // 2), 80, "cuda").fits  # the smallest TP that fits
    tight = verdict(c, m.arch, s, 20, "cuda")  # no Megatron layout fits: qlora only off Megatron (FSDP2)
    assert tight.fix is None or ("qlora" not in tight.fix or tight.fix.startswith("backend=fsdp2")) \
        and tight.fix.count("backend.tp=") <= 1, tight.fix


def test_dpo_reference_and_grpo_generation_terms():
    kw = dict(peft="none", precision="bf16-mixed", micro_batch=2, seq_len=1024)
    sft = _est("llama3-8b", method="sft", **kw)[2]
    copy = _est("llama3-8b", method="dpo", dpo_ref="copy", **kw)[2]
    pre = _est("llama3-8b", method="dpo", dpo_ref="precompute", **kw)[2]
    assert copy.reference > 0 and pre.reference == 0
    assert pre.activations == pytest.approx(2 * sft.activations)  # chosen + rejected
    short = _est("llama3-8b", method="grpo", completion_len=128, **kw)[2]
    long = _est("llama3-8b", method="grpo", completion_len=1024, **kw)[2]
    assert long.generation > short.generation > 0
    vllm = _est("llama3-8b", method="grpo", vllm_fraction=0.3, **kw)[2]
    assert vllm.generation == 0 and vllm.vllm_fraction == 0.3


def test_grpo_rollouts_come_from_the_methods_own_options_and_defaults():
    """The planner reads what a method generates from its spec (MethodSpec.generation), with the
    method's own Config defaults for an option the node leaves out, validated or not: the plan
    of a GRPO node without max_new_tokens and share_prompt is the plan with GRPO's defaults."""
    from workbench.methods.grpo import Config
    from workbench.plan.make import from_cfg

    full = compose(["method=grpo"], base=())
    bare = compose(["method=grpo", "~method.max_new_tokens", "~method.share_prompt"], base=(), validate=False)
    s_full, s_bare = from_cfg(full), from_cfg(bare)
    assert (s_bare.completion_len, s_bare.share_prompt) == (Config.max_new_tokens, Config.share_prompt) == (8, True)
    assert s_bare == s_full
    # a run's own options win: 32 new tokens, completions as rows
    mine = from_cfg(compose(["method=grpo", "method.max_new_tokens=32", "method.share_prompt=false"], base=()))
    assert (mine.completion_len, mine.share_prompt, mine.rollouts) == (32, False, True)
    # a method that generates nothing plans no completions
    assert (from_cfg(compose([], base=())).completion_len, from_cfg(compose([], base=())).rollouts) == (0, False)


def test_each_method_is_counted_as_the_catalog_says():
    """workbench/methods/spec.py: pair methods put two sequences through the model, KTO keeps a copied
    reference without peft (CPO/ORPO/RM none), distillation holds its teacher (sized by
    plan.teacher_scale), and methods that generate keep a KV cache; the resolved run decides the
    reference, so a config without one plans none."""
    kw = dict(peft="none", precision="bf16-mixed", micro_batch=2, seq_len=1024)
    sft = _est("llama3-8b", method="sft", **kw)[2]
    for pair in ("kto", "cpo", "orpo", "rm"):
        assert _est("llama3-8b", method=pair, dpo_ref="none", **kw)[2].activations == pytest.approx(2 * sft.activations)
    assert _est("llama3-8b", method="kto", dpo_ref="copy", **kw)[2].reference > 0
    one = _est("llama3-8b", method="distill", dpo_ref="none", **kw)[2]
    big = _est("llama3-8b", method="distill", dpo_ref="none", teacher_scale=8.0, **kw)[2]
    assert one.reference > 0 and big.reference == pytest.approx(8 * one.reference) and one.generation > 0
    for name, ref in (("kto", "copy"), ("cpo", "none"), ("orpo", "none"), ("rm", "none"), ("distill", "none")):
        assert setup_from(["method=" + name, "peft=none"]).dpo_ref == ref, name
    # FLOPs: each pass a method adds beyond training (a reference's or a teacher's forward, a
    # generated token) costs one forward, whose share of a training step is measured here
    n = 8e9
    train_step = train_flops_per_token(n, n, "none", "cpo")
    forward = train_flops_per_token(n, n, "none", "kto", "copy") - train_flops_per_token(n, n, "none", "kto", "none")
    assert forward / train_step == measured_forward_share()
    assert train_flops_per_token(n, n, "none", "distill") == train_step + 2 * forward  # teacher + generation
    assert train_flops_per_token(n, n, "none", "sft") == train_step  # no extra pass


def measured_forward_share() -> float:
    """A forward pass's share of a training step's FLOPs, by PyTorch's counter on a stack of
    Linear layers (a decoder's weights): backward computes the input and the weight gradients,
    two matmuls the size of the forward's one."""
    from torch.utils.flop_counter import FlopCounterMode

    layers = torch.nn.Sequential(*(torch.nn.Linear(32, 32, bias=False) for _ in range(3)))
    x = torch.randn(4, 32, requires_grad=True)
    with FlopCounterMode(display=False) as fwd:
        y = layers(x).sum()
    with FlopCounterMode(display=False) as bwd:
        y.backward()
    return fwd.get_total_flops() / (fwd.get_total_flops() + bwd.get_total_flops())


def setup_from(overrides):
    from workbench.plan.make import from_cfg

    extra = ["method.teacher=tiny"] if "method=distill" in overrides else []
    return from_cfg(compose([*overrides, *extra]))


def test_worked_example_70b_1t_tokens_256_h100():
    h100 = catalog.profiles()["h100-80gb"]
    fpt = train_flops_per_token(70e9, 70e9, "none")
    assert fpt == 6 * 70e9
    sp = speed(1e12, fpt, 256, catalog.peak_tflops(h100, "fp8"), mfu=0.38, price=[3.0, 3.0])
    # the figures workbench/plan/speed.py quotes, to their rounding (tests/tolerances.py)
    assert sp.days == pytest.approx(25, rel=QUOTED_FIGURE_RTOL)
    assert sp.device_hours == pytest.approx(153_600, rel=QUOTED_FIGURE_RTOL)
    assert sp.cost[0] == pytest.approx(460_000, rel=QUOTED_FIGURE_RTOL)
    exact = speed(1e12, fpt, 256, 1.0, mfu=1.0, price=[3.0])
    assert exact.cost[0] == pytest.approx(exact.device_hours * 3)


def test_lora_flops_are_fewer_and_dollars_per_million_tokens():
    assert train_flops_per_token(1e9, 1e7, "lora") < train_flops_per_token(1e9, 1e9, "none")
    assert cost_per_million_tokens(tokens_per_s=1e6 / 3600, devices=1, price_per_hour=2.0) == pytest.approx(2.0)


def test_catalog_profiles_are_what_a_run_composes():
    """The planner's catalog (workbench/plan/catalog.py reads conf/hardware itself) holds, for every
    profile, what Hydra composes for `hardware=<name>`: the same memory, FLOP/s, prices and
    launch settings, with a profile that extends another (8xh100 from h100-80gb) merged alike."""
    from omegaconf import OmegaConf

    p = catalog.profiles()
    assert set(p) == {path.stem for path in (Path(CONF) / "hardware").glob("*.yaml")}
    for name, hw in p.items():
        composed = OmegaConf.to_container(compose([f"hardware={name}"]).hardware, resolve=True)
        assert OmegaConf.to_container(hw, resolve=True) == composed, name
        if hw.device != "cpu":
            assert hw.memory_gb > 0 and hw.bf16_tflops > 0 and len(hw.price_per_hour) == 2, name
            assert hw.price_per_hour[0] <= hw.price_per_hour[1] and hw.price_date, name
    assert p["8xh100"].procs == 8 and p["8xh100"].memory_gb == p["h100-80gb"].memory_gb
    assert "NCCL_IB_HCA" in p["h100-ib"].env and p["gb200-nvl72"].env["NCCL_NVLS_ENABLE"] == "1"
    assert p["gb200-nvl72"].procs * p["gb200-nvl72"].nodes == 72


def test_make_plan_for_70b_dpo_on_cpu_refuses_with_where_it_fits():
    cfg = compose(["model=70b", "method=dpo", "hardware=cpu", "plan.hardware=[8xh100,h100-80gb,8xb200]"])
    plan = make_plan(cfg)
    assert plan["params"]["total"] == 70_553_706_496
    assert not plan["here"]["fits"]
    msg = refusal(plan)
    assert "GiB per device" in msg and "hardware=" in msg and "$" in msg
    assert {r["hardware"] for r in plan["profiles"]} == {"8xh100", "h100-80gb", "8xb200"}


def test_tracker_logs_dollars_per_million_tokens(tmp_path):
    t = Tracker(tmp_path)
    t.set_price([2.0, 4.0], devices=8)
    t.log({"step": 1, "loss": 1.0, "tokens_per_s": 8e6 / 3600})
    row = t.rows[0]
    assert row["usd_per_mtok"] == pytest.approx([2.0, 4.0])  # 8 devices x $2/h for 8M tokens/h
    assert row["usd_per_mtok"][0] == pytest.approx(usd_per_million_tokens(8e6 / 3600, 8, 2.0))
    bare = Tracker(tmp_path / "b")
    bare.set_price([], devices=1)
    bare.log({"step": 1, "loss": 1.0, "tokens_per_s": 10.0})
    assert "usd_per_mtok" not in bare.rows[0]


def test_a_plan_derives_each_config_once(monkeypatch):
    # the configured run once for every hardware row and note, each change the planner tries once
    # for every row it is tried on (it used to derive again per row, per term and per candidate)
    from omegaconf import OmegaConf

    from workbench.plan import make

    derived, real = [], make.derive
    monkeypatch.setattr(make, "derive", lambda c: derived.append(OmegaConf.to_yaml(c)) or real(c))
    make.make_plan(compose(["method=dpo", "model=70b", "hardware=8xh100"], base=()))
    assert len(derived) >= 2 and len(derived) == len(set(derived))  # the config and the changes it tried
