import copy
import json

import pytest

from atlas_cli.bench import capping
from atlas_cli.bench import trajectories as traj
from atlas_cli.errors import ContextOverflowError
from tests.bench_helpers import tiny_conversation, trajectory_file, write_jsonl


@pytest.fixture(scope="module")
def real():
    path = trajectory_file()
    return path, traj.load(path)


def test_real_file_shape(real):
    path, conversations = real
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(rows) == 2014
    assert len(conversations) == 20
    requests = [r for c in conversations for r in traj.requests(c)]
    assert len(requests) == 1007
    # one request per user or tool row, each answering that row's turn
    triggers = {(r["conversation_id"], r["turn"]) for r in rows if r["role"] in ("user", "tool")}
    assert {(r.conversation_id, r.turn) for r in requests} == triggers


def test_real_requests_carry_the_recorded_history(real):
    path, conversations = real
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    conv = conversations[0]
    reqs = list(traj.requests(conv))
    first, last = reqs[0], reqs[-1]
    assert [m["role"] for m in first.messages] == ["system", "user"]
    assert first.messages[0]["content"] == rows[0]["system"]
    assert first.messages[1]["content"] == rows[0]["content"]
    assert first.tools == rows[0]["tools"]
    # every later request extends the one before it (recorded answers, never the model's)
    for a, b in zip(reqs, reqs[1:], strict=False):
        assert b.messages[: len(a.messages)] == a.messages
        assert b.messages[-1]["role"] == "tool"
    conv_rows = [r for r in rows if r["conversation_id"] == conv.id]
    assistants = [m for m in last.messages if m["role"] == "assistant"]
    recorded = [r for r in conv_rows if r["role"] == "assistant"][: len(assistants)]
    assert [m["tool_calls"] for m in assistants] == [r["tool_calls"] for r in recorded]
    assert [m["reasoning_content"] for m in assistants] == [
        r["reasoning_content"] for r in recorded
    ]
    tool_msgs = [m for m in last.messages if m["role"] == "tool"]
    n_results = sum(
        len(r["tool_results"]) for r in conv_rows if r["turn"] <= last.turn and r["role"] == "tool"
    )
    assert len(tool_msgs) == n_results


def test_limit_turns(real):
    _, conversations = real
    assert len(list(traj.requests(conversations[0], limit=3))) == 3


def _load_rows(tmp_path, rows):
    return traj.load(write_jsonl(tmp_path / "t.jsonl", rows))


def test_tiny_conversation_requests(tmp_path):
    conversations = _load_rows(tmp_path, tiny_conversation("a", 2) + tiny_conversation("b", 1))
    assert [c.id for c in conversations] == ["a", "b"]
    reqs = list(traj.requests(conversations[0]))
    assert [r.turn for r in reqs] == [1, 3, 5]
    assert [m["role"] for m in reqs[-1].messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
    ]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda rows: rows.__setitem__(1, "not an object"), "must be a JSON object"),
        (lambda rows: rows[1].__setitem__("role", "robot"), "unknown role 'robot'"),
        (lambda rows: rows[1].pop("conversation_id"), "has no 'conversation_id'"),
        (lambda rows: rows[1].__setitem__("turn", "2"), "'turn' must be int"),
        (lambda rows: rows[0].pop("content"), "user row has no 'content'"),
        (lambda rows: rows[2].__setitem__("tool_results", []), "empty 'tool_results'"),
        (
            lambda rows: rows[2]["tool_results"][0].__setitem__("tool_call_id", "nope"),
            "answers no tool call",
        ),
        (lambda rows: rows[1].__setitem__("tool_calls", [{"id": "x"}]), "each tool call must be"),
        (lambda rows: rows[1].pop("tool_calls"), "neither 'content' nor 'tool_calls'"),
        (lambda rows: rows[4].__setitem__("turn", 9), "skips to turn 9"),
        (lambda rows: rows[3].__setitem__("turn", 3), "repeats turn 3"),
        (lambda rows: rows.pop(0), "must start with a user row at turn 1"),
    ],
)
def test_malformed_rows_give_clear_errors(tmp_path, mutate, message):
    rows = copy.deepcopy(tiny_conversation("c", 2))
    mutate(rows)
    with pytest.raises(traj.TrajectoryError, match=message) as err:
        _load_rows(tmp_path, rows)
    assert str(tmp_path / "t.jsonl") in str(err.value)


def test_bad_json_names_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    good = json.dumps(tiny_conversation("c", 1)[0])
    path.write_text(good + "\n{not json\n")
    with pytest.raises(traj.TrajectoryError, match=r"t\.jsonl:2: not valid JSON"):
        traj.load(path)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(traj.TrajectoryError, match="no such trajectory file"):
        traj.load(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(traj.TrajectoryError, match="no rows"):
        traj.load(tmp_path / "empty.jsonl")


def test_text_rendering_for_templates_without_tools(tmp_path):
    conv = _load_rows(tmp_path, tiny_conversation("a", 1))[0]
    req = list(traj.requests(conv))[-1]
    out = traj.as_text_messages(req.messages, req.tools)
    assert all(set(m) == {"role", "content"} for m in out)
    assert '"name": "bash"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assistant = out[2]["content"]
    assert assistant.startswith("<think>\nStep 0: look around.\n</think>")
    assert (
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>' in assistant
    )
    assert out[3] == {"role": "tool", "content": "<tool_response>\nfile0.py\n</tool_response>"}
    assert not traj.template_supports_tools("{{ message['content'] }}")
    assert traj.template_supports_tools("{% if message.tool_calls %}{% endif %}")


# -- prompt capping ----------------------------------------------------------------------------


def _chars(messages):
    return sum(
        len(m.get("content") or "") + len(m.get("reasoning_content") or "") for m in messages
    )


def test_capping_drops_oldest_steps_and_sticks(real):
    _, conversations = real
    conv = conversations[0]
    cap = 40_000
    capper = capping.PromptCapper(cap, _chars)
    previous = None
    drops = 0
    for req in traj.requests(conv):
        fitted = capper.fit(req.messages)
        assert fitted.tokens <= cap and _chars(fitted.messages) == fitted.tokens
        assert fitted.messages[:2] == req.messages[:2]  # system + task always kept
        assert fitted.messages[-1] == req.messages[-1]  # the newest tool result is there
        kept = fitted.messages[2:]
        assert kept == req.messages[len(req.messages) - len(kept) :]  # a suffix of the history
        assert not kept or kept[0]["role"] == "assistant"  # never a result without its call
        if previous is not None and fitted.dropped_messages == previous.dropped_messages:
            # no new drop: the previous prompt is a prefix of this one (cache reuse)
            assert fitted.messages[: len(previous.messages)] == previous.messages
        elif previous is not None:
            drops += 1
            assert fitted.dropped_messages > previous.dropped_messages
            assert fitted.tokens <= cap * capping.LOW_WATER or len(kept) <= 2
        previous = fitted
    assert drops >= 1


def test_capping_truncates_when_one_step_is_too_long():
    messages = [
        {"role": "system", "content": "s" * 10},
        {"role": "user", "content": "u" * 100},
        {"role": "assistant", "content": "", "reasoning_content": "r" * 20},
        {"role": "tool", "content": "t" * 5000},
    ]
    fitted = capping.PromptCapper(400, _chars).fit(messages)
    assert fitted.tokens <= 400 and fitted.truncated_to is not None
    tool = fitted.messages[-1]["content"]
    assert tool.startswith("ttt") and tool.endswith("ttt") and "characters cut" in tool
    assert fitted.messages[:2] == messages[:2]  # the task stays whole: a stable prefix
    # when cutting the steps is not enough, the task is cut too (never the system prompt)
    tight = capping.PromptCapper(170, _chars).fit(messages)
    assert tight.tokens <= 170 and tight.messages[0] == messages[0]
    assert tight.messages[1]["content"] != messages[1]["content"]
    with pytest.raises(ContextOverflowError, match="raise --max-prompt-tokens"):
        capping.PromptCapper(20, _chars).fit(messages)
