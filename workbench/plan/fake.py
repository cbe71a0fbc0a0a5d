"""The machinery under `dry_run=trace` (workbench/plan/trace.py): fake tensors that still compute
the batch's bookkeeping, a fake process group of the run's world size, and memory trackers that
say where the peak happens.

    mode = TraceMode()
    with fake_world(8), mode:                 # rank 0 of 8, no second process, no memory
        model = ...                           # parameters are FakeTensors: shapes, dtypes, no data
        batch = mode.known(real_batch)        # small index tensors whose values the step reads
        with peak_tracker(model, [optimizer], fsdp=True) as t:
            ...                               # the step
    t.peak, t.terms(), t.where                # bytes per category at the peak, and when it came

Why a FakeTensorMode of our own: a training step reads a few values, not just shapes. The
selected positions (`hidden[select]`, `select.nonzero()`) set the shape of the head's input,
and a loss or gradient norm is read back as a Python number (`float(loss)`). Plain fake tensors
refuse both (DynamicOutputShapeException, DataDependentOutputException). Here the batch's
index tensors are fake tensors that carry their real values (FakeTensor.constant), and every op
whose inputs all carry values is computed for real (FakeTensorMode's constant propagation, which
torch limits to one element; we allow up to CONSTANT_LIMIT: the masks and ids of a micro-batch).
A number read from a tensor without values (a loss, a norm, a metric) comes back as a stand-in
(1): it never sizes a tensor in the step, only what is logged.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

# Elements a value-carrying tensor may have: a micro-batch's ids, masks and targets (rows x
# seq_len; 16 x 2 x 32k = 1 M), with room to spare. Larger outputs of such ops become plain fakes.
CONSTANT_LIMIT = 1 << 24
_SCALAR_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)
_RANGES = (torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step)


class TraceMode(FakeTensorMode):
    """FakeTensorMode with value-carrying small tensors and stand-ins for scalar reads (above)."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)
        self.stand_ins = 0  # scalar reads answered with a stand-in (reported, for the record)

    def may_turn_const(self, t: torch.Tensor) -> bool:
        return (t.numel() <= CONSTANT_LIMIT and not t.is_sparse and not self.is_our_fake(t)
                and t.device.type != "meta")

    def dispatch(self, func, types, args=(), kwargs=None):
        if func in _RANGES:  # small index ranges carry their values (Megatron compares positions to one)
            with unset_fake_temporarily():
                real = func(*args, **(kwargs or {}))
            if real.numel() <= CONSTANT_LIMIT:
                return self.fake_tensor_converter.from_real_tensor(self, real, make_constant=True)
        if func in _SCALAR_READS and self.is_our_fake(args[0]) and args[0].constant is None \
                and args[0].item_memo is None:
            self.stand_ins += 1
            dtype = args[0].dtype
            return True if dtype == torch.bool else (1.0 if dtype.is_floating_point else 1)
        return super().dispatch(func, types, args, kwargs)

    def known(self, tree):
        """`tree` (dicts, lists, tensors) with every real tensor made a fake one that keeps its values,
        up to CONSTANT_LIMIT elements (a tree row's 4-D attention mask is larger, and only masks)."""
        conv = self.fake_tensor_converter

        def one(x):
            if isinstance(x, torch.Tensor):
                return conv.from_real_tensor(self, x, make_constant=x.numel() <= CONSTANT_LIMIT)
            if isinstance(x, dict):
                return {k: one(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return type(x)(one(v) for v in x)
            return x

        return one(tree)


@contextlib.contextmanager
def module_moves():
    """`module.to(device, dtype)` that puts converted tensors in place of the old ones. torch
    swaps a fake parameter with its converted copy (Module._apply), and a swap refuses a tensor
    that the fake mode has seen in an op ("Cannot swap ... weakref associated with it"); peft
    moves every new adapter to its base layer's device and dtype that way. Replacing is what
    torch's own overwrite mode does (torch.__future__); tied parameters stay tied."""
    orig = torch.nn.Module.to

    def to(self, *args, **kwargs):
        device, dtype, non_blocking, fmt = torch._C._nn._parse_to(*args, **kwargs)
        if fmt is not None:
            return orig(self, *args, **kwargs)
        done = {}

        def convert(t):
            cast = dtype if dtype is not None and (t.is_floating_point() or t.is_complex()) else None
            with torch.no_grad():
                return t.to(device=device, dtype=cast, non_blocking=non_blocking)

        for m in self.modules():
            for key, p in m._parameters.items():
                if p is not None:
                    if id(p) not in done:
                        q = convert(p)
                        done[id(p)] = p if q is p else torch.nn.Parameter(q, requires_grad=p.requires_grad)
                    m._parameters[key] = done[id(p)]
            for key, b in m._buffers.items():
                if b is not None:
                    m._buffers[key] = convert(b)
        return self

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = orig


@contextlib.contextmanager
def global_shapes_apart():
    """DTensor works out an op's output shape by running it on fake tensors of the *global*
    shapes (torch/distributed/tensor/_sharding_prop.py), in the fake mode it finds active, else
    a fresh one. Under the trace it would find ours, and the memory tracker would count those
    whole-model shadows as this rank's: a foreach AdamW op over FSDP2's fp32 moments made 29.9
    GiB of "activations" at Llama 3 8B full fine-tuning on 8 ranks, eight times the local
    moments. Run the propagation as a real run does: outside every mode of the trace, where it
    makes a fresh fake mode of its own."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    orig = ShardingPropagator._propagate_tensor_meta_non_cached

    def apart(self, op_schema):
        with _disable_current_modes():
            return orig(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = apart
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = orig


_COALESCED: list = []  # the library that holds the Meta kernels below, once made


def _coalesced_collectives() -> None:
    """Meta kernels for c10d's coalesced collectives, which torch leaves without one
    (torch/distributed/_meta_registrations.py lists them as deprecated) and Megatron-Core's
    distributed optimizer calls: on fake tensors they return a finished work, as the others do."""
    if _COALESCED:
        return
    from torch.distributed._meta_registrations import create_fakework

    lib = torch.library.Library("c10d", "IMPL")
    for op in ("allreduce_coalesced_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
               "reduce_scatter_tensor_coalesced_"):
        try:
            lib.impl(op, lambda *args: create_fakework(args, return_first_arg=False), "Meta")
        except RuntimeError:  # a torch that has one already
            pass
    _COALESCED.append(lib)


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0):
    """torch's `fake` process group as `rank` of `world`: every collective returns at once, each
    tensor keeps the shape a real one would have. Nothing is sent; the group is destroyed after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("dry_run=trace needs a process without a process group (it makes a fake one)")
    _coalesced_collectives()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    # An object collective pickles into a tensor the fake group never fills: every rank's object is
    # this rank's own (Megatron's pipeline broadcasts its metric names from the last stage). A group
    # asked of another backend (Megatron-Core's gloo side groups) is a fake one too.
    orig = dist.broadcast_object_list, dist.all_gather_object, dist.new_group
    dist.broadcast_object_list = lambda objects, *a, **k: None
    dist.all_gather_object = lambda out, obj, *a, **k: out.__setitem__(slice(None), [obj] * len(out))
    dist.new_group = lambda *a, **k: orig[2](*a, **{**k, "backend": None})
    try:
        yield
    finally:
        dist.broadcast_object_list, dist.all_gather_object, dist.new_group = orig
        dist.destroy_process_group()


class _NoHook:
    def remove(self) -> None:
        pass


def _located(base):
    """A tracker class (torch's MemTracker or FSDPMemTracker) that also records where the peak
    came (the phase: forward, backward, optimizer; the innermost module running then), takes a
    frozen parameter, and a model called again in the same step (a reference pass, the next
    micro-batch): torch's trackers keep per-module figures for one call of the root and refuse a
    second ("multiple iterative calls"); those are dropped at each new call of the root, the
    device's figures (what the trace reports) run on."""

    class Located(base):
        where = ("", "")
        phase: str | None = None  # set by the tracer for a phase of its own (a rollout)
        phase_peaks: dict  # the highest total seen in each phase (peak_tracker makes it)

        def _update_peak_stats(self, peak_state) -> None:
            # The device's peak only: torch's own also walks every module's figures at every op
            # (thousands of modules with adapters at 70B), which the trace does not report.
            for dev, snap in self._curr_mem_snap.items():
                phase = self.phase or ("optimizer" if self._in_opt else "backward" if self._mod_tracker.is_bw
                                       else "forward")
                self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), snap["Total"])
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)
                    mods = sorted(self._mod_tracker.parents - {"Global"}, key=lambda n: (n.count("."), n))
                    self.where = (phase, mods[-1] if mods else "")

        def _update_and_maybe_create_winfos(self, t, reftype, update_existing: bool = False):
            # A meta tensor holds no memory (backend=megatron leaves the HF base's frozen weights
            # as meta once its GPTModel holds them); torch's trackers count its storage's size
            # under a "meta" device, which the trace's sum over devices would add in.
            if t.device.type == "meta":
                return set()
            return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            # MemTracker hooks every parameter's gradient, and torch refuses a hook on one that
            # needs none (a frozen base under peft): mark those hooked already
            for p in module.parameters():
                if not p.requires_grad and self._param_to_grad_hook_handles.get(p, None) is None:
                    self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
            # Megatron-Core's DDP keeps a list named `buffers` that hides Module.buffers()
            shadow = module.__dict__.get("buffers")
            if shadow is not None and not callable(shadow):
                module.__dict__["buffers"] = torch.nn.Module.buffers.__get__(module)
            try:
                return super()._track_module_params_and_buffers(module, install_grad_hooks)
            finally:
                if shadow is not None and not callable(shadow):
                    module.__dict__["buffers"] = shadow

        def _pre_fw_hook(self, module, inputs) -> None:  # MemTracker's
            if not self._mod_tracker.is_bw and module in self.memory_tracking:
                name = self._mod_tracker.get_known_fqn(module)
                if self._mod_tracker.parents - {name} == {"Global"}:
                    self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

        def _fsdp_state_pre_forward(self, fsdp_mod, orig):  # FSDPMemTracker's
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

            def again(*args, **kwargs):
                if fsdp_mod is self._root_mod and not self._mod_tracker.is_bw and fsdp_mod in self.memory_tracking:
                    self.reset_mod_stats()
                return inner(*args, **kwargs)

            return again

    return Located


def peak_tracker(model, optimizers: list, fsdp: bool):
    """A memory tracker of `model` and `optimizers` that locates its peak (enter it inside the mode)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if fsdp:  # FSDP2 backends step one torch optimizer
        tracker = _located(FSDPMemTracker)(model, optimizers[0] if optimizers else None)
    else:
        tracker = _located(MemTracker)()
        tracker.track_external(model, *optimizers)
    tracker.phase_peaks = {}
    return tracker


# What each tracker category is in the planner's terms (workbench/plan/memory.py). FSDP2's
# gathered copies and all-gather buffers are weights on the device, as the planner counts them.
TERMS = {
    "Parameter": "weights", "Buffer": "weights", "Sharded Param": "weights", "Unsharded Param": "weights",
    "All Gather": "weights",
    "Gradient": "grads", "Sharded Grad": "grads", "Unsharded Grad": "grads", "Reduce Scatter": "grads",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries", "Inputs": "temporaries", "Other": "temporaries",
}
TERM_ORDER = ("weights", "grads", "optimizer", "activations", "temporaries")


def peak_terms(tracker) -> tuple[int, dict[str, int], dict[str, int]]:
    """(peak bytes, bytes per planner term at the peak, bytes per tracker category at the peak)
    over every device the tracker saw (one: the traced rank's)."""
    snap = tracker.get_tracker_snapshot("peak")
    cats: dict[str, int] = {}
    for dev in snap.values():
        for k, v in dev.items():
            name = getattr(k, "value", str(k))
            cats[name] = cats.get(name, 0) + int(v)
    total = cats.pop("Total", 0)
    terms = dict.fromkeys(TERM_ORDER, 0)
    for name, v in cats.items():
        terms[TERMS.get(name, "temporaries")] += v
    return total, terms, {k: v for k, v in cats.items() if v}
