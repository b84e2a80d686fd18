"""evaluate=mmlu: MMLU few-shot through lm-eval-harness on the in-memory adapted model, from local CSVs."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qft import evaluate, model, record, run
from qft.errors import QftError
from conftest import TINY_DATA, build, make_cfg

pytest.importorskip("lm_eval")  # the `paper` extra, which scripts/setup.sh installs

ROOT = Path(__file__).resolve().parent.parent
SUBJECTS = ("anatomy", "high_school_physics")


def mmlu_folder(root: Path) -> Path:
    """The original MMLU layout: dev/<subject>_dev.csv (5 rows) and test/<subject>_test.csv (3 rows), no header.
    Cells that pandas would change ("1.50", "None") and CSV quoting (commas, quotes) are in there on purpose."""
    for subject in SUBJECTS:
        for split, n in (("dev", 5), ("test", 3)):
            (root / split).mkdir(parents=True, exist_ok=True)
            with open(root / split / f"{subject}_{split}.csv", "w", newline="", encoding="utf-8") as f:
                w = csv.writer(f)
                for i in range(n):
                    w.writerow([f"{subject} {split} question {i}: which one, \"really\"?", "1.50", "None",
                                f"option {i}", f"{subject[:4]} {i}", "ABCD"[(i + len(subject)) % 4]])
    return root


def mmlu_cfg(folder, *more):
    return make_cfg(*TINY_DATA, "train.steps=2", "train.batch_size=4", "evaluate=mmlu", f"evaluate.path={folder}",
                    *more)


def test_the_default_config_has_no_evaluate_key_and_scale_paper_selects_mmlu():
    # no key at all by default, so every record written before the group existed keeps its config hash
    assert "evaluate" not in make_cfg()
    paper = make_cfg("+experiment=rank_sweep", "scale=paper", tiny=False)
    assert paper.evaluate.benchmark == "mmlu" and paper.evaluate.shots == 5 and paper.device == "cuda"
    assert make_cfg("+experiment=rank_sweep", "scale=paper", "evaluate=none", tiny=False).get("evaluate") is None


def test_a_run_records_mmlu_after_training(tmp_path):
    folder = mmlu_folder(tmp_path / "mmlu")
    rec = run.run(mmlu_cfg(folder, "evaluate.before_training=true"), tmp_path / "run")
    assert rec["status"] == "ok" and record.read(tmp_path / "run")["mmlu"] == rec["mmlu"]
    m = rec["mmlu"]
    assert m["n"] == 6 and m["shots"] == 5 and set(m["per_subject"]) == set(SUBJECTS)
    assert all(v["n"] == 3 and round(3 * v["acc"], 9) in (0, 1, 2, 3) for v in m["per_subject"].values())  # k of 3
    assert m["acc"] == pytest.approx(sum(v["acc"] * v["n"] for v in m["per_subject"].values()) / 6)
    assert round(6 * m["acc"], 9) in range(7) and m["acc_stderr"] == pytest.approx((m["acc"] * (1 - m["acc"]) / 5) ** 0.5)
    before = m["before_training"]
    assert before["n"] == 6 and set(before["per_subject"]) == set(SUBJECTS)
    assert rec["config"]["evaluate"]["path"] == str(folder)


def test_lm_eval_runs_five_shot_on_the_model_it_is_given(tmp_path):
    folder = mmlu_folder(tmp_path / "mmlu")
    cfg, source, built = build("evaluate=mmlu", f"evaluate.path={folder}")
    tok = model.load_tokenizer(source)
    net = built.model
    raw = evaluate.mmlu_results(cfg.evaluate, net, tok, torch.float32, tmp_path / "cache")
    assert sorted(raw["samples"]) == [f"qft_mmlu_{s}" for s in SUBJECTS]
    recomputed = {}
    for subject in SUBJECTS:
        samples = raw["samples"][f"qft_mmlu_{subject}"]
        assert len(samples) == 3
        dev = evaluate.read_mmlu_csv(folder / "dev" / f"{subject}_dev.csv")
        test = evaluate.read_mmlu_csv(folder / "test" / f"{subject}_test.csv")
        for s in samples:
            context = s["arguments"][0][0]
            assert [a[1] for a in s["arguments"]] == [" A", " B", " C", " D"]
            # 5 shots, the first 5 dev rows in order, each with its answer, then the question itself
            assert context.count("\nAnswer:") == 6
            assert context.startswith(f"The following are multiple choice questions (with answers) about "
                                      f"{subject.replace('_', ' ')}.\n\n")
            at = [context.index(d["question"]) for d in dev]
            assert at == sorted(at) and all(f"Answer: {'ABCD'[d['answer']]}\n\n" in context for d in dev)
            doc = test[s["doc_id"]]
            assert context.endswith(f"{doc['question']}\nA. 1.50\nB. None\nC. {doc['choices'][2]}\n"
                                    f"D. {doc['choices'][3]}\nAnswer:")
            assert s["target"] == doc["answer"]
        # accuracy from lm-eval's per-sample log-likelihoods: argmax over the four letters
        hits = [max(range(4), key=lambda c: s["filtered_resps"][c][0]) == s["target"] for s in samples]
        recomputed[subject] = sum(hits) / 3
        assert raw["results"][f"qft_mmlu_{subject}"]["acc,none"] == pytest.approx(recomputed[subject])
    summary = evaluate.summarize_mmlu(raw)
    assert summary["acc"] == pytest.approx(sum(recomputed.values()) / 2)
    assert {k: v["acc"] for k, v in summary["per_subject"].items()} == pytest.approx(recomputed)

    # lm-eval scored *our* model: its log-likelihood of " B" after the first prompt is the model's own
    s = raw["samples"]["qft_mmlu_anatomy"][0]
    context, cont = s["arguments"][1]
    ctx = tok(context)["input_ids"]
    whole = tok(context + cont)["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(net(input_ids=torch.tensor([whole])).logits[0].float(), -1)
    mine = sum(logp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))
    assert s["filtered_resps"][1][0] == pytest.approx(mine, abs=1e-3)

    # before_training scores with the adapters switched off: LoRA starts at B = 0, so that is the untrained
    # model, whatever training did to B
    def logliks(r):
        return [c[0] for t in sorted(r["samples"]) for x in r["samples"][t] for c in x["filtered_resps"]]

    with torch.no_grad():
        for n, p in net.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn_like(p))
    trained = evaluate.mmlu_results(cfg.evaluate, net, tok, torch.float32, tmp_path / "cache")
    with net.disable_adapter():
        base = evaluate.mmlu_results(cfg.evaluate, net, tok, torch.float32, tmp_path / "cache")
    assert logliks(base) == pytest.approx(logliks(raw), abs=1e-5)
    assert logliks(trained) != pytest.approx(logliks(raw), abs=1e-3)


@pytest.mark.parametrize("override,key", [
    ("evaluate.path=/nonexistent/mmlu", "evaluate.path"),
    ("evaluate.shots=6", "evaluate.shots"),
    ("evaluate.limit=0", "evaluate.limit"),
    ("evaluate.subjects=[anatomy,virology]", "evaluate.subjects"),
    ("evaluate.batch_size=0", "evaluate.batch_size"),
])
def test_bad_mmlu_config_fails_before_any_work(tmp_path, override, key):
    folder = mmlu_folder(tmp_path / "mmlu")
    with pytest.raises(QftError) as e:
        run.run(mmlu_cfg(folder, override), tmp_path / "run")
    assert e.value.key == key and "\n" not in str(e.value)
    assert record.read(tmp_path / "run")["status"] == "failed"


def test_a_malformed_csv_names_the_file_and_line(tmp_path):
    folder = mmlu_folder(tmp_path / "mmlu")
    with open(folder / "test" / "anatomy_test.csv", "a", encoding="utf-8") as f:
        f.write("a question,1,2,3,4,E\n")
    with pytest.raises(QftError) as e:
        run.run(mmlu_cfg(folder), tmp_path / "run")
    assert e.value.key == "evaluate.path" and "anatomy_test.csv" in str(e.value) and "line 4" in str(e.value)


def test_a_missing_mmlu_folder_is_one_line_and_exit_status_2(tmp_path):
    res = subprocess.run([sys.executable, "-m", "qft", "model=tiny_llama", "device=cpu", "evaluate=mmlu",
                          f"evaluate.path={tmp_path / 'nowhere'}", f"hydra.run.dir={tmp_path / 'run'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    errors = [l for l in res.stderr.splitlines() if l.startswith("qft: error:")]
    assert errors == [f"qft: error: evaluate.path='{tmp_path / 'nowhere'}': no such folder: want "
                      f"{evaluate.MMLU_LAYOUT}"]
