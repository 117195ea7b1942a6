"""What each slash command does: `/name ARG` runs `cmd_name(ARG)`, `/show topic` runs
`show_topic()`. The names, arguments and help texts are in commands.py.

`SlashCommands` is mixed into `ChatREPL` (repl.py): the handlers read and change the REPL's
state declared below, and call its `respond_or_undo()`, `prompt_ids()`, `context` and
`note()`.
A handler that returns False ends the chat; a bad argument raises `UsageError`, which the loop
prints without leaving.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markdown import Markdown
from rich.text import Text

from atlas_cli.backend.engine import GenerationStats
from atlas_cli.chat.commands import COMMANDS, KEYS, SHOW_TOPICS, resolve_command
from atlas_cli.chat.conversation import Conversation
from atlas_cli.chat.input import PROMPT
from atlas_cli.chat.render import Totals, describe, footer, label, table
from atlas_cli.chat.settings import (
    PARAMS,
    ChatSettings,
    apply,
    from_options,
    param_name,
    show_value,
)
from atlas_cli.errors import UsageError

# what /load restores from a saved file (display switches stay as the user has them)
RESTORED = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "seed",
    "reasoning_budget",
    "max_tokens",
    "stop",
)


class SlashCommands:
    # the REPL's state (set by ChatREPL.__init__)
    model: Any
    model_name: str
    settings: ChatSettings
    conv: Conversation
    console: Console
    loader: Callable[[str], Any]
    last: GenerationStats | None
    totals: Totals

    def cmd_help(self, arg: str) -> None:
        if arg:
            c = resolve_command(arg.lstrip("/"))
            self.console.print(Text(f"/{c.name} {c.args}".rstrip(), style="bold"), c.help)
            if c.aliases:
                self.console.print("also: " + ", ".join("/" + a for a in c.aliases))
            if c.name == "set":
                self.console.print(table({n: p.help for n, p in PARAMS.items()}))
            elif c.name == "show":
                self.console.print(table(SHOW_TOPICS))
            return
        self.console.print(table({f"/{c.name} {c.args}".rstrip(): c.help for c in COMMANDS}))
        self.console.print()
        self.console.print(table(dict(KEYS)))

    def cmd_bye(self, arg: str) -> bool:
        return False

    def cmd_clear(self, arg: str) -> None:
        self.conv.clear()
        kept = " (the system prompt stays)" if self.conv.system else ""
        self.note(f"Cleared the conversation{kept}.")

    def cmd_system(self, arg: str) -> None:
        self.conv.system = arg or None
        self.note("System prompt set." if arg else "System prompt removed.")

    def cmd_set(self, arg: str) -> None:
        if not arg:
            self.show_params()
            return
        name, _, value = arg.partition(" ")
        if not value.strip():
            raise UsageError(f"usage: /set {name} VALUE")
        self.settings = apply(self.settings, name, value.strip())
        key = param_name(name)
        self.note(f"{key} = {show_value(getattr(self.settings, key))}")

    def cmd_show(self, arg: str) -> None:
        topics = [t for t in SHOW_TOPICS if t.startswith(arg.lower())] if arg else []
        if len(topics) != 1:
            raise UsageError("usage: /show " + "|".join(SHOW_TOPICS))
        getattr(self, f"show_{topics[0]}")()

    def cmd_retry(self, arg: str) -> None:
        if not self.conv.turn_starts:
            self.note("Nothing to retry yet.")
            return
        old = self.conv.pop_last("assistant")

        def put_back() -> None:
            if old is not None:
                self.conv.turns.append(old)

        self.respond_or_undo(put_back)

    def cmd_save(self, arg: str) -> None:
        path = _file_arg("save", arg)
        self.conv.save(path, self.model_name, self.settings.options())
        self.note(f"Saved {len(self.conv.turn_starts)} turn(s) to {path}.")

    def cmd_load(self, arg: str) -> None:
        path = _file_arg("load", arg)
        conv, options = Conversation.load(path)
        restored = {k: options[k] for k in RESTORED if k in options}
        self.settings = from_options(self.settings, restored)
        self.conv = conv
        self.replay()
        self.note(f"Loaded {len(conv.turn_starts)} turn(s) from {path}.")
        saved = options.get("model")
        if isinstance(saved, str) and saved != self.model_name:
            self.note(f"It was saved with {saved}; /model {saved} switches to it.")

    def cmd_stats(self, arg: str) -> None:
        used = len(self.prompt_ids(self.conv.messages()))
        rows = {
            "model": label(self.model_name),
            "context": f"{used:,} of {self.context:,} tokens ({100 * used / self.context:.1f}%)",
            "turns": str(len(self.conv.turn_starts)),
        }
        if self.last is not None:
            rows["last answer"] = footer(self.last)
        if self.totals.answers:
            rows["session"] = self.totals.summary()
        self.console.print(table(rows))

    def cmd_model(self, arg: str) -> None:
        if not arg:
            raise UsageError(f"usage: /model NAME (now: {self.model_name})")
        self.model = self.loader(arg)
        self.model_name = arg
        self.note(f"Switched to {label(arg)} ({describe(self.model)}); the conversation stays.")

    # -- /show -----------------------------------------------------------------------------

    def show_info(self) -> None:
        m = self.model
        info, cfg = m.info, m.info.config
        heads = cfg.get("num_attention_heads")
        kv = cfg.get("num_key_value_heads", heads)
        arch = info.architecture
        if cfg.get("model_type") not in (None, arch):
            arch += f" ({cfg['model_type']})"
        rows = {
            "model": info.name
            if info.name == label(self.model_name)
            else f"{label(self.model_name)} ({info.name})",
            "architecture": arch,
            "weights": f"{info.format}, {info.file_type}",
            "layers": str(cfg.get("num_hidden_layers", "?")),
            "hidden size": str(cfg.get("hidden_size", "?")),
            "attention heads": f"{heads} ({kv} key/value)",
            "context": f"{m.context_length:,} tokens (model limit "
            f"{cfg.get('max_position_embeddings', m.context_length):,})",
            "vocabulary": f"{m.tokenizer.vocab_size:,} tokens",
            "chat template": "yes" if m.tokenizer.chat_template else "none",
            "device": m.device,
            "path": str(info.path),
        }
        self.console.print(table(rows))

    def show_params(self) -> None:
        self.console.print(
            table({n: show_value(getattr(self.settings, n)) for n in PARAMS}, plain_values=True)
        )

    def show_template(self) -> None:
        template = self.model.tokenizer.chat_template
        if not template:
            self.note("This model has no chat template.")
            return
        self.console.print(template, markup=False, highlight=False)

    def show_system(self) -> None:
        if self.conv.system:
            self.console.print(self.conv.system, markup=False, highlight=False)
        else:
            self.note("No system prompt (the chat template's default applies, if it has one).")

    # -- after /load -----------------------------------------------------------------------

    def replay(self) -> None:
        """Print a loaded conversation as if it had just been typed and answered."""
        if self.conv.system:
            self.console.print(Text("system: ", style="dim") + Text(self.conv.system, "dim"))
        for m in self.conv.turns:
            if m["role"] == "user":
                self.console.print(Text(PROMPT, style="bold") + Text(m["content"]))
            elif self.settings.markdown:
                self.console.print(Markdown(m["content"]))
            else:
                self.console.print(m["content"], markup=False, highlight=False)


def _file_arg(command: str, arg: str) -> Path:
    if not arg:
        raise UsageError(f"usage: /{command} FILE")
    return Path(arg).expanduser()
