"""The real packaged model on real data: SmolLM2-135M (NF4) on BBC News, a few steps."""

from qft import record, run
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
