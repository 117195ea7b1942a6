"""`atlas bench bfcl`: BFCL's own checker on real BFCL v4 cases with hand-written answers, the
command against atlas serve with a scripted engine, protocol errors, and the gate.

Needs bfcl-eval (`pip install --no-deps bfcl-eval==2026.3.23`; .ci/run installs it)."""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

from atlas_cli.bench import bfcl, gate
from atlas_cli.bench import bfcl_cases as cases
from atlas_cli.cli import app

pytest.importorskip("bfcl_eval")

runner = CliRunner()


def case(category: str, index: int) -> cases.Case:
    return cases.load(category, index + 1)[index]


def fc(*calls: tuple[str, dict]) -> cases.Reply:
    return cases.Reply(None, [(name, json.dumps(args)) for name, args in calls])


def text(content: str) -> cases.Reply:
    return cases.Reply(content, None)


# -- BFCL's checker on real cases -------------------------------------------------------------


def test_simple_call_right_and_wrong():
    triangle = case("simple_python", 0)  # calculate_triangle_area(base=10, height=5)
    right = fc(("calculate_triangle_area", {"base": 10, "height": 5}))
    assert cases.score(triangle, right, "fc").valid
    with_optional = fc(("calculate_triangle_area", {"base": 10, "height": 5, "unit": "units"}))
    assert cases.score(triangle, with_optional, "fc").valid
    wrong = cases.score(triangle, fc(("calculate_triangle_area", {"base": 9, "height": 5})), "fc")
    assert not wrong.valid and wrong.error_type.startswith("value_error")
    missing = cases.score(triangle, fc(("calculate_triangle_area", {"base": 10})), "fc")
    assert not missing.valid
    prose = cases.score(triangle, text("The area is 25 square units."), "fc")
    assert (prose.valid, prose.error_type) == (False, "ast_decoder:decoder_failed")


def test_dotted_names_in_each_mode():
    factorial = case("simple_python", 1)  # math.factorial(number=5)
    # fc: the tool was sent as math_factorial (OpenAI names have no dots); the checker knows
    assert cases.score(factorial, fc(("math_factorial", {"number": 5})), "fc").valid
    assert cases.score(factorial, text("[math.factorial(number=5)]"), "prompt").valid
    assert not cases.score(factorial, text("[math_factorial(number=5)]"), "prompt").valid
    assert not cases.score(factorial, text("[math.factorial(number='5')]"), "prompt").valid


def test_parallel_calls_in_any_order_and_all_of_them():
    spotify = case("parallel", 0)  # Taylor Swift 20 min and Maroon 5 15 min
    swift = ("spotify_play", {"artist": "Taylor Swift", "duration": 20})
    maroon = ("spotify_play", {"artist": "Maroon 5", "duration": 15})
    assert cases.score(spotify, fc(maroon, swift), "fc").valid
    assert not cases.score(spotify, fc(swift), "fc").valid
    prompt = (
        "[spotify.play(artist='Taylor Swift', duration=20), "
        "spotify.play(artist='Maroon 5', duration=15)]"
    )
    assert cases.score(spotify, text(prompt), "prompt").valid


def test_multiple_picks_the_right_function():
    heron = case("multiple", 1)  # math.triangle_area_heron(3, 4, 5) among three
    right = fc(("math_triangle_area_heron", {"side1": 3, "side2": 4, "side3": 5}))
    assert cases.score(heron, right, "fc").valid
    other = fc(("math_triangle_area_base_height", {"base": 3, "height": 4}))
    assert not cases.score(heron, other, "fc").valid


def test_relevance_categories():
    bmi = case("irrelevance", 0)  # a triangle question, only a BMI tool: no call is right
    assert cases.score(bmi, text("No tool can compute a triangle's area."), "fc").valid
    assert cases.score(bmi, cases.Reply(None, []), "fc").valid  # an empty call list
    called = cases.score(bmi, fc(("determine_body_mass_index", {"weight": 1, "height": 1})), "fc")
    assert (called.valid, called.error_type) == (False, "irrelevance_error:decoder_success")
    assert not cases.score(
        bmi, text("[determine_body_mass_index(weight=1, height=1)]"), "prompt"
    ).valid
    image = case("live_relevance", 0)  # any call is right
    assert cases.score(image, fc(("generate_image", {"prompt": "a masked woman"})), "fc").valid
    assert not cases.score(image, text("Here is your painting."), "fc").valid


def test_what_the_model_is_shown():
    (tool,) = cases.openai_tools(case("simple_python", 1).functions)
    assert tool["type"] == "function"
    f = tool["function"]
    assert f["name"] == "math_factorial"
    assert f["description"].endswith(cases.PYTHON_HINT)
    assert f["parameters"]["type"] == "object"  # BFCL's "dict"
    messages = cases.prompt_messages(case("simple_python", 0))
    assert messages[0]["role"] == "system" and "calculate_triangle_area" in messages[0]["content"]
    assert "[func_name1(params_name1=params_value1" in messages[0]["content"]
    assert messages[1:] == case("simple_python", 0).messages


def test_prompt_decoder_folds_arithmetic_without_running_it():
    assert cases.decode_python_calls("f(a=2**3, b='x' + 'y', c=-1.5)") == [
        {"f": {"a": 8, "b": "xy", "c": -1.5}}
    ]
    for hostile in ("f(a=9**9**9)", "f(a='x' * 10**9)", "f(a=__import__('os').getcwd() + 1)"):
        with pytest.raises(ValueError):
            cases.decode_python_calls(hostile)


def test_without_bfcl_eval_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "bfcl_eval", None)  # import fails as if not installed
    with pytest.raises(cases.BfclMissingError, match="pip install --no-deps 'bfcl-eval=="):
        cases.load("simple_python", 1)


def test_bad_flags():
    with pytest.raises(bfcl.UsageError, match="unknown nope"):
        bfcl.parse_categories("simple_python,nope")
    assert bfcl.parse_categories(None) == cases.CATEGORIES
    for bad in (
        bfcl.Settings("m", mode="json"),
        bfcl.Settings("m", tool_choice="none"),
        bfcl.Settings("m", mode="prompt", tool_choice="required"),
        bfcl.Settings("m", limit=0),
    ):
        with pytest.raises(bfcl.UsageError):
            bfcl.check_settings(bad)


# -- the command against atlas serve (scripted engine) ----------------------------------------

TRIANGLE_CALL = [
    "<tool_call>\n",
    '{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}}',
    "\n</tool_call>",
]


@pytest.fixture(scope="module")
def scripted_server(smollm2):
    from atlas_cli.serve.app import create_app
    from atlas_cli.serve.http import ServeConfig
    from tests.serve_helpers import ServerThread, scripted_model

    fake = scripted_model(smollm2.tokenizer)
    config = ServeConfig(model="scripted", accept_any_model=True)
    with ServerThread(create_app(config, fake)) as srv:
        yield srv.url, fake.engine, smollm2.tokenizer


def bench(*args: str):
    return runner.invoke(app, ["bench", "bfcl", *args])


def test_command_scores_a_scripted_server(scripted_server, tmp_path):
    url, engine, tokenizer = scripted_server
    engine.script, engine.prompts = TRIANGLE_CALL, []
    out = tmp_path / "run.json"
    args = ["scripted", "--url", url, "--limit", "2", "--categories", "simple_python,irrelevance"]
    result = bench(*args, "-o", "json", "--output-file", str(out))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc == json.loads(out.read_text())
    assert doc["kind"] == "bfcl" and doc["mode"] == "fc" and doc["tool_choice"] == "auto"
    valid = {row["id"]: row["valid"] for row in doc["cases"]}
    # the one answer is right for simple_python_0 only, and a call is wrong for irrelevance
    assert valid == {
        "simple_python_0": True,
        "simple_python_1": False,
        "irrelevance_0": False,
        "irrelevance_1": False,
    }
    assert doc["categories"]["simple_python"] == {
        "correct": 1,
        "total": 2,
        "accuracy": 0.5,
        "protocol_errors": 0,
    }
    assert doc["summary"]["accuracy"] == 0.25 and doc["summary"]["protocol_errors"] == 0
    assert len(engine.prompts) == 4
    shown = tokenizer.decode(engine.prompts[1])  # the second case's prompt, tools included
    assert "math_factorial" in shown and cases.PYTHON_HINT.strip() in shown

    engine.script = ["I cannot help with that."]
    result = bench(*args)
    assert result.exit_code == 0, result.output
    assert "| simple_python | 0 | 2 | 0.0% | 0 |" in result.stdout
    assert "| irrelevance | 2 | 2 | 100.0% | 0 |" in result.stdout
    assert "| **overall** | 2 | 4 | 50.0% | 0 |" in result.stdout


def test_a_cut_off_run_resumes_where_it_stopped(scripted_server, tmp_path):
    """--resume FILE keeps the answers FILE holds (not its protocol errors), asks the rest,
    writes FILE after every case; a file asked with other settings is refused in one line."""
    url, engine, _ = scripted_server
    engine.script, engine.prompts = TRIANGLE_CALL, []
    kept = tmp_path / "kept.json"
    args = ["scripted", "--url", url, "--limit", "2", "--categories", "simple_python,irrelevance"]
    whole = bench(*args, "-o", "json", "--resume", str(kept))
    assert whole.exit_code == 0, whole.output
    assert json.loads(kept.read_text()) == json.loads(whole.stdout)
    assert len(engine.prompts) == 4

    doc = json.loads(kept.read_text())  # as if cut off after two cases, one of them refused
    doc["cases"] = doc["cases"][:2]
    doc["cases"][1] = {**doc["cases"][1], "valid": False, "error_type": "protocol_error"}
    kept.write_text(json.dumps(doc))
    engine.prompts = []
    again = bench(*args, "-o", "json", "--resume", str(kept))
    assert again.exit_code == 0, again.output
    assert len(engine.prompts) == 3  # the refused case and the two never asked
    assert json.loads(again.stdout)["cases"] == json.loads(whole.stdout)["cases"]
    assert "simple_python_0 kept" in again.output

    other = bench(*args, "--mode", "prompt", "--resume", str(kept))
    assert other.exit_code == 2 and "other settings" in other.output


def test_gate_on_a_baseline(scripted_server, tmp_path):
    url, engine, _ = scripted_server
    args = ["scripted", "--url", url, "--limit", "1", "--categories", "simple_python,irrelevance"]
    engine.script = TRIANGLE_CALL  # simple right, irrelevance wrong: 50%
    base = tmp_path / "base.json"
    assert bench(*args, "--save-baseline", str(base)).exit_code == 0
    engine.script = ["No call needed."]  # simple wrong, irrelevance right: still 50% overall
    result = bench(*args, "--baseline", str(base))
    assert result.exit_code == 1, result.output
    assert "accuracy simple_python" in result.output and "REGRESSED" in result.output
    result = bench(*args, "--baseline", str(base), "--mlperf-rule")  # the overall only
    assert result.exit_code == 0, result.output
    assert "gate: PASS" in result.output


def test_mlperf_rule_is_97_percent_of_the_reference():
    def doc(accuracy: float) -> dict:
        tally = {"correct": 0, "total": 100, "accuracy": accuracy, "protocol_errors": 0}
        return {"kind": "bfcl", "summary": tally, "categories": {"simple_python": tally}}

    assert gate.mlperf_accuracy(doc(0.485), doc(0.5)).passed  # 97% of 0.5
    assert not gate.mlperf_accuracy(doc(0.48), doc(0.5)).passed
    assert not gate.compare(doc(0.485), doc(0.5), 0.01).passed  # the plain gate: per metric
    with pytest.raises(gate.BaselineError):
        gate.mlperf_accuracy(doc(0.5), {"kind": "agentic", "summary": {}})


def test_tool_choice_required_is_sent(scripted_server):
    url, engine, _ = scripted_server
    seen = []
    engine.script = TRIANGLE_CALL
    client = bfcl.ChatClient(url, "scripted")
    settings = bfcl.Settings("scripted", tool_choice="required")
    try:
        body = client.body(case("simple_python", 0), settings)
        seen.append(body["tool_choice"])
        reply = client.ask(body)
    finally:
        client.close()
    assert (
        seen == ["required"] and body["tools"][0]["function"]["name"] == "calculate_triangle_area"
    )
    assert cases.score(case("simple_python", 0), reply, "fc").valid


# -- protocol errors --------------------------------------------------------------------------


class Refusing(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["messages"][-1]["content"].startswith("Find the area"):  # simple_python_0
            time.sleep(1)  # longer than the client waits
        self.send_response(500)
        self.end_headers()
        self.wfile.write(b'{"error": "boom"}')


def test_a_slow_answer_is_a_protocol_error_too():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    client = bfcl.ChatClient(f"http://127.0.0.1:{srv.server_address[1]}", "m", timeout_s=0.2)
    try:
        row = bfcl.run_case(client, case("simple_python", 0), bfcl.Settings("m"))
    finally:
        client.close()
        srv.shutdown()
        srv.server_close()
    assert row["error_type"] == "protocol_error" and "no answer" in row["error"]


def test_refusals_are_protocol_errors_and_a_dead_server_stops_the_run():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    settings = bfcl.Settings("m", categories=("simple_python", "irrelevance"), limit=1, url=url)
    try:
        doc = bfcl.run(settings, url)
    finally:
        srv.shutdown()
        srv.server_close()
    assert doc["summary"] == {"correct": 0, "total": 2, "accuracy": 0.0, "protocol_errors": 2}
    assert "HTTP 500" in doc["cases"][0]["error"]
    result = bench("m", "--url", url, "--limit", "1", "--categories", "simple_python")
    assert result.exit_code != 0 and "cannot reach" in result.output


# -- in-process: atlas serve started by the command -------------------------------------------


@pytest.mark.slow
def test_in_process_run_on_the_default_model(smollm2_path):
    args = [str(smollm2_path), "--limit", "1", "--categories", "simple_python,irrelevance"]
    result = bench(*args, "--max-tokens", "4", "--ctx-size", "2048", "-o", "json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["summary"]["total"] == 2 and doc["summary"]["protocol_errors"] == 0
    assert [row["id"] for row in doc["cases"]] == ["simple_python_0", "irrelevance_0"]
    assert all(row["output"] is not None for row in doc["cases"])  # the model answered
