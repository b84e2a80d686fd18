"""budget.method=fitted: a least-squares model of accuracy against rank per layer type, fitted on a study's
records, and the allocation of a budget it predicts best, beside the uniform one with the predicted difference's
interval, so a proposal says whether it beats the fit's own uncertainty."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from qft import layers as L
from qft.budget.costs import cost_per_rank, uniform
from qft.budget.evidence import one_dataset, read_records
from qft.errors import QftError

COEFFICIENTS = ("c", "u", "v", "w")
FORM = "acc = c + u*log2(1+r_attn) + v*log2(1+r_mlp) + w*log2(1+r_attn)*log2(1+r_mlp)"


def features(r_attn, r_mlp) -> np.ndarray:
    """The design rows of FORM for ranks `r_attn` and `r_mlp` (numbers or arrays): 1, a, m, a*m with
    a = log2(1 + r_attn), m = log2(1 + r_mlp)."""
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
        from qft import stats  # here: scipy.stats would cost every `python -m qft` start a second

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
    """Least-squares Fit of FORM to the ok records in `df` of one dataset (`data`, as evidence.one_dataset, strict),
    every seed's record a point; the zero-shot records (both ranks 0) are left out and counted. Raises QftError on
    budget.records with no usable record, records of several models, under four fine-tuned cells, cells that do not
    vary both ranks, or no more records than coefficients; on budget.records_data as evidence.one_dataset.
    Why this form: a log in rank gives diminishing returns; w lets one layer type's saturation cap the other's gain."""
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


def fit_records(cfg) -> Fit:
    """The Fit of the records under `cfg.records` (`cfg` the budget group) on `cfg.records_data`; raises QftError
    on budget.records where it is unset, no folder or holds no ok record, and as `fit`."""
    if not cfg.records:
        raise QftError("budget.records", None, "budget.method=fitted needs a folder of result records, "
                       "e.g. budget.records=results/rank_sweep/runs")
    from qft.record import RECORD

    df = read_records("budget.records", cfg.records)
    if df.empty or not (df.status == "ok").any():
        raise QftError("budget.records", str(cfg.records), f"no ok result record ({RECORD}) under it")
    f = fit(df, cfg.records_data)
    f.records = str(cfg.records)
    return f


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
    """Take the Fit `f`, the projections `layers`, the budget `params`, `tolerance` (a fraction) and `max_rank`
    (default: the largest rank `f` measured per layer type); over integer (r_attn, r_mlp) up to it whose exact count
    lies within `tolerance` below `params`, return the Proposal: the one `f` predicts best (ties: nearest the
    budget), the uniform allocation, their predicted difference and its 95% interval. Raises QftError on
    budget.params where none lies in that window.
    Why below only: predictions rise with parameters, so a window on both sides would favour its top."""
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
