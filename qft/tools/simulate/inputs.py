"""What the simulator is given (a server, a workload, a policy) and what it returns, as frozen dataclasses
checked on construction, so every later stage can trust them."""

from __future__ import annotations

from dataclasses import dataclass, field

from qft.tools.simulate.checks import check_policy, check_server, check_workload

GB = 1e9
GiB = 2**30


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
        check_server(self)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage's cost per micro-batch; measured numbers can stand here instead of a model shape."""

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
        check_workload(self, Stage)


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
        check_policy(self)


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
