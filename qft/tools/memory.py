"""Will this config fit on my GPU? A memory model of one qft training step, from the composed config alone.

Asks qft.planning.footprint and qft.planning.stages; prints a table, and what would fit instead.

    python -m qft.tools.memory model=llama2_7b device=cuda train.batch_size=4 data.max_length=512
    python -m qft.tools.memory model=llama3_70b device=cuda offload.device_budget_gb=24   # fits? if not, what would
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass

from qft import layers as L
from qft.planning import stages
from qft.errors import QftError, fail
from qft.planning.footprint import GiB, eval_peak, layer_costs, resolve, target_device
from qft.planning.stages import HOST, stage_components, stage_peaks


@dataclass
class Estimate:
    """The peak device memory of a config's training step, broken down; `peak` is the most loaded device's."""

    model: str
    device: str
    compute_dtype: str
    batch: int
    seq: int
    answer: int
    mode: str
    boundaries: list
    offloaded: list
    components: dict  # component -> bytes on the most loaded device (they sum to `peak`)
    stage_peaks: list
    host_bytes: int  # activations offloaded to host memory, all stages
    eval_peak: int  # the scorer's forward with its KV cache (train.eval_batch_size, no gradients)
    params: int  # trainable
    layers: int

    @property
    def peak(self) -> int:
        """The most loaded stage's peak bytes."""
        return max(self.stage_peaks)


def estimate(cfg, source=None, answer_tokens: int | None = None, answer_rows: int | None = None,
             padded: bool = True, files: bool = True) -> Estimate:
    """The Estimate of one training step of config `cfg`, from the config alone (no weights); `source`,
    `answer_tokens`, `answer_rows`, `padded` and `files` as qft.planning.footprint.resolve takes them."""
    p = resolve(cfg, source, answer_tokens, answer_rows, padded, files)
    off = p.offload
    if off["mode"] == "pipeline":
        the_plan = stages.plan(cfg)
        boundaries, offloaded = list(the_plan.boundaries), list(the_plan.offloaded)
    else:
        boundaries, offloaded = [], [0] if off["mode"] == "activations" else []
    host: list = []
    peaks = stage_peaks(cfg, boundaries, offload_stages=offloaded, resolved=p, host=host)
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    m = off["micro_batches"] if off["mode"] == "pipeline" else 1
    costs = layer_costs(cfg, p.batch // m, resolved=p)
    comps = stage_components(p, costs, [0, *boundaries, p.shape.layers], worst, m, off["schedule"], worst in offloaded)
    comps.pop(HOST, None)
    params = sum(c.detail.get("params", 0) for c in costs)
    return Estimate(p.name, p.device, p.compute_dtype, p.batch, p.seq, p.answer, off["mode"], boundaries, offloaded,
                    comps, peaks, sum(host), eval_peak(p, costs), params, p.shape.layers)


# ----------------------------------------------------------------------------------------------- what would fit

def _with(cfg, changes: dict):
    """A copy of `cfg` with the dotted keys of `changes` set."""
    from omegaconf import OmegaConf, open_dict

    out = copy.deepcopy(cfg)
    with open_dict(out):
        for key, value in changes.items():
            OmegaConf.update(out, key, value, merge=False)
    return out


def _four_bit(cfg) -> dict:
    """The overrides that put every projection of `cfg`'s frozen base at 4 bits (NF4) wherever it sets more."""
    changes = {f"quant.{lt}.bits": 4 for lt in L.LAYER_TYPES if cfg.quant[lt].bits != 4}
    for proj, entry in (cfg.quant.projections or {}).items():
        if (entry or {}).get("bits", 4) != 4:
            changes[f"quant.projections.{proj}.bits"] = 4
    for g, entry in (cfg.quant.depth_groups or {}).items():
        if (entry or {}).get("bits", 4) != 4:
            changes[f"quant.depth_groups.{g}.bits"] = 4
    return changes


def _peak_of(cfg, source, answer_tokens) -> int | None:
    """estimate(`cfg`, `source`, `answer_tokens`).peak, or None where a pipeline cannot fit its budget."""
    try:
        return estimate(cfg, source, answer_tokens).peak
    except QftError as e:  # a pipeline that cannot fit the budget says so through its planner
        if e.key == "offload.device_budget_gb":
            return None
        raise


def suggestions(cfg, budget_bytes: float, source=None, answer_tokens: int | None = None) -> list[dict]:
    """Rows {"overrides", "peak" (bytes or None), "fits"} of settings that would bring `cfg`'s peak under
    `budget_bytes`: checkpointing, activation offload, a smaller batch with more accumulation, 4 bits, pipeline
    stages; then each on top of checkpointing where no single change fits. `source`, `answer_tokens` as estimate's."""
    from qft import model

    source = source or model.resolve(cfg.model, cfg.cache_dir)
    t, off = cfg.train, cfg.offload
    singles = []
    if not t.gradient_checkpointing:
        singles.append({"train.gradient_checkpointing": True})
    gpu = target_device(cfg) == "cuda"
    if off.mode == "none" and gpu:  # on a CPU, host memory is the device's
        singles.append({"offload.mode": "activations"})
    if _four_bit(cfg):
        singles.append(_four_bit(cfg))
    rows = []

    def consider(changes: dict, label: str | None = None):
        c = _with(cfg, changes)
        peak = _peak_of(c, source, answer_tokens)
        rows.append({"overrides": label or _overrides(changes),
                     "peak": peak, "fits": peak is not None and peak <= budget_bytes})
        return rows[-1]["fits"]

    def smaller_batch(base: dict) -> bool:
        b = t.batch_size // 2
        while b >= 1:  # the largest batch that fits is the cheapest in step time
            if t.batch_size % b == 0:
                ch = {**base, "train.batch_size": b, "train.grad_accum": t.grad_accum * t.batch_size // b}
                if consider(ch):
                    return True
            b //= 2
        return False

    def stages(base: dict) -> bool:
        depth = source.num_layers
        m = next(k for k in range(min(off.micro_batches, t.batch_size), 0, -1) if t.batch_size % k == 0)
        for p in range(2, min(depth, 64) + 1):
            ch = {**base, "offload.mode": "pipeline", "offload.stages": p, "offload.micro_batches": m,
                  "offload.device_budget_gb": budget_bytes / GiB}
            c = _with(cfg, ch)
            peak = _peak_of(c, source, answer_tokens)
            if peak is not None and peak <= budget_bytes:
                label = _overrides({k: v for k, v in ch.items() if k != "offload.device_budget_gb"})
                rows.append({"overrides": label, "peak": peak, "fits": True})
                return True
        rows.append({"overrides": _overrides(base) + f" offload=pipeline offload.stages<={min(depth, 64)}",
                     "peak": None, "fits": False})
        return False

    for ch in singles:
        consider(ch)
    if t.batch_size > 1:
        smaller_batch({})
    if off.mode != "pipeline":
        stages({})
    if not any(r["fits"] for r in rows):  # combine: checkpointing and 4-bit first, they cost no memory traffic
        base = {**({"train.gradient_checkpointing": True} if not t.gradient_checkpointing else {}), **_four_bit(cfg)}
        if base and not consider(base):
            if not (t.batch_size > 1 and smaller_batch(base)):
                with_off = {**base, "offload.mode": "activations"} if off.mode == "none" and gpu else base
                if not consider(with_off) and not (t.batch_size > 1 and smaller_batch(with_off)):
                    stages(base)
    return rows


def _eval_batch_that_fits(cfg, source, budget_bytes: float) -> tuple[int, int] | None:
    """The largest power-of-two evaluation batch below `cfg`'s whose scoring peak fits `budget_bytes`, or None."""
    b = cfg.train.eval_batch_size
    for cand in sorted((2 ** i for i in range(b.bit_length()) if 2 ** i < b), reverse=True):
        peak = estimate(_with(cfg, {"train.eval_batch_size": cand}), source).eval_peak
        if peak <= budget_bytes:
            return cand, peak
    return None


def _overrides(changes: dict) -> str:
    """Changes as the command line sets them: an offload mode by its preset, whose shape holds the mode's keys."""
    return " ".join(f"offload={v}" if k == "offload.mode" else f"{k}={_show(v)}" for k, v in changes.items())


def _show(v) -> str:
    """Override value `v` as written on a command line."""
    return str(v).lower() if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)


# ----------------------------------------------------------------------------------------------- the CLI

def table(est: Estimate) -> str:
    """Estimate `est` as a markdown table in GiB."""
    lines = [f"{est.model} on {est.device} ({est.compute_dtype} compute), batch {est.batch} x seq {est.seq}, "
             f"answer {est.answer} tokens, {est.params:,} trainable parameters, offload.mode={est.mode}",
             "", "| component | GiB |", "|---|---:|"]
    lines += [f"| {k} | {v / GiB:.3f} |" for k, v in est.components.items()]
    lines.append(f"| **peak{' (most loaded stage)' if len(est.stage_peaks) > 1 else ''}** | **{est.peak / GiB:.3f}** |")
    if len(est.stage_peaks) > 1:
        edges = [0, *est.boundaries, est.layers]
        lines += ["", "| stage | layers | peak GiB | activations |", "|---|---|---:|---|"]
        for s, peak in enumerate(est.stage_peaks):
            lines.append(f"| {s} | {edges[s]}-{edges[s + 1] - 1} | {peak / GiB:.3f} | "
                         f"{'host' if s in est.offloaded else 'device'} |")
    if est.host_bytes:
        lines.append(f"\nhost memory for offloaded activations: {est.host_bytes / GiB:.3f} GiB")
    lines.append(f"evaluation (train.eval_batch_size, KV cache, no gradients): {est.eval_peak / GiB:.3f} GiB")
    return "\n".join(lines)


def main(argv=None) -> int:
    """The command line: `argv` as Hydra overrides; returns the exit status (2 on bad input)."""
    from qft import config

    cfg = config.compose(argv, "qft.tools.memory", __doc__)
    if cfg is None:
        return 2
    try:
        from qft import model, offload

        offload.check(cfg.offload)  # a bad budget is the user's, not the "no split fits" the planner raises below
        source = model.resolve(cfg.model, cfg.cache_dir)
        budget_gb = cfg.offload.device_budget_gb
        try:
            est = estimate(cfg, source)
            too_small = False
        except QftError as e:  # the pipeline planner found no split under the budget
            if e.key != "offload.device_budget_gb":
                raise
            est, too_small = estimate(_with(cfg, {"offload.device_budget_gb": None}), source), True
        print(table(est))
        if budget_gb is not None:
            budget_bytes = budget_gb * GiB
            fits = not too_small and est.peak <= budget_bytes
            print(f"\nbudget {budget_gb:g} GiB per device: training {'fits' if fits else 'does not fit'} "
                  f"(peak {est.peak / GiB:.3f} GiB)")
            if not fits:
                rows = suggestions(cfg, budget_bytes, source)
                print("\nwhat would fit (estimated peak per device):\n\n| overrides | peak GiB | fits |\n"
                      "|---|---:|---|")
                for r in rows:
                    peak = "-" if r["peak"] is None else f"{r['peak'] / GiB:.3f}"
                    print(f"| {r['overrides']} | {peak} | {'yes' if r['fits'] else 'no'} |")
            if est.mode != "pipeline" and est.eval_peak > budget_bytes:  # a pipeline scores on the host
                b = _eval_batch_that_fits(cfg, source, budget_bytes)
                print(f"\nevaluation does not fit ({est.eval_peak / GiB:.3f} GiB): "
                      + (f"train.eval_batch_size={b[0]} would ({b[1] / GiB:.3f} GiB)" if b else
                         "not even at train.eval_batch_size=1"))
    except QftError as e:
        return fail("qft.tools.memory", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
