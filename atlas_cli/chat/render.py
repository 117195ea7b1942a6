"""How the chat looks on the terminal (rich): a streamed reply with its reasoning apart from the
answer and optional Markdown, the per-turn stats line and the session totals, and the
two-column tables and model labels that the commands print."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from rich.cells import cell_len
from rich.console import Console
from rich.control import Control
from rich.live import Live
from rich.markdown import Markdown
from rich.segment import ControlType, Segment, Segments
from rich.table import Table
from rich.text import Text

from atlas_cli.backend.engine import GenerationStats

THOUGHT_STYLE = "dim italic"
OPEN, CLOSE = "<think>", "</think>"


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    return max((k for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


class ThinkSplitter:
    """Splits streamed text into reasoning (inside `<think>…</think>`) and answer.

    Tags may arrive split across tokens, so a possible tag start is held back until it is
    decided. `<think>` counts only before any answer text (a reply may discuss the tag);
    `thinking=True` starts inside reasoning, for templates whose prompt already opens it.
    """

    def __init__(self, thinking: bool = False):
        self.thinking = thinking
        self.pending = ""
        self.answer_started = False
        self.strip = True  # whitespace right after a tag, or before the answer, is noise

    def feed(self, text: str) -> list[tuple[bool, str]]:
        self.pending += text
        out: list[tuple[bool, str]] = []
        while True:
            tag = CLOSE if self.thinking else (None if self.answer_started else OPEN)
            if tag is None:
                self._emit(out, self.pending)
                self.pending = ""
                return out
            i = self.pending.find(tag)
            if i >= 0 and (self.thinking or not self.pending[:i].strip()):
                self._emit(out, self.pending[:i])
                self.pending = self.pending[i + len(tag) :]
                self.thinking = not self.thinking
                self.strip = True
                continue
            keep = _held_prefix(self.pending, tag)
            if not self.thinking and not self.pending[: len(self.pending) - keep].strip():
                return out  # only whitespace so far: `<think>` may still come
            self._emit(out, self.pending[: len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep :]
            return out

    def flush(self) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        self._emit(out, self.pending)
        self.pending = ""
        return out

    def _emit(self, out: list[tuple[bool, str]], text: str) -> None:
        if self.strip:
            text = text.lstrip()
        if not text:
            return
        self.strip = False
        if not self.thinking:
            self.answer_started = True
        out.append((self.thinking, text))


class MarkdownStream:
    """Live Markdown for a streamed answer, after aider's MarkdownStream: the whole answer is
    re-rendered as it grows; lines above a small window at the bottom are printed for good
    (they no longer change), the window is redrawn in place. A window that never exceeds the
    screen keeps the terminal's scrollback clean."""

    WINDOW = 6

    def __init__(self, console: Console, min_interval_s: float = 0.05):
        self.console = console
        self.min_interval_s = min_interval_s  # re-rendering it all per token would be O(n²)
        self.printed = 0
        self.last = 0.0
        self.live = Live(Text(""), console=console, auto_refresh=False, transient=True)
        self.live.start()

    def update(self, text: str, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < self.min_interval_s:
            return
        self.last = now
        lines = self.console.render_lines(Markdown(text), pad=False)
        stable = len(lines) if final else max(len(lines) - self.WINDOW, self.printed)
        for line in lines[self.printed : stable]:
            self.live.console.print(Segments([*line, Segment.line()]))  # Segments adds no newline
        self.printed = max(self.printed, stable)
        window = [seg for line in lines[stable:] for seg in (*line, Segment.line())]
        self.live.update(Segments(window[:-1]), refresh=True)

    def close(self, text: str) -> None:
        try:
            self.update(text, final=True)
            self.live.update(Text(""), refresh=True)
        finally:
            self.live.stop()


class WordWrap:
    """Streamed text broken into lines of at most `width` cells between words, as the terminal
    would not: its own wrap cuts words. A word is held until the space after it shows where it
    ends (a word longer than a line is cut)."""

    def __init__(self, width: int):
        self.width = max(width, 1)
        self.column = 0
        self.word = ""

    def feed(self, text: str) -> str:
        out = []
        for ch in text:
            if ch == "\n":
                out.append(self._word() + "\n")
                self.column = 0
            elif ch.isspace():
                out.append(self._word())
                if self.column >= self.width:
                    out.append("\n")
                    self.column = 0
                elif self.column > 0:  # no space at the start of a wrapped line
                    out.append(ch)
                    self.column += 1
            else:
                self.word += ch
        return "".join(out)

    def flush(self) -> str:
        return self._word()

    def _word(self) -> str:
        word, self.word = self.word, ""
        out = []
        while word:
            size = cell_len(word)
            if self.column > 0 and self.column + size > self.width:
                out.append("\n")
                self.column = 0
            if size <= self.width:
                out.append(word)
                self.column += size
                break
            head = word[: self.width]  # longer than a line: cut it
            out.append(head + "\n")
            word = word[self.width :]
        return "".join(out)


class TurnPrinter:
    """Prints one streamed reply and collects its answer and reasoning."""

    def __init__(
        self, console: Console, *, think: str = "on", markdown: bool = False, thinking=False
    ):
        self.console = console
        self.think = think
        self.markdown = markdown
        self.splitter = ThinkSplitter(thinking)
        self.answer: list[str] = []
        self.reasoning: list[str] = []
        self.column0 = True  # the cursor is at the start of a line
        self.indicator = False  # a "thinking…" note is on screen
        self.stream: MarkdownStream | None = None
        self.stream_interval = 0.05  # seconds between Markdown redraws
        # lines broken between words on a terminal; elsewhere the text goes as it comes
        self.wrap = WordWrap(console.width) if console.is_terminal else None

    def feed(self, text: str) -> None:
        for is_thought, piece in self.splitter.feed(text):
            self._show(is_thought, piece)

    def finish(self) -> tuple[str, str]:
        """Flush what is held back, end the output cleanly; return (answer, reasoning)."""
        try:
            for is_thought, piece in self.splitter.flush():
                self._show(is_thought, piece)
        finally:
            self._clear_indicator()
            answer = "".join(self.answer).rstrip()
            if self.stream is not None:
                self.stream.close(answer)
                self.column0 = True
            elif self.markdown and answer:
                self._newline()
                self.console.print(Markdown(answer))
                self.column0 = True
            self._newline()
        return answer, "".join(self.reasoning).strip()

    def _show(self, is_thought: bool, piece: str) -> None:
        if is_thought:
            self.reasoning.append(piece)
            if self.think == "hidden":
                if self.console.is_terminal and not self.indicator:
                    self._print("thinking…", THOUGHT_STYLE)
                    self.indicator = True
                return
            self._write(piece, THOUGHT_STYLE)
            return
        if not self.answer:
            self._clear_indicator()
            if self.reasoning and self.think != "hidden":
                self._newline()
                self.console.print()  # a blank line between reasoning and answer
        self.answer.append(piece)
        if not self.markdown:
            self._write(piece)
        elif self.console.is_terminal:
            if self.stream is None:
                self.stream = MarkdownStream(self.console, self.stream_interval)
            self.stream.update("".join(self.answer))

    def _write(self, text: str, style: str | None = None) -> None:
        if self.wrap is not None:
            text = self.wrap.feed(text)
        self._print(text, style)

    def _print(self, text: str, style: str | None = None) -> None:
        if not text:
            return
        self.console.print(text, style=style, end="", markup=False, highlight=False, soft_wrap=True)
        self.column0 = text.endswith("\n")

    def _newline(self) -> None:
        if self.wrap is not None:
            self._print(self.wrap.flush())
            self.wrap.column = 0
        if not self.column0:
            self.console.print()
            self.column0 = True

    def _clear_indicator(self) -> None:
        if self.indicator:
            self.console.control(Control.move_to_column(0), Control((ControlType.ERASE_IN_LINE, 2)))
            self.indicator = False
            self.column0 = True
            if self.wrap is not None:
                self.wrap.column = 0


# -- stats ---------------------------------------------------------------------------------


def footer(stats: GenerationStats) -> str:
    """The one-line stats of a turn (verbose mode)."""
    # the count the rate is of (the tokens evaluated), the cached ones apart
    cached = f" + {stats.cached_tokens} cached" if stats.cached_tokens else ""
    evaluated = stats.prompt_tokens - stats.cached_tokens
    return (
        f"prompt {evaluated} tok{cached} · {stats.prompt_rate:.1f} tok/s · "
        f"answer {stats.completion_tokens} tok · {stats.eval_rate:.1f} tok/s · "
        f"TTFT {stats.ttft_s:.2f}s · {stats.finish_reason}"
    )


@dataclass
class Totals:
    """What the answers of a session add up to (for /stats)."""

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

    def summary(self) -> str:
        rate = (self.completion_tokens / self.eval_s) if self.eval_s else 0.0
        return (
            f"{self.answers} answer(s), {self.completion_tokens:,} tokens generated "
            f"(~{rate:.1f} tok/s); {self.prompt_tokens:,} prompt tokens evaluated, "
            f"{self.cached_tokens:,} reused from the cache"
        )


# -- tables and labels ---------------------------------------------------------------------


def table(rows: dict[str, str], plain_values: bool = False) -> Table:
    """Two columns, keys then values, no borders; values print as given (no markup)."""
    grid = Table(show_header=False, box=None, padding=(0, 2, 0, 0))
    grid.add_column(style="bold" if plain_values else "cyan", no_wrap=True)
    grid.add_column()
    for key, value in rows.items():
        grid.add_row(key, Text(value))
    return grid


def label(name: str) -> str:
    """A model name for display: a path shows as its file or folder name."""
    return Path(name).name if ("/" in name or os.sep in name) else name


def describe(model) -> str:
    """A loaded model in one line: architecture, quantization, context, device, load time."""
    info = model.info
    return (
        f"{info.architecture}, {info.file_type}, context {model.context_length:,}, "
        f"{model.device}, loaded in {model.load_s:.1f}s"
    )
