"""`atlas chat`: the interactive loop, its input (prompt-toolkit on a terminal, plain lines
from a pipe) and the slash commands.

Each turn renders the whole conversation with the model's chat template; the engine keeps its
KV cache between requests and prefills only the part of the prompt that is new, so a long
conversation costs one turn's worth of prefill per turn.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

from rich.console import Console
from rich.markdown import Markdown
from rich.table import Table
from rich.text import Text

from atlas_cli.backend.engine import GenerationStats
from atlas_cli.chat.commands import COMMANDS, KEYS, SHOW_TOPICS, Command, SlashCompleter, lookup
from atlas_cli.chat.conversation import Conversation, plan_fit, reply_room
from atlas_cli.chat.render import TurnPrinter, footer
from atlas_cli.chat.settings import PARAMS, ChatSettings, apply, from_options, show_value
from atlas_cli.errors import AtlasError, TemplateError, UsageError

PROMPT = ">>> "
CONTINUATION = "... "
NO_HISTORY_ENV = "ATLAS_NO_HISTORY"
NEARLY_FULL = 0.9  # warn when a turn leaves the context this full
# what /load restores from a saved file (display switches stay as the user has them)
RESTORED = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "seed",
    "max_tokens",
    "stop",
)
TRIPLE = '"""'


@dataclass(frozen=True)
class ChatOptions:
    system: str | None = None
    device: str = "cpu"
    ctx_size: int | None = None
    history: bool = True
    # sampling settings the user gave; the others take the model recipe's defaults
    explicit: frozenset[str] = frozenset()


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


# -- input ---------------------------------------------------------------------------------


def block_open(text: str) -> bool:
    """True inside a `\"\"\"` block that has not been closed yet."""
    stripped = text.lstrip()
    return stripped.startswith(TRIPLE) and stripped.count(TRIPLE) % 2 == 1


def unwrap_block(text: str) -> str:
    inner = text.strip().removeprefix(TRIPLE)
    inner = inner.removesuffix(TRIPLE) if inner.rstrip().endswith(TRIPLE) else inner
    return inner.rstrip().removesuffix(TRIPLE).strip("\n").strip()


class LineInput(Protocol):
    def read(self, prompt: str) -> str: ...  # raises EOFError at the end, KeyboardInterrupt

    def confirm(self, question: str) -> bool: ...


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
        return answer.strip().lower() in ("", "y", "yes")


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
        return bool(line) and line.strip().lower() in ("", "y", "yes")


# -- the REPL ------------------------------------------------------------------------------


@dataclass
class Totals:
    answers: int = 0
    prompt_tokens: int = 0  # evaluated, not taken from the cache
    cached_tokens: int = 0
    completion_tokens: int = 0
    prompt_s: float = 0.0
    eval_s: float = 0.0

    def add(self, s: GenerationStats) -> None:
        self.answers += 1
        self.prompt_tokens += s.prompt_tokens - s.cached_tokens
        self.cached_tokens += s.cached_tokens
        self.completion_tokens += s.completion_tokens
        self.prompt_s += s.prompt_s
        self.eval_s += s.eval_s


class ChatREPL:
    def __init__(
        self,
        model,
        model_name: str,
        settings: ChatSettings,
        *,
        lines: LineInput,
        console: Console,
        loader: Callable[[str], Any],
        system: str | None = None,
    ):
        self.model = model
        self.model_name = model_name
        self.settings = settings
        self.lines = lines
        self.console = console
        self.loader = loader
        self.conv = Conversation(system=system)
        self.last: GenerationStats | None = None
        self.totals = Totals()

    # -- loop ------------------------------------------------------------------------------

    def run(self) -> None:
        self.banner()
        while True:
            try:
                text = self.lines.read(PROMPT)
            except KeyboardInterrupt:
                self.note("Use Ctrl-D or /bye to leave.")
                continue
            except EOFError:
                break
            try:
                if not self.handle(text):
                    break
            except KeyboardInterrupt:
                self.note("stopped")
            except AtlasError as exc:
                self.error(str(exc))

    def handle(self, text: str) -> bool:
        """Act on one input; False means leave."""
        stripped = text.strip()
        if not stripped:
            return True
        if stripped.startswith(TRIPLE):
            message = unwrap_block(stripped)  # a block is always a message, even "/..."
            if message:
                self.send(message)
            return True
        if stripped.startswith("/"):
            return self.command(stripped)
        self.send(stripped)
        return True

    def command(self, text: str) -> bool:
        parts = text[1:].split(None, 1)
        command = resolve_command(parts[0] if parts else "help")
        arg = parts[1].strip() if len(parts) > 1 else ""
        return getattr(self, f"cmd_{command.name}")(arg) is not False

    # -- turns -----------------------------------------------------------------------------

    def send(self, text: str) -> None:
        self.conv.add("user", text)
        answered = False
        try:
            answered = self.respond()
        finally:
            if not answered:
                self.conv.pop_last("user")

    def respond(self) -> bool:
        """Answer the conversation's last user message; True when an answer was added."""
        if not self.make_room():
            return False
        s = self.settings
        ids = self.prompt_ids(self.conv.messages())
        printer = TurnPrinter(
            self.console, think=s.think, markdown=s.markdown, thinking=self.opens_thinking(ids)
        )
        stats = GenerationStats()
        events = self.model.generate(
            ids, max_tokens=s.max_tokens, stop=list(s.stop), stats=stats, **s.sampling()
        )
        interrupted = False
        try:
            try:
                for event in events:
                    printer.feed(event.text)
            except KeyboardInterrupt:
                interrupted = True
            finally:
                events.close()
        finally:
            answer, reasoning = printer.finish()
        self.last = stats
        self.totals.add(stats)
        kept = bool(answer) or not interrupted
        if kept:
            self.conv.add("assistant", answer, reasoning)
        if interrupted:
            self.note(
                "stopped; the partial answer stays (/retry generates it again)"
                if kept
                else "stopped before the answer began; the message was dropped (Up recalls it)"
            )
        elif stats.finish_reason == "length":
            if stats.completion_tokens >= s.max_tokens:
                self.note(f"cut at max_tokens={s.max_tokens}; /set max_tokens N allows more")
            else:
                self.note("the context is full; the answer was cut")
        if s.verbose:
            self.console.print(footer(stats), style="dim", highlight=False, soft_wrap=True)
        used = stats.prompt_tokens + stats.completion_tokens
        if used >= NEARLY_FULL * self.context:
            self.note(
                f"the context is {100 * used / self.context:.0f}% full ({used:,} of "
                f"{self.context:,} tokens): old turns will have to go soon; /clear starts afresh"
            )
        self.console.print()  # a blank line between an answer and the next prompt
        return kept

    def make_room(self) -> bool:
        """Check that the prompt and room for the answer fit the context; if not, offer to drop
        the oldest turns. Never drops anything unasked."""
        reply = reply_room(self.settings.max_tokens, self.context)
        fit = plan_fit(self.conv, lambda m: len(self.prompt_ids(m)), self.context, reply)
        if fit.fits:
            return True
        if fit.drop is None:
            self.warn(
                f"This message needs {fit.tokens_after:,} tokens, plus {reply:,} for the answer, "
                f"even without earlier turns; the context holds {self.context:,}. Shorten it, "
                "lower max_tokens, or start again with a larger --ctx-size. Not sent."
            )
            return False
        turns = "turn" if fit.drop == 1 else "turns"
        self.warn(
            f"The conversation no longer fits the context: {fit.tokens:,} tokens plus "
            f"{reply:,} for the answer, and the context holds {self.context:,}."
        )
        question = (
            f"Drop the oldest {fit.drop} {turns} ({fit.tokens - fit.tokens_after:,} tokens) "
            "and send? [Y/n] "
        )
        if not self.lines.confirm(question):
            self.note("Not sent. /save keeps the conversation, /clear starts afresh.")
            return False
        self.conv.drop_oldest(fit.drop)
        self.note(f"Dropped the oldest {fit.drop} {turns}.")
        return True

    @property
    def context(self) -> int:
        return self.model.context_length

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        kwargs = {"enable_thinking": False} if self.settings.think == "off" else {}
        return self.model.chat_prompt(messages, **kwargs)

    def opens_thinking(self, ids: list[int]) -> bool:
        """Templates such as DeepSeek-R1's end the prompt inside `<think>`."""
        return self.model.tokenizer.decode(ids[-4:]).rstrip().endswith("<think>")

    # -- commands --------------------------------------------------------------------------

    def cmd_help(self, arg: str) -> None:
        if arg:
            c = resolve_command(arg.lstrip("/"))
            self.console.print(Text(f"/{c.name} {c.args}".rstrip(), style="bold"), c.help)
            if c.aliases:
                self.console.print("also: " + ", ".join("/" + a for a in c.aliases))
            if c.name == "set":
                self.console.print(_table({n: p.help for n, p in PARAMS.items()}))
            elif c.name == "show":
                self.console.print(_table(SHOW_TOPICS))
            return
        self.console.print(_table({f"/{c.name} {c.args}".rstrip(): c.help for c in COMMANDS}))
        self.console.print()
        self.console.print(_table(dict(KEYS)))

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
        key = name.replace("-", "_").lower()
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
        answered = False
        try:
            answered = self.respond()
        finally:
            if not answered and old is not None:
                self.conv.turns.append(old)

    def cmd_save(self, arg: str) -> None:
        if not arg:
            raise UsageError("usage: /save FILE")
        path = Path(arg).expanduser()
        self.conv.save(path, self.model_name, self.settings.options())
        self.note(f"Saved {len(self.conv.turn_starts)} turn(s) to {path}.")

    def cmd_load(self, arg: str) -> None:
        if not arg:
            raise UsageError("usage: /load FILE")
        path = Path(arg).expanduser()
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
        t = self.totals
        if t.answers:
            rate = (t.completion_tokens / t.eval_s) if t.eval_s else 0.0
            rows["session"] = (
                f"{t.answers} answer(s), {t.completion_tokens:,} tokens generated "
                f"(~{rate:.1f} tok/s); {t.prompt_tokens:,} prompt tokens evaluated, "
                f"{t.cached_tokens:,} reused from the cache"
            )
        self.console.print(_table(rows))

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
            "model": f"{self.model_name} ({info.name})",
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
        self.console.print(_table(rows))

    def show_params(self) -> None:
        self.console.print(
            _table({n: show_value(getattr(self.settings, n)) for n in PARAMS}, plain_values=True)
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

    # -- output ----------------------------------------------------------------------------

    def banner(self) -> None:
        self.console.print(
            Text.assemble(
                ("atlas chat", "bold"),
                f" · {label(self.model_name)} ",
                (f"({describe(self.model)})", "dim"),
            ),
            soft_wrap=True,
        )
        self.note('/help: commands · """ or Alt-Enter: more lines · Ctrl-C: stop · Ctrl-D: quit')

    def replay(self) -> None:
        if self.conv.system:
            self.console.print(Text("system: ", style="dim") + Text(self.conv.system, "dim"))
        for m in self.conv.turns:
            if m["role"] == "user":
                self.console.print(Text(PROMPT, style="bold") + Text(m["content"]))
            elif self.settings.markdown:
                self.console.print(Markdown(m["content"]))
            else:
                self.console.print(m["content"], markup=False, highlight=False)

    def note(self, text: str) -> None:
        self._say(text, "dim")

    def warn(self, text: str) -> None:
        self._say(text, "yellow")

    def error(self, text: str) -> None:
        self._say("error: " + text, "red")

    def _say(self, text: str, style: str) -> None:
        # soft wrap: the terminal wraps; a pipe or log gets one line per message
        self.console.print(text, style=style, markup=False, highlight=False, soft_wrap=True)


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


def label(name: str) -> str:
    """A model name for display: a path shows as its file or folder name."""
    return Path(name).name if ("/" in name or os.sep in name) else name


def describe(model) -> str:
    info = model.info
    return (
        f"{info.architecture}, {info.file_type}, context {model.context_length:,}, "
        f"{model.device}, loaded in {model.load_s:.1f}s"
    )


def _table(rows: dict[str, str], plain_values: bool = False) -> Table:
    table = Table(show_header=False, box=None, padding=(0, 2, 0, 0))
    table.add_column(style="bold" if plain_values else "cyan", no_wrap=True)
    table.add_column()
    for key, value in rows.items():
        table.add_row(key, Text(value))
    return table


# -- entry ---------------------------------------------------------------------------------


def run_chat(
    model_name: str,
    settings: ChatSettings,
    options: ChatOptions,
    *,
    console: Console | None = None,
    input=None,
    output=None,
    load_model: Callable[..., Any] | None = None,
) -> None:
    """Load `model_name` and chat until the user leaves. `input`/`output` are prompt-toolkit
    objects and `load_model` stands in for `session.open_model` (tests pass a pipe input, a
    dummy output and an already loaded model)."""
    console = console or Console(highlight=False)
    if load_model is None:
        from atlas_cli.session import open_model as load_model

    def load(name: str):
        console.print(f"Loading {label(name)}…", style="dim", markup=False, soft_wrap=True)
        model = load_model(name, device=options.device, ctx_size=options.ctx_size)
        if not model.tokenizer.chat_template:
            raise TemplateError(
                f"{name} has no chat template, which a chat needs; "
                "`atlas run --raw` sends plain text to it"
            )
        return model

    model = load(model_name)
    recipe = getattr(model, "sampling_defaults", {})
    settings = dataclasses.replace(
        settings, **{k: v for k, v in recipe.items() if k not in options.explicit}
    ).validate()
    if input is None and not sys.stdin.isatty():
        lines: LineInput = PlainInput(sys.stdin, console)
    else:
        from atlas_cli.completion import model_names

        history = prepare_history(history_path()) if history_enabled(options.history) else None
        lines = PromptInput(history, SlashCompleter(model_names), input=input, output=output)
    repl = ChatREPL(
        model,
        model_name,
        settings,
        lines=lines,
        console=console,
        loader=load,
        system=options.system,
    )
    repl.run()
