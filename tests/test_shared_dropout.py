"""adapter.shared_dropout: one dropout mask for the projections that read one input, opt-in and in the hash."""

import torch

from qft import record, train
from conftest import build, make_cfg
from test_fuse import ANSWERS, PROMPTS, fused_outputs, outputs


def a_inputs(*overrides) -> dict:
    """What every LoRA A matrix read in one training forward (the dropped input), by module name."""
    _, _, built = build("quant.compute_dtype=fp32", "adapter.dropout=0.5", *overrides)
    net, seen = built.model, {}
    for name, m in net.get_base_model().named_modules():
        if hasattr(m, "lora_A") and "default" in m.lora_A:
            m.lora_A["default"].register_forward_pre_hook(lambda mod, args, n=name: seen.__setitem__(n, args[0]))
    net.train()
    torch.manual_seed(1)
    train.answer_loss(net, PROMPTS, ANSWERS, 2, torch.float32)
    return {n.split("layers.")[1]: x for n, x in seen.items()}


def test_a_group_reads_one_dropped_input_drawn_as_its_first_member_would():
    shared, own = a_inputs("adapter.shared_dropout=true"), a_inputs()
    assert len(shared) == len(own) == 4 * 7  # tiny_llama: 4 layers x 7 adapted projections
    for d in range(4):
        q, k, v, o = (shared[f"{d}.self_attn.{p}_proj"] for p in "qkvo")
        gate, up, down = (shared[f"{d}.mlp.{p}_proj"] for p in ("gate", "up", "down"))
        assert q is k is v and gate is up  # one mask a group ...
        assert not torch.equal(q != 0, o != 0) and not torch.equal(gate != 0, down != 0)  # ... not one a layer
        assert (q == 0).float().mean() > 0.3  # the mask drops (p = 0.5)
    # layer 0 draws first: its q mask is the very one peft's own q dropout draws from the same stream; k's is not
    assert torch.equal(shared["0.self_attn.q_proj"], own["0.self_attn.q_proj"])
    assert not torch.equal(own["0.self_attn.k_proj"] != 0, own["0.self_attn.q_proj"] != 0)


def test_shared_masks_hold_under_checkpointing_and_fusion():
    """Checkpointing's recompute draws the group's mask again from the restored RNG state, and qft.accel.fuse runs the
    shared dropout as peft's own: same loss and gradients either way."""
    _, loss, grads, _ = outputs(False, "fp32", "adapter.shared_dropout=true")
    for fused, ckpt in ((False, True), (True, False), (True, True)):
        make = fused_outputs if fused else lambda *a, **kw: outputs(False, *a, **kw)  # fusion as test_fuse checks it
        _, l2, g2, _ = make("fp32", "adapter.shared_dropout=true", checkpointing=ckpt)
        assert torch.equal(l2, loss)
        for k in grads:
            assert torch.equal(g2[k], grads[k]), k
    _, own, _, _ = outputs(False, "fp32")
    assert own != loss  # another model of dropout


def test_shared_dropout_enters_the_hash_and_its_default_hashes_as_before_it_existed():
    on, off = make_cfg("adapter.shared_dropout=true"), make_cfg()
    assert record.config_hash(on) != record.config_hash(off)
    before = record.resolved(off)
    del before["adapter"]["shared_dropout"]
    assert record.config_hash(before, inputs_=record.inputs(off)) == record.config_hash(off)
