"""Merge a run's adapter into its base for deployment: `python -m qft.tools.merge RUN_DIR OUT_DIR`.

The base is rebuilt and quantized as the run did, then dequantized to the exact weights it computed with; stock
peft loads the adapter onto it and merges it (merging into the quantized base would lose most of the adapter).
OUT_DIR is a Hugging Face folder that `AutoModelForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from qft import layers, model, quant
from qft.errors import QftError, fail
from qft.tools.predict import adapter_folder, read_run

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # offline, as `python -m qft` (qft/__main__.py says why)


def merge(run_dir: Path, out_dir: Path) -> int:
    """Write the run in `run_dir`'s merged model and tokenizer to `out_dir` (a new or empty folder); returns its
    parameter count. Raises QftError (RUN_DIR, OUT_DIR) on a bad run or a non-empty folder."""
    from peft import PeftModel

    rec, cfg = read_run(run_dir, classification=False)
    if not rec.get("adapter_dir"):
        raise QftError("RUN_DIR", str(run_dir), "the run trained no adapter (rank 0 everywhere): its base is the model")
    adapter = adapter_folder(run_dir, rec, "adapter_config.json")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise QftError("OUT_DIR", str(out_dir), "a new or empty folder")
    source = model.resolve(cfg.model, cfg.cache_dir)
    base = model.load(source)
    quant.quantize(base, cfg.quant, layers.classify(base, source.model_type), torch.device("cpu"))
    merged = PeftModel.from_pretrained(quant.dequantize(base), str(adapter)).merge_and_unload()
    merged.config.use_cache = True  # qft trains without the KV cache; generation wants it
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))  # a half-written folder is never OUT_DIR
    try:
        merged.save_pretrained(tmp, safe_serialization=True)
        model.load_tokenizer(source).save_pretrained(tmp)
        if out_dir.exists():
            out_dir.rmdir()
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sum(p.numel() for p in merged.parameters())


def main(argv=None) -> int:
    """The command line (`argv`: RUN_DIR OUT_DIR); returns the exit status (2 on bad input)."""
    ap = argparse.ArgumentParser(prog="python -m qft.tools.merge", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run directory of python -m qft (result.json and adapter/)")
    ap.add_argument("out_dir", help="a new or empty folder for the merged Hugging Face model")
    args = ap.parse_args(argv)
    try:
        n = merge(Path(args.run_dir), Path(args.out_dir))
    except QftError as e:
        return fail("qft.tools.merge", e)
    print(f"qft.tools.merge: {args.run_dir}'s adapter merged into its dequantized base ({n:,} parameters) -> "
          f"{args.out_dir} (transformers.AutoModelForCausalLM.from_pretrained loads it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
