#!/bin/bash
# Start, or restart, the gate's two lanes, from the repository root. Each lane runs its lines of the stage's jobs files
# in order, each file from a checkout pinned at the commit that declared it and at its thread count: the screen's,
# stages 1 and 2 (jobs.txt), at qft 93e4679, the commit of plan.yaml, then stage 4's (harder.txt) at HARDER_COMMIT, the
# commit of the amendment of 2026-12-07 14:45 UTC, at 1 thread; the confirmation's (`run.sh confirm`) at CONFIRM_COMMIT,
# the commit of the amendment of 08:25 UTC: r8_few's (confirm.txt) at 1 thread, then ng20's (confirm_ng20.txt, lane A
# alone, note of 16:17 UTC) at 2. `run.sh STUDY` runs a study of the ng20 regime (experiments/STUDY/jobs.txt, e.g.
# finding1_ng20) from the stage-3 checkout at 2 threads, and refuses until every plan*.yaml there, the fixed-margin ones
# too, lists its seeds_amended. A file named without a folder is the gate's. GATE_COMMIT overrides the commit of every
# file, GATE_CHECKOUT the checkout (default beside this repository, named by the commit); PYTHON is this checkout's
# .venv. The records land in this checkout's results/<the file's folder>/runs, where a done run is skipped and a killed
# one resumes from its checkpoint, so a restart is the same command. Output and the lanes' start/end lines go to $TMPDIR
# (default /tmp).
#   bash experiments/sensitivity_gate/run.sh [confirm | STUDY]  # --prepare: make the checkouts, start nothing
set -euo pipefail
repo=$PWD
CONFIRM_COMMIT=b8e49f7
HARDER_COMMIT=da674d9
stages="jobs.txt:93e4679:1 harder.txt:$HARDER_COMMIT:1"  # file:commit:threads
if [ "${1:-}" = "confirm" ]; then stages="confirm.txt:$CONFIRM_COMMIT:1 confirm_ng20.txt:$CONFIRM_COMMIT:2"; shift
elif [ -n "${1:-}" ] && [ "${1#-}" = "$1" ]; then
  study=${1%/}
  case $study in
    sensitivity_gate|""|*[!A-Za-z0-9_]*)
      echo "run.sh: error: STUDY=$1: the name of a study's folder of experiments/ (not the gate's), or confirm" >&2; exit 2;;
  esac
  [ -f "$repo/experiments/$study/jobs.txt" ] || {
    echo "run.sh: error: STUDY=$study: a folder of experiments/ with a jobs.txt, or confirm" >&2; exit 2; }
  plans=$(find "$repo/experiments/$study" -maxdepth 1 -name "plan*.yaml" | sort)
  [ -n "$plans" ] || { echo "run.sh: error: STUDY=$study: experiments/$study has no plan*.yaml" >&2; exit 2; }
  for plan in $plans; do  # a list of seeds, not an empty key
    grep -Eq "^seeds_amended: *\[ *[0-9]" "$plan" || {
      echo "run.sh: error: $study/$(basename "$plan") has no seeds_amended: its seeds are fixed before its first run" >&2
      exit 2; }
  done
  stages="$study/jobs.txt:$CONFIRM_COMMIT:2"; shift
fi
case "${1:-}${2:+ more}" in  # --prepare alone after the stage; --lane is the lanes' own call
  ""|--prepare|--lane*) ;;
  *) echo "run.sh: error: $*: allowed: [confirm | STUDY] [--prepare]" >&2; exit 2;;
esac
python=${PYTHON:-$repo/.venv/bin/python}
logs=${TMPDIR:-/tmp}
file_of() { local f=${1%%:*}; [ "${f#*/}" = "$f" ] && f=sensitivity_gate/$f; echo "$f"; }  # under experiments/
commit_of() { local c=${1#*:}; echo "${GATE_COMMIT:-${c%%:*}}"; }  # a stage file:commit:threads's commit
checkout_of() { echo "${GATE_CHECKOUT:-$(dirname "$repo")/qft-sensitivity-gate-$(commit_of "$1")}"; }
out_of() { local f; f=$(file_of "$1"); echo "$repo/results/${f%%/*}/runs"; }
if [ "${1:-}" = "--lane" ]; then
  for stage in $3; do
    checkout=$(checkout_of "$stage")
    threads=${stage##*:}
    out=$(out_of "$stage")
    { grep "^$2 " "$repo/experiments/$(file_of "$stage")" || [ $? = 1 ]; } | cut -d' ' -f2- | while IFS= read -r line; do
      echo "$(date -u +%FT%T) start $line" >> "$logs/gate-lane-$2.log"
      rc=0
      (cd "$checkout" && eval "OMP_NUM_THREADS=$threads PYTHONPATH=$checkout QFT_PROGRESS=0 $python -m qft \
        +experiment=sensitivity_gate hydra.sweep.dir=$out $line") >> "$logs/gate-lane-$2.out" 2>&1 < /dev/null || rc=$?
      echo "$(date -u +%FT%T) end rc=$rc $line" >> "$logs/gate-lane-$2.log"
    done
  done
  exit 0
fi
if pgrep -f "qft \+experiment=sensitivity_gate( |$)" > /dev/null; then
  echo "run.sh: error: the gate's runs are running already (pgrep -af sensitivity_gate); a second start would run them twice" >&2
  exit 2
fi
for stage in $stages; do
  checkout=$(checkout_of "$stage")
  [ -d "$checkout" ] || { git worktree prune; git worktree add --detach "$checkout" "$(commit_of "$stage")" > /dev/null; }
  mkdir -p "$(out_of "$stage")"
done
[ "${1:-}" = "--prepare" ] && exit 0
for name in A B; do
  setsid nohup bash "$0" --lane "$name" "$stages" < /dev/null > /dev/null 2>&1 &
done
echo "run.sh: lanes A and B started on $stages (file:commit:threads, each from its pinned checkout); tail -f $logs/gate-lane-A.log"
