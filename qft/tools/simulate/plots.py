"""The figures of a comparison (step time, peak memory, a Gantt chart of streams and links) and of a sweep,
so the reader sees where the time and the memory go, not only the table."""

from __future__ import annotations

from qft.tools.simulate.inputs import GiB, Server

COLOURS = {"F": "#4c72b0", "B": "#55a868", "offload": "#dd8452", "prefetch": "#8172b3", "act": "#999999",
           "grad": "#666666"}


def _pyplot():
    """pyplot without a display, imported only when a figure is asked for: the simulation needs no matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path, rect=None):
    """Save `fig` as `path` (tight layout in `rect`) and close it."""
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_step_time(results: dict, path, title=""):
    """Plot each policy's step time of `results`, titled `title`, into `path`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = list(results)
    vals = [results[k].makespan for k in names]
    bars = ax.bar(names, vals, color=["#999999", "#c44e52", "#dd8452", "#55a868"][:len(names)])
    for bar, r in zip(bars, results.values()):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{r.makespan:.2f}s"
                + ("" if all(r.fits) else "\n(OOM)"), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("step time (s)")
    ax.set_title(title, fontsize=8)
    ax.set_ylim(0, max(vals) * 1.25)
    _save(plt, fig, path)


def plot_peak_memory(results: dict, server: Server, path, title=""):
    """Plot each policy's peak memory per GPU of `results` against `server`'s memory, titled `title`, into `path`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = list(results)
    p = len(next(iter(results.values())).peak_memory)
    width = 0.8 / len(names)
    for j, k in enumerate(names):
        ax.bar([s + (j - (len(names) - 1) / 2) * width for s in range(p)],
               [x / GiB for x in results[k].peak_memory], width, label=k)
    ax.axhline(server.gpu_memory_bytes / GiB, color="k", ls="--", lw=1, label="GPU memory")
    ax.set_xticks(range(p))
    ax.set_xlabel("stage")
    ax.set_ylabel("peak GPU memory (GiB)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, ncol=3)
    _save(plt, fig, path)


def plot_gantt(results: dict, path, kinds=("sync", "neighbour"), title=""):
    """Plot a Gantt chart of `results` for the policies `kinds`, a row per compute stream and busy link on a shared
    time axis, titled `title`, into `path`."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    kinds = [k for k in kinds if k in results]
    rows_of = {}
    for k in kinds:
        res = results[k]
        rows = sorted({e.resource for e in res.timeline},
                      key=lambda r: (not r.startswith("stage"), r))
        rows_of[k] = rows
    span = max(results[k].makespan for k in kinds)
    fig, axes = plt.subplots(len(kinds), 1, figsize=(10, 0.25 * sum(len(r) for r in rows_of.values()) + 1.5),
                             squeeze=False)
    for ax, k in zip(axes[:, 0], kinds):
        rows = rows_of[k]
        y = {r: i for i, r in enumerate(rows)}
        for e in results[k].timeline:
            ax.barh(y[e.resource], e.end - e.start, left=e.start, height=0.8, color=COLOURS[e.kind], lw=0)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(rows, fontsize=6)
        ax.invert_yaxis()
        ax.set_xlim(0, span)
        ax.set_title(f"{k}: {results[k].makespan:.2f} s", fontsize=8)
    axes[-1, 0].set_xlabel("time (s)")
    fig.legend(handles=[Patch(color=c, label=n) for n, c in COLOURS.items()], loc="upper right", fontsize=7,
               ncol=6)
    if title:
        fig.suptitle(title, fontsize=8, x=0.01, ha="left")
    _save(plt, fig, path, rect=(0, 0, 1, 0.96))


def plot_sweep(rows: list, path, title=""):
    """Plot the speedup of neighbour over sync per sweep row of `rows` against the band the paper reports, titled
    `title`, into `path`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.4))
    labels = [f"{r['compute']} bw{r['sync_copy_bw']:g} {r['uplink'].replace('per ', '')} f={r['fraction']}"
              for r in rows]
    ax.axhspan(2.04, 3.59, color="#55a868", alpha=0.15, label="paper: 2.04x-3.59x")
    ax.bar(range(len(rows)), [r["neighbour_vs_sync"] for r in rows], color="#4c72b0", label="neighbour / sync")
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=6)
    ax.set_ylabel("speedup over sync")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, loc="upper left")
    _save(plt, fig, path)
