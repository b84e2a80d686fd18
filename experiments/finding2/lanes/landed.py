"""Copy finding 2's finished runs from the lanes' worktree into this checkout, blind: each new record's result.json
and examples.npz, and one line a run naming what a reader may see before the report (status, steps, test documents,
seconds, what executed it), never a score. From the repository root:

    python experiments/finding2/lanes/landed.py                 # WORKTREE (default ../f2x, beside this checkout)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

FILES = ("result.json", "examples.npz")


def landed(worktree: Path, here: Path) -> list[str]:
    """One line for each record in the worktree that is not here as it is there: an ok one is copied, another (a
    failed or stopped run, which a restart resumes) only named."""
    lines = []
    for src in sorted((worktree / "results/finding2/runs").glob("*/result.json")):
        dst = here / "results/finding2/runs" / src.parent.name
        if (dst / "result.json").exists() and (dst / "result.json").read_bytes() == src.read_bytes():
            continue
        r = json.loads(src.read_text())
        if r.get("status") == "ok":
            dst.mkdir(parents=True, exist_ok=True)
            for name in FILES:
                shutil.copy2(src.parent / name, dst / name)
        e = r.get("execution", {})
        lines.append(f"{src.parent.name}: {r.get('status')}{'' if r.get('status') == 'ok' else ' (not copied)'}, "
                     f"{r.get('steps')} steps, "
                     f"{(r.get('data') or {}).get('sizes', {}).get('test')} test documents, "
                     f"training {r.get('train_seconds') or 0:.0f} s, wall {r.get('wall_seconds') or 0:.0f} s, "
                     f"{e.get('cpu_kind')} {e.get('threads')} thread(s) {e.get('compute_dtype')} "
                     f"qft {str(e.get('qft_commit'))[:7]}")
    return lines


if __name__ == "__main__":
    worktree = Path(os.environ.get("WORKTREE") or Path.cwd().parent / "f2x")
    if not (worktree / "results/finding2/runs").is_dir():
        sys.exit(print(f"landed.py: error: WORKTREE={worktree} holds no results/finding2/runs (the lanes' worktree: "
                       "experiments/finding2/lanes/start.sh makes it)", file=sys.stderr) or 2)
    print("\n".join(landed(worktree, Path.cwd())) or "no new record")
