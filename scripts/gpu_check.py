"""The prepared GPU check: one short run that measures the GPU path and prints one JSON summary.

    bash scripts/gpu_check.sh              # on one CUDA GPU (sized for <= 8 min on an H200)
    bash scripts/gpu_check.sh --dry        # the same wiring on CPU, tiny model, 2 steps (CI)

Sections (each guarded: a missing package or a refusal records "skipped: <why>", a crash
records "error: <why>" and makes the exit status 1):

  bf16_full_ft   tokens/s and MFU, full fine-tuning in bf16-mixed: SmolLM2-135M and a ~1.2B
                 Llama config with random weights
  lora           LoRA and QLoRA tokens/s on SmolLM2-135M: plain HF, kernels=liger, model.loader=unsloth
  fp8            fp8 vs bf16-mixed on the ~1.2B config: median step time and loss after N steps
  rollout        GRPO-style rollout tokens/s: HF generate vs the colocated vLLM engine, with the
                 engine's weight-sync check before and after a weight update
  episodes       multi-turn calculator episodes (env=calc) turn by turn: HF generate vs vLLM serving
                 the turns (workbench/rollout/episodes.py), episodes/s
  planner        workbench.plan's predicted peak memory vs torch.cuda.max_memory_allocated, 3 configs
  megatron       backend=megatron vs backend=single: first-step loss on the same batch; LoRA on
                 Megatron layers; Megatron-Core's distributed optimizer with NCCL, bf16 parameters
                 and fp32 main weights (Transformer Engine's or Apex's fused Adam, none of the CPU
                 shims); with 2 GPUs a tiny Mixtral at tp=2 with sequence parallelism

MFU is reported twice: against the matmul peak the runner measures in-process, and against
the hardware profile's datasheet bf16 TFLOP/s. Without SmolLM2's weights on the machine the
135M runs use random weights of the same shape (noted as "weights": "random").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WORKBENCH_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# ~1.2B Llama (SmolLM2's vocabulary): 16 layers x 2048 wide.
ARCH_1B = ["model.arch.layers=16", "model.arch.hidden=2048", "model.arch.heads=32", "model.arch.kv_heads=8",
           "model.arch.head_dim=64", "model.arch.intermediate=8192"]
# The dry run's stand-in for it: still a different shape from model=tiny.
ARCH_DRY = ["model.arch.layers=1", "model.arch.hidden=32", "model.arch.heads=2", "model.arch.kv_heads=1",
            "model.arch.head_dim=16", "model.arch.intermediate=64"]


class Skip(Exception):
    """A section (or variant) that cannot run here; the message says why."""


class Check:
    def __init__(self, dry: bool, budget_s: float, assets: Path):
        self.dry = dry
        self.t0 = time.perf_counter()
        self.budget = budget_s
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.assets = assets
        self.weights = "n/a"
        self.n = 0
        h200 = (ROOT / "conf" / "hardware" / "h200.yaml").exists()
        self.hw = ["hardware=cpu"] if dry else (["hardware=h200"] if h200 else ["hardware.device=cuda"])

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def need(self, seconds: float) -> None:
        if self.left() < seconds:
            raise Skip(f"time budget: {self.left():.0f}s left, this needs ~{seconds:.0f}s")

    # -- models ----------------------------------------------------------------------------
    def model_135m(self) -> list[str]:
        """Overrides selecting SmolLM2-135M (or its random-weight stand-in)."""
        if self.dry:
            self.weights = "tiny (dry run)"
            return ["model=tiny"]
        from workbench.core.errors import UserError
        from workbench.models.load import converted_dir, locate, zoo_entry

        try:
            locate(zoo_entry("smollm2-135m"))
            self.weights = "pretrained"
        except UserError:
            _random_smollm2(self.assets, converted_dir("smollm2-135m"))
            self.weights = "random (SmolLM2-135M weights not on this machine)"
        return ["model=smollm2-135m"]

    def model_1b(self) -> list[str]:
        return ["model=tiny"] + (ARCH_DRY if self.dry else ARCH_1B)

    # -- runs ------------------------------------------------------------------------------
    def compose(self, overrides: list[str]):
        from hydra import compose, initialize_config_dir

        from workbench.resolve.validate import validate

        self.n += 1
        ov = ["eval=none", "train.export=false", "train.log_every=1000", "optim.warmup_steps=0",
              "optim.scheduler=constant", "train.resume=never", "data.seq_len=256", *self.hw, *overrides,
              f"output_dir={self.tmp}/run{self.n}"]
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return validate(compose(config_name="train", overrides=ov))

    def train(self, overrides: list[str], steps: int, mbs: int) -> dict:
        """Run the shared runner; per-step medians excluding the first (warm-up) step."""
        import torch

        from workbench.core.errors import UserError
        from workbench.run import preflight
        from workbench.run.runner import Runner

        cfg = self.compose([f"train.max_steps={steps}", f"train.micro_batch_size={mbs}", *overrides])
        try:
            preflight.check(cfg)
        except UserError as exc:
            raise Skip(str(exc)) from None
        cuda = cfg.hardware.device == "cuda"
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        # The runner's build and step calls, without its checkpoint/report tail: a 1B full
        # fine-tune would otherwise write ~15 GB of optimizer state per run.
        runner = Runner(cfg)
        runner.build()
        from workbench.compute.flops import FlopCount

        count = FlopCount.from_model(runner.model, runner.run)
        rows = []
        for _ in range(steps):
            t = time.perf_counter()
            batch = runner.method.next_batch(runner.state, runner.backend)
            m = runner.backend.forward_backward(batch, runner.method.loss)
            runner.backend.optimizer_step()
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            runner.state.step += 1
            rows.append({"loss": m["loss"], "tokens_per_s": batch.tokens / dt, "step_s": dt,
                         "flops_per_s": count.step(batch.micro, batch.forward_passes) / dt})  # FLOPs as computed
        timed = rows[1:] or rows  # the first step pays for allocation and autotuning
        tps = statistics.median(r["tokens_per_s"] for r in timed)
        out = {"steps": steps, "micro_batch_size": mbs, "tokens_per_s": tps,
               "step_s": statistics.median(r["step_s"] for r in timed),
               "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
               "n_params": runner.n_params, "n_trainable": runner.n_trainable}
        from workbench.plan.peak import measured_peak_flops

        achieved = statistics.median(r["flops_per_s"] for r in timed)
        out["mfu_vs_measured_peak"] = achieved / measured_peak_flops(cfg.hardware.device, runner.pol)
        if cfg.hardware.bf16_tflops:
            out["mfu_vs_datasheet"] = achieved / (cfg.hardware.bf16_tflops * 1e12)
        if cuda:
            out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
        del runner, batch, m
        if cuda:
            torch.cuda.empty_cache()
        return out


def _random_smollm2(assets: Path, out: Path) -> None:
    """A SmolLM2-135M-shaped model with random weights and the real tokenizer (from `assets`)."""
    if (out / "model.safetensors").exists():
        return
    if not (assets / "tokenizer.json").exists():
        raise Skip(f"no SmolLM2-135M weights and no tokenizer assets in {assets}; "
                   "run `bash scripts/gpu_check.sh --prepare` where the weights are and carry .gpu_assets")
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    for f in assets.iterdir():
        shutil.copy(f, out / f.name)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out)).save_pretrained(out)


# -- sections ------------------------------------------------------------------------------------
def bf16_full_ft(c: Check) -> dict:
    steps, mbs = (2, 2) if c.dry else (12, 64)
    out = {"smollm2_135m": c.train(c.model_135m() + ["peft=none", "precision=bf16-mixed", "optim.lr=2e-5"],
                                   steps, mbs)}
    out["smollm2_135m"]["weights"] = c.weights
    c.need(0 if c.dry else 90)
    out["llama_1b_random"] = c.train(c.model_1b() + ["peft=none", "precision=bf16-mixed", "optim.lr=2e-5"],
                                     steps, mbs // 2 or 1)
    return out


def lora(c: Check) -> dict:
    steps, mbs = (2, 2) if c.dry else (10, 64)
    out = {}
    for kind in ("lora", "qlora"):
        for variant, extra in (("hf", []), ("liger", ["kernels=liger"]), ("unsloth", ["++model.loader=unsloth"])):
            key = f"{kind}_{variant}"
            try:
                c.need(0 if c.dry else 30)
                out[key] = c.train(c.model_135m() + [f"peft={kind}", "precision=bf16-mixed", *extra], steps, mbs)
            except Skip as exc:
                out[key] = f"skipped: {exc}"
    return out


def fp8(c: Check) -> dict:
    steps, mbs = (2, 2) if c.dry else (20, 16)
    out = {}
    for prec in ("bf16-mixed", "fp8"):
        try:
            out[prec] = c.train(c.model_1b() + ["peft=none", f"precision={prec}", "optim.lr=1e-5"], steps, mbs)
        except Skip as exc:
            out[prec] = f"skipped: {exc}"
    if isinstance(out["fp8"], dict):
        out["fp8_speedup"] = out["bf16-mixed"]["step_s"] / out["fp8"]["step_s"]
        out["loss_last_diff"] = out["fp8"]["loss_last"] - out["bf16-mixed"]["loss_last"]
    return out


def rollout(c: Check) -> dict:
    import torch

    from workbench.compute.precision import autocast, policy
    from workbench.data.chat import setup_tokenizer
    from workbench.models.load import load_model, load_tokenizer
    from workbench.rollout.generate import generate

    prompts, gens, new = (2, 2, 4) if c.dry else (64, 8, 128)
    cfg = c.compose(c.model_135m() + ["peft=none", "precision=bf16-mixed"])
    tok = load_tokenizer(cfg.model)
    contract = setup_tokenizer(tok, cfg.data.chat_template)
    dev = cfg.hardware.device
    model = load_model(cfg.model, dtype=torch.bfloat16 if dev == "cuda" else torch.float32, device=dev)
    convs = [[{"role": "user", "content": f"What is {10 + i} + {i * 3 % 90}?"}] for i in range(prompts)]
    out = {"prompts": prompts, "generations": gens, "max_new_tokens": new, "weights": c.weights}

    def timed(fn):
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        ids = fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        n = sum(len(x) for x in ids)
        return {"seconds": dt, "completion_tokens": n, "tokens_per_s": n / dt, "sequences": len(ids)}

    out["hf_generate"] = timed(lambda: generate(
        model, tok, convs, new, contract.end_of_turn_id, do_sample=True, temperature=1.0,
        num_return_sequences=gens, autocast=autocast(policy("bf16-mixed"), dev)))
    try:
        from workbench.core.errors import UserError
        from workbench.resolve import rules
        from workbench.rollout.vllm_engine import VLLMEngine

        vcfg = c.compose(c.model_135m() + ["peft=none", "precision=bf16-mixed", "method=grpo", "method.engine=vllm"])
        try:
            rules.check(vcfg)  # vllm-needs-cuda, vllm-needs-package, ...
        except UserError as exc:
            raise Skip(str(exc)) from None
        engine = VLLMEngine(vcfg, tok, contract)
        first = engine.sync_weights(model)
        out["vllm"] = timed(lambda: engine.generate(convs, gens, new, 1.0, 1.0))
        with torch.no_grad():  # a stand-in optimizer step: the engine must follow it
            w = model.model.layers[0].mlp.down_proj.weight
            w.add_(torch.randn_like(w) * 0.01)
        second = engine.sync_weights(model)
        out["vllm_weight_check"] = {"first_sync": first, "after_update": second,
                                    "checksum_changed": first["checksum"] != second["checksum"]}
        out["vllm_speedup"] = out["vllm"]["tokens_per_s"] / out["hf_generate"]["tokens_per_s"]
    except Skip as exc:
        out["vllm"] = f"skipped: {exc}"
    return out


def planner(c: Check) -> dict:
    """Predicted (workbench.plan.make_plan) vs measured peak memory; packed rows so every
    micro-batch holds seq_len tokens, as the planner assumes."""
    try:
        from workbench.plan.make import make_plan
    except ImportError as exc:
        raise Skip(f"the planner is not importable: {exc}") from None
    mbs = 2 if c.dry else 16
    configs = {"135m_full_bf16": c.model_135m() + ["peft=none", "precision=bf16-mixed"],
               "135m_lora": c.model_135m() + ["peft=lora", "precision=bf16-mixed"],
               "1b_full_bf16": c.model_1b() + ["peft=none", "precision=bf16-mixed"]}
    out = {}
    for name, ov in configs.items():
        ov = ov + ["data.packing=true"]
        plan = make_plan(c.compose(ov + [f"train.micro_batch_size={mbs}", "train.max_steps=3"]), hardware=[])
        entry = {"predicted_peak_gb": plan["memory_gb"]["peak"], "predicted_terms_gb": plan["memory_gb"]}
        if c.dry:
            entry["measured_peak_gb"] = "skipped: --dry (no CUDA memory counters on CPU)"
        else:
            try:
                c.need(0 if c.dry else 40)
                run = c.train(ov, 3, mbs)
                entry["measured_peak_gb"] = run.get("peak_memory_gb", "n/a on CPU")
                if isinstance(entry["measured_peak_gb"], float):
                    entry["predicted_over_measured"] = entry["predicted_peak_gb"] / entry["measured_peak_gb"]
            except Skip as exc:
                entry["measured_peak_gb"] = f"skipped: {exc}"
        out[name] = entry
    return out


def megatron(c: Check) -> dict:
    from workbench.backends.registry import SPECS

    if "megatron" not in SPECS:
        raise Skip("backend=megatron is not registered in workbench.backends")
    if c.dry:
        raise Skip("--dry: the Megatron forward check runs on the GPU only")
    if importlib.util.find_spec("megatron.core") is None:
        raise Skip("megatron-core is not installed")
    common = ["model=tiny", "peft=none", "precision=bf16-mixed", "optim.lr=1e-6"]
    single = c.train(common + ["backend=single"], 2, 4)
    mega = c.train(common + ["backend=megatron"], 2, 4)
    out = {"single_loss_step1": single["loss_first"], "megatron_loss_step1": mega["loss_first"],
           "abs_diff": abs(single["loss_first"] - mega["loss_first"])}
    # Megatron-Core's own optimizer on its GPU path: bf16 parameters, fp32 main weights and
    # moments, grads reduced in fp32 over NCCL, TE/Apex fused Adam (on CPU: torch AdamW, shims)
    lr = ["optim.lr=1e-4", "optim.max_grad_norm=1.0"]
    torch_opt = c.train(common[:3] + lr + ["backend=megatron"], 4, 4)
    dist_opt = c.train(common[:3] + lr + ["backend=megatron", "backend.distributed_optimizer=true"], 4, 4)
    out["distributed_optimizer"] = {"torch_adamw_losses": [torch_opt["loss_first"], torch_opt["loss_last"]],
                                    "megatron_losses": [dist_opt["loss_first"], dist_opt["loss_last"]],
                                    "peak_memory_gb": dist_opt.get("peak_memory_gb"),
                                    "tokens_per_s": dist_opt["tokens_per_s"]}
    lora_single = c.train(["model=tiny", "peft=lora", "precision=bf16-mixed", "backend=single"], 3, 4)
    lora_mega = c.train(["model=tiny", "peft=lora", "precision=bf16-mixed", "backend=megatron"], 3, 4)
    out["lora"] = {"single_losses": [lora_single["loss_first"], lora_single["loss_last"]],
                   "megatron_losses": [lora_mega["loss_first"], lora_mega["loss_last"]],
                   "megatron_tokens_per_s": lora_mega["tokens_per_s"], "single_tokens_per_s": lora_single["tokens_per_s"]}
    out["moe_tp2_sequence_parallel"] = _moe_sequence_parallel(c)
    return out


def _moe_sequence_parallel(c: Check):
    """A tiny Mixtral at tp=2 with sequence parallelism (2 GPUs, Transformer Engine or Apex norms)
    against the same model at tp=1: first-step losses on the same batch (bf16)."""
    import subprocess

    import torch

    if torch.cuda.device_count() < 2:
        return "skipped: tp=2 needs 2 GPUs (this machine has 1)"
    moe = ["model=tiny", "model.arch.family=mixtral", "model.arch.experts=4", "model.arch.experts_per_token=2",
           "peft=none", "precision=bf16-mixed", "optim.lr=1e-6", "train.max_steps=2", "train.micro_batch_size=4",
           "eval=none", "train.export=false", "backend=megatron", "hardware.procs=2", *c.hw]
    losses = {}
    layouts = {"tp2_sp": ["backend.tp=2", "backend.sequence_parallel=true"],
               "ep2": ["backend.ep=2", "train.micro_batch_size=2"]}  # 2 data-parallel ranks: the same 4 rows
    for name, extra in layouts.items():
        out = c.tmp / f"moe_{name}"
        proc = subprocess.run([sys.executable, "-m", "workbench", *moe, *extra, f"output_dir={out}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=max(60, int(c.left()) - 10))
        if proc.returncode:
            return f"error: {name}: {proc.stderr[-1500:]}"
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in rows if "loss" in r and "eval" not in r]
    return {"losses": losses, "step1_abs_diff": abs(losses["tp2_sp"][0] - losses["ep2"][0])}


def episodes(c: Check) -> dict:
    """Multi-turn calculator episodes (env=calc): HF generate turn by turn against the colocated
    vLLM engine serving the same turns (VLLMEngine.generate_ids), episodes/s and turns."""
    import torch

    from workbench.compute.precision import autocast, policy
    from workbench.data.chat import setup_tokenizer
    from workbench.envs.registry import load
    from workbench.evals.hooks import eval_rows
    from workbench.models.load import load_model, load_tokenizer
    from workbench.rollout import episodes as loop
    from workbench.rollout.generate import generate_ids
    from workbench.rollout.turns import Turns

    rows_n, gens, new = (2, 2, 4) if c.dry else (32, 8, 48)
    cfg = c.compose(c.model_135m() + ["peft=none", "precision=bf16-mixed", "method=grpo", "env=calc"])
    tok = load_tokenizer(cfg.model)
    contract = setup_tokenizer(tok, cfg.data.chat_template)
    dev = cfg.hardware.device
    model = load_model(cfg.model, dtype=torch.bfloat16 if dev == "cuda" else torch.float32, device=dev)
    env = load(cfg.env)
    turns = Turns(tok, contract, env.tools)
    rows = [{**r, "_where": "calc_eval"} for r in eval_rows("calc", rows_n)]
    out = {"rows": rows_n, "generations": gens, "max_new_tokens_per_turn": new, "weights": c.weights}

    def timed(sample):
        t = time.perf_counter()
        eps = loop.run(env, turns, rows, sample, repeat=gens, max_new_tokens=new, max_turns=env.max_turns)
        dt = time.perf_counter() - t
        return {"seconds": dt, "episodes_per_s": len(eps) / dt, "sampled_tokens": sum(e.sampled for e in eps),
                "turns_mean": sum(e.turns for e in eps) / len(eps), "tool_calls": sum(e.tool_calls for e in eps)}

    ac = autocast(policy("bf16-mixed"), dev)
    out["hf_generate"] = timed(lambda p, first: generate_ids(model, p, new, contract.end_of_turn_id, tok.pad_token_id,
                                                             do_sample=True, autocast=ac))
    try:
        from workbench.core.errors import UserError
        from workbench.resolve import rules
        from workbench.rollout.vllm_engine import VLLMEngine

        vcfg = c.compose(c.model_135m() + ["peft=none", "precision=bf16-mixed", "method=grpo", "method.engine=vllm",
                                           "env=calc"])
        try:
            rules.check(vcfg)  # vllm-needs-cuda, vllm-needs-package, ...
        except UserError as exc:
            raise Skip(str(exc)) from None
        engine = VLLMEngine(vcfg, tok, contract)
        engine.sync_weights(model)
        engine.wake()
        out["vllm"] = timed(lambda p, first: engine.generate_ids(p, new, 1.0, 1.0))
        engine.sleep()
        out["vllm_speedup"] = out["vllm"]["episodes_per_s"] / out["hf_generate"]["episodes_per_s"]
    except Skip as exc:
        out["vllm"] = f"skipped: {exc}"
    return out


SECTIONS = {"bf16_full_ft": bf16_full_ft, "lora": lora, "fp8": fp8, "rollout": rollout, "episodes": episodes,
            "planner": planner, "megatron": megatron}


def environment() -> dict:
    import torch

    env = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["capability"] = list(torch.cuda.get_device_capability())
    for pkg in ("transformers", "peft", "accelerate", "bitsandbytes", "liger_kernel", "unsloth", "vllm",
                "torchao", "transformer_engine", "flash_attn", "megatron.core", "hydra"):
        try:
            env[pkg] = importlib.util.find_spec(pkg) is not None
        except ModuleNotFoundError:
            env[pkg] = False
    return env


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check")
    ap.add_argument("--dry", action="store_true", help="CPU, tiny model, 2 steps: wiring only")
    ap.add_argument("--only", default="", help="comma-separated sections")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for all sections")
    ap.add_argument("--assets", default=str(ROOT / ".gpu_assets" / "smollm2-135m"))
    ap.add_argument("--out", default="", help="also write the JSON here")
    a = ap.parse_args(argv)
    import torch

    if not a.dry and not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device; use --dry on CPU"}))
        return 2
    c = Check(a.dry, a.budget, Path(a.assets))
    summary: dict = {"mode": "dry" if a.dry else "gpu", "environment": environment()}
    wanted = [s for s in a.only.split(",") if s] or list(SECTIONS)
    failed = False
    for name in wanted:
        t = time.perf_counter()
        try:
            c.need(0 if a.dry else 20)
            summary[name] = SECTIONS[name](c)
        except Skip as exc:
            summary[name] = f"skipped: {exc}"
        except Exception as exc:  # noqa: BLE001 - one broken section must not hide the others
            failed = True
            summary[name] = f"error: {type(exc).__name__}: {exc}"
            traceback.print_exc()
        if isinstance(summary[name], dict):
            summary[name]["section_seconds"] = time.perf_counter() - t
    summary["total_seconds"] = time.perf_counter() - c.t0
    import shutil

    shutil.rmtree(c.tmp, ignore_errors=True)
    text = json.dumps(summary, indent=1, default=str)
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
