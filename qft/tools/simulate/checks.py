"""The simulator's input rules, so a bad server, workload or policy fails at construction, naming its key,
rather than as a stalled or endless simulation. The shared checks of qft/errors.py where they say the rule;
`fraction` for the rule they cannot."""

from __future__ import annotations

import dataclasses

from qft.errors import QftError, boolean, integer, number, one_of

POLICIES = ("none", "sync", "overlap", "neighbour")
SCHEDULES = ("1f1b", "gpipe")
PLACEMENTS = ("pipeline", "mirror")


def fraction(key: str, value, zero: bool = True, also: str = "") -> None:
    """Raise QftError naming `key` unless `value` is a share in [0, 1] (in (0, 1] without `zero`); `also` names the
    non-numeric values the caller accepts, for the message."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not (0 <= value <= 1 if zero else 0 < value <= 1):
        raise QftError(key, value, f"a fraction in {'[' if zero else '('}0, 1]{also}")


def check_server(s) -> None:
    """Check inputs.Server `s`; raises QftError naming the server key."""
    integer("server.n_gpus", s.n_gpus, low=1)
    number("server.gpu_memory_bytes", s.gpu_memory_bytes, above=0, infinite=True)
    number("server.pcie_bandwidth", s.pcie_bandwidth, above=0, infinite=True)
    number("server.pcie_latency_s", s.pcie_latency_s, at_least=0)  # finite: an endless latency never ends a step
    number("server.nvlink_latency_s", s.nvlink_latency_s, at_least=0)
    boolean("server.shared_uplink", s.shared_uplink)
    seen = set()
    for p in s.nvlink_pairs:
        if (len(p) != 2 or any(isinstance(g, bool) or not isinstance(g, int) for g in p) or p[0] == p[1]
                or any(not 0 <= g < s.n_gpus for g in p) or seen & set(p)):
            raise QftError("server.nvlink_pairs", [list(q) for q in s.nvlink_pairs],
                           f"pairs of distinct GPU indices in [0, {s.n_gpus - 1}], each GPU in at most one pair")
        seen |= set(p)
    if s.nvlink_pairs:
        number("server.nvlink_bandwidth", s.nvlink_bandwidth, above=0, infinite=True)


def check_workload(w, stage_type: type) -> None:
    """Check inputs.Workload `w`, its stages of `stage_type` (inputs.Stage, passed in: inputs imports this module);
    raises QftError naming the workload key."""
    if not w.stages:
        raise QftError("workload.stages", [], "at least one stage")
    for i, st in enumerate(w.stages):
        if not isinstance(st, stage_type):
            raise QftError(f"workload.stages[{i}]", st, "a Stage")
        for f in dataclasses.fields(stage_type):
            number(f"workload.stages[{i}].{f.name}", getattr(st, f.name), at_least=0)
    integer("workload.micro_batches", w.micro_batches, low=1)
    one_of("workload.schedule", w.schedule, SCHEDULES)


def check_policy(p) -> None:
    """Check inputs.Policy `p`; raises QftError naming the policy key."""
    one_of("policy.kind", p.kind, POLICIES)
    if p.stages is not None and any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in p.stages):
        raise QftError("policy.stages", list(p.stages), "stage indices >= 0, or null for the stages that do not fit")
    if p.fraction != "auto":
        fraction("policy.fraction", p.fraction, also=", or 'auto'")
    if p.neighbour_share is not None:
        fraction("policy.neighbour_share", p.neighbour_share, also=", or null to balance the pair")
    fraction("policy.copy_efficiency", p.copy_efficiency, zero=False)
