"""BFCL v4's side of `atlas bench bfcl`: its single-turn test cases, its prompt, its decoders and
its checker, read from the `bfcl-eval` package without importing its model handlers.

bfcl-eval declares heavy dependencies (torch through sentence-transformers, faiss, a numpy pin,
every vendor SDK), but the single-turn AST categories need none of them: the cases are
JSON-lines files inside the wheel and `ast_checker` is plain Python. That module imports BFCL's
model registry (`constants.model_config`, which imports every vendor handler) for one fact per
model, whether the model saw "." in function names replaced by "_"; a small stand-in holds that
fact while it imports. The prompt-mode system prompt is assembled from BFCL's own template
constants. `openai_tools` and the decoders restate BFCL's `convert_to_tool` and `decode_ast`
(model_handler/utils.py, which imports tree-sitter and tenacity at module level).
"""

from __future__ import annotations

import ast
import copy
import json
import operator
import sys
import types
from dataclasses import dataclass
from functools import cache
from importlib import metadata, resources
from typing import Any

from atlas_cli.errors import AtlasError

BFCL_VERSION = "2026.3.23"  # the bfcl-eval release these categories and this code were read from
INSTALL = f"pip install --no-deps 'bfcl-eval=={BFCL_VERSION}'"

# The single-turn Python categories (BFCL's "python" collection, in the leaderboard's order):
# AST-checked or relevance-checked, none needs the network or an API key.
CATEGORIES = (
    "simple_python",
    "multiple",
    "parallel",
    "parallel_multiple",
    "irrelevance",
    "live_simple",
    "live_multiple",
    "live_parallel",
    "live_parallel_multiple",
    "live_irrelevance",
    "live_relevance",
)
# Also loadable, for the MLPerf set (bfcl_mlperf.py), which sends their functions as it sends
# the Python ones; the checker reads their values as Java or JavaScript
OTHER_LANGUAGES = {"simple_java": "JAVA", "simple_javascript": "JAVASCRIPT"}
MODES = ("fc", "prompt")

# The checker's model names: an OpenAI-style function-calling model (tools sent with "." in a
# name replaced by "_", which the checker undoes) and a prompted model (names kept).
CHECKER_MODEL = {"fc": "atlas-FC", "prompt": "atlas-prompt"}
PYTHON_HINT = " Note that the provided function is in Python 3 syntax."  # BFCL utils.py


class BfclMissingError(AtlasError):
    """The bfcl-eval package (BFCL's data and checker) is not installed."""


@dataclass(frozen=True)
class Case:
    id: str
    category: str
    messages: list[dict[str, Any]]  # the single turn's messages, as BFCL gives them
    functions: list[dict[str, Any]]  # BFCL function docs, as the checker reads them
    answer: list[dict[str, Any]] | None  # possible answers; None for the relevance categories


@dataclass(frozen=True)
class Reply:
    """What the server answered: the content, and the tool calls as (name, arguments JSON);
    `calls` is None when the message had no `tool_calls` field."""

    content: str | None
    calls: list[tuple[str, str]] | None


@dataclass(frozen=True)
class Verdict:
    valid: bool
    error_type: str | None = None
    error: str | None = None


def _require() -> None:
    try:
        import bfcl_eval  # noqa: F401
    except ImportError:
        raise BfclMissingError(
            f"atlas bench bfcl reads BFCL's cases and checker from the bfcl-eval package: "
            f"{INSTALL} (its own dependencies are not needed)"
        ) from None


def version() -> str:
    _require()
    try:
        return metadata.version("bfcl-eval")
    except metadata.PackageNotFoundError:  # importable from a source tree
        return "unknown"


def _data_file(*parts: str):
    from bfcl_eval.constants.category_mapping import VERSION_PREFIX

    path = resources.files("bfcl_eval").joinpath("data", *parts[:-1])
    return path.joinpath(f"{VERSION_PREFIX}_{parts[-1]}.json")


def _jsonl(path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def is_relevance(category: str) -> bool:
    return category.endswith("relevance")  # irrelevance, live_irrelevance, live_relevance


def load(category: str, limit: int | None = None) -> list[Case]:
    """The first `limit` cases of a category (all when None), in BFCL's order."""
    _require()
    if category not in CATEGORIES and category not in OTHER_LANGUAGES:
        raise AtlasError(f"unknown BFCL category {category!r}; pick from {', '.join(CATEGORIES)}")
    entries = _jsonl(_data_file(category))[:limit]
    answers: dict[str, Any] = {}
    if not is_relevance(category):
        answers = {
            a["id"]: a["ground_truth"] for a in _jsonl(_data_file("possible_answer", category))
        }
    return [
        Case(
            id=e["id"],
            category=category,
            messages=e["question"][0],
            functions=e["function"],
            answer=None if is_relevance(category) else answers[e["id"]],
        )
        for e in entries
    ]


# -- what the model is shown -------------------------------------------------------------------


def hinted(functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The docs with BFCL's language hint, as its inference step shows them to every model."""
    out = copy.deepcopy(functions)
    for f in out:
        f["description"] = f.get("description", "") + PYTHON_HINT
    return out


def _cast_types(properties: dict[str, Any], mapping: dict[str, str]) -> dict[str, Any]:
    """BFCL's `_cast_to_openai_type`: its type names to JSON Schema's, floats flagged."""
    for value in properties.values():
        kind = value.get("type")
        if kind == "float":
            value["format"] = "float"
            value["description"] = value.get("description", "") + " This is a float type value."
        value["type"] = mapping.get(kind, "string")
        if value["type"] in ("array", "object"):
            if "properties" in value:
                value["properties"] = _cast_types(value["properties"], mapping)
            elif "items" in value:
                items = value["items"]
                items["type"] = mapping.get(items.get("type"), "string")
                if items["type"] == "object" and "properties" in items:
                    items["properties"] = _cast_types(items["properties"], mapping)
                elif items["type"] == "array" and "items" in items:
                    inner = items["items"]
                    inner["type"] = mapping.get(inner.get("type"), "string")
    return properties


def openai_tools(functions: list[dict[str, Any]], hint: bool = True) -> list[dict[str, Any]]:
    """BFCL's `convert_to_tool` for OpenAI chat completions: the `tools` field it sends (on the
    docs with its language hint; without it as the MLPerf harness sends them)."""
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI

    tools = []
    for f in hinted(functions) if hint else copy.deepcopy(functions):
        f["name"] = f["name"].replace(".", "_")  # OpenAI's names match ^[a-zA-Z0-9_-]{1,64}$
        params = f.setdefault("parameters", {})
        params["type"] = "object"
        params["properties"] = _cast_types(params.get("properties", {}), GORILLA_TO_OPENAPI)
        tools.append({"type": "function", "function": f})
    return tools


def prompt_messages(case: Case) -> list[dict[str, Any]]:
    """BFCL's prompt mode: its default system prompt (python calls, no tag, JSON docs,
    plaintext, classic style; `formulate_system_prompt`) before any system message of the case."""
    from bfcl_eval.constants import default_prompts as p

    style = p.PROMPT_STYLE_TEMPLATES["classic"]
    call_format = style["tool_call_no_tag"].format(
        output_format=p.OUTPUT_FORMAT_MAPPING["python"], param_types=p.PARAM_TYPE_MAPPING["python"]
    )
    tools = style["available_tools"].format(
        format="json", functions=json.dumps(hinted(case.functions), indent=4)
    )
    system = p.PROMPT_TEMPLATE_MAPPING["plaintext"].format(
        persona=style["persona"],
        task=style["task"],
        tool_call_format=call_format,
        multiturn_behavior=style["multiturn_behavior"],
        available_tools=tools,
    )
    messages = copy.deepcopy(case.messages)
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = system + "\n\n" + messages[0]["content"]
    else:
        messages.insert(0, {"role": "system", "content": system})
    return messages


# -- what the model said -----------------------------------------------------------------------


def decode(reply: Reply, mode: str) -> list[dict[str, Any]]:
    """BFCL's `decode_ast`: [{name: {argument: value}}]; raises where BFCL's decoder fails."""
    if mode == "fc":
        if reply.calls is None:  # BFCL then decodes the content string, which always fails
            raise ValueError("no tool calls in the answer")
        return [{name: json.loads(arguments)} for name, arguments in reply.calls]
    return decode_python_calls(reply.content)


def decode_python_calls(text: str | None) -> list[dict[str, Any]]:
    """BFCL's `default_decode_ast_prompting`: `[f(a=1), g(b="x")]` into calls."""
    if text is None:
        raise ValueError("no content in the answer")
    text = text.strip("`\n ")
    text = ("" if text.startswith("[") else "[") + text + ("" if text.endswith("]") else "]")
    parsed = ast.parse(text.strip().strip("'"), mode="eval")
    if isinstance(parsed.body, ast.Call):
        return [_call(parsed.body)]
    calls = []
    for elem in parsed.body.elts:
        if not isinstance(elem, ast.Call):
            raise ValueError("not a list of calls")
        calls.append(_call(elem))
    return calls


def _call(node: ast.Call) -> dict[str, Any]:
    parts = []
    func = node.func
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return {".".join(reversed(parts)): {k.arg: _value(k.value) for k in node.keywords}}


def _value(node: ast.expr) -> Any:
    """BFCL's `resolve_ast_by_type`, except that arithmetic is folded by `_arithmetic` where
    BFCL calls eval(): model output is never executed."""
    if isinstance(node, ast.Constant):
        return "..." if node.value is Ellipsis else node.value
    if isinstance(node, ast.UnaryOp):  # -1, +2.5 (BFCL negates any operand)
        return ast.literal_eval(node)
    if isinstance(node, ast.List):
        return [_value(v) for v in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_value(v) for v in node.elts)
    if isinstance(node, ast.Dict):
        return {_value(k): _value(v) for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, ast.BinOp):
        return _arithmetic(node)
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        return _call(node) if node.keywords else ast.unparse(node)
    if isinstance(node, ast.Subscript):
        return ast.unparse(node)
    raise ValueError(f"unsupported argument syntax: {type(node).__name__}")


_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _arithmetic(node: ast.expr) -> Any:
    """`2**3`, `"a" + "b"`, `1/3` as eval() would give them; names and calls fail to decode, as
    they do under eval() in BFCL; `9**9**9` and `"a" * 10**9` are refused, not computed."""
    if isinstance(node, ast.Constant | ast.UnaryOp):
        return ast.literal_eval(node)
    if not isinstance(node, ast.BinOp) or type(node.op) not in _OPERATORS:
        raise ValueError(f"unsupported arithmetic: {ast.unparse(node)[:80]}")
    left, right = _arithmetic(node.left), _arithmetic(node.right)
    if isinstance(node.op, ast.Pow) and abs(right) > 64:
        raise ValueError("exponent too large")
    text, count = (left, right) if isinstance(left, str) else (right, left)
    if isinstance(node.op, ast.Mult) and isinstance(text, str) and count > 10_000:
        raise ValueError("repeated string too long")
    return _OPERATORS[type(node.op)](left, right)


def _is_call_list(decoded: Any) -> bool:
    """BFCL's `is_function_calling_format_output`: [] or [{name: {args}}, ...]."""
    return isinstance(decoded, list) and all(
        isinstance(d, dict) and len(d) == 1 and isinstance(next(iter(d.values())), dict)
        for d in decoded
    )


def _is_empty(decoded: Any) -> bool:
    """BFCL's `is_empty_output`: no call at all (what an irrelevance case wants)."""
    return not _is_call_list(decoded) or not decoded or (len(decoded) == 1 and not decoded[0])


# -- the verdict -------------------------------------------------------------------------------


class _CheckerModels(dict):
    """The stand-in for BFCL's model registry while its checker imports: our two names."""

    def __init__(self):
        super().__init__(
            {
                CHECKER_MODEL["fc"]: types.SimpleNamespace(underscore_to_dot=True),
                CHECKER_MODEL["prompt"]: types.SimpleNamespace(underscore_to_dot=False),
            }
        )


@cache
def _checker():
    _require()
    name = "bfcl_eval.constants.model_config"
    stand_in = name not in sys.modules
    if stand_in:
        registry = types.ModuleType(name)
        registry.MODEL_CONFIG_MAPPING = _CheckerModels()
        sys.modules[name] = registry
    try:
        from bfcl_eval.eval_checker.ast_eval import ast_checker
    finally:
        if stand_in:
            del sys.modules[name]  # the checker keeps its reference; nothing else sees it
    return ast_checker


def score(case: Case, reply: Reply, mode: str) -> Verdict:
    """BFCL's verdict on one answer (eval_runner's `_evaluate_single_relevance_entry` and
    `_evaluate_single_ast_entry`, with its `ast_checker`)."""
    from bfcl_eval.constants.enums import Language

    checker = _checker()
    try:
        decoded = decode(reply, mode)
    except Exception as exc:  # BFCL counts any decoder failure the same way
        if is_relevance(case.category):
            called = False
        else:
            return Verdict(False, "ast_decoder:decoder_failed", str(exc)[:200])
    else:
        called = not _is_empty(decoded)
    if is_relevance(case.category):
        if "irrelevance" in case.category:
            return Verdict(not called, None if not called else "irrelevance_error:decoder_success")
        return Verdict(called, None if called else "relevance_error:decoder_failed")
    if not _is_call_list(decoded):
        return Verdict(False, "ast_decoder:decoder_wrong_output_format")
    language = Language[OTHER_LANGUAGES.get(case.category, "PYTHON")]
    result = checker.ast_checker(
        case.functions, decoded, case.answer, language, case.category, CHECKER_MODEL[mode]
    )
    if result["valid"]:
        return Verdict(True)
    return Verdict(False, result.get("error_type"), "; ".join(map(str, result.get("error", []))))
