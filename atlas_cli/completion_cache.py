"""Tab completion from the cached command table: no Typer, no click, no command modules.

Importing the CLI costs ~0.2 s of CPU, and a shell runs `atlas` on every Tab. So the first Tab
answered the slow way (the Typer app, atlas_cli/cli.py) also writes the command tree as a table
(atlas_cli/completion_table.py) into the cache directory, and later Tabs are answered from it
here, with model names read live from `completion.NAME_SOURCES`.

This is Typer's completion (typer/_completion_classes.py over its click core,
`shell_completion._resolve_context` / `_resolve_incomplete`) replayed on the table, for the lines
it can replay exactly: words that are known subcommands, known options and their values, and
positional arguments. Anything else (`--`, `--opt=value`, a cluster of short flags, an unknown
word, a value that looks like an option) returns None and the CLI answers. A test compares the
two on many lines for every shell.

The table is used only while it is fresh: the same atlas version, Python and table format, and
the same files (path, size, mtime) of atlas and of Typer; else the CLI rewrites it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from atlas_cli import __version__
from atlas_cli.completion import (
    SHELLS,
    complete_downloaded,
    complete_models,
    route_completion_words,
    split_words,
)
from atlas_cli.store.paths import cache_dir

TABLE_FORMAT = 1
PACKAGE = Path(__file__).resolve().parent
SKIPPED = {"kernels", "__pycache__"}  # every .py and .toml counts: a choice may live anywhere
LIVE = {
    "models": complete_models,
    "downloaded": complete_downloaded,
}  # value kinds read live, not from the table
ENV_KEYS = ("COMP_WORDS", "COMP_CWORD", "_TYPER_COMPLETE_ARGS")

Item = tuple[str, str | None]  # (value, help)


def table_path() -> Path:
    return cache_dir() / "completion" / f"atlas-{__version__}.json"


def fingerprint(typer_file: str) -> str:
    """What the table was built from: atlas's sources (~130 stats, ~2 ms) and Typer's file."""
    seen = []
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED)
        for name in sorted(files):
            if name.endswith((".py", ".toml")):
                seen.append(_stamp(os.path.join(folder, name)))
    seen.append(_stamp(typer_file))
    return "\n".join(seen)


def _stamp(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return f"{path} missing"
    return f"{path} {st.st_size} {st.st_mtime_ns}"


def stamp(typer_file: str) -> dict[str, object]:
    """The freshness record a table carries."""
    return {
        "format": TABLE_FORMAT,
        "version": __version__,
        "python": sys.version,
        "typer": typer_file,
        "sources": fingerprint(typer_file),
    }


def load(path: Path | None = None) -> dict | None:
    """The cached table, or None when there is none or it is stale."""
    try:
        table = json.loads((path or table_path()).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    key = table.get("stamp") if isinstance(table, dict) else None
    if not isinstance(key, dict) or not isinstance(key.get("typer"), str):
        return None
    return table if key == stamp(key["typer"]) else None


def save(table: dict, typer_file: str, path: Path | None = None) -> None:
    """Write the table for the next Tab; a cache that cannot be written is only slower."""
    path = path or table_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f"{path.name}.{os.getpid()}.part")
        part.write_text(json.dumps({**table, "stamp": stamp(typer_file)}), encoding="utf-8")
        os.replace(part, path)
        for old in path.parent.glob("atlas-*.json"):  # other versions' tables
            if old != path:
                old.unlink(missing_ok=True)
    except OSError:
        pass


def complete_from_cache(instruction: str) -> tuple[str, int] | None:
    """What the shell gets for this Tab (output, exit status), or None to ask the CLI."""
    shell = instruction.partition("_")[2] if instruction.startswith("complete_") else ""
    if shell not in SHELLS:
        return None
    if shell == "bash" and not os.environ.get("COMP_CWORD", "").isdigit():
        return None  # not a line from the bash script: let the CLI say what is wrong
    table = load()
    if table is None:
        return None
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    try:
        route_completion_words(lambda words: route(table["routes"], words))
        done = _answer(table, shell)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        done = None  # a damaged table: the CLI answers
    if done is None:  # the CLI routes the words itself
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return done


def route(routes: dict[str, dict], words: list[str]) -> list[str]:
    """cli.with_default_bench_command from the table: a group's default subcommand goes first
    unless the next word is one of its subcommands or a help flag (bench.cli.route_bench_args)."""
    rule = routes.get(words[0]) if words else None
    if rule is None or len(words) < 2 or words[1] in rule["keep"]:
        return words
    return [words[0], rule["default"], *words[1:]]


def _answer(table: dict, shell: str) -> tuple[str, int] | None:
    args, incomplete = _completion_args(shell)
    items = resolve(table["tree"], args, incomplete)
    if items is None:
        return None
    if shell == "bash":
        return "\n".join(value for value, _ in items) + "\n", 0
    lines = _format(items, table["renders"][shell], shell)
    if lines is None:
        return None
    if shell == "zsh":
        return ("_arguments '*: :((" + "\n".join(lines) + "))'" if lines else "_files") + "\n", 0
    action = os.environ.get("_TYPER_COMPLETE_FISH_ACTION", "")
    if action == "is-args":
        return "", 0 if lines else 1
    return ("\n".join(lines) if action == "get-args" else "") + "\n", 0


def _completion_args(shell: str) -> tuple[list[str], str]:
    """The words before the cursor and the one being typed, as Typer's shell classes read them."""
    if shell == "bash":
        words = split_words(os.environ["COMP_WORDS"])
        cword = int(os.environ["COMP_CWORD"])
        return words[1:cword], words[cword] if cword < len(words) else ""
    line = os.environ.get("_TYPER_COMPLETE_ARGS", "")
    args = split_words(line)[1:]
    if args and not line.endswith(" "):
        return args[:-1], args[-1]
    return args, ""


def _format(items: list[Item], renders: dict[str, str], shell: str) -> list[str] | None:
    lines = []
    for value, about in items:
        if about and about not in renders:
            return None  # a help text the table has not seen rendered
        if shell == "zsh":
            head = f'"{_zsh_escape(value)}"'
            lines.append(f'{head}:"{renders[about]}"' if about else head)
        else:
            lines.append(f"{value}\t{renders[about]}" if about else value)
    return lines


def _zsh_escape(s: str) -> str:
    """typer's ZshComplete.format_completion escape."""
    for old, new in (('"', '""'), ("'", "''"), ("$", "\\$"), ("`", "\\`"), (":", r"\\:")):
        s = s.replace(old, new)
    return s


# -- click's resolution, replayed -------------------------------------------------------------


def resolve(tree: dict, args: list[str], incomplete: str) -> list[Item] | None:
    """The completions for `incomplete` after `args`, as click's `_resolve_incomplete` finds
    them; None where the table cannot tell."""
    walked = _walk(tree, args)
    if walked is None:
        return None
    node, given = walked
    if incomplete == "=":
        incomplete = ""
    elif "=" in incomplete and incomplete.startswith("-"):
        return None
    if incomplete.startswith("-"):
        return _names(node, given, incomplete)
    params = node["params"]
    for p in params:
        if _wants_value(args, p):
            return _values(p, incomplete)
    for p in params:
        if not p["option"] and (p["nargs"] == -1 or p["name"] not in given):
            return _values(p, incomplete)
    return _names(node, given, incomplete)


def _walk(tree: dict, args: list[str]) -> tuple[dict, set[str]] | None:
    """The command the words lead to and the parameters they set there."""
    node, given, position, i = tree, set(), 0, 0
    while i < len(args):
        word = args[i]
        if word == "--":
            return None
        if word.startswith("-") and len(word) > 1:
            p = _option(node, word)
            if p is None or not p["plain"]:
                return None
            given.add(p["name"])
            if not p["flag"]:
                if p["nargs"] != 1 or (i + 1 < len(args) and args[i + 1].startswith("-")):
                    return None
                i += 1  # its value
        elif "commands" in node and not node["interspersed"]:
            node = node["commands"].get(word)
            if node is None:
                return None
            given, position = set(), 0
        else:
            arguments = [p for p in node["params"] if not p["option"]]
            if position >= len(arguments):
                return None
            p = arguments[position]
            if p["nargs"] == -1 and p is not arguments[-1] or p["nargs"] not in (1, -1):
                return None  # click spreads these from the end
            given.add(p["name"])
            position += p["nargs"] == 1
        i += 1
    return node, given


def _option(node: dict, word: str) -> dict | None:
    for p in node["params"]:
        if p["option"] and (word in p["opts"] or word in p["secondary"]):
            return p
    return None


def _wants_value(args: list[str], p: dict) -> bool:
    """click's `_is_incomplete_option`."""
    if not p["option"] or p["flag"]:
        return False
    for index, arg in enumerate(reversed(args)):
        if index + 1 > p["nargs"]:
            break
        if arg.startswith("-"):
            return arg in p["opts"]
    return False


def _values(p: dict, incomplete: str) -> list[Item] | None:
    kind = p["values"]["kind"]
    if kind in LIVE:
        found = [c if isinstance(c, tuple) else (c, None) for c in LIVE[kind](incomplete)]
        return [(v, about) for v, about in found if v.startswith(incomplete)]
    if kind == "items":
        return [(v, about) for v, about in p["values"]["items"] if v.startswith(incomplete)]
    if kind == "echo":
        return [(incomplete, None)]
    return [] if kind == "none" else None


def _names(node: dict, given: set[str], incomplete: str) -> list[Item]:
    """A group's subcommands, then (for a word that starts with a symbol) the options."""
    items = [(name, short) for name, short in node.get("listed", []) if name.startswith(incomplete)]
    if incomplete and not incomplete[0].isalnum():
        for p in node["params"]:
            if p["offered"] and (p["multiple"] or p["name"] not in given):
                items += [
                    (n, p["help"]) for n in p["opts"] + p["secondary"] if n.startswith(incomplete)
                ]
    return items
