"""backend.distributed_optimizer=true: Megatron-Core's own DDP and optimizer behind the backend.

    opt = DistributedOptimizer(gpt, cfg.optim, params_dtype)   # after the weights are bridged in
    opt.ddp                        # the model chunk the schedule runs (grads land in param.main_grad)
    opt.zero_grad(); <schedule>; opt.finalize()                 # DP reduce-scatter, SP norms, tied embeddings
    grad_norm = opt.step(lr)       # clip over the model-parallel groups, step, all-gather the params
    step, moments, masters = opt.full_state()                   # per Megatron parameter, whole (collective)
    opt.load_full_state(step, moments, masters)

`get_megatron_optimizer` with `use_distributed_optimizer=True`: each data-parallel rank keeps
the fp32 main weights and Adam moments of its 1/dp of every gradient buffer (experts: of the
expert-data-parallel group), steps them, and all-gathers the updated parameters. Its mixed
precision is Megatron's own: bf16 (or fp16) parameters in the model, fp32 main weights in the
optimizer, gradients reduced in fp32 (`grad_reduce_in_fp32`). Gradients are clipped by the
global norm over the model-parallel groups (`clip_grad`). Every parameter decays by
optim.weight_decay (`config_overrides={}`), as the other backends' torch AdamW does; Megatron's
default exempts biases and norms.

On CPU: without Transformer Engine or Apex, Megatron-Core 0.16.1 steps torch's AdamW, and
builds and steps it with CUDA allocations and type checks that `cpu_shim.optimizer_cpu()` routes
to the CPU. The losses' reduction is the workbench's: `calculate_per_token_loss` keeps DDP from
averaging over ranks (the losses are already divided by the global denominator), and
`finalize_model_grads` is called here with no token count (the schedule would otherwise divide
every gradient by the count of micro-batches the loss function reports).

`full_state` / `load_full_state` give and put, per Megatron parameter of this rank (its TP shard
of its PP stage), the whole fp32 main weight and Adam moments, gathered from (scattered to) the
data-parallel ranks' shards: the form the checkpoint code maps through the bridge. Loading into
the torch-AdamW fallback needs two workarounds (a fresh optimizer has no state to copy into;
torch AdamW increments `step` in place, so one shared step tensor would count N steps per step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from workbench.megatron.cpu_shim import cpu_device, optimizer_cpu

KINDS = {"adamw": "adam", "sgd": "sgd"}
MOMENTS = ("exp_avg", "exp_avg_sq")


class DistributedOptimizer:
    def __init__(self, gpt, optim_cfg, params_dtype: torch.dtype):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.gpt, self.params_dtype = gpt, params_dtype
        config = OptimizerConfig(
            optimizer=KINDS[optim_cfg.name], lr=optim_cfg.lr, weight_decay=optim_cfg.weight_decay,
            adam_beta1=float(optim_cfg.betas[0]), adam_beta2=float(optim_cfg.betas[1]), adam_eps=optim_cfg.eps,
            sgd_momentum=0.0, clip_grad=float(optim_cfg.max_grad_norm or 0.0),
            bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16, params_dtype=params_dtype,
            use_distributed_optimizer=True)
        with cpu_device(), optimizer_cpu():
            self.ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(
                use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False), gpt)
            self.opt = get_megatron_optimizer(config, [self.ddp], config_overrides={})
        self.parts = getattr(self.opt, "chained_optimizers", [self.opt])

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()

    def finalize(self) -> None:
        from megatron.core.distributed import finalize_model_grads

        with cpu_device(), optimizer_cpu():
            finalize_model_grads([self.ddp], num_tokens=None)

    def step(self, lr: float) -> float:
        for group in self.opt.param_groups:
            group["lr"] = lr
        with cpu_device(), optimizer_cpu():
            ok, grad_norm, _ = self.opt.step()
            if grad_norm is None:
                grad_norm = self.opt.get_grad_norm()
        if not ok:
            raise FloatingPointError("megatron optimizer: non-finite gradients (step skipped)")
        return float(grad_norm)

    def local_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: moments, and main weights where they are
        fp32 copies of half-precision parameters (fp32 main weights are views of the model's)."""
        held = 0
        for part in self.parts:
            for group in part.optimizer.param_groups:
                for p in group["params"]:
                    st = part.optimizer.state.get(p, {})
                    held += sum(t.numel() * t.element_size() for t in st.values() if torch.is_tensor(t) and t.dim())
                    if self.params_dtype != torch.float32:
                        held += p.numel() * p.element_size()
        return held

    # -- whole per-parameter state, for checkpoints ----------------------------------------------
    def _shards(self):
        """(name, parameter, this rank's [start, end) of it, its tensors, optimizer part) per
        parameter that has a shard here."""
        names = {p: n for n, p in self.gpt.named_parameters()}
        for part in self.parts:
            for p, _ in part.model_param_group_index_map.items():
                rng = part._get_model_param_range_map(p)["param"]
                yield names[p], p, (rng.start, rng.end), part._get_main_param_and_optimizer_states(p), part

    def full_state(self) -> tuple[int, dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        """(step, {moment: {name: whole tensor}}, {name: whole fp32 main weight}) (collective over
        each part's data-parallel group)."""
        with cpu_device(), optimizer_cpu():
            mine: dict = {}
            for name, p, rng, tensors, part in self._shards():
                mine.setdefault(id(part), {})[name] = (tuple(p.shape), rng, {k: v.detach().float().cpu().clone()
                                                                             for k, v in tensors.items()
                                                                             if torch.is_tensor(v) and v.dim()})
            step = max((int(s["step"]) for part in self.parts for s in part.optimizer.state.values() if "step" in s),
                       default=0)
        masters: dict[str, torch.Tensor] = {}
        moments: dict[str, dict[str, torch.Tensor]] = {k: {} for k in MOMENTS}
        for part in self.parts:
            everyone = [mine.get(id(part), {})]
            group = part.data_parallel_group
            if dist.get_world_size(group) > 1:
                everyone = [None] * dist.get_world_size(group)
                dist.all_gather_object(everyone, mine.get(id(part), {}), group=group)
            for name in sorted({n for shard in everyone for n in shard}):
                shape = next(shard[name][0] for shard in everyone if name in shard)
                pieces = sorted((shard[name][1], shard[name][2]) for shard in everyone if name in shard)
                for key in ("param", *MOMENTS):
                    if key in pieces[0][1]:
                        whole = torch.cat([t[key] for _, t in pieces]).view(shape)
                        (masters if key == "param" else moments[key])[name] = whole
        return step, {k: v for k, v in moments.items() if v}, masters

    def load_full_state(self, step: int, moments: dict, masters: dict) -> None:
        """Put whole per-parameter state back into this rank's shards (every rank, no
        communication). The model's own parameters are loaded separately (the bridge)."""
        with torch.no_grad():
            for name, _, (start, end), tensors, part in self._shards():
                main = tensors["param"]
                main.copy_(masters[name].reshape(-1)[start:end].to(main.dtype))
                state = part.optimizer.state[main]
                for key in MOMENTS if moments else ():  # torch AdamW makes its state at its first step
                    state[key] = moments[key][name].reshape(-1)[start:end].to(main.dtype).clone()
                if moments:
                    state["step"] = torch.tensor(float(step))  # one per parameter: AdamW adds to it in place
