"""Discrete-event simulator of pipeline-parallel fine-tuning with activation offload.

Why it exists: Liu, Lai, Li (HPCC 2023 / CIBDA 2024) balance the memory of a 1F1B pipeline by offloading
early stages' activations to host memory, routing part of the copies through an NVLink-bridged neighbour's
PCIe link, and report 2.04x-3.59x over PyTorch's synchronous offloading. This module predicts what each
policy costs in step time and buys in peak memory on a described server, from first principles, before any
GPU is booked: compute streams, PCIe/NVLink links (one FIFO per direction, chunked so concurrent flows
interleave) and per-GPU memory are simulated event by event.

    python -m qft.simulate rtx3090x4 --model llama2-7b --seq-len 2048 --micro-batches 16
    python -m qft.simulate my_server.yaml --out results/pipeline_offload/mine
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import heapq
import itertools
import math
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from qft.errors import QftError, fail

POLICIES = ("none", "sync", "overlap", "neighbour")
SCHEDULES = ("1f1b", "gpipe")
PLACEMENTS = ("pipeline", "mirror")
GB = 1e9
AUTO_ROUNDS = 6  # re-simulations that raise an 'auto' fraction where the first estimate does not fit
RELAY_SLOTS = 4  # chunks that may be staged on a relay GPU between their two hops, all flows together
GiB = 2**30


# ----------------------------------------------------------------------------------------------- inputs

@dataclass(frozen=True)
class Server:
    """GPUs, their host links and NVLink bridges. Bandwidths in bytes/s per direction."""

    n_gpus: int
    gpu_memory_bytes: float
    pcie_bandwidth: float
    nvlink_pairs: tuple = ()
    nvlink_bandwidth: float = 0.0
    shared_uplink: bool = False  # the two GPUs of a pair share one PCIe uplink (a switch per pair)
    pcie_latency_s: float = 10e-6
    nvlink_latency_s: float = 5e-6
    name: str = "custom"

    def __post_init__(self):
        object.__setattr__(self, "nvlink_pairs", tuple(tuple(p) for p in self.nvlink_pairs))
        _check_server(self)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage's cost per micro-batch; pass measured numbers here instead of a model shape."""

    fwd_s: float
    bwd_s: float
    act_bytes: float  # activations saved for backward, per micro-batch
    fixed_bytes: float  # weights + adapter + grads + optimizer states + runtime overhead
    boundary_bytes: float = 0.0  # activation sent to the next stage per micro-batch (its gradient comes back)


@dataclass(frozen=True)
class Workload:
    stages: tuple
    micro_batches: int
    schedule: str = "1f1b"
    tokens_per_step: int | None = None
    name: str = "custom"

    def __post_init__(self):
        object.__setattr__(self, "stages", tuple(self.stages))
        _check_workload(self)


@dataclass(frozen=True)
class Policy:
    """What to offload and how. stages=None offloads the stages whose activations would not fit."""

    kind: str = "none"
    stages: tuple | None = None
    fraction: float | str = 1.0  # of each micro-batch's activation bytes; "auto": just enough to fit
    neighbour_share: float | None = None  # of the offloaded bytes sent via the neighbour; None: balance the pair
    copy_efficiency: float = 1.0  # fraction of link bandwidth the copies reach (pageable memory < 1)

    def __post_init__(self):
        if self.stages is not None:
            object.__setattr__(self, "stages", tuple(self.stages))
        _check_policy(self)


@dataclass(frozen=True)
class Event:
    stage: int
    kind: str  # F, B (compute); offload, prefetch, act, grad (copies)
    micro_batch: int
    start: float
    end: float
    resource: str  # "compute" or a link name such as pcie0.d2h, nvlink0>1


@dataclass
class Result:
    policy: str
    makespan: float
    peak_memory: list  # per stage, bytes on its GPU: fixed + resident activations + buffers + relayed chunks
    peak_inflight: list  # per stage, micro-batches between forward start and backward end
    fixed_bytes: list
    fits: list
    compute_busy: list  # per stage, seconds of F/B compute
    link_busy: dict  # link name -> seconds busy
    bubble_fraction: float  # idle share of the compute streams over the step
    offload_stages: list
    fractions: list
    gpu_of_stage: list
    timeline: list = field(repr=False)


# ----------------------------------------------------------------------------------------------- checks

def _number(key, value, lo=0.0, lo_open=True, allow_inf=True, integer=False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if ok and integer:
        ok = float(value).is_integer() and not math.isinf(value)
    if ok and not allow_inf:
        ok = not math.isinf(value)
    if ok:
        ok = value > lo if lo_open else value >= lo
    if not ok:
        kind = "an integer" if integer else "a number"
        raise QftError(key, value, f"{kind} {'>' if lo_open else '>='} {lo:g}")


def _check_server(s: Server):
    _number("server.n_gpus", s.n_gpus, 1, lo_open=False, integer=True)
    _number("server.gpu_memory_bytes", s.gpu_memory_bytes)
    _number("server.pcie_bandwidth", s.pcie_bandwidth)
    _number("server.pcie_latency_s", s.pcie_latency_s, lo_open=False, allow_inf=False)
    _number("server.nvlink_latency_s", s.nvlink_latency_s, lo_open=False, allow_inf=False)
    if not isinstance(s.shared_uplink, bool):
        raise QftError("server.shared_uplink", s.shared_uplink, "true or false")
    seen = set()
    for p in s.nvlink_pairs:
        if (len(p) != 2 or any(isinstance(g, bool) or not isinstance(g, int) for g in p) or p[0] == p[1]
                or any(not 0 <= g < s.n_gpus for g in p) or seen & set(p)):
            raise QftError("server.nvlink_pairs", [list(q) for q in s.nvlink_pairs],
                           f"pairs of distinct GPU indices in [0, {s.n_gpus - 1}], each GPU in at most one pair")
        seen |= set(p)
    if s.nvlink_pairs:
        _number("server.nvlink_bandwidth", s.nvlink_bandwidth)


def _check_workload(w: Workload):
    if not w.stages:
        raise QftError("workload.stages", [], "at least one stage")
    for i, st in enumerate(w.stages):
        if not isinstance(st, Stage):
            raise QftError(f"workload.stages[{i}]", st, "a Stage")
        for f in dataclasses.fields(Stage):
            _number(f"workload.stages[{i}].{f.name}", getattr(st, f.name), lo_open=False, allow_inf=False)
    _number("workload.micro_batches", w.micro_batches, 1, lo_open=False, integer=True)
    if w.schedule not in SCHEDULES:
        raise QftError("workload.schedule", w.schedule, f"allowed: {', '.join(SCHEDULES)}")


def _check_policy(p: Policy):
    if p.kind not in POLICIES:
        raise QftError("policy.kind", p.kind, f"allowed: {', '.join(POLICIES)}")
    if p.stages is not None and any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in p.stages):
        raise QftError("policy.stages", list(p.stages), "stage indices >= 0, or null for the stages that do not fit")
    if p.fraction != "auto":
        if isinstance(p.fraction, bool) or not isinstance(p.fraction, (int, float)) or not 0 <= p.fraction <= 1:
            raise QftError("policy.fraction", p.fraction, "a fraction in [0, 1], or 'auto'")
    if p.neighbour_share is not None and (isinstance(p.neighbour_share, bool)
                                          or not isinstance(p.neighbour_share, (int, float))
                                          or not 0 <= p.neighbour_share <= 1):
        raise QftError("policy.neighbour_share", p.neighbour_share, "a fraction in [0, 1], or null to balance the pair")
    if isinstance(p.copy_efficiency, bool) or not isinstance(p.copy_efficiency, (int, float)) \
            or not 0 < p.copy_efficiency <= 1:
        raise QftError("policy.copy_efficiency", p.copy_efficiency, "a fraction in (0, 1]")


# ----------------------------------------------------------------------------------------------- schedules

def schedule_order(schedule: str, m: int, p: int, s: int) -> list:
    """The compute order of stage s: [("F", i) | ("B", i)]. 1F1B: p-s-1 warm-up forwards, then F/B pairs."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    w = min(p - s - 1, m)
    ops = [("F", i) for i in range(w)]
    for k in range(m - w):
        ops += [("F", w + k), ("B", k)]
    return ops + [("B", i) for i in range(m - w, m)]


def inflight(schedule: str, m: int, p: int, s: int) -> int:
    """Micro-batches whose activations stage s holds at once: min(m, p - s) in 1F1B, m in GPipe."""
    return m if schedule == "gpipe" else min(m, p - s)


def placement_of(placement, p: int, server: Server) -> list:
    """Stage -> GPU. 'pipeline': stage s on GPU s (neighbour stages bridged); 'mirror': stage k shares a pair
    with stage p-1-k, so a heavy early stage relays through a light late one (at the price of PCIe hops)."""
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


# ----------------------------------------------------------------------------------------------- engine

class _Link:
    """One direction of one physical link: serves one chunk at a time, first come first served."""

    def __init__(self, name, bandwidth, latency):
        self.name, self.bw, self.lat = name, bandwidth, latency
        self.queue = deque()
        self.busy = False
        self.busy_s = 0.0

    def put(self, run, nbytes, efficiency, tag, done):
        self.queue.append((nbytes, efficiency, tag, done))
        if not self.busy:
            self._next(run)

    def _next(self, run):
        nbytes, eff, tag, done = self.queue.popleft()
        dur = self.lat + nbytes / (self.bw * eff)
        self.busy = True
        self.busy_s += dur
        run.record(tag, run.now, run.now + dur, self.name)
        run.at(run.now + dur, self._finish, run, done)

    def _finish(self, run, done):
        self.busy = False
        if self.queue:  # start the waiting chunk first, so a follow-up chunk of `done`'s flow queues behind it
            self._next(run)
        done()


class _Run:
    def __init__(self, server: Server, work: Workload, policy: Policy, gpus: list, chunk_bytes: float,
                 chosen: set, frac: list):
        self.srv, self.work, self.pol, self.gpus, self.chunk = server, work, policy, gpus, chunk_bytes
        self.offl_stages, self.frac = chosen, list(frac)
        self.p, self.m = len(work.stages), work.micro_batches
        self.now, self.heap, self.seq, self.events, self._last = 0.0, [], itertools.count(), [], {}
        self.mem = [0.0] * server.n_gpus
        self.mem_peak = [0.0] * server.n_gpus
        self.mem_wait = [[] for _ in range(server.n_gpus)]
        self.draining = [0] * server.n_gpus
        self.relay_staged = [0] * server.n_gpus
        self.relay_wait = [[] for _ in range(server.n_gpus)]
        self.reserve = [0.0] * server.n_gpus  # headroom a relay GPU keeps for staged chunks
        self.partner = {}
        for a, b in server.nvlink_pairs:
            self.partner[a], self.partner[b] = b, a
        self.links = {}
        self._make_links()
        self.stage_on_gpu = {g: s for s, g in enumerate(gpus)}

    # -- plumbing
    def at(self, t, fn, *args, late=False):
        """Schedule fn(*args) at t; `late` ones run after everything else due at t, so zero-time copies
        settle before the next compute starts."""
        heapq.heappush(self.heap, (t, late, next(self.seq), fn, args))

    def record(self, tag, start, end, resource):
        """Append a busy interval; back-to-back chunks of one flow on one link merge into one event."""
        last = self._last.get(resource)
        if last is not None and last[0] == tag and abs(self.events[last[1]].end - start) < 1e-12:
            self.events[last[1]] = dataclasses.replace(self.events[last[1]], end=end)
            return
        self.events.append(Event(tag[0], tag[1], tag[2], start, end, resource))
        self._last[resource] = (tag, len(self.events) - 1)

    def alloc(self, gpu, nbytes):
        self.mem[gpu] += nbytes
        self.mem_peak[gpu] = max(self.mem_peak[gpu], self.mem[gpu])

    def free(self, gpu, nbytes):
        self.mem[gpu] -= nbytes
        self.wake(gpu)

    def wake(self, gpu):
        if self.mem_wait[gpu]:
            waiting, self.mem_wait[gpu] = self.mem_wait[gpu], []
            for fn in waiting:
                self.at(self.now, fn, late=True)

    def no_room(self, s, nbytes) -> bool:
        """An allocation waits for memory only while offloads from (or relays through) its GPU are still
        draining; with nothing in flight it goes ahead and the stage is reported as not fitting."""
        g = self.gpus[s]
        cap = self.srv.gpu_memory_bytes - self.reserve[g]
        return self.draining[g] > 0 and self.work.stages[s].fixed_bytes + self.mem[g] + nbytes > cap + 1e-6

    def _make_links(self):
        s = self.srv
        for g in range(s.n_gpus):
            if s.shared_uplink and g in self.partner:
                a, b = sorted((g, self.partner[g]))
                name = f"pcie{a}+{b}"
            else:
                name = f"pcie{g}"
            for d in ("d2h", "h2d"):
                key = f"{name}.{d}"
                self.links.setdefault(key, _Link(key, s.pcie_bandwidth, s.pcie_latency_s))
                self.links[(g, d)] = self.links[key]
        for a, b in s.nvlink_pairs:
            for x, y in ((a, b), (b, a)):
                self.links[(x, ">", y)] = _Link(f"nvlink{x}>{y}", s.nvlink_bandwidth, s.nvlink_latency_s)

    def flow(self, path, nbytes, tag, done, hop_done=None, efficiency=1.0, relay=None):
        """Move nbytes along a path of links in chunks, store-and-forward per chunk. A flow keeps one chunk on
        its first link at a time, so concurrent flows on a link interleave (a fair share, roughly); a two-hop
        flow staged on a `relay` GPU holds one of its RELAY_SLOTS per chunk there, so the relay buffers little."""
        if nbytes <= 0 or not path:
            self.at(self.now, done)
            return
        n = max(1, math.ceil(nbytes / self.chunk))
        size = nbytes / n
        st = {"next": 0, "first_busy": False, "left": n, "waiting": False}

        def send(k, h):
            path[h].put(self, size, efficiency, tag, lambda: arrived(k, h))

        def pump():
            st["waiting"] = False
            if st["first_busy"] or st["next"] >= n:
                return
            if relay is not None:
                if self.relay_staged[relay] >= RELAY_SLOTS:
                    st["waiting"] = True
                    self.relay_wait[relay].append(pump)
                    return
                self.relay_staged[relay] += 1
            st["first_busy"] = True
            st["next"] += 1
            send(st["next"] - 1, 0)

        def arrived(k, h):
            if hop_done:
                hop_done(h, size)
            if h == 0:
                st["first_busy"] = False
            if h + 1 < len(path):
                send(k, h + 1)
            else:
                st["left"] -= 1
                if relay is not None:
                    self.relay_staged[relay] -= 1
                    waiting, self.relay_wait[relay] = self.relay_wait[relay], []
                    for fn in waiting:
                        self.at(self.now, fn)
                if not st["left"]:
                    done()
            if not st["waiting"]:
                pump()

        pump()

    def p2p_path(self, a, b):
        """GPU a -> GPU b: over the bridge if they are paired, else through host memory (GeForce cards have
        no PCIe peer-to-peer)."""
        if self.partner.get(a) == b:
            return [self.links[(a, ">", b)]]
        return [self.links[(a, "d2h")], self.links[(b, "h2d")]]

    # -- the run
    def simulate(self) -> Result:
        w, pol, p, m = self.work, self.pol, self.p, self.m
        self.order = [schedule_order(w.schedule, m, p, s) for s in range(p)]
        self.adjacent = [{i for (k, i), nxt in zip(o, o[1:]) if k == "F" and nxt == ("B", i)} for o in self.order]
        self.share = _neighbour_shares(self, pol) if pol.kind == "neighbour" else [0.0] * p
        for s in range(p):
            if self.share[s] > 0 and self.gpus[s] in self.partner:
                self.reserve[self.partner[self.gpus[s]]] = RELAY_SLOTS * self.chunk
        self.pos = [0] * p
        self.busy = [False] * p
        self.have_act = [set() for _ in range(p)]
        self.have_grad = [set() for _ in range(p)]
        self.off_done = [set() for _ in range(p)]
        self.want = [set() for _ in range(p)]
        self.fetched = [set() for _ in range(p)]
        self.live = [0] * p
        self.live_peak = [0] * p
        self.compute_busy = [0.0] * p
        self.finished = 0
        for s in range(p):
            self.at(0.0, self.try_start, s)
        while self.heap:
            t, _, _, fn, args = heapq.heappop(self.heap)
            self.now = t
            fn(*args)
        if self.finished != p:
            raise RuntimeError(f"simulation stalled: {self.finished} of {p} stages finished")  # a bug, not input
        span = self.now
        stages = w.stages
        peak = [stages[s].fixed_bytes + self.mem_peak[self.gpus[s]] for s in range(p)]  # incl. relayed chunks
        busy_total = sum(self.compute_busy)
        return Result(
            policy=pol.kind, makespan=span, peak_memory=peak, peak_inflight=list(self.live_peak),
            fixed_bytes=[st.fixed_bytes for st in stages],
            fits=[x <= self.srv.gpu_memory_bytes * (1 + 1e-9) for x in peak], compute_busy=list(self.compute_busy),
            link_busy=_link_busy(self.links),
            bubble_fraction=1 - busy_total / (p * span) if span > 0 else 0.0,
            offload_stages=sorted(self.offl_stages), fractions=list(self.frac), gpu_of_stage=list(self.gpus),
            timeline=sorted(self.events, key=lambda e: (e.start, e.stage)))

    def offloads(self, s, i) -> bool:
        """Whether micro-batch i's activations on stage s leave the GPU. The overlapped policies keep one whose
        backward comes right after its forward (nothing to gain); save_on_cpu offloads everything."""
        if s not in self.offl_stages or self.frac[s] <= 0 or self.pol.kind == "none":
            return False
        if self.pol.kind == "sync":
            return True
        return i not in self.adjacent[s]

    def try_start(self, s):
        if self.busy[s] or self.pos[s] == len(self.order[s]):
            return
        kind, i = self.order[s][self.pos[s]]
        if kind == "F":
            if s > 0 and i not in self.have_act[s]:
                return
            if self.no_room(s, self.work.stages[s].act_bytes):
                self.mem_wait[self.gpus[s]].append(lambda: self.try_start(s))
                return
            self._begin(s)
            return
        if s < self.p - 1 and i not in self.have_grad[s]:
            return
        if self.offloads(s, i):
            if self.pol.kind == "sync":  # the compute stream copies back, then computes
                self._begin(s, sync_fetch=True)
                return
            if i not in self.want[s]:
                self.want_fetch(s, i)
            if i not in self.fetched[s]:
                return
        self._begin(s)

    def _begin(self, s, sync_fetch=False):
        kind, i = self.order[s][self.pos[s]]
        self.pos[s] += 1
        self.busy[s] = True
        if sync_fetch:
            self.fetch(s, i, lambda: self._compute(s, kind, i))
            return
        self._compute(s, kind, i)
        if self.pol.kind in ("overlap", "neighbour") and self.pos[s] < len(self.order[s]):
            nk, j = self.order[s][self.pos[s]]  # prefetch for the next backward, overlapping this op
            if nk == "B" and self.offloads(s, j) and j not in self.want[s]:
                self.want_fetch(s, j)

    def _compute(self, s, kind, i):
        st = self.work.stages[s]
        dur = st.fwd_s if kind == "F" else st.bwd_s
        if kind == "F":
            self.alloc(self.gpus[s], st.act_bytes)
            self.live[s] += 1
            self.live_peak[s] = max(self.live_peak[s], self.live[s])
        self.record((s, kind, i), self.now, self.now + dur, f"stage{s}")
        self.compute_busy[s] += dur
        self.at(self.now + dur, self._end, s, kind, i)

    def _end(self, s, kind, i):
        st, g = self.work.stages[s], self.gpus[s]
        if kind == "F":
            if s < self.p - 1:
                self.flow(self.p2p_path(g, self.gpus[s + 1]), st.boundary_bytes, (s, "act", i),
                          lambda: self._arrive(self.have_act, s + 1, i))
            if self.offloads(s, i):
                if self.pol.kind == "sync":
                    self.offload(s, i, lambda: self._free_stream(s))
                    return
                self.offload(s, i, lambda: self._offloaded(s, i))
        else:
            self.free(g, st.act_bytes)
            self.live[s] -= 1
            if s > 0:
                self.flow(self.p2p_path(g, self.gpus[s - 1]), self.work.stages[s - 1].boundary_bytes,
                          (s, "grad", i), lambda: self._arrive(self.have_grad, s - 1, i))
            if self.pos[s] == len(self.order[s]):
                self.finished += 1
        self._free_stream(s)

    def _free_stream(self, s):
        self.busy[s] = False
        self.at(self.now, self.try_start, s, late=True)

    def _arrive(self, box, s, i):
        box[s].add(i)
        self.at(self.now, self.try_start, s, late=True)

    def _offloaded(self, s, i):
        self.off_done[s].add(i)
        if i in self.want[s]:
            self.fetch(s, i, lambda: self._arrive(self.fetched, s, i))

    def want_fetch(self, s, i):
        self.want[s].add(i)
        if i in self.off_done[s]:
            self.fetch(s, i, lambda: self._arrive(self.fetched, s, i))

    def _split(self, s):
        """(own bytes, neighbour bytes, neighbour GPU) of one micro-batch's offload from stage s."""
        total = self.work.stages[s].act_bytes * self.frac[s]
        g = self.gpus[s]
        nb = self.partner.get(g)
        via = total * self.share[s] if nb is not None else 0.0
        return total - via, via, nb

    def offload(self, s, i, done):
        own, via, nb = self._split(s)
        g, eff = self.gpus[s], self.pol.copy_efficiency
        parts = [2]
        self.draining[g] += 1
        if via > 0:
            self.draining[nb] += 1

        def part():
            parts[0] -= 1
            if not parts[0]:
                self.draining[g] -= 1
                self.wake(g)
                if via > 0:
                    self.draining[nb] -= 1
                    self.wake(nb)
                done()

        self.flow([self.links[(g, "d2h")]], own, (s, "offload", i), part,
                  hop_done=lambda h, n: self.free(g, n), efficiency=eff)

        def relay(h, n):  # hop 0 leaves this GPU for the neighbour's memory, hop 1 leaves the neighbour
            if h == 0:
                self.free(g, n)
                self.alloc(nb, n)
            else:
                self.free(nb, n)

        path = [self.links[(g, ">", nb)], self.links[(nb, "d2h")]] if via > 0 else []
        self.flow(path, via, (s, "offload", i), part, hop_done=relay, efficiency=eff, relay=nb)

    def fetch(self, s, i, done):
        own, via, nb = self._split(s)
        g, eff = self.gpus[s], self.pol.copy_efficiency
        if self.no_room(s, own + via):
            self.mem_wait[g].append(lambda: self.fetch(s, i, done))
            return
        self.alloc(g, own + via)  # the buffer is allocated when the prefetch starts
        parts = [2]

        def part():
            parts[0] -= 1
            if not parts[0]:
                done()

        self.flow([self.links[(g, "h2d")]], own, (s, "prefetch", i), part, efficiency=eff)

        def relay(h, n):
            if h == 0:
                self.alloc(nb, n)
            else:
                self.free(nb, n)

        path = [self.links[(nb, "h2d")], self.links[(nb, ">", g)]] if via > 0 else []
        self.flow(path, via, (s, "prefetch", i), part, hop_done=relay, efficiency=eff, relay=nb)


def _link_busy(links) -> dict:
    out = {}
    for k, l in links.items():
        if isinstance(k, tuple):
            out.setdefault(l.name, l.busy_s)
    return dict(sorted(out.items()))


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


def _neighbour_shares(run: _Run, pol: Policy) -> list:
    """Share of each stage's offload routed via its NVLink partner. Given, or chosen so that the pair's two
    PCIe links carry equal bytes per step (nothing to gain when the pair shares one uplink)."""
    p, srv = run.p, run.srv
    if pol.neighbour_share is not None:
        return [float(pol.neighbour_share)] * p
    vol = [run.work.stages[s].act_bytes * run.frac[s] * sum(run.offloads(s, i) for i in range(run.m))
           for s in range(p)]
    shares = []
    for s in range(p):
        nb = run.partner.get(run.gpus[s])
        if nb is None or srv.shared_uplink or vol[s] <= 0:
            shares.append(0.0)
            continue
        t = run.stage_on_gpu.get(nb)
        other = vol[t] if t is not None else 0.0
        shares.append(max(0.0, (vol[s] - other) / (2 * vol[s])))
    return shares


def simulate(server: Server, workload: Workload, policy: Policy | str = "none", placement="pipeline",
             chunk_bytes: float = 64 * 2**20) -> Result:
    """One training step of `workload` on `server` under `policy`."""
    if isinstance(policy, str):
        policy = Policy(kind=policy)
    _number("chunk_bytes", chunk_bytes, allow_inf=False)
    gpus = placement_of(placement, len(workload.stages), server)
    chosen, frac = _offload_plan(server, workload, policy)
    res = _Run(server, workload, policy, gpus, chunk_bytes, chosen, frac).simulate()
    for _ in range(AUTO_ROUNDS if policy.fraction == "auto" else 0):  # the estimate may fall short: top up
        over = [s for s in chosen if not res.fits[s] and frac[s] < 1]
        if not over:
            break
        for s in over:
            st = workload.stages[s]
            k = max(1, inflight(workload.schedule, workload.micro_batches, len(workload.stages), s) - 2)
            frac[s] = min(1.0, frac[s] + (res.peak_memory[s] - server.gpu_memory_bytes) / (k * st.act_bytes) + 0.02)
        res = _Run(server, workload, policy, gpus, chunk_bytes, chosen, frac).simulate()
    return res


def compare(server: Server, workload: Workload, stages=None, fraction=1.0, neighbour_share=None,
            placement="pipeline", sync_efficiency: float = 1.0) -> dict:
    """The four policies on the same stages and fraction; sync copies at `sync_efficiency` of the bandwidth."""
    out = {}
    for kind in POLICIES:
        pol = Policy(kind=kind, stages=stages, fraction=fraction, neighbour_share=neighbour_share,
                     copy_efficiency=sync_efficiency if kind == "sync" else 1.0)
        out[kind] = simulate(server, workload, pol, placement)
    return out


def sweep(server: Server, workload: Workload, stages=None, placement="pipeline") -> list:
    """Speedups under the assumptions that decide them: compute speed (x1, x2), the baseline's copy bandwidth
    (pinned 1.0, pageable ~0.5), one PCIe uplink per GPU or per pair, and offloading all or just enough."""
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


# ----------------------------------------------------------------------------------------------- presets

def _rtx3090(n):
    # 24 GiB GDDR6X; PCIe 4.0 x16: 31.5 GB/s raw, ~25 GB/s measured pinned copies; NVLink bridge: 4 links,
    # 112.5 GB/s total, 56.25 GB/s per direction (NVIDIA spec), bridges join GPUs in pairs.
    return Server(n_gpus=n, gpu_memory_bytes=24 * GiB, pcie_bandwidth=25 * GB,
                  nvlink_pairs=tuple((i, i + 1) for i in range(0, n, 2)), nvlink_bandwidth=56 * GB,
                  name=f"rtx3090x{n}")


SERVERS = {"rtx3090x4": lambda: _rtx3090(4), "rtx3090x8": lambda: _rtx3090(8)}


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int


MODELS = {
    "llama2-7b": ModelShape("LLaMA-2-7B", 32, 4096, 32, 11008, 32000),
    "llama2-13b": ModelShape("LLaMA-2-13B", 40, 5120, 40, 13824, 32000),
}


def workload_from_model(model: str | ModelShape, stages: int, micro_batches: int, micro_batch_size: int = 1,
                        seq_len: int = 2048, schedule: str = "1f1b", tflops: float = 30e12,
                        bwd_ratio: float = 2.0, lora_rank: int = 16, flash_attention: bool = False,
                        base_bytes_per_param: float = 0.5 + 0.127 / 8, overhead_bytes: float = 1.0 * GiB
                        ) -> Workload:
    """Per-stage costs of a LLaMA-shaped model with an NF4 base and LoRA on all projections, from its shape.

    Forward FLOPs 2 * params * tokens + 4 b s^2 h per layer (attention), backward `bwd_ratio` x forward;
    activations s b h (34 + 5 a s / h) bytes per layer (Korthikanti et al. 2022, 16-bit, no recomputation;
    the 5as/h term is dropped with `flash_attention`); NF4 weights at 0.5 B/param + double-quant statistics,
    LoRA in fp32 with grads and Adam states (16 B/param), embeddings and head in bf16, plus `overhead_bytes`
    (CUDA context, workspaces) per GPU. The head's fp32 logits are activations of the last stage.
    """
    if isinstance(model, str):
        if model not in MODELS:
            raise QftError("model", model, f"allowed: {', '.join(MODELS)}")
        model = MODELS[model]
    _number("stages", stages, 1, lo_open=False, integer=True)
    if stages > model.layers:
        raise QftError("stages", stages, f"at most {model.layers} (the layers of {model.name})")
    _number("micro_batch_size", micro_batch_size, 1, lo_open=False, integer=True)
    _number("seq_len", seq_len, 1, lo_open=False, integer=True)
    _number("tflops", tflops, allow_inf=False)
    _number("bwd_ratio", bwd_ratio, allow_inf=False)
    _number("lora_rank", lora_rank, lo_open=False, integer=True)
    L, h, a, f, V = model.layers, model.hidden, model.heads, model.ffn, model.vocab
    b, s = micro_batch_size, seq_len
    tokens = b * s
    per_layer_params = 4 * h * h + 3 * h * f
    lora_params = lora_rank * (4 * 2 * h + 2 * (h + f) + (f + h))
    act_layer = s * b * h * (34 + (0 if flash_attention else 5 * a * s / h))
    fwd_layer = 2 * per_layer_params * tokens + 4 * b * s * s * h
    out = []
    for st in range(stages):
        n = L // stages + (1 if st >= stages - L % stages else 0)
        fwd = n * fwd_layer
        act = n * act_layer
        fixed = n * (per_layer_params * base_bytes_per_param + lora_params * 16) + overhead_bytes
        if st == 0:
            fixed += 2 * V * h  # embedding, bf16
        if st == stages - 1:
            fwd += 2 * tokens * h * V
            act += tokens * V * 4  # fp32 logits kept for the loss backward
            fixed += 2 * V * h  # head, bf16
        out.append(Stage(fwd_s=fwd / tflops, bwd_s=bwd_ratio * fwd / tflops, act_bytes=act, fixed_bytes=fixed,
                         boundary_bytes=2 * tokens * h))
    return Workload(stages=tuple(out), micro_batches=micro_batches, schedule=schedule,
                    tokens_per_step=tokens * micro_batches,
                    name=f"{model.name} NF4, b={b} s={s} m={micro_batches}, {stages} stages, {schedule}")


# ----------------------------------------------------------------------------------------------- loading

def _from_dict(cls, d: dict, key: str, convert=None):
    if not isinstance(d, dict):
        raise QftError(key, d, "a mapping")
    names = {f.name for f in dataclasses.fields(cls)}
    for k in d:
        if k not in names:
            raise QftError(f"{key}.{k}", d[k], f"allowed keys: {', '.join(sorted(names))}")
    d = {k: (float(v) if isinstance(v, str) and k not in ("name", "schedule", "kind") and _is_float(v) else v)
         for k, v in d.items()}  # YAML 1.1 reads 24e9 (no dot) as a string
    try:
        return cls(**(convert(d) if convert else d))
    except TypeError as e:
        raise QftError(key, d, str(e)) from None


def server_from_dict(d: dict) -> Server:
    def conv(x):
        x = dict(x)
        if "nvlink_pairs" in x:
            pairs = x["nvlink_pairs"]
            if not isinstance(pairs, (list, tuple)) or any(not isinstance(q, (list, tuple)) for q in pairs):
                raise QftError("server.nvlink_pairs", pairs, "a list of [gpu, gpu] pairs")
            x["nvlink_pairs"] = tuple(tuple(q) for q in pairs)
        return x
    return _from_dict(Server, d, "server", conv)


def _is_float(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False


def workload_from_dict(d: dict, stages: int | None = None) -> Workload:
    """Either {model: llama2-7b, micro_batches: 16, ...} (derived) or {stages: [{fwd_s: ...}, ...], ...}."""
    if not isinstance(d, dict):
        raise QftError("workload", d, "a mapping")
    if "model" in d:
        kw = dict(d)
        kw.setdefault("stages", stages)
        allowed = set(workload_from_model.__code__.co_varnames[:workload_from_model.__code__.co_argcount])
        for k in kw:
            if k not in allowed:
                raise QftError(f"workload.{k}", kw[k], f"allowed keys: {', '.join(sorted(allowed))}")
        return workload_from_model(**kw)
    st = d.get("stages")
    if not isinstance(st, list) or not st:
        raise QftError("workload.stages", st, "a list of {fwd_s, bwd_s, act_bytes, fixed_bytes[, boundary_bytes]}")
    stage_objs = tuple(_from_dict(Stage, x, f"workload.stages[{i}]") for i, x in enumerate(st))
    rest = {k: v for k, v in d.items() if k != "stages"}
    return _from_dict(Workload, {**rest, "stages": stage_objs}, "workload")


def load(path: str | Path) -> tuple:
    """A YAML file -> (Server, Workload or None). Either server keys at the top level, or server: / workload:."""
    import yaml

    try:
        d = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise QftError("server", str(path), f"a preset ({', '.join(SERVERS)}) or an existing YAML file") from None
    except yaml.YAMLError as e:
        raise QftError("server", str(path), f"valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(d, dict):
        raise QftError("server", str(path), "a YAML mapping")
    if "server" in d:
        extra = set(d) - {"server", "workload"}
        if extra:
            k = sorted(extra)[0]
            raise QftError(k, d[k], "allowed top-level keys: server, workload")
        return server_from_dict(d["server"]), (d.get("workload"))
    return server_from_dict(d), None


# ----------------------------------------------------------------------------------------------- report

def table_rows(results: dict, workload: Workload) -> list:
    base = results.get("sync")
    rows = []
    for kind, r in results.items():
        pcie = {k: v for k, v in r.link_busy.items() if k.startswith("pcie")}
        nv = {k: v for k, v in r.link_busy.items() if k.startswith("nvlink")}
        rows.append({
            "policy": kind,
            "step_s": round(r.makespan, 3),
            "speedup_vs_sync": round(base.makespan / r.makespan, 2) if base else None,
            "tokens_per_s": round(workload.tokens_per_step / r.makespan) if workload.tokens_per_step else None,
            "peak_gib_per_stage": " ".join(f"{x / GiB:.1f}" for x in r.peak_memory),
            "fits": all(r.fits),
            "bubble": round(r.bubble_fraction, 3),
            "offload_stages": ",".join(map(str, r.offload_stages)) or "-",
            "max_pcie_busy_s": round(max(pcie.values(), default=0.0), 3),
            "nvlink_busy_s": round(sum(nv.values()), 3),
        })
    return rows


def format_table(rows: list) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("" if r[c] is None else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


COLOURS = {"F": "#4c72b0", "B": "#55a868", "offload": "#dd8452", "prefetch": "#8172b3", "act": "#999999",
           "grad": "#666666"}


def plot_step_time(results: dict, path, title=""):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = list(results)
    vals = [results[k].makespan for k in names]
    bars = ax.bar(names, vals, color=["#999999", "#c44e52", "#dd8452", "#55a868"][:len(names)])
    for bar, r in zip(bars, results.values()):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{r.makespan:.2f}s"
                + ("" if all(r.fits) else "\n(OOM)"), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("step time (s)")
    ax.set_title(title, fontsize=8)
    ax.set_ylim(0, max(vals) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_peak_memory(results: dict, server: Server, path, title=""):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = list(results)
    p = len(next(iter(results.values())).peak_memory)
    width = 0.8 / len(names)
    for j, k in enumerate(names):
        ax.bar([s + (j - (len(names) - 1) / 2) * width for s in range(p)],
               [x / GiB for x in results[k].peak_memory], width, label=k)
    ax.axhline(server.gpu_memory_bytes / GiB, color="k", ls="--", lw=1, label="GPU memory")
    ax.set_xticks(range(p))
    ax.set_xlabel("stage")
    ax.set_ylabel("peak GPU memory (GiB)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_gantt(results: dict, path, kinds=("sync", "neighbour"), title=""):
    """One row per compute stream and per busy link, for each named policy, on a shared time axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    kinds = [k for k in kinds if k in results]
    rows_of = {}
    for k in kinds:
        res = results[k]
        rows = sorted({e.resource for e in res.timeline},
                      key=lambda r: (not r.startswith("stage"), r))
        rows_of[k] = rows
    span = max(results[k].makespan for k in kinds)
    fig, axes = plt.subplots(len(kinds), 1, figsize=(10, 0.25 * sum(len(r) for r in rows_of.values()) + 1.5),
                             squeeze=False)
    for ax, k in zip(axes[:, 0], kinds):
        rows = rows_of[k]
        y = {r: i for i, r in enumerate(rows)}
        for e in results[k].timeline:
            ax.barh(y[e.resource], e.end - e.start, left=e.start, height=0.8, color=COLOURS[e.kind], lw=0)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(rows, fontsize=6)
        ax.invert_yaxis()
        ax.set_xlim(0, span)
        ax.set_title(f"{k}: {results[k].makespan:.2f} s", fontsize=8)
    axes[-1, 0].set_xlabel("time (s)")
    fig.legend(handles=[Patch(color=c, label=n) for n, c in COLOURS.items()], loc="upper right", fontsize=7,
               ncol=6)
    if title:
        fig.suptitle(title, fontsize=8, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(rows: list, path, title=""):
    """Speedup of neighbour over sync per sweep row, against the band the paper reports (2.04x-3.59x)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.4))
    labels = [f"{r['compute']} bw{r['sync_copy_bw']:g} {r['uplink'].replace('per ', '')} f={r['fraction']}"
              for r in rows]
    ax.axhspan(2.04, 3.59, color="#55a868", alpha=0.15, label="paper: 2.04x-3.59x")
    ax.bar(range(len(rows)), [r["neighbour_vs_sync"] for r in rows], color="#4c72b0", label="neighbour / sync")
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=6)
    ax.set_ylabel("speedup over sync")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _write_csv(path, rows):
    with open(path, "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)


def write_outputs(results: dict, server: Server, workload: Workload, out: Path, header: str):
    out.mkdir(parents=True, exist_ok=True)
    rows = table_rows(results, workload)
    (out / "table.md").write_text(header + "\n\n" + format_table(rows) + "\n")
    _write_csv(out / "table.csv", rows)
    title = f"{server.name}: {workload.name}"
    plot_step_time(results, out / "step_time.png", title)
    plot_peak_memory(results, server, out / "peak_memory.png", title)
    plot_gantt(results, out / "gantt.png", title=title)


# ----------------------------------------------------------------------------------------------- CLI

class _Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"qft: error: {message}", file=sys.stderr)
        sys.exit(2)


def _parse_stages(text):
    if text in ("auto", None):
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise QftError("--offload-stages", text, "'auto' or comma-separated stage indices, e.g. 0,1") from None


def _parse_fraction(text):
    if text == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise QftError("--fraction", text, "a fraction in [0, 1], or 'auto'") from None


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m qft.simulate", description="Compare activation-offload policies for "
                 "pipeline-parallel fine-tuning on a described server (discrete-event simulation).")
    ap.add_argument("server", nargs="?", default="rtx3090x4", help=f"a preset ({', '.join(SERVERS)}) or a YAML file")
    ap.add_argument("--model", default=None, help=f"model shape ({', '.join(MODELS)}); default llama2-7b. A YAML "
                    "workload, if given, is used instead and the workload flags below are ignored, unless --model")
    ap.add_argument("--stages", type=int, default=None, help="pipeline stages (default: one per GPU)")
    ap.add_argument("--micro-batches", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--schedule", default="1f1b", help="1f1b or gpipe")
    ap.add_argument("--tflops", type=float, default=30.0, help="achieved TFLOP/s per GPU")
    ap.add_argument("--bwd-ratio", type=float, default=2.0, help="backward / forward compute time")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--flash", action="store_true", help="fused attention: drop the 5as/h activation term")
    ap.add_argument("--offload-stages", default="auto", help="'auto' (stages that do not fit) or e.g. 0,1")
    ap.add_argument("--fraction", default="1.0", help="fraction of activation bytes offloaded, or 'auto'")
    ap.add_argument("--neighbour-share", type=float, default=None, help="share routed via the NVLink neighbour "
                    "(default: balance the pair's PCIe bytes)")
    ap.add_argument("--placement", default="pipeline", help="pipeline (stage s on GPU s) or mirror")
    ap.add_argument("--shared-uplink", action="store_true", help="the GPUs of a pair share one PCIe uplink")
    ap.add_argument("--pcie-gbps", type=float, default=None, help="override PCIe GB/s per direction")
    ap.add_argument("--sync-efficiency", type=float, default=1.0,
                    help="share of PCIe bandwidth the synchronous baseline reaches (pageable memory < 1)")
    ap.add_argument("--sweep", action="store_true", help="also vary compute speed, baseline copy bandwidth, "
                    "uplink sharing and fraction; print (and with --out write sweep.md/csv) the speedups")
    ap.add_argument("--out", default=None, help="write table.md, table.csv and PNG plots here")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.server in SERVERS:
            server, wl_dict = SERVERS[args.server](), None
        else:
            server, wl_dict = load(args.server)
        if args.shared_uplink or args.pcie_gbps is not None:
            server = dataclasses.replace(server, shared_uplink=server.shared_uplink or args.shared_uplink,
                                         pcie_bandwidth=args.pcie_gbps * GB if args.pcie_gbps is not None
                                         else server.pcie_bandwidth)
        stages = args.stages if args.stages is not None else server.n_gpus
        if wl_dict is not None and args.model is None:
            work = workload_from_dict(wl_dict, stages)
        else:
            work = workload_from_model(args.model or "llama2-7b", stages, args.micro_batches,
                                       args.micro_batch_size, args.seq_len, args.schedule, args.tflops * 1e12,
                                       args.bwd_ratio, args.lora_rank, args.flash)
        placement = args.placement
        if placement not in PLACEMENTS:
            raise QftError("--placement", placement, f"allowed: {', '.join(PLACEMENTS)}")
        offload_stages = _parse_stages(args.offload_stages)
        results = compare(server, work, offload_stages, _parse_fraction(args.fraction),
                          args.neighbour_share, placement, args.sync_efficiency)
        sweep_rows = sweep(server, work, offload_stages, placement) if args.sweep else None
    except QftError as e:
        return fail("qft", e)
    st = work.stages
    header = (f"{server.name} ({server.n_gpus} GPUs, {server.gpu_memory_bytes / GiB:.0f} GiB, PCIe "
              f"{server.pcie_bandwidth / GB:.0f} GB/s{' shared per pair' if server.shared_uplink else ''}, "
              f"NVLink {server.nvlink_bandwidth / GB:.0f} GB/s pairs {list(map(list, server.nvlink_pairs))}); "
              f"{work.name}; placement {placement}\n\nper stage: fwd "
              + " ".join(f"{x.fwd_s:.3f}" for x in st) + " s, bwd " + " ".join(f"{x.bwd_s:.3f}" for x in st)
              + " s, activations " + " ".join(f"{x.act_bytes / GiB:.2f}" for x in st) + " GiB/micro-batch, fixed "
              + " ".join(f"{x.fixed_bytes / GiB:.2f}" for x in st) + " GiB")
    print(header + "\n")
    print(format_table(table_rows(results, work)))
    if sweep_rows:
        print("\n" + format_table(sweep_rows))
    if args.out:
        write_outputs(results, server, work, Path(args.out), header)
        print(f"\nwrote {args.out}/table.md, table.csv, step_time.png, peak_memory.png, gantt.png"
              + (", sweep.md, sweep.csv, sweep.png" if sweep_rows else ""))
        if sweep_rows:
            (Path(args.out) / "sweep.md").write_text(header + "\n\n" + format_table(sweep_rows) + "\n")
            _write_csv(Path(args.out) / "sweep.csv", sweep_rows)
            plot_sweep(sweep_rows, Path(args.out) / "sweep.png", f"{server.name}: {work.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
