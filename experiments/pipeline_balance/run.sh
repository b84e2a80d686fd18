#!/usr/bin/env bash
# Measured per-stage memory of a 2- and 3-stage 1F1B pipeline on SmolLM2-135M (NF4, r=8 everywhere, BBC News):
# the memory-balanced split against the uniform one, in fp32 and in bf16 compute (named, not `auto`, so a CPU without
# bf16 units is not asked to emulate it: set DTYPES=fp32 there). CPU processes with gloo; the record of each run holds
# the plan (estimated peaks) and the measured resident + step peak of every stage. Arguments are passed to every run
# (sweep.force=true measures again where ok records of the same config exist).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-results/pipeline_balance}
COMMON="train.steps=2 train.batch_size=8 train.warmup_steps=1 train.eval_every=0 train.checkpoint_every=0
        train.zero_shot=false data.train_size=16 data.val_size=10 data.test_size=10 data.max_length=64
        offload=pipeline offload.micro_batches=4 offload.schedule=1f1b"
for dtype in ${DTYPES:-fp32 bf16}; do
  for stages in 3 2; do
    for split in memory uniform; do
      OMP_NUM_THREADS=1 QFT_PROGRESS=0 $PY -m torch.distributed.run --nproc-per-node $stages \
        --master-port $((29600 + stages)) -m qft $COMMON quant.compute_dtype=$dtype offload.stages=$stages \
        offload.split=$split hydra.run.dir=$OUT/runs/$dtype-stages$stages-$split "$@"
    done
  done
done
$PY - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = ["| compute | stages | split | layers per stage | estimated peak per stage (MiB) | measured peak per stage (MiB) "
        "| max measured (MiB) | loss at step 2 |", "|---|---|---|---|---|---|---|---|"]
for f in sorted(out.glob("runs/*/result.json")):
    r = json.loads(f.read_text())
    if r["status"] != "ok":
        continue
    est = [p / 2**20 for p in r["pipeline"]["peaks"]]
    meas = [(m["resident"] + m["step_peak"]) / 2**20 for m in r["pipeline_measured"]]
    o = r["config"]["offload"]
    rows.append(f"| {r['config']['quant']['compute_dtype']} | {o['stages']} | {o['split']} | "
                f"{' '.join(str(b - a) for a, b in r['pipeline']['layers'])} | {' / '.join(f'{x:.0f}' for x in est)} | "
                f"{' / '.join(f'{x:.0f}' for x in meas)} | {max(meas):.0f} | {r['loss_curve'][-1][1]:.4f} |")
(out / "table.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PY
