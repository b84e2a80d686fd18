"""The memory model of one qft training step, from the composed config alone (`python -m qft.tools.memory` asks it).

Built on the meta device (no weights), counting bytes as qft's code holds them: quantized weights with
bitsandbytes' exact statistics, fp32 embeddings, norms, LoRA weights, gradients and AdamW states, and activations as
autograd saves them (one row of qft.planning.saved per op and setting). How each term is counted and how close it
comes to measured steps: docs/memory.md, "How the memory model counts".
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

import torch

from qft import adapter as A
from qft import accel, budget, quant
from qft import layers as L
from qft.errors import QftError
from qft.model import DTYPES
from qft.planning import saved

GiB = 1024 ** 3  # memory in GiB everywhere qft prints it (offload.device_budget_gb too); bandwidth in GiB/s
ANSWER_TOKENS = 4  # classification answers, which the config alone cannot tokenize: a label word of up to 4 tokens


# ----------------------------------------------------------------------------------------------- inputs

@dataclass(frozen=True)
class Shape:
    """The sizes of an architecture that memory depends on."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config) -> "Shape":
        """The Shape of transformers `config` (kv_heads and head_dim defaulted as transformers does)."""
        heads = config.num_attention_heads
        return cls(config.num_hidden_layers, config.hidden_size, config.intermediate_size, heads,
                   getattr(config, "num_key_value_heads", None) or heads,
                   getattr(config, "head_dim", None) or config.hidden_size // heads, config.vocab_size)


@dataclass
class Resolved:
    """A config resolved against an architecture: everything the estimate reads."""

    name: str
    shape: Shape
    projections: list  # qft.layers.Layer
    quant: dict  # projection name -> quantization settings
    ranks: dict  # projection name -> LoRA rank
    biased: set  # projections with a bias (qwen2's attention)
    embed_bytes: int  # the input embedding (fp32)
    layer_other: list  # per decoder layer: its frozen non-projection tensors (norms)
    head_bytes: int  # final norm, untied LM head, rotary buffers (a tied head is the embedding, counted once)
    tied: bool
    device: str  # "cpu" or "cuda": the kernels the activation terms assume
    compute_dtype: str
    compute_bytes: int
    dropout: bool
    dequantized: bool  # accel.cache_dequantized: 4-bit weights held dequantized in the compute dtype
    checkpointing: bool
    optimizer: str
    batch: int  # train.batch_size: one micro-step's examples
    seq: int  # data.max_length: the widest batch
    answer: int  # answer tokens k: the head runs on k+1 positions
    answer_rows: int | None  # answer tokens in one batch of train.batch_size (None: every answer k long)
    padded: bool  # batches of unequal lengths (a padding mask): the conservative assumption
    eval_batch: int
    offload: dict
    fast_mask: bool = False  # adapter.dropout_mask=fast keeps a 1-byte mask, torch's dropout one in its input's dtype
    shared_dropout: bool = False  # adapter.shared_dropout: one mask (and dropped input) per group reading one input
    fused: bool = False  # accel.fuse_projections where it runs (the CPU): groups reading one input share a matmul;
    # the head is cast once
    attention_fp32: bool = False  # quant.attention_dtype=fp32: SDPA keeps its tensors in fp32 under autocast


def meta_model(source):
    """The model of `source`'s architecture on the meta device, in fp32: shapes and byte counts without weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(source.config, dtype=torch.float32)


_ARCHITECTURES: dict = {}  # the last architecture's derived numbers: suggestions re-plan it many times


def _architecture(source):
    """(projections, Shape, frozen non-projection bytes: embedding, per layer, head, tied) of `source`'s
    architecture."""
    key = source.config.to_json_string()
    if key in _ARCHITECTURES:
        return _ARCHITECTURES[key]
    net = meta_model(source)
    projections = L.classify(net, source.model_type)
    shape = Shape.of(source.config)
    seen = {id(t) for l in projections for t in net.get_submodule(l.name).parameters(recurse=False)}
    embedding = net.get_input_embeddings().weight
    embed, head, layer_other = 0, 0, [0] * shape.layers
    for n, t in list(net.named_parameters()) + list(net.named_buffers()):  # tied tensors come once
        if id(t) in seen:
            continue
        seen.add(id(t))
        nbytes = t.numel() * t.element_size()
        depth = re.search(r"(?:^|\.)layers\.(\d+)\.", n)
        if t is embedding:
            embed += nbytes
        elif depth:
            layer_other[int(depth.group(1))] += nbytes
        else:
            head += nbytes
    out_emb = net.get_output_embeddings()
    biased = {l.name for l in projections if getattr(net.get_submodule(l.name), "bias", None) is not None}
    tied = out_emb is not None and out_emb.weight is embedding
    derived = projections, shape, (embed, layer_other, head, tied, biased)
    _ARCHITECTURES.clear()
    _ARCHITECTURES[key] = derived
    return derived


def target_device(cfg) -> str:
    """The device config `cfg`'s memory is planned for: cpu or cuda (device=auto: what this machine has)."""
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device  # device=cuda plans a GPU run from any machine


def _compute_dtype(name: str, device: str) -> str:
    """The compute dtype `name` means on target `device`: as qft.model decides here, except that a GPU planned from
    a machine without one is assumed to have bf16 (Ampere and later)."""
    from qft import model

    if name == "auto" and device == "cuda" and not torch.cuda.is_available():
        return "bf16"
    return model.compute_dtype_name(name, device)


def _validate(cfg, depth: int | None = None, files: bool = True) -> None:
    """Validate `cfg` as a run does (at `depth` layers), passing a GPU that this machine lacks and, with `files`
    False, data or benchmark files only the job's machine has; raises QftError naming the key."""
    from qft import validate

    validate.validate(cfg, depth, planning=True, files=files)


def resolve(cfg, source=None, answer_tokens: int | None = None, answer_rows: int | None = None,
         padded: bool = True, files: bool = True) -> Resolved:
    """The Resolved of config `cfg` against its architecture (`source`: default, resolved from `cfg`), validated as
    a run would (`files` as in _validate); raises QftError naming the key.

    What the config cannot say, where known: `answer_tokens`, the longest answer (default ANSWER_TOKENS, or half of
    data.max_length for instruction data); `answer_rows`, one batch's answer tokens; `padded`, unequal lengths."""
    from qft import model

    _validate(cfg, files=files)
    device = target_device(cfg)
    source = source or model.resolve(cfg.model, cfg.cache_dir)
    projections, shape, (embed, layer_other, head, tied, biased) = _architecture(source)
    _validate(cfg, shape.layers, files=files)
    off = dict(cfg.offload)
    if off["mode"] == "pipeline" and off["stages"] > shape.layers:
        raise QftError("offload.stages", off["stages"],
                       f"at most {shape.layers} (the decoder layers of {cfg.model.name})")
    if cfg.budget.params is not None:  # the run solves its ranks from the budget; so does the plan
        cfg = copy.deepcopy(cfg)
        budget.apply(cfg, projections)
    ranks = {n: s["r"] for n, s in A.plan(cfg.adapter, projections).items()}
    if answer_tokens is None:
        answer_tokens = ANSWER_TOKENS if cfg.data.task == "classification" else cfg.data.max_length // 2
    dtype = _compute_dtype(cfg.quant.compute_dtype, device)
    on = accel.switches(cfg, device)
    return Resolved(cfg.model.name, shape, projections, quant.plan(cfg.quant, projections), ranks, biased, embed,
                layer_other, head, tied, device, dtype, DTYPES[dtype].itemsize,
                float(cfg.adapter.dropout) > 0, bool(on["cache_dequantized"]),
                bool(cfg.train.gradient_checkpointing), cfg.train.optimizer, int(cfg.train.batch_size),
                int(cfg.data.max_length), int(answer_tokens), answer_rows, padded,
                int(cfg.train.eval_batch_size), off, fast_mask=cfg.adapter.dropout_mask == "fast",
                shared_dropout=bool(cfg.adapter.shared_dropout), fused=on["fuse_projections"],
                attention_fp32=cfg.quant.attention_dtype == "fp32")


# ----------------------------------------------------------------------------------------------- fixed bytes

def projection_bytes(in_features: int, out_features: int, s: dict, compute_bytes: int = 2,
                     bias: bool = False) -> int:
    """The bytes a frozen (`in_features`, `out_features`) projection of settings `s` holds (`compute_bytes` a value,
    `bias`): its backend's closed form, equal to qft.quant.module_bytes."""
    return quant.for_settings(s).weight_bytes(s, in_features, out_features, compute_bytes, bias)


def format_of(s: dict, compute_dtype: str = "bf16") -> str:
    """What qft.quant.describe will name a module of settings `s` in `compute_dtype`: nf4, fp4, int8 or a dtype."""
    return quant.for_settings(s).format(s, compute_dtype)


def optimizer_bytes(numels: list[int], optimizer: str, device: str) -> int:
    """The state bytes `optimizer` keeps on `device` for tensors of `numels` elements: AdamW two fp32 moments (the
    step count a host scalar, on the device only on a CPU); bitsandbytes' 8-bit AdamW two bytes plus two fp32
    absmax per 256, fp32 moments under 4096 elements, and two 256-entry maps."""
    if optimizer == "adamw":
        return sum(8 * n for n in numels) + (4 * len(numels) if device == "cpu" else 0)
    total = 2 * 256 * 4 if any(n >= 4096 for n in numels) else 0
    for n in numels:
        total += 8 * n if n < 4096 else 2 * n + 2 * 4 * -(-n // 256)
    return total


# ----------------------------------------------------------------------------------------------- activations

_DTYPES = {"fp32": 4, "int64": 8, "bool": 1}  # the dtypes of qft.planning.saved whose size a config does not set


def _mask_setting(p: Resolved) -> str:
    """The qft.planning.saved dropout setting of Resolved `p`: fast (bool), or torch's in its input's dtype (fp32 on
    a CPU and without autocast) or a CUDA bool mask."""
    if p.fast_mask:
        return "fast"
    return "torch, cuda" if p.device == "cuda" and p.compute_bytes < 4 else "torch"


def _mask_bytes(p: Resolved) -> int:
    """The bytes a dropout mask of Resolved `p` keeps per element."""
    return saved.nbytes("dropout", _mask_setting(p), {"t": 1, "d_in": 1}, _DTYPES)


def _layer_activations(p: Resolved, depth: int, grad_in: bool, b: int) -> tuple[dict, bool]:
    """({"attn", "mlp": bytes saved for backward}, whether the output requires grad) of decoder layer `depth` of
    Resolved `p` at micro-batch `b`, its input requiring grad where `grad_in`; each op's bytes are its saved row.

    Nothing is saved upstream of the first adapter. Batches are planned padded (SDPA then keeps k, v at every head
    and a mask copy) unless `p.padded` is False."""
    sh, c, s = p.shape, p.compute_bytes, p.seq
    t = b * s
    autocast = c < 4
    q_dim = sh.heads * sh.head_dim
    kv_dim = q_dim if p.padded else sh.kv_heads * sh.head_dim  # a padding mask rules out the GQA kernels
    by_proj = {l.proj: l for l in p.projections if l.depth == depth}
    shared = set()  # without autocast or dropout, projections reading the same input save it once
    masked = set()  # with adapter.shared_dropout, the inputs whose one mask is already counted
    one_mask = p.dropout and p.shared_dropout

    def backend(proj: str):
        return quant.for_settings(p.quant[by_proj[proj].name])

    def out_bytes(proj: str) -> int:  # bitsandbytes 4-bit returns its input's dtype (fp32 here)
        return 4 if proj not in by_proj or backend(proj).output_in_input_dtype or not autocast else c

    dtypes = {**_DTYPES, "compute": c, "attn": 4 if p.attention_fp32 else c, "gate": out_bytes("gate_proj"),
              "up": out_bytes("up_proj")}
    dims = {"t": t, "b": b, "s": s, "h": sh.hidden, "f": sh.intermediate, "q_dim": q_dim, "kv_dim": kv_dim,
            "heads": sh.heads}

    def keeps(op: str, setting: str, **more) -> int:
        return saved.nbytes(op, setting, {**dims, **more}, dtypes)

    def pinned_input(width: int, dtype: int) -> int:
        return saved.nbytes("int8 matmul", "any", {**dims, "d_in": width}, {"input": dtype})

    def r_of(proj: str) -> int:
        return p.ranks.get(by_proj[proj].name, 0) if proj in by_proj else 0

    def lora(proj: str, g: bool, source: str) -> int:
        r = r_of(proj)
        if not r:
            return 0
        widths = {"d_in": by_proj[proj].in_features, "d_out": by_proj[proj].out_features, "r": r}
        sdpa_out = source == "o_in" and not p.dropout and (  # fp32 attention under autocast: LoRA casts a copy
            not autocast or p.device == "cuda" and not p.attention_fp32)
        if sdpa_out:  # o_proj's LoRA reads SDPA's output as is, which SDPA keeps anyway
            setting = "autocast, input in compute dtype" if autocast else "fp32, input saved elsewhere"
        elif autocast:  # a bf16 copy of the input per projection, the rank-r middle, the cached bf16 weights
            setting = "autocast"
        elif (p.dropout and not one_mask) or source not in shared:  # the dropped (or shared) input, the middle
            setting = "fp32"
            if not p.dropout or one_mask:
                shared.add(source)
        else:
            setting = "fp32, input saved elsewhere"
        keep = keeps("lora", setting, **widths)
        mask = keeps("dropout", _mask_setting(p), **widths) \
            if p.dropout and g and not (one_mask and source in masked) else 0
        if mask and one_mask:
            masked.add(source)
        return keep + mask

    def pins(*projs) -> bool:
        return any(x in by_proj and backend(x).pins_input for x in projs)

    norm = keeps("rmsnorm", "any")  # RMSNorm keeps its fp32 input and the reciprocal rms
    attn = norm if grad_in else 0
    attn += sum(lora(x, grad_in, "attn_in") for x in ("q_proj", "k_proj", "v_proj"))
    g_qkv = grad_in or any(r_of(x) for x in ("q_proj", "k_proj", "v_proj"))
    if g_qkv:  # SDPA: q, k, v and the output, the fp32 log-sum-exp, and its own additive copy of the mask
        attn += keeps("sdpa", "padded" if p.padded else "unpadded")
    attn += lora("o_proj", g_qkv, "o_in")
    # bitsandbytes' int8 matmul keeps its input on its autograd node itself (ctx.A), past saved-tensor
    # hooks and checkpointing: the fp32 norm output (shared by q, k, v). o_proj's input is SDPA's output
    # (its kernels write it heads-last, so the transpose back is a view), which SDPA keeps anyway.
    # (Without autocast and dropout the LoRA path keeps that very tensor: counted once.)
    pinned = {"attn": pinned_input(sh.hidden, 4) if grad_in and pins(
        "q_proj", "k_proj", "v_proj") and "attn_in" not in shared else 0}
    g_mid = g_qkv or r_of("o_proj") > 0
    mlp = norm if g_mid else 0
    mlp += lora("gate_proj", g_mid, "mlp_in") + lora("up_proj", g_mid, "mlp_in")
    g_gu = g_mid or r_of("gate_proj") > 0 or r_of("up_proj") > 0
    if g_gu:  # SwiGLU: silu's input and output, the up projection
        mlp += keeps("swiglu", "any")
    mlp += lora("down_proj", g_gu, "down_in")
    pinned["mlp"] = (pinned_input(sh.hidden, 4)
                     if g_mid and pins("gate_proj", "up_proj") and "mlp_in" not in shared else 0) \
        + (pinned_input(sh.intermediate, max(dtypes["gate"], dtypes["up"]))
           if g_gu and pins("down_proj") and "down_in" not in shared else 0)
    return {"attn": attn, "mlp": mlp, "pinned.attn": pinned["attn"], "pinned.mlp": pinned["mlp"]}, \
        g_gu or r_of("down_proj") > 0


def _layer_work(p: Resolved, depth: int, b: int, held: int) -> int:
    """The transient bytes, beyond what is held across layers, while decoder layer `depth` of Resolved `p` runs at
    micro-batch `b`, `held` being its saved bytes (recomputed and held first under checkpointing).

    Terms fitted to measured steps; what each counts: docs/memory.md, "How the memory model counts"."""
    sh, c = p.shape, p.compute_bytes
    t = b * p.seq
    fwd = 4 * t * (5 * sh.hidden + (1.5 if c < 4 else 1) * sh.intermediate)
    bwd = 4 * 4 * t * sh.hidden
    fwd_w = bwd_w = 0
    for l in p.projections:
        if l.depth != depth:
            continue
        backend = quant.for_settings(p.quant[l.name])
        if p.dequantized and backend.holds_dequantized:
            continue
        freed = (c + _mask_bytes(p) * (p.dropout and not p.shared_dropout)) * t * l.in_features if p.ranks.get(l.name) else 0
        f, b_ = backend.work_bytes(l.in_features * l.out_features, c, p.device)
        fwd_w, bwd_w = max(fwd_w, f), max(bwd_w, b_ - freed) if b_ else bwd_w
    if p.fused:  # a fused group's output (compute dtype) is held until its last member has run
        fwd += c * t * max([_group_width(p, depth, names) for names in L.Architecture().shared_input] + [0])
    backward = max(bwd, bwd_w)
    if p.checkpointing:
        return int(max(held + backward, fwd + fwd_w))
    return int(max(fwd + fwd_w, backward))


def _group_width(p: Resolved, depth: int, names: tuple) -> int:
    """The output width of projections `names` at layer `depth` of Resolved `p` where qft.accel.fuse runs them as one
    (all present, one backend that fuses), else 0."""
    members = [l for l in p.projections if l.depth == depth and l.proj in names]
    backends = {quant.for_settings(p.quant[l.name]).name for l in members}
    if len(members) != len(names) or len(backends) != 1 or not quant.BACKENDS[backends.pop()].fuses:
        return 0
    return sum(l.out_features for l in members)


# ----------------------------------------------------------------------------------------------- per-layer costs

@dataclass
class LayerCost:
    """One contiguous piece of the model, in bytes, for summing over pipeline stages: `fixed` (frozen weights,
    adapter, gradients, optimizer states), `act` (activations per micro-batch in flight; with checkpointing the
    layer's input), `work` (transient peak while it runs) and `detail` (fixed's and act's components)."""

    name: str
    fixed: int
    act: int
    work: int
    detail: dict = field(default_factory=dict)


def layer_costs(cfg, micro_batch: int | None = None, *, resolved: Resolved | None = None) -> list[LayerCost]:
    """The LayerCost of the embedding, every decoder layer and the head of config `cfg` (or of `resolved`), in model
    order, at `micro_batch` (default: default_micro_batch)."""
    p = resolved or resolve(cfg)
    b = micro_batch or default_micro_batch(p)
    sh, c, t = p.shape, p.compute_bytes, b * p.seq
    rotary = saved.nbytes("rotary", "any", {"t": t, "head_dim": sh.head_dim}, _DTYPES)  # once for every layer
    out = [LayerCost("embed", p.embed_bytes, rotary, 0, {"frozen.other": p.embed_bytes, "act.rotary": rotary})]
    grad = False  # does the hidden state entering this layer require grad?
    per_depth: dict[int, list] = {}
    for l in p.projections:
        per_depth.setdefault(l.depth, []).append(l)
    for depth in range(sh.layers):
        detail = {f"frozen.{lt}": 0 for lt in L.LAYER_TYPES}
        numels = []
        for l in per_depth.get(depth, []):
            s = p.quant[l.name]
            nbytes = projection_bytes(l.in_features, l.out_features, s, c, l.name in p.biased)
            fmt = format_of(s, p.compute_dtype)
            if p.dequantized and quant.for_settings(s).holds_dequantized:  # held dequantized: the compute dtype, not the 4-bit codes
                nbytes = (l.in_features + (l.name in p.biased)) * l.out_features * c
                fmt = f"{fmt} (dequantized, {p.compute_dtype})"
            detail[f"frozen.{l.layer_type}"] += nbytes
            key = f"weights.{l.layer_type}.{fmt}"
            detail[key] = detail.get(key, 0) + nbytes
            r = p.ranks.get(l.name, 0)
            numels += [r * l.in_features, l.out_features * r] if r else []
        params = sum(numels)
        act, grad_out = _layer_activations(p, depth, grad, b)
        runs_backward = grad or params > 0
        work = _layer_work(p, depth, b, act["attn"] + act["mlp"]) if runs_backward else 0
        pinned = act["pinned.attn"] + act["pinned.mlp"]
        if p.checkpointing and runs_backward:  # the layer input (fp32) to recompute the layer from, and
            held = {"act.inputs": 4 * sh.hidden * t, "act.int8_inputs": pinned}  # what bitsandbytes int8 keeps
        else:
            held = {"act.attn": act["attn"] + act["pinned.attn"], "act.mlp": act["mlp"] + act["pinned.mlp"]}
        detail.update({"frozen.other": p.layer_other[depth], "adapter": 4 * params, "grads": 4 * params,
                       "optimizer": optimizer_bytes(numels, p.optimizer, p.device) if numels else 0,
                       "params": params, **held})
        fixed = sum(v for k, v in detail.items() if k.startswith("frozen.") or k in ("adapter", "grads", "optimizer"))
        out.append(LayerCost(f"layer.{depth}", fixed, sum(held.values()), work, detail))
        grad = grad_out
    # The head: final norm (fp32), the LM head (fp32; autocast's bf16 copy is kept for backward) and the
    # logits only at the k+1 answer positions, of which the fp32 log-softmax of the n answer rows is kept.
    V, k = sh.vocab, p.answer
    n = b * k if p.answer_rows is None else -(-p.answer_rows * b // p.batch)
    dims, dtypes = {"t": t, "h": sh.hidden, "n": n, "V": V}, {**_DTYPES, "compute": c}
    # under autocast the head keeps its weight's cast; with fused projections made once and kept (qft.accel.fuse)
    head_cast = saved.nbytes("lm_head", "autocast", dims, dtypes) if c < 4 else 0
    head_setting = "fp32" if c == 4 else "autocast, fuse_projections" if p.fused else "autocast"
    head_act = sum(saved.nbytes(op, setting, dims, dtypes) for op, setting in (
        ("rmsnorm", "any"), ("lm_head", head_setting), ("cross_entropy", "any"))) if grad else 0
    # forward: the logits, their fp32 upcast (autocast) while the n answer rows are picked from it, then
    # those rows while their log-softmax is computed; backward: two n x V fp32 gradients, log-softmax held
    logits = c * b * (k + 1) * V
    head_work = max(logits + (4 * b * k * V if c < 4 else 0), logits + 4 * n * V, 8 * n * V) if grad else 0
    kept = head_cast if p.fused else 0
    out.append(LayerCost("head", p.head_bytes + kept, head_act, head_work,
                         {"frozen.other": p.head_bytes, "frozen.head_cast": kept, "act.logits": head_act}))
    return out


def default_micro_batch(p: Resolved) -> int:
    """train.batch_size / offload.micro_batches in a pipeline, else train.batch_size, of Resolved `p`."""
    return p.batch // p.offload["micro_batches"] if p.offload["mode"] == "pipeline" else p.batch


def eval_peak(p: Resolved, costs) -> int:
    """The scorer's peak bytes for Resolved `p` with `costs` (layer_costs): frozen weights and adapter, the prompt's
    KV cache, one layer's forward working set and the last position's logits, at train.eval_batch_size."""
    sh, b = p.shape, p.eval_batch
    t = b * p.seq
    kv = sh.layers * t * sh.kv_heads * sh.head_dim * (4 + 4)
    frozen = sum(v for c in costs for k, v in c.detail.items() if k.startswith("frozen.")) + \
        sum(c.detail.get("adapter", 0) for c in costs)
    layer = 4 * t * (4 * sh.hidden + 3 * sh.intermediate)
    return int(frozen + kv + layer + 2 * 4 * b * sh.vocab)
