"""The command tree as a table, for Tab completion without importing the CLI.

Written by the slow path (the Typer app answering a Tab, see atlas_cli/cli.py) into atlas's
cache directory; read by atlas_cli/completion_cache.py. Everything in it is taken from the
click objects Typer builds and from the shell classes Typer registers, by asking them, so the
fast path answers what they answer:

- per command: its parameters in `get_params` order (option names, help, flag or value,
  nargs, what completes the value) and, for a group, its visible subcommands with their short
  help in `list_commands` order;
- value completion: `models` for the model-name completer (live: `completion.complete_models`),
  the recorded values for any other completer or choice (they are prefix filters over a fixed
  set; checked here on probes, else marked `slow`), `echo` for a path (the shell completes
  files), `none` for nothing;
- each help text as each shell prints it (zsh and fish pass it through Typer's renderer).

A parameter or line the table cannot answer exactly is marked `slow`: the fast path then hands
the Tab to the CLI.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

PROBE = "\x00atlas-probe"  # a word no completer offers anything for


def build(
    root: Any, prog: str, dynamic: dict[Callable, str], routes: dict[str, dict]
) -> dict[str, Any]:
    """The table of `root` (a click command). `dynamic` maps a completer function to the name
    of the live source the fast path calls instead; `routes` are the groups' default
    subcommands (see cli.with_default_bench_command)."""
    ctx = root.make_context(prog, [], resilient_parsing=True)
    helps: set[str] = set()
    tree = _node(root, ctx, dynamic, helps)
    from atlas_cli.completion import model_names

    helps.update(model_names().values())
    return {"tree": tree, "routes": routes, "renders": _renders(root, prog, helps)}


def _node(command: Any, ctx: Any, dynamic: dict[Callable, str], helps: set[str]) -> dict:
    offered = {item.value for item in command.shell_complete(ctx, "-")}
    params = [_param(p, command, ctx, dynamic, offered) for p in command.get_params(ctx)]
    helps.update(p["help"] for p in params if p["help"])
    node: dict[str, Any] = {
        "params": params,
        "interspersed": bool(ctx.allow_interspersed_args),
    }
    if hasattr(command, "list_commands"):
        listed, commands = [], {}
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is None:
                continue
            sub_ctx = sub.make_context(name, [], parent=ctx, resilient_parsing=True)
            commands[name] = _node(sub, sub_ctx, dynamic, helps)
            if not sub.hidden:
                short = sub.get_short_help_str()
                listed.append([name, short])
                helps.add(short)
        node["listed"], node["commands"] = listed, commands
    return node


def _param(p: Any, command: Any, ctx: Any, dynamic: dict, offered: set[str]) -> dict:
    is_option = hasattr(p, "is_flag")
    help_option = command.get_help_option(ctx)
    return {
        "name": p.name,
        "option": is_option,
        "opts": list(p.opts),
        "secondary": list(p.secondary_opts),
        "help": getattr(p, "help", None),
        "offered": any(n in offered for n in [*p.opts, *p.secondary_opts]),
        "multiple": bool(p.multiple),
        "flag": bool(is_option and (p.is_flag or p.count)),
        "nargs": p.nargs,
        # an option whose callback acts while completing (--version prints) needs the CLI
        "plain": p.callback is None or p is help_option,
        "values": _values(p, ctx, dynamic),
    }


def _values(p: Any, ctx: Any, dynamic: dict[Callable, str]) -> dict:
    """How the parameter completes its value, found by asking it."""
    source = _dynamic_source(getattr(p, "_custom_shell_complete", None), dynamic)
    if source:
        return {"kind": source}
    try:
        everything = p.shell_complete(ctx, "")
        probed = p.shell_complete(ctx, PROBE)
    except Exception:  # a completer that fails here fails in the CLI too: let it say so
        return {"kind": "slow"}
    if [(i.value, i.help) for i in probed] == [(PROBE, None)]:
        return {"kind": "echo"}  # a path: the value typed so far, and the shell adds files
    if probed or any(not isinstance(i.value, str) for i in everything):
        return {"kind": "slow"}
    items = [[i.value, i.help] for i in everything]
    for prefix in {v[:1] for v, _ in items} | {v[:2] for v, _ in items}:
        got = [[i.value, i.help] for i in p.shell_complete(ctx, prefix)]
        if got != [i for i in items if i[0].startswith(prefix)]:
            return {"kind": "slow"}  # not a filter over a fixed set
    return {"kind": "items", "items": items} if items else {"kind": "none"}


def _dynamic_source(completer: Any, dynamic: dict[Callable, str], depth: int = 0) -> str | None:
    """The live source behind `completer`: Typer wraps the function given as `autocompletion`
    in closures, so look through their cells."""
    if completer is None or depth > 4:
        return None
    if completer in dynamic:
        return dynamic[completer]
    for cell in getattr(completer, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:
            continue
        if callable(inner) and (found := _dynamic_source(inner, dynamic, depth + 1)):
            return found
    return None


def _renders(root: Any, prog: str, helps: Iterable[str]) -> dict[str, dict[str, str]]:
    """Each help text as zsh and fish print it, cut out of the shell classes' own lines."""
    from typer._completion_classes import FishComplete, ZshComplete
    from typer.completion import completion_init

    try:
        from typer._click.shell_completion import CompletionItem
    except ImportError:  # Typer releases that use click itself
        from click.shell_completion import CompletionItem
    from atlas_cli.completion import COMPLETE_VAR

    completion_init()
    shapes = {"zsh": (ZshComplete, '"v":"', '"'), "fish": (FishComplete, "v\t", "")}
    renders: dict[str, dict[str, str]] = {}
    for shell, (cls, head, tail) in shapes.items():
        shell_class = cls(root, {}, prog, COMPLETE_VAR)
        done = renders.setdefault(shell, {})
        for text in sorted(helps):
            line = shell_class.format_completion(CompletionItem("v", help=text))
            if line.startswith(head) and line.endswith(tail):
                done[text] = line[len(head) : len(line) - len(tail)]
    return renders
