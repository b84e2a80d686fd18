"""Bits of the frozen base per layer type (budget.bits_records): the smallest base a bits sweep shows equivalent to
the best, since fewer bits are worth having only where they cost no accuracy beyond the margin."""

from __future__ import annotations

from dataclasses import dataclass

from qft.budget.evidence import one_dataset, read_records
from qft.errors import QftError


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
    """Take `df` (a bits sweep's result records), `data` (the dataset, where they hold several) and `margin`
    (accuracy); return the BitsProposal whose chosen setting is the smallest base shown equivalent to the best.
    Raises QftError on budget.bits_records with no record, under two bits settings sharing an adapter configuration,
    or a setting of one record; on budget.records_data where the records hold several datasets and `data` names none.
    Why pooled over the adapters measured at every setting: their effect cancels, so each seed samples the setting."""
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
    from qft import stats  # here, not at the top: scipy.stats costs every `python -m qft` start a second

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
    """propose_bits over the records under `cfg.bits_records` (`cfg` the budget group) on `cfg.records_data`;
    raises QftError on budget.bits_records where that is no folder, and as propose_bits."""
    return propose_bits(read_records("budget.bits_records", cfg.bits_records), cfg.records_data)
