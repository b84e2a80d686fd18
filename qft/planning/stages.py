"""Where a pipeline cuts the decoder: stage boundaries balanced on per-stage peak memory, from the memory model.

Balanced on peak memory (fixed bytes plus the activations of the micro-batches a stage holds in flight), not on
parameter counts, which a 4-bit base makes meaningless; with a per-device budget it also picks the stages whose
activations go to host memory. Planning only: qft.pipeline runs the stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qft.planning import footprint
from qft import layers as L
from qft.errors import QftError
from qft.planning.footprint import GiB


def in_flight(stage: int, stages: int, micro_batches: int, schedule: str) -> int:
    """The micro-batches of activations stage `stage` of `stages` holds at its peak under `schedule` (1f1b: up to
    min(`micro_batches`, stages - stage); gpipe: all)."""
    return micro_batches if schedule == "gpipe" else min(micro_batches, stages - stage)


def stage_peaks(cfg, boundaries, schedule: str | None = None, micro_batches: int | None = None,
                offload_stages=(), *, resolved: footprint.Resolved | None = None, host: list | None = None) -> list[int]:
    """The peak device bytes of each stage of config `cfg` split at `boundaries` (each later stage's first layer),
    run by `schedule` over `micro_batches`, the `offload_stages` keeping activations on the host; `resolved`: a
    footprint.Resolved to reuse; `host`, a list, receives each stage's host bytes. The first stage holds the
    embedding, the last the head (and a tied embedding's copy)."""
    p = resolved or footprint.resolve(cfg)
    schedule = schedule or p.offload["schedule"]
    m = micro_batches or (p.offload["micro_batches"] if p.offload["mode"] == "pipeline" else 1)
    if p.batch % m:
        raise QftError("offload.micro_batches", m, f"must divide train.batch_size={p.batch}")
    costs = footprint.layer_costs(cfg, p.batch // m, resolved=p)
    edges = [0, *boundaries, len(costs) - 2]
    if any(a >= b for a, b in zip(edges, edges[1:])):
        raise QftError("offload.split", list(boundaries), f"increasing layer indices in 1..{len(costs) - 3}")
    peaks = []
    for s in range(len(edges) - 1):
        comps = stage_components(p, costs, edges, s, m, schedule, s in offload_stages)
        peaks.append(sum(v for k, v in comps.items() if k != HOST))
        if host is not None:
            host.append(comps.get(HOST, 0))
    return peaks


HOST = "host memory: offloaded activations"  # reported beside a stage's components, not in its peak


def stage_components(p: footprint.Resolved, costs, edges, s: int, m: int, schedule: str, offloaded: bool) -> dict:
    """{component: bytes} on the device of stage `s` (plus HOST) for Resolved `p`, `costs`, stage `edges`, `m`
    micro-batches, `schedule`, `offloaded`: what stage_peaks sums and the table shows."""

    embed, layers, head = costs[0], costs[1:-1], costs[-1]
    n_stages = len(edges) - 1
    mine, last = layers[edges[s]:edges[s + 1]], s == n_stages - 1
    n = in_flight(s, n_stages, m, schedule)
    out: dict = {}

    def add(key, v):
        out[key] = out.get(key, 0) + int(v)

    other = "frozen other (norms, embedding, head)"
    for c in mine:
        for k, v in c.detail.items():
            if k.startswith("weights."):
                add(f"frozen {k[8:].replace('.', ' ', 1)}", v)
        add(other, c.detail["frozen.other"])
        add("adapter weights (fp32)", c.detail["adapter"])
        add("adapter gradients (fp32)", c.detail["grads"])
        add(f"optimizer states ({p.optimizer})", c.detail["optimizer"])
    if s == 0 or (last and n_stages > 1 and p.tied):  # a tied head needs the embedding on the last stage too
        add(other, embed.fixed)
    if last:
        add(other, head.fixed)
    if offloaded:
        held = n * sum(c.act for c in mine)
        add("activations: one layer on the device (the rest in host memory)", max(c.act for c in mine))
        if p.device == "cpu":  # host memory is the device's: the copies save nothing
            add("activations in host memory (on a CPU, the same memory)", held)
        add(HOST, held)
    else:
        times = f" x {n} micro-batches" if n > 1 else ""
        for c in mine:
            for k, label in (("act.attn", "activations attn"), ("act.mlp", "activations mlp"),
                             ("act.inputs", "activations: layer inputs (checkpointing)"),
                             ("act.int8_inputs", "activations: int8 inputs bitsandbytes keeps")):
                add(label + times, n * c.detail.get(k, 0))
    add("activations: rotary tables", n * embed.act)
    if last:
        add(f"logits and LM head copy ({p.answer + 1} positions)", n * head.act)
    add("transient working set", max([c.work for c in mine] + [head.work if last else 0]))
    return {k: v for k, v in out.items() if v}


@dataclass
class Plan:
    """A pipeline split: boundaries, offloaded stages, estimated peaks and each stage's layers."""

    boundaries: list  # first layer of each stage after the first
    offloaded: list  # stages whose saved activations live in host memory
    peaks: list  # estimated bytes per stage
    layers: list = field(default_factory=list)  # [lo, hi) per stage


def _peak(fixed, act, lo, hi, s, p, m, schedule, off, ends, work=None) -> float:
    """The peak bytes of stage `s` of `p` holding layers [`lo`, `hi`): their `fixed` bytes, `act` times the
    micro-batches in flight (one if `off`), the largest `work`, and the `ends` (embedding, head) at the ends."""
    n_act = 1 if off else in_flight(s, p, m, schedule)
    total = sum(fixed[lo:hi]) + n_act * sum(act[lo:hi]) + (max(work[lo:hi]) if work else 0)
    if s == 0:
        total += ends[0]
    if s == p - 1:
        total += ends[1]
    return total


def balance(fixed, act, stages: int, micro_batches: int, schedule: str, ends=(0.0, 0.0),
            offloaded=(), work=None) -> tuple[list, list]:
    """(boundaries, peaks) of the contiguous split of the layers (`fixed`, `act`, `work` a layer) into `stages` that
    minimises the largest stage peak by exact DP, with `micro_batches`, `schedule`, `ends`, `offloaded` as _peak
    takes them; raises QftError (offload.stages) beyond the layer count."""
    n = len(fixed)
    if n < stages:
        raise QftError("offload.stages", stages, f"at most the number of decoder layers ({n})")
    inf = float("inf")
    # best[s][i]: smallest max-peak of stages 0..s-1 covering layers [0, i)
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                if best[s - 1][j] == inf:
                    continue
                v = max(best[s - 1][j], _peak(fixed, act, j, i, s - 1, stages, micro_batches, schedule,
                                              s - 1 in offloaded, ends, work))
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    bounds, i = [], n
    for s in range(stages, 0, -1):
        i = cut[s][i]
        bounds.append(i)
    bounds = sorted(bounds)[1:]
    return bounds, peaks_of(fixed, act, bounds, micro_batches, schedule, ends, offloaded, work)


def uniform(n: int, stages: int) -> list:
    """The boundaries that cut `n` layers into `stages` near-equal runs."""
    return [round(n * s / stages) for s in range(1, stages)]


def peaks_of(fixed, act, bounds, micro_batches, schedule, ends=(0.0, 0.0), offloaded=(), work=None) -> list:
    """The _peak of each stage of the split at `bounds` of layers `fixed`, `act`, `work`, with `micro_batches`,
    `schedule`, `ends` and `offloaded` stages."""
    edges = [0, *bounds, len(fixed)]
    p = len(edges) - 1
    return [_peak(fixed, act, edges[s], edges[s + 1], s, p, micro_batches, schedule, s in offloaded, ends, work)
            for s in range(p)]


def plan_split(fixed, act, stages: int, micro_batches: int, schedule: str, ends=(0.0, 0.0), split="memory",
               budget: float | None = None, offload_stages="auto", work=None) -> Plan:
    """The Plan for `split` (memory, uniform or a list) of layers `fixed`, `act`, `work` into `stages`, with
    `micro_batches`, `schedule`, `ends`; with `budget` bytes and `offload_stages` "auto", the fewest, earliest stages
    offloaded that let it fit. Raises QftError (offload.device_budget_gb) where nothing fits."""
    n = len(fixed)

    def split_for(off):
        if split == "uniform":
            b = uniform(n, stages)
            return b, peaks_of(fixed, act, b, micro_batches, schedule, ends, off, work)
        if split == "memory":
            return balance(fixed, act, stages, micro_batches, schedule, ends, off, work)
        b = list(split)
        if len(b) != stages - 1 or b != sorted(b) or len(set(b)) != len(b) or not all(0 < x < n for x in b):
            raise QftError("offload.split", split, f"memory, uniform, or {stages - 1} increasing layer indices "
                                                   f"in 1..{n - 1}")
        return b, peaks_of(fixed, act, b, micro_batches, schedule, ends, off, work)

    if offload_stages != "auto":
        off = sorted(offload_stages)
        if any(not isinstance(s, int) or not 0 <= s < stages for s in off):
            raise QftError("offload.offload_stages", offload_stages, f"auto or stage indices in 0..{stages - 1}")
        candidates = [off]
    elif budget is None:
        candidates = [[]]
    else:
        candidates = [list(range(k)) for k in range(stages + 1)]
    for off in candidates:
        bounds, peaks = split_for(off)
        if budget is None or max(peaks) <= budget:
            edges = [0, *bounds, n]
            return Plan(bounds, off, peaks, [[edges[s], edges[s + 1]] for s in range(stages)])
    smallest = max(split_for(candidates[-1])[1])
    raise QftError("offload.device_budget_gb", round(budget / GiB, 3),
                   f"too small for {stages} stages even with {'every' if offload_stages == 'auto' else 'the listed'}"
                   f" stage offloaded; the smallest budget that fits is {smallest / GiB:.3f} GiB "
                   f"(or use more stages)")


def plan(cfg, model_type: str = "llama") -> Plan:
    """The Plan of composed config `cfg` for a `model_type` decoder, from the memory model (no weights); raises
    QftError (offload.mode) where the registry cannot stage that architecture."""
    staged = sorted(n for n, a in L.REGISTRY.items() if a.pipeline)
    if model_type not in staged:
        raise QftError("offload.mode", "pipeline", f"supports {', '.join(staged)} decoders (the registry in "
                                                   f"qft/layers.py); this model is {model_type}")

    resolved = footprint.resolve(cfg)
    costs = footprint.layer_costs(cfg, resolved=resolved)
    layers = [c for c in costs if c.name.startswith("layer.")]
    embed, head = costs[0], costs[-1]  # the head's logits are held per micro-batch only while it runs
    # a tied head is the embedding matrix, which the last stage then holds as well as the first
    ends = (embed.fixed, head.fixed + head.act + head.work + (embed.fixed if resolved.tied else 0))
    o = cfg.offload
    split = o.split if isinstance(o.split, str) else list(o.split)  # offload.check allowed the words and lists
    budget = None if o.device_budget_gb is None else o.device_budget_gb * GiB
    stages_off = o.offload_stages if isinstance(o.offload_stages, str) else list(o.offload_stages)
    return plan_split([c.fixed for c in layers], [c.act for c in layers], o.stages, o.micro_batches, o.schedule,
                      ends, split, budget, stages_off, [c.work for c in layers])
