"""Clear errors from the sharding backends and the torchrun launcher, raised before any worker
starts or weights load. In-process and fast (no processes are started).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_backend_errors.py
"""

from __future__ import annotations

import sys

import pytest

from tests.conftest import compose
from workbench.core.errors import UserError
from workbench.resolve import rules
from workbench.resolve.resolved import resolve_run

# what the rules see on a machine with every engine installed (tests pass their own Env)
ENGINES = rules.Env(packages=frozenset({"deepspeed", "megatron", "bitsandbytes"}))


def test_deepspeed_missing_names_the_install_hint(monkeypatch, tmp_path):
    from workbench.cli import run_job
    from workbench.run.runner import Runner

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    cfg = compose(["backend=deepspeed", "hardware.procs=2"], tmp_path, validate=False)
    with pytest.raises(UserError, match=r"deepspeed.*pip install -e '\.\[deepspeed\]'"):
        run_job(cfg)  # checked before any worker starts
    assert not (tmp_path / "checkpoints").exists()
    # A run started under the user's own torchrun resolves its run too, before weights load.
    with pytest.raises(UserError, match=r"\[deepspeed-needs-package\].*pip install -e '\.\[deepspeed\]'"):
        Runner(compose(["backend=deepspeed"], tmp_path))


def test_procs_above_gpus_is_refused(tmp_path):
    four = rules.Env(cuda=True, gpus=4, packages=ENGINES.packages)
    cfg = compose(["hardware.procs=8", "++hardware.device=cuda"], tmp_path)
    with pytest.raises(UserError, match=r"hardware.procs=8 but this node has 4 GPU\(s\); set hardware.procs<=4"):
        resolve_run(cfg, env=four)
    resolve_run(compose(["hardware.procs=4", "++hardware.device=cuda"], tmp_path), env=four)  # fits: no error


@pytest.mark.parametrize("overrides, message", [
    (["backend=deepspeed", "backend.stage=2", "backend.offload_param=cpu"],
     r"offload_param needs parameters partitioned: set backend.stage=3"),
    (["backend=deepspeed", "backend.stage=0"], r"ZeRO stages are 1, 2 or 3; .* use backend=single"),
    (["backend=deepspeed", "backend.offload_optimizer=nvme"], r"set backend.nvme_path"),
    (["backend=fsdp2", "++model.gradient_checkpointing=true"], r"use backend.activation_checkpointing=full"),
    (["backend=fsdp2", "backend.cpu_offload=true"], r"set backend.cpu_offload=false"),
    (["backend=fsdp2", "method=grpo", "method.engine=vllm"], r"use method.engine=hf"),
    (["backend=fsdp2", "method=grpo", "method.beta=0.1", "peft=none"], r"use peft=lora .* or method.beta=0"),
    (["backend=deepspeed", "backend.stage=3", "method=dpo", "peft=none"], r"use method.reference=precomputed"),
])
def test_impossible_combinations_say_what_to_use(tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        resolve_run(compose(overrides, tmp_path), env=ENGINES)


@pytest.mark.parametrize("precision, storage", [("fp32", "float32"), ("bf16-mixed", "bfloat16")])
def test_qlora_storage_becomes_a_shardable_float(tmp_path, precision, storage):
    cfg = compose(["backend=fsdp2", "peft=qlora", f"precision={precision}"], tmp_path)
    assert resolve_run(cfg, env=ENGINES).peft.quant_storage == storage
    assert cfg.peft.quant_storage == "uint8"  # decided in the resolved run; the config is not rewritten


def test_worker_command_forwards_overrides_and_pins_output_dir(tmp_path, monkeypatch):
    from workbench.launch import torchrun

    cfg = compose(["backend=fsdp2", "hardware.procs=2"], tmp_path)

    from types import SimpleNamespace

    from workbench.config.files import CONF_DIR

    class Fake:  # what HydraConfig.get() exposes
        class overrides:
            task = ["backend=fsdp2", "hardware.procs=2", "output_dir=relative/x", "++hardware.timeout_minutes=2"]

        class runtime:  # the primary config is conf/train.yaml: nothing more to pass on
            config_sources = [SimpleNamespace(provider="main", schema="file", path=str(CONF_DIR))]

        class job:
            config_name = "train"

    monkeypatch.setattr("hydra.core.hydra_config.HydraConfig.get", staticmethod(lambda: Fake))
    args = torchrun.worker_args(cfg)
    assert args == ["-m", "workbench", "backend=fsdp2", "hardware.procs=2", "++hardware.timeout_minutes=2",
                    f"output_dir={tmp_path.resolve()}"]
    # a run from a saved config (remote far side, python -m workbench.export) keeps it in the workers
    Fake.runtime.config_sources = [SimpleNamespace(provider="main", schema="file", path=str(tmp_path))]
    Fake.job.config_name = "config"
    args = torchrun.worker_args(cfg)
    assert args[:6] == ["-m", "workbench", "--config-path", str(tmp_path.resolve()), "--config-name", "config"]
    lc = torchrun.launch_config(compose(["hardware.procs=2", "++hardware.max_restarts=3"], tmp_path))
    assert (lc.nproc_per_node, lc.max_restarts, lc.min_nodes, lc.rdzv_backend) == (2, 3, 1, "c10d")
    with pytest.raises(UserError, match=r"\[multinode-needs-rendezvous\].*hardware.rdzv_endpoint"):
        resolve_run(compose(["hardware.nodes=2"], tmp_path), env=ENGINES)
