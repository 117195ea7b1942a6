"""The docs name files that exist, and stay reference pages.

Which tokens are paths, and how they resolve (docs/*.md and README.md):

- A candidate is an inline code span (`...`) outside fenced code blocks that, after dropping a
  trailing `()` and a pytest `::node` part, is made of letters, digits, `_`, `-`, `.` and `/`
  only, and either contains a `/` or ends in a source suffix (SOURCE_SUFFIXES). Spans with
  spaces (command lines), URLs, globs and placeholders (`*`, `<name>`, `{a,b}`), spans starting
  with `/` (absolute paths, HTTP routes, REPL commands), `~`, `$`, `-` or `../`, and a bare
  suffix such as `.cuh` are not repository paths.
- A candidate with a `/` resolves when it names a file or directory from the repository root, or
  is the trailing part of one (`ops/cpu/fast.py` and `backend/ops/cpu/fast.py` both name
  `atlas_cli/backend/ops/cpu/fast.py`; `serve/` names `atlas_cli/serve`). `dir/module.name`
  (an attribute of a module, such as `commands/run.reply`) resolves when `dir/module.py` does.
- A bare file name (`decode.py`, `quant.cuh`) resolves when a file of that name exists anywhere
  in the repository.
- In command lines (spans with spaces, and fenced code blocks) every word that starts with a
  top-level source folder (TOP_LEVEL) must exist from the repository root: the scripts the docs
  tell a reader to run.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
SOURCE_SUFFIXES = (".py", ".cu", ".cuh", ".cpp", ".h", ".md", ".toml", ".sh", ".cfg")
TOP_LEVEL = ("atlas_cli/", "benchmarks/", "scripts/", "tests/", "docs/", "kernels/")
SKIPPED_DIRS = {".git", "__pycache__", ".venv", "venv", "build", "dist", "out", "node_modules"}
MAX_PERFORMANCE_LINES = 400

FENCE = re.compile(r"^\s*```.*?^\s*```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
PATH_CHARS = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_./-]*")
ISSUE_HEADING = re.compile(r"^#+\s.*\bissues?\s+\d+", re.I | re.M)


@cache
def repository() -> tuple[frozenset[str], frozenset[str]]:
    """(every file and directory as a root-relative posix path, every file name)."""
    paths, names = set(), set()
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if SKIPPED_DIRS & set(rel.parts) or any(p.endswith(".egg-info") for p in rel.parts):
            continue
        paths.add(rel.as_posix())
        if path.is_file():
            names.add(path.name)
    return frozenset(paths), frozenset(names)


def _names_a_path(token: str) -> bool:
    paths, _ = repository()
    token = token.rstrip("/")
    return token in paths or any(p.endswith("/" + token) for p in paths)


def resolves(token: str) -> bool:
    """Whether a path-like token names something in the repository (the module docstring)."""
    _, names = repository()
    if "/" not in token:
        return token in names
    if _names_a_path(token):
        return True
    head, _, last = token.rstrip("/").rpartition("/")
    stem, dot, _ = last.partition(".")
    return bool(dot) and not last.endswith(SOURCE_SUFFIXES) and _names_a_path(f"{head}/{stem}.py")


def path_candidate(span: str) -> str | None:
    """The span as a repository path to check, or None when it is not one."""
    token = span.split("::")[0].removesuffix("()")
    if token.startswith(("/", "~", "$", "-", "../")) or "://" in span:
        return None
    if not PATH_CHARS.fullmatch(token) or re.fullmatch(r"\.\w+", token):
        return None
    return token if "/" in token or token.endswith(SOURCE_SUFFIXES) else None


def command_paths(line: str) -> list[str]:
    """Words of a command line that name a file from the repository root."""
    words = (w.strip("\"'(),;:`").split("::")[0] for w in line.split())
    return [w for w in words if w.startswith(TOP_LEVEL)]


def broken_paths(text: str) -> list[str]:
    """The path-like tokens of a markdown text that name nothing in the repository."""
    paths, _ = repository()
    broken = []
    for block in FENCE.findall(text):
        broken += [w for w in command_paths(block) if w.rstrip("/") not in paths]
    for span in SPAN.findall(FENCE.sub("", text)):
        if any(c.isspace() for c in span):
            broken += [w for w in command_paths(span) if w.rstrip("/") not in paths]
        elif (token := path_candidate(span)) is not None and not resolves(token):
            broken.append(token)
    return broken


def test_every_path_in_the_docs_exists():
    broken = {doc.name: broken_paths(doc.read_text(encoding="utf-8")) for doc in DOCS}
    assert {name: paths for name, paths in broken.items() if paths} == {}


def test_the_checker_finds_made_up_paths():
    doc = """
    Real: `atlas_cli/backend/ops/cpu/fast.py`, `ops/cpu/fast.py`, `backend/ops/native/`,
    `decode.py`, `quant.cuh`, `serve/`, `commands/run.reply`, `tests/test_docs.py::test_x`,
    `pyproject.toml`, `docs/performance.md`.
    Not paths: `/health`, `https://example.com/a/b.py`, `~/.cache/x.py`, `$ATLAS_HOME/run/`,
    `*.cu`, `<cache>/kernels/<file>`, `.cuh`, `-t/--threads`, `x / d`, `1 + w`.
    Made up: `atlas_cli/backend/ops/cpu_fast.py`, `ops/native_decoder.py`, `run_cmd.py`,
    `kernels/nope.cu`, `commands/nope.reply`.
    Command lines: `python benchmarks/startup.py --rounds 6`, `pytest tests/nope.py -q`.

    ```bash
    python scripts/gpu_bench.py --only gemv
    python benchmarks/not_there.py
    ```
    """
    assert broken_paths(doc) == [
        "benchmarks/not_there.py",
        "atlas_cli/backend/ops/cpu_fast.py",
        "ops/native_decoder.py",
        "run_cmd.py",
        "kernels/nope.cu",
        "commands/nope.reply",
        "tests/nope.py",
    ]


def test_performance_page_stays_short():
    lines = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_PERFORMANCE_LINES, f"docs/performance.md: {lines} lines"


def test_no_heading_names_an_issue():
    found = {
        doc.name: ISSUE_HEADING.findall(doc.read_text(encoding="utf-8"))
        for doc in sorted((ROOT / "docs").glob("*.md"))
    }
    assert {name: h for name, h in found.items() if h} == {}


def test_issue_heading_pattern():
    assert ISSUE_HEADING.findall("# Title\n## Fast path (issue 16)\ntext issue 3\n") == [
        "## Fast path (issue 16"
    ]
