#!/usr/bin/env bash
# The prepared GPU check: bf16/fp8, LoRA/QLoRA with liger and unsloth, vLLM rollouts, the
# planner vs measured memory, Megatron forward; one JSON summary on stdout (see gpu_check.py).
#
#   bash scripts/gpu_check.sh --prepare    # where SmolLM2-135M is cached: copy its tokenizer and
#                                          # config into .gpu_assets/ (small) to carry to the GPU box
#   bash scripts/gpu_check.sh              # on one CUDA GPU; <= 8 minutes on an H200
#   bash scripts/gpu_check.sh --dry        # CPU wiring check, tiny model, 2 steps (CI)
#
# On a bare GPU machine whose python has torch/transformers/accelerate/peft, the rest travels
# as wheels in .whl/ (hydra-core, omegaconf, antlr4-python3-runtime; optionally bitsandbytes,
# liger-kernel, torchao, unsloth, vllm, flash-attn): they are installed into /tmp/site first.
# Sections whose packages are missing record "skipped: <why>".
#
# Not covered by this one-GPU check, and never exercised on CPU (README, "Megatron-Core"):
# Megatron with Transformer Engine layer specs and fp8 (refused until built), context
# parallelism, NCCL tensor/pipeline parallel speed (needs >= 2 GPUs), the all-to-all MoE
# dispatcher. The megatron section compares backend=megatron with backend=single in bf16 on
# the CUDA build path (SDPA fused kernels, model_parallel_cuda_manual_seed).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

if [ "${1:-}" = "--prepare" ]; then
  src="${WORKBENCH_CACHE:-$HOME/.cache/workbench}/models/smollm2-135m"
  [ -f "$src/tokenizer.json" ] || { echo "no converted SmolLM2-135M in $src; run any smollm2 job once" >&2; exit 2; }
  mkdir -p .gpu_assets/smollm2-135m
  for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja \
           special_tokens_map.json; do
    [ -f "$src/$f" ] && cp "$src/$f" .gpu_assets/smollm2-135m/
  done
  echo "wrote .gpu_assets/smollm2-135m (carry .gpu_assets and .whl)"
  exit 0
fi

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export WORKBENCH_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# On the GPU box the weights cache lives in /tmp unless WORKBENCH_CACHE says otherwise.
if [ "${1:-}" != "--dry" ] && [ -z "${WORKBENCH_CACHE:-}" ] && [ ! -d "$HOME/.cache/workbench" ]; then
  export WORKBENCH_CACHE=/tmp/workbench_cache
fi
exec timeout "${GPU_CHECK_TIMEOUT:-480}" "$PY" scripts/gpu_check.py "$@"
