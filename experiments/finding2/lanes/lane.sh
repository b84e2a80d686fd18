#!/bin/bash
# One lane of finding 2's runs: each line of JOBFILE is one run's overrides (its seed included), run in order at 1
# thread from the worktree at qft dd15231 (WORKTREE), with this checkout's .venv (PYTHON); qft's output goes to
# /tmp/lane-NAME.out, unread (qft prints a run's test accuracy), starts and ends to /tmp/lane-NAME.log. A done run is
# skipped and a killed one resumes from its checkpoint, so a lane restarts with the same command.
#   bash experiments/finding2/lanes/lane.sh A experiments/finding2/lanes/A.txt    # beside the same with B
name=$1; jobs=$(realpath "$2"); python=${PYTHON:-$(pwd)/.venv/bin/python}; worktree=${WORKTREE:-$(dirname "$(pwd)")/f2x}
cd "$worktree" || exit 2
while IFS= read -r line; do
  [ -z "$line" ] && continue
  echo "$(date -u +%FT%T) start $line" >> "/tmp/lane-$name.log"
  eval "OMP_NUM_THREADS=1 PYTHONPATH=$worktree QFT_PROGRESS=0 $python -m qft +experiment=finding2 $line" \
    >> "/tmp/lane-$name.out" 2>&1
  echo "$(date -u +%FT%T) end rc=$? $line" >> "/tmp/lane-$name.log"
done < "$jobs"
