"""What the user types: a prompt-toolkit session on a terminal (its key bindings, history and
completion), plain lines from a pipe, `\"\"\"` blocks that span lines, and where the input
history lives.

The REPL reads through the `LineInput` protocol and never asks which of the two it has.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Protocol, TextIO

from rich.console import Console

from atlas_cli.chat.commands import SlashCompleter

PROMPT = ">>> "
CONTINUATION = "... "
TRIPLE = '"""'
NO_HISTORY_ENV = "ATLAS_NO_HISTORY"


class LineInput(Protocol):
    def read(self, prompt: str) -> str: ...  # raises EOFError at the end, KeyboardInterrupt

    def confirm(self, question: str) -> bool: ...


def open_input(console: Console, *, history: bool, input=None, output=None) -> LineInput:
    """Plain lines when stdin is a pipe (and the caller gave no prompt-toolkit `input`), else a
    prompt-toolkit session that keeps a history file unless `history` is off."""
    if input is None and not sys.stdin.isatty():
        return PlainInput(sys.stdin, console)
    from atlas_cli.completion import model_names

    path = prepare_history(history_path()) if history_enabled(history) else None
    return PromptInput(path, SlashCompleter(model_names), input=input, output=output)


# -- multi-line blocks ---------------------------------------------------------------------


def block_open(text: str) -> bool:
    """True inside a `\"\"\"` block that has not been closed yet."""
    stripped = text.lstrip()
    return stripped.startswith(TRIPLE) and stripped.count(TRIPLE) % 2 == 1


def unwrap_block(text: str) -> str:
    inner = text.strip().removeprefix(TRIPLE)
    inner = inner.removesuffix(TRIPLE) if inner.rstrip().endswith(TRIPLE) else inner
    return inner.rstrip().removesuffix(TRIPLE).strip("\n").strip()


def is_yes(answer: str) -> bool:
    """A yes to a [Y/n] question: Enter alone counts as yes."""
    return answer.strip().lower() in ("", "y", "yes")


# -- a terminal ----------------------------------------------------------------------------


class PromptInput:
    """prompt-toolkit: Emacs keys, history, completion, multi-line input."""

    def __init__(self, history: Path | None, completer, *, input=None, output=None):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.auto_suggest import AutoSuggestFromHistory
        from prompt_toolkit.history import FileHistory, InMemoryHistory
        from prompt_toolkit.styles import Style

        style = Style.from_dict({"prompt": "bold", "placeholder": "#808080"})
        self.session = PromptSession(
            history=FileHistory(str(history)) if history else InMemoryHistory(),
            completer=completer,
            complete_while_typing=True,
            auto_suggest=AutoSuggestFromHistory(),
            key_bindings=_key_bindings(),
            multiline=True,
            prompt_continuation=lambda width, line, wrap: CONTINUATION.rjust(width),
            placeholder=[("class:placeholder", "Send a message (/help for commands)")],
            style=style,
            input=input,
            output=output,
        )
        # questions get their own session: their answers stay out of the history
        self.questions = PromptSession(input=input, output=output, style=style)

    def read(self, prompt: str) -> str:
        return self.session.prompt([("class:prompt", prompt)])

    def confirm(self, question: str) -> bool:
        try:
            answer = self.questions.prompt(question)
        except (EOFError, KeyboardInterrupt):
            return False
        return is_yes(answer)


def _key_bindings():
    from prompt_toolkit.key_binding import KeyBindings

    kb = KeyBindings()

    @kb.add("enter")
    def _(event):
        buffer = event.current_buffer
        if block_open(buffer.text):
            buffer.newline(copy_margin=False)
        else:
            buffer.validate_and_handle()

    @kb.add("escape", "enter")
    def _(event):
        event.current_buffer.newline(copy_margin=False)

    @kb.add("c-c")
    def _(event):
        # like a shell: Ctrl-C drops what is typed; on an empty line it reminds how to leave
        if event.current_buffer.text:
            event.current_buffer.reset()
        else:
            event.app.exit(exception=KeyboardInterrupt, style="class:aborting")

    return kb


# -- a pipe --------------------------------------------------------------------------------


class PlainInput:
    """Lines from a pipe: `printf 'Hi\\n/bye\\n' | atlas chat`."""

    def __init__(self, stream: TextIO, console: Console):
        self.stream = stream
        self.console = console

    def read(self, prompt: str) -> str:
        line = self.stream.readline()
        if not line:
            raise EOFError
        text = line.rstrip("\n")
        while block_open(text) and (more := self.stream.readline()):
            text += "\n" + more.rstrip("\n")
        return text

    def confirm(self, question: str) -> bool:
        self.console.print(question, end="", markup=False)
        line = self.stream.readline()
        self.console.print(line.strip(), markup=False)
        return bool(line) and is_yes(line)


# -- history -------------------------------------------------------------------------------


def history_path() -> Path:
    """Where input history lives: $ATLAS_HOME/chat_history, or the per-user state directory."""
    home = os.environ.get("ATLAS_HOME")
    if home:
        return Path(home).expanduser() / "chat_history"
    import platformdirs

    return Path(platformdirs.user_state_dir("atlas", appauthor=False)) / "chat_history"


def history_enabled(flag: bool) -> bool:
    off = os.environ.get(NO_HISTORY_ENV, "").strip().lower() not in ("", "0", "false", "no")
    return flag and not off


def prepare_history(path: Path) -> Path | None:
    """Create the history file private to the user (chats can be personal); None if the
    location is not writable."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not path.exists():
            path.touch(mode=0o600)
        return path
    except OSError:
        return None
