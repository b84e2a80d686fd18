"""A newcomer's recipes, each as the docs give it: an own small model folder and an own 120-row CSV, then predict and
merge on that run; a torchrun pipeline launch without hydra.run.dir; and the CLIs' help and bad-input lines."""

import contextlib
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qft import data, model, run
from qft.errors import QftError
from conftest import make_cfg

ROOT = Path(__file__).resolve().parent.parent
WORDS = {"good": ["great", "lovely", "fine", "superb", "nice", "excellent"],
         "bad": ["awful", "broken", "poor", "dreadful", "shoddy", "terrible"]}


def reviews(path: Path, n: int = 120) -> Path:
    """n rows (half good, half bad), columns review and stars, as a user's own CSV."""
    rows = [(f"{WORDS[lab][i % 6]} product, model {i}", lab) for i in range(n // 2) for lab in WORDS]
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([("review", "stars"), *rows])
    return path


def own_model(folder: Path) -> Path:
    """A small model folder of one's own, made with transformers' save_pretrained (tiny_llama's architecture)."""
    source = model.resolve(make_cfg().model, os.environ["QFT_CACHE"])
    model.load(source).save_pretrained(folder)
    model.load_tokenizer(source).save_pretrained(folder)
    return folder


def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def qft(*args, cwd=None, timeout=600):
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd or ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env())


OWN = ["data=local", "data.text_column=review", "data.label_column=stars", "train.steps=2", "train.batch_size=8",
       "train.lr=0.05", "train.zero_shot=false", "train.eval_every=0", "train.checkpoint_every=0",
       "quant.compute_dtype=fp32", "adapter.dropout=0.0"]


@pytest.fixture(scope="module")
def own_run(tmp_path_factory):
    """A run on an own model folder and an own 120-row CSV with no split size given: (run dir, stderr, record)."""
    tmp = tmp_path_factory.mktemp("own")
    folder, table = own_model(tmp / "my_model"), reviews(tmp / "reviews.csv")
    cfg = make_cfg("model=local", f"model.path={folder}", f"data.path={table}", *OWN, tiny=False)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rec = run.run(cfg, tmp / "run")
    return tmp / "run", err.getvalue(), rec


def test_own_csv_of_120_rows_gets_split_sizes_from_its_rows(own_run):
    run_dir, err, rec = own_run
    assert rec["status"] == "ok" and rec["data"]["sizes"] == {"train": 84, "val": 12, "test": 24}
    assert "qft: data: reviews.csv has 120 rows; split sizes derived from them: train 84, val 12, test 24" in err


def test_an_empty_split_names_the_files_row_count(tokenizer, tmp_path):
    cfg = make_cfg("data=local", f"data.path={reviews(tmp_path / 'reviews.csv')}", "data.text_column=review",
                   "data.label_column=stars", "data.train_size=1600", "data.val_size=100")
    with pytest.raises(QftError) as e:
        data.prepare(cfg.data, tokenizer, tmp_path / "cache")
    assert str(e.value) == ("data.train_size=1600: the train split is empty: reviews.csv has 120 rows for train, val and "
                            "test sizes [1600, 100, 24]; ask for fewer")


def test_merge_writes_a_model_transformers_loads_with_the_adapted_logits(own_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qft.tools import merge, predict

    run_dir, _, _ = own_run
    assert merge.main([str(run_dir), str(tmp_path / "merged")]) == 0
    assert capsys.readouterr().out.startswith(f"qft.tools.merge: {run_dir}'s adapter merged into its dequantized base")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").pad_token_id is not None
    adapted = predict.load(run_dir)[0].eval()
    ids = torch.randint(3, 49152, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        with adapted.disable_adapter():  # and the adapter is what the merge carried over
            base = adapted(input_ids=ids).logits
    assert (got - want).abs().max().item() < 1e-4
    assert (base - want).abs().max().item() > 1e-2
    capsys.readouterr()
    assert merge.main([str(run_dir), str(tmp_path / "merged")]) == 2  # an existing folder is never overwritten
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"qft.tools.merge: error: OUT_DIR='{tmp_path / 'merged'}': a new or empty folder"]


def test_predict_refuses_gold_labels_the_run_never_saw(own_run, tmp_path, capsys):
    from qft.tools import predict

    run_dir, _, _ = own_run
    texts = tmp_path / "new.csv"
    texts.write_text("review,stars\ngreat product,good\nawful product,Good\nfine day,weather\npoor product,bad\n")
    assert predict.main([str(run_dir), str(texts), "--label-column", "stars"]) == 2
    out = capsys.readouterr()
    assert out.err.strip().splitlines() == ["qft.tools.predict: error: --label-column='stars': 2 of 4 gold labels are "
                                            "not among the run's labels (bad, good): Good, weather"]
    assert not out.out and not texts.with_suffix(".predictions.csv").exists()


def test_predict_and_merge_of_a_run_without_adapter(tmp_path, capsys):
    from qft.tools import merge, predict

    table = reviews(tmp_path / "reviews.csv", 40)
    cfg = make_cfg(f"data.path={table}", *OWN, "adapter.attn.r=0", "adapter.mlp.r=0")
    assert run.run(cfg, tmp_path / "run")["status"] == "ok"
    assert predict.main([str(tmp_path / "run"), str(table), "--label-column", "stars"]) == 0
    out = capsys.readouterr().out
    assert f"scored with {tmp_path / 'run'}'s base model (the run trained no adapter) ->" in out and "adapter ->" not in out
    assert merge.main([str(tmp_path / "run"), str(tmp_path / "merged")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"qft.tools.merge: error: RUN_DIR='{tmp_path / 'run'}': the run trained no adapter (rank 0 everywhere): its base "
        "is the model"]


def test_budget_split_by_depth_takes_three_equal_shares_by_default(capsys):
    from qft.budget.cli import main

    assert main(["model=llama2_7b", "budget.params=20000000", "budget.split=depth"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "llama2_7b: 224 projections; parameters per unit of rank: shallow 858,880, middle 780,800, deep 858,880"
    assert "| 8 | 8 | 8 | 19,988,480 | -0.06% |" in out
    assert make_cfg("budget=shares", "budget.split=depth").budget.shares == [1, 1, 1]
    assert list(make_cfg("budget=shares").budget.shares) == [1, 1]


@pytest.mark.parametrize("tool", ["qft.tools.memory", "qft.budget", "qft.tools.report", "qft.tools.power",
                                  "qft.tools.simulate", "qft.tools.predict", "qft.tools.merge"])
def test_every_tool_prints_its_help(tool, capsys):
    import importlib

    main = importlib.import_module("qft.budget.cli" if tool == "qft.budget" else
                                   f"{tool}.cli" if tool.endswith(("report", "simulate")) else tool).main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr()
    assert out.out.startswith(f"usage: python -m {tool}") or out.out.startswith("usage: "), out.out[:200]
    assert not out.err


def test_qft_prints_its_help():
    got = qft("qft", "--help")
    assert got.returncode == 0 and "== Configuration groups ==" in got.stdout and "model: " in got.stdout


def test_memory_refuses_a_budget_that_is_no_number(capsys):
    from qft.tools import memory

    assert memory.main(["model=llama2_7b", "offload.device_budget_gb=abc"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "qft.tools.memory: error: offload.device_budget_gb='abc': a number of GiB > 0, or null"]


@pytest.mark.parametrize("args,line", [
    (["hydra/launcher=dry_run", "model=tiny_llama"],
     "qft: error: hydra/launcher='dry_run': prints a sweep's jobs without running them: add --multirun (-m); a single "
     "run trains, without hydra/launcher=dry_run"),
    (["model.name=tiny_llama"],
     "qft: error: model.name='tiny_llama': model=smollm2_135m is the packaged model smollm2_135m and keeps its name; a "
     "model of your own (model=local model.path=FOLDER) takes any name")])
def test_a_single_run_is_refused_before_it_trains(args, line, tmp_path):
    got = qft("qft", *args, f"hydra.run.dir={tmp_path / 'run'}")
    assert got.returncode == 2 and got.stderr.strip().splitlines()[-1] == line, got.stderr[-2000:]
    assert [x for x in got.stderr.splitlines() if x.startswith("qft")] == [line] and "qft: ok" not in got.stdout
    assert not (tmp_path / "run" / "result.json").exists()


def test_an_own_models_name_is_free_and_a_presets_is_its_own():
    model.check_name(make_cfg("model=local", "model.path=/m", "model.name=mine", tiny=False).model, "local")
    model.check_name(make_cfg("model.path=/m", "model.name=mine", tiny=False).model, "smollm2_135m")  # own folder
    model.check_name(make_cfg().model, "tiny_llama")
    with pytest.raises(QftError, match="model.name='tiny_llama'"):
        model.check_name(make_cfg("model=llama2_7b", "model.name=tiny_llama", tiny=False).model, "llama2_7b")


HOLD = '''"""torchrun's worker for the test: rank 1 starts Hydra past two second boundaries after rank 0 goes on."""
import os, runpy, sys, time
from pathlib import Path

import qft.__main__  # noqa: F401 - the imports first, so that the hold below is what parts the ranks

mark = Path(os.environ["QFT_TEST_MARK"])
if os.environ["RANK"] == "0":
    mark.write_text(repr(time.time()))
else:
    while not mark.exists():
        time.sleep(0.01)
    time.sleep(max(0.0, int(float(mark.read_text())) + 3.05 - time.time()))
sys.argv[0] = "qft"
runpy.run_module("qft", run_name="__main__")
'''


def test_torchrun_ranks_run_in_rank_zeros_folder(tmp_path):
    """docs/memory.md's torchrun line, on tiny_llama, without hydra.run.dir: Hydra names each rank's folder after the
    second it started in, so rank 1 is held (by a stand-in for `-m qft` that runs it) until rank 0's second is past;
    the launch must still be one run in one folder."""
    (tmp_path / "hold.py").write_text(HOLD)
    torchrun = Path(sys.executable).with_name("torchrun")
    got = subprocess.run([str(torchrun), "--nproc-per-node", "2", "hold.py", "model=tiny_llama", "train.steps=2",
                          "offload=pipeline", "offload.stages=2", "offload.micro_batches=4"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=900,
                         env={**env(), "QFT_TEST_MARK": str(tmp_path / "mark"), "QFT_PROGRESS": "0"})
    assert got.returncode == 0, got.stderr[-3000:]
    folders = sorted(p for p in (tmp_path / "outputs").glob("*/*"))
    assert len(folders) == 1, folders
    rec = json.loads((folders[0] / "result.json").read_text())
    assert rec["status"] == "ok" and rec["steps"] == 2
    assert [x for x in got.stdout.splitlines() if x.startswith("qft: ok")] == [
        f"qft: ok: test accuracy {rec['final_accuracy']['test']} (zero-shot {rec['zero_shot_accuracy']['test']}), "
        f"record {folders[0] / 'result.json'}"]


def test_several_processes_without_torchruns_store_must_name_the_run_folder(tmp_path):
    got = subprocess.run([sys.executable, "-m", "qft", "model=tiny_llama"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={**env(), "RANK": "1", "WORLD_SIZE": "2"})
    assert got.returncode == 2 and got.stderr.strip().splitlines() == [
        "qft: error: hydra.run.dir=None: 2 processes started without torchrun's store cannot agree on a run folder: "
        "name one, the same on every rank (hydra.run.dir=...)"] and not (tmp_path / "outputs").exists()


SIMULATE = [line for where, line in __import__("test_docs").COMMANDS
            if where == "experiments/pipeline_offload/README.md" and "qft.tools.simulate" in line]


@pytest.mark.reproduce  # a study's outputs derived again: make reproduce
@pytest.mark.parametrize("line", SIMULATE, ids=[line.split("--out ")[1].split("/")[-1] for line in SIMULATE])
def test_rerunning_the_pipeline_offload_study_rewrites_no_committed_file(line, tmp_path, capsys):
    import shlex

    from qft.tools.simulate.cli import main

    words = shlex.split(line)[3:]
    committed = ROOT / words[words.index("--out") + 1]
    words[words.index("--out") + 1] = str(tmp_path)
    assert main(words) == 0
    texts = sorted(p.name for p in committed.iterdir() if p.suffix in (".md", ".csv"))
    assert texts and texts == sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".md", ".csv"))
    for name in texts:
        assert (tmp_path / name).read_text() == (committed / name).read_text(), (committed / name)


def test_the_docs_describe_the_bits_proposal_as_the_tool_computes_it():
    import inspect

    from qft.budget.bits import propose_bits

    text = " ".join((ROOT / "docs" / "studies.md").read_text().split())
    part = text[text.index("budget.bits_records="):][:700]
    margin = inspect.signature(propose_bits).parameters["margin"].default
    assert "Welch" not in part.split("TOST")[0] and "95%" not in part and f"±{margin:g}" in part and "TOST" in part


def test_the_memory_docs_size_a_gpu_from_any_machine(capsys):
    """docs/memory.md shows the memory estimate with device=cuda, which sizes a GPU run on a machine without one."""
    import re
    import shlex

    from qft.tools import memory

    lines = [line for where, line in __import__("test_docs").COMMANDS
             if where == "docs/memory.md" and "qft.tools.memory" in line]
    cuda = [line for line in lines if "device=cuda" in line]
    assert cuda and len(lines) > len(cuda)
    for line in lines:
        assert memory.main(shlex.split(line)[3:]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        want = "cuda" if "device=cuda" in line else "cuda" if torch.cuda.is_available() else "cpu"
        assert re.search(rf" on {want} \(", first), (line, first)
