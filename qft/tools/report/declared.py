"""A study's declared analysis (plan.yaml): its contrasts are the confirmatory family, Holm-adjusted across
themselves only, so that they are read apart from the exploratory comparisons of the summary table."""

from __future__ import annotations

from pathlib import Path

from qft import stats
from qft.tools.report.compare import (MARGIN, MIN_SEEDS, compare_configs, equal, mixed, one_record_a_seed,
                                      seed_rows)
from qft.tools.report.tables import table


def read_plan(path: Path) -> dict:
    """A study's declared analysis (plan.yaml): metric, margin, alpha, the contrasts (cell a - cell b, each cell as
    columns of the table) and the family the Holm adjustment covers (all the contrasts)."""
    import yaml

    try:
        plan = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--plan={path}: not a readable YAML file ({type(e).__name__})") from e
    contrasts = plan.get("contrasts")
    if not isinstance(contrasts, list) or not contrasts or not all(
            isinstance(c, dict) and {"name", "a", "b"} <= set(c) for c in contrasts):
        raise ValueError(f"--plan={path}: contrasts must be a list of {{name, a, b}} with a and b as column: value maps")
    if plan.get("metric", "accuracy") not in ("accuracy", "loglik"):
        raise ValueError(f"--plan={path}: metric must be accuracy or loglik")
    for key in ("seeds", "seeds_amended"):
        seeds = plan.get(key)
        if seeds is not None and (not isinstance(seeds, list) or not seeds or not all(
                isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
            raise ValueError(f"--plan={path}: {key} must be a non-empty list of integer seeds")
    return {"metric": "accuracy", "margin": MARGIN, "alpha": 0.05, **plan}


def declared_seeds(plan: dict) -> list | None:
    """The seeds the plan's verdicts use (the amended list where there is one): a contrast is analysed on exactly
    these, never on fewer, so a report run mid-study gives no early verdict."""
    seeds = plan.get("seeds_amended", plan.get("seeds"))
    return None if seeds is None else sorted(set(seeds))


def cell_keys(ok, cell: dict) -> list:
    """The configuration keys of the records a plan's cell matches; a cell names columns of the table or dotted
    config keys."""
    hit = ok[[all(equal(r[k] if k in r else r.get(f"cfg.{k}"), v) for k, v in cell.items()) for _, r in ok.iterrows()]]
    return list(dict.fromkeys(hit.config_key))


def _unmatched(matches: list) -> str:
    """Why a contrast has no single configuration on a side (its cells' matches, a then b): a cell the records lack,
    or one the plan names too loosely to tell configurations apart."""
    return "; ".join(f"cell {side} matches {'no records' if not m else f'{len(m)} configurations'}"
                     for side, m in zip("ab", matches) if len(m) != 1)


def _missing(ok, keys: list, seeds: list, untrained: set) -> list:
    """The declared seeds a contrast's trained cells do not both have (all of them for a cell with none)."""
    have = [set(ok.seed[ok.config_key == k]) for k in keys if k not in untrained]
    return [s for s in seeds if not all(s in h for h in have)]


def _finds(comp, alpha: float) -> str:
    d = stats.detectable(comp, alpha)
    return "-" if d is None else (f"{d:.3f}" if d < 1 else "> 1")


def _components(comp) -> str:
    c = comp.components
    return "-" if not c else f"{c['seed']:.2g} / {c['example']:.2g} / {c['residual']:.2g}"


def contrasts(df, g, plan: dict) -> tuple[list[dict], str]:
    """The declared contrasts with Holm across them, and their markdown table; where every contrast is paired and
    the metric is accuracy, the gold label's log-likelihood (continuous, more power) beside it, Holm across the
    same family, equivalence only within a declared `loglik_margin`."""
    ok, repeats = one_record_a_seed(df)  # as the exploratory table keeps them, and named below, never chosen silently
    matches = [[cell_keys(ok, c[side]) for side in ("a", "b")] for c in plan["contrasts"]]
    keys = [[m[0] if len(m) == 1 else None for m in ms] for ms in matches]  # None: no single configuration
    seeds = declared_seeds(plan)
    untrained = set(ok.config_key[ok.params.fillna(0).eq(0)])  # one evaluation: any seed stands for it
    if seeds is not None:
        ok = ok[ok.seed.isin(seeds) | ok.config_key.isin(untrained)]
    missing = [[] if seeds is None or None in k else _missing(ok, k, seeds, untrained) for k in keys]
    found = [(c, compare_configs(ok, *k, plan["margin"], plan["metric"]) if None not in k and not m else None)
             for c, k, m in zip(plan["contrasts"], keys, missing)]
    stats.holm([comp for _, comp in found])  # the whole declared family, a missing contrast as p = 1
    comps = [comp for _, comp in found if comp is not None]
    for comp in comps:
        comp.alpha = plan["alpha"]
    loglik = {}
    if plan["metric"] == "accuracy" and comps and all(c.method == "paired-crossed" for c in comps):
        loglik = {i: compare_configs(ok, *k, plan.get("loglik_margin", 0.0), "loglik")
                  if None not in k and not missing[i] else None for i, k in enumerate(keys)}
        stats.holm(list(loglik.values()))
        loglik = {i: x for i, x in loglik.items() if x is not None}
        for x in loglik.values():
            x.alpha = plan["alpha"]
    rows = [{"name": c["name"], **({} if comp is None else comp.as_dict()),
             **({"loglik": loglik[i].as_dict()} if i in loglik else {})} for i, (c, comp) in enumerate(found)]
    header = ["contrast", "a - b", "95% CI", "p", "Holm p", "Holm TOST p", "verdict", "method", "seeds", "examples",
              "finds (80%)", "seed / example / residual",
              *(["gold log-lik a - b [95% CI], Holm p"] if loglik else [])]
    cells = []
    for i, (c, comp) in enumerate(found):
        if comp is None:
            runs = [] if None in keys[i] else [d for k in keys[i] for d in seed_rows(ok, k).values()]
            why = (f"not run: {len(seeds) - len(missing[i])} of the {len(seeds)} declared seeds in both cells "
                   f"(missing {', '.join(map(str, missing[i]))})" if missing[i] else
                   f"not computable: {_unmatched(matches[i])}" if None in keys[i] else
                   f"not comparable: its records ran on {' and '.join(mixed(ok, runs))}" if mixed(ok, runs) else
                   f"not computable: fewer than {MIN_SEEDS} seeds both cells share, or per-example scores on "
                   f"different examples")
            cells.append([c["name"], "-", "-", "-", "-", "-", why, "", "", "", "", "", *([""] if loglik else [])])
            continue
        x = loglik.get(i)  # None where this contrast's log-likelihood comparison was not computable
        cells.append([c["name"], f"{comp.diff:+.4f}", f"[{comp.low:+.4f}, {comp.high:+.4f}]", f"{comp.p:.3g}",
                      f"{comp.p_adj:.3g}", f"{comp.p_tost_adj:.3g}", comp.word(), comp.method, comp.n_seeds, comp.n_examples or "-",
                      _finds(comp, plan["alpha"] / len(found)), _components(comp),
                      *([f"{x.diff:+.4f} [{x.low:+.4f}, {x.high:+.4f}], {x.p_adj:.3g}"] if x is not None else [])])
    on = "" if seeds is None else f"; each on exactly the declared seeds {', '.join(map(str, seeds))}"
    lines = [f"Declared contrasts ({plan['metric']}, margin ±{plan['margin']:g}, alpha {plan['alpha']:g}, Holm across "
             f"all {len(found)}, {len(found) - len(comps)} of them not computable{on}). Holm runs within each kind of "
             f"claim: differs (Holm p < alpha), equivalent (Holm TOST p < alpha: both one-sided tests reject "
             f"±margin) and, of a difference, by more than ±margin (Holm minimum-effect p < alpha: it rejects every "
             f"difference within ±margin), each with family-wise error alpha, so at most "
             f"{3 * plan['alpha']:g} across the three kinds. The "
             f"95% interval shown is unadjusted. Finds (80%): the smallest difference this contrast's own seeds, "
             f"examples and variance components find with 80% power at alpha/{len(found)}; the components are those "
             f"of its paired differences.", "",
             *table(header, cells),
             *(["", f"Left out as repeating the configuration and seed of another record (the last by folder "
                    f"stands): {', '.join(repeats)}"] if repeats else [])]
    return rows, "\n".join(lines) + "\n"
