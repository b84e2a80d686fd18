"""Projections that read one input (q/k/v; gate/up) run as one group: one cast of the input, one frozen matmul.

Each member keeps its own LoRA and its own autograd node, so losses and gradients keep their unfused bits wherever the
matmul library gives a column the same bits inside a wider output (tests/test_fuse.py). Other adapted projections
run as groups of one; peft's modules stay in place and a group steps aside when peft's state is not plain LoRA.
Why and how far it holds: docs/memory.md (`accel.fuse_projections`).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from qft import layers as L
from qft import quant
from qft.accel.probe import same_bits, spread


class _Member(torch.autograd.Function):
    """Member `i`'s frozen output of `x`, sliced from `group`'s matmul; backward is that member's own matmul.

    One node per member, made when it is called, so autograd sums the input gradient in the unfused order. With
    `box` (_Sum) it returns an empty stand-in and takes its gradient, already cast, through the box."""

    @staticmethod
    def forward(ctx, x, group, i, box=None, split=False):
        ctx.group, ctx.i, ctx.x_dtype, ctx.box, ctx.split = group, i, x.dtype, box, split
        lo, hi = group.slices[i]
        y = group.shared(x, "base", lambda: group.frozen(x, split))
        if box is not None:
            return x.new_empty(0)
        return y[..., lo:hi].to(x.dtype if group.cast_back else y.dtype, memory_format=torch.contiguous_format,
                                copy=True)

    @staticmethod
    def backward(ctx, grad):
        g = grad.to(ctx.group.dtype) if ctx.box is None else ctx.box.pop("grad")
        w = ctx.group.member_weight(ctx.i).to(g.dtype)
        return _linear(g, w.t(), None, ctx.split).to(ctx.x_dtype), None, None, None, None


class _Sum(torch.autograd.Function):
    """A member's output (frozen slice of `y` from `lo`, plus LoRA output `h` times `scale`), the same bits as peft's
    `result + lora_B(...) * scaling`, in one compiled pass forward and one backward (accel.compiled_sums).

    It stands where peft's add node stood, so autograd keeps its order."""

    @staticmethod
    def forward(ctx, stand_in, h, y, lo, scale, frozen_dtype, out_dtype, box):
        from qft.accel import kernels

        ctx.scale, ctx.frozen_dtype, ctx.h_dtype, ctx.box = scale, frozen_dtype, h.dtype, box
        return kernels.lora_sum(y, lo, h, scale, out_dtype)

    @staticmethod
    @once_differentiable  # the loops make no graph: a second derivative raises instead of coming out wrong
    def backward(ctx, grad):
        if ctx.frozen_dtype == ctx.h_dtype == torch.bfloat16 and grad.dtype == torch.float32:
            from qft.accel import kernels

            frozen, lora = kernels.lora_sum_grad(grad.contiguous(), ctx.scale)
        else:  # an fp32 or a bf16 sum: the same ops as peft's nodes, one pass either way
            frozen, lora = grad.to(ctx.frozen_dtype), grad.to(ctx.h_dtype) * ctx.scale
        if ctx.needs_input_grad[0]:  # else the input needs no gradient and the member's node never runs to take it
            ctx.box["grad"] = frozen
        return grad.new_empty(0), lora, None, None, None, None, None, None


class Group:
    """The projections `names` of module `parent` that read the same input, run as one group once installed."""

    def __init__(self, parent: nn.Module, names: tuple[str, ...]):
        self.parent, self.names = parent, names
        self.members = [getattr(parent, n) for n in names]
        self.bases = [m.get_base_layer() if hasattr(m, "get_base_layer") else m for m in self.members]
        self.backends = [quant.for_module(b) for b in self.bases]
        kinds = {b.fuse_kind(m) if b else None for b, m in zip(self.backends, self.bases)}
        self.kind = kinds.pop() if len(kinds) == 1 else None  # "stored", "computed" or None (runs unfused)
        sizes = [b.out_features for b in self.bases]
        self.slices = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
        self.dtype = self.backends[0].compute_dtype(self.bases[0]) if self.kind else None
        self.cast_back = self.kind is not None and self.backends[0].output_in_input_dtype
        self._cache: tuple | None = None  # (input, {what: tensor}, members done, its version): shared for one input
        self.compiled = False  # compile_sums: each member's output summed in one compiled pass (CPU)
        self.split_rows = False  # split_rows: a training step's frozen matmuls in two blocks of rows where that pays
        self.storage = None
        self.bias = None

    def fusable(self) -> bool:
        """Whether the members share a backend, fuse kind, compute dtype and input width (and can be computed here)."""
        if self.kind is None or len({b.in_features for b in self.bases}) != 1 or len(
                {type(k) for k in self.backends}) != 1:
            return False
        if any(k.compute_dtype(b) != self.dtype for k, b in zip(self.backends, self.bases)):
            return False
        return self.kind == "stored" or self._computable(self.bases[0].weight.device)

    def install(self) -> None:
        if self.kind == "stored":  # one storage, each projection's weight a view of it
            self.storage = torch.cat([b.weight.data for b in self.bases])
            for b, (lo, hi) in zip(self.bases, self.slices):
                b.weight = nn.Parameter(self.storage[lo:hi], requires_grad=False)
        biased = [b.bias for b in self.bases if b.bias is not None]
        if biased:  # a member without one adds zeros, made where the others' are (a CUDA group's on its GPU)
            self.bias = torch.cat([b.bias.data.to(self.dtype) if b.bias is not None
                                   else torch.zeros(b.out_features, dtype=self.dtype, device=biased[0].device)
                                   for b in self.bases])
        for i, m in enumerate(self.members):
            m.forward = self._caller(i, type(m).forward.__get__(m))

    def remove(self) -> None:
        for m in self.members:
            m.__dict__.pop("forward", None)
        if self.storage is not None:  # each projection owns its weight again
            for b in self.bases:
                b.weight = nn.Parameter(b.weight.data.clone(), requires_grad=False)
            self.storage = None

    def weight(self) -> torch.Tensor:
        if self.kind == "stored":
            return self.storage
        return torch.cat([k.fused_weight(b, self.dtype) for k, b in zip(self.backends, self.bases)])

    def frozen(self, x: torch.Tensor, split: bool = False) -> torch.Tensor:
        """Every member's frozen output side by side: one cast of the input, one matmul (in two blocks of rows where
        `split` allows and that pays)."""
        return _linear(x.to(self.dtype), self.weight(), self.bias, split)

    def member_weight(self, i: int) -> torch.Tensor:
        """What member i's own backward multiplies by: its stored weight, or its weight as its own backward
        makes it (for bitsandbytes 4-bit, the codes dequantized to fp32: qft.quant.dequantized_weight)."""
        b = self.bases[i]
        return b.weight if self.kind == "stored" else self.backends[i].weight(b)

    def shared(self, x: torch.Tensor, what: str, compute):
        """Work done once per input for the whole group (no autograd: each member's node does its own backward)."""
        if self._cache is None or self._cache[0] is not x or self._cache[3] != x._version:  # changed in place: anew
            self._cache = (x, {}, set(), x._version)
        done = self._cache[1]
        if what not in done:
            with torch.no_grad():
                done[what] = compute()
        return done[what]

    def _done(self, i: int) -> None:
        if self._cache is not None:
            self._cache[2].add(i)
            if len(self._cache[2]) == len(self.members):
                self._cache = None

    def _live(self, x: torch.Tensor) -> bool:
        if any(getattr(self.parent, n) is not m for n, m in zip(self.names, self.members)):
            return False
        if any(b.weight.device != x.device for b in self.bases) or (self.bias is not None
                                                                      and self.bias.device != x.device):
            return False
        if self.kind == "stored":
            return all(b.weight.data_ptr() == self.storage[lo:hi].data_ptr() and b.weight.shape == (hi - lo,
                       self.storage.shape[1]) for b, (lo, hi) in zip(self.bases, self.slices))
        return self._computable(x.device)

    def _computable(self, device: torch.device) -> bool:
        return all(k.fusable(b, device) for k, b in zip(self.backends, self.bases))

    def _plain_lora(self, m: nn.Module) -> bool:
        if not hasattr(m, "lora_A"):
            return True  # a projection without an adapter (rank 0)
        return (not m.merged and not m.disable_adapters and list(m.active_adapters) == ["default"]
                and "default" in m.lora_A and not m.lora_variant and getattr(m, "cast_input_dtype_enabled", True))

    def _caller(self, i: int, own):
        def forward(x, *args, **kwargs):
            # peft's state and the weights are checked once per input, by its first member; later members reuse it
            if args or kwargs or not self.shared(x, "fusable", lambda: self._live(x) and all(
                    self._plain_lora(m) for m in self.members)):
                self._cache = None  # running unfused: hold no reference to the input
                return own(x, *args, **kwargs)
            out = self.run(i, x)
            self._done(i)
            return out
        return forward

    def run(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Member i's output: its slice of the group's frozen matmul, plus its LoRA as peft computes it."""
        m = self.members[i]
        split = self.split_rows and torch.is_grad_enabled()  # training; evaluation has a shape per batch
        if not hasattr(m, "lora_A"):
            return _Member.apply(x, self, i, None, split)
        a, b = m.lora_A["default"], m.lora_B["default"]
        autocast = torch.is_autocast_enabled(x.device.type)
        h_dtype = torch.get_autocast_dtype(x.device.type) if autocast else b.weight.dtype
        out_dtype = x.dtype if self.cast_back else self.dtype  # peft's result dtype, and so its sum's
        box = {} if self.compiled and self._summable(x, h_dtype, out_dtype) else None
        result = _Member.apply(x, self, i, box, split)
        middle = a(m.lora_dropout["default"](m._cast_input_dtype(x, a.weight.dtype)))
        h = b(middle)
        if box is not None:
            lo, _ = self.slices[i]
            return _Sum.apply(result, h.contiguous(), self.shared(x, "base", None), lo, m.scaling["default"],
                              self.dtype, out_dtype, box)
        h = h * m.scaling["default"]
        if not autocast:
            h = h.to(result.dtype)
        return (result + h).to(result.dtype)

    def _summable(self, x: torch.Tensor, h_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
        """Whether the compiled sum computes what peft's sum computes here: on the CPU, from bf16 or fp32 parts to an
        fp32 output, or all in bf16 (peft rounds an fp32 part to bf16 before a bf16 add). A bias is in the frozen
        output already: the group's matmul adds it."""
        parts = {self.dtype, h_dtype}
        return x.device.type == "cpu" and (parts <= {torch.bfloat16, torch.float32} and out_dtype == torch.float32
                                           or parts == {out_dtype} == {torch.bfloat16})


_HALVES: dict[tuple, bool | None] = {}  # per shape: None seen once, then whether two blocks of rows pay


def _linear(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, split: bool) -> torch.Tensor:
    """F.linear(`a`, `w`, `bias`); with `split` (accel.split_rows, CPU) as two blocks of a's rows where, per shape,
    that gives the same bits and is faster (decided at a shape's second call). oneDNN runs some bf16 matmuls on one
    thread, each half on every thread."""
    cpu = a.device.type
    if not split or cpu != "cpu" or a.dim() < 2 or not a.is_contiguous() or a.shape[-1] == 0 \
            or a.numel() // a.shape[-1] < 2 or torch.get_num_threads() < 2 or a.dtype != w.dtype \
            or torch.is_grad_enabled() and (a.requires_grad or w.requires_grad) \
            or torch.is_autocast_enabled(cpu) and torch.get_autocast_dtype(cpu) != a.dtype:
        return F.linear(a, w, bias)
    key = (tuple(a.shape), a.dtype, tuple(w.shape), w.stride(), bias is not None, torch.get_num_threads())
    if key not in _HALVES:
        _HALVES[key] = None
        return F.linear(a, w, bias)
    if _HALVES[key] is None:
        whole = F.linear(a, w, bias)
        _HALVES[key] = _halves_pay(a, w, bias, whole)
        return whole
    return _in_halves(a, w, bias) if _HALVES[key] else F.linear(a, w, bias)


def _in_halves(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(`a`, `w`, `bias`) computed as two blocks of a's rows into one output."""
    a2 = a.reshape(-1, a.shape[-1])
    m, half = a2.shape[0], a2.shape[0] // 2
    out = a2.new_empty(m, w.shape[0])
    for lo, hi in ((0, half), (half, m)):
        if bias is None:
            torch.mm(a2[lo:hi], w.t(), out=out[lo:hi])
        else:
            torch.addmm(bias, a2[lo:hi], w.t(), out=out[lo:hi])
    return out.view(*a.shape[:-1], w.shape[0])


def _halves_pay(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, whole: torch.Tensor) -> bool:
    """Whether two blocks of rows give `whole`'s very bits on (`a`, `w`, `bias`) and on probe.spread operands, and
    are faster (_faster)."""
    g = torch.Generator().manual_seed(0)
    cancelling = [spread(t.shape, g).to(t.dtype) for t in (a, w)]
    return (same_bits(_in_halves(a, w, bias), whole)
            and same_bits(_in_halves(*cancelling, bias), F.linear(*cancelling, bias)) and _faster(a, w, bias))


def _faster(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the halves, best of three, take under 0.9 of the whole matmul's best of three on `a`, `w`, `bias`."""
    best = {False: float("inf"), True: float("inf")}
    for _ in range(3):
        for halves in (False, True):
            run = _in_halves if halves else F.linear
            t = time.perf_counter()
            run(a, w, bias)
            best[halves] = min(best[halves], time.perf_counter() - t)
    return best[True] < 0.9 * best[False]


class _CastHead:
    """The forward of LM head `head` with its weight cast to the autocast dtype once (refreshed when it changes), kept
    as a non-persistent buffer: the same logits.

    Autocast re-casts a frozen weight every forward, most of a large tied head's cost."""

    def __init__(self, head: nn.Linear):
        self.head, self.own, self.key = head, type(head).forward.__get__(head), None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        w = self.head.weight
        if not torch.is_autocast_enabled(h.device.type) or w.requires_grad or self.head.bias is not None:
            return self.own(h)
        dtype = torch.get_autocast_dtype(h.device.type)
        key = (dtype, w.data_ptr(), w._version, w.device)
        if key != self.key or self.head.qft_cast is None or self.head.qft_cast.device != w.device:
            self.key = key
            self.head.qft_cast = w.detach().to(dtype)
        return F.linear(h.to(dtype), self.head.qft_cast)


def install(model: nn.Module, projections: list[L.Layer], model_type: str) -> list[Group]:
    """Group the `projections` of `model` that read one input (the registry's shared_input of `model_type`) and each
    other adapted projection alone, where fusable; cast the LM head once (_CastHead). Returns the groups installed."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    arch = L.architecture(model_type)
    by_parent: dict[str, list[str]] = {}
    for layer in projections:
        by_parent.setdefault(layer.name.rpartition(".")[0], []).append(layer.proj)
    groups = []
    for parent_name in sorted(by_parent):
        parent = base.get_submodule(parent_name)
        shared = [names for names in arch.shared_input if all(hasattr(parent, n) for n in names)]
        alone = [(n,) for n in by_parent[parent_name] if hasattr(getattr(parent, n), "lora_A")]
        placed: set[str] = set()
        for names in shared + alone:
            group = Group(parent, names)
            if placed.isdisjoint(names) and group.fusable():
                group.install()
                groups.append(group)
                placed.update(names)
    head = base.get_output_embeddings()
    if type(head) is nn.Linear:
        head.register_buffer("qft_cast", None, persistent=False)
        head.forward = _CastHead(head)
    model._qft_fused = groups
    return groups


def compile_sums(model: nn.Module) -> list[Group]:
    """Switch `model`'s fused groups to summing each member's frozen and LoRA outputs in one compiled pass, the same
    bits; returns the groups ([] without numba). Compiles here, before any step, keeping torch's thread count."""
    try:
        from qft.accel import kernels
    except ImportError:  # numba is not installed
        return []
    groups = _switched(model, "compiled")
    if groups:
        kernels.warm()
    return groups


def split_rows(model: nn.Module) -> list[Group]:
    """Switch `model`'s fused groups to split_rows (_linear); returns the groups."""
    return _switched(model, "split_rows")


def _switched(model: nn.Module, switch: str) -> list[Group]:
    """Set attribute `switch` on every fused group of `model`; returns the groups."""
    groups = getattr(model, "_qft_fused", [])
    for group in groups:
        setattr(group, switch, True)
    return groups


def remove(model: nn.Module) -> None:
    """Undo `install` on `model`: every projection runs alone and owns its weight again (before saving or merging)."""
    for group in getattr(model, "_qft_fused", []):
        group.remove()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    head.__dict__.pop("forward", None)
    head._buffers.pop("qft_cast", None)
    model._qft_fused = []
