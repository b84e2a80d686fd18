"""The compiled loops (qft.accel.kernels) give the very bits torch's ops give: accel.compiled_masks (the fast dropout
mask as one pass), accel.compiled_sums (a projection's frozen and scaled LoRA outputs summed in one pass) and
accel.compiled_rope (the rotary embedding of q and k in one pass)."""

import collections
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import build, make_cfg, spread_lora_b
from qft import adapter, model, record, train
from qft.accel import fuse, kernels, masks, rope

P = 0.05
THRESHOLD, SCALE = round(P * 65536) - 32768, 65536 / (65536 - round(P * 65536))
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]
ANSWERS = [[100], [200, 201, 202], [300, 301]]


def awkward(shape, seed=0):
    """Normal values, then every case a rounding or a sign could get wrong: signed zeros, infinities, subnormals,
    a product that overflows, and fp32 values exactly halfway between two bf16 values (ties to even, both ways)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, -1e-40, 3.3e38, -3.3e38, 1e-45])
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x40ffffff, 0x3F80FFFF, 0x00008000],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    flat = x.view(-1)
    flat[:len(special)], flat[len(special):len(special) + len(ties)] = special, ties
    return x


def lanes_of(shape, seed=1):
    n = torch.Size(shape).numel()
    bits = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-2**63, None,
                                                                 generator=torch.Generator().manual_seed(seed))
    lanes = bits.view(torch.int16)[:n].view(shape)
    lanes.view(-1)[:16] = torch.tensor([THRESHOLD - 1, THRESHOLD] * 8)  # the threshold itself keeps, one below drops
    return lanes


def masked(shape, compiled, autocast, grad_seed=2):
    x = awkward(shape).requires_grad_(True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = adapter._MaskedScale.apply(x, lanes_of(shape), THRESHOLD, SCALE, compiled, True)
        out = y if y.dtype == torch.bfloat16 or not autocast else y.to(torch.bfloat16)  # what the A matmul reads
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
    out.backward(grad)
    return out.detach(), x.grad


def bits(t):
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


@pytest.mark.parametrize("shape", [(16, 64, 96), (3, 5, 33), (4001,)])
@pytest.mark.parametrize("autocast", [True, False])
def test_compiled_mask_gives_the_bits_of_torchs_ops(shape, autocast):
    ref_out, ref_grad = masked(shape, False, autocast)
    out, grad = masked(shape, True, autocast)
    # under bf16 autocast the compiled mask hands the A matmul its bf16 input itself: the bits autocast's cast made
    assert out.dtype == ref_out.dtype == (torch.bfloat16 if autocast else torch.float32)
    finite = ~torch.isnan(ref_out.float())
    assert torch.equal(bits(out)[finite], bits(ref_out)[finite])
    assert torch.equal(torch.isnan(out.float()), ~finite)  # inf * 0 (a dropped infinity): NaN both ways
    assert torch.equal(bits(grad), bits(ref_grad)) and grad.dtype == torch.float32
    flat = out.view(-1).float()
    # even lanes of the first 16 drop, odd ones keep: -0 kept, a dropped inf is NaN, -3.3e38 * scale overflows
    assert torch.signbit(flat[1]) and torch.isnan(flat[2]) and flat[3] == -float("inf") and flat[7] == -float("inf")


def test_bf16_rounding_is_torchs_for_every_exponent_and_mantissa_and_each_way_of_rounding():
    """Every upper half of an fp32 (sign, exponent, the 7 bits bf16 keeps) with the lower halves that decide the
    rounding: 0, just below half, exactly half (ties to even, both ways), just above, all ones (rounds up, also to
    infinity), each kept at scale 1 so the kernel rounds x itself."""
    upper = torch.arange(65536, dtype=torch.int64) << 16
    lower = torch.tensor([0, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    x = (upper[:, None] | lower[None, :]).reshape(-1).to(torch.int32).view(torch.float32).contiguous()
    out, keep = torch.empty(x.shape, dtype=torch.bfloat16), torch.empty(x.shape, dtype=torch.bool)
    kernels.drop(x, torch.zeros(x.shape, dtype=torch.int16), -32768, 1.0, out, keep)
    ref = x.to(torch.bfloat16)
    finite = ~torch.isnan(x)
    assert keep.all() and torch.equal(bits(out)[finite], bits(ref)[finite]) and torch.isnan(out[~finite].float()).all()
    back = torch.empty(x.shape)
    kernels.undrop(ref, keep, 1.0, back)  # and widening a bf16 gradient is exact
    assert torch.equal(bits(back)[finite], bits(ref.float())[finite])


THREADS = """
import sys, torch
from qft import adapter, model
from qft.accel import masks, rope
sys.path.insert(0, "tests")
from conftest import make_cfg
torch.ones(1000, 1000) @ torch.ones(1000, 1000)  # torch's OpenMP runtime loaded and in use
before = torch.get_num_threads()
if sys.argv[1] == "masks":
    masks.compile_masks(torch.nn.Sequential(adapter.FastDropout(0.1)))
elif sys.argv[1] == "rope":  # the rotary loop's install, whose probe runs a compiled loop
    cfg = make_cfg()
    assert rope.compile_rope(model.load(model.resolve(cfg.model, cfg.cache_dir)))
else:  # a whole build whose first compiled install is the rotary loop's (no masks to install first)
    from qft import run
    cfg = make_cfg("accel.compiled_masks=false")
    assert run.build(cfg, model.resolve(cfg.model, cfg.cache_dir), torch.device("cpu")).ran["compiled_rope"]
print(before, torch.get_num_threads())
"""


@pytest.mark.parametrize("switch", ["masks", "rope", "build"])
def test_compiling_a_loop_keeps_torchs_thread_count(switch):
    """numba's OpenMP start-up sets the process's thread count (torch's libgomp is the one it reaches): a 1-thread
    run (xdist workers, pipeline stages, OMP_NUM_THREADS=1 studies) must stay at 1, as its record says."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", THREADS, switch], capture_output=True, text=True, env=env, timeout=300,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1"]


def test_compiled_mask_runs_torchs_ops_where_it_cannot_apply():
    x = awkward((8, 32)).to(torch.bfloat16)  # a bf16 input, and a strided one: torch's ops, same results
    for inp in (x, awkward((32, 8)).t()):
        a = adapter._MaskedScale.apply(inp, lanes_of(inp.shape), THRESHOLD, SCALE, True, True)
        b = adapter._MaskedScale.apply(inp, lanes_of(inp.shape), THRESHOLD, SCALE, False, True)
        assert a.dtype == inp.dtype and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def loss_and_grads(*overrides, net=None):
    """The model of the overrides (or `net`, built from them) and its loss and gradients on the tiny batch."""
    if net is None:
        net = model_of(*overrides)
    torch.manual_seed(7)  # the masks' draws
    dtype = torch.bfloat16 if "quant.compute_dtype=bf16" in overrides else torch.float32
    loss, n, _ = train.answer_loss(net, PROMPTS, ANSWERS, 2, dtype)
    (loss / n).backward()
    return net, loss.item(), {k: p.grad for k, p in net.named_parameters() if p.requires_grad}


def model_of(*overrides):
    _, _, built = build("adapter.dropout=0.2", "adapter.dropout_mask=fast", *overrides)
    net = built.model
    spread_lora_b(net)
    if "train.gradient_checkpointing=true" in overrides:  # as train.train enables it: recompute redraws the masks
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return net


@pytest.mark.parametrize("extra", [["quant.compute_dtype=bf16"], ["quant.compute_dtype=fp32"],
                                   ["quant.compute_dtype=bf16", "adapter.shared_dropout=true"],
                                   ["quant.compute_dtype=bf16", "accel.fuse_projections=false"],
                                   ["quant.compute_dtype=bf16", "train.gradient_checkpointing=true"]])
def test_compiled_masks_change_no_numbers_in_a_model(extra):
    net, loss, grads = loss_and_grads("accel.compiled_masks=true", *extra)
    _, ref_loss, ref_grads = loss_and_grads("accel.compiled_masks=false", *extra)
    masks = [m for m in net.modules() if isinstance(m, adapter.FastDropout)]
    assert len(masks) == 4 * 7 and all(m.compiled for m in masks)  # tiny_llama: 4 layers x 7 projections
    # a group's shared mask (q/k/v, gate/up) is read by several matmuls: it hands them fp32, as torch's ops do
    shared = "adapter.shared_dropout=true" in extra
    assert sum(not m.one_reader for m in masks) == (4 * 5 if shared else 0)
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[k], ref_grads[k]) for k in grads)


def test_compiled_masks_is_an_execution_switch_outside_the_hash():
    assert_outside_the_hash("compiled_masks")
    _, _, built = build("accel.compiled_masks=false", "adapter.dropout=0.1")
    assert not any(getattr(m, "compiled", False) for m in built.model.modules())
    assert len(masks.compile_masks(built.model)) == 4 * 7


def same_bits_but_nan(a, b):
    """Equal bits, NaNs in the same places (an inf - inf or a NaN's payload is not what is tested)."""
    finite = ~torch.isnan(b.float())
    return a.dtype == b.dtype and torch.equal(bits(a)[finite], bits(b)[finite]) and torch.equal(
        torch.isnan(a.float()), ~finite)


@pytest.mark.parametrize("y_dtype,h_dtype,dtype", [(torch.bfloat16, torch.bfloat16, torch.float32),
                                                   (torch.bfloat16, torch.float32, torch.float32),
                                                   (torch.float32, torch.bfloat16, torch.float32),
                                                   (torch.float32, torch.float32, torch.float32),
                                                   (torch.bfloat16, torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("scale", [2.0, 16 / 8 ** 0.5, 0.3, 1e-30])
def test_compiled_sum_gives_the_bits_of_pefts_sum(y_dtype, h_dtype, dtype, scale):
    y = awkward((3, 7, 96), seed=3).to(y_dtype)  # a group's frozen output, members side by side
    h = awkward((3, 7, 40), seed=4).to(h_dtype)  # one member's LoRA output
    for lo in (0, 17, 56):
        ref = y[..., lo:lo + 40].to(dtype) + h * scale  # peft: result + lora_B(...) * scaling, result in x's dtype
        assert same_bits_but_nan(kernels.lora_sum(y, lo, h, scale, dtype), ref)
    empty = kernels.lora_sum(y[:0], 0, h[:0], scale, dtype)  # no rows: torch's empty result
    assert empty.shape == (0, 7, 40) and empty.dtype == dtype


@pytest.mark.parametrize("scale", [2.0, 16 / 8 ** 0.5, 0.3, 1e-30])
def test_compiled_sum_gradient_gives_the_bits_of_pefts_nodes(scale):
    grad = awkward((5, 9, 33), seed=5)
    frozen, lora = kernels.lora_sum_grad(grad, scale)
    # the add node hands the bf16 branch its gradient cast to bf16, the multiply scales it in bf16, and the frozen
    # matmul's backward casts the same gradient again
    assert same_bits_but_nan(frozen, grad.to(torch.bfloat16))
    assert same_bits_but_nan(lora, grad.to(torch.bfloat16) * scale)


def run_model(*overrides):
    """loss_and_grads, then the evaluation logits, counting the compiled sums' calls forward and backward (not the
    build's, which compile them)."""
    calls, net = collections.Counter(), model_of(*overrides)
    with pytest.MonkeyPatch.context() as mp:
        for name in ("lora_sum", "lora_sum_grad", "rope"):
            mp.setattr(kernels, name, counted(getattr(kernels, name), name, calls))
        net, loss, grads = loss_and_grads(*overrides, net=net)
        net.eval()
        dtype = torch.bfloat16 if "quant.compute_dtype=bf16" in overrides else torch.float32
        with torch.no_grad(), torch.autocast("cpu", dtype, enabled=dtype == torch.bfloat16):
            logits = net(input_ids=torch.tensor([PROMPTS[2]])).logits
    return net, loss, grads, logits, calls


def assert_same_run(got, ref):
    """run_model's results alike bit for bit: the loss, the evaluation logits and every gradient."""
    (_, loss, grads, logits, _), (_, ref_loss, ref_grads, ref_logits, _) = got, ref
    assert loss == ref_loss and torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[k], ref_grads[k]) for k in grads)


def assert_outside_the_hash(switch):
    """An execution switch: the same config hash on and off, and the record's `execution` names which."""
    on, off = make_cfg(f"accel.{switch}=true"), make_cfg(f"accel.{switch}=false")
    assert record.config_hash(on) == record.config_hash(off)
    assert record.execution(on)[switch] is True and record.execution(off)[switch] is False


def counted(f, name, calls):
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return f(*args, **kwargs)
    return wrapper


@pytest.mark.parametrize("extra,sums,grads", [  # sums a forward pass (tiny_llama: 4 layers x 7), grad loops
    (["quant.compute_dtype=bf16"], 28, 24),  # o_proj's input and output are bf16 (bf16 attention): torch's multiply
    (["quant.compute_dtype=bf16", "quant.attention_dtype=fp32"], 28, 28),
    (["quant.compute_dtype=fp32"], 28, 0),  # fp32: torch's multiply (one pass either way)
    (["quant.compute_dtype=bf16", "accel.cache_dequantized=true"], 28, 24),
    (["quant.compute_dtype=bf16", "train.gradient_checkpointing=true"], 28, 24),
    (["quant.compute_dtype=bf16", "quant=attn8_mlp4"], 12, 12),  # int8 attention runs unfused
    (["quant.compute_dtype=bf16", "adapter.use_rslora=true", "+adapter.projections.v_proj={r:0}",
      "+adapter.depth_groups.deep={layers:[2,3],r:4}"], 26, 22),  # v (r=0 but in the deep group) has no sum
    (["quant.compute_dtype=bf16", "accel.compiled_masks=false", "adapter.dropout_mask=torch"], 28, 24),
])
def test_compiled_sums_change_no_numbers_in_a_model(extra, sums, grads):
    got, ref = run_model("accel.compiled_sums=true", *extra), run_model("accel.compiled_sums=false", *extra)
    net, calls, ref_calls = got[0], got[4], ref[4]
    assert all(g.compiled for g in net._qft_fused) and not (ref_calls["lora_sum"] or ref_calls["lora_sum_grad"])
    if "train.gradient_checkpointing=true" in extra:  # forward again in backward, until the last tensor it keeps
        assert 2 * sums < calls["lora_sum"] < 3 * sums
    else:
        assert calls["lora_sum"] == 2 * sums  # training, then evaluation
    assert calls["lora_sum_grad"] == grads
    assert_same_run(got, ref)


def test_compiled_sums_is_an_execution_switch_outside_the_hash():
    assert_outside_the_hash("compiled_sums")
    _, _, built = build("accel.compiled_sums=false")
    assert built.model._qft_fused and not any(g.compiled for g in built.model._qft_fused)
    assert len(fuse.compile_sums(built.model)) == 4 * 4  # q/k/v, o, gate/up, down


WARM = """
import sys
sys.path.insert(0, "tests")
import torch
from qft.accel import kernels
from test_kernels import run_model
kernels.warm()
loops = [getattr(kernels, n) for n in dir(kernels) if hasattr(getattr(kernels, n), "signatures")]
before = {f.__name__: len(f.signatures) for f in loops}
for dtype in ("bf16", "fp32"):  # bf16: o_proj's bf16 sum too
    for attention in ("compute", "fp32"):
        run_model(f"quant.compute_dtype={dtype}", f"quant.attention_dtype={attention}")
print(sum(before.values()) > 0, {f.__name__: len(f.signatures) for f in loops} == before)
"""


def test_warm_compiles_every_loop_a_step_calls():
    """Whatever a training step and an evaluation call, warm has compiled (or loaded): a loop compiled inside the
    first step would cost that step seconds, and a run's start-up would hide in its training time. A fresh process,
    so that no earlier test has compiled what warm left out."""
    out = subprocess.run([sys.executable, "-c", WARM], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


@pytest.mark.parametrize("seed", [0, 5, 2**40 + 3])
@pytest.mark.parametrize("offset", [0, 7, 8], ids=["fresh-seed", "odd-word", "even-word"])
def test_random_bits_are_torchs_draws_and_leave_its_generator_where_torch_does(seed, offset):
    """From a fresh seed's state (no block twisted yet), an odd and an even word into the block: a first draw that ends
    the block exactly, then sizes one short of a block, one over, empty, and 40 random ones that end anywhere in a
    block; the draws, the state afterwards and the next draws of another kind are torch's."""
    sizes = [(624 - offset % 624) // 2 if offset % 2 == 0 else 1, 0, 3, 311, 312, 313, 623, 624, 625, 1, 147456, 2,
             700, 1000, 937, 1249]
    sizes += np.random.RandomState(seed % 2**32).randint(1, 2000, 40).tolist()  # ends anywhere in a block
    torch.manual_seed(seed)
    torch.rand(offset)  # the words already read from the block
    ref = [torch.empty(n, dtype=torch.int64).random_(-2**63, None) for n in sizes]
    ref_state, ref_next = torch.get_rng_state(), torch.rand(5)
    for guard in (kernels._STATE_BYTES, 0):  # 0: a layout it does not know: None, and the mask's draws are torch's
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kernels, "_STATE_BYTES", guard)
            assert (kernels.random_bits(5) is None) == (guard == 0)
            torch.manual_seed(seed)
            torch.rand(offset)
            got = [kernels.random_bits(n) if guard else adapter.draws(n, torch.device("cpu"), True) for n in sizes]
            assert all(torch.equal(a, b) for a, b in zip(got, ref))
            assert torch.equal(torch.get_rng_state(), ref_state) and torch.equal(torch.rand(5), ref_next)
    torch.manual_seed(seed)
    assert kernels.random_bits(0).numel() == 0 and torch.equal(torch.get_rng_state(), torch.manual_seed(seed).get_state())


def test_mask_draws_are_the_compiled_ones_where_they_can_be():
    """adapter.draws takes kernels.random_bits' draws where it gives them (compiled masks on the CPU), and torch's
    kernel's otherwise: not compiled, or None from it."""
    mine = torch.arange(8)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "random_bits", lambda n: mine[:n])
        assert torch.equal(adapter.draws(8, torch.device("cpu"), True), mine)
        torch.manual_seed(2)
        got = adapter.draws(8, torch.device("cpu"), False)
        mp.setattr(kernels, "random_bits", lambda n: None)
        torch.manual_seed(2)
        assert torch.equal(adapter.draws(8, torch.device("cpu"), True), got) and not torch.equal(got, mine)


def test_random_bits_leave_a_state_torch_would_not_make_to_torchs_kernel():
    """A position that is not the end of the block's remaining words (torch keeps next + left = 625): None, and the
    mask's draws are torch's kernel's, which reads from `next` on."""
    torch.manual_seed(1)
    torch.rand(3)
    state = torch.get_rng_state()
    state[kernels._NEXT] = torch.tensor([40], dtype=torch.int64).view(torch.uint8)
    torch.set_rng_state(state)
    ref = torch.empty(1000, dtype=torch.int64).random_(-2**63, None)
    ref_state = torch.get_rng_state()
    torch.set_rng_state(state)
    assert kernels.random_bits(1000) is None and torch.equal(torch.get_rng_state(), state)
    assert torch.equal(adapter.draws(1000, torch.device("cpu"), True), ref)
    assert torch.equal(torch.get_rng_state(), ref_state)


def test_every_public_loop_is_listed_for_the_step_table():
    """benchmarks/step_ops.py times kernels.LOOPS as ops of their own: a loop missing there would hide in its caller."""
    import inspect

    public = {n for n, f in inspect.getmembers(kernels, inspect.isfunction)
              if f.__module__ == kernels.__name__ and not n.startswith("_")}
    assert public - {"warm"} == set(kernels.LOOPS)


def test_warm_leaves_torchs_random_stream_where_it_was(monkeypatch):
    monkeypatch.setattr(kernels, "_WARMED", [])  # warm as at a process's first call
    torch.manual_seed(3)
    before = torch.get_rng_state()
    kernels.warm()
    assert torch.equal(torch.get_rng_state(), before)


def test_warm_runs_the_loops_once_and_sets_numbas_threads_each_call(monkeypatch):
    """Each switch's install calls warm: only the first call runs the loops, and every call gives numba torch's
    thread count (where numba has that many), torch's own left as it was."""
    import numba

    monkeypatch.setattr(kernels, "_WARMED", [])
    calls = []
    monkeypatch.setattr(kernels, "random_bits", lambda n: calls.append(n))
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 1):
            torch.set_num_threads(count)
            kernels.warm()
            numbas = min(count, numba.config.NUMBA_NUM_THREADS)
            assert (torch.get_num_threads(), numba.get_num_threads()) == (count, numbas)
    finally:
        torch.set_num_threads(threads)
        kernels.warm()
    assert len(calls) == 1


def test_random_bits_leave_draws_off_the_main_thread_to_torchs_kernel():
    """Reading the generator's state and writing it back is not atomic: in a thread (a sweep's jobs run as threads
    share one generator) torch's kernel, which holds the generator's lock, draws."""
    import threading

    got = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "_stream", None)  # the compiled draw would fail
        torch.manual_seed(0)
        worker = threading.Thread(target=lambda: got.extend([kernels.random_bits(1000),
                                                             adapter.draws(1000, torch.device("cpu"), True)]))
        worker.start()
        worker.join()
    torch.manual_seed(0)
    assert got[0] is None and torch.equal(got[1], torch.empty(1000, dtype=torch.int64).random_(-2**63, None))


def test_compiled_sums_hold_no_gradient_past_backward():
    """A member whose input needs no gradient (layer 0's q/k/v read the embedding) never takes the frozen gradient
    the sum's backward would hand it: the sum keeps none (it would live as long as the loss)."""
    boxes = []
    own = fuse._Sum.forward

    def recording(ctx, *args):
        boxes.append(args[-1])
        return own(ctx, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fuse._Sum, "forward", staticmethod(recording))
        net = model_of("quant.compute_dtype=bf16", "accel.compiled_sums=true")
        loss_and_grads("quant.compute_dtype=bf16", net=net)
    assert len(boxes) == 4 * 7 and all(box == {} for box in boxes)


def hf_rope():
    """transformers' own rotary function for LLaMA (outside a model's forward, the `kernels` wrapper calls it)."""
    from transformers.models.llama import modeling_llama

    return modeling_llama.apply_rotary_pos_emb


def rope_case(f, batch, cos_rows, heads, kv, seq, dim, layout, dtype=torch.float32, grads="spread"):
    """f's q and k embeddings, the gradients of the projections' outputs, and the layouts of the gradients q and k
    are handed. q and k laid out (batch, seq, heads * dim) as HF's attention views a projection's output, or as
    slices of one fused output (at a storage offset), or (batch, heads, seq, dim) contiguous; the output gradients
    spread values laid out alike, or a sum's (expanded: stride 0), or none for k (its output unread)."""
    widths = (heads * dim, kv * dim)
    if layout == "fused":
        leaves = [awkward((batch, seq, sum(widths)), seed=10).to(dtype).requires_grad_(True)]
        parts = [leaves[0][..., :widths[0]], leaves[0][..., widths[0]:]]
    else:
        shapes = [(batch, seq, w) if layout == "bshd" else (batch, w // dim, seq, dim) for w in widths]
        leaves = [awkward(shape, seed=10 + i).to(dtype).requires_grad_(True) for i, shape in enumerate(shapes)]
        parts = leaves
    views = [x.view(batch, seq, w // dim, dim).transpose(1, 2) if x.dim() == 3 else x for x, w in zip(parts, widths)]
    strides = {}
    for i, v in enumerate(views):
        v.register_hook(lambda g, i=i: strides.update({i: g.stride()} if g is not None else {}))
    cos, sin = (awkward((cos_rows, seq, dim), seed=30 + i).to(dtype) for i in range(2))
    outs = f(*views, cos, sin)
    if grads == "sum":
        (outs[0].sum() + outs[1].sum()).backward()
    elif grads == "q only":
        outs[0].backward(awkward(outs[0].shape, seed=20).to(dtype))
    else:
        gs = [awkward(o.transpose(1, 2).shape, seed=20 + i).to(dtype).transpose(1, 2) if layout != "bhsd"
              else awkward(o.shape, seed=20 + i).to(dtype) for i, o in enumerate(outs)]
        torch.autograd.backward(outs, gs)
    got = [o.detach() for o in outs] + [x.grad for x in leaves]
    return got, [o.stride() for o in outs] + sorted(strides.items())


def same_case(got, ref):
    """rope_case's results alike: outputs and gradients bit for bit (a NaN's sign aside), and every layout."""
    (values, layouts), (ref_values, ref_layouts) = got, ref
    return layouts == ref_layouts and len(values) == len(ref_values) and all(
        (a is None and b is None) or (a is not None and b is not None and same_bits_but_nan(a, b))
        for a, b in zip(values, ref_values))


@pytest.mark.parametrize("batch,cos_rows,heads,kv,seq,dim", [(3, 3, 4, 2, 7, 16), (3, 1, 4, 2, 7, 16),
                                                            (2, 2, 9, 3, 5, 64), (1, 1, 1, 1, 1, 16)])
@pytest.mark.parametrize("layout,grads", [("bshd", "spread"), ("bhsd", "spread"), ("fused", "spread"),
                                          ("bshd", "sum"), ("bshd", "q only"), ("fused", "q only")])
def test_compiled_rope_gives_the_bits_of_hfs_ops(batch, cos_rows, heads, kv, seq, dim, layout, grads):
    """Forward and backward over every rounding case `awkward` holds (signed zeros: autograd's sum with the slices'
    zeros makes a -0 gradient +0), cos per example or broadcast, GQA's fewer k heads, q and k at a storage offset,
    a sum's expanded gradient, an unread k; outputs and the gradients handed back laid out as HF's ops lay them
    out (a norm after the projection, Qwen3's q_norm, sums its weight's gradient in that order)."""
    args = (batch, cos_rows, heads, kv, seq, dim, layout)
    assert same_case(rope_case(lambda *a: rope._Rope.apply(*a), *args, grads=grads),
                     rope_case(hf_rope(), *args, grads=grads))


def test_compiled_rope_takes_only_hfs_function():
    """The probe that decides whether an architecture's rotary function is the one compiled: LLaMA's is; a partial
    rotary one (Phi-3's kind), an interleaved one and one of another signature are not."""
    def partial(q, k, cos, sin):  # the first half of each head rotated, the rest passed through
        def rot(x):
            n = x.shape[-1] // 2
            part = x[..., :n]
            turned = torch.cat((-part[..., n // 2:], part[..., :n // 2]), -1)
            return torch.cat((part * cos[..., :n].unsqueeze(1) + turned * sin[..., :n].unsqueeze(1), x[..., n:]), -1)
        return rot(q), rot(k)

    def interleaved(q, k, cos, sin):
        def rot(x):
            pairs = x.unflatten(-1, (-1, 2))
            turned = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
            return x * cos.unsqueeze(1) + turned * sin.unsqueeze(1)
        return rot(q), rot(k)

    assert rope._rope_is_hfs(hf_rope())
    assert not any(rope._rope_is_hfs(f) for f in (partial, interleaved, lambda q, k, cos, sin, ids: (q, k)))


def test_compiled_rope_runs_hfs_ops_where_it_does_not_fit_or_is_off():
    _, _, built = build("accel.compiled_rope=true")
    funcs = [f for m in built.model.modules() for f in getattr(m, "_kernel_funcs", {}).values()]
    assert len(funcs) == 4 and all(f.compiled for f in funcs)
    func, args = funcs[0], (1, 1, 4, 2, 3, 16, "bshd")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "rope", None)  # the compiled pass would fail
        assert same_case(rope_case(func, *args, dtype=torch.bfloat16),
                         rope_case(hf_rope(), *args, dtype=torch.bfloat16))
        func.compiled = False
        assert same_case(rope_case(func, *args), rope_case(hf_rope(), *args))


@pytest.mark.parametrize("extra,calls", [  # tiny_llama: 4 layers; q and k a call each, forward and backward
    (["quant.compute_dtype=bf16"], 3 * 8),  # training forward and backward, evaluation forward
    (["quant.compute_dtype=bf16", "quant.attention_dtype=fp32"], 3 * 8),
    (["quant.compute_dtype=fp32"], 3 * 8),
    (["quant.compute_dtype=bf16", "accel.fuse_projections=false"], 3 * 8),
    (["quant.compute_dtype=bf16", "train.gradient_checkpointing=true"], 4 * 8),  # forward again in backward
])
def test_compiled_rope_changes_no_numbers_in_a_model(extra, calls):
    got, ref = run_model("accel.compiled_rope=true", *extra), run_model("accel.compiled_rope=false", *extra)
    assert got[4]["rope"] == calls and not ref[4]["rope"]
    assert_same_run(got, ref)


def test_compiled_rope_is_an_execution_switch_outside_the_hash():
    assert_outside_the_hash("compiled_rope")
    _, _, built = build("accel.compiled_rope=false")
    assert not any(getattr(f, "compiled", False) for m in built.model.modules()
                   for f in getattr(m, "_kernel_funcs", {}).values())
    assert len(rope.compile_rope(built.model)) == 4


def test_compiled_rope_survives_train_and_eval_of_a_model_loaded_from_a_folder(tmp_path):
    """transformers 5 kernelizes a model it loads from a folder (hub kernels) and again at each train() and eval(),
    which resets every rotary function's forward; qft loads without, so the hook stays and nothing is fetched."""
    model.load(model.resolve(make_cfg().model, make_cfg().cache_dir)).save_pretrained(tmp_path / "base")
    _, _, built = build(f"model.path={tmp_path / 'base'}", "accel.compiled_rope=true")
    net = built.model
    assert not net.get_base_model().use_kernels
    funcs = [f for m in net.modules() for f in getattr(m, "_kernel_funcs", {}).values()]
    net.train()
    net.eval()
    assert len(funcs) == 4 and all("forward" in f.__dict__ and f.compiled for f in funcs)
