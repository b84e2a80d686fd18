"""`python -m qft [overrides]`: one fine-tune (or a Hydra multirun) configured from conf/."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from qft.errors import QftError

CONF = str(Path(__file__).resolve().parent.parent / "conf")


@hydra.main(config_path=CONF, config_name="config", version_base="1.3")
def main(cfg) -> float | None:
    from qft.run import run

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        rec = run(cfg, run_dir)
    except QftError as e:
        print(f"qft: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"qft: {rec['status']}: test accuracy {(rec.get('final_accuracy') or {}).get('test')} "
          f"(zero-shot {(rec.get('zero_shot_accuracy') or {}).get('test')}), record {run_dir / 'result.json'}")
    return (rec.get("final_accuracy") or {}).get("val")


if __name__ == "__main__":
    main()
