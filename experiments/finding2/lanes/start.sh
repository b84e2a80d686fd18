#!/bin/bash
# Start, or restart, finding 2's two lanes, from the repository root: on the AMX Xeon only (plan.yaml, fifth
# amendment), from a worktree at qft dd15231 (WORKTREE, default ../f2x: a folder beside this checkout), made here where it is
# missing, holding this checkout's committed records (copied in, none overwritten), so that done runs skip and killed ones
# resume from their checkpoints. `--prepare` stops before starting the lanes.
#   bash experiments/finding2/lanes/start.sh
set -euo pipefail
worktree=${WORKTREE:-$(dirname "$(pwd)")/f2x}
if ! grep -qw amx_bf16 "${CPUINFO:-/proc/cpuinfo}"; then
  echo "start.sh: error: this CPU has no amx_bf16; finding 2 runs on the AMX Xeon only (plan.yaml, fifth amendment)" >&2
  exit 2
fi
if pgrep -f "lanes/lane.sh|qft \+experiment=finding2( |$)" > /dev/null; then
  echo "start.sh: error: finding 2's lanes or runs are running already (pgrep -af lane.sh); a second start would run them twice" >&2
  exit 2
fi
if [ ! -d "$worktree" ]; then
  git worktree prune
  git worktree add --detach "$worktree" dd15231 > /dev/null
fi
mkdir -p "$worktree/results/finding2/runs"
cp -rn results/finding2/runs/. "$worktree/results/finding2/runs/"
[ "${1:-}" = "--prepare" ] && exit 0
for lane in A B; do
  WORKTREE=$worktree nohup bash experiments/finding2/lanes/lane.sh "$lane" "experiments/finding2/lanes/$lane.txt" \
    > /dev/null 2>&1 &
done
echo "lanes A and B started from $worktree; starts and ends in /tmp/lane-A.log and /tmp/lane-B.log"
