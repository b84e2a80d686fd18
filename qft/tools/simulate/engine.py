"""The event loop: compute streams, links and per-GPU memory of one pipeline step, advanced event by event,
because overlapped copies, shared links and memory waits interact in ways no closed form follows."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections import deque

from qft.tools.simulate.inputs import Event, Policy, Result, Server, Workload
from qft.tools.simulate.schedules import schedule_order

RELAY_SLOTS = 4  # chunks that may be staged on a relay GPU between their two hops, all flows together


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


class Run:
    """One training step under one policy, simulated once: the clock, the event heap, every link and each
    GPU's memory and each stage's progress live here, because the callbacks of concurrent flows and compute
    streams all read and change them. Build one per (plan, fractions) and call `simulate` once."""

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
        p = self.p
        self.order = [schedule_order(work.schedule, self.m, p, s) for s in range(p)]
        self.adjacent = [{i for (k, i), nxt in zip(o, o[1:]) if k == "F" and nxt == ("B", i)} for o in self.order]
        self.share = _neighbour_shares(self, policy) if policy.kind == "neighbour" else [0.0] * p
        for s in range(p):
            if self.share[s] > 0 and self.gpus[s] in self.partner:
                self.reserve[self.partner[self.gpus[s]]] = RELAY_SLOTS * self.chunk
        self.pos = [0] * p  # next op of each stage's order
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
        w, pol, p = self.work, self.pol, self.p
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


def _neighbour_shares(run: Run, pol: Policy) -> list:
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
