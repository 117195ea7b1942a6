"""`atlas chat` driven through prompt-toolkit's pipe input with the real default model
(greedy, a handful of tokens per answer)."""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass

from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console

from atlas_cli.chat import ChatOptions, ChatREPL, ChatSettings, run_chat
from atlas_cli.chat.commands import SlashCompleter
from atlas_cli.chat.input import PromptInput, history_path

ENTER = "\r"
ALT_ENTER = "\x1b\r"
CTRL_C = "\x03"
CTRL_D = "\x04"
UP = "\x1b[A"
GREEDY = ChatSettings(temperature=0, max_tokens=3)  # few tokens: most tests need no more
NAMES = {"smollm2-135m": "default model"}


@dataclass
class Session:
    repl: ChatREPL
    out: str


def keys(lines) -> str:
    """Each line followed by Enter, unless it ends in a key that does not want one."""
    return "".join(k if k.endswith((CTRL_C, CTRL_D, ALT_ENTER)) else k + ENTER for k in lines)


def new_console() -> Console:
    return Console(file=io.StringIO(), width=200, color_system=None, highlight=False)


def chat(model, *lines: str, settings=GREEDY, system=None, loader=None, history=None) -> Session:
    """Type `lines` (each followed by Enter unless it ends in a control key) into a REPL; the
    input ends after them, as if the user pressed Ctrl-D."""
    console = new_console()
    with create_pipe_input() as pipe:
        pipe.send_text(keys(lines))
        pipe.close()  # end of input: the REPL sees Ctrl-D after the last line
        prompt = PromptInput(
            history, SlashCompleter(lambda: NAMES), input=pipe, output=DummyOutput()
        )
        repl = ChatREPL(
            model,
            "smollm2-135m",
            settings,
            lines=prompt,
            console=console,
            loader=loader or (lambda name: model),
            system=system,
        )
        repl.run()
    return Session(repl, console.file.getvalue())


def roles(repl: ChatREPL) -> list[str]:
    return [m["role"] for m in repl.conv.turns]


# -- conversation ------------------------------------------------------------------------------


def test_second_turn_uses_the_first_answer(smollm2):
    settings = ChatSettings(temperature=0, max_tokens=8)
    s = chat(
        smollm2,
        "What is the capital of France?",
        "Repeat your previous answer exactly.",
        settings=settings,
    )
    first, second = s.repl.conv.turns[1]["content"], s.repl.conv.turns[3]["content"]
    assert roles(s.repl) == ["user", "assistant", "user", "assistant"]
    assert "Paris" in first
    assert "Paris" in second  # only the first answer can tell it
    assert first in s.out and s.out.count("Paris") >= 2
    # the second prompt extends the first: the engine reused prompt + answer from its cache
    first_prompt = smollm2.chat_prompt(s.repl.conv.messages()[:1])
    answer_ids = smollm2.tokenizer.encode(first)
    assert s.repl.last.cached_tokens >= len(first_prompt) + len(answer_ids) - 1
    assert s.repl.totals.answers == 2


def test_without_the_first_turn_the_model_cannot_repeat_it(smollm2):
    # the control for the test above: the same question alone does not produce "Paris"
    s = chat(
        smollm2,
        "Repeat your previous answer exactly.",
        settings=ChatSettings(temperature=0, max_tokens=12),
    )
    assert "Paris" not in s.repl.conv.turns[1]["content"]


def test_ctrl_d_and_bye_leave(smollm2):
    s = chat(smollm2, CTRL_D, "/help")  # Ctrl-D on an empty line ends the chat
    assert "/retry" not in s.out
    s = chat(smollm2, "/bye", "/help")
    assert "/retry" not in s.out
    s = chat(smollm2, "/exit", "/help")
    assert "/retry" not in s.out


def test_ctrl_c_at_the_prompt_clears_the_line(smollm2):
    s = chat(smollm2, "a half-typed message" + CTRL_C, CTRL_C, "/show system")
    assert "Use Ctrl-D or /bye to leave." in s.out  # Ctrl-C on an empty line: a reminder
    assert s.out.count("Use Ctrl-D") == 1
    assert s.repl.conv.turns == []  # the half-typed message was not sent
    assert "No system prompt" in s.out  # and the loop went on


class Interrupting:
    """The real model, but its token stream raises KeyboardInterrupt (as Ctrl-C would) after
    `after` tokens."""

    def __init__(self, model, after: int):
        self.model = model
        self.after = after

    def __getattr__(self, name):
        return getattr(self.model, name)

    def generate(self, ids, **kwargs):
        events = self.model.generate(ids, **kwargs)
        try:
            for i, event in enumerate(events):
                if i == self.after:
                    raise KeyboardInterrupt
                yield event
        finally:
            events.close()


def test_ctrl_c_during_generation_keeps_the_conversation(smollm2):
    model = Interrupting(smollm2, after=3)
    s = chat(model, "What is the capital of France?", settings=ChatSettings(temperature=0))
    assert "stopped; the partial answer stays" in s.out
    assert roles(s.repl) == ["user", "assistant"]
    partial = s.repl.conv.turns[1]["content"]
    assert partial and partial != "The capital of France is Paris."
    assert "The capital of France is Paris.".startswith(partial)
    assert s.repl.last.finish_reason == "interrupted"
    assert partial in s.out and s.repl.last.completion_tokens >= 3

    # the conversation goes on: the next turn sees the partial answer, /retry redoes it
    model.after = 10**6
    s2 = chat(model, "/retry")
    assert s2.repl.conv.turns == []  # a fresh REPL has nothing to retry
    assert "Nothing to retry yet." in s2.out


def test_ctrl_c_then_retry_in_one_session(smollm2):
    model = Interrupting(smollm2, after=2)
    console_keys = ["What is the capital of France?", "/set max_tokens 16", "/retry"]
    s = chat(model, *console_keys, settings=ChatSettings(temperature=0))
    # both the first answer and the retried one were cut at 2 tokens by the fake Ctrl-C
    assert s.out.count("stopped; the partial answer stays") == 2
    assert roles(s.repl) == ["user", "assistant"]


def test_ctrl_c_before_any_answer_drops_the_message(smollm2):
    s = chat(Interrupting(smollm2, after=0), "Hello there")
    assert "stopped before the answer began" in s.out
    assert s.repl.conv.turns == []


def test_multiline_input(smollm2):
    s = chat(
        smollm2,
        '"""',
        "/not a command",
        "second line",
        '"""',
        "first" + ALT_ENTER,
        "second",
        settings=ChatSettings(temperature=0, max_tokens=1),
    )
    users = [m["content"] for m in s.repl.conv.turns if m["role"] == "user"]
    assert users == ["/not a command\nsecond line", "first\nsecond"]


# -- slash commands ----------------------------------------------------------------------------


def test_help(smollm2):
    s = chat(smollm2, "/help", "/help set", "/? show", "/")
    for name in ("/help", "/bye", "/clear", "/system", "/set", "/show", "/retry", "/save"):
        assert name in s.out
    assert "/load FILE" in s.out and "/stats" in s.out and "/model NAME" in s.out
    assert "Alt-Enter" in s.out and "Ctrl-C" in s.out
    assert "repeat_penalty" in s.out  # /help set lists the parameters
    assert "the model's chat template" in s.out  # /? show lists the topics


def test_set_every_parameter(smollm2):
    s = chat(
        smollm2,
        "/set temperature 0.5",
        "/set top_k 7",
        "/set top-p 0.9",
        "/set min_p 0.1",
        "/set repeat_penalty 1.1",
        "/set seed 42",
        "/set reasoning-budget 64",
        "/set max_tokens 33",
        "/set stop '###' END",
        "/set verbose on",
        "/set think hidden",
        "/set markdown on",
        "/set",
    )
    got = s.repl.settings
    assert (got.temperature, got.top_k, got.top_p, got.min_p) == (0.5, 7, 0.9, 0.1)
    assert (got.repeat_penalty, got.seed, got.max_tokens) == (1.1, 42, 33)
    assert got.stop == ("###", "END")
    assert (got.verbose, got.think, got.markdown) == (True, "hidden", True)
    assert got.reasoning_budget == 64 and got.sampling().reasoning_budget == 64
    assert re.search(r"max_tokens +33", s.out)  # `/set` alone lists them


def test_set_rejects_bad_values_and_keeps_the_old_ones(smollm2):
    s = chat(
        smollm2,
        "/set temperature -1",
        "/set top_k many",
        "/set think maybe",
        "/set colour blue",
        "/set top_p",
        "/set seed none",
    )
    assert s.repl.settings == GREEDY
    assert s.out.count("error:") == 5
    assert "temperature must be >= 0" in s.out
    assert "unknown parameter 'colour'" in s.out


def test_system_clear_and_show(smollm2):
    s = chat(
        smollm2,
        "/system You answer in one word.",
        "/show system",
        "Capital of France?",
        "/clear",
        "/show system",
        "/system",
        "/show system",
        "/show params",
        "/show template",
        "/show info",
        "/show bogus",
    )
    assert s.out.count("You answer in one word.") == 2  # shown twice, kept by /clear
    assert "Cleared the conversation (the system prompt stays)." in s.out
    assert "System prompt removed." in s.out and "No system prompt" in s.out
    assert s.repl.conv.system is None and s.repl.conv.turns == []
    assert "<|im_start|>" in s.out  # the template
    assert "Q4_1" in s.out and "8,192" in s.out and "49,152 tokens" in s.out  # info
    assert "error: usage: /show info|params|template|system" in s.out


def test_system_prompt_reaches_the_model(smollm2):
    s = chat(smollm2, "/system You are a pirate.", "Hi")
    prompt = smollm2.tokenizer.decode(smollm2.chat_prompt(s.repl.conv.messages()))
    assert "You are a pirate." in prompt and "SmolLM" not in prompt


def test_retry_regenerates_the_last_answer(smollm2):
    s = chat(
        smollm2, "What is the capital of France?", "/set temperature 0.9", "/set seed 1", "/retry"
    )
    assert roles(s.repl) == ["user", "assistant"]  # replaced, not appended
    assert s.repl.totals.answers == 2


def test_stats_and_verbose_footer(smollm2):
    s = chat(smollm2, "/set verbose on", "Hi", "/stats")
    assert "prompt " in s.out and "tok/s" in s.out and "TTFT" in s.out  # the footer
    assert "of 8,192 tokens" in s.out  # /stats: context use
    assert "1 answer(s)" in s.out


def test_model_switch_keeps_the_conversation(smollm2):
    loaded = []

    def loader(name):
        loaded.append(name)
        return smollm2

    s = chat(smollm2, "Hi", "/model other-model", "/model", loader=loader)
    assert loaded == ["other-model"]
    assert s.repl.model_name == "other-model"
    assert "Switched to other-model" in s.out and "the conversation stays" in s.out
    assert "error: usage: /model NAME (now: other-model)" in s.out
    assert roles(s.repl) == ["user", "assistant"]


def test_model_switch_failure_keeps_the_old_model(smollm2):
    from atlas_cli.errors import ModelNotFoundError

    def loader(name):
        raise ModelNotFoundError(f"unknown model {name!r}")

    s = chat(smollm2, "/model nope", loader=loader)
    assert "error: unknown model 'nope'" in s.out
    assert s.repl.model is smollm2 and s.repl.model_name == "smollm2-135m"


def test_unknown_ambiguous_and_prefix_commands(smollm2):
    s = chat(smollm2, "/frobnicate", "/s", "/cl")
    assert "unknown command /frobnicate" in s.out
    assert "/s could be" in s.out
    assert "Cleared the conversation" in s.out  # /cl is /clear


def test_save_load_round_trip(smollm2, tmp_path):
    path = tmp_path / "talk.json"
    s1 = chat(
        smollm2,
        "/system Be brief.",
        "What is the capital of France?",
        "/set temperature 0.3",
        "/set reasoning_budget 64",
        f"/save {path}",
    )
    saved = json.loads(path.read_text())
    assert saved["model"] == "smollm2-135m" and saved["options"]["temperature"] == 0.3
    assert [m["role"] for m in saved["messages"]] == ["system", "user", "assistant"]

    s2 = chat(smollm2, "/set temperature 0.9", f"/load {path}", "/show system")
    assert s2.repl.conv.messages() == s1.repl.conv.messages()
    assert s2.repl.settings.temperature == 0.3 and s2.repl.settings.reasoning_budget == 64
    assert "Loaded 1 turn(s)" in s2.out
    assert ">>> What is the capital of France?" in s2.out  # the replay
    # saving what was loaded gives the same file
    again = tmp_path / "again.json"
    chat(smollm2, f"/load {path}", f"/save {again}")
    assert json.loads(again.read_text()) == saved


def test_load_rejects_bad_files_and_keeps_the_conversation(smollm2, tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "odd.json").write_text(json.dumps({"messages": [{"role": "wizard"}]}))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps([{"role": "user", "content": "Hi"}]))
    s = chat(
        smollm2,
        "/system Keep me.",
        f"/load {tmp_path / 'bad.json'}",
        f"/load {tmp_path / 'odd.json'}",
        f"/load {tmp_path / 'missing.json'}",
        "/save",
    )
    assert s.out.count("error:") == 4
    assert "not valid JSON" in s.out and "message 1" in s.out and "cannot read" in s.out
    assert s.repl.conv.system == "Keep me."
    s = chat(smollm2, f"/load {plain}")  # a bare list of OpenAI-style messages loads too
    assert s.repl.conv.turns == [{"role": "user", "content": "Hi"}]


# -- history -----------------------------------------------------------------------------------


def test_history_persists_across_sessions(smollm2, tmp_path, monkeypatch):
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    monkeypatch.delenv("ATLAS_NO_HISTORY", raising=False)
    path = history_path()
    assert path == tmp_path / "chat_history"

    first = session_via_run_chat(
        "smollm2-135m", "/system Remember me.", "/show system", model=smollm2
    )
    assert "Remember me." in first
    assert "/system Remember me." in path.read_text()
    assert oct(path.stat().st_mode & 0o777) == "0o600"

    # a new session: Up twice recalls "/system Remember me." from the file (Up once: /show)
    second = session_via_run_chat("smollm2-135m", UP + UP, "/show system", model=smollm2)
    assert second.count("Remember me.") == 1


def test_history_can_be_turned_off(smollm2, tmp_path, monkeypatch):
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    monkeypatch.setenv("ATLAS_NO_HISTORY", "1")
    session_via_run_chat("smollm2-135m", "/show system", model=smollm2)
    assert not (tmp_path / "chat_history").exists()
    monkeypatch.delenv("ATLAS_NO_HISTORY")
    session_via_run_chat("smollm2-135m", "/show system", history=False, model=smollm2)
    assert not (tmp_path / "chat_history").exists()


def session_via_run_chat(
    model_path, *lines, history=True, ctx_size=None, settings=GREEDY, model=None
) -> str:
    """A session through the entry point; `model` skips loading (tests of other things)."""
    console = new_console()
    with create_pipe_input() as pipe:
        pipe.send_text(keys(lines))
        pipe.close()
        options = ChatOptions(device="cpu-ref", ctx_size=ctx_size, history=history)
        run_chat(
            str(model_path),
            settings,
            options,
            console=console,
            input=pipe,
            output=DummyOutput(),
            load_model=(lambda name, **kwargs: model) if model is not None else None,
        )
    return console.file.getvalue()


# -- the context window ------------------------------------------------------------------------


def test_overflow_offers_to_drop_the_oldest_turns(smollm2_path):
    # 104 tokens of context, 10 kept for each answer; the first prompt is 37 tokens and each
    # turn adds ~23: three questions fit (83 + 10), the fourth does not (106 + 10)
    settings = ChatSettings(temperature=0, max_tokens=10)
    out = session_via_run_chat(
        smollm2_path,
        "What is the capital of France?",
        "What is the capital of Italy?",
        "What is the capital of Spain?",
        "What is the capital of Germany?",
        "n",  # decline: nothing is sent, nothing dropped
        "What is the capital of Germany?",
        "y",  # accept: the oldest turn goes, the question is answered
        "word " * 150,  # too long even alone
        "/stats",
        ctx_size=104,
        settings=settings,
    )
    assert "Paris" in out and "Rome" in out and "Madrid" in out
    assert out.count("The conversation no longer fits the context") == 2
    assert out.count("Not sent. /save keeps the conversation") == 1
    assert out.count("Dropped the oldest 1 turn.") == 1
    assert "Berlin" in out
    assert "even without earlier turns; the context holds 104" in out
    assert "turns        3" in out  # France dropped: Italy, Spain, Germany
    assert "of 104 tokens" in out
