"""From OpenAI-shaped messages to prompt tokens.

The model's own chat template renders the conversation. Where a template does not know a
feature (SmolLM2's renders only role and content), the server renders it in the tool-call
format of the model's parser (Hermes, as Qwen2.5 and NousHermes templates do, unless the
parser is Qwen3.5's XML one): tool signatures in the system prompt, assistant calls as
`<tool_call>` text, tool results as `<tool_response>` inside a user turn. JSON mode adds an
instruction and starts the answer with `{` (see `JsonCutter` for the other half).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from atlas_cli.backend.choice import CONTENT_FREE
from atlas_cli.backend.constraint import grammar_tokenizer
from atlas_cli.backend.tokenizer import TextTokenizer
from atlas_cli.errors import TemplateError
from atlas_cli.serve import toolcalls
from atlas_cli.serve.errors import APIError, bad_param, check_text_fits
from atlas_cli.serve.grammar import GrammarRequest, build_grammar
from atlas_cli.serve.protocol import Message, NamedToolChoice, ResponseFormat, Tool
from atlas_cli.serve.schema_checks import check_schemas
from atlas_cli.serve.toolcalls import HermesParser, NoToolParser, ToolParser
from atlas_cli.serve.toolcalls.tags import THINK_OPEN, TOOL_CALL_OPEN

RESERVED_TEMPLATE_KEYS = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}

HERMES_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

# Qwen3.5's own instructions, for a template without tools and the qwen3_coder parser
XML_TOOLS_PROMPT = """# Tools

You have access to the following functions:

<tools>
{tools}
</tools>

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call>"""

JSON_PROMPT = "Answer with one valid JSON object and nothing else."


@dataclass(frozen=True)
class CallDecision:
    """`auto` for a model with no tool syntax of its own (its template renders no tools):
    call or reply is decided before the answer starts (backend/choice.py), then the answer
    is held to `calls_grammar` (a call) or to the prompt's own lazy grammar (a reply)."""

    null_ids: list[int]  # the prompt with the last turn content-free
    opening: list[int]  # the call's opening tag, as tokens
    calls_grammar: str


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str
    prefill: str = ""  # the start of the answer the server wrote (JSON mode's "{")
    opened_think: bool = False  # the template ended the prompt inside <think>
    tools: list[dict] | None = None  # tools whose calls to parse out of the answer
    json_mode: bool = False
    grammar: str | None = None  # what the answer must fit (serve/grammar.py), prefill included
    decision: CallDecision | None = None  # auto's call-or-reply, where it is decided first


@dataclass
class ChatOptions:
    # the model's tool-call format: how history calls and the tool list are written when the
    # template cannot render them
    parser: type[ToolParser] = HermesParser
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    context: int | None = None  # the model's context: a prompt that cannot fit is not tokenised


def choose_parser(chat_template: str | None, override: str | None = None) -> type[ToolParser]:
    """The tool-call parser for a model: `override` (a flag or recipe) if given, else the one
    the template's text names. A template that renders no tools at all gets Hermes, since
    the server then writes the tool list in the Hermes format itself."""
    parser = toolcalls.select_parser(chat_template, override)
    auto = override in (None, "", "auto")
    if auto and parser is NoToolParser and not template_renders(chat_template, "tools"):
        return HermesParser
    return parser


def template_renders(chat_template: str | None, feature: str) -> bool:
    """Whether the template itself handles `feature`; when not, the server renders it."""
    if not chat_template:
        return False
    needles = {
        "tools": ("tools",),
        "tool_calls": ("tool_calls",),
        "tool_role": ("'tool'", '"tool"'),
        "reasoning": ("reasoning_content",),
    }[feature]
    return any(n in chat_template for n in needles)


def text_of(
    content: str | list | None, where: str, kinds: tuple[str, ...] = ("text", "input_text")
) -> str:
    """A message's text: parts (OpenAI content parts, Anthropic blocks) of the text `kinds`
    are joined; other kinds are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(content):
        if part.type not in kinds:
            raise APIError(
                400,
                f"{where}[{i}]: content of type {part.type!r} is not supported (text only)",
                code="unsupported",
                param=where,
            )
        parts.append(part.text or "")
    return "\n".join(parts)


def _tool_dicts(tools: list[Tool] | None) -> list[dict]:
    return [t.model_dump(exclude_none=True) for t in tools or []]


def chat_messages(
    messages: list[Message], template: str | None, parser: type[ToolParser] = HermesParser
) -> list[dict[str, Any]]:
    """Template-ready dicts: text content, arguments as objects, fallbacks for what the
    template cannot render."""
    renders_calls = template_renders(template, "tool_calls")
    renders_tool_role = template_renders(template, "tool_role")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role = {"developer": "system", "function": "tool"}.get(msg.role, msg.role)
        text = text_of(msg.content, f"{where}.content")
        item: dict[str, Any] = {"role": role, "content": text}
        if msg.name:
            item["name"] = msg.name
        if role == "assistant":
            if msg.reasoning_content:
                item["reasoning_content"] = msg.reasoning_content
            if msg.tool_calls:
                calls = [
                    _call_dict(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(msg.tool_calls)
                ]
                if renders_calls:
                    item["tool_calls"] = calls
                else:
                    texts = [
                        parser.render_call(c["function"]["name"], c["function"]["arguments"])
                        for c in calls
                    ]
                    item["content"] = "\n".join([text, *texts] if text else texts)
        if role == "tool":
            if msg.tool_call_id:
                item["tool_call_id"] = msg.tool_call_id
            if not renders_tool_role:
                wrapped = f"<tool_response>\n{text}\n</tool_response>"
                if out and out[-1].get("_tool_results"):  # consecutive results share a turn
                    out[-1]["content"] += "\n" + wrapped
                    continue
                item = {"role": "user", "content": wrapped, "_tool_results": True}
        out.append(item)
    for item in out:
        item.pop("_tool_results", None)
    return out


def _call_dict(call, where: str) -> dict[str, Any]:
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise bad_param(
                f"{where}.function.arguments", "arguments must be a JSON object"
            ) from None
    return {
        "id": call.id or _new_call_id(),
        "type": "function",
        "function": {"name": call.function.name, "arguments": args},
    }


_new_call_id = toolcalls.ToolCallIds()


def _add_system(messages: list[dict[str, Any]], text: str) -> None:
    if messages and messages[0]["role"] == "system":
        first = messages[0]["content"]
        messages[0] = {**messages[0], "content": f"{first}\n\n{text}" if first else text}
    else:
        messages.insert(0, {"role": "system", "content": text})


def build_chat_prompt(
    tokenizer: TextTokenizer, messages: list[Message], opts: ChatOptions
) -> Prompt:
    template = tokenizer.chat_template
    if not template:
        raise APIError(
            400, "this model has no chat template; use /v1/completions", code="no_template"
        )
    kwargs = dict(opts.template_kwargs)
    clash = RESERVED_TEMPLATE_KEYS & kwargs.keys()
    if clash:
        raise bad_param("chat_template_kwargs", f"{', '.join(sorted(clash))} cannot be set here")
    choice = opts.tool_choice
    tools_active = bool(opts.tools) and choice != "none"
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in opts.tools or []]
        if choice.function.name not in names:
            raise bad_param(
                "tool_choice", f"tool_choice names {choice.function.name!r}, which is not in tools"
            )
    elif choice == "required" and not opts.tools:
        raise bad_param("tool_choice", "tool_choice 'required' needs tools")
    rendered = chat_messages(messages, template, opts.parser)
    tool_dicts = _tool_dicts(opts.tools) if tools_active else None
    pass_tools = None
    if tools_active:
        if template_renders(template, "tools"):
            pass_tools = tool_dicts
        else:
            lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tool_dicts)
            xml = opts.parser.name == "qwen3_coder"
            _add_system(
                rendered, (XML_TOOLS_PROMPT if xml else HERMES_TOOLS_PROMPT).format(tools=lines)
            )
        if choice == "required":
            _add_system(rendered, "You must call at least one of the tools.")
        elif isinstance(choice, NamedToolChoice):
            _add_system(rendered, f"You must call the tool {choice.function.name!r}.")
    fmt = opts.response_format
    json_mode = fmt is not None and fmt.type != "text"
    if json_mode:
        schema = (fmt.json_schema or {}).get("schema") if fmt.type == "json_schema" else None
        extra = f" It must follow this JSON schema:\n{json.dumps(schema)}" if schema else ""
        _add_system(rendered, JSON_PROMPT + extra)
    text = render(tokenizer, rendered, pass_tools, opts.add_generation_prompt, kwargs)
    opened_think = toolcalls.prompt_opens_thinking(text)
    prefill = "{" if json_mode and not tools_active and not opened_think else ""
    if opts.context is not None:  # a 10 MB body costs seconds to tokenise: refuse it first
        check_text_fits(text, tokenizer.fewest_tokens(text + prefill), opts.context)
    ids = tokenizer.encode(text + prefill, add_special_tokens=True)
    grammar = answer_grammar(tokenizer, opts, tools_active, opened_think)
    decision = None
    if grammar is not None and tools_active and pass_tools is None and not json_mode:
        decision = call_decision(tokenizer, opts, rendered, kwargs, text)
    return Prompt(ids, text, prefill, opened_think, tool_dicts, json_mode, grammar, decision)


def call_decision(
    tokenizer: TextTokenizer,
    opts: ChatOptions,
    rendered: list[dict[str, Any]],
    kwargs: dict[str, Any],
    text: str,
) -> CallDecision | None:
    """The decision for `auto` where the server wrote the tool list (the template knows no
    tools, so the model has no call syntax of its own); None where the answer has no single
    decision point (another tool_choice, reasoning first, nothing to make content-free)."""
    if opts.tool_choice not in (None, "auto") or not opts.add_generation_prompt:
        return None
    if THINK_OPEN in (tokenizer.chat_template or "") or not rendered:
        return None
    if rendered[-1]["role"] not in ("user", "tool"):
        return None
    null = [*rendered[:-1], {**rendered[-1], "content": CONTENT_FREE}]
    null_text = render(tokenizer, null, None, True, kwargs)
    if opts.context is not None and tokenizer.fewest_tokens(null_text) >= opts.context:
        return None
    calls = answer_grammar(tokenizer, replace(opts, tool_choice="required"), True, False)
    if calls is None or null_text == text:
        return None
    null_ids = tokenizer.encode(null_text, add_special_tokens=True)
    opening = tokenizer.encode(TOOL_CALL_OPEN, add_special_tokens=False)
    return CallDecision(null_ids, opening, calls)


def answer_grammar(
    tokenizer: TextTokenizer, opts: ChatOptions, tools_active: bool, opened_think: bool
) -> str | None:
    """The grammar constrained decoding holds the answer to (serve/grammar.py), or None:
    nothing to constrain, or a vocabulary llguidance cannot read (then it is prompt-only)."""
    choice, tools = opts.tool_choice, toolcalls.tools_from_openai(_tool_dicts(opts.tools))
    if isinstance(choice, NamedToolChoice):
        tools = {choice.function.name: tools[choice.function.name]}
    syntax = opts.parser.name
    if not tools_active or syntax not in ("hermes", "qwen3_coder"):
        mode = "none"
    else:
        mode = "auto" if choice in (None, "auto") else "required"
    fmt = opts.response_format
    schema = None
    if fmt is not None and fmt.type != "text":
        given = (fmt.json_schema or {}).get("schema") if fmt.type == "json_schema" else None
        schema = given if isinstance(given, dict) and given else {"type": "object"}
    think = "open" if opened_think else "none"
    if not opened_think and THINK_OPEN in (tokenizer.chat_template or ""):
        think = "optional"
    req = GrammarRequest(tools, mode, opts.parallel_tool_calls is True, schema, syntax, think)
    if mode == "none" and schema is None:
        return None
    gtok = grammar_tokenizer(tokenizer)
    if gtok is None:
        return None
    checked = [("tools", params) for params in tools.values()] if mode != "none" else []
    check_schemas(gtok, checked + ([("response_format", schema)] if schema else []))
    return build_grammar(req, gtok.is_special)


def render(
    tokenizer: TextTokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict] | None,
    add_generation_prompt: bool,
    kwargs: dict[str, Any],
) -> str:
    try:
        return tokenizer.render_chat(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except TemplateError as exc:
        raise APIError(400, str(exc), code="template_error") from None
    except Exception as exc:  # a template fed data it does not expect (e.g. None + str)
        raise APIError(400, f"chat template failed: {exc}", code="template_error") from None


class JsonCutter:
    """JSON mode's end: finds where the first top-level JSON value closes in streamed text so
    generation can stop there (a small model tends to keep talking after the object)."""

    def __init__(self, prefill: str = ""):
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.started = False
        self.done = False
        self.feed(prefill)

    def feed(self, text: str) -> int | None:
        """Feed text; return the index in `text` just past the closing brace, if it is there."""
        for i, ch in enumerate(text):
            if self.done:
                return None
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
                self.started = True
            elif ch in "}]":
                self.depth -= 1
                if self.started and self.depth <= 0:
                    self.done = True
                    return i + 1
        return None


def valid_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
