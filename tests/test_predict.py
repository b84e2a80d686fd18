"""qft.tools.predict scores new texts with a run's adapter exactly as the run scored its own test split."""
import csv

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
