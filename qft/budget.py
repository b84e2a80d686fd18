"""Trainable-parameter budgets: exact LoRA counts from module shapes alone, and ranks that meet a budget.

The model is built on the meta device, so a 70B architecture is planned in seconds from its config with no
weights on the machine. A LoRA adapter of rank r on a d_in x d_out projection has r * (d_in + d_out)
parameters, so each layer type (or depth group) has a fixed cost per unit of rank, and a budget is solved
for integer ranks by one of three methods: `shares` (the split between groups nearest the requested shares),
`uniform` (the same rank on every group) or `fitted` (per layer type, the allocation a model of accuracy
against rank, least-squares fitted on a study's result records, predicts best; see `fit` and `propose`).
With `budget.bits_records` (a bits sweep's records) it also proposes the bits of the frozen base per layer type:
the smallest base the seed noise cannot tell from the best (`propose_bits`).

    python -m qft.budget model=smollm2_135m budget.params=1000000
    python -m qft.budget model=local model.path=/models/Llama-2-7b budget.params=4e6 budget.split=depth
    python -m qft.budget model=smollm2_135m budget.params=1146000 budget.method=fitted \
        budget.records=results/rank_sweep/runs budget.records_data=bbc_news
    python -m qft.budget budget.params=1831680 budget.method=fitted budget.records=results/rank_sweep/runs \
        budget.records_data=reuters_r8 budget.bits_records=results/bits_sweep/runs
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from qft import layers as L, stats
from qft.errors import QftError, fail, integer, number

SPLITS = ("type", "depth")
METHODS = ("shares", "uniform", "fitted")


def meta_layers(source) -> list[L.Layer]:
    """The projections of an architecture, from its config alone (no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(source.config)
    return L.classify(model, source.model_type)


def groups(layers: list[L.Layer], split: str) -> dict[str, list[L.Layer]]:
    if split == "type":
        return {lt: [l for l in layers if l.layer_type == lt] for lt in L.LAYER_TYPES}
    thirds = L.depth_thirds(L.num_layers(layers))
    return {g: [l for l in layers if lo <= l.depth <= hi] for g, (lo, hi) in thirds.items()}


def cost_per_rank(layers: list[L.Layer], split: str) -> dict[str, int]:
    """Trainable parameters added by one unit of rank on every projection of each group."""
    return {g: sum(l.in_features + l.out_features for l in ls) for g, ls in groups(layers, split).items()}


def check(cfg) -> None:
    if cfg.params is None:
        return
    number("budget.params", cfg.params, above=0, what="a number of trainable parameters > 0, or null")
    if cfg.split not in SPLITS:
        raise QftError("budget.split", cfg.split, f"allowed: {', '.join(SPLITS)}")
    if not 0 < cfg.tolerance < 1:
        raise QftError("budget.tolerance", cfg.tolerance, "a fraction in (0, 1)")
    method = cfg.get("method", "shares")
    if method not in METHODS:
        raise QftError("budget.method", method, f"allowed: {', '.join(METHODS)}")
    if method == "shares":
        shares = list(cfg.shares)
        n = len(L.LAYER_TYPES) if cfg.split == "type" else 3
        if len(shares) != n or any(not isinstance(s, (int, float)) or s < 0 for s in shares) or sum(shares) <= 0:
            raise QftError("budget.shares", shares, f"{n} non-negative weights, one per "
                           + ("layer type (attn, mlp)" if cfg.split == "type" else "depth third (shallow, middle, deep)"))
    if method == "fitted":
        if cfg.split != "type":
            raise QftError("budget.split", cfg.split, "budget.method=fitted allocates per layer type: use budget.split=type")
        mr = cfg.get("max_rank")
        integer("budget.max_rank", mr, 1, what="an integer >= 1, or null (the largest rank measured)", null=True)
        fit_records(cfg)  # a bad folder, dataset choice or too few cells fails here, before any weight is read


def solve(layers: list[L.Layer], cfg) -> dict[str, int]:
    """Integer ranks per group that meet the budget within tolerance, by budget.method: `shares`, `uniform`
    or `fitted` (the allocation the fitted accuracy model predicts best)."""
    method = cfg.get("method", "shares")
    if method == "uniform":
        u = uniform(layers, cfg.params, cfg.split)
        if abs(u["off_by"]) > cfg.tolerance:
            step = sum(cost_per_rank(layers, cfg.split).values())
            raise QftError("budget.params", cfg.params,
                           f"the nearest uniform allocation (rank {u['r']} on every group) has {u['params']:,} parameters "
                           f"({u['off_by']:+.2%}), outside budget.tolerance={cfg.tolerance:g}; the nearest budgets it "
                           "meets exactly: " + " and ".join(f"{r * step:,} (rank {r})" for r in
                                                           sorted({max(1, int(cfg.params // step)), int(cfg.params // step) + 1})))
        return {g: u["r"] for g in cost_per_rank(layers, cfg.split)}
    if method == "fitted":
        f = fit_records(cfg)
        best = propose(f, layers, cfg.params, cfg.tolerance, cfg.get("max_rank")).best
        return {lt: best[lt] for lt in L.LAYER_TYPES}
    return solve_shares(layers, cfg)


def solve_shares(layers: list[L.Layer], cfg) -> dict[str, int]:
    """Integer ranks per group whose exact total lies within tolerance of the budget and whose split
    between groups is nearest the requested shares (ties: nearest the budget)."""
    costs = cost_per_rank(layers, cfg.split)
    names, unit = list(costs), list(costs.values())
    shares = [float(s) / sum(cfg.shares) for s in cfg.shares]
    best, best_key = None, None
    ranges = [range(int(cfg.params * (1 + cfg.tolerance) // c) + 1) if s > 0 else range(1) for c, s in zip(unit[:-1], shares)]
    for head in itertools.product(*ranges):
        rest = cfg.params - sum(r * c for r, c in zip(head, unit))
        last = max(0, round(rest / unit[-1])) if shares[-1] > 0 else 0
        combo = (*head, last)
        total = sum(r * c for r, c in zip(combo, unit))
        if not total or abs(total - cfg.params) > cfg.tolerance * cfg.params:
            continue
        key = (sum(abs(r * c / total - s) for r, c, s in zip(combo, unit, shares)), abs(total - cfg.params))
        if best_key is None or key < best_key:
            best, best_key = combo, key
    if best is None:
        smallest = min(c for c, s in zip(unit, shares) if s > 0)
        raise QftError("budget.params", cfg.params,
                       f"no integer ranks with shares {list(cfg.shares)} come within {cfg.tolerance:.0%}; "
                       f"the smallest allocation (rank 1 on one group) is {smallest:,} parameters")
    return dict(zip(names, best))


def apply(cfg, layers: list[L.Layer]) -> dict[str, int]:
    """Set the adapter ranks of `cfg` in place from its budget; return the solved ranks."""
    from omegaconf import open_dict

    ranks = solve(layers, cfg.budget)
    with open_dict(cfg):
        if cfg.budget.split == "type":
            for lt, r in ranks.items():
                cfg.adapter[lt].r = r
        else:
            for g, (lo, hi) in L.depth_thirds(L.num_layers(layers)).items():
                cfg.adapter.depth_groups[f"budget_{g}"] = {"layers": [lo, hi], "r": ranks[g]}
    return ranks


# --------------------------------------------------------------------------- fitted allocation

COEFFICIENTS = ("c", "u", "v", "w")
FORM = "acc = c + u*log2(1+r_attn) + v*log2(1+r_mlp) + w*log2(1+r_attn)*log2(1+r_mlp)"


def features(r_attn, r_mlp) -> np.ndarray:
    """The design rows of FORM: 1, a, m, a*m with a = log2(1 + r_attn), m = log2(1 + r_mlp)."""
    a, m = np.log2(1 + np.asarray(r_attn, float)), np.log2(1 + np.asarray(r_mlp, float))
    return np.stack([np.ones_like(a), a, m, a * m], axis=-1)


@dataclass
class Fit:
    """Test accuracy against rank per layer type, least-squares fitted on one dataset's records.

    `cov` is the coefficients' covariance (residual variance x (X'X)^-1), from which every prediction's
    interval follows; `measured` is the largest rank measured per layer type (the edge of the evidence)."""

    coef: np.ndarray
    cov: np.ndarray
    resid_se: float
    dof: int
    n_records: int
    n_cells: int
    data: str | None
    model: str | None
    measured: dict
    cells: list = field(default_factory=list)   # (r_attn, r_mlp, n records, mean accuracy) per cell
    pure_sd: float | None = None                 # seed-to-seed SD within cells (None with one record a cell)
    n_zero_shot: int = 0                         # no-adapter records left out of the fit
    records: str | None = None

    @property
    def se(self) -> np.ndarray:
        return np.sqrt(np.diag(self.cov))

    def t95(self) -> float:
        return stats.t_quantile(self.dof)

    def predict(self, r_attn, r_mlp) -> tuple[float, float]:
        """Predicted mean test accuracy and the half-width of its 95% interval (the fit's uncertainty about
        the mean at those ranks, not a single run's seed noise)."""
        x = features(r_attn, r_mlp)
        return float(x @ self.coef), self.t95() * math.sqrt(max(float(x @ self.cov @ x), 0.0))

    def difference(self, a: tuple, b: tuple) -> tuple[float, float]:
        """Predicted accuracy of ranks `a` minus ranks `b`, and its 95% half-width: the two predictions share
        the coefficients, so the difference's variance is d' cov d with d = x(a) - x(b), not a sum."""
        d = features(*a) - features(*b)
        return float(d @ self.coef), self.t95() * math.sqrt(max(float(d @ self.cov @ d), 0.0))

    def describe(self) -> str:
        where = f" under {self.records}" if self.records else ""
        lines = [f"fit of {self.n_records} ok records ({self.n_cells} attn x mlp rank cells, every seed) of "
                 f"{self.data}{where}, model {self.model}"
                 + (f" ({self.n_zero_shot} zero-shot records, both ranks 0, left out)" if self.n_zero_shot else "") + ":",
                 f"  {FORM}",
                 "| coefficient | estimate | SE |", "|---|---|---|"]
        lines += [f"| {n} | {c:+.4f} | {s:.4f} |" for n, c, s in zip(COEFFICIENTS, self.coef, self.se)]
        lines.append(f"residual SE {self.resid_se:.4f} on {self.dof} degrees of freedom; ranks measured up to "
                     + ", ".join(f"{lt} {r}" for lt, r in self.measured.items()))
        if self.pure_sd:
            ratio = self.resid_se / self.pure_sd
            lines.append(f"seed-to-seed SD within cells {self.pure_sd:.4f}; residual SE / that = {ratio:.1f}"
                         + (": the form misses the cell means by more than the seeds scatter (lack of fit), "
                            "which widens every interval below" if ratio > 2 else ""))
        lines += ["| r_attn | r_mlp | n | mean acc | fitted |", "|---|---|---|---|---|"]
        lines += [f"| {a} | {m} | {k} | {mean:.4f} | {self.predict(a, m)[0]:.4f} |" for a, m, k, mean in self.cells]
        return "\n".join(lines)


def fit(df, data: str | None = None) -> Fit:
    """Least-squares fit of FORM to the ok records of one dataset, every seed's record a point.

    Why this form: accuracy grows with rank with diminishing returns (a log in rank: doubling the rank buys
    a constant step, so 2 -> 8 buys far less than 0 -> 2 per parameter), and the two layer types are not
    additive, because the task saturates: once one type's adapters lift accuracy to the ceiling, the other
    type can add little, which only an interaction term w (negative under saturation) expresses.
    The no-adapter cell (both ranks 0) is left out: it is the zero-shot prompt, not a fine-tune, and the
    jump from prompting to any fine-tune is a step no smooth curve in rank follows (on BBC News 0.37 -> 0.86
    at rank 2, then flat; with it in the fit the residual SE was six times the seed-to-seed SD). No
    allocation of a budget > 0 is that cell, so the fit covers only the fine-tuned region it chooses in.
    Fitting all seeds rather than cell means lets the residual standard error measure seed-to-seed noise and
    weights each cell by its number of seeds. Four coefficients need at least four distinct fine-tuned cells
    that vary both ranks, and more records than coefficients to estimate the noise; otherwise QftError."""
    if df is None or len(df) == 0 or "status" not in df:
        raise QftError("budget.records", None, "no result record to fit")
    ok = df[(df.status == "ok") & df.acc_test.notna() & df.attn_r.notna() & df.mlp_r.notna()]
    ok, data = one_dataset(ok, data, "records", strict=True)
    if ok.empty:
        raise QftError("budget.records", None, "no ok record with a test accuracy and adapter ranks")
    zero = (ok.attn_r == 0) & (ok.mlp_r == 0)
    n_zero, ok = int(zero.sum()), ok[~zero]
    models = sorted(ok["cfg.model.name"].dropna().unique()) if "cfg.model.name" in ok else []
    if len(models) > 1:
        raise QftError("budget.records", None, f"the {data} records come from several models "
                       f"({', '.join(models)}); fit one model's records")
    ra, rm = ok.attn_r.astype(float).to_numpy(), ok.mlp_r.astype(float).to_numpy()
    y = ok.acc_test.astype(float).to_numpy()
    X = features(ra, rm)
    n, p = X.shape
    cells = len(set(zip(ra, rm)))
    if cells < p:
        raise QftError("budget.records", f"{cells} cells", f"the fit has {p} coefficients and needs records of at "
                       f"least {p} distinct (attention rank, MLP rank) cells with an adapter")
    if np.linalg.matrix_rank(X) < p:
        raise QftError("budget.records", f"{cells} cells", "the cells must vary both ranks (some with both types "
                       "adapted) for every coefficient to be determined")
    if n <= p:
        raise QftError("budget.records", f"{n} records", f"more records than the {p} coefficients are needed to "
                       "estimate the noise: add a seed of any cell")
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ coef
    s2 = float(resid @ resid) / (n - p)
    by_cell = ok.assign(_y=y).groupby([ok.attn_r.astype(int), ok.mlp_r.astype(int)])._y
    within = float(((y - by_cell.transform("mean").to_numpy()) ** 2).sum())
    return Fit(coef=coef, cov=s2 * np.linalg.inv(X.T @ X), resid_se=math.sqrt(s2), dof=n - p, n_records=n,
               n_cells=cells, data=data, model=models[0] if models else None,
               measured={"attn": int(ra.max()), "mlp": int(rm.max())},
               cells=[(a, m, int(k), float(v)) for (a, m), k, v in zip(by_cell.mean().index, by_cell.count(), by_cell.mean())],
               pure_sd=math.sqrt(within / (n - cells)) if n > cells else None, n_zero_shot=n_zero)


def one_dataset(ok, data: str | None, what: str, strict: bool):
    """The records of one dataset (data.source) and its name: `data` where the records hold several, else the
    only one they hold. strict: `data`, when given, must be among them (the records were made for it); not strict:
    it only chooses among several (budget.records_data names the rank records' dataset, which the bits records
    need not share)."""
    col = "cfg.data.source"
    sources = sorted(ok[col].dropna().unique()) if col in ok else []
    if len(sources) > 1 or (strict and data is not None):
        if data is None:
            raise QftError("budget.records_data", None, f"the {what} hold several datasets ({', '.join(sources)}); "
                           "choose one, e.g. budget.records_data=" + sources[0])
        if data not in sources:
            raise QftError("budget.records_data", data, f"no ok record of that dataset; the {what} hold: "
                           + (", ".join(sources) or "none"))
        return ok[ok[col] == data], data
    return ok, sources[0] if sources else None


def _collect(key: str, folder):
    """The records under a folder named by a budget key, through qft.report.collect (the one reader of records)."""
    path = Path(str(folder)).expanduser()
    if not path.is_dir():
        raise QftError(key, str(folder), "no such folder")
    from qft import report

    return report.collect([path])


def fit_records(cfg) -> Fit:
    """The fit of budget.records (a folder of result records, read through qft.report.collect, the one
    reader of records) on budget.records_data."""
    if not cfg.get("records"):
        raise QftError("budget.records", None, "budget.method=fitted needs a folder of result records, "
                       "e.g. budget.records=results/rank_sweep/runs")
    from qft.record import RECORD

    df = _collect("budget.records", cfg.records)
    if df.empty or not (df.status == "ok").any():
        raise QftError("budget.records", str(cfg.records), f"no ok result record ({RECORD}) under it")
    f = fit(df, cfg.get("records_data"))
    f.records = str(cfg.records)
    return f


def uniform(layers: list[L.Layer], params: float, split: str = "type") -> dict:
    """The same rank r >= 1 on every group, r nearest the budget (the count is linear in r, so r rounds
    params / (sum of the groups' cost per rank))."""
    step = sum(cost_per_rank(layers, split).values())
    r = max(1, round(params / step))
    return {"r": r, "params": r * step, "off_by": (r * step - params) / params}


@dataclass
class Proposal:
    """The fitted allocation at a budget, the uniform one beside it, and the predicted difference."""

    params: float
    tolerance: float
    max_rank: dict
    candidates: list[dict]          # every allocation within tolerance and max_rank, best predicted first
    best: dict
    uniform: dict
    diff: float                     # predicted accuracy, best - uniform
    diff_ci: float                  # 95% half-width of diff
    costs: dict = field(default_factory=dict)

    @property
    def within_noise(self) -> bool:
        return abs(self.diff) <= self.diff_ci

    def verdict(self) -> str:
        b, u = self.best, self.uniform
        if (b["attn"], b["mlp"]) == (u["attn"], u["mlp"]):
            return "the fit proposes the uniform allocation itself."
        said = (f"predicted difference, fitted - uniform: {self.diff:+.4f} ±{self.diff_ci:.4f} (95%): ")
        if self.within_noise:
            said += ("WITHIN NOISE: the interval includes 0, so the fit cannot tell the fitted allocation from the "
                     "uniform one; a run of each would be needed to find out.")
        else:
            said += f"larger than the fit's uncertainty: the fit favours the {'fitted' if self.diff > 0 else 'uniform'} allocation."
        notes = []
        if abs(u["off_by"]) > self.tolerance:
            notes.append(f"the uniform allocation is {u['off_by']:+.2%} off the budget, outside the {self.tolerance:.0%} "
                         "tolerance: the two are not at equal parameters")
        if u["extrapolates"]:
            notes.append("the uniform rank lies beyond the ranks measured, so its prediction extrapolates")
        if b["extrapolates"]:
            notes.append("the fitted allocation lies beyond the ranks measured (budget.max_rank), so its prediction extrapolates")
        return said + "".join(f"\nnote: {n}." for n in notes)

    def describe(self) -> str:
        lines = [f"allocations within {self.tolerance:.0%} of {self.params:,.0f} trainable parameters, ranks up to "
                 + ", ".join(f"{lt} {r}" for lt, r in self.max_rank.items()) + ", best predicted first:",
                 "| allocation | r_attn | r_mlp | params | off by | predicted acc | 95% CI |",
                 "|---|---|---|---|---|---|---|"]
        rows = self.candidates + ([] if any(_same(c, self.uniform) for c in self.candidates) else [self.uniform])
        for a in rows:
            label = " = ".join(n for n, on in (("fitted", a is self.best), ("uniform", _same(a, self.uniform))) if on)
            lines.append(f"| {label} | {a['attn']} | {a['mlp']} | {a['params']:,} | {a['off_by']:+.2%} | "
                         f"{a['pred']:.4f} | ±{a['ci']:.4f} |")
        lines.append(f"| fitted - uniform | {self.best['attn'] - self.uniform['attn']:+d} | "
                     f"{self.best['mlp'] - self.uniform['mlp']:+d} | {self.best['params'] - self.uniform['params']:+,} | "
                     f"| {self.diff:+.4f} | ±{self.diff_ci:.4f} |")
        lines.append(self.verdict())
        return "\n".join(lines)


def _same(a: dict, b: dict) -> bool:
    return (a["attn"], a["mlp"]) == (b["attn"], b["mlp"])


def _allocation(f: Fit, costs: dict, r_attn: int, r_mlp: int, params: float) -> dict:
    total = r_attn * costs["attn"] + r_mlp * costs["mlp"]
    pred, ci = f.predict(r_attn, r_mlp)
    return {"attn": r_attn, "mlp": r_mlp, "params": total, "off_by": (total - params) / params, "pred": pred,
            "ci": ci, "extrapolates": r_attn > f.measured["attn"] or r_mlp > f.measured["mlp"]}


def propose(f: Fit, layers: list[L.Layer], params: float, tolerance: float, max_rank: int | None = None) -> Proposal:
    """Over integer (r_attn, r_mlp), each within [0, max_rank] (default: the largest rank measured for that
    type, so the choice never rests on extrapolation), whose exact count lies within tolerance below the budget
    (never above: predictions rise with parameters, so a window on both sides would favour its top and compare
    unequal counts): the one with the highest predicted accuracy (ties: nearest the budget), beside the uniform
    allocation (the same rank on both, nearest the budget) and the predicted difference with its 95% interval."""
    costs = cost_per_rank(layers, "type")
    cap = dict(f.measured) if max_rank is None else {lt: int(max_rank) for lt in L.LAYER_TYPES}
    found = [_allocation(f, costs, a, m, params) for a in range(cap["attn"] + 1) for m in range(cap["mlp"] + 1)
             if (a or m) and 0 <= params - (a * costs["attn"] + m * costs["mlp"]) <= tolerance * params]
    if not found:
        upto = ", ".join(f"{lt} {r}" for lt, r in cap.items())
        raise QftError("budget.params", params, f"no ranks up to {upto} come within {tolerance:.0%} below it (attn costs "
                       f"{costs['attn']:,}, mlp {costs['mlp']:,} per unit of rank); raise budget.tolerance or "
                       "budget.max_rank (beyond the measured ranks the fit extrapolates)")
    found.sort(key=lambda c: (-c["pred"], abs(c["off_by"])))
    best = found[0]
    r = uniform(layers, params, "type")["r"]
    uni = _allocation(f, costs, r, r, params)
    diff, ci = (0.0, 0.0) if _same(best, uni) else f.difference((best["attn"], best["mlp"]), (r, r))
    return Proposal(params=params, tolerance=tolerance, max_rank=cap, candidates=found, best=best, uniform=uni,
                    diff=diff, diff_ci=ci, costs=costs)


# --------------------------------------------------------------------------- bits of the frozen base

@dataclass
class BitsProposal:
    """Accuracy per (attention bits, MLP bits) of the base over the adapters measured at every one of them, and
    the cheapest setting shown equivalent to the best within the margin."""

    table: list[dict]      # per bits setting: attn, mlp, n, mean, sd, base_bytes, diff (vs best), low, high, verdict
    best: dict
    chosen: dict
    adapters: int          # adapter configurations pooled (those measured at every bits setting)
    data: str | None
    margin: float = 0.02

    def describe(self) -> str:
        lines = [f"bits of the frozen base, from {sum(r['n'] for r in self.table)} ok records of {self.data} "
                 f"({self.adapters} adapter configurations measured at every setting, pooled):",
                 "| attn bits | mlp bits | n | mean acc | base MB | vs best | |", "|---|---|---|---|---|---|---|"]
        for r in self.table:
            mark = "proposed" if r is self.chosen else ""
            vs = "best" if r is self.best else f"{r['diff']:+.4f} [{r['low']:+.4f}, {r['high']:+.4f}] {r['verdict']}"
            lines.append(f"| {r['attn']} | {r['mlp']} | {r['n']} | {r['mean']:.4f} | {r['base_bytes'] / 1e6:,.1f} | "
                         f"{vs} | {mark} |")
        c, b = self.chosen, self.best
        lines.append(f"proposed bits: attn {c['attn']}, mlp {c['mlp']}: the smallest base shown equivalent to the best "
                     f"within ±{self.margin:g} accuracy (TOST on Welch over records, 5%)" + ("" if c is b else f"; {b['base_bytes'] / c['base_bytes']:.2f}x "
                     f"smaller than the best-measured setting (attn {b['attn']}, mlp {b['mlp']})"))
        return "\n".join(lines)


def propose_bits(df, data: str | None = None, margin: float = 0.02) -> BitsProposal:
    """The fewest bits per layer type shown to cost less than `margin` accuracy, from a bits sweep's records.

    Why pooled over adapters: each bits setting is compared on the same adapter configurations (those measured
    at every setting), so the adapters' own effect cancels and every seed of every adapter is a sample of the
    setting; a setting is proposed over the best one only where equivalence within the margin is shown (TOST on
    Welch: "no difference seen" is not enough), and among those the one whose frozen base is smallest wins (the
    point of fewer bits is memory)."""
    if df is None or len(df) == 0 or "status" not in df:
        raise QftError("budget.bits_records", None, "no result record")
    ok = df[(df.status == "ok") & df.acc_test.notna() & df.attn_bits.notna() & df.mlp_bits.notna()]
    ok, data = one_dataset(ok, data, "bits records", strict=False)
    bits = ok.assign(_b=list(zip(ok.attn_bits.astype(int), ok.mlp_bits.astype(int))),
                     _a=list(zip(ok.attn_r, ok.mlp_r)))
    settings = sorted(set(bits._b))
    common = set.intersection(*(set(bits[bits._b == b]._a) for b in settings)) if settings else set()
    bits = bits[bits._a.isin(common)]
    if len(settings) < 2 or not common:
        raise QftError("budget.bits_records", f"{len(settings)} bits settings",
                       "records of at least two bits settings on a common adapter configuration are needed")
    g = bits.groupby("_b")
    t = stats.seed_summary(g).assign(base_bytes=g.base_bytes.mean()).reset_index()
    if (t.n_seeds < 2).any():
        raise QftError("budget.bits_records", "one record", "every bits setting needs two records or more for its noise")
    j = t.acc_mean.idxmax()
    ref = t.loc[j]
    table = []
    for i, r in t.iterrows():
        c = stats.welch_from_summary(r.acc_mean, r.acc_sd, r.n_seeds, ref.acc_mean, ref.acc_sd, ref.n_seeds, margin)
        table.append({"attn": r._b[0], "mlp": r._b[1], "n": int(r.n_seeds), "mean": r.acc_mean, "sd": r.acc_sd,
                      "base_bytes": r.base_bytes, "is_best": i == j, "diff": 0.0 if i == j else c.diff,
                      "low": c.low, "high": c.high, "verdict": "best" if i == j else c.verdict})
    table.sort(key=lambda r: r["base_bytes"])
    best = next(r for r in table if r["is_best"])
    chosen = next(r for r in table if r["is_best"] or r["verdict"] == "equivalent")
    return BitsProposal(table=table, best=best, chosen=chosen, adapters=len(common), data=data, margin=margin)


def bits_records(cfg) -> BitsProposal:
    return propose_bits(_collect("budget.bits_records", cfg.bits_records), cfg.get("records_data"))


def allocations(layers: list[L.Layer], params: float, split: str, tolerance: float, grid) -> list[dict]:
    """Every combination of grid ranks per group whose exact count lies within tolerance of the budget."""
    costs = cost_per_rank(layers, split)
    out = []
    for combo in itertools.product(grid, repeat=len(costs)):
        total = sum(r * c for r, c in zip(combo, costs.values()))
        if total and abs(total - params) <= tolerance * params:
            out.append({**dict(zip(costs, combo)), "params": total, "off_by": (total - params) / params})
    return sorted(out, key=lambda a: abs(a["off_by"]))


def main(argv=None) -> int:
    from qft import config, model

    cfg = config.compose(argv, "qft.budget")
    if cfg is None:
        return 2
    method = cfg.budget.get("method", "shares")
    try:
        if cfg.budget.params is None:
            raise QftError("budget.params", None, "set the budget, e.g. budget.params=1000000")
        check(cfg.budget)
        layers = meta_layers(model.resolve(cfg.model, cfg.cache_dir))
        costs = cost_per_rank(layers, cfg.budget.split)
        bits = bits_records(cfg.budget) if cfg.budget.get("bits_records") else None
        if method == "fitted":
            f = fit_records(cfg.budget)
            proposal = propose(f, layers, cfg.budget.params, cfg.budget.tolerance, cfg.budget.get("max_rank"))
        else:
            found = allocations(layers, cfg.budget.params, cfg.budget.split, cfg.budget.tolerance, list(cfg.budget.grid))
            if method == "uniform":
                ranks = solve(layers, cfg.budget)
            elif not found:
                raise QftError("budget.params", cfg.budget.params,
                               f"no allocation on the rank grid {list(cfg.budget.grid)} within {cfg.budget.tolerance:.0%}; "
                               f"the smallest is {min(costs.values()):,} parameters")
    except QftError as e:
        return fail("qft.budget", e)
    print(f"{cfg.model.name}: {len(layers)} projections; parameters per unit of rank: "
          + ", ".join(f"{g} {c:,}" for g, c in costs.items()))
    if method == "fitted":
        print(f.describe())
        if f.model and f.model != cfg.model.name:
            print(f"note: the records come from model {f.model}; this plan is for {cfg.model.name}")
        print(proposal.describe())
        if bits:
            print(bits.describe())
        return 0
    print(f"allocations within {cfg.budget.tolerance:.0%} of {cfg.budget.params:,.0f} trainable parameters:")
    print("| " + " | ".join(f"r_{g}" for g in costs) + " | params | off by |")
    print("|" + "---|" * (len(costs) + 2))
    for a in found:
        print("| " + " | ".join(str(a[g]) for g in costs) + f" | {a['params']:,} | {a['off_by']:+.2%} |")
    if method == "uniform":
        total = sum(ranks[g] * c for g, c in costs.items())
        print(f"uniform (budget.method=uniform): rank {next(iter(ranks.values()))} on every group, {total:,} parameters "
              f"({(total - cfg.budget.params) / cfg.budget.params:+.2%})")
    if bits:
        print(bits.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
