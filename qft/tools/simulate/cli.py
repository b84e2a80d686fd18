"""`python -m qft.tools.simulate`: compare the offload policies on a preset or YAML server from the command line;
bad input ends as one line on stderr and exit status 2, like every qft CLI."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from qft.errors import QftError, fail, one_of
from qft.tools.simulate.checks import PLACEMENTS
from qft.tools.simulate.inputs import GB
from qft.tools.simulate.loading import load, workload_from_dict
from qft.tools.simulate.policies import compare, sweep
from qft.tools.simulate.presets import MODELS, SERVERS, workload_from_model
from qft.tools.simulate.report import describe, format_table, table_rows, write_outputs, write_sweep


class _Parser(argparse.ArgumentParser):
    """argparse's own error prints the usage too; a bad flag here is one line and status 2, like a bad value."""

    def error(self, message):
        print(f"qft: error: {message}", file=sys.stderr)
        sys.exit(2)


def _parse_stages(text):
    """--stages `text` as stage indices, or None for "auto"."""
    if text in ("auto", None):
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise QftError("--offload-stages", text, "'auto' or comma-separated stage indices, e.g. 0,1") from None


def _parse_fraction(text):
    """--fraction `text` as a float, or "auto"."""
    if text == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise QftError("--fraction", text, "a fraction in [0, 1], or 'auto'") from None


def parser() -> argparse.ArgumentParser:
    """The command line's argument parser."""
    ap = _Parser(prog="python -m qft.tools.simulate", description="Compare activation-offload policies for "
                 "pipeline-parallel fine-tuning on a described server (discrete-event simulation).")
    ap.add_argument("server", nargs="?", default="rtx3090x4", help=f"a preset ({', '.join(SERVERS)}) or a YAML file")
    ap.add_argument("--model", default=None, help=f"model shape ({', '.join(MODELS)}); default llama2-7b. A YAML "
                    "workload, if given, is used instead and the workload flags below are ignored, unless --model")
    ap.add_argument("--stages", type=int, default=None, help="pipeline stages (default: one per GPU)")
    ap.add_argument("--micro-batches", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--schedule", default="1f1b", help="1f1b or gpipe")
    ap.add_argument("--tflops", type=float, default=30.0, help="achieved TFLOP/s per GPU")
    ap.add_argument("--bwd-ratio", type=float, default=2.0, help="backward / forward compute time")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--flash", action="store_true", help="fused attention: drop the 5as/h activation term")
    ap.add_argument("--offload-stages", default="auto", help="'auto' (stages that do not fit) or e.g. 0,1")
    ap.add_argument("--fraction", default="1.0", help="fraction of activation bytes offloaded, or 'auto'")
    ap.add_argument("--neighbour-share", type=float, default=None, help="share routed via the NVLink neighbour "
                    "(default: balance the pair's PCIe bytes)")
    ap.add_argument("--placement", default="pipeline", help="pipeline (stage s on GPU s) or mirror")
    ap.add_argument("--shared-uplink", action="store_true", help="the GPUs of a pair share one PCIe uplink")
    ap.add_argument("--pcie-gbps", type=float, default=None, help="override PCIe GB/s per direction")
    ap.add_argument("--sync-efficiency", type=float, default=1.0,
                    help="share of PCIe bandwidth the synchronous baseline reaches (pageable memory < 1)")
    ap.add_argument("--sweep", action="store_true", help="also vary compute speed, baseline copy bandwidth, "
                    "uplink sharing and fraction; print (and with --out write sweep.md/csv) the speedups")
    ap.add_argument("--out", default=None, help="write table.md, table.csv and PNG plots here")
    return ap


def main(argv=None) -> int:
    """The command line (`argv`); returns the exit status (2 on bad input)."""
    args = parser().parse_args(argv)
    try:
        if args.server in SERVERS:
            server, wl_dict = SERVERS[args.server](), None
        else:
            server, wl_dict = load(args.server)
        if args.shared_uplink or args.pcie_gbps is not None:
            server = dataclasses.replace(server, shared_uplink=server.shared_uplink or args.shared_uplink,
                                         pcie_bandwidth=args.pcie_gbps * GB if args.pcie_gbps is not None
                                         else server.pcie_bandwidth)
        stages = args.stages if args.stages is not None else server.n_gpus
        if wl_dict is not None and args.model is None:
            work = workload_from_dict(wl_dict, stages)
        else:
            work = workload_from_model(args.model or "llama2-7b", stages, args.micro_batches,
                                       args.micro_batch_size, args.seq_len, args.schedule, args.tflops * 1e12,
                                       args.bwd_ratio, args.lora_rank, args.flash)
        placement = args.placement
        one_of("--placement", placement, PLACEMENTS)
        offload_stages = _parse_stages(args.offload_stages)
        results = compare(server, work, offload_stages, _parse_fraction(args.fraction),
                          args.neighbour_share, placement, args.sync_efficiency)
        sweep_rows = sweep(server, work, offload_stages, placement) if args.sweep else None
    except QftError as e:
        return fail("qft", e)
    header = describe(server, work, placement)
    print(header + "\n")
    print(format_table(table_rows(results, work)))
    if sweep_rows:
        print("\n" + format_table(sweep_rows))
    if args.out:
        write_outputs(results, server, work, Path(args.out), header)
        print(f"\nwrote {args.out}/table.md, table.csv, step_time.png, peak_memory.png, gantt.png"
              + (", sweep.md, sweep.csv, sweep.png" if sweep_rows else ""))
        if sweep_rows:
            write_sweep(sweep_rows, server, work, Path(args.out), header)
    return 0
