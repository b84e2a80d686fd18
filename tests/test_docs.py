"""Every command the docs show runs as written: each `python -m qft...`, `torchrun ... -m qft` and `make` line in the code
blocks of README.md, benchmarks/README.md and experiments/**/*.md composes (every grid point of a multirun, and of an
experiment's sweeper grid), passes the run's own validation, and parses with its tool's own parser."""

import contextlib
import itertools
import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from qft import config, model, schema, validate
from qft.budget import cli as budget_cli
from qft.planning import footprint
from qft.tools import power, report, simulate
from qft.errors import QftError

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "experiments").rglob("*.md")),
        *sorted((ROOT / "docs").rglob("*.md"))]
COMMAND = re.compile(r"(^|\s)(python -m qft|torchrun .*-m qft|make )")


def documented() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        blocks = re.findall(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", doc.read_text(), re.S | re.M)  # fences paired line by line
        for block in [text for lang, text in blocks if lang in ("", "bash", "sh")]:
            for line in block.replace("\\\n", " ").splitlines():
                line = re.split(r"\s#\s", line)[0].strip()
                if COMMAND.search(line) and not line.startswith("#"):
                    out.append((f"{doc.relative_to(ROOT)}", line))
    return out


COMMANDS = documented()


def test_the_docs_show_commands():
    assert len(COMMANDS) > 40 and any("qft.tools.power" in c for _, c in COMMANDS)


def split_values(value: str) -> list[str]:
    """A Hydra sweep value a,b,c -> [a, b, c]; commas inside brackets, braces or quotes stay."""
    out, depth, cur, quote = [], 0, "", None
    for ch in value:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        cur += ch
    return out + [cur]


def grid(overrides: list[str]) -> list[list[str]]:
    axes = []
    for o in overrides:
        key, _, value = o.partition("=")
        values = split_values(value) if "=" in o and not key.startswith("+") else [value]
        axes.append([f"{key}={v}" if "=" in o else o for v in values])
    return [list(p) for p in itertools.product(*axes)]


def hydra_cfg(overrides: list[str], with_hydra: bool = False):
    """The config a command line composes, completed as a run or a CLI completes it (qft.schema.complete)."""
    with initialize_config_dir(config.CONF, version_base="1.3"):
        return schema.complete(compose("config", overrides=overrides, return_hydra_config=with_hydra))


def environment(words: list[str]) -> tuple[dict, list[str]]:
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    return env, words


def jobs(args: list[str]):
    """(overrides, composed config) of every job a `python -m qft` command line runs: its own grid points, each
    crossed with the experiment's sweeper grid where the line does not set that key."""
    overrides = [a for a in args if a not in ("--multirun", "-m")]
    for point in grid(overrides):
        cfg = hydra_cfg(point, with_hydra=True)
        sweep = dict(cfg.hydra.sweeper.get("params") or {})
        extra = [[f"{k}={v}" for v in split_values(str(val))] for k, val in sweep.items() if k not in
                 {o.partition("=")[0] for o in point}]
        for more in itertools.product(*extra) if extra else [()]:
            yield point, hydra_cfg([*point, *more])


# files a documented Python block makes (README's own model and data) before a command line uses them
MADE = {name for doc in DOCS for block in re.findall(r"^```python\n(.*?)^```", doc.read_text(), re.S | re.M)
        for name in re.findall(r"(?:save_pretrained|open)\(\"([^\"]+)\"", block)}


def without_hydra_flags(args: list[str]) -> list[str]:
    """The overrides of a line: Hydra's own flags (`--help`, `--cfg job`) print and compose the same config."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("--cfg", "-c", "--package", "-p"):
            skip = True
        elif a not in ("--help", "-h", "--hydra-help", "--info", "-i"):
            out.append(a)
    return out


def check_qft_run(args: list[str], env: dict, monkeypatch) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = without_hydra_flags(args)
    made = any(a.partition("=")[2] in MADE for a in args if a.startswith(("model.path=", "data.path=")))
    for point, job in jobs(args):
        dry = "hydra/launcher=dry_run" in point
        # a dry run plans jobs for a cluster: its data and benchmark files live there
        validate.validate(job, planning=job.device == "cuda" or dry, files=not dry and not env and not made)


def sweep_folders() -> set[str]:
    """Records folders that exist once a documented sweep has run: each experiment's, at CPU and paper scale."""
    names = [p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml") if not p.stem.startswith("_")]
    out = {f"results/{n}/runs" for n in names}
    out.add(str(hydra_cfg(["+experiment=rank_sweep", "scale=paper"], with_hydra=True).hydra.sweep.dir))
    return out


@pytest.mark.parametrize("where,line", COMMANDS, ids=[f"{w}:{i}" for i, (w, _) in enumerate(COMMANDS)])
def test_documented_command_runs_as_written(where, line, monkeypatch, tmp_path, request):
    env, words = environment(shlex.split(line))
    if words[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
        assert all(t in targets for t in words[1:]), (where, line)
        return
    if words[0] == "torchrun":
        words = words[words.index("-m"):]
        words = ["python", *words]
    assert words[:2] == ["python", "-m"], line
    module, args = words[2], words[3:]
    if "--help" in args or "-h" in args:
        assert module in MAINS or module == "qft", line  # and test_cheap_documented_command_really_runs runs it
        return
    monkeypatch.chdir(ROOT)
    if module == "qft":
        if any(a.split("=", 1)[-1] in RUN_HERE for a in args):  # an own CSV or model folder, in the user's folder
            monkeypatch.chdir(request.getfixturevalue("recipe_files"))
        check_qft_run(args, env, monkeypatch)
    elif module in ("qft.tools.memory", "qft.budget"):
        assert not any(a.startswith("--") for a in args), f"{line}: {module} takes Hydra overrides only"
        cfg = hydra_cfg(args if module == "qft.tools.memory" else budget_cli.overrides(args))
        footprint.resolve(cfg) if module == "qft.tools.memory" else validate.validate(cfg, planning=True)
    elif module == "qft.tools.report":
        ns = report.parser().parse_args(args)
        assert all(Path(p).exists() or p in sweep_folders() for p in ns.paths), line
        if ns.plan:
            report.read_plan(ns.plan)
    elif module == "qft.tools.power":
        ns = power.parser().parse_args(args)
        assert all(Path(p).exists() or p in sweep_folders() for p in ns.records), line
    elif module == "qft.tools.simulate":
        simulate.parser().parse_args(args)
    elif module in ("qft.tools.predict", "qft.tools.merge"):  # RUN_DIR and TEXTS / OUT_DIR (run by the test below)
        assert len([a for a in args if not a.startswith("-")]) >= 2 or "--help" in args, line
    else:
        pytest.fail(f"{where}: {line}: no check for {module}")


# the tools' entry points, run in this process: each takes its argv and returns the exit status
MAINS = {"qft.budget": "qft.budget.cli", "qft.tools.memory": "qft.tools.memory", "qft.tools.report": "qft.tools.report.cli",
         "qft.tools.power": "qft.tools.power", "qft.tools.simulate": "qft.tools.simulate.cli",
         "qft.tools.predict": "qft.tools.predict", "qft.tools.merge": "qft.tools.merge"}
# what a recipe may name in its folder: an own 120-row CSV (README's texts.csv, docs' reviews.csv) and own model folder
RUN_HERE = "reviews.csv", "texts.csv", "my_model"


def cheap(line: str) -> bool:
    """Whether a documented line runs here in seconds: a tool on committed records or on a plan (no weights), --help,
    or a fine-tune of tiny_llama or of an own tiny model folder. A fine-tune of a real model composes only (above), and
    so do power's simulations and reports on records not committed."""
    _, words = environment(shlex.split(line))
    if words[0] == "make":
        return False
    module, args = (words[words.index("-m") + 1], words[words.index("-m") + 2:]) if "-m" in words else ("", [])
    if "--help" in args or "-h" in args:
        return True
    if module == "qft":
        multirun = "-m" in args or "--multirun" in args
        return not multirun and ("model=tiny_llama" in args or "model=local" in args and any(
            a.startswith("model.path=") and a.split("=", 1)[1] in RUN_HERE for a in args))
    if module == "qft.tools.power":
        return not any(a.startswith("--simulate") for a in args)
    if module == "qft.tools.report":
        return all((ROOT / p).exists() for p in report.parser().parse_args(args).paths)
    return module in MAINS


# test_recipes reruns the pipeline_offload study's lines against its committed outputs
CHEAP = sorted({line: where for where, line in COMMANDS if cheap(line)
                and where != "experiments/pipeline_offload/README.md"}.items(), key=lambda x: (x[1], x[0]))


def study_rerun(line: str, where: str) -> bool:
    """A study's own analysis run again over its committed records (a line of an experiments/ write-up that reads
    results/): a reproduction, run by `make reproduce`; the docs' and README's lines stay in `make test`."""
    return where.startswith("experiments/") and " results/" in f" {line}"


@pytest.fixture(scope="module")
def recipe_files(tmp_path_factory):
    """The files a newcomer's recipes name (RUN_HERE): README's own Python block, run as written in an empty folder
    (an own tiny model folder made with save_pretrained and a 120-row texts.csv), and a 120-row reviews.csv
    (columns review and stars)."""
    import os
    import re

    from test_recipes import reviews

    tmp = tmp_path_factory.mktemp("recipes")
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) == 1 and "save_pretrained" in blocks[0] and "texts.csv" in blocks[0]
    here = os.getcwd()
    os.chdir(tmp)
    try:
        exec(compile(blocks[0], "README.md", "exec"), {})
    finally:
        os.chdir(here)
    assert (tmp / "my_model" / "config.json").is_file() and len((tmp / "texts.csv").read_text().splitlines()) == 121
    reviews(tmp / "reviews.csv")
    return tmp


@pytest.fixture(scope="module")
def own_files(recipe_files):
    """recipe_files, and a run of python -m qft on them (its folder stands for a recipe's RUN_DIR)."""
    from test_recipes import OWN
    from conftest import make_cfg

    from qft import run

    tmp = recipe_files
    cfg = make_cfg("model=local", f"model.path={tmp / 'my_model'}", f"data.path={tmp / 'reviews.csv'}", *OWN,
                   tiny=False)
    assert run.run(cfg, tmp / "run")["status"] == "ok"
    return tmp


@pytest.mark.parametrize("line,where", [
    pytest.param(line, where, id=f"{where}:{i}", marks=[pytest.mark.reproduce] if study_rerun(line, where) else [])
    for i, (line, where) in enumerate(CHEAP)])
def test_cheap_documented_command_really_runs(line, where, own_files, tmp_path, monkeypatch, capsys):
    """Each cheap line runs as written, with its output folders moved to a temporary one (a committed file is never
    rewritten; test_recipes checks that the pipeline_offload study's outputs are what is committed), and ends ok."""
    import importlib
    import os
    import subprocess
    import sys

    env, words = environment(shlex.split(line))
    work = tmp_path / "work"
    work.mkdir()
    for name in RUN_HERE:
        (work / name).symlink_to(own_files / name)
    module, args = words[words.index("-m") + 1], words[words.index("-m") + 2:]
    if module in ("qft.tools.predict", "qft.tools.merge"):  # RUN_DIR: the own run; TEXTS: the own CSV
        args = [str(own_files / "run") if i == 0 else (str(own_files / "reviews.csv") if module.endswith("predict")
                                                       else str(tmp_path / "merged")) if i == 1 else a
                for i, a in enumerate(args)]
    elif "--out" in args:
        args[args.index("--out") + 1] = str(tmp_path / "out")
    elif module == "qft.tools.report":
        args += ["--out", str(tmp_path / "out")]
    if module in MAINS:
        monkeypatch.chdir(ROOT if module in ("qft.tools.report", "qft.tools.power", "qft.tools.simulate") else work)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        main = importlib.import_module(MAINS[module]).main
        try:
            status = main(args)
        except SystemExit as e:  # --help
            status = e.code
        assert status == 0, (line, capsys.readouterr().err[-2000:])
        return
    assert module == "qft", line
    help_only = any(a in ("--help", "-h", "--cfg", "-c") for a in args)  # prints, runs nothing
    # the test's overrides first: Hydra reads its overrides before a flag such as --cfg job
    command = [sys.executable, "-m", "qft", *([] if help_only else [
        f"hydra.run.dir={tmp_path / 'run'}", *([] if any(a.startswith("train.steps=") for a in args) else ["train.steps=2"])]),
        *args]
    if words[0] == "torchrun":
        command = [str(Path(sys.executable).with_name("torchrun")), *words[1:words.index("-m")], *command[1:]]
    got = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=900,
                         env={**os.environ, **env, "QFT_PROGRESS": "0",
                              "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert got.returncode == 0, (line, got.stderr[-3000:])
    if not help_only:
        assert "qft: ok:" in got.stdout and (tmp_path / "run" / "result.json").is_file(), (line, got.stdout[-2000:])


def test_the_cheap_lines_cover_the_recipes():
    """What a newcomer runs first is among the lines the test above really runs."""
    lines = [line for line, _ in CHEAP]
    for what in ("qft.tools.memory", "device=cuda", "torchrun", "qft.tools.simulate", "budget.split=depth",
                 "qft.tools.merge", "qft.tools.report", "qft.tools.power"):
        assert any(what in line for line in lines), what


def test_bad_documented_overrides_would_fail():
    """The checks above can fail: a stale key or flag is caught."""
    with pytest.raises(Exception):
        hydra_cfg(["quant.projections.down_proj.bits=16"])  # needs a leading +
    with pytest.raises(SystemExit):
        report.parser().parse_args(["results", "--budget-gb", "24"])
    with pytest.raises(QftError):
        validate.validate(hydra_cfg(["data=local", "data.path=/no/such.csv"]))


def test_gpu_check_runs_its_cpu_parts_and_names_what_it_skips(tmp_path):
    """scripts/gpu_check.sh OUT runs the rows a CPU can, names each skipped row with its reason, and writes every row
    to OUT/gpu_check.md and OUT/gpu_check.jsonl as the console shows it; without OUT it refuses in one line."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHON": sys.executable}
    res = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert res.returncode == 2 and res.stderr.startswith("usage: bash scripts/gpu_check.sh OUT")
    res = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path / "out")], cwd=ROOT, capture_output=True,
                         text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("| ") and not line.startswith("| check")]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:3] for line in lines}
    assert rows["NF4 forward/backward vs dequantized reference"][0] == "ok"
    assert rows["offload=activations vs none (streams, pinned buffers, prefetch)"][0] == "ok"
    assert rows["paged 8-bit AdamW"] == ["skipped", "no CUDA"] and len(rows) == 14
    for name in ("python -m qft end to end (BBC, mixed bits and ranks)", "fusion on CUDA: loss and gradients "
                 "bit-identical to unfused?", "its adapter in stock peft on a stock-quantized base: same test scores"):
        assert rows[name] == ["skipped", "no CUDA"], name
    assert all(detail for status, detail in rows.values() if status == "skipped")  # each with its reason
    # ok where this CPU has bf16 units, else skipped (emulated bf16 would take minutes); never FAIL
    assert rows["quant.attention_dtype=fp32 vs compute"][0] == ("ok" if model.native_bf16("cpu") else "skipped")
    assert [line for line in (tmp_path / "out" / "gpu_check.md").read_text().splitlines() if line in lines] == lines
    written = [json.loads(line) for line in (tmp_path / "out" / "gpu_check.jsonl").read_text().splitlines()]
    assert [[r["result"], r["detail"]] for r in written] == list(rows.values())


PLANS = sorted((ROOT / "experiments").glob("*/plan*.yaml"))


@pytest.mark.parametrize("plan", PLANS, ids=[f"{p.parent.name}/{p.name}" for p in PLANS])
def test_every_declared_cell_is_one_configuration_the_study_runs(plan, tmp_path):
    """Each cell of a study's declared contrasts matches at most one of the configurations its README's commands run
    (one seed each) on each dataset, and both cells match one on some dataset: a cell named too loosely (finding 2's reference against its depth cells, whose attention and MLP
    alphas are the reference's) or one no command makes would leave its contrast without a verdict."""
    import json

    from qft import record
    from qft.tools.report import declared

    lines = [line for where, line in COMMANDS if where == f"experiments/{plan.parent.name}/README.md"
             and re.search(r"python -m qft \+experiment=", line) and "_pilot" not in line]
    assert lines, plan
    configs = {}
    for line in lines:
        _, words = environment(shlex.split(line))
        seedless = [w for w in words[3:] if not w.startswith("seed=")]
        for _, job in jobs(seedless):
            conf = record.resolved(job)
            configs[json.dumps(conf, sort_keys=True)] = conf
    for i, conf in enumerate(configs.values()):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "result.json").write_text(json.dumps(
            {"status": "ok", "config": conf, "seed": 0, "final_accuracy": {"test": 0.5}}))
    df = report.collect([tmp_path])
    assert len(set(df.config_key)) == len(configs)
    for c in report.read_plan(plan)["contrasts"]:  # the report reads a plan on each dataset's records apart
        found = {source: [len(declared.cell_keys(ok, c[side])) for side in ("a", "b")]
                 for source, ok in df.groupby("cfg.data.source")}
        # never two configurations for a cell; on some dataset (a study of candidates: one of them) both cells run
        assert all(n <= 1 for ns in found.values() for n in ns), (plan.parent.name, c["name"], found)
        assert [1, 1] in found.values(), (plan.parent.name, c["name"], found)


@pytest.mark.reproduce
def test_finding2s_seed_check_reproduces_its_committed_output():
    """experiments/finding2/planner/sensitivity.py, as its README shows it, prints what the plan's seed block cites,
    from the committed variance-pilot records (variance quantities only)."""
    import subprocess
    import sys

    script = ROOT / "experiments" / "finding2" / "planner" / "sensitivity.py"
    got = subprocess.run([sys.executable, str(script.relative_to(ROOT))], cwd=ROOT, capture_output=True, text=True,
                         timeout=900)  # a hang guard, as the size check's: about 50 s of CPU, longer beside other jobs
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout == (script.parent / "sensitivity.txt").read_text()


@pytest.mark.reproduce
def test_finding2s_size_check_reproduces_its_committed_output():
    """experiments/finding2/size_check.py (the minimum-effect test's size, checked before finding 2's report is read)
    is deterministic: at 10 simulated studies a row it prints what its committed short output says, from finding 1's
    and finding 3's committed records (its README's 2,000 a row take about 17 minutes)."""
    import subprocess
    import sys

    script = ROOT / "experiments" / "finding2" / "size_check.py"
    got = subprocess.run([sys.executable, str(script.relative_to(ROOT)), "--reps", "10"], cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout == (script.parent / "size_check_reps10.txt").read_text()
    full = (script.parent / "size_check.txt").read_text().splitlines()
    assert full[:5] == got.stdout.splitlines()[:5]  # the committed full run fitted the same shape
    # the write-up's calibration of observed p-values: against rows whose p's are known, Holm over those given
    cal = subprocess.run([sys.executable, str(script.relative_to(ROOT)), "--reps", "10", "--calibrate", "1", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert cal.returncode == 0 and cal.stdout.splitlines()[-2:] == [
        "minimum-effect p 1: calibrated 1.0000, Holm over the 2 given 1.0000",
        "minimum-effect p 0: calibrated 0.0909, Holm over the 2 given 0.1818"], cal.stdout  # (0 + 1) / (10 + 1), x 2
    bad = subprocess.run([sys.executable, str(script.relative_to(ROOT)), "--calibrate", "0.2", "1.5"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.splitlines()[-1] == (
        "size_check.py: error: --calibrate: p-values in [0, 1], not [0.2, 1.5]") and not bad.stdout


LANES = ROOT / "experiments" / "finding2" / "lanes"


def test_finding2s_lanes_refuse_a_cpu_without_amx(tmp_path):
    """The study runs on the AMX Xeon only (its plan's fifth amendment): on another CPU the start script makes no
    worktree and starts nothing, exit 2 with one line."""
    import subprocess

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    got = subprocess.run(["bash", str(LANES / "start.sh")], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "CPUINFO": str(cpuinfo), "WORKTREE": str(tmp_path / "wt")})
    assert got.returncode == 2 and got.stdout == "" and not (tmp_path / "wt").exists()
    assert got.stderr.splitlines() == [got.stderr.strip()] and got.stderr.startswith("start.sh: error: this CPU has no")


@contextlib.contextmanager
def stand_in(name: str):
    """A process that carries `name` on its command line (as a running lane or run would) while the block runs."""
    import os
    import subprocess
    import time

    token = f"stand-in-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen(["bash", "-c", f'exec -a "{name} {token}" sleep 60'])
    try:
        for _ in range(100):  # until the stand-in carries its name
            if subprocess.run(["pgrep", "-f", token], capture_output=True).returncode == 0:
                break
            time.sleep(0.05)
        yield proc
    finally:
        proc.kill()


def test_finding2s_lanes_refuse_to_start_twice(tmp_path):
    """Lanes already running (here a stand-in process named as one) are not started again, on an AMX CPU too."""
    import subprocess

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu avx2 amx_bf16 amx_tile\n")
    with stand_in("bash experiments/finding2/lanes/lane.sh A"):
        got = subprocess.run(["bash", str(LANES / "start.sh"), "--prepare"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60, env={"PATH": "/usr/bin:/bin", "CPUINFO": str(cpuinfo),
                                              "WORKTREE": str(tmp_path / "wt")})
    assert got.returncode == 2 and got.stdout == "" and not (tmp_path / "wt").exists()
    assert got.stderr.splitlines() == [got.stderr.strip()] and "running already" in got.stderr


def test_finding2s_landed_records_are_copied_without_a_score(tmp_path):
    """landed.py copies each ok record (result.json, examples.npz) from the lanes' worktree, names a failed one
    without copying it, prints no accuracy, and copies nothing twice; a missing worktree is refused, exit 2."""
    import json
    import subprocess
    import sys

    runs, here = tmp_path / "wt" / "results" / "finding2" / "runs", tmp_path / "here"
    here.mkdir()
    for name, status in (("seed=0", "ok"), ("seed=1", "failed")):
        (runs / name).mkdir(parents=True)
        (runs / name / "result.json").write_text(json.dumps({
            "status": status, "steps": 400, "data": {"sizes": {"test": 2160}}, "train_seconds": 1265.4,
            "wall_seconds": 1470.2, "final_accuracy": {"test": 0.912345}, "zero_shot_accuracy": {"test": 0.387654},
            "execution": {"cpu_kind": "amx_bf16", "threads": 1, "compute_dtype": "bf16", "qft_commit": "dd15231ae7"}}))
        (runs / name / "examples.npz").write_bytes(b"npz")

    def landed(worktree):
        return subprocess.run([sys.executable, str(LANES / "landed.py")], cwd=here, capture_output=True, text=True,
                              timeout=60, env={"WORKTREE": str(worktree), "PATH": "/usr/bin:/bin"})

    got = landed(tmp_path / "wt")
    assert got.returncode == 0, got.stderr
    assert got.stdout.splitlines() == [
        "seed=0: ok, 400 steps, 2160 test documents, training 1265 s, wall 1470 s, amx_bf16 1 thread(s) bf16 qft dd15231",
        "seed=1: failed (not copied), 400 steps, 2160 test documents, training 1265 s, wall 1470 s, amx_bf16 1 "
        "thread(s) bf16 qft dd15231"]
    assert "912" not in got.stdout and "387" not in got.stdout
    copied = here / "results" / "finding2" / "runs"
    assert sorted(p.name for p in copied.iterdir()) == ["seed=0"]
    assert sorted(p.name for p in (copied / "seed=0").iterdir()) == ["examples.npz", "result.json"]
    again = landed(tmp_path / "wt")
    assert again.stdout.splitlines()[0] == "seed=1: failed (not copied), 400 steps, 2160 test documents, training " \
                                          "1265 s, wall 1470 s, amx_bf16 1 thread(s) bf16 qft dd15231"
    assert len(again.stdout.splitlines()) == 1
    gone = landed(tmp_path / "none")
    assert gone.returncode == 2 and gone.stdout == "" and gone.stderr.startswith("landed.py: error: WORKTREE=")


@pytest.mark.reproduce
def test_the_gates_screen_reproduces_its_committed_table():
    """experiments/sensitivity_gate/screen.py, as its README shows it, prints the committed screen.md from the
    committed records (regenerated whenever a pair lands)."""
    import subprocess
    import sys

    here = ROOT / "experiments" / "sensitivity_gate"
    got = subprocess.run([sys.executable, "experiments/sensitivity_gate/screen.py"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout == (here / "screen.md").read_text()
    assert got.stdout.count("\n") >= 3 and "| r8_few | 8 -> 1 | 0 |" in got.stdout


def test_the_gates_lanes_refuse_to_start_twice(tmp_path):
    """Runs of the gate already going (here a stand-in process named as one) are not started again, and no pinned
    checkout is made."""
    import subprocess

    with stand_in("python -m qft +experiment=sensitivity_gate"):
        got = subprocess.run(["bash", "experiments/sensitivity_gate/run.sh", "--prepare"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60,
                             env={"PATH": "/usr/bin:/bin", "GATE_CHECKOUT": str(tmp_path / "wt")})
    assert got.returncode == 2 and got.stdout == "" and not (tmp_path / "wt").exists()
    assert got.stderr.splitlines() == [got.stderr.strip()] and "running already" in got.stderr


def stand_in_python(tmp_path: Path) -> Path:
    """A python for run.sh's lanes that writes down where, at how many threads and with what it was called, in
    $TMPDIR/calls."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\necho "$PWD $OMP_NUM_THREADS $*" >> "$TMPDIR/calls"\n')
    fake.chmod(0o755)
    return fake


def test_the_gates_lane_runs_its_lines_of_each_stage_in_order(tmp_path):
    """A lane runs its lines of jobs.txt, then of harder.txt (stage 4), each stage from its checkout at its thread
    count; here with a stand-in python that writes down where, at how many threads and with what it was called."""
    import subprocess

    fake = stand_in_python(tmp_path)
    (tmp_path / "wt").mkdir()
    got = subprocess.run(["bash", "experiments/sensitivity_gate/run.sh", "--lane", "B", "jobs.txt:c1:1 harder.txt:c2:3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "TMPDIR": str(tmp_path),
                              "GATE_CHECKOUT": str(tmp_path / "wt")})
    assert got.returncode == 0, got.stderr
    here = ROOT / "experiments" / "sensitivity_gate"
    want = [(threads, line[2:]) for f, threads in (("jobs.txt", 1), ("harder.txt", 3))
            for line in (here / f).read_text().splitlines() if line.startswith("B ")]
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(want) >= 6 and len(calls) == len(want)
    sweep = f"-m qft +experiment=sensitivity_gate hydra.sweep.dir={ROOT}/results/sensitivity_gate/runs"
    assert calls == [f"{tmp_path / 'wt'} {threads} {sweep} {line}" for threads, line in want]
    assert "train.steps=500" in calls[-1]


def test_a_study_runs_from_its_jobs_file_only_once_its_seeds_are_amended(tmp_path):
    """`run.sh STUDY` refuses, in one line and exit 2, the gate's own folder, a STUDY without jobs.txt or plans, or
    one with a plan whose seeds_amended lists no seed; once every plan lists them it prepares the stage-3 checkout and
    results/STUDY/runs, and its lane runs the study's lines there at 2 threads (a stand-in pgrep and python)."""
    import subprocess

    script = ROOT / "experiments" / "sensitivity_gate" / "run.sh"
    repo, bin_ = tmp_path / "repo", tmp_path / "bin"
    study = repo / "experiments" / "demo"
    study.mkdir(parents=True)
    bin_.mkdir()
    (bin_ / "pgrep").write_text("#!/bin/bash\nexit 1\n")  # no run going: the host's own runs are not the test's
    (bin_ / "pgrep").chmod(0o755)
    fake = stand_in_python(tmp_path)
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "PYTHON": str(fake), "TMPDIR": str(tmp_path)}

    def start(*args, cwd=repo):
        return subprocess.run(["bash", str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=60, env=env)

    def refused(*args):
        got = start(*args)
        assert got.returncode == 2 and got.stdout == "" and got.stderr.count("\n") == 1, got.stderr
        assert not (tmp_path / "qft-sensitivity-gate-b8e49f7").exists() and not (repo / "results").exists()
        return got.stderr

    assert "STUDY=demo: a folder of experiments/ with a jobs.txt" in refused("demo")
    (study / "jobs.txt").write_text("A seed=1\nA seed=2\n")
    assert "experiments/demo has no plan*.yaml" in refused("demo")
    (study / "plan_a.yaml").write_text("seeds_amended: [1, 2, 3]\n")
    (study / "plan_b.yaml").write_text("# seeds_amended: [1, 2, 3] in a comment is not the key\nseeds: [1]\n")
    assert "demo/plan_b.yaml has no seeds_amended" in refused("demo")
    (study / "plan_b.yaml").write_text("seeds_amended: []\n")
    assert "demo/plan_b.yaml has no seeds_amended" in refused("demo")
    for name in ("nowhere", "sensitivity_gate", "demo/x", "../demo"):
        assert f"STUDY={name}" in refused(name)
    assert "allowed: [confirm | STUDY] [--prepare]" in refused("--prepare", "demo")
    (study / "plan_b.yaml").write_text("seeds_amended: [1, 2]\n")
    (tmp_path / "qft-sensitivity-gate-b8e49f7").mkdir()  # the stage-3 checkout, named by its commit, made already
    got = start("demo/", "--prepare")
    assert got.returncode == 0 and got.stdout == got.stderr == "" and (repo / "results" / "demo" / "runs").is_dir()
    got = start("--lane", "A", "demo/jobs.txt:b8e49f7:2")
    assert got.returncode == 0, got.stderr
    sweep = f"-m qft +experiment=sensitivity_gate hydra.sweep.dir={repo}/results/demo/runs"
    assert (tmp_path / "calls").read_text().splitlines() == [
        f"{tmp_path / 'qft-sensitivity-gate-b8e49f7'} 2 {sweep} seed={s}" for s in (1, 2)]
    # a lane with no lines in one stage goes on to the next; a jobs file that is not there stops it
    (study / "more.txt").write_text("B seed=7\n")
    got = start("--lane", "B", "demo/jobs.txt:b8e49f7:2 demo/more.txt:b8e49f7:3")
    assert got.returncode == 0 and (tmp_path / "calls").read_text().splitlines()[2:] == [
        f"{tmp_path / 'qft-sensitivity-gate-b8e49f7'} 3 {sweep} seed=7"]
    got = start("--lane", "B", "demo/none.txt:b8e49f7:2 demo/more.txt:b8e49f7:3")
    assert got.returncode != 0 and "none.txt" in got.stderr and (tmp_path / "calls").read_text().count("\n") == 3


def test_finding1_ng20s_jobs_with_the_gates_records_make_every_cell_of_its_plans():
    """finding1_ng20/jobs.txt runs, seed by seed, its plans' cells that the gate's stage 3 did not run (seeds 1-3),
    then all four cells of each later seed the plans list, each in the regime of the gate's stage-3 jobs (so a copied
    stage-3 record is the same cell), one line a run."""
    import yaml

    here = ROOT / "experiments" / "finding1_ng20"
    gate_jobs = (ROOT / "experiments" / "sensitivity_gate" / "confirm_ng20.txt").read_text().splitlines()
    regime = {" ".join(w for w in line.split()[1:] if not w.startswith(("adapter.", "seed=", "model=")))
              for line in gate_jobs if line.startswith("A ")}
    assert len(regime) == 1
    regime = regime.pop()
    family = {"smollm2_135m": "", "gemma3_270m": "model=gemma3_270m "}
    cells, seeds = set(), []
    for name in ("plan_smollm2.yaml", "plan_gemma3.yaml"):
        plan = yaml.safe_load((here / name).read_text())
        for c in plan["contrasts"] + plan["controls"]:
            cells |= {(side["model.name"], side["attn_r"], side["mlp_r"]) for side in (c["a"], c["b"])}
        seeds.append(plan.get("seeds_amended", [1, 2, 3]))
    assert len(cells) == 8 and seeds[0] == seeds[1]
    gate = {(f, r, r) for f in family for r in (32, 1)}
    want = [f"A adapter.attn.r={a} adapter.mlp.r={m} {family[f]}{regime} seed={seed}"
            for seed in seeds[0] for f in family for (g, a, m) in sorted(cells - gate if seed <= 3 else cells)
            if g == f]
    assert [line for line in (here / "jobs.txt").read_text().splitlines() if not line.startswith("#")] == want


def _stage3_record(folder: Path, family: str, r: int, seed: int, correct, wall: float, resumed: bool = False,
                   status: str = "ok", execution: dict | None = None, steps: int = 250, **data) -> None:
    """A stage-3 ng20 record as run.run writes one (config, execution, per-example scores), for seeds.py; `data`,
    `steps`, `execution` and `status` make the decoys it must leave out."""
    import json

    from conftest import write_test_examples
    from qft import record

    folder.mkdir(parents=True)
    config = {"experiment": "sensitivity_gate", "seed": seed, "model": {"name": family},
              "data": {"source": "twenty_newsgroups", "max_length": 256, "train_size": 4000, "val_size": 200,
                       "test_size": 2000, "test_stream": "own", "split_seed": 0, **data},
              "quant": {"compute_dtype": "bf16", "attn": {"bits": 4, "quant_type": "nf4"}},
              "adapter": {"attn": {"r": r}, "mlp": {"r": r}}, "train": {"steps": steps, "eval_batch_size": 32}}
    write_test_examples(folder, correct)
    run_kind = {"qft_commit": "b8e49f7ba16a95f0f1bdd4e6f6d791c9cc8d9d33", "qft_edited": False, "cpu": "AMD EPYC",
                "cpu_kind": "avx512_bf16", "threads": 2, "compute_dtype": "bf16", "torch": "2.13.0+cpu",
                **(execution or {})}
    (folder / "result.json").write_text(json.dumps({
        "status": status, "config": config, "config_hash": record.config_hash(config), "seed": seed,
        "trainable_params": {"total": 10 * r}, "final_accuracy": {"test": float(correct.mean()), "val": 0.5},
        "data": {"sizes": {"val": 200, "test": len(correct)}}, "train_seconds": wall / 2, "wall_seconds": wall,
        "execution": run_kind, "examples": "examples.npz",
        **({"execution_history": [run_kind, run_kind]} if resumed else {})}))


def _stage3(runs: Path, gains: dict) -> tuple[dict, list]:
    """Each family's six stage-3 records under `runs` (the cut's size by `gains`), beside one decoy for each thing
    seeds.py must check; ({family: the three seeds' cuts}, the wall seconds of the records made in one go)."""
    import numpy as np

    rng = np.random.default_rng(3)
    cuts, walls = {}, []
    for f, gain in gains.items():
        cuts[f] = []
        for seed in (1, 2, 3):
            low = (rng.random(300) < 0.6).astype(int)
            high = np.where(rng.random(300) < gain, 1, low)
            if not gain:  # a cut of one example in 300, in 39 that disagree: no count of seeds finds a quarter of it
                high = low.copy()
                high[np.flatnonzero(low == 0)[:20]], high[np.flatnonzero(low == 1)[:19]] = 1, 0
            cuts[f].append(high.mean() - low.mean())
            for r, c in ((32, high), (1, low)):
                wall = (4000.0 if f == "smollm2_135m" else 9000.0) + 100 * seed + r
                resumed = f == "gemma3_270m" and r == 1 and seed == 2
                _stage3_record(runs / f"{f}-{r}-{seed}", f, r, seed, c, wall, resumed=resumed)
                walls += [] if resumed else [wall]
        decoys = {"seed0": dict(seed=0), "rank8": dict(r=8), "t1": dict(execution={"threads": 1}),
                  "commit": dict(execution={"qft_commit": "93e4679"}), "edited": dict(execution={"qft_edited": True}),
                  "steps500": dict(steps=500), "train8000": dict(train_size=8000), "failed": dict(status="error")}
        for name, kw in decoys.items():
            args = {"family": f, "r": 32, "seed": 1, "correct": low, "wall": 1.0, **kw}
            _stage3_record(runs / f"a-{name}-{f}", **args)  # sorted before the real ones: a wrong filter keeps it
    return cuts, walls


def test_finding1_ng20s_seed_rule_reads_exactly_each_familys_six_stage3_records(tmp_path):
    """experiments/finding1_ng20/seeds.py (the seed rule the plans declare) takes each family's (32, 32) and (1, 1)
    records of seeds 1-3 at qft b8e49f7 unedited, 2 threads, 250 steps, in the regime, and nothing else: M is a quarter
    of the mean cut, the power tool runs on exactly those six, n = max(n_1, n_2, 3) and finding 1's hours(n), h over
    the records made in one invocation; ">100" goes to each study's rule; a record missing or two records of one cell
    refuse in one line, exit 2."""
    import re
    import shutil
    import subprocess
    import sys

    import numpy as np

    runs, out = tmp_path / "runs", tmp_path / "out"
    out.mkdir()
    cuts, walls = _stage3(runs, {"smollm2_135m": 0.10, "gemma3_270m": 0.06})

    def seeds(*args):
        return subprocess.run([sys.executable, "experiments/finding1_ng20/seeds.py", "--runs", str(runs), "--out",
                               str(out), *args], cwd=ROOT, capture_output=True, text=True, timeout=600)

    got = seeds("--study", "finding1_ng20")
    assert got.returncode == 0, got.stderr[-2000:]
    counts = []
    for f, short in (("smollm2_135m", "smollm2"), ("gemma3_270m", "gemma3")):
        section = (out / f"power_{short}.txt").read_text()
        delta = 0.25 * np.mean(cuts[f])
        assert f"## {f}" in section and f"M = 0.25 x that = {delta:.6f}" in section
        first = re.search(r"^\$ python -m qft.tools.power (.*)$", section, re.M).group(1).split()
        assert sorted(Path(p).name for p in first[:6]) == sorted(f"{f}-{r}-{s}" for r in (32, 1) for s in (1, 2, 3))
        assert first[6:] == ["--delta", f"{delta:.6f}", "--family", "3"]
        row = re.search(r"^\| 2000 \|.*$", section, re.M).group(0).split("|")
        counts.append(max(int(row[4]), int(row[5])))
        assert f"n_{f} = {counts[-1]}" in section and section.endswith(got.stdout)
    n, h = max(*counts, 3), np.mean(walls) / 3600
    assert got.stdout.splitlines()[0] == f"h = {h:.3f} hours (the mean wall_seconds of the 11 of 12 records made in " \
                                         "one invocation)"
    hours = 2 * (4 * n - 6) * h
    fit = max(k for k in range(3, 101) if 2 * (4 * k - 6) * h <= 60)
    assert hours > 60  # the plan's 60-hour cap applies to these records (its other branch: the second study below)
    assert f"n = max(n_1, n_2, 3) = {n}, hours(n) = {hours:.1f} > 60: n = the largest with hours(n) <= 60, never " \
           f"under 3: {fit}" in got.stdout
    assert f"--family 3 --simulate {fit}" in (out / "power_gemma3.txt").read_text()
    # a family whose cut is tiny: ">100" seeds, which each study's rule reads its own way
    shutil.rmtree(runs)
    _stage3(runs, {"smollm2_135m": 0.10, "gemma3_270m": 0})
    got = seeds("--study", "finding1_ng20")
    h = float(re.search(r"^h = ([0-9.]+) hours", got.stdout, re.M).group(1))
    fit = max(k for k in range(3, 101) if 2 * (4 * k - 6) * h <= 60)
    assert got.returncode == 0 and f"left to the budget: the largest n with hours(n) = 2 x (4n - 6) x h <= 60, never " \
                                   f"under 3: n = {fit}" in got.stdout
    got = seeds("--study", "finding3_ng20")
    assert got.returncode == 0 and "a column reads >100: the study is not run" in got.stdout
    got = seeds("--study", "finding2_ng20", "--family", "5")
    assert got.returncode == 0 and "a column reads >100: k = 5 does not fit" in got.stdout
    assert "--family 5" in (out / "power_gemma3_k5.txt").read_text()  # one file a k it prices
    assert "--simulate" not in (out / "power_smollm2.txt").read_text()
    assert seeds("--study", "finding2_ng20").returncode == 2  # its k is required
    # refusals: a second record of one cell, a record missing
    shutil.copytree(runs / "gemma3_270m-1-3", runs / "z-copy")
    got = seeds("--study", "finding3_ng20")
    assert got.returncode == 2 and got.stderr.count("\n") == 1 and "two records of gemma3_270m (1, 1) seed 3" in got.stderr
    shutil.rmtree(runs / "z-copy")
    (runs / "gemma3_270m-1-3" / "result.json").unlink()
    got = seeds("--study", "finding1_ng20")
    assert got.returncode == 2 and got.stdout == "" and got.stderr.count("\n") == 1
    assert "lacks 1 of its 12 records: gemma3_270m (1, 1) seed 3" in got.stderr
    # a record that cannot be read is named as such, not counted as missing; a --runs that is not there likewise
    (runs / "gemma3_270m-1-3" / "result.json").write_text('{"status": "ok", "config": ')
    got = seeds("--study", "finding1_ng20")
    assert got.returncode == 2 and got.stderr.count("\n") == 1 and "lacks" not in got.stderr
    assert "gemma3_270m-1-3/result.json is not a readable record (1 such" in got.stderr
    (runs / "gemma3_270m-1-3" / "result.json").write_text('["a list, not a record"]')
    assert "gemma3_270m-1-3/result.json is not a readable record" in seeds("--study", "finding1_ng20").stderr
    for folder in runs.iterdir():  # a folder without one ok record: all twelve are missing
        if folder.is_dir():
            shutil.rmtree(folder)
    got = seeds("--study", "finding1_ng20")
    assert got.returncode == 2 and got.stderr.count("\n") == 1 and "lacks 12 of its 12 records" in got.stderr
    runs.rmdir()
    got = seeds("--study", "finding1_ng20")
    assert got.returncode == 2 and got.stderr == f"seeds.py: error: --runs={runs}: not a folder\n"
