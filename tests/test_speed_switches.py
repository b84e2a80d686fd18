"""Every speed switch is a config key, and none changes the numbers: same loss, gradients and scores."""

import pytest
import torch

from qft import data, model, quant, train
from conftest import build, spread_lora_b

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]
ANSWERS = [[100], [200, 201, 202], [300, 301]]


def loss_grads_logits(*overrides):
    _, _, built = build("adapter.dropout=0.0", *overrides)
    net = built.model
    spread_lora_b(net)
    loss, n, _ = train.answer_loss(net, PROMPTS, ANSWERS, 2, torch.bfloat16)
    (loss / n).backward()
    grads = {k: p.grad.clone() for k, p in net.named_parameters() if p.requires_grad}
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        logits = net(input_ids=torch.tensor([PROMPTS[2]])).logits.float()
    return built, loss.item(), grads, logits


@pytest.mark.parametrize("preset", ["nf4", "fp4", "attn8_mlp4"])
def test_cache_dequantized_changes_no_numbers(preset):
    ref_built, ref_loss, ref_grads, ref_logits = loss_grads_logits(f"quant={preset}")
    built, loss, grads, logits = loss_grads_logits(f"quant={preset}", "accel.cache_dequantized=true")
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        assert torch.equal(grads[k], ref_grads[k]), k
    assert torch.equal(logits, ref_logits)
    # the 4-bit projections are now plain bf16 linears; the record still describes the 4-bit base
    base = built.model.get_base_model()
    kinds = {type(base.get_submodule(l.name).base_layer).__name__ for l in built.projections if l.layer_type == "mlp"}
    assert kinds == {"Dequantized"}
    assert built.base_bytes == ref_built.base_bytes
    for layer in built.projections:
        a = base.get_submodule(layer.name).base_layer
        b = ref_built.model.get_base_model().get_submodule(layer.name).base_layer
        assert quant.describe(a) == quant.describe(b)


@pytest.mark.parametrize("preset,extra", [("nf4", []), ("fp4", []), ("attn8_mlp4", []), ("none", []),
                                          ("nf4", ["accel.cache_dequantized=true"])])
def test_quantized_base_cache_rebuilds_the_same_model(preset, extra, tmp_path, monkeypatch):
    where = quant.cache_file
    monkeypatch.setattr(quant, "cache_file",
                        lambda cfg, layers, fp, dev, _, *deq: where(cfg, layers, fp, dev, tmp_path, *deq))
    over = [f"quant={preset}", *extra]
    _, ref_loss, ref_grads, ref_logits = loss_grads_logits(*over, "accel.cache_quantized=false")
    assert not list(tmp_path.glob("quantized/*"))
    first = loss_grads_logits(*over)  # quantizes and fills the cache: the tensors, and the RNG state after
    rng = list(tmp_path.glob("quantized/*.rng-*.safetensors"))
    assert len(list(tmp_path.glob("quantized/*.safetensors"))) == 2 and len(rng) == 1
    for b in quant.BACKENDS.values():
        monkeypatch.setattr(b, "quantize", lambda *a, **k: pytest.fail("quantized again despite the cache"))
    rng[0].unlink()  # without the RNG state, the modules are built drawing the RNG as quantizing did
    second = loss_grads_logits(*over)
    assert rng[0].exists()
    draws = []
    for b in quant.BACKENDS.values():
        monkeypatch.setattr(b, "rebuild", lambda *a, at, _r=b.rebuild: draws.append(at) or _r(*a, at=at))
    built, loss, grads, logits = loss_grads_logits(*over)  # built on meta, the RNG state restored
    assert draws and set(draws) == {"meta"}
    for got in (first[1:], second[1:], (loss, grads, logits)):
        assert got[0] == ref_loss and torch.equal(got[2], ref_logits)
        assert all(torch.equal(got[1][k], ref_grads[k]) for k in ref_grads)
    assert built.base_bytes == first[0].base_bytes


ALLOCATOR_PROBE = """
import sys, torch
from safetensors.torch import save_file
sys.path.insert(0, "tests")
from conftest import make_cfg
from qft import accel
import test_speed_switches as t
print(accel.tune_host_allocator(accel.switches(make_cfg(f"accel.host_allocator={sys.argv[1]}"), "cpu")["host_allocator"]))
_, loss, grads, logits = t.loss_grads_logits(f"accel.host_allocator={sys.argv[1]}")
save_file({**{"g." + k: v for k, v in grads.items()}, "logits": logits, "loss": torch.tensor(loss)}, sys.argv[2])
"""


def test_tuned_host_allocator_changes_no_numbers(tmp_path):
    """The allocator setting is process-wide, so each side runs in a fresh process of its own."""
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    root = Path(__file__).resolve().parent.parent
    out = {}
    for setting in ("default", "tuned"):
        res = subprocess.run([sys.executable, "-c", ALLOCATOR_PROBE, setting, str(tmp_path / setting)], cwd=root,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout.strip().splitlines()[-1] == str(setting == "tuned")  # only the tuned process changed it
        out[setting] = load_file(tmp_path / setting)
    assert out["default"].keys() == out["tuned"].keys()
    assert all(torch.equal(out["default"][k], out["tuned"][k]) for k in out["default"])


# ---------------------------------------------------------------- adapter.dropout_mask=fast: another random stream
# It changes which elements are dropped (so it is part of the config hash), not the distribution or the math.

def test_fast_dropout_keeps_the_rate_and_scales_like_inverted_dropout():
    from qft.adapter import FastDropout

    drop = FastDropout(0.05).train()
    x = torch.randn(1000, 1000, dtype=torch.float32, requires_grad=True)
    torch.manual_seed(0)
    y = drop(x)
    kept = y != 0
    p_exact = round(0.05 * 65536) / 65536
    n = x.numel()
    sigma = (n * p_exact * (1 - p_exact)) ** 0.5
    assert abs((n - int(kept.sum())) - n * p_exact) < 5 * sigma
    assert torch.equal(y[kept], x[kept] * (65536 / (65536 - 3277)))
    y.backward(torch.ones_like(y))  # the gradient goes through the very same mask, scaled the same
    assert torch.equal(x.grad, kept.float() * (65536 / (65536 - 3277)))
    torch.manual_seed(0)
    assert torch.equal(drop(x), y)  # drawn from torch's global generator: seeds and checkpoints govern it
    assert drop.eval()(x) is x and FastDropout(0.0).train()(x) is x
    # each of the four 16-bit lanes of one 64-bit draw keeps at the rate, and the lanes are independent of each other
    lanes = kept.view(-1, 4).float()
    assert torch.all((lanes.mean(0) - (1 - p_exact)).abs() < 5 * (p_exact / (n / 4)) ** 0.5)
    half = FastDropout(0.5).train()
    torch.manual_seed(1)
    dropped = (half(torch.ones(4 * 250_000)) == 0).view(-1, 4).float()
    for i in range(4):
        for j in range(i + 1, 4):  # P(both dropped) = 1/4 for independent lanes, 1/2 if one draw fed both
            both = (dropped[:, i] * dropped[:, j]).mean().item()
            assert abs(both - 0.25) < 5 * (0.25 * 0.75 / 250_000) ** 0.5, (i, j, both)


@pytest.mark.parametrize("dtype, as_int", [(torch.float32, torch.int32), (torch.bfloat16, torch.int16)])
def test_fast_dropout_applies_its_mask_with_the_bits_of_a_multiply_by_the_bool_mask(dtype, as_int):
    from qft.adapter import _MaskedScale

    x = torch.randn(64, 96).to(dtype)
    x[0, :8], x[1, :8] = -0.0, 0.0  # signed zeros, dropped and kept
    lanes = torch.randint(-32768, 32768, x.shape, dtype=torch.int16, generator=torch.Generator().manual_seed(0))
    lanes[0, ::2] = lanes[1, ::2] = -32768
    threshold, scale = 3277 - 32768, 65536 / (65536 - 3277)
    keep = lanes >= threshold
    grad = torch.randn(x.shape).to(dtype)
    x.requires_grad_(True)
    y = _MaskedScale.apply(x, lanes, threshold, scale, False, True)  # torch's ops (compiled: tests/test_kernels.py)
    y.backward(grad)
    bits = lambda t: t.detach().view(as_int)  # noqa: E731
    assert y.dtype == dtype and torch.equal(bits(y), bits((x.detach() * keep).mul_(scale)))
    assert torch.equal(bits(x.grad), bits((grad * keep).mul_(scale)))
    neg_zero = bits(torch.tensor(-0.0, dtype=dtype))
    assert (bits(y)[0, :8] == neg_zero).all() and (bits(y)[(~keep) & (x < 0)] == neg_zero).all()  # signs kept


def test_fast_dropout_on_every_adapter_and_only_there():
    from qft.adapter import FastDropout

    _, _, fast = build("adapter.dropout_mask=fast", "adapter.attn.r=4", "adapter.mlp.r=0")
    _, _, ref = build("adapter.dropout_mask=torch", "adapter.attn.r=4", "adapter.mlp.r=0")
    def drops(m):
        return [type(d).__name__ for mod in m.modules() if isinstance(getattr(mod, "lora_dropout", None),
                                                                       torch.nn.ModuleDict)
                for d in mod.lora_dropout.values()]
    assert drops(fast.model) == ["FastDropout"] * 4 * 4  # tiny_llama: 4 layers x q, k, v, o
    assert drops(ref.model) == ["Dropout"] * 16
    assert all(isinstance(m, FastDropout) is False for m in ref.model.modules())
    # same parameters, same initialisation: only the dropout draws differ
    pf, pr = dict(fast.model.named_parameters()), dict(ref.model.named_parameters())
    assert pf.keys() == pr.keys() and all(torch.equal(pf[k], pr[k]) for k in pf)


def test_fast_dropout_mask_is_in_the_hash():
    from conftest import make_cfg
    from qft import record

    fast, torch_mask = make_cfg("adapter.dropout_mask=fast"), make_cfg("adapter.dropout_mask=torch")
    assert record.config_hash(fast) != record.config_hash(torch_mask)


def test_lm_head_reads_a_dense_input_as_one_matmul():
    """logits_to_keep hands the head a strided slice of the hidden states; without qft's pre-hook that linear runs
    as a batched matmul over an expanded weight (slow in fp32). With it: one mm, the same logits and gradients."""
    def run(hooked):
        _, _, built = build("quant.compute_dtype=fp32", "adapter.dropout=0.0", "accel.fuse_projections=false")
        net = built.model
        head = net.get_output_embeddings()
        assert list(head._forward_pre_hooks.values()) == [model.dense_input]
        if not hooked:
            head._forward_pre_hooks.clear()
        spread_lora_b(net)
        with torch.profiler.profile() as prof:
            loss, _, _ = train.answer_loss(net, PROMPTS, ANSWERS, 2, torch.float32)
            loss.backward()
        ops = {e.key for e in prof.key_averages()}
        return loss, {k: p.grad for k, p in net.named_parameters() if p.requires_grad}, ops

    loss, grads, ops = run(True)
    ref_loss, ref_grads, ref_ops = run(False)
    assert "aten::bmm" in ref_ops and "aten::bmm" not in ops  # SDPA, not bmm, runs the attention here
    assert torch.allclose(loss, ref_loss, rtol=1e-6)
    for k in grads:  # the same products summed in one call: equal within fp32 reassociation, whose error scales
        # with the magnitude of the terms summed, not of their sum: near-zero entries are bounded by the tensor's
        # scale (on an AMX CPU, differences up to 2.7e-7 in a tensor whose largest entry is 0.43)
        assert torch.allclose(grads[k], ref_grads[k], rtol=1e-5, atol=1e-5 * ref_grads[k].abs().max().item()), k


# ---------------------------------------------------------------- quant.attention_dtype=fp32: other rounding, hashed
# It runs the model's SDPA in fp32 under bf16 autocast (faster on CPUs, more precise): numbers change, so it is
# part of the config hash; with fp32 compute it changes nothing.

SDPA = torch.nn.functional.scaled_dot_product_attention


def attention_calls(monkeypatch, *overrides, dtype=torch.bfloat16):
    """Loss, gradients and what each SDPA call saw (autocast on?, the output's dtype) on a left-padded batch."""
    seen = []

    def spy(q, k, v, *args, **kwargs):
        out = SDPA(q, k, v, *args, **kwargs)
        seen.append((torch.is_autocast_enabled("cpu"), out.dtype))
        return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    _, _, built = build("adapter.dropout=0.0", *overrides)
    spread_lora_b(built.model)
    loss, n, _ = train.answer_loss(built.model, PROMPTS, ANSWERS, 2, dtype)
    (loss / n).backward()
    return loss.item(), {k: p.grad for k, p in built.model.named_parameters() if p.requires_grad}, seen


def test_fp32_attention_runs_sdpa_in_fp32_under_bf16_autocast(monkeypatch):
    loss, grads, seen = attention_calls(monkeypatch, "quant.compute_dtype=bf16", "quant.attention_dtype=fp32")
    ref_loss, ref_grads, ref_seen = attention_calls(monkeypatch, "quant.compute_dtype=bf16")
    assert seen == [(False, torch.float32)] * 4 and ref_seen == [(True, torch.bfloat16)] * 4  # tiny_llama: 4 layers
    assert loss != ref_loss and abs(loss - ref_loss) < 1e-2 * abs(ref_loss)  # other rounding, the same model
    assert grads.keys() == ref_grads.keys()
    for k in grads:  # bf16 rounding apart, as a whole
        assert (grads[k] - ref_grads[k]).norm() < 0.1 * ref_grads[k].norm(), k


def test_fp32_attention_changes_nothing_in_fp32(monkeypatch):
    loss, grads, seen = attention_calls(monkeypatch, "quant.compute_dtype=fp32", "quant.attention_dtype=fp32",
                                        dtype=torch.float32)
    ref_loss, ref_grads, _ = attention_calls(monkeypatch, "quant.compute_dtype=fp32", dtype=torch.float32)
    assert seen == [(False, torch.float32)] * 4 and loss == ref_loss
    assert all(torch.equal(grads[k], ref_grads[k]) for k in grads)


def test_attention_dtype_is_checked_and_hashed():
    from conftest import make_cfg
    from qft import record
    from qft.errors import QftError

    fp32, default = make_cfg("quant.attention_dtype=fp32"), make_cfg()
    assert record.config_hash(fp32) != record.config_hash(default)
    before = record.resolved(default)
    del before["quant"]["attention_dtype"]  # configs made before the key hash as its default
    assert record.config_hash(before, inputs_=record.inputs(default)) == record.config_hash(default)
    with pytest.raises(QftError, match="quant.attention_dtype.*compute, fp32"):
        quant.check(make_cfg("quant.attention_dtype=bf16").quant)
    cfg, source, built = build()
    eager = model.load(source)
    eager.set_attn_implementation("eager")
    with pytest.raises(QftError, match="quant.attention_dtype.*'eager'"):
        model.attention_dtype(eager, "fp32")
    fp32 = model.load(source)  # each model owns its config: the setting of one leaves the next load alone
    model.attention_dtype(fp32, "fp32")
    assert fp32.config._attn_implementation == "qft_sdpa_fp32"
    assert model.load(source).config._attn_implementation == "sdpa"


# ---------------------------------------------------------------- start-up inside a sweep: the tokenizer read once

def test_tokenizer_is_read_once_per_folder_state_and_handed_out_as_a_copy(tmp_path):
    import dataclasses
    import os
    import shutil

    from conftest import make_cfg

    cfg = make_cfg()
    source = model.resolve(cfg.model, cfg.cache_dir)
    folder = shutil.copytree(source.tokenizer_dir, tmp_path / "tokenizer")
    mine = dataclasses.replace(source, tokenizer_dir=folder)
    before = model._read_tokenizer.cache_info().misses
    first = model.load_tokenizer(mine)
    first.padding_side = "right"  # a caller's change stays with its copy
    second = model.load_tokenizer(mine)
    assert second is not first and second.padding_side == "left" and second.pad_token is not None
    assert second("a test sentence")["input_ids"] == first("a test sentence")["input_ids"]
    assert model._read_tokenizer.cache_info().misses == before + 1  # read once
    # the Rust backend is shared within a thread, not copied: what qft does with a tokenizer leaves it as read
    assert second.backend_tokenizer is first.backend_tokenizer
    import threading

    other = []
    thread = threading.Thread(target=lambda: other.append(model.load_tokenizer(mine)))  # a sweep job run as a thread
    thread.start()
    thread.join()
    assert other[0].backend_tokenizer is not first.backend_tokenizer
    assert other[0]("a test sentence")["input_ids"] == first("a test sentence")["input_ids"]
    state = second.backend_tokenizer.to_str()
    task = data.prepare(cfg.data, first, tmp_path / "cache")  # every example tokenized (a fresh cache)
    assert second.backend_tokenizer.to_str() == state
    first(["a b", "a"], padding=True, truncation=True, max_length=1)  # a caller's padded call: each call sets its own
    assert data.prepare(cfg.data, second, tmp_path / "other").splits == task.splits
    some = next(f for f in sorted(folder.iterdir()) if f.is_file())
    os.utime(some, ns=(some.stat().st_atime_ns, some.stat().st_mtime_ns + 10**9))  # the folder changed: read again
    model.load_tokenizer(mine)
    assert model._read_tokenizer.cache_info().misses == before + 3  # the other thread's read, then this one's


def sweep_in_process(tmp_path, monkeypatch, *overrides) -> tuple[list, list]:
    """A 4-job smoke multirun through `qft.__main__.main` in this process, each job a fake run that makes a reference
    cycle (job 1 crashes, job 2 fails with a QftError, both with the cycle in their frames). Returns, per job, the
    frozen count when it started and which earlier cycles were collected by then; and the cycles' weak references."""
    import gc
    import sys
    import weakref

    from qft import __main__ as cli
    from qft import run as run_module
    from qft.errors import QftError

    class Cycle:
        def __init__(self):
            self.me = self

    seen, refs = [], []

    def fake_run(cfg, run_dir, keys=None):
        seen.append((gc.get_freeze_count(), [r() is None for r in refs]))
        big = Cycle()
        refs.append(weakref.ref(big))
        if len(seen) == 1:
            raise RuntimeError("a crash, its frame holding a cycle")  # a sweep records it and goes on
        if len(seen) == 2:
            raise QftError("adapter.attn.r", -1, "allowed: 0 or more")
        return {"status": "ok", "final_accuracy": {"val": 0.5}}

    monkeypatch.setattr(run_module, "run", fake_run)
    monkeypatch.setattr(cli, "STARTED", [])
    monkeypatch.setattr(cli, "pin_gpu", lambda *a: None)
    monkeypatch.setattr(sys, "argv", ["qft", "--multirun", "+experiment=smoke", f"hydra.sweep.dir={tmp_path}",
                                      "hydra/job_logging=none", "hydra/hydra_logging=none", *overrides])
    gc.unfreeze()
    try:
        cli.main()
        return seen, [r() is None for r in refs]
    finally:
        gc.unfreeze()


def test_a_sweep_freezes_what_survives_a_run_and_collects_its_cycles_first(tmp_path, monkeypatch):
    """Hydra's basic launcher runs a sweep's jobs in this process: between them qft collects, then freezes, so a
    full collection no longer walks the imported stack. A finished run is not frozen: its reference cycles (here
    held by a crashed and a failed run's frames) are collected first, and the next run's objects stay collectable."""
    seen, dead_after = sweep_in_process(tmp_path, monkeypatch)
    assert len(seen) == 4  # the smoke grid
    assert seen[0][0] == 0 and all(frozen > 0 for frozen, _ in seen[1:])
    assert all(all(dead) for _, dead in seen)  # each earlier run's cycle was collected, none frozen
    assert len(dead_after) == 4 and all(dead_after)  # the last one's too, after the sweep
