#!/bin/bash
# Start, or restart, the gate's two lanes, from the repository root. Each lane runs its lines of the stage's jobs file
# in order at 1 thread: the screen's (jobs.txt) from a checkout pinned at qft 93e4679, the commit that declared
# plan.yaml; the confirmation's (confirm.txt, `run.sh confirm`) from one pinned at CONFIRM_COMMIT, the commit of
# plan.yaml's amendment of 2026-12-07 08:25 UTC (GATE_COMMIT overrides either; GATE_CHECKOUT, default beside this
# repository), with this checkout's .venv (PYTHON); the records land in this checkout's
# results/sensitivity_gate/runs, where a done run is skipped and a killed one resumes from its checkpoint, so a
# restart is the same command. Output and the lanes' start/end lines go to $TMPDIR (default /tmp).
#   bash experiments/sensitivity_gate/run.sh [confirm]  # --prepare: make the checkout, start nothing
set -euo pipefail
repo=$PWD
CONFIRM_COMMIT=b8e49f7
jobs=jobs.txt
commit=93e4679
if [ "${1:-}" = "confirm" ]; then jobs=confirm.txt; commit=$CONFIRM_COMMIT; shift; fi
commit=${GATE_COMMIT:-$commit}
checkout=${GATE_CHECKOUT:-$(dirname "$repo")/qft-sensitivity-gate-$commit}
python=${PYTHON:-$repo/.venv/bin/python}
out=$repo/results/sensitivity_gate/runs
logs=${TMPDIR:-/tmp}
if [ "${1:-}" = "--lane" ]; then
  grep "^$2 " "$repo/experiments/sensitivity_gate/$3" | cut -d' ' -f2- | while IFS= read -r line; do
    echo "$(date -u +%FT%T) start $line" >> "$logs/gate-lane-$2.log"
    rc=0
    (cd "$checkout" && eval "OMP_NUM_THREADS=1 PYTHONPATH=$checkout QFT_PROGRESS=0 $python -m qft \
      +experiment=sensitivity_gate hydra.sweep.dir=$out $line") >> "$logs/gate-lane-$2.out" 2>&1 < /dev/null || rc=$?
    echo "$(date -u +%FT%T) end rc=$rc $line" >> "$logs/gate-lane-$2.log"
  done
  exit 0
fi
if pgrep -f "qft \+experiment=sensitivity_gate( |$)" > /dev/null; then
  echo "run.sh: error: the gate's runs are running already (pgrep -af sensitivity_gate); a second start would run them twice" >&2
  exit 2
fi
[ -d "$checkout" ] || { git worktree prune; git worktree add --detach "$checkout" "$commit" > /dev/null; }
mkdir -p "$out"
[ "${1:-}" = "--prepare" ] && exit 0
for name in A B; do
  GATE_COMMIT=$commit setsid nohup bash "$0" --lane "$name" "$jobs" < /dev/null > /dev/null 2>&1 &
done
echo "run.sh: lanes A and B started on $jobs from $checkout (qft $commit); tail -f $logs/gate-lane-A.log"
