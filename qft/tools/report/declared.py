"""A study's declared analysis (plan.yaml): its contrasts are the confirmatory family, Holm-adjusted across themselves
only; its positive controls are a family of their own, tested first, and may set the margin relative to their cost."""

from __future__ import annotations

from qft import stats
from qft.tools.report import kinds
from qft.tools.report.compare import MIN_SEEDS, compare_configs, equal, one_record_a_seed, pairs
from qft.tools.report.plan import declared_seeds, read_plan  # noqa: F401  (read_plan: the package's name for it)
from qft.tools.report.tables import table


def cell_keys(ok, cell: dict) -> list:
    """The cell keys of the records in `ok` that plan cell `cell` matches (columns of the table or dotted config
    keys)."""
    hit = [all(equal(r[k] if k in r else r.get(f"cfg.{k}"), v) for k, v in cell.items()) for _, r in ok.iterrows()]
    return list(dict.fromkeys(ok.cell_key[hit])) if hit else []


def _unmatched(matches: list) -> str:
    """Why a contrast has no single configuration on a side, from its cells' `matches` (a then b): a cell the records
    lack, or one named too loosely."""
    return "; ".join(f"cell {side} matches {'no records' if not m else f'{len(m)} configurations'}"
                     for side, m in zip("ab", matches) if len(m) != 1)


def _finds(comp, alpha: float) -> str:
    """The smallest difference `comp`'s design finds at `alpha`, as a table cell."""
    d = stats.detectable(comp, alpha)
    return "-" if d is None else (f"{d:.3f}" if d < 1 else "> 1")


def _components(comp) -> str:
    """`comp`'s variance components (seed / example / residual) as a table cell."""
    c = comp.components
    return "-" if not c else f"{c['seed']:.2g} / {c['example']:.2g} / {c['residual']:.2g}"


def family(every, ok, declared: list, seeds: list | None, margin: float, plan: dict) -> list[dict]:
    """Each contrast of `declared` (contrasts or controls of `plan`) compared on its pairs in `ok` at `margin` over
    the plan's `seeds`, Holm across the list: its cell keys (matched on `every` record), the seeds without a pair on
    one kind, its comparison (None where not computed) and its split by kind."""
    out = []
    for c in declared:
        matches = [cell_keys(every, c[side]) for side in ("a", "b")]
        keys = [m[0] if len(m) == 1 else None for m in matches]  # None: no single configuration
        e = {"contrast": c, "matches": matches, "keys": keys, "missing": [], "comp": None, "split": None}
        if None not in keys:
            p = pairs(ok, *keys)
            # a declared seed counts where its pair ran on one kind (two untrained cells: one evaluation, any seed)
            e["missing"] = [] if seeds is None or all(p.untrained) else [s for s in seeds if s not in p.a]
            e["split"] = kinds.split(ok, *keys, margin, plan["metric"])
            if not e["missing"]:
                e["comp"] = compare_configs(ok, *keys, margin, plan["metric"])
        out.append(e)
    stats.holm([e["comp"] for e in out])  # the whole declared family, a missing contrast as p = 1
    for e in out:
        if e["comp"] is not None:
            e["comp"].alpha = plan["alpha"]
    return out


def resolve_margin(plan: dict, controls: list[dict]) -> tuple[float, str, bool]:
    """(margin, its source, resolved?) of `plan`: the number declared, or `factor` x |a - b| of the control of
    `controls` it names, once that control passed; else 0, where TOST never rejects (no "equivalent")."""
    m = plan["margin"]
    if not isinstance(m, dict):
        return float(m), "declared", True
    ctl = next(e for e in controls if e["contrast"]["name"] == m["relative_to"])
    comp = ctl["comp"]
    if comp is None or comp.verdict != "differs":
        why = "was not computed" if comp is None else f"came out {comp.verdict}"
        return 0.0, (f"{m['factor']:g} x the cost of control {m['relative_to']!r}, which {why}; no "
                     "equivalence verdicts"), False
    return m["factor"] * abs(comp.diff), (f"{m['factor']:g} x the measured cost of control {m['relative_to']!r} "
                                          f"(|{comp.diff:+.4f}|)"), True


def _why(e: dict, seeds: list | None) -> str:
    """Why contrast entry `e` has no comparison over `seeds`."""
    refused = (e["split"] or {}).get("refused_pairs") or []
    on = f"; {len(refused)} pair(s) refused, their cells on different run kinds (named below)" if refused else ""
    if e["missing"]:
        return (f"not run: {len(seeds) - len(e['missing'])} of the {len(seeds)} declared seeds in both cells "
                f"(missing {', '.join(map(str, e['missing']))}){on}")
    if None in e["keys"]:
        return f"not computable: {_unmatched(e['matches'])}"
    if refused:
        return f"not comparable: fewer than {MIN_SEEDS} pairs on one kind{on}"
    return f"not computable: fewer than {MIN_SEEDS} seeds both cells share, or per-example scores on different examples"


def _controls_markdown(controls: list[dict], seeds, alpha: float) -> list[str]:
    """The markdown lines of the positive `controls` (compared over `seeds`) at `alpha`, passed or FAILED."""
    cells = [[e["contrast"]["name"], *(["-", "-", "-", "-", _why(e, seeds)] if e["comp"] is None else
                                       [f"{e['comp'].diff:+.4f}", f"[{e['comp'].low:+.4f}, {e['comp'].high:+.4f}]",
                                        f"{e['comp'].p:.3g}", f"{e['comp'].p_adj:.3g}", e["comp"].verdict]),
              "passed" if e["comp"] is not None and e["comp"].verdict == "differs" else "FAILED"] for e in controls]
    return [f"Positive controls (each must come out \"differs\": Holm across the {len(controls)} of them at alpha "
            f"{alpha:g}, tested before the contrasts, which say something only where every control passed; a failed "
            "control means this design did not see an effect it was built to see, so its \"equivalent\" says only "
            "that the task needs no capacity):", "", *table(["control", "a - b", "95% CI", "p", "Holm p", "verdict",
                                                              "passed"], cells), ""]


def contrasts(df, g, plan: dict) -> tuple[list[dict], str]:
    """(the contrasts of `plan` on frame `df` and summary `g`, Holm across them; their markdown: controls, margin,
    contrasts, split by run kind). Where every contrast is paired on accuracy, the log-likelihood's beside it
    (equivalence only within a declared `loglik_margin`)."""
    every, repeats = one_record_a_seed(df)  # as the exploratory table keeps them, and named below, never chosen silently
    ok = every
    seeds = declared_seeds(plan)
    untrained = set(ok.cell_key[ok.params.fillna(0).eq(0)])  # one evaluation a kind: any seed stands for it
    if seeds is not None:
        ok = ok[ok.seed.isin(seeds) | ok.cell_key.isin(untrained)]
    controls = family(every, ok, plan.get("controls") or [], seeds, plan["margin"] if not isinstance(plan["margin"], dict)
                      else 0.0, plan)
    margin, source, resolved = resolve_margin(plan, controls)
    found = family(every, ok, plan["contrasts"], seeds, margin, plan)
    comps = [e["comp"] for e in found if e["comp"] is not None]
    loglik = {}
    if plan["metric"] == "accuracy" and comps and all(c.method == "paired-crossed" for c in comps):
        loglik = {i: compare_configs(ok, *e["keys"], plan.get("loglik_margin", 0.0), "loglik")
                  if None not in e["keys"] and not e["missing"] else None for i, e in enumerate(found)}
        stats.holm(list(loglik.values()))
        loglik = {i: x for i, x in loglik.items() if x is not None}
        for x in loglik.values():
            x.alpha = plan["alpha"]
    rows = [{"name": e["contrast"]["name"], **({} if e["comp"] is None else e["comp"].as_dict()),
             **({"loglik": loglik[i].as_dict()} if i in loglik else {}), "margin_source": source, **(e["split"] or {})}
            for i, e in enumerate(found)]
    rows += [{"name": e["contrast"]["name"], "control": True, "passed": e["comp"] is not None and
              e["comp"].verdict == "differs", **({} if e["comp"] is None else e["comp"].as_dict()), **(e["split"] or {})}
             for e in controls]
    header = ["contrast", "a - b", "95% CI", "p", "Holm p", "Holm TOST p", "verdict", "method", "seeds", "examples",
              "finds (80%)", "seed / example / residual",
              *(["gold log-lik a - b [95% CI], Holm p"] if loglik else [])]
    cells = []
    for i, e in enumerate(found):
        comp = e["comp"]
        if comp is None:
            cells.append([e["contrast"]["name"], "-", "-", "-", "-", "-", _why(e, seeds), "", "", "", "", "",
                          *([""] if loglik else [])])
            continue
        x = loglik.get(i)  # None where this contrast's log-likelihood comparison was not computable
        cells.append([e["contrast"]["name"], f"{comp.diff:+.4f}", f"[{comp.low:+.4f}, {comp.high:+.4f}]",
                      f"{comp.p:.3g}", f"{comp.p_adj:.3g}", f"{comp.p_tost_adj:.3g}",
                      comp.word() if resolved else comp.verdict, comp.method, comp.n_seeds, comp.n_examples or "-",
                      _finds(comp, plan["alpha"] / len(found)), _components(comp),
                      *([f"{x.diff:+.4f} [{x.low:+.4f}, {x.high:+.4f}], {x.p_adj:.3g}"] if x is not None else [])])
    on = "" if seeds is None else f"; each on exactly the declared seeds {', '.join(map(str, seeds))}"
    relative = isinstance(plan["margin"], dict)
    width = "unresolved" if not resolved else f"±{margin:.4g}" if relative else f"±{margin:g}"
    lines = [*(_controls_markdown(controls, seeds, plan["alpha"]) if controls else []),
             *([f"Margin: {width} ({source}).", ""] if relative else []),
             f"Declared contrasts ({plan['metric']}, margin {width}, alpha {plan['alpha']:g}, Holm across "
             f"all {len(found)}, {len(found) - len(comps)} of them not computable{on}). Holm runs within each kind of "
             f"claim: differs (Holm p < alpha), equivalent (Holm TOST p < alpha: both one-sided tests reject "
             f"±margin) and, of a difference, by more than ±margin (Holm minimum-effect p < alpha: it rejects every "
             f"difference within ±margin), each with family-wise error alpha, so at most "
             f"{3 * plan['alpha']:g} across the three kinds. The "
             f"95% interval shown is unadjusted. Finds (80%): the smallest difference this contrast's own seeds, "
             f"examples and variance components find with 80% power at alpha/{len(found)}; the components are those "
             f"of its paired differences. A contrast pools its pairs (its two cells on one seed) across run kinds; "
             f"a pair whose two cells ran on different kinds is refused.", "",
             *table(header, cells), "",
             *kinds.markdown([(e["contrast"]["name"], e["split"]) for e in controls + found]),
             *(["", f"Left out as repeating the configuration and seed of another record (the last by folder "
                    f"stands): {', '.join(repeats)}"] if repeats else [])]
    return rows, "\n".join(lines) + "\n"
