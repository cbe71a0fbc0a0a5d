"""Clear errors from the sharding backends and the torchrun launcher, raised before any worker
starts or weights load. In-process and fast (no processes are started).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_backend_errors.py
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.conftest import compose
from workbench.errors import UserError


def test_deepspeed_missing_names_the_install_hint(monkeypatch, tmp_path):
    from workbench.cli import run_job

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    cfg = compose(["backend=deepspeed", "hardware.procs=2"], tmp_path, validate=False)
    with pytest.raises(UserError, match=r"deepspeed.*pip install -e '\.\[deepspeed\]'"):
        run_job(cfg)  # checked before any worker starts
    assert not (tmp_path / "checkpoints").exists()
    from workbench.backends import deepspeed

    # The backend's own check, which also guards runs started under the user's own torchrun.
    with pytest.raises(UserError, match=r"'deepspeed' is not installed.*pip install -e '\.\[deepspeed\]'"):
        deepspeed.preflight(compose(["backend=deepspeed"], tmp_path))


def test_procs_above_gpus_is_refused(monkeypatch, tmp_path):
    from workbench.launch.torchrun import check_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    cfg = compose(["hardware.procs=8", "++hardware.device=cuda"], tmp_path)
    with pytest.raises(UserError, match=r"hardware.procs=8 but this machine has 4 GPU\(s\); use hardware.procs=4"):
        check_devices(cfg)
    check_devices(compose(["hardware.procs=4", "++hardware.device=cuda"], tmp_path))  # fits: no error


@pytest.mark.parametrize("overrides, message", [
    (["backend=deepspeed", "backend.stage=2", "backend.offload_param=cpu"],
     r"offload_param=cpu needs ZeRO stage 3: use backend.stage=3 or backend.offload_param=none"),
    (["backend=deepspeed", "backend.stage=0"], r"'backend.stage' must be 1, 2 or 3 .* use backend=single"),
    (["backend=deepspeed", "backend.offload_optimizer=nvme"], r"NVMe offload needs backend.nvme_path"),
    (["backend=fsdp2", "++model.gradient_checkpointing=true"], r"use backend.activation_checkpointing=full"),
    (["backend=fsdp2", "backend.cpu_offload=true"], r"use backend.cpu_offload=false"),
    (["backend=fsdp2", "method=grpo", "method.engine=vllm"], r"use method.engine=hf"),
    (["backend=fsdp2", "method=grpo", "method.beta=0.1", "peft=none"], r"use peft=lora .* or method.beta=0"),
    (["backend=deepspeed", "backend.stage=3", "method=dpo", "peft=none"], r"use method.reference=precomputed"),
])
def test_impossible_combinations_say_what_to_use(tmp_path, overrides, message):
    from workbench.config import plugin_module

    cfg = compose(overrides, tmp_path)
    with pytest.raises(UserError, match=message):
        plugin_module("backend", cfg.backend.name).preflight(cfg)


@pytest.mark.parametrize("precision, storage", [("fp32", "float32"), ("bf16-mixed", "bfloat16")])
def test_qlora_storage_becomes_a_shardable_float(tmp_path, precision, storage):
    from workbench.backends import fsdp2

    cfg = compose(["backend=fsdp2", "peft=qlora", f"precision={precision}"], tmp_path)
    assert cfg.peft.quant_storage == "uint8"
    fsdp2.preflight(cfg)
    assert cfg.peft.quant_storage == storage


def test_worker_command_forwards_overrides_and_pins_output_dir(tmp_path, monkeypatch):
    from workbench.launch import torchrun

    cfg = compose(["backend=fsdp2", "hardware.procs=2"], tmp_path)

    from types import SimpleNamespace

    from workbench.config import CONF_DIR

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
    with pytest.raises(UserError, match="needs hardware.rdzv_endpoint"):
        torchrun.launch_config(compose(["hardware.nodes=2"], tmp_path))
