"""The REPL's slash commands as data: their names, arguments and help (for /help), how a typed
word finds one (name, alias or unique prefix), and their tab completion. What each command
does lives in handlers.py."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prompt_toolkit.completion import CompleteEvent, Completer, Completion, PathCompleter
from prompt_toolkit.document import Document

from atlas_cli.chat.settings import PARAMS, find_param
from atlas_cli.errors import UsageError


@dataclass(frozen=True)
class Command:
    name: str
    args: str
    help: str
    aliases: tuple[str, ...] = ()


COMMANDS = (
    Command("help", "[COMMAND]", "list the commands and keys, or explain one command", ("?",)),
    Command("bye", "", "leave the chat (Ctrl-D does too)", ("exit", "quit")),
    Command("clear", "", "forget the conversation; the system prompt stays"),
    Command("system", "[TEXT]", "set the system prompt; without TEXT, remove it"),
    Command("set", "PARAM VALUE", "change a sampling or display setting; /set alone lists them"),
    Command("show", "info|params|template|system", "show the model, settings, template or prompt"),
    Command("retry", "", "throw away the last answer and generate it again"),
    Command("save", "FILE", "save the conversation (JSON)"),
    Command("load", "FILE", "load a conversation saved with /save"),
    Command("stats", "", "context use, speed of the last answer, session totals"),
    Command("model", "NAME", "switch to another model; the conversation stays"),
)
SHOW_TOPICS = {
    "info": "the model: architecture, quantization, context, device",
    "params": "the current settings",
    "template": "the model's chat template",
    "system": "the system prompt",
}

BY_NAME = {name: c for c in COMMANDS for name in (c.name, *c.aliases)}

KEYS = (
    ("Enter", "send"),
    ('"""', "start or end a multi-line message"),
    ("Alt-Enter / Esc Enter", "new line"),
    ("Tab", "complete a /command, setting, model or file"),
    ("Up / Down, Ctrl-R", "history, search history"),
    ("Ctrl-C", "stop the answer (the conversation stays), or clear the line"),
    ("Ctrl-D", "leave"),
)


def lookup(name: str) -> Command | None:
    return BY_NAME.get(name.lower())


def resolve_command(word: str) -> Command:
    """A command by name, alias or unique prefix (`/cl` is /clear)."""
    exact = lookup(word)
    if exact is not None:
        return exact
    matches = [c for c in COMMANDS if c.name.startswith(word.lower())] if word else []
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise UsageError(f"/{word} could be " + ", ".join("/" + c.name for c in matches))
    raise UsageError(f"unknown command /{word}; /help lists them")


class SlashCompleter(Completer):
    """Completes /commands, their arguments, /set parameters and values, model names and
    file paths for /save and /load."""

    def __init__(self, model_names: Callable[[], dict[str, str]]):
        self.model_names = model_names
        self.paths = PathCompleter(expanduser=True)

    def get_completions(self, document: Document, event: CompleteEvent) -> Iterable[Completion]:
        text = document.text_before_cursor
        if not text.startswith("/") or "\n" in text:
            return
        if " " not in text:
            word = text[1:].lower()
            for c in COMMANDS:
                if c.name.startswith(word):
                    yield Completion("/" + c.name, -len(text), display_meta=c.help)
            return
        head, _, rest = text[1:].partition(" ")
        command = lookup(head)
        if command is None:
            return
        if command.name == "set":
            name, space, value = rest.partition(" ")
            if not space:
                yield from _choices(rest, {n: p.help for n, p in PARAMS.items()})
            elif (param := find_param(name)) is not None:
                yield from _choices(value, dict.fromkeys(param.values, ""))
        elif command.name == "show":
            yield from _choices(rest, SHOW_TOPICS)
        elif command.name == "help":
            yield from _choices(rest, {c.name: c.help for c in COMMANDS})
        elif command.name == "model":
            yield from _choices(rest, self.model_names())
        elif command.name in ("save", "load"):
            yield from self.paths.get_completions(Document(rest, len(rest)), event)


def _choices(word: str, options: dict[str, str]) -> Iterable[Completion]:
    for value, meta in options.items():
        if value.startswith(word) and " " not in word:
            yield Completion(value, -len(word), display_meta=meta or None)
