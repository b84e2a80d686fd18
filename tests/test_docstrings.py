"""Docstrings state the contract and stay short: every public function of qft/ names each parameter it takes, no
docstring runs over MAX_LINES, and none holds a measured figure (those live in benchmarks/README.md and docs/); a
conf/ line with a comment stays within MAX_YAML_COMMENT characters. Read from the source text alone (ast, no imports)."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 8  # of any docstring in qft/ (module, class or function)
MAX_YAML_COMMENT = 120  # characters in a line of conf/ that holds a comment
# a figure measured on some machine: a duration, a size in memory units, a compute rate, a speed ratio, a date
MEASURED = re.compile(r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s?(?:s|ms|µs|us|min|MB|GB|MiB|GiB|[GT]FLOP/s)\b"
                      r"|\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x (?:faster|slower|cheaper)\b|\b20\d\d-\d\d-\d\d\b")


def docstrings(path: Path):
    """(name, docstring) of the module at `path` and of each class and function in it that has one."""
    tree = ast.parse(path.read_text())
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        if doc is not None:
            yield getattr(node, "name", "<module>"), doc


def sources() -> list[Path]:
    return sorted((ROOT / "qft").rglob("*.py"))


def unnamed_parameters(path: Path) -> list[str]:
    """`function: parameter` for each parameter a public top-level function of `path` takes but its docstring does not
    name in backticks (a missing docstring names none)."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            doc = ast.get_docstring(node) or ""
            a = node.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
                if not re.search(rf"`[^`]*\b{re.escape(arg.arg)}\b[^`]*`", doc):
                    out.append(f"{node.name}: {arg.arg}")
    return out


def yaml_comment_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of each line of `path` that holds a comment (a # at its start or after a space)."""
    return [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1)
            if line.lstrip().startswith("#") or " #" in line]


@pytest.mark.parametrize("text,found", [
    ("about 17 s for SmolLM2-135M", True), ("0.12-0.30 s of a start-up", True), ("14.4 against 6.5 ms", True),
    ("0.25 MB", True), ("up to 32 MiB", True), ("0.3 vs 19 GFLOP/s", True), ("about 2.5x slower", True),
    ("(the 2026-12-04 statistics review)", True), ("r * (d_in + d_out)", False), ("2 bytes a weight", False),
    ("a multiple of 1/65536", False), ("10 steps", False), ("2.04x-3.59x throughput (published)", False),
])
def test_the_measurement_pattern_finds_what_it_should(text, found):
    assert bool(MEASURED.search(text)) is found


def test_docstrings_are_short():
    long = []
    for path in sources():
        rel = path.relative_to(ROOT).as_posix()
        long += [f"{rel}:{name} ({len(doc.splitlines())} lines)" for name, doc in docstrings(path)
                 if len(doc.splitlines()) > MAX_LINES]
    assert len(sources()) > 50
    assert not long, "\n".join(long)


def measured() -> dict[str, list[str]]:
    """{path:name: the measured figures in its docstring} over qft/."""
    out = {}
    for path in sources():
        for name, doc in docstrings(path):
            found = [m.group(0) for m in MEASURED.finditer(doc)]
            if found:
                out[f"{path.relative_to(ROOT).as_posix()}:{name}"] = found
    return out


def test_docstrings_hold_no_measurements():
    found = measured()
    assert not found, "\n".join(f"{k}: {v}" for k, v in found.items())


def test_public_functions_name_their_parameters():
    """Every public top-level function of qft/ names each parameter it takes (train.train its four among them)."""
    found = [f"{p.relative_to(ROOT).as_posix()}: {u}" for p in sources() for u in unnamed_parameters(p)]
    assert not found, "\n".join(found)


def test_the_parameter_check_sees_a_missing_name(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('def f(a, b, *, c=1):\n    """Uses `a` and `c`; b is not quoted."""\n\n'
                 'def _g(x):\n    pass\n\ndef h(y):\n    pass\n')
    assert unnamed_parameters(f) == ["f: b", "h: y"]


def test_yaml_comment_lines_are_short():
    files = sorted((ROOT / "conf").rglob("*.yaml"))
    long = [f"{p.relative_to(ROOT)}:{n} ({len(line)} characters)" for p in files for n, line in yaml_comment_lines(p)
            if len(line) > MAX_YAML_COMMENT]
    assert len(files) > 40
    assert not long, "\n".join(long)
