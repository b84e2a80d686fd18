"""Every single-GPU CUDA path of qft, checked in a few minutes, printed as one table: `bash scripts/gpu_check.sh`.

The lent GPU machine is bare (its Python has torch, transformers and peft, but no bitsandbytes, Hydra or gguf) and
reaches no registry, so scripts/gpu_check.sh installs the wheels that scripts/fetch_gpu_wheels.sh put in .whl/.
The model is a randomly initialised LLaMA of SmolLM2-135M's shape (no weights to carry, no tokenizer: token ids are
drawn at random). On a CPU the same script runs the parts a CPU can, and says which it skipped and why.
"""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qft import config, layers, model, offload, quant, train  # noqa: E402
from qft.planning import measure
from qft.tools import memory
from qft import adapter as qadapter  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
SHAPE = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30 if CUDA else 2,
             num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048,
             tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)
ROWS: list[tuple[str, str, str, float]] = []


def cfg(*overrides):
    c = config.compose(["model=tiny_llama", "device=cuda" if CUDA else "device=cpu", "quant.cache_quantized=false",
                        "adapter.dropout=0.0", *overrides], "gpu_check")
    for k, v in SHAPE.items():
        c.model.arch[k] = v
    return c


def source(c) -> model.Source:
    from transformers import AutoConfig

    return model.Source("random-smollm2-shape", None, Path("."), AutoConfig.for_model(**dict(c.model.arch)), seed=0)


def built(c):
    torch.manual_seed(0)
    net = model.load(source(c))
    model.attention_dtype(net, c.quant.attention_dtype)
    projections = layers.classify(net, "llama")
    quant.quantize(net, c.quant, projections, DEV, None)
    net, _ = qadapter.attach(net, c.adapter, projections)
    net.to(DEV)
    with torch.no_grad():  # peft starts B at zero, which would hide the A gradients
        for n, p in net.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.02, generator=torch.Generator().manual_seed(len(n)))
    return net


def batch(n=8, prompt=48, answer=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, SHAPE["vocab_size"], (n, prompt + answer), generator=g).tolist()
    return [r[:prompt] for r in ids], [r[prompt:] for r in ids]


def check(name):
    def wrap(fn):
        t0 = time.perf_counter()
        try:
            status, detail = fn()
        except Exception as e:  # noqa: BLE001 - a failed check is a row, the others still run
            status, detail = "FAIL", f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
            traceback.print_exc(file=sys.stderr)
        ROWS.append((name, status, detail, time.perf_counter() - t0))
        return fn
    return wrap


def skip(reason):
    return "skipped", reason


def dequantized(m) -> torch.Tensor:
    import bitsandbytes as bnb

    if isinstance(m, bnb.nn.Linear4bit):
        return bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state).float()
    return m.weight.data.float() * m.weight.SCB.float()[:, None] / 127


def grads_against_reference(preset, name, int8_activations=False):
    net = built(cfg(f"quant={preset}", "quant.compute_dtype=fp32"))
    lora = net.get_base_model().get_submodule(name)
    w = dequantized(lora.base_layer)
    a, b, s = lora.lora_A["default"].weight, lora.lora_B["default"].weight, lora.scaling["default"]
    x = torch.randn(4, 16, lora.in_features, device=DEV, requires_grad=True)
    target = torch.randn(4, 16, lora.out_features, device=DEV)
    ((lora(x) - target) ** 2).sum().backward()
    xr, ar, br = (t.detach().clone().requires_grad_(True) for t in (x, a, b))
    if int8_activations:  # LLM.int8 (CUDA): row-wise absmax int8 activations times the int8 weight
        flat = xr.reshape(-1, xr.shape[-1])
        sx = flat.abs().amax(1, keepdim=True).detach()
        q = torch.round(flat / sx * 127).detach() + (flat - flat.detach())  # straight-through for the x gradient
        base = (q @ (w * 127 / lora.base_layer.weight.SCB.float()[:, None]).t()) * sx / 127 \
            * lora.base_layer.weight.SCB.float()[None, :] / 127
        base = base.reshape(*xr.shape[:-1], -1)
    else:
        base = xr @ w.t()
    ((base + s * (xr @ ar.t()) @ br.t() - target) ** 2).sum().backward()
    errs = [((g - r).abs().max() / r.abs().max()).item() for g, r in ((x.grad, xr.grad), (a.grad, ar.grad),
                                                                        (b.grad, br.grad))]
    return max(errs)


@check("NF4 forward/backward vs dequantized reference")
def _():
    err = grads_against_reference("nf4", "model.layers.1.mlp.down_proj")
    return ("ok" if err < 1e-3 else "FAIL"), f"max relative gradient error {err:.2e} (bound 1e-3)"


@check("int8 forward/backward vs reference")
def _():
    err = grads_against_reference("int8", "model.layers.1.mlp.gate_proj", int8_activations=CUDA)
    bound = 2e-2 if CUDA else 1e-3
    ref = "LLM.int8 (int8 activations)" if CUDA else "dequantized weight (the CPU path)"
    return ("ok" if err < bound else "FAIL"), f"against {ref}: max relative gradient error {err:.2e} (bound {bound:g})"


@check("paged 8-bit AdamW")
def _():
    if not CUDA:
        return skip("CUDA only")
    import bitsandbytes as bnb

    moved = []
    for opt_cls in (torch.optim.AdamW, bnb.optim.PagedAdamW8bit):
        net = built(cfg())
        params = [p for p in net.parameters() if p.requires_grad]
        before = torch.cat([p.detach().flatten().clone() for p in params])
        opt = opt_cls(params, lr=1e-3)
        for _ in range(3):
            prompts, answers = batch()
            loss, n, _ = train.answer_loss(net, prompts, answers, 2, torch.bfloat16)
            (loss / n).backward()
            opt.step()
            opt.zero_grad()
        moved.append(torch.cat([p.detach().flatten() for p in params]) - before)
    cos = torch.nn.functional.cosine_similarity(moved[0], moved[1], dim=0).item()
    return ("ok" if cos > 0.9 else "FAIL"), f"3 steps: update cosine to torch AdamW's {cos:.4f} (bound 0.9)"


@check("offload=activations vs none (streams, pinned buffers, prefetch)")
def _():
    out = []
    for mode in ("none", "activations"):
        c = cfg(f"offload={mode}")
        net = built(c)
        prompts, answers = batch()
        with offload.hooks(c.offload, DEV):
            loss, n, _ = train.answer_loss(net, prompts, answers, 2, torch.bfloat16 if CUDA else torch.float32)
        (loss / n).backward()
        out.append((loss.item(), {k: p.grad.clone() for k, p in net.named_parameters() if p.requires_grad}))
    same = out[0][0] == out[1][0] and all(torch.equal(out[0][1][k], out[1][1][k]) for k in out[0][1])
    return ("ok" if same else "FAIL"), "bit-identical loss and gradients" if same else "losses or gradients differ"


@check("compute_dtype=auto")
def _():
    got = model.compute_dtype_name("auto", DEV)
    want = "bf16" if CUDA else ("bf16" if model.native_bf16("cpu") else "fp32")
    return ("ok" if got == want else "FAIL"), f"auto -> {got} on {torch.cuda.get_device_name() if CUDA else 'CPU'}"


@check("memory model vs measured peak")
def _():
    if not CUDA:
        return skip("CUDA only here (benchmarks/memory.py measures the CPU)")
    c = cfg("train.batch_size=8", "data.max_length=64")
    net = built(c)
    prompts, answers = batch(8, 62, 2)
    got = measure.measure_step(net, c.train, [(prompts, answers)], 2, torch.bfloat16)
    est = memory.estimate(c, source(c), answer_tokens=2, padded=False)
    return "ok", f"estimated {est.peak / 2**30:.3f} GiB, measured {got['peak'] / 2**30:.3f} GiB " \
                 f"(max_memory_allocated; ratio {est.peak / got['peak']:.2f})"


@check("tokens/s vs the stock HF QLoRA recipe")
def _():
    if not CUDA:
        return skip("CUDA only here (benchmarks/speed.py measures the CPU)")
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    c = cfg("quant.compute_dtype=bf16")
    prompts, answers = batch(16, 62, 2)

    def rate(net, steps=8):
        params = [p for p in net.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)
        for i in range(steps + 2):
            if i == 2:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            loss, n, tok = train.answer_loss(net, prompts, answers, 2, torch.bfloat16)
            (loss / n).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        return steps * 16 * 64 / (time.perf_counter() - t0)

    ours = rate(built(c))
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model.load(source(c)).save_pretrained(tmp)
        stock = AutoModelForCausalLM.from_pretrained(
            tmp, quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                        bnb_4bit_use_double_quant=True,
                                                        bnb_4bit_compute_dtype=torch.bfloat16), device_map={"": 0})
        stock = prepare_model_for_kbit_training(stock, use_gradient_checkpointing=False)
        stock = get_peft_model(stock, LoraConfig(r=8, lora_alpha=16, target_modules=list(layers.PROJECTIONS),
                                                 task_type="CAUSAL_LM"))
        theirs = rate(stock)
    return "ok", f"qft {ours:,.0f} tokens/s, stock {theirs:,.0f} tokens/s: {ours / theirs:.2f}x (batch 16, seq 64, r=8)"


@check("quant.attention_dtype=fp32 vs compute")
def _():
    if not CUDA and not model.native_bf16("cpu"):
        return skip("bf16 autocast is emulated on this CPU")
    out = {}
    for name in ("compute", "fp32"):
        net = built(cfg("quant.compute_dtype=bf16", f"quant.attention_dtype={name}"))
        prompts, answers = batch()
        for i in range(3):  # the third pass is timed
            if CUDA:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss, n, _ = train.answer_loss(net, prompts, answers, 2, torch.bfloat16)
            (loss / n).backward()
            if CUDA:
                torch.cuda.synchronize()
        out[name] = (loss.item(), time.perf_counter() - t0)
    rel = abs(out["fp32"][0] - out["compute"][0]) / abs(out["compute"][0])
    return ("ok" if rel < 1e-2 else "FAIL"), f"loss {rel:.1e} apart (bound 1e-2: bf16 rounding); a forward + backward " \
        f"{out['fp32'][1] / out['compute'][1]:.2f}x the compute dtype's time"


@check("2-process NCCL pipeline vs one process")
def _():
    return skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}") if torch.cuda.device_count() < 2 \
        else skip("run: torchrun --nproc-per-node 2 -m qft offload=pipeline offload.stages=2 (tests/test_pipeline.py)")


@check("offload.route=neighbour (NVLink peer)")
def _():
    if torch.cuda.device_count() < 2:
        return skip(f"needs 2 GPUs with peer access, this machine has {torch.cuda.device_count()}")
    return ("ok" if torch.cuda.can_device_access_peer(0, 1) else "skipped"), "peer access 0 -> 1"


def main() -> int:
    print(f"qft GPU check on {torch.cuda.get_device_name() if CUDA else 'CPU (no CUDA device)'}; torch "
          f"{torch.__version__}; model: random LLaMA, SmolLM2-135M's shape with {SHAPE['num_hidden_layers']} layers\n")
    print("| check | result | detail | seconds |\n|---|---|---|---|")
    for name, status, detail, secs in ROWS:
        print(f"| {name} | {status} | {detail} | {secs:.1f} |")
    return 1 if any(s == "FAIL" for _, s, _, _ in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
