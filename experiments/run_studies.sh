#!/usr/bin/env bash
# The layer-sensitivity studies (rank, alpha, bits, depth, allocator), in the order they are run, each resumable: a sweep skips
# every grid point whose record is ok for the same config, so this picks up where the last run stopped.
# Commit results/*/runs as records land (git add results; git commit), then rebuild the reports:
#   python -m qft.tools.report results/<experiment>/runs
# About 2 minutes a run on a 2-core AMX CPU (bf16), 8 on an AVX2-only one (fp32). On 2 cores, two sweeps side by
# side with OMP_NUM_THREADS=1 each finish about 1.2x sooner than one after the other with 2 threads (measured
# 2026-12-03: ~200-265 s a run each, against ~135 s alone); their records' tokens/s are then contended.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export QFT_PROGRESS=${QFT_PROGRESS:-0}
FAST=accel.cache_dequantized=true   # changes no number and no hash: only the speed
sweep() { echo "=== $(date +%T) $*"; $PY -m qft "$@" $FAST; }
sweep +experiment=rank_sweep                                  # finding 1, BBC News, seed 0 (done)
sweep +experiment=rank_sweep seed=1,2                         # ... seeds 1 and 2 (done)
sweep +experiment=rank_sweep data=reuters_r8 seed=0,1,2       # finding 1, second dataset
sweep +experiment=bits_sweep data=reuters_r8 seed=0,1,2       # finding 3: equal cuts at 4/8/16 bits
sweep +experiment=alpha_sweep data=reuters_r8 seed=0,1,2      # finding 2
sweep +experiment=depth_sweep data=reuters_r8 seed=0,1,2      # equal cuts by depth third
sweep +experiment=alpha_depth data=reuters_r8 seed=0,1,2      # finding 2 by depth: alpha 64 on one third
sweep +experiment=allocator_check seed=0,1,2                  # the fitted allocator against uniform, held out
