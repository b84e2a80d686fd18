"""What each policy costs: plan which stages offload how much, simulate a step (topping up an 'auto' fraction
that falls short), and compare the four policies, alone or across the assumptions that decide the speedup."""

from __future__ import annotations

import dataclasses
import itertools

from qft.errors import QftError, number
from qft.tools.simulate.checks import POLICIES
from qft.tools.simulate.engine import Run
from qft.tools.simulate.inputs import Policy, Result, Server, Workload
from qft.tools.simulate.schedules import inflight, placement_of

AUTO_ROUNDS = 6  # re-simulations that raise an 'auto' fraction where the first estimate does not fit


def _offload_plan(server: Server, w: Workload, pol: Policy):
    """(offloading stages, fraction per stage). Auto stages: those whose resident peak exceeds the GPU.
    Auto fraction: the least f with fixed + (1-f) k A + 2 f A <= memory (k in flight, 2 buffers in flight)."""
    p, m, mem = len(w.stages), w.micro_batches, server.gpu_memory_bytes
    if pol.kind == "none":
        return set(), [0.0] * p
    if pol.stages is None:
        chosen = {s for s, st in enumerate(w.stages)
                  if st.fixed_bytes + inflight(w.schedule, m, p, s) * st.act_bytes > mem}
    else:
        bad = [s for s in pol.stages if s >= p]
        if bad:
            raise QftError("policy.stages", list(pol.stages), f"stage indices in [0, {p - 1}]")
        chosen = set(pol.stages)
    frac = []
    for s, st in enumerate(w.stages):
        if s not in chosen:
            frac.append(0.0)
        elif pol.fraction != "auto":
            frac.append(float(pol.fraction))
        else:
            k = inflight(w.schedule, m, p, s)
            need = st.fixed_bytes + k * st.act_bytes - mem
            frac.append(1.0 if k <= 2 or st.act_bytes <= 0 else min(1.0, max(0.0, need / ((k - 2) * st.act_bytes))))
    return chosen, frac


def simulate(server: Server, workload: Workload, policy: Policy | str = "none", placement="pipeline",
             chunk_bytes: float = 64 * 2**20) -> Result:
    """The Result of one training step of `workload` on `server` under `policy` (a Policy or its kind), stages
    placed by `placement`, copies moved in chunks of `chunk_bytes`."""
    if isinstance(policy, str):
        policy = Policy(kind=policy)
    number("chunk_bytes", chunk_bytes, above=0)
    gpus = placement_of(placement, len(workload.stages), server)
    chosen, frac = _offload_plan(server, workload, policy)
    res = Run(server, workload, policy, gpus, chunk_bytes, chosen, frac).simulate()
    for _ in range(AUTO_ROUNDS if policy.fraction == "auto" else 0):  # the estimate may fall short: top up
        over = [s for s in chosen if not res.fits[s] and frac[s] < 1]
        if not over:
            break
        for s in over:
            st = workload.stages[s]
            k = max(1, inflight(workload.schedule, workload.micro_batches, len(workload.stages), s) - 2)
            frac[s] = min(1.0, frac[s] + (res.peak_memory[s] - server.gpu_memory_bytes) / (k * st.act_bytes) + 0.02)
        res = Run(server, workload, policy, gpus, chunk_bytes, chosen, frac).simulate()
    return res


def compare(server: Server, workload: Workload, stages=None, fraction=1.0, neighbour_share=None,
            placement="pipeline", sync_efficiency: float = 1.0) -> dict:
    """{policy: Result} of the four policies for `workload` on `server`, on the same `stages`, `fraction`,
    `neighbour_share` and `placement`; sync copies at `sync_efficiency` of the bandwidth."""
    out = {}
    for kind in POLICIES:
        pol = Policy(kind=kind, stages=stages, fraction=fraction, neighbour_share=neighbour_share,
                     copy_efficiency=sync_efficiency if kind == "sync" else 1.0)
        out[kind] = simulate(server, workload, pol, placement)
    return out


def sweep(server: Server, workload: Workload, stages=None, placement="pipeline") -> list:
    """A row of speedups for `workload` on `server` (`stages`, `placement` as compare's) under each mix of the
    assumptions that decide them: compute speed (x1, x2), the baseline's copy bandwidth (pinned 1.0, pageable 0.5),
    one PCIe uplink per GPU or per pair, and offloading all or just enough."""
    rows = []
    for speed, eff, shared, frac in itertools.product((1, 2), (1.0, 0.5), (False, True), (1.0, "auto")):
        wl = dataclasses.replace(workload, stages=tuple(dataclasses.replace(st, fwd_s=st.fwd_s / speed,
                                 bwd_s=st.bwd_s / speed) for st in workload.stages))
        srv = dataclasses.replace(server, shared_uplink=shared)
        r = compare(srv, wl, stages, frac, None, placement, eff)
        t = {k: v.makespan for k, v in r.items()}
        rows.append({"compute": f"x{speed}", "sync_copy_bw": eff, "uplink": "per pair" if shared else "per GPU",
                     "fraction": frac, "none_s": round(t["none"], 2), "none_fits": all(r["none"].fits),
                     "sync_s": round(t["sync"], 2), "overlap_s": round(t["overlap"], 2),
                     "neighbour_s": round(t["neighbour"], 2),
                     "neighbour_vs_sync": round(t["sync"] / t["neighbour"], 2),
                     "neighbour_vs_overlap": round(t["overlap"] / t["neighbour"], 2),
                     "offload_fits": all(all(r[k].fits) for k in ("sync", "overlap", "neighbour"))})
    return rows
