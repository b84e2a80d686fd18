"""Who computes what when, and on which GPU: the 1F1B and GPipe orders and the stage-to-GPU placements,
kept apart from the engine so the closed forms they encode can be read (and tested) on their own."""

from __future__ import annotations

from qft.errors import QftError
from qft.tools.simulate.inputs import Server


def schedule_order(schedule: str, m: int, p: int, s: int) -> list:
    """The compute order of stage `s` of `p` over `m` micro-batches under `schedule`: [("F", i) | ("B", i)]; 1F1B:
    p-s-1 warm-up forwards, then F/B pairs."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    w = min(p - s - 1, m)
    ops = [("F", i) for i in range(w)]
    for k in range(m - w):
        ops += [("F", w + k), ("B", k)]
    return ops + [("B", i) for i in range(m - w, m)]


def inflight(schedule: str, m: int, p: int, s: int) -> int:
    """The micro-batches whose activations stage `s` of `p` holds at once under `schedule`: min(`m`, p - s) in 1F1B,
    m in GPipe."""
    return m if schedule == "gpipe" else min(m, p - s)


def placement_of(placement, p: int, server: Server) -> list:
    """The GPU of each of `p` stages on `server` under `placement`: 'pipeline', stage s on GPU s; 'mirror', stage k
    paired with stage p-1-k, so a heavy early stage relays through a light late one."""
    if placement == "pipeline":
        if p > server.n_gpus:
            raise QftError("workload.stages", p, f"at most server.n_gpus={server.n_gpus} stages")
        return list(range(p))
    if placement == "mirror":
        if p % 2 or p // 2 > len(server.nvlink_pairs):
            raise QftError("placement", placement, f"'mirror' needs an even number of stages <= 2 x "
                           f"{len(server.nvlink_pairs)} NVLink pairs (got {p} stages)")
        gpus = [0] * p
        for k in range(p // 2):
            gpus[k], gpus[p - 1 - k] = server.nvlink_pairs[k]
        return gpus
    gpus = list(placement) if isinstance(placement, (list, tuple)) else None
    if (gpus is None or len(gpus) != p or len(set(gpus)) != p
            or any(isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < server.n_gpus for g in gpus)):
        raise QftError("placement", placement, f"'pipeline', 'mirror' or a list of {p} distinct GPU indices "
                       f"in [0, {server.n_gpus - 1}]")
    return gpus
