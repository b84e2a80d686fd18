import pytest
import torch
from peft import PeftModel

from qft import layers, model, quant
from conftest import build


def test_adapter_round_trip_through_stock_peft(tmp_path):
    cfg, source, built = build("quant=attn8_mlp4", "adapter.mlp.r=4", "+adapter.projections.v_proj={r:16}")
    with torch.no_grad():  # a trained-looking adapter: B is zero at init
        for n, p in built.model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    built.model.eval()
    ids = torch.randint(0, 49152, (2, 12))
    want = built.model(input_ids=ids).logits
    built.model.save_pretrained(tmp_path)

    base = model.load(source)  # the same base, quantized the same way, then stock peft loading
    quant.quantize(base, cfg.quant, layers.classify(base, "llama"), torch.device("cpu"))
    loaded = PeftModel.from_pretrained(base, tmp_path).eval()
    got = loaded(input_ids=ids).logits
    assert torch.equal(got, want)
    with loaded.disable_adapter():  # and the adapter is what makes them so
        assert not torch.allclose(loaded(input_ids=ids).logits, want, atol=1e-3)


@pytest.mark.parametrize("preset,want", [
    ("nf4", {"Linear4bit"}), ("int8", {"Linear8bitLt"}), ("attn8_mlp4", {"Linear4bit", "Linear8bitLt"}),
    ("none", {"Linear"})])
def test_every_module_is_the_class_stock_peft_builds(preset, want):
    """The stock path (from_pretrained(quantization_config=...), get_peft_model) wraps bitsandbytes layers in
    peft's lora.bnb classes; qft's live model must too, mixed bits included."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora.bnb import Linear4bit as Lora4, Linear8bitLt as Lora8

    _, _, built = build(f"quant={preset}")
    base = built.model.get_base_model()
    expected = {"Linear4bit": Lora4, "Linear8bitLt": Lora8, "Linear": LoraLinear}
    got = set()
    for layer in built.projections:
        m = base.get_submodule(layer.name)
        kind = type(m.base_layer).__name__
        got.add(kind if kind != "Dequantized" else "Linear")
        assert type(m) is expected[kind if kind in expected else "Linear"], (layer.name, type(m))
    assert got == want


def trained_looking(*overrides):
    cfg, source, built = build("quant.compute_dtype=fp32", "adapter.dropout=0.0", *overrides)
    with torch.no_grad():
        for n, p in built.model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(n)))
    return cfg, source, built.model.eval()


IDS = torch.randint(3, 49152, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("preset,bound", [("nf4", 0.3), ("int8", 0.03)])
def test_merge_and_unload_on_a_quantized_base_is_within_requantization_error(preset, bound):
    """Merging re-quantizes base + adapter (measured on tiny_llama: 0.12 max logit difference at 4 bits, 0.012 at
    8 bits); it must work, and be no worse than bitsandbytes' requantization error allows."""
    _, _, net = trained_looking(f"quant={preset}")
    with torch.no_grad():
        want = net(input_ids=IDS).logits
        merged = net.merge_and_unload()
        got = merged(input_ids=IDS).logits
    diff = (got - want).abs().max().item()
    assert 0 < diff < bound, diff
    assert not any("lora" in n for n, _ in merged.named_parameters())


@pytest.mark.parametrize("preset", ["nf4", "int8", "attn8_mlp4"])
def test_merging_into_the_dequantized_base_keeps_the_logits(preset, tmp_path):
    cfg, source, net = trained_looking(f"quant={preset}")
    # bitsandbytes' int8 layer quantizes its inputs too in eval mode (LLM.int8 inference: 4e-3 off on tiny_llama)
    # and multiplies by the dequantized weight in training mode; dropout is 0, so train mode is deterministic
    with torch.no_grad():
        want = net.train()(input_ids=IDS).logits
    net.save_pretrained(tmp_path)
    base = model.load(source)  # the same base, quantized the same way, then dequantized: the deployment recipe
    quant.quantize(base, cfg.quant, layers.classify(base, "llama"), torch.device("cpu"))
    merged = PeftModel.from_pretrained(quant.dequantize(base), tmp_path).merge_and_unload()
    with torch.no_grad():
        got = merged(input_ids=IDS).logits
    assert (got - want).abs().max().item() < 1e-5


def test_the_saved_adapter_on_a_stock_quantized_base_reproduces_the_records_accuracy(tmp_path):
    """Uniform NF4 (what BitsAndBytesConfig can express): the base quantized by the stock path
    (from_pretrained(quantization_config=...)) plus stock PeftModel.from_pretrained scores the test split as the
    run did."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from qft import data, evaluate, record, run
    from conftest import make_cfg
    from test_predict import dataset

    over = dataset(tmp_path / "reviews.csv")
    cfg = make_cfg(*over, "quant.compute_dtype=fp32", "train.steps=3", "train.batch_size=8", "train.zero_shot=false",
                   "train.eval_every=0", "train.checkpoint_every=0")
    rec = run.run(cfg, tmp_path / "run")
    source = model.resolve(cfg.model, cfg.cache_dir)
    model.load(source).save_pretrained(tmp_path / "base")
    stock = AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", dtype=torch.float32, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32))
    for m in stock.modules():  # as qft does: bitsandbytes' AVX512-BF16 repack fails on a 160-wide block row
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    loaded = PeftModel.from_pretrained(stock, tmp_path / "run" / "adapter").eval()
    tokenizer = model.load_tokenizer(source)
    task = data.prepare(cfg.data, tokenizer, cfg.cache_dir)
    got = evaluate.score(loaded, task, "test", tokenizer, cfg.train.eval_batch_size, torch.float32)
    ex = record.read_examples(tmp_path / "run")["final.test"]
    assert got["accuracy"] == rec["final_accuracy"]["test"]
    assert (got["examples"]["pred"] == ex["pred"]).all()
