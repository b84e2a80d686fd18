"""The project's documents speak of the project only: what ran, on which CPU, when and why. README.md, docs/,
experiments/ and benchmarks/ (their file names too) never tell how the work was organised: no "session", no machine
"lent", no "issue N", no absolute path of one machine, no pointer to notes outside the repository. Pre-registered plan.yaml text stays as written (a wording
correction is appended to it as a dated erratum), so plan.yaml files are not read here."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WHERE = ["README.md", "docs", "experiments", "benchmarks"]
PRE_REGISTERED = "plan.yaml"

WORDS = {
    "session": re.compile(r"\bsessions?\b", re.I),
    "lent": re.compile(r"\blent\b", re.I),
    "issue number": re.compile(r"\bissues?\s*#?\d+|\bthe issue's\b", re.I),
    "machine path": re.compile(r"(?<![\w.~$])/(?:work|home|Users|root|mnt|scratch)/"),
    "outside the repository": re.compile(r"\.\./shared/|\bDESIGN(?:\.md)?\b"),
}
CODE = re.compile(r"""scope\s*=\s*["']session["']""")  # pytest's fixture scope is code, not history


def hits(text: str) -> list[str]:
    text = CODE.sub("", text)
    return [name for name, pattern in WORDS.items() if pattern.search(text)]


def files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z", "--", *WHERE], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout:
        return [ROOT / p for p in listed.stdout.split("\0") if p and (ROOT / p).is_file()]
    return [p for w in WHERE for p in ([ROOT / w] if (ROOT / w).is_file() else (ROOT / w).rglob("*")) if p.is_file()]


@pytest.mark.parametrize("text,found", [
    ("measured in the nineteenth session", ["session"]),
    ("the Zen 4 has not been lent since", ["lent"]),
    ("the studies of issue 6", ["issue number"]),
    ("the 1.6x the issue's target asks", ["issue number"]),
    ("WORKTREE, default /work/f2x", ["machine path"]),
    ("see `../shared/DESIGN.md`", ["outside the repository"]),
    ('@pytest.fixture(scope="session")', []),
    ("a silent run, lentils, ~/.cache/qft, $HOME/work/x, excellent", []),
])
def test_the_wording_check_finds_what_it_should(text, found):
    assert hits(text) == found


def test_documents_speak_of_the_project_only():
    found = []
    for path in files():
        rel = path.relative_to(ROOT)
        found += [f"{rel}: file name ({w})" for w in hits(str(rel))]
        if path.name == PRE_REGISTERED:
            continue
        raw = path.read_bytes()
        if b"\0" in raw:  # images, arrays, parquet
            continue
        for n, line in enumerate(raw.decode("utf-8", "replace").splitlines(), 1):
            found += [f"{rel}:{n} ({w}): {line.strip()[:120]}" for w in hits(line)]
    assert len(files()) > 50
    assert not found, "\n".join(found)
