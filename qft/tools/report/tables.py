"""The report's markdown: one table writer for every table it writes, so they read alike, and the summary's
prose, which says what each number is and what a reader must know before comparing them."""

from __future__ import annotations

import math

from qft.tools.report.compare import MARGIN, one_record_a_seed
from qft.frame import AXES, THIRDS
from qft.tools.report.views import uneven_depth


def table(header: list, rows, align: str = "---") -> list[str]:
    """The lines of a markdown table of `header` and `rows`, cells unpadded (readers match `| value |`); `align`:
    each column's delimiter cell, `---` or `---:` for numbers."""
    return [_line(header), "|" + f"{align}|" * len(header), *map(_line, rows)]


def _line(cells) -> str:
    """`cells` as one markdown table line."""
    return "| " + " | ".join(map(str, cells)) + " |"


def curves_markdown(curves) -> str:
    """`curves` (views.learning_curves) as a markdown table: a row a validation step, a column a run's curve."""
    rows = ([step, *("" if v != v else f"{v:.4f}" for v in values)]
            for step, values in zip(curves.index, curves.itertuples(index=False)))
    return "\n".join(table(["step", *curves.columns], rows, "---:")) + "\n"


def _vs(r, versus) -> str:
    """Summary row `r`'s comparison cell (against `versus`, or the best)."""
    if r.name == r.vs_ref:
        return "reference" if versus else "best"
    if r.vs_ref < 0 or not r.vs_verdict:
        return ""
    if r.vs_verdict == "not comparable":
        return "not comparable (too few pairs on one kind)"
    return (f"{r.vs_diff:+.3f} [{r.vs_low:+.3f}, {r.vs_high:+.3f}] p_adj {r.vs_p_adj:.2g}, TOST p_adj "
            f"{r.vs_p_tost_adj:.2g} {r.vs_verdict}")


def markdown(g, df, versus: dict | None = None, within: tuple = (), margin: float = MARGIN) -> str:
    """summary.md of summary `g` and record frame `df`: the prose a reader needs first, then the table of every
    configuration compared with `versus` (or the best) within `within`, at `margin`."""
    cols = ["adapted", *[c for c in AXES.values() if c in g.columns and g[c].nunique() > 1],
            *([f"params_{t}" for t in THIRDS] if uneven_depth(g) else []), "params"]
    name = "vs " + (",".join(f"{k}={v}" for k, v in versus.items()) if versus else "best") \
        + (f" (per {', '.join(within)})" if within else "")
    f1 = "macro_f1" in g and g.macro_f1.notna().any()
    rows = []
    for _, r in g.iterrows():
        ci = "one evaluation" if r.n_seeds == 1 and (r.params or 0) == 0 else "" if math.isnan(r.ci95) else f"±{r.ci95:.3f}"
        rows.append([*(str(r[c]) if not isinstance(r[c], float) else f"{r[c]:g}" for c in cols),
                     r.n_seeds, f"{r.acc_mean:.3f}", ci,
                     *(["" if math.isnan(r.macro_f1) else f"{r.macro_f1:.3f}"] if f1 else []),
                     _vs(r, versus), f"{r.tokens_per_s:.0f}"])
    lines = table(cols + ["n", "test acc", "95% CI", *(["macro-F1"] if f1 else []), name, "tokens/s"], rows)
    failed = df[df.status != "ok"]
    methods = sorted({m for m in g.vs_method if m})
    n = int(((g.vs_verdict != "") & (g.vs_verdict != "not comparable")).sum())
    head = (f"{len(df)} runs: {int((df.status == 'ok').sum())} ok, {len(failed)} not ok. Test accuracy: mean over seeds "
            f"with its 95% t interval (an untrained cell is one evaluation){'; macro-F1: mean over seeds' if f1 else ''}. **Exploratory**: {name} is the difference "
            f"from the {'reference' if versus else 'best'} configuration{' of its group' if within else ''}, its 95% "
            f"interval (unadjusted), its Holm-adjusted p of a difference and of equivalence within ±{margin:g} (TOST) "
            f"across these {n} comparisons and a verdict (differs / "
            f"equivalent within ±{margin:g} / inconclusive) from the adjusted tests ({', '.join(methods) or 'none'}; paired-crossed: per-example over seeds and examples, "
            "welch / one-sample, this test set: over seeds only, for records without per-example scores, so the test set's "
            "own sampling noise is not in the interval). "
            + ("The reference is named on the command line, not declared in a plan before the runs: exploratory. "
               if versus else "The reference is the best cell on this same test set, which biases toward \"differs\": "
               "exploratory. ")
            + "A study's declared contrasts are in contrasts.md.")
    tail = [f"- {r.run_dir}: {r.status} {r.error or ''}" for _, r in failed.iterrows()]
    notes = _provenance(df[df.status == "ok"])
    if "vs_refused" in g:
        notes += [f"- pairs refused in the comparison of {', '.join(f'{c} {r[c]}' for c in cols[1:-1]) or r.cell_key} "
                  f"with the {'reference' if versus else 'best'}, their two cells on different run kinds: {r.vs_refused}"
                  for _, r in g.iterrows() if r.vs_refused]
    return "\n".join([head, "", *lines, *([""] + notes if notes else []), *([""] + tail if tail else [])]) + "\n"


def classes_markdown(g, df) -> str | None:
    """classes.md of summary `g` and frame `df`: each configuration's recall on each test class, mean over seeds;
    None without per-example predictions. A cut may cost a small class dearly and barely move accuracy."""
    ok = one_record_a_seed(df)[0]
    names = [c for c in ok.columns if c.startswith("acc_class_")]
    if not names:
        return None
    means = ok.groupby("cell_key")[names].mean()
    seeds = ok.groupby("cell_key")[names[0]].count()  # seeds with predictions behind each mean
    cols = ["adapted", *[c for c in AXES.values() if c in g.columns and g[c].nunique() > 1]]
    rows = [[*(str(r[c]) if not isinstance(r[c], float) else f"{r[c]:g}" for c in cols), 1 if r.n_seeds == 1 else seeds[r.cell_key],
             *("" if math.isnan(means.loc[r.cell_key, n]) else f"{means.loc[r.cell_key, n]:.3f}" for n in names)]
            for _, r in g.iterrows() if r.cell_key in means.index]
    head = ("Accuracy on each class of the test split (recall: the share of its documents labelled right; the class's "
            "documents in brackets), mean over the n seeds with predictions; descriptive, no verdicts: in a class of d documents "
            "one document moves recall by 1/d (0.1 in a class of 10), so small classes move in large steps.")
    support = [ok[f"n_class_{n[len('acc_class_'):]}"].dropna() for n in names]  # documents of each class
    header = [f"{n[len('acc_class_'):]}" + (f" ({int(x.iloc[0])})" if len(x) and x.nunique() == 1 else "")
              for n, x in zip(names, support)]
    return "\n".join([head, "", *table(cols + ["n", *header], rows)]) + "\n"


def _provenance(ok) -> list[str]:
    """The lines on records `ok` a reader must know before comparing: CPU kinds, commits, records without
    per-example scores."""
    notes = []
    kinds = sorted({str(k) if isinstance(k, str) else "not recorded" for k in ok.get("run_kind", [])})
    if len(kinds) > 1:
        notes.append(f"- these records span kinds of execution (GPU or CPU, threads, compute dtype, fusion, pipeline "
                     f"layout, torch, eval batch): {'; '.join(kinds)}; a comparison pools pairs (the two cells of one "
                     "seed) across kinds, never a pair whose two cells ran on different kinds (those are left out)")
    elif kinds == ["not recorded"] and len(ok):
        notes.append(f"- none of these {len(ok)} records names what executed it (made before qft recorded it): their "
                     "comparisons assume one machine, thread count and compute dtype")
    commits = sorted({str(c)[:10] for c in ok.get("qft_commit", []) if c})
    if len(commits) > 1:
        notes.append(f"- these records span qft code versions (source digest, else commit): {', '.join(commits)}")
    repeats = one_record_a_seed(ok)[1]
    if repeats:
        notes.append(f"- {len(repeats)} of {len(ok)} records repeat the configuration and seed of another and are left "
                     f"out (the last by folder stands): {', '.join(repeats)}")
    missing = int((~ok.has_examples).sum()) if "has_examples" in ok else 0
    if missing:
        notes.append(f"- {missing} of {len(ok)} records keep no per-example scores (made before they were kept): "
                     "their comparisons are Welch over seeds, not paired, and they carry no log-likelihood analysis")
    return notes
