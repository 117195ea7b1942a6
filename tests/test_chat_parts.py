"""The chat's parts without a model: reasoning split, printing, settings, context fitting,
tab completion, multi-line blocks."""

from __future__ import annotations

import io

import pytest
from prompt_toolkit.completion import CompleteEvent
from prompt_toolkit.document import Document
from rich.console import Console

from atlas_cli.chat.commands import SlashCompleter, resolve_command
from atlas_cli.chat.conversation import Conversation, plan_fit, reply_room
from atlas_cli.chat.input import block_open, unwrap_block
from atlas_cli.chat.render import ThinkSplitter, TurnPrinter, footer
from atlas_cli.chat.settings import ChatSettings, apply, from_options
from atlas_cli.errors import UsageError


def split(pieces, thinking=False):
    s = ThinkSplitter(thinking)
    out = [part for p in pieces for part in s.feed(p)] + s.flush()
    thought = "".join(t for is_thought, t in out if is_thought)
    answer = "".join(t for is_thought, t in out if not is_thought)
    return thought.strip(), answer  # whitespace before </think> is the printer's business


@pytest.mark.parametrize(
    "pieces",
    [
        ["<think>\nHmm, 2+2.\n</think>\n\nIt is 4."],
        ["<", "think", ">", "\nHmm, 2+2.", "\n</", "think>", "\n\n", "It is", " 4."],
        ["  <thi", "nk>Hmm, 2+2.</th", "ink>It is 4."],
    ],
)
def test_think_tags_split_anywhere(pieces):
    assert split(pieces) == ("Hmm, 2+2.", "It is 4.")


def test_think_rules():
    assert split(["Plain answer."]) == ("", "Plain answer.")
    # a tag after the answer began is text, not reasoning
    assert split(["Use ", "<think>", " tags."]) == ("", "Use <think> tags.")
    # prompts that open the block leave only the closing tag to the model
    assert split(["Let me see.</think>Yes."], thinking=True) == ("Let me see.", "Yes.")
    # a lone "<" that turns out not to be a tag is not lost
    assert split(["<", "b> is bold"]) == ("", "<b> is bold")
    assert split(["<thi"]) == ("", "<thi")


def printer_output(pieces, **kwargs):
    console = Console(file=io.StringIO(), width=80, color_system=None)
    printer = TurnPrinter(console, **kwargs)
    for p in pieces:
        printer.feed(p)
    answer, reasoning = printer.finish()
    return console.file.getvalue(), answer, reasoning


def test_printer_shows_or_hides_reasoning():
    pieces = ["<think>", "Let me think.", "</think>", "\n\nDone."]
    out, answer, reasoning = printer_output(pieces, think="on")
    assert out == "Let me think.\n\nDone.\n"
    assert (answer, reasoning) == ("Done.", "Let me think.")
    out, answer, reasoning = printer_output(pieces, think="hidden")
    assert out == "Done.\n" and reasoning == "Let me think."


def test_printer_renders_markdown_when_finished():
    out, answer, _ = printer_output(
        ["# Title\n\n", "Some **bold** ", "text.\n\n- one\n- two"], markdown=True
    )
    assert answer.startswith("# Title") and "**bold**" in answer
    assert "**" not in out and "Some bold text." in out and "• one" in out
    plain, _, _ = printer_output(["Some **bold** text."])
    assert plain == "Some **bold** text.\n"


def screen_after(output: str, width: int, height: int = 80) -> list[str]:
    """What a terminal shows after `output` (cursor moves and erasures applied)."""
    import pyte

    screen = pyte.Screen(width, height)
    pyte.Stream(screen).feed(output.replace("\n", "\r\n"))
    lines = [line.rstrip() for line in screen.display]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def test_printer_streams_markdown_on_a_terminal():
    console = Console(file=io.StringIO(), width=60, force_terminal=True, color_system=None)
    printer = TurnPrinter(console, markdown=True)
    printer.stream_interval = 0  # redraw on every piece: the worst case for the window
    text = "Fruits:\n\n" + "".join(f"- **Fruit {i}** is tasty.\n" for i in range(12))
    for word in text.split(" "):
        printer.feed(word + " ")
    answer, _ = printer.finish()
    assert answer == text.strip()
    shown = screen_after(console.file.getvalue(), 60)
    assert shown == ["Fruits:", ""] + [f" • Fruit {i} is tasty." for i in range(12)]


def test_footer():
    from atlas_cli.backend.engine import GenerationStats

    s = GenerationStats(
        prompt_tokens=40, cached_tokens=30, completion_tokens=11, prompt_s=0.5, eval_s=1.0
    )
    s.ttft_s, s.finish_reason = 0.25, "stop"
    assert footer(s) == (
        "prompt 10 tok + 30 cached · 20.0 tok/s · answer 11 tok · 10.0 tok/s · TTFT 0.25s · stop"
    )


# -- settings ----------------------------------------------------------------------------------


def test_set_parses_and_validates():
    s = ChatSettings()
    assert apply(s, "temperature", "0").temperature == 0.0
    assert apply(s, "TOP-K", "5").top_k == 5
    assert apply(s, "seed", "none").seed is None and apply(s, "seed", "3").seed == 3
    assert apply(s, "stop", "'a b' c").stop == ("a b", "c")
    assert apply(apply(s, "stop", "x"), "stop", "none").stop == ()
    assert apply(s, "verbose", "yes").verbose is True
    assert apply(s, "think", "hide").think == "hidden"
    for name, value in [
        ("top_p", "0"),
        ("min_p", "1"),
        ("max_tokens", "0"),
        ("repeat_penalty", "0"),
        ("markdown", "sometimes"),
        ("nope", "1"),
    ]:
        with pytest.raises(UsageError):
            apply(s, name, value)


def test_options_round_trip():
    s = ChatSettings(temperature=0.2, stop=("x",), seed=5)
    assert from_options(ChatSettings(), s.options()) == s
    with pytest.raises(UsageError):
        from_options(ChatSettings(), {"temperature": "hot"})


# -- the context window ------------------------------------------------------------------------


def words(messages) -> int:
    """A stand-in tokenizer: one token per word, plus 2 per message."""
    return sum(len(m["content"].split()) + 2 for m in messages)


def conversation(turns: int) -> Conversation:
    conv = Conversation(system="be kind")
    for i in range(turns):
        conv.add("user", f"question {i} " + "word " * 8)
        conv.add("assistant", f"answer {i} " + "word " * 8)
    conv.add("user", "last question")
    return conv


def test_plan_fit_drops_the_fewest_oldest_turns():
    conv = conversation(5)  # system 4 + 5 turns * 2 messages * 12 + question 4 = 128 "tokens"
    assert words(conv.messages()) == 128
    assert plan_fit(conv, words, 200, 10).fits
    fit = plan_fit(conv, words, 100, 10)  # 128 + 10 > 100: dropping 2 turns gives 80 + 10
    assert (fit.drop, fit.tokens, fit.tokens_after) == (2, 128, 80)
    conv.drop_oldest(fit.drop)
    assert conv.turns[0]["content"].startswith("question 2")
    assert conv.system == "be kind" and conv.turns[-1]["content"] == "last question"


def test_plan_fit_never_drops_the_question_itself():
    conv = conversation(2)
    fit = plan_fit(conv, words, 12, 5)  # even system + question alone (8) + 5 > 12
    assert fit.drop is None and fit.tokens_after == 8


def test_reply_room():
    assert reply_room(512, 8192) == 512
    assert reply_room(512, 128) == 32  # a quarter of a small context at most
    assert reply_room(16, 128) == 16


# -- input -------------------------------------------------------------------------------------


def test_triple_quote_blocks():
    assert block_open('"""') and block_open('"""first line\nsecond')
    assert not block_open('"""done"""') and not block_open("plain")
    assert unwrap_block('"""\nline 1\nline 2\n"""') == "line 1\nline 2"
    assert unwrap_block('"""one line"""') == "one line"


def test_commands_resolve_by_prefix_and_alias():
    assert resolve_command("cl").name == "clear"
    assert resolve_command("quit").name == "bye"
    assert resolve_command("?").name == "help"
    with pytest.raises(UsageError, match="could be"):
        resolve_command("s")
    with pytest.raises(UsageError, match="unknown"):
        resolve_command("zap")


def completions(text: str, tmp_path=None) -> list[str]:
    completer = SlashCompleter(lambda: {"smollm2-135m": "default", "qwen3-8b": "recipe"})
    doc = Document(text, len(text))
    return [
        c.text for c in completer.get_completions(doc, CompleteEvent(completion_requested=True))
    ]


def test_tab_completion(tmp_path):
    assert completions("/s") == ["/system", "/set", "/show", "/save", "/stats"]
    assert completions("/re") == ["/retry"]
    assert completions("/set te") == ["temperature"]
    assert completions("/set think ") == ["on", "hidden", "off"]
    assert completions("/set verbose o") == ["on", "off"]
    assert completions("/show t") == ["template"]
    assert completions("/help mo") == ["model"]
    assert completions("/model q") == ["qwen3-8b"]
    assert completions("hello /s") == [] and completions("/set temperature 0") == []
    (tmp_path / "talk.json").write_text("{}")
    assert completions(f"/load {tmp_path}/ta") == ["lk.json"]


def test_hidden_reasoning_leaves_only_the_answer_on_a_terminal():
    console = Console(file=io.StringIO(), width=60, force_terminal=True, color_system=None)
    printer = TurnPrinter(console, think="hidden")
    for piece in ["<think>", "Step one.", " Step two.", "</think>", "\n\n", "Answer", " here."]:
        printer.feed(piece)
    assert printer.finish() == ("Answer here.", "Step one. Step two.")
    assert "thinking…" in console.file.getvalue()  # shown while it thought
    assert screen_after(console.file.getvalue(), 60) == ["Answer here."]


def test_chat_takes_recipe_sampling_defaults_unless_given(monkeypatch, tmp_path):
    """Settings the user did not give come from the model's recipe (`Model.defaults`)."""
    from types import SimpleNamespace

    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from atlas_cli.backend.defaults import RunDefaults
    from atlas_cli.chat import ChatOptions, ChatSettings, run_chat
    from atlas_cli.chat import repl as repl_module

    seen = {}

    class CapturingREPL:
        def __init__(self, model, name, settings, **kwargs):
            seen["settings"] = settings

        def run(self):
            pass

    monkeypatch.setattr(repl_module, "ChatREPL", CapturingREPL)
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    model = SimpleNamespace(
        tokenizer=SimpleNamespace(chat_template="{{ messages }}"),
        defaults=RunDefaults.from_recipe({"temperature": 0.2, "top_p": 0.9}),
    )
    options = ChatOptions(history=False, explicit=frozenset({"temperature"}))
    with create_pipe_input() as pipe:
        run_chat(
            "recipe-model",
            ChatSettings(temperature=0.7),
            options,
            input=pipe,
            output=DummyOutput(),
            load_model=lambda *args, **kwargs: model,
        )
    assert seen["settings"].temperature == 0.7  # given on the command line
    assert seen["settings"].top_p == 0.9  # from the recipe
    assert seen["settings"].top_k == ChatSettings().top_k  # neither: atlas's default


def test_a_terminal_reply_wraps_between_words():
    """The terminal's own wrap cut words in two ("Il Corio|bella"): lines break at spaces, a
    word longer than a line is cut, and the text itself is what was streamed."""
    console = Console(file=io.StringIO(), width=24, force_terminal=True, color_system=None)
    printer = TurnPrinter(console)
    text = "The capital of France is Paris, a city of museums, cafes and a tower."
    for i in range(0, len(text), 3):  # tokens end anywhere inside words
        printer.feed(text[i : i + 3])
    answer, _ = printer.finish()
    lines = console.file.getvalue().rstrip("\n").split("\n")
    assert answer == text and all(len(line) <= 24 for line in lines)
    assert " ".join(line.strip() for line in lines) == text  # no word was cut
    assert lines[0] == "The capital of France is"
