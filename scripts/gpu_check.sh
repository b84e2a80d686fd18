#!/usr/bin/env bash
# qft's GPU check (scripts/gpu_check.py): every single-GPU CUDA path in about 4 minutes, one table.
# On the lent GPU machine, which has torch, transformers and peft but no registry, first run here
#   bash scripts/fetch_gpu_wheels.sh        # the missing packages as wheels into .whl/ (about 45 MB)
# and carry .whl with the command. On a CPU it runs the parts a CPU can and says what it skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
if ! "$PY" -c "import bitsandbytes, hydra, omegaconf" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/qft-site .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/qft-site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "gpu_check: bitsandbytes, hydra-core and omegaconf are missing and .whl/ holds no wheels: run scripts/fetch_gpu_wheels.sh" >&2
    exit 2
  fi
fi
export PYTHONUNBUFFERED=1 QFT_PROGRESS=0 HF_HUB_OFFLINE=1  # the machine reaches nothing outside: no Hub lookups at import
exec timeout 600 "$PY" scripts/gpu_check.py
