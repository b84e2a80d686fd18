"""The house rules a reader relies on: the import graph flows one way, and no module reaches into another's
private helpers. Function-level imports count: they hide a cycle, they do not remove it."""

import ast
from pathlib import Path

QFT = Path(__file__).resolve().parent.parent / "qft"


def _name(path: Path, root: Path) -> str:
    """A module's dotted name under qft: `run`, `quant` (a package's __init__), `quant.bnb4`."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path | None = None) -> tuple[set, list]:
    """qft modules a file imports anywhere in it, and the private names it imports from them."""
    root = root or QFT
    known = {_name(p, root) for p in root.rglob("*.py")}
    mods, private = set(), []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "qft":
            base = node.module.partition(".")[2]
            for a in node.names:  # `from qft.quant import bnb4` imports a module, `from qft.quant import plan` a name
                sub = f"{base}.{a.name}" if base else a.name
                mods.add(sub if sub in known else base)
            if base:
                private += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            mods |= {a.name.partition(".")[2] for a in node.names if a.name.startswith("qft.")}
    return mods - {_name(path, root), ""}, private


def graph() -> dict:
    modules = {_name(p, QFT): p for p in QFT.rglob("*.py")}
    return {m: _imports(p)[0] & set(modules) for m, p in modules.items()}


def test_no_import_cycle_counting_function_level_imports():
    g = graph()
    assert {"tools.memory", "planning.footprint", "planning.stages", "pipeline", "config", "budget"} <= set(g)

    def reaches(a, b, seen):
        return any(d == b or (d not in seen and reaches(d, b, seen | {d})) for d in g[a])

    cycles = sorted((a, b) for a in g for b in g[a] if reaches(b, a, {b}))
    assert cycles == []


def test_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    """The check above can fail: two modules that import each other inside functions are a cycle."""
    for a, b in (("one", "two"), ("two", "one")):
        (tmp_path / f"{a}.py").write_text(f"def f():\n    from qft import {b}\n")
    monkeypatch.setattr(__import__(__name__), "QFT", tmp_path)
    g = graph()
    assert g == {"one": {"two"}, "two": {"one"}}


def test_no_private_helper_imported_across_modules():
    leaks = [(_name(p, QFT), name) for p in QFT.rglob("*.py") for name in _imports(p)[1]]
    assert leaks == []


def test_one_config_home():
    """CONF and compose live in qft/config.py, which imports no config group's module (every CLI can use it): only the
    schema, which imports nothing but the error type."""
    mods, _ = _imports(QFT / "config.py")
    assert mods <= {"errors", "schema"}
    for path in (QFT / "schema").glob("*.py"):
        assert _imports(path)[0] <= {"errors", "schema", "schema.groups", "schema.spec"}, path
    for path in list(QFT.parent.glob("tests/*.py")) + list(QFT.parent.glob("benchmarks/*.py")) + [QFT / "__main__.py"]:
        assert "Path(__file__).resolve().parent.parent / \"conf\"" not in path.read_text(), path


def test_layers_flow_one_way():
    """The run path and planning import no tool, and planning imports nothing that runs a run (qft.run, qft.pipeline,
    the entry point; qft.planning.measure does run one training step to measure it): tools read runs and plans,
    runs read plans, never the reverse."""
    g = graph()
    tool = [m for m in g if m == "tools" or m.startswith("tools.")]
    for m, deps in g.items():
        if m not in tool:
            assert not [d for d in deps if d in tool], m
        if m.startswith("planning"):
            assert not deps & {"run", "pipeline", "__main__"}, m
