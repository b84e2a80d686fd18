#!/usr/bin/env bash
# The packages scripts/gpu_check.sh needs that a bare GPU image with torch, transformers and peft lacks, as wheels for
# CPython 3.12 on x86-64 Linux, into .whl/ (git-ignored; carry it to the GPU machine with the working tree).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl \
  bitsandbytes==0.50.2 hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 gguf
du -sh .whl
