"""The run manifest: everything needed to say how a model was made.

Package versions, git commit, hardware, data fingerprints, chat-template hash and EOS ids,
where the weights came from, and the composed config with secrets removed (the rule of
workbench/core/secrets.py). Secrets (HF_TOKEN, WANDB_API_KEY, cloud keys) are read from the
environment only and never written here.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

from workbench.core.secrets import redact

PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "bitsandbytes", "hydra-core",
            "safetensors", "deepspeed", "megatron-core", "vllm", "unsloth", "liger-kernel", "ray", "modal", "runpod")


def versions() -> dict[str, str]:
    out = {}
    for p in PACKAGES:
        try:
            out[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def git_sha() -> str | None:
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (sha + ("+dirty" if dirty else "")) if sha else None


def hardware() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def build(config: dict, model_source: dict, data: dict, contract) -> dict:
    """The manifest, redacted as a whole: a data path or model source can hold a token too."""
    return redact({
        "versions": versions(),
        "git": git_sha(),
        "hardware": hardware(),
        "model_source": model_source,
        "data": data,
        "chat_template": {"sha256_16": contract.template_hash, "end_of_turn": contract.end_of_turn,
                          "end_of_turn_id": contract.end_of_turn_id},
        "config": config,
    })
