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
