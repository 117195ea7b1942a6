"""`atlas chat`: `run_chat` (load the model, choose the input, start the loop) and `ChatREPL`,
the loop itself and one turn of it: fit the prompt into the context, stream the answer, say
what happened.

Each turn renders the whole conversation with the model's chat template; the engine keeps its
KV cache between requests and prefills only the part of the prompt that is new, so a long
conversation costs one turn's worth of prefill per turn.

Around it: input.py reads lines, commands.py names the slash commands and handlers.py carries
them out, render.py draws the reply, conversation.py holds the messages, settings.py the
/set values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.text import Text

from atlas_cli.backend.engine import GenerationStats
from atlas_cli.chat.commands import resolve_command
from atlas_cli.chat.conversation import Conversation, plan_fit, reply_room
from atlas_cli.chat.handlers import SlashCommands
from atlas_cli.chat.input import PROMPT, TRIPLE, LineInput, open_input, unwrap_block
from atlas_cli.chat.render import Totals, TurnPrinter, describe, footer, label
from atlas_cli.chat.settings import ChatSettings
from atlas_cli.errors import AtlasError, TemplateError

NEARLY_FULL = 0.9  # warn when a turn leaves the context this full


@dataclass(frozen=True)
class ChatOptions:
    system: str | None = None
    device: str = "cpu"
    ctx_size: int | None = None
    history: bool = True
    # sampling settings the user gave; the others take the model recipe's defaults
    explicit: frozenset[str] = frozenset()


class ChatREPL(SlashCommands):
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
        notes: Console | None = None,
    ):
        self.model = model
        self.model_name = model_name
        self.settings = settings
        self.lines = lines
        self.console = console
        # atlas's own words (banner, notes, warnings); `console` has the answers
        self.notes = notes or console
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
        self.respond_or_undo(lambda: self.conv.pop_last("user"))

    def respond_or_undo(self, undo: Callable[[], object]) -> None:
        """Answer the last user message; when no answer is added (not sent, stopped before it
        began, or an error), `undo` puts the conversation back as it was."""
        answered = False
        try:
            answered = self.respond()
        finally:
            if not answered:
                undo()

    def respond(self) -> bool:
        """Answer the conversation's last user message; True when an answer was added."""
        if not self.make_room():
            return False
        stats = GenerationStats()
        answer, reasoning, interrupted = self.stream_answer(stats)
        self.last = stats
        self.totals.add(stats)
        kept = bool(answer) or not interrupted
        if kept:
            self.conv.add("assistant", answer, reasoning)
        self.report(stats, interrupted=interrupted, kept=kept)
        self.console.print()  # a blank line between an answer and the next prompt
        return kept

    def stream_answer(self, stats: GenerationStats) -> tuple[str, str, bool]:
        """Generate and print the answer: (answer, reasoning, interrupted). Ctrl-C stops the
        stream and keeps what came so far."""
        s = self.settings
        ids = self.prompt_ids(self.conv.messages())
        printer = TurnPrinter(
            self.console, think=s.think, markdown=s.markdown, thinking=self.opens_thinking(ids)
        )
        events = self.model.generate(
            ids, max_tokens=s.max_tokens, stop=list(s.stop), stats=stats, sampling=s.sampling()
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
        return answer, reasoning, interrupted

    def report(self, stats: GenerationStats, *, interrupted: bool, kept: bool) -> None:
        """The notes after an answer: why it ended early, its stats, a context nearly full."""
        if interrupted:
            self.note(
                "stopped; the partial answer stays (/retry generates it again)"
                if kept
                else "stopped before the answer began; the message was dropped (Up recalls it)"
            )
        elif stats.finish_reason == "length":
            if stats.completion_tokens >= self.settings.max_tokens:
                max_tokens = self.settings.max_tokens
                self.note(f"cut at max_tokens={max_tokens}; /set max_tokens N allows more")
            else:
                self.note("the context is full; the answer was cut")
        if self.settings.verbose:
            self.console.print(footer(stats), style="dim", highlight=False, soft_wrap=True)
        used = stats.prompt_tokens + stats.completion_tokens
        if used >= NEARLY_FULL * self.context:
            self.note(
                f"the context is {100 * used / self.context:.0f}% full ({used:,} of "
                f"{self.context:,} tokens): old turns will have to go soon; /clear starts afresh"
            )

    def make_room(self) -> bool:
        """Check that the prompt and room for the answer fit the context; if not, offer to drop
        the oldest turns. Never drops anything unasked."""
        reply = reply_room(self.settings.max_tokens, self.context)
        fit = plan_fit(self.conv, lambda m: len(self.prompt_ids(m)), self.context, reply)
        if fit.fits:
            return True
        if fit.drop is None:
            can_grow = getattr(getattr(self.model, "engine", None), "can_grow", True)
            larger = ", or start again with a larger --ctx-size" if can_grow else ""
            self.warn(
                f"This message needs {fit.tokens_after:,} tokens, plus {reply:,} for the answer, "
                f"even without earlier turns; the context holds {self.context:,}. Shorten it "
                f"or lower max_tokens{larger}. Not sent."
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

    # -- atlas's own messages --------------------------------------------------------------

    def banner(self) -> None:
        self.notes.print(
            Text.assemble(
                ("atlas chat", "bold"),
                f" · {label(self.model_name)} ",
                (f"({describe(self.model)})", "dim"),
            ),
            soft_wrap=True,
        )
        self.note('/help: commands · """ or Alt-Enter: more lines · Ctrl-C: stop · Ctrl-D: quit')

    def note(self, text: str) -> None:
        self._say(text, "dim")

    def warn(self, text: str) -> None:
        self._say(text, "yellow")

    def error(self, text: str) -> None:
        self._say("error: " + text, "red")

    def _say(self, text: str, style: str) -> None:
        # soft wrap: the terminal wraps; a pipe or log gets one line per message
        self.notes.print(text, style=style, markup=False, highlight=False, soft_wrap=True)


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
    dummy output and an already loaded model). Answers go to `console` (stdout); when stdout
    is not a terminal, atlas's own lines go to stderr, so a pipe carries the answers alone."""
    notes = console
    if console is None:
        console = Console(highlight=False)
        notes = console if console.is_terminal else Console(stderr=True, highlight=False)
    if load_model is None:
        from atlas_cli.session import open_model as load_model

    def load(name: str):
        notes.print(f"Loading {label(name)}…", style="dim", markup=False, soft_wrap=True)
        model = load_model(name, device=options.device, ctx_size=options.ctx_size)
        if not model.tokenizer.chat_template:
            raise TemplateError(
                f"{name} has no chat template, which a chat needs; "
                "`atlas run --raw` sends plain text to it"
            )
        return model

    model = load(model_name)
    recipe = model.defaults.sampling.set_fields()
    settings = dataclasses.replace(
        settings, **{k: v for k, v in recipe.items() if k not in options.explicit}
    ).validate()
    lines = open_input(notes, history=options.history, input=input, output=output)
    repl = ChatREPL(
        model,
        model_name,
        settings,
        lines=lines,
        console=console,
        loader=load,
        system=options.system,
        notes=notes,
    )
    repl.run()
