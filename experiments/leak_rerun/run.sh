#!/usr/bin/env bash
# Re-run rank_sweep on Reuters R8 with data format 2 (the prompt no longer tells the label), seeds 0-2, one seed
# after the other, into results/rank_sweep_r8_format2/runs (resumes from the records already there).
set -euo pipefail
cd "$(dirname "$0")/../.."
for s in 0 1 2; do
  python -m qft +experiment=rank_sweep data=reuters_r8 seed=$s hydra.sweep.dir=results/rank_sweep_r8_format2/runs
done
