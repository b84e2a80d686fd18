"""Activation offload changes where tensors live, never the numbers."""

import pytest
import torch

from qft import offload, train
from conftest import build, make_cfg
from test_speed_switches import ANSWERS, PROMPTS


def grads_with(hooks, *overrides):
    _, _, built = build("adapter.dropout=0.0", *overrides)
    net = built.model
    with torch.no_grad():
        for n, p in net.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.2, generator=torch.Generator().manual_seed(len(n)))
    with hooks:
        loss, n, _ = train.answer_loss(net, PROMPTS, ANSWERS, 2, torch.bfloat16)
    (loss / n).backward()
    return loss.item(), {k: p.grad.clone() for k, p in net.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("extra", [[], ["train.gradient_checkpointing=true"], ["accel.cache_dequantized=true"]])
def test_offloaded_activations_give_identical_gradients(extra):
    cfg = make_cfg("offload=activations")
    ref_loss, ref = grads_with(offload.hooks(make_cfg().offload, torch.device("cpu")), *extra)
    hooks = offload.hooks(cfg.offload, torch.device("cpu"))
    assert isinstance(hooks, offload.ActivationOffload)
    loss, got = grads_with(hooks, *extra)
    assert hooks.count > 20  # the layers' saved activations really went through the hooks
    assert not hooks.host  # and every one came back in backward
    assert loss == ref_loss
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_parameters_and_small_tensors_stay_put():
    hooks = offload.ActivationOffload(min_bytes=1024)
    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(32, 64, requires_grad=True)
    small = torch.randn(4, requires_grad=True)
    with hooks:
        y = (x @ w).sum() + (small * small).sum()
    assert hooks.count == 1  # x only: w is a parameter, `small` is under min_bytes
    y.backward()
    assert torch.allclose(x.grad, w.detach().sum(1).expand(32, 64), atol=1e-5)
    assert torch.allclose(small.grad, 2 * small.detach())


@pytest.mark.parametrize("override,key", [("offload.mode=disk", "offload.mode"),
                                          ("offload=pipeline offload.schedule=zb", "offload.schedule"),
                                          ("+offload.stages=2", "offload.stages"),  # on offload=none
                                          ("offload=pipeline offload.stages=1", "offload.stages"),
                                          ("offload=pipeline offload.micro_batches=3", "offload.micro_batches"),
                                          ("offload=activations offload.route=neighbour", "offload.route")])
def test_bad_offload_settings_name_the_key(override, key):
    from qft import validate
    from qft.errors import QftError

    with pytest.raises(QftError) as e:
        validate.validate(make_cfg(*override.split()))
    assert e.value.key == key
