"""The house rules, checked on the source: imports run one way, rooms stay small.

Every `import` counts, function-level ones too (they hide circles rather than remove them). The
rules are the ones docs/architecture.md draws as layers.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "atlas_cli"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
STDLIB_AND_NUMPY = {"numpy", "__future__"}

# What the restructuring has not moved yet. Each ledger may only shrink: a new circle, a new
# forbidden edge or a new big room fails, and so does a fixed one still listed here.
KNOWN_CIRCLES: list[list[str]] = []
KNOWN_BROKEN: set[str] = set()
KNOWN_GPU_PACKAGE_USERS: set[str] = set()
KNOWN_BIG_FILES: set[str] = set()
KNOWN_LONG_FUNCTIONS: set[str] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_names(path: Path) -> Iterator[str]:
    """Absolute names of everything `path` imports, wherever in the file the import stands:
    for `from pkg import name`, `pkg.name` where that is a module, else `pkg`."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield sub if sub in modules() else base


@cache
def edges() -> dict[str, set[str]]:
    """Module -> the atlas modules it imports."""
    known = modules()
    return {
        mod: {n for n in imported_names(path) if n in known and n != mod}
        for mod, path in known.items()
    }


def third_party(mod: str) -> set[str]:
    return {n.split(".")[0] for n in imported_names(modules()[mod])} - {"atlas_cli"}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    assert sorted(circles(edges())) == sorted(KNOWN_CIRCLES)


def test_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def broken(rule) -> list[str]:
    """Edges that break `rule`, less the ledger's."""
    found = {f"{a} -> {b}" for a, targets in edges().items() for b in targets if rule(a, b)}
    assert KNOWN_BROKEN - found <= {k for k in KNOWN_BROKEN if not rule(*k.split(" -> "))}
    return sorted(found - KNOWN_BROKEN)


def test_backend_imports_nothing_of_the_app():
    """The engine never depends on the app: names, recipes, the fit check and the CLI live
    above it. The one leaf it may read is where atlas keeps its caches."""
    allowed = ("atlas_cli.backend", "atlas_cli.errors", "atlas_cli.store.paths")
    assert (
        broken(lambda a, b: under(a, "atlas_cli.backend") and not any(under(b, x) for x in allowed))
        == []
    )


def test_models_read_like_the_math():
    """Model files use the ops contract, the cache and the layer records only: never loaders,
    runtimes or the hub."""
    allowed = {
        "atlas_cli.backend.cache",
        "atlas_cli.backend.layers",
        "atlas_cli.backend.ops.contract",
        "atlas_cli.errors",
    }
    assert (
        broken(
            lambda a, b: (
                under(a, "atlas_cli.backend.models")
                and not (under(b, "atlas_cli.backend.models") or b in allowed)
            )
        )
        == []
    )
    for mod in modules():
        if under(mod, "atlas_cli.backend.models"):
            assert third_party(mod) <= STDLIB_AND_NUMPY | _stdlib(), mod


def _stdlib() -> set[str]:
    import sys

    return set(sys.stdlib_module_names)


def test_numpy_reference_imports_numpy_only():
    mod = "atlas_cli.backend.ops.numpy_ref"
    assert third_party(mod) <= STDLIB_AND_NUMPY | _stdlib()
    assert edges()[mod] <= {"atlas_cli.errors"}


@pytest.mark.parametrize(
    "package, only",
    [
        ("cupy", "atlas_cli.backend.ops.native.runtime_cuda"),
        ("hip", "atlas_cli.backend.ops.native.runtime_hip"),
    ],
)
def test_one_home_per_gpu_package(package, only):
    users = {m for m in modules() if package in third_party(m)}
    assert users - KNOWN_GPU_PACKAGE_USERS <= {only}


def test_nothing_imports_the_cli_assembly():
    starters = {"atlas_cli.__main__", "atlas_cli.entry"}  # entry: the console script
    assert broken(lambda a, b: b == "atlas_cli.cli" and a not in starters) == []


# The command line: the Typer app, its command modules (bench's among them) and what starts it.
CLI_LAYER = (
    "atlas_cli.__main__",
    "atlas_cli.entry",
    "atlas_cli.cli",
    "atlas_cli.commands",
    "atlas_cli.bench.cli",
)


def test_only_the_cli_imports_the_commands():
    """What a command and another caller share lives in a library module below the commands
    (`run_service`: `atlas run` and its keep-alive worker), never in the command's module."""
    assert (
        broken(
            lambda a, b: under(b, "atlas_cli.commands") and not any(under(a, x) for x in CLI_LAYER)
        )
        == []
    )


def test_store_and_recipes_are_told_the_hardware():
    """The store and the recipes never probe the machine: their callers (the session, the
    commands) pass the hardware class down; the class names are a leaf of their own."""
    told = ("atlas_cli.store", "atlas_cli.recipes")
    assert (
        broken(lambda a, b: any(under(a, x) for x in told) and under(b, "atlas_cli.hardware")) == []
    )
    assert edges()["atlas_cli.hardware_classes"] == set()


def test_store_paths_is_a_leaf():
    """The backend reads its cache dirs from store.paths, so that module must not reach back."""
    assert edges()["atlas_cli.store.paths"] <= {"atlas_cli.errors"}
    assert edges()["atlas_cli.store"] == set()  # the package imports none of its modules


def test_api_routers_depend_on_shared_helpers_not_the_app():
    routers = {
        "atlas_cli.serve.openai_api",
        "atlas_cli.serve.anthropic_api",
        "atlas_cli.serve.responses_api",
    }
    assert broken(lambda a, b: a in routers and b in routers | {"atlas_cli.serve.app"}) == []


def source_files() -> list[Path]:
    roots = [PACKAGE, ROOT / "scripts", ROOT / "benchmarks", ROOT / "tests"]
    return sorted(p for r in roots for p in r.rglob("*.py") if "fixtures" not in p.parts)


def test_rooms_stay_small():
    big = {}
    for path in source_files():
        lines = path.read_text(encoding="utf-8").count("\n")
        if lines > MAX_FILE_LINES:
            big[str(path.relative_to(ROOT))] = lines
    assert set(big) == KNOWN_BIG_FILES


def test_functions_stay_short():
    long = {}
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = length
    assert set(long) == KNOWN_LONG_FUNCTIONS
