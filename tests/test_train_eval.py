import pytest
from pathlib import Path

import torch

from qft import evaluate, model, record, run, schema, train
from qft.accel import rope
from conftest import TINY_DATA, build, make_cfg


def trained_looking(built):
    with torch.no_grad():
        for n, p in built.model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.2)
    return built.model


def test_answer_loss_matches_full_sequence_reference():
    _, _, built = build("quant.compute_dtype=fp32", "adapter.dropout=0.0")
    net = trained_looking(built).eval()
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23]]
    answers = [[100], [200, 201, 202], [300, 301]]
    loss, n, _ = train.answer_loss(net, prompts, answers, 2, torch.float32)
    ref, count = 0.0, 0
    for p, a in zip(prompts, answers):  # one unpadded sequence at a time, HF's own shifted loss
        ids = torch.tensor([p + a])
        labels = torch.tensor([[-100] * len(p) + a])
        out = net(input_ids=ids, labels=labels)
        ref += out.loss.item() * len(a)
        count += len(a)
    assert n == count == 6
    assert abs(loss.item() - ref) < 1e-4 * ref


def test_scores_do_not_depend_on_padding_or_batching(tokenizer):
    _, _, built = build("quant.compute_dtype=fp32", "adapter.dropout=0.0")
    net = trained_looking(built).eval()
    prompts = [[1, 5, 9, 33, 41, 7], [1, 8], [1, 4, 4, 2000, 19]]
    labels = [[24406], [293, 1327, 358], [99, 773]]  # business, entertainment (3 tokens), sport (2)
    batched = evaluate.label_scores(net, prompts, labels, 2, 8, torch.float32)
    single = torch.cat([evaluate.label_scores(net, [p], labels, 2, 1, torch.float32) for p in prompts])
    assert torch.allclose(batched, single, atol=1e-4)
    # the KV-cache scoring of multi-token words equals a plain forward over prompt + word
    for i, p in enumerate(prompts):
        for c, word in enumerate(labels):
            logits = net(input_ids=torch.tensor([p + word])).logits[0].float().log_softmax(-1)
            want = sum(logits[len(p) - 1 + j, t] for j, t in enumerate(word))
            assert abs(batched[i, c].item() - want.item()) < 1e-4


def test_micro_batches_are_a_seeded_pure_function_of_the_step():
    n, bs = 10, 4
    epoch0 = [train.micro_batch_indices(n, bs, s, 3) for s in range(2)]
    assert len(set(epoch0[0]) | set(epoch0[1])) == 8
    assert train.micro_batch_indices(n, bs, 1, 3) == epoch0[1]
    assert train.micro_batch_indices(n, bs, 1, 4) != epoch0[1]


def test_lr_schedule_closed_forms():
    import math

    for schedule, want in (("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))), ("linear", lambda p: 1 - p),
                           ("constant", lambda p: 1.0)):
        cfg = make_cfg("train.steps=20", "train.warmup_steps=4", f"train.schedule={schedule}").train
        f = [train.lr_factor(cfg, s) for s in range(20)]
        assert f[:4] == [0.25, 0.5, 0.75, 1.0]
        for s in range(4, 20):
            assert f[s] == pytest.approx(want((s - 4) / 16), abs=1e-12), (schedule, s)


RUN = ["train.steps=6", "train.batch_size=4", "train.grad_accum=2", "train.eval_every=0", "train.checkpoint_every=2",
       "train.zero_shot=false", "adapter.dropout=0.1", *TINY_DATA]


def test_resume_continues_a_killed_run_to_the_same_result(tmp_path, monkeypatch):
    from qft.frame import run_kind

    straight = run.run(make_cfg(*RUN), tmp_path / "a")
    first = run.run(make_cfg(*RUN, "train.stop_after_steps=3"), tmp_path / "b")
    assert first["status"] == "incomplete" and first["steps"] == 3
    assert record.read(tmp_path / "b")["status"] == "incomplete"
    here = record.cpu_kind()
    monkeypatch.setattr(record, "cpu_kind", lambda: ("Another CPU", "another_kind"))  # finished on another machine
    resumed = run.run(make_cfg(*RUN, "train.resume=true"), tmp_path / "b")
    assert resumed["status"] == "ok" and resumed["config_hash"] == straight["config_hash"]
    assert resumed["loss_curve"] == straight["loss_curve"]
    # the record names both machines, so the report cannot take the run for the finishing machine's alone
    assert "execution_history" not in straight
    assert [(e["cpu"], e["cpu_kind"]) for e in resumed["execution_history"]] == [here, ("Another CPU", "another_kind")]
    kind = run_kind(resumed["execution"], resumed["versions"], resumed["execution_history"])
    assert kind.startswith("mixed within one run: ") and "Another CPU" in kind and "another_kind," in kind and here[1] in kind
    assert run_kind(straight["execution"], straight["versions"]) == run_kind(
        straight["execution"], straight["versions"], [straight["execution"]])  # one kind: not mixed
    from safetensors.torch import load_file
    a = load_file(tmp_path / "a" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "b" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_its_benchmark_fails_keeps_its_checkpoint_and_resumes(tmp_path, monkeypatch):
    """The checkpoint outlives training until the benchmarks after it are done: an MMLU failure after hours of
    training costs the steps since the last checkpoint, not the run."""
    straight = run.run(make_cfg(*RUN), tmp_path / "a")
    assert not (tmp_path / "a" / "checkpoint").exists()

    def fails(*args):
        raise RuntimeError("the benchmark broke")

    monkeypatch.setattr(evaluate, "benchmarks", fails)
    with pytest.raises(RuntimeError):
        run.run(make_cfg(*RUN), tmp_path / "b")
    assert record.read(tmp_path / "b")["status"] == "failed" and (tmp_path / "b" / "checkpoint").is_dir()
    monkeypatch.undo()
    resumed = run.run(make_cfg(*RUN, "train.resume=true"), tmp_path / "b")
    assert resumed["status"] == "ok" and resumed["loss_curve"] == straight["loss_curve"]
    assert not (tmp_path / "b" / "checkpoint").exists()


def test_record_is_complete(tmp_path):
    rec = run.run(make_cfg(*RUN), tmp_path)
    assert record.read(tmp_path) == rec
    for key in ("config", "config_hash", "status", "trainable_params", "base_bytes", "zero_shot_accuracy",
                "final_accuracy", "loss_curve", "train_tokens_per_second", "wall_seconds", "memory", "seed", "versions"):
        assert key in rec, key
    assert rec["status"] == "ok" and len(rec["loss_curve"]) == 6
    assert set(rec["final_accuracy"]) == {"val", "test"}
    # the run's own high-water mark: about what is resident now, at most the high-water mark now (no reset since);
    # pages first touched after the record was taken (reading it back, the test's own work) may add to what is
    # resident now: CI met one page more (4 KiB of 2.7 GB)
    status = dict(l.split(":", 1) for l in Path("/proc/self/status").read_text().splitlines() if ":" in l)
    resident, hwm = (int(status[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))
    assert resident - 64 * 2**20 <= rec["memory"]["peak_rss_bytes"] <= hwm
    assert rec["versions"]["peft"] and rec["versions"]["bitsandbytes"]
    from peft import PeftConfig
    assert PeftConfig.from_pretrained(rec["adapter_dir"]).peft_type == "LORA"


def test_instruction_data_trains_and_scores_by_exact_match(tmp_path):
    import json

    f = tmp_path / "alpaca.jsonl"
    f.write_text("".join(json.dumps({"instruction": "Repeat the word.", "input": w, "output": w}) + "\n"
                         for w in (f"{a}{b}" for a in ["red", "blue", "tall", "old"] for b in "abcdefgh")))
    rec = run.run(make_cfg("data=alpaca", f"data.path={f}", "data.train_size=16", "data.val_size=4",
                           "data.test_size=4", "data.max_length=64", "train.steps=2", "train.batch_size=4",
                           "train.eval_every=0", "train.checkpoint_every=0"), tmp_path / "run")
    assert rec["status"] == "ok" and rec["data"]["task"] == "instruction"
    test = record.read_examples(tmp_path / "run")["final.test"]
    assert len(test["correct"]) == 4 and rec["final_accuracy"]["test"] == test["correct"].mean()


def test_exact_match_scores_exactly_what_was_generated(tokenizer):
    """Controlled generations: right, wrong, right with spaces around it, and a prefix of the answer."""
    from qft.data import Split

    refs = ["red", "blue", "tall", "older"]
    outputs = ["red", "green", "  tall \n", "old"]

    class Scripted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def generate(self, input_ids, attention_mask, max_new_tokens, **kw):
            rows = []
            for ids in input_ids:
                i = int(ids[-1])  # each prompt ends with its own index token
                new = tokenizer(outputs[i], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                rows.append(ids.tolist() + (new + [tokenizer.pad_token_id] * 8)[:max_new_tokens])
            return torch.tensor(rows)

    answers = [tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for r in refs]
    split = Split([[7, 8, i] for i in range(4)], answers, [-1] * 4, refs)
    hits = evaluate.exact_match(Scripted(), split, tokenizer, 3, torch.float32)
    assert hits == [True, False, True, False]


def test_resume_refuses_or_ignores_another_configs_checkpoint(tmp_path):
    import pytest
    from qft.errors import QftError

    run.run(make_cfg(*RUN, "train.stop_after_steps=2"), tmp_path)
    with pytest.raises(QftError) as e:
        run.run(make_cfg(*RUN, "train.resume=true", "train.lr=5e-4"), tmp_path)
    assert e.value.key == "train.resume"
    rec = run.run(make_cfg(*RUN, "train.resume=auto", "train.lr=5e-4"), tmp_path)
    fresh = run.run(make_cfg(*RUN, "train.lr=5e-4"), tmp_path / "fresh")
    assert rec["status"] == "ok" and rec["loss_curve"] == fresh["loss_curve"]


def test_ok_records_are_skipped_unless_forced(tmp_path, capsys):
    first = run.run(make_cfg(*RUN), tmp_path)
    assert not (tmp_path / "checkpoint").exists()  # an ok run keeps its adapter, not its checkpoint
    again = run.run(make_cfg(*RUN), tmp_path)
    assert again == first and "already holds an ok record" in capsys.readouterr().out
    forced = run.run(make_cfg(*RUN, "sweep.force=true"), tmp_path)
    assert forced["wall_seconds"] != first["wall_seconds"] and forced["loss_curve"] == first["loss_curve"]


def test_an_ok_record_made_on_another_kind_is_skipped_unless_forced(tmp_path, capsys):
    """A study resumed on a CPU kind where `auto` resolves another compute dtype keeps its finished records: the
    same seed of the same cell (record.cell_key) is skipped, another seed is not."""
    first = run.run(make_cfg(*RUN, "quant.compute_dtype=fp32"), tmp_path)
    capsys.readouterr()
    again = run.run(make_cfg(*RUN, "quant.compute_dtype=bf16"), tmp_path)
    assert again == first and "already holds an ok record" in capsys.readouterr().out
    other_seed = run.run(make_cfg(*RUN, "quant.compute_dtype=bf16", "seed=7"), tmp_path)
    assert other_seed["seed"] == 7 and other_seed["config_hash"] != first["config_hash"]


def test_nan_loss_is_recorded_as_failed(tmp_path, monkeypatch):
    import pytest

    real = train.answer_loss

    def poisoned(*args, **kw):
        loss, n, tokens = real(*args, **kw)
        return loss * float("nan"), n, tokens
    monkeypatch.setattr(train, "answer_loss", poisoned)
    with pytest.raises(FloatingPointError):
        run.run(make_cfg(*RUN), tmp_path)
    rec = record.read(tmp_path)
    assert rec["status"] == "failed" and "loss is nan at step 1" in rec["error"] and rec["traceback"]


def test_non_finite_gradients_with_a_finite_loss_fail_the_run(tmp_path, monkeypatch):
    import pytest

    real = train.answer_loss

    def poisoned(model, *args, **kw):
        loss, n, tokens = real(model, *args, **kw)
        p = next(p for p in model.parameters() if p.requires_grad)
        return loss + 0.0 * torch.sqrt(p - p).sum(), n, tokens  # adds 0; d sqrt at 0 is inf: a nan gradient
    monkeypatch.setattr(train, "answer_loss", poisoned)
    with pytest.raises(FloatingPointError):
        run.run(make_cfg(*RUN), tmp_path)
    rec = record.read(tmp_path)
    assert rec["status"] == "failed" and "gradient norm is nan at step 1" in rec["error"]


def test_seed_changes_lora_init_but_not_a_random_base():
    _, _, a = build("seed=0")
    _, _, b = build("seed=1")
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    lora_a = [k for k in pa if "lora_A" in k]
    assert lora_a and all(not torch.equal(pa[k], pb[k]) for k in lora_a)
    base = [k for k in pa if "norm" in k or "embed" in k]
    assert base and all(torch.equal(pa[k], pb[k]) for k in base)  # model.seed's base, the same for every run seed


def test_checkpoint_keeps_the_cuda_generators(tmp_path, monkeypatch):
    # no GPU here: stand-in generators show that their state is saved and restored with the rest
    states = [torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([4, 5], dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: states)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: restored.extend(s))
    _, _, built = build()
    params = [p for p in built.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    train.save_checkpoint(tmp_path, built.model, opt, sched, train.History(step=1), "h")
    assert train.load_checkpoint(tmp_path, built.model, opt, sched, "h") is not None
    assert len(restored) == 2 and all(torch.equal(a, b) for a, b in zip(restored, states))


def test_sliding_window_models_score_prompts_longer_than_the_window():
    """Gemma-3 mixes sliding-window layers; cropping their cache back after a candidate word raised."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gemma3_text", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
                               layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64)
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    prompts = [list(range(10, 22)), list(range(30, 39))]  # both longer than the window of 4
    labels = [[5], [6, 7, 8], [9, 10]]
    got = evaluate.label_scores(net, prompts, labels, 0, 2, torch.float32)
    for i, p in enumerate(prompts):
        for c, word in enumerate(labels):
            with torch.no_grad():
                logits = net(input_ids=torch.tensor([p + word])).logits[0].float().log_softmax(-1)
            want = sum(logits[len(p) - 1 + j, t] for j, t in enumerate(word))
            assert abs(got[i, c].item() - want.item()) < 1e-4


def test_record_keeps_per_example_scores_and_what_executed_it(tmp_path):
    rec = run.run(make_cfg(*RUN), tmp_path)
    ex = record.read_examples(tmp_path)
    assert set(ex) == {"final.val", "final.test"}
    test = ex["final.test"]
    assert test["loglik"].shape == (15, len(rec["data"]["labels"]))
    assert (test["pred"] == test["loglik"].argmax(1)).all() and (test["correct"] == (test["pred"] == test["gold"])).all()
    assert abs(test["correct"].mean() - rec["final_accuracy"]["test"]) < 1e-12
    assert len(set(test["id"])) == 15
    e = rec["execution"]
    assert e["threads"] == torch.get_num_threads() and e["compute_dtype"] in ("bf16", "fp32") and e["cpu_kind"]
    # the execution switches, on by default and each installed in the tiny llama (numba is a test dependency);
    # split_rows only where torch computes on several threads (at one it never splits)
    assert {k: e[k] for k in record.SWITCHES} == {k: k != "split_rows" or torch.get_num_threads() > 1
                                                   for k in record.SWITCHES}


def test_a_run_records_a_switch_that_found_nothing_to_change_as_off(tmp_path):
    rec = run.run(make_cfg(*[o for o in RUN if not o.startswith("adapter.dropout")], "adapter.dropout=0.0"), tmp_path)
    assert rec["status"] == "ok" and schema.accel_switches(make_cfg(), "cpu")["compiled_masks"] is True
    assert {k: rec["execution"][k] for k in record.SWITCHES} == {
        k: k != "compiled_masks" and (k != "split_rows" or torch.get_num_threads() > 1) for k in record.SWITCHES}


@pytest.mark.parametrize("overrides,off", [
    (["adapter.dropout=0.0"], {"compiled_masks"}),  # no mask to compile
    (["accel.compiled_rope=false", "accel.compiled_sums=false"], {"compiled_rope", "compiled_sums"}),
    (["accel.fuse_projections=false"], {"fuse_projections", "compiled_sums", "split_rows"}),  # no fused groups
    (["refused rope"], {"compiled_rope"}),
])
def test_build_reports_which_execution_switches_it_installed(overrides, off, monkeypatch):
    """A switch on in the config counts only where it was installed: a rotary form the probe refuses, no dropout or
    no fused groups leave it off (what a run's record then says; training off the CPU: the next test)."""
    if overrides == ["refused rope"]:
        monkeypatch.setattr(rope, "_rope_is_hfs", lambda func: False)
        overrides = []
    ran = build(*overrides)[2].ran
    if torch.get_num_threads() == 1:  # split_rows never splits at one thread: not installed
        off = off | {"split_rows"}
    assert ran == {k: k not in off for k in ("fuse_projections", *record.SWITCHES)}


def test_build_leaves_the_thread_count_it_found(monkeypatch, capsys):
    """A library that moves torch's thread count while the model is built (numba's OpenMP start-up did) must not
    leave the run computing at another count than its record names."""
    cfg = make_cfg()
    source = model.resolve(cfg.model, cfg.cache_dir)
    before, real = torch.get_num_threads(), rope.compile_rope
    monkeypatch.setattr(rope, "compile_rope", lambda net: torch.set_num_threads(before + 1) or real(net))
    try:
        run.build(cfg, source, torch.device("cpu"))
        assert torch.get_num_threads() == before
        assert f"thread count moved from {before} to {before + 1} while the model was built" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


def test_build_for_training_elsewhere_installs_no_cpu_switch():
    """A pipeline's stages build on the CPU and train on their GPUs: the CPU loops are not installed there, nor
    fusion, which cuBLAS gives no promise of keeping each column's bits inside a wider matmul (the dense head's cast
    goes with it); the record says so. The CPU build of the same config fuses."""
    cfg = make_cfg()
    source = model.resolve(cfg.model, cfg.cache_dir)
    built = run.build(cfg, source, torch.device("cpu"), trains_on=torch.device("cuda"))
    assert built.ran == dict.fromkeys(("fuse_projections", *record.SWITCHES), False)
    assert not any(getattr(m, "compiled", False) for m in built.model.modules())
    assert not getattr(built.model, "_qft_fused", [])
    assert "forward" not in built.model.get_base_model().get_output_embeddings().__dict__
    cpu = run.build(cfg, source, torch.device("cpu"))
    assert cpu.ran["fuse_projections"] is True and cpu.model._qft_fused


def test_learning_curve_records_val_accuracy_and_gold_loglik(tmp_path):
    rec = run.run(make_cfg(*[o for o in RUN if not o.startswith("train.eval_every")], "train.eval_every=2"), tmp_path)
    assert [s for s, _ in rec["val_curve"]] == [s for s, _ in rec["val_loglik_curve"]] == [2, 4]
    assert all(v < 0 for _, v in rec["val_loglik_curve"])  # log-likelihoods of the gold label
    # the curve's last point is the model after step 4; the final score is after step 6: both from one scorer
    assert rec["val_curve"][-1][1] * 10 == round(rec["val_curve"][-1][1] * 10)  # k of the 10 val examples
