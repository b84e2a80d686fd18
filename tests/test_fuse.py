"""Fused projections (qft.accel.fuse) compute what the unfused model computes, with peft's own modules in place."""

import collections
import time

import pytest
import torch
import torch.nn.functional as F
from peft.tuners.lora import bnb as lora_bnb

from qft import record, train
from qft.accel import fuse
from conftest import build, make_cfg, spread_lora_b

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]
ANSWERS = [[100], [200, 201, 202], [300, 301]]


def outputs(fused, dtype, *overrides, checkpointing=False, prompts=PROMPTS, answers=ANSWERS):
    torch.manual_seed(0)
    _, _, built = build(f"accel.fuse_projections={fused}", f"quant.compute_dtype={dtype}", "adapter.dropout=0.1",
                        *overrides)
    net = built.model
    if checkpointing:  # as qft.train enables it: the layer's forward runs again in backward
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    spread_lora_b(net)
    torch.manual_seed(1)  # the dropout masks: the same stream, drawn in the same order
    cdt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    loss, _, _ = train.answer_loss(net, prompts, answers, 2, cdt)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in net.named_parameters() if p.requires_grad}
    net.eval()
    with torch.no_grad(), torch.autocast("cpu", cdt, enabled=cdt != torch.float32):
        logits = net(input_ids=torch.tensor([PROMPTS[2]])).logits
    return built, loss, grads, logits


def width_invariant(built, cdt) -> bool:
    """The premise of bit-identity on this machine: each member's columns of its group's matmul have the bits of the
    member's own matmul, for the row counts the tests use (up to 32). oneDNN and MKL may pick a kernel (and so the
    order of a dot product's sum) by output width, row count or threads; CI met a machine where bf16 ones differ in
    a last bit."""
    g = torch.Generator().manual_seed(0)
    for group in built.model._qft_fused:
        for rows in range(1, 33):
            x = torch.randn(rows, group.bases[0].in_features, generator=g).to(cdt)
            if not torch.equal(group.frozen(x), per_member(group, x)):
                return False
    return True


def per_member(group, x, split=False):
    """The group's frozen outputs as each member's own matmul makes them, side by side: what fusion promises."""
    w, xb = group.weight(), x.to(group.dtype)
    return torch.cat([F.linear(xb, w[lo:hi], None if group.bias is None else group.bias[lo:hi])
                      for lo, hi in group.slices], -1)


def fused_outputs(dtype, *extra, **kw):
    """The fused model's outputs, with the group's one matmul where this machine's matmul is width-invariant;
    elsewhere with each member's own matmul in its place, so that what is compared exactly is fusion's own work
    (slicing, LoRA, dropout stream, autograd nodes), not the machine's rounding, which
    test_group_matmul_is_each_members_own_to_rounding bounds apart."""
    got = outputs("true", dtype, *extra, **kw)
    if width_invariant(got[0], {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]):
        return got
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fuse.Group, "frozen", per_member)
        return outputs("true", dtype, *extra, **kw)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("extra,groups", [  # tiny_llama's 4 layers: q/k/v, o, gate/up and down each a group
    (["quant=nf4"], 16),
    (["quant=nf4", "accel.cache_dequantized=true"], 16),
    (["quant=none"], 16),
    (["quant=attn8_mlp4"], 8),  # int8 attention runs unfused
    (["quant=nf4", "+quant.projections.k_proj={bits:8}", "adapter.mlp.r=2", "adapter.attn.alpha=4"], 20),  # q, v alone
    (["quant=nf4", "+adapter.projections.v_proj={r:0}", "+adapter.depth_groups.deep={layers:[2,3],r:4}"], 16),
    (["quant=nf4", "model.arch.model_type=olmo2"], 16),  # post-norm: q/k/v and gate/up read the residual stream
])
def test_fused_equals_unfused(dtype, extra, groups):
    ref_built, ref_loss, ref_grads, ref_logits = outputs("false", dtype, *extra)
    built, loss, grads, logits = fused_outputs(dtype, *extra)
    assert len(built.model._qft_fused) == groups
    assert not getattr(ref_built.model, "_qft_fused", [])
    assert grads.keys() == ref_grads.keys()
    assert torch.equal(loss, ref_loss)  # slices of one matmul are each projection's own
    assert torch.equal(logits, ref_logits)
    for k in grads:  # one autograd node per projection, so the input gradient is summed in the unfused order
        assert torch.equal(grads[k], ref_grads[k]), k


def test_fused_equals_unfused_under_gradient_checkpointing():
    ref = outputs("false", "bf16", "quant=nf4", checkpointing=True)
    got = fused_outputs("bf16", "quant=nf4", checkpointing=True)
    assert torch.equal(got[1], ref[1])
    for k in ref[2]:
        assert torch.equal(got[2][k], ref[2][k]), k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("quant", ["quant=nf4", "quant=none"])
def test_group_matmul_is_each_members_own_to_rounding(dtype, quant):
    """The one thing fusion leaves to the machine: a column of the group's matmul against the member's own module.
    Any order of a length-K dot product's sum lies within gamma_K = K u / (1 - K u) of |x| |w| of the exact sum
    (Higham, Accuracy and Stability of Numerical Algorithms, 3.1), plus one rounding of the output to the dtype;
    a wrong slice, weight, bias or cast is off by far more. Where the machine is width-invariant, equal bits."""
    _, _, built = build("accel.fuse_projections=true", quant, f"quant.compute_dtype={'bf16' if dtype == torch.bfloat16 else 'fp32'}")
    g = torch.Generator().manual_seed(0)
    for group in built.model._qft_fused:
        for rows in (1, 7, 27, 64):
            x = torch.randn(rows, group.bases[0].in_features, generator=g).to(dtype)
            with torch.no_grad(), torch.autocast("cpu", dtype, enabled=dtype != torch.float32):
                own = torch.cat([b(x) for b in group.bases], -1).float()
                got = group.frozen(x).float()
            k = x.shape[-1]
            u = 2.0 ** -24  # products and sums run in fp32 (bf16 kernels accumulate in fp32)
            mag = x.abs().float() @ group.weight().abs().float().T + (0 if group.bias is None else group.bias.abs())
            out_u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24
            bound = 2 * (k * u / (1 - k * u)) * mag + 2 * out_u * own.abs() + 1e-30
            assert ((got - own).abs() <= bound).all(), (group.names, rows)
            if torch.equal(group.frozen(x), per_member(group, x)):  # width-invariant at these rows
                assert torch.equal(got, own), (group.names, rows)


def test_groups_follow_the_registry_and_keep_peft_modules():
    _, _, built = build("accel.fuse_projections=true", "quant=nf4")
    base = built.model.get_base_model()
    names = sorted(tuple(g.names) for g in built.model._qft_fused)
    assert names == sorted([("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)] * 4)
    for layer in built.projections:
        assert isinstance(base.get_submodule(layer.name), lora_bnb.Linear4bit)  # peft's own class, unchanged


def test_dense_group_is_one_storage_and_remove_gives_it_back():
    _, _, built = build("accel.fuse_projections=true", "quant=none")
    group = built.model._qft_fused[0]
    q, k = (b.weight for b in group.bases[:2])
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == group.storage.data_ptr()
    fuse.remove(built.model)
    q, k = (b.weight for b in group.bases[:2])
    assert q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
    assert all("forward" not in m.__dict__ for m in group.members)


def test_merge_unmerge_and_disabled_adapters_step_aside():
    """Where peft's state is not plain LoRA the group runs each projection as peft does: the same outputs as an
    unfused model in the same state."""
    ref, fused = (build(f"accel.fuse_projections={f}", "quant=none", "quant.compute_dtype=fp32")[2].model
                  for f in ("false", "true"))
    for net in (ref, fused):
        spread_lora_b(net)
        net.eval()
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        with ref.disable_adapter(), fused.disable_adapter():
            assert torch.equal(ref(input_ids=ids).logits, fused(input_ids=ids).logits)
        plain = ref(input_ids=ids).logits
        for net in (ref, fused):
            net.merge_adapter()
        assert torch.equal(ref(input_ids=ids).logits, fused(input_ids=ids).logits)
        for net in (ref, fused):
            net.unmerge_adapter()
        after = fused(input_ids=ids).logits
        assert torch.allclose(after, plain, atol=1e-5)  # merge and unmerge add and subtract in fp32
        assert all(g._live(ids.float()) for g in fused._qft_fused)  # the in-place merge kept the shared storage


def test_fusion_is_an_execution_setting_recorded_outside_the_hash():
    on, off = make_cfg("accel.fuse_projections=true"), make_cfg("accel.fuse_projections=false")
    assert record.config_hash(on) == record.config_hash(off)
    assert record.execution(on)["fuse_projections"] is True
    assert record.execution(off)["fuse_projections"] is False


LONG_PROMPTS = [list(range(5 + i, 29 + i)) for i in range(6)]  # 6 x (24 + 2) = 156 rows in a step's matmuls
LONG_ANSWERS = [[100 + i, 101 + i] for i in range(6)]


@pytest.fixture
def two_threads():
    """The halves are for matmuls on several threads: a test worker may run on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype,checkpointing", [("bf16", False), ("fp32", False), ("bf16", True)])
def test_row_halves_change_no_numbers_in_a_model(monkeypatch, two_threads, dtype, checkpointing):
    """Every frozen matmul of a training step, forward and backward, is offered the halves (as if always faster):
    each shape whose halves gave the whole's bits runs in halves, and the loss and every gradient keep their bits."""
    extra = (f"quant.compute_dtype={dtype}", "quant.attention_dtype=fp32")
    monkeypatch.setattr(fuse, "_HALVES", {})
    monkeypatch.setattr(fuse, "_faster", lambda *a: True)
    halves, backward = collections.Counter(), []
    monkeypatch.setattr(fuse, "_in_halves", lambda *a, own=fuse._in_halves: halves.update([bool(backward)]) or own(*a))

    def member_backward(ctx, grad, own=fuse._Member.backward):
        backward.append(1)
        try:
            return own(ctx, grad)
        finally:
            backward.pop()
    monkeypatch.setattr(fuse._Member, "backward", staticmethod(member_backward))
    kw = dict(checkpointing=checkpointing, prompts=LONG_PROMPTS, answers=LONG_ANSWERS)
    built, loss, grads, _ = outputs("true", dtype, "accel.split_rows=true", *extra, **kw)  # 4 layers: shapes recur
    assert all(g.split_rows for g in built.model._qft_fused)
    decided = dict(fuse._HALVES)
    _, ref_loss, ref_grads, _ = outputs("true", dtype, "accel.split_rows=false", *extra, **kw)
    assert fuse._HALVES == decided  # the run without the switch decided nothing
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    assert any(v is not None for v in decided.values())  # shapes recur across the 4 layers: decided
    if dtype == "bf16" and not any(decided.values()):
        pytest.skip(f"no shape's bf16 halves gave the whole's bits on this machine ({len(decided)} shapes)")
    assert any(decided.values())  # fp32 halves of 78 rows sum as the whole's 156 (MKL and oneDNN alike)
    assert sum(halves.values()) > 2 * len(decided)  # beyond each shape's two checks: the halves ran in the step
    if dtype == "fp32":
        assert halves[False] and halves[True]  # forward and backward matmuls both ran in halves


def test_row_halves_are_refused_for_one_differing_bit(monkeypatch):
    a, w = torch.randn(64, 32), torch.randn(48, 32)
    halves = fuse._in_halves(a, w, None)
    monkeypatch.setattr(fuse, "_faster", lambda *args: pytest.fail("timed halves whose bits differ"))
    flipped = halves.clone()
    flipped.view(torch.int32)[5, 7] ^= 1
    assert fuse._halves_pay(a, w, None, flipped) is False
    for bias in (None, torch.randn(48)):  # mm and addmm into the halves of one output: F.linear's rows
        whole = F.linear(a, w, bias)
        assert torch.equal(fuse._in_halves(a, w, bias), whole)


def test_row_halves_that_are_not_faster_are_refused(monkeypatch):
    a, w = torch.randn(64, 32), torch.randn(48, 32)
    own = fuse._in_halves
    monkeypatch.setattr(fuse, "_in_halves", lambda *args: time.sleep(0.002) or own(*args))
    assert fuse._faster(a, w, None) is False
    monkeypatch.setattr(fuse, "_in_halves", lambda *args: None)  # no work at all: faster than any matmul
    assert fuse._faster(a, w, None) is True


def test_row_halves_decide_at_a_shapes_second_call_and_never_in_evaluation(monkeypatch, two_threads):
    monkeypatch.setattr(fuse, "_HALVES", {})
    decisions = []
    monkeypatch.setattr(fuse, "_halves_pay", lambda *a: decisions.append(a[0].shape) or True)
    a, w, b = torch.randn(2, 16, 32), torch.randn(48, 32), torch.randn(48)
    whole = F.linear(a, w, b)
    assert torch.equal(fuse._linear(a, w, b, True), whole) and not decisions  # seen once
    assert torch.equal(fuse._linear(a, w, b, True), whole) and len(decisions) == 1  # decided, the whole returned
    assert torch.equal(fuse._linear(a, w, b, True), whole) and len(decisions) == 1  # the halves, the same bits
    for other in (torch.randn(3, 16, 32), torch.randn(3, 16, 32)):
        fuse._linear(other, w, b, True)
    assert len(decisions) == 2  # another shape decides anew, at its second call
    for _ in range(2):
        fuse._linear(torch.randn(5, 16, 32), w, b, False)
    assert len(decisions) == 2  # the switch off never decides
    torch.set_num_threads(1)
    for _ in range(2):
        fuse._linear(torch.randn(7, 16, 32), w, b, True)
    assert len(decisions) == 2  # nor one thread
    torch.set_num_threads(2)
    for _ in range(2):
        fuse._linear(torch.randn(7, 16, 32), w, b, True)
    assert len(decisions) == 3  # two threads: a key of its own
    _, _, built = build("accel.fuse_projections=true", "accel.split_rows=true")
    net, ids = built.model, torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        for _ in range(2):
            net(input_ids=ids)
    assert len(decisions) == 3  # evaluation runs the whole matmuls
    for _ in range(2):
        net(input_ids=ids)
    assert len(decisions) > 3  # and training decides


def test_split_rows_is_an_execution_setting_recorded_outside_the_hash():
    on, off = make_cfg("accel.split_rows=true"), make_cfg("accel.split_rows=false")
    assert record.config_hash(on) == record.config_hash(off)
    assert record.execution(on)["split_rows"] is True and record.execution(off)["split_rows"] is False


def test_split_rows_is_recorded_as_what_ran_one_thread_never_splits(two_threads):
    """At one thread the halves never run (`fuse._linear`): the switch is not installed and the record says false."""
    _, _, built = build("accel.fuse_projections=true", "accel.split_rows=true")
    assert built.ran["split_rows"] is True and all(g.split_rows for g in built.model._qft_fused)
    torch.set_num_threads(1)
    _, _, built = build("accel.fuse_projections=true", "accel.split_rows=true")
    assert built.ran["split_rows"] is False and not any(g.split_rows for g in built.model._qft_fused)
    assert built.model._qft_fused  # fused all the same


def test_mixed_bias_groups_make_their_zeros_on_the_members_device():
    """A group whose members differ in having a bias fills the gaps with zeros on the biases' device, not the CPU's
    (on CUDA a CPU zero vector in the concatenation would fail)."""
    parent = torch.nn.Module()
    parent.q_proj = torch.nn.Linear(8, 4, bias=True, device="meta")
    parent.k_proj = torch.nn.Linear(8, 2, bias=False, device="meta")
    group = fuse.Group(parent, ("q_proj", "k_proj"))
    assert group.fusable()
    group.install()
    assert group.bias.device.type == "meta" and group.bias.shape == (6,)
    cpu = torch.nn.Module()
    cpu.q_proj, cpu.k_proj = torch.nn.Linear(8, 4, bias=True), torch.nn.Linear(8, 2, bias=False)
    group = fuse.Group(cpu, ("q_proj", "k_proj"))
    group.install()
    assert torch.equal(group.bias, torch.cat([cpu.q_proj.bias.data, torch.zeros(2)]))


def test_an_input_changed_in_place_is_not_served_from_the_groups_cache():
    """The group computes its frozen matmul once per input for all members; an input changed in place between two
    members' calls (same tensor, new `_version`) is computed anew, as the unfused members would."""
    _, _, built = build("accel.fuse_projections=true", "quant=none", "quant.compute_dtype=fp32", "adapter.dropout=0.0")
    spread_lora_b(built.model)
    group = next(g for g in built.model._qft_fused if len(g.members) == 3)
    x = torch.randn(2, 5, group.bases[0].in_features)
    with torch.no_grad():
        group.members[0](x)  # q: the group's matmul over x, cached for k and v
        x.mul_(2.0)
        got = group.members[1](x)
        fuse.remove(built.model)
        want = group.members[1](x)  # k unfused, on the changed x
    assert torch.equal(got, want)
