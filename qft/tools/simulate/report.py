"""What a comparison prints and writes: the setup header, the per-policy table (markdown and CSV) and the
files of --out, kept out of the CLI so a script calling `compare` can write the same outputs."""

from __future__ import annotations

import csv
from pathlib import Path

from qft.tools.simulate.inputs import GB, GiB, Server, Workload
from qft.tools.simulate.plots import plot_gantt, plot_peak_memory, plot_step_time, plot_sweep


def describe(server: Server, work: Workload, placement) -> str:
    """The header naming the setup (`server`, `work`, `placement`), printed above the table and atop table.md and
    sweep.md."""
    st = work.stages
    return (f"{server.name} ({server.n_gpus} GPUs, {server.gpu_memory_bytes / GiB:.0f} GiB, PCIe "
            f"{server.pcie_bandwidth / GB:.0f} GB/s{' shared per pair' if server.shared_uplink else ''}, "
            f"NVLink {server.nvlink_bandwidth / GB:.0f} GB/s pairs {list(map(list, server.nvlink_pairs))}); "
            f"{work.name}; placement {placement}\n\nper stage: fwd "
            + " ".join(f"{x.fwd_s:.3f}" for x in st) + " s, bwd " + " ".join(f"{x.bwd_s:.3f}" for x in st)
            + " s, activations " + " ".join(f"{x.act_bytes / GiB:.2f}" for x in st) + " GiB/micro-batch, fixed "
            + " ".join(f"{x.fixed_bytes / GiB:.2f}" for x in st) + " GiB")


def table_rows(results: dict, workload: Workload) -> list:
    """A row per policy of `results` for `workload`: step time, speedup over sync, peaks, link use."""
    base = results.get("sync")
    rows = []
    for kind, r in results.items():
        pcie = {k: v for k, v in r.link_busy.items() if k.startswith("pcie")}
        nv = {k: v for k, v in r.link_busy.items() if k.startswith("nvlink")}
        rows.append({
            "policy": kind,
            "step_s": round(r.makespan, 3),
            "speedup_vs_sync": round(base.makespan / r.makespan, 2) if base else None,
            "tokens_per_s": round(workload.tokens_per_step / r.makespan) if workload.tokens_per_step else None,
            "peak_gib_per_stage": " ".join(f"{x / GiB:.1f}" for x in r.peak_memory),
            "fits": all(r.fits),
            "bubble": round(r.bubble_fraction, 3),
            "offload_stages": ",".join(map(str, r.offload_stages)) or "-",
            "max_pcie_busy_s": round(max(pcie.values(), default=0.0), 3),
            "nvlink_busy_s": round(sum(nv.values()), 3),
        })
    return rows


def format_table(rows: list) -> str:
    """`rows` as a markdown table."""
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("" if r[c] is None else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def _write_csv(path, rows):
    """Write `rows` to CSV `path`."""
    with open(path, "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)


def write_outputs(results: dict, server: Server, workload: Workload, out: Path, header: str):
    """Write the comparison `results` of `workload` on `server` into folder `out`: table.md (after `header`),
    table.csv and the plots."""
    out.mkdir(parents=True, exist_ok=True)
    rows = table_rows(results, workload)
    (out / "table.md").write_text(header + "\n\n" + format_table(rows) + "\n")
    _write_csv(out / "table.csv", rows)
    title = f"{server.name}: {workload.name}"
    plot_step_time(results, out / "step_time.png", title)
    plot_peak_memory(results, server, out / "peak_memory.png", title)
    plot_gantt(results, out / "gantt.png", title=title)


def write_sweep(rows: list, server: Server, workload: Workload, out: Path, header: str):
    """Write sweep `rows` of `workload` on `server` into folder `out`: sweep.md (after `header`), sweep.csv and
    sweep.png."""
    (out / "sweep.md").write_text(header + "\n\n" + format_table(rows) + "\n")
    _write_csv(out / "sweep.csv", rows)
    plot_sweep(rows, out / "sweep.png", f"{server.name}: {workload.name}")
