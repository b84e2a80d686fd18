"""train.compiled_masks: the fast dropout mask as one compiled pass gives the very bits torch's ops give."""

import pytest
import torch

from conftest import build, make_cfg, spread_lora_b
from qft import adapter, record, train

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


def test_compiled_mask_runs_torchs_ops_where_it_cannot_apply():
    x = awkward((8, 32)).to(torch.bfloat16)  # a bf16 input, and a strided one: torch's ops, same results
    for inp in (x, awkward((32, 8)).t()):
        a = adapter._MaskedScale.apply(inp, lanes_of(inp.shape), THRESHOLD, SCALE, True, True)
        b = adapter._MaskedScale.apply(inp, lanes_of(inp.shape), THRESHOLD, SCALE, False, True)
        assert a.dtype == inp.dtype and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def loss_and_grads(*overrides):
    _, _, built = build("adapter.dropout=0.2", "adapter.dropout_mask=fast", *overrides)
    net = built.model
    spread_lora_b(net)
    torch.manual_seed(7)  # the masks' draws
    dtype = torch.bfloat16 if "quant.compute_dtype=bf16" in overrides else torch.float32
    loss, n, _ = train.answer_loss(net, PROMPTS, ANSWERS, 2, dtype)
    (loss / n).backward()
    return net, loss.item(), {k: p.grad for k, p in net.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("extra", [["quant.compute_dtype=bf16"], ["quant.compute_dtype=fp32"],
                                   ["quant.compute_dtype=bf16", "adapter.shared_dropout=true"],
                                   ["quant.compute_dtype=bf16", "train.fuse_projections=false"]])
def test_compiled_masks_change_no_numbers_in_a_model(extra):
    net, loss, grads = loss_and_grads("train.compiled_masks=true", *extra)
    _, ref_loss, ref_grads = loss_and_grads("train.compiled_masks=false", *extra)
    masks = [m for m in net.modules() if isinstance(m, adapter.FastDropout)]
    assert len(masks) == 4 * 7 and all(m.compiled for m in masks)  # tiny_llama: 4 layers x 7 projections
    # a group's shared mask (q/k/v, gate/up) is read by several matmuls: it hands them fp32, as torch's ops do
    shared = "adapter.shared_dropout=true" in extra
    assert sum(not m.one_reader for m in masks) == (4 * 5 if shared else 0)
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[k], ref_grads[k]) for k in grads)


def test_compiled_masks_is_an_execution_switch_outside_the_hash():
    on, off = make_cfg("train.compiled_masks=true"), make_cfg("train.compiled_masks=false")
    assert record.config_hash(on) == record.config_hash(off)
    assert record.execution(on)["compiled_masks"] is True and record.execution(off)["compiled_masks"] is False
    _, _, built = build("train.compiled_masks=false", "adapter.dropout=0.1")
    assert not any(getattr(m, "compiled", False) for m in built.model.modules())
    assert adapter.compile_masks(built.model) == 4 * 7
