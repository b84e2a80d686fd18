"""qft.tools.predict scores new texts with a run's adapter exactly as the run scored its own test split."""
import csv
from pathlib import Path

import numpy as np
import pytest

from qft import data, record, run
from qft.tools import predict
from conftest import make_cfg

WORDS = {"good": ["great", "lovely", "fine", "superb"], "bad": ["awful", "broken", "poor", "dreadful"]}


def dataset(path):
    rows = [(f"{w} product, model {i}", lab) for i in range(30) for lab, ws in WORDS.items() for w in ws[i % 4:i % 4 + 1]]
    path.write_text("review,stars\n" + "".join(f'"{t}",{s}\n' for t, s in rows))
    return ["data=local", f"data.path={path}", "data.text_column=review", "data.label_column=stars",
            "data.train_size=32", "data.val_size=8", "data.test_size=12"]


def test_predict_reproduces_the_runs_test_scores(tmp_path, capsys):
    over = dataset(tmp_path / "reviews.csv")
    cfg = make_cfg(*over, "train.steps=3", "train.batch_size=8", "train.zero_shot=false", "train.eval_every=0",
                   "train.checkpoint_every=0")
    rec = run.run(cfg, tmp_path / "run")
    # the run's test split, as texts: the same seeded split of the same rows
    test = data.split(data.SOURCES["local"](cfg.data), cfg.data)["test"]
    f = tmp_path / "test.csv"
    with open(f, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["review", "stars"])
        w.writerows(test)
    assert predict.main([str(tmp_path / "run"), str(f), "--label-column", "stars"]) == 0
    out = capsys.readouterr().out
    assert f"accuracy {rec['final_accuracy']['test']:.4f}" in out
    rows = list(csv.DictReader(open(tmp_path / "test.predictions.csv")))
    ex = record.read_examples(tmp_path / "run")["final.test"]
    assert [r["prediction"] for r in rows] == [rec["data"]["labels"][i] for i in ex["pred"]]
    assert [float(r["loglik_good"]) for r in rows] == pytest.approx(ex["loglik"][:, 1].tolist(), abs=1e-5)


@pytest.mark.parametrize("args,key", [(["/no/such/run", "{csv}"], "RUN_DIR"), (["{run}", "/no/such.csv"], "TEXTS"),
                                      (["{run}", "{csv}", "--text-column", "body"], "--text-column"),
                                      (["{run}", "{txt}"], "TEXTS")])
def test_bad_input_is_one_line_and_status_2(tmp_path, capsys, args, key):
    (tmp_path / "run").mkdir()
    record.write(tmp_path / "run", {"status": "failed", "config": {}})
    (tmp_path / "t.csv").write_text("text\nhello\n")
    (tmp_path / "t.txt").write_text("hello\n")
    filled = [a.format(csv=tmp_path / "t.csv", txt=tmp_path / "t.txt", run=tmp_path / "run") for a in args]
    assert predict.main(filled) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"qft.tools.predict: error: {key}=")


def test_int8_rescoring_reproduces_the_record_and_scores_through_the_training_matmul(tmp_path, capsys):
    """experiments/finding3/int8_scoring.py: its "scoring" path is the run's own scoring (equal log-likelihoods), its
    "training" path is the dequantized-weight matmul (other log-likelihoods), and a run without int8 is bad input."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "int8_scoring", Path(__file__).resolve().parent.parent / "experiments" / "finding3" / "int8_scoring.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    over = dataset(tmp_path / "reviews.csv")
    common = ["train.steps=2", "train.batch_size=8", "train.zero_shot=false", "train.eval_every=0",
              "train.checkpoint_every=0"]
    run.run(make_cfg(*over, *common, "quant=int8"), tmp_path / "int8")
    ex = record.read_examples(tmp_path / "int8")["final.test"]
    both = script.rescore(tmp_path / "int8", ("scoring", "training", "scoring"))  # the hooks come off between passes
    assert both["scoring"]["loglik"] == pytest.approx(ex["loglik"], abs=1e-5)
    assert not np.allclose(both["training"]["loglik"], ex["loglik"], atol=1e-5)
    assert script.main(["--check", str(tmp_path / "int8")]) == 0
    out = capsys.readouterr().out
    assert f"n {len(ex['id'])}, accuracy as recorded (LLM.int8) {ex['correct'].mean():.4f}" in out
    assert float(out.split("from the record is ")[1].split()[0]) < 1e-5

    run.run(make_cfg(*over, *common), tmp_path / "nf4")
    assert script.main([str(tmp_path / "nf4")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("int8_scoring: error: RUN_DIR=") and "no int8 layer" in err[0]
