"""Chat templates: the model's own Jinja, rendered in jinja2's immutable sandbox under a budget.

A template is data from a model repo. The sandbox keeps it away from Python objects and the
filesystem; the budget keeps it from taking the process down: every render gets a step count
(loop iterations, calls, operators, writes), a deadline, a recursion depth, a cap on the size
of any one value and on everything it writes, and a cap on integer size. `include`, `import`
and `extends` are refused (a chat template is one self-contained file).

The budget is enforced at the points jinja2's sandbox already routes through the environment
(`call`, `call_binop`) plus three hooks the compiler cannot give us, which we add to the parsed
template before it is compiled: every `for` iterates through `iterate`, every `~` joins through
`concat`, and every write goes through `emit`. Filters are wrapped the same way.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import string
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from atlas_cli.errors import TemplateError

# Limits. A prompt over MAX_CHARS cannot fit any context atlas runs (16 Mi characters is ~4M
# tokens), so nothing legitimate comes near them; hostile templates stop in well under 3 s.
MAX_CHARS = 16 * 1024 * 1024  # any one value, and the rendered prompt
MAX_ITEMS = 1 << 18  # the longest list (range() stops at 100,000; messages at thousands)
MAX_WRITTEN = 4 * MAX_CHARS  # everything written, macro bodies and {% set %} blocks included
MAX_STEPS = 1_000_000
MAX_SECONDS = 2.0
MAX_DEPTH = 64  # nested macro / recursive-loop calls
MAX_INT_BITS = 4096
MAX_JSON_INDENT = 32  # also the longest tojson separator
MAX_WIDTH = 1 << 20  # a width or count asked of str.ljust, |center, |indent, |slice, ...
WIDTH_FILTERS = {"center", "indent", "truncate", "wordwrap", "batch", "slice"}
WIDTH_METHODS = {"ljust", "rjust", "center", "zfill", "expandtabs"}
REFUSED_TAGS = {"Include": "include", "Import": "import", "FromImport": "from-import"}

_BUDGET: contextvars.ContextVar[Budget] = contextvars.ContextVar("atlas_template_budget")


class BudgetExceeded(TemplateError):
    """A template that ran past one of the limits above."""


@dataclass
class Budget:
    """What one render may still spend."""

    deadline: float
    steps: int = 0
    depth: int = 0
    written: int = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise BudgetExceeded(f"ran over {MAX_STEPS:,} steps (loop iterations and calls)")
        if not self.steps & 255 and time.monotonic() > self.deadline:
            raise BudgetExceeded(f"ran longer than {MAX_SECONDS:g} s")


def _active() -> Budget:
    """The render's budget. Outside a render (jinja's constant folding at compile time) this
    raises, which makes jinja leave the expression to run time, under the budget."""
    budget = _BUDGET.get(None)
    if budget is None:
        raise BudgetExceeded("no render in progress")
    return budget


def size_of(value: Any, limit: int = MAX_CHARS) -> int:
    """The characters `value` stands for once written out (a list repeating one string counts
    it each time; any other item counts 1). Stops counting past `limit`; a list longer than
    MAX_ITEMS is over it at once."""
    if isinstance(value, str | bytes):
        return len(value)
    if not isinstance(value, list | tuple | dict):
        return 1
    if len(value) > MAX_ITEMS:
        return limit + 1
    total = len(value)
    for item in value.items() if isinstance(value, dict) else value:
        if item.__class__ is str:
            total += len(item)
        elif isinstance(item, list | tuple | dict | bytes):
            total += size_of(item, limit - total)
        if total > limit:
            break
    return total


def check_size(value: Any, what: str = "a value") -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        check_int(value)
    elif size_of(value) > MAX_CHARS:
        raise BudgetExceeded(f"{what} is over the {MAX_CHARS // 2**20} MiB size limit")
    return value


def check_int(value: int) -> None:
    if value.bit_length() > MAX_INT_BITS:
        raise BudgetExceeded(f"an integer is over the {MAX_INT_BITS}-bit limit")


def check_widths(args: tuple, kwargs: dict, limit: int = MAX_WIDTH) -> None:
    """Widths, counts and repeats: a number over `limit` can only ask for too much."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > limit:
            shown = f"{value:,}" if abs(value) < 10**12 else "given"
            raise BudgetExceeded(f"the width or count {shown} is over {limit:,}")


# -- the sizes an operation is about to produce ------------------------------------------------

_PRINTF_NUMBERS = re.compile(r"%[#0\- +]*(\d*)(?:\.(\d*))?")
_NUMBERS = re.compile(r"\d+")


def check_printf(fmt: str, args: Any) -> None:
    """`'%100000000d' % 1` would allocate the width before we see the result."""
    for width, precision in _PRINTF_NUMBERS.findall(fmt):
        for digits in (width, precision):
            if digits and (len(digits) > 9 or int(digits) > MAX_CHARS):
                raise BudgetExceeded("a printf width or precision is too big")
    check_widths(args if isinstance(args, tuple) else (args,), {}, MAX_CHARS)
    if fmt.count("%") * size_of(args) > MAX_CHARS:  # '%(a)s%(a)s...' % {'a': big}
        raise BudgetExceeded("a formatted value is over the size limit")


def check_format(fmt: str, args: tuple, kwargs: dict) -> None:
    """The same for `str.format`: `'{:>100000000}'.format(1)`, `'{0}{0}...'.format(big)`."""
    if fmt.count("{") * (size_of(args) + size_of(kwargs)) > MAX_CHARS:
        raise BudgetExceeded("a formatted value is over the size limit")
    for _, _, spec, _ in string.Formatter().parse(fmt):
        for digits in _NUMBERS.findall(spec or ""):
            if len(digits) > 9 or int(digits) > MAX_CHARS:
                raise BudgetExceeded("a format width or precision is too big")


def check_binop(op: str, left: Any, right: Any) -> None:
    if op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        if abs(left) > 1 and right * max(abs(left).bit_length() - 1, 1) > MAX_INT_BITS:
            raise BudgetExceeded(f"an integer power is over the {MAX_INT_BITS}-bit limit")
    elif op == "*":
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise BudgetExceeded(f"an integer product is over the {MAX_INT_BITS}-bit limit")
            return
        seq, times = (left, right) if isinstance(right, int) else (right, left)
        if not isinstance(times, int) or times <= 0:
            return
        if isinstance(seq, list | tuple) and len(seq) * times > MAX_ITEMS:
            raise BudgetExceeded(f"a repeated list is over {MAX_ITEMS:,} items")
        if size_of(seq) * times > MAX_CHARS:
            raise BudgetExceeded(f"a repeated value is over the {MAX_CHARS // 2**20} MiB limit")
    elif op == "+" and not isinstance(left, int | float):
        lists = isinstance(left, list | tuple) and isinstance(right, list | tuple)
        if lists and len(left) + len(right) > MAX_ITEMS:
            raise BudgetExceeded(f"a joined list is over {MAX_ITEMS:,} items")
        if size_of(left) + size_of(right) > MAX_CHARS:
            raise BudgetExceeded(f"a joined value is over the {MAX_CHARS // 2**20} MiB limit")
    elif op == "%" and isinstance(left, str):
        check_printf(left, right)


def check_str_method(method: Any, args: tuple, kwargs: dict) -> tuple:
    """The string methods whose result can dwarf their arguments, checked before they run;
    returns `args` (a joined iterator comes back as a list: counting it consumed it)."""
    method = getattr(method, "__wrapped__", method)  # the sandbox wraps str.format
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(owner, str):
        return args
    if name in WIDTH_METHODS:
        check_widths(args, kwargs)
    if name == "join" and args:
        items = args[0] if isinstance(args[0], list | tuple) else list(args[0])
        check_join(owner, items)
        args = (items, *args[1:])
    elif name in ("format", "format_map"):
        check_format(owner, args, kwargs)
    elif name == "replace" and len(args) >= 2:
        check_replace(owner, str(args[0]), str(args[1]), args[2] if len(args) > 2 else -1)
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tab, int) and owner.count("\t") * tab > MAX_CHARS:
            raise BudgetExceeded("expanded tabs are over the size limit")
    return args


def check_join(separator: str, items: Any) -> None:
    if len(separator) * len(items) + size_of(items) > MAX_CHARS:
        raise BudgetExceeded(f"a joined value is over the {MAX_CHARS // 2**20} MiB limit")


def check_replace(text: str, old: str, new: str, count: int = -1) -> None:
    hits = text.count(old) if count < 0 else min(count, text.count(old))
    if len(text) + hits * len(new) > MAX_CHARS:
        raise BudgetExceeded("a replaced value is over the size limit")


# -- filters and globals -----------------------------------------------------------------------


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    # HF's tojson: no HTML escaping (jinja's default filter escapes <, > and &)
    widths = [indent if isinstance(indent, int) else len(str(indent or ""))]
    widths += [len(str(s)) for s in separators or ()]
    if isinstance(indent, bool) or max(widths) > MAX_JSON_INDENT:
        raise BudgetExceeded(f"tojson indent or separators are over {MAX_JSON_INDENT}")
    encoder = json.JSONEncoder(
        indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys
    )
    if indent is None:  # no indentation: the text is a small multiple of the value's size
        return encoder.encode(value)
    pieces, total = [], 0  # indentation grows with depth: stop as soon as it is too long
    for piece in encoder.iterencode(value):
        total += len(piece)
        if total > MAX_CHARS:
            raise BudgetExceeded(f"tojson output is over the {MAX_CHARS // 2**20} MiB limit")
        pieces.append(piece)
    return "".join(pieces)


def _raise_exception(message: str):
    raise TemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    if len(str(fmt)) > 256:
        raise BudgetExceeded("strftime_now: the format is too long")
    return datetime.now().strftime(fmt)


def _prechecks(name: str, value: Any, args: tuple, kwargs: dict) -> Any:
    """The filters whose output can dwarf their input, checked before they run; returns the
    value (an iterator to join comes back as a list: counting it consumed it)."""
    if name in WIDTH_FILTERS:
        check_widths(args, kwargs)
    if name == "join":
        value = value if isinstance(value, list | tuple) else list(value)
        check_join(str(args[0] if args else kwargs.get("d", "")), value)
    elif name == "replace" and len(args) >= 2:
        count = args[2] if len(args) > 2 else kwargs.get("count")
        check_replace(str(value), str(args[0]), str(args[1]), -1 if count is None else count)
    elif name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        lines = str(value).count("\n") + 1
        if lines * (len(width) if isinstance(width, str) else width) > MAX_CHARS:
            raise BudgetExceeded("indent: the indented text is over the size limit")
    elif name == "format":
        check_printf(str(value), args or tuple(kwargs.values()))
    elif name == "wordwrap":
        wrap = args[2] if len(args) > 2 else kwargs.get("wrapstring") or "\n"
        if len(str(value)) * (len(str(wrap)) + 1) > MAX_CHARS:
            raise BudgetExceeded("wordwrap: the wrapped text is over the size limit")
    return value


def budgeted_filter(name: str, fn):
    """`fn` under the budget: a step, number and size checks before, a size check after."""
    # a filter marked pass_context / pass_eval_context gets jinja's argument before the value
    first = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(fn)  # keeps those marks
    def guarded(*args, **kwargs):
        _active().step()
        value = _prechecks(name, args[first], args[first + 1 :], kwargs)
        out = fn(*args[:first], value, *args[first + 1 :], **kwargs)
        return check_size(out, f"the result of |{name}")

    return guarded


# -- the environment ---------------------------------------------------------------------------


def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BudgetedEnvironment(ImmutableSandboxedEnvironment):
        # jinja2 routes these operators through call_binop and never constant-folds them
        intercepted_binops = frozenset({"**", "*", "+", "%"})

        def call_binop(self, context, operator, left, right):
            _active().step()
            check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's names)
            if id(__obj) in HOOK_IDS:  # our own; they count their own steps
                return __obj(*args)
            budget = _active()
            budget.step()
            args = check_str_method(__obj, args, kwargs)
            budget.depth += 1
            try:
                if budget.depth > MAX_DEPTH:
                    raise BudgetExceeded(f"calls nest deeper than {MAX_DEPTH}")
                result = super().call(__context, __obj, *args, **kwargs)
            finally:
                budget.depth -= 1
            return check_size(result, "a call's result")

    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters = {name: budgeted_filter(name, fn) for name, fn in env.filters.items()}
    env.filters["tojson"] = budgeted_filter("tojson", _tojson)
    env.globals.pop("lipsum", None)  # generates any amount of text; no chat template uses it
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals.update({HOOK_PREFIX + fn.__name__.strip("_"): fn for fn in HOOKS})
    return env


# -- the hooks added to a parsed template ------------------------------------------------------

HOOK_PREFIX = "__atlas_"


def _iterate(items):
    budget = _active()
    for item in items:
        budget.step()
        yield item


def _concat(*parts) -> str:
    check_join("", parts)
    return "".join(map(str, parts))


def _emit(value) -> str:
    budget = _active()
    text = value if isinstance(value, str) else str(check_size(value))
    budget.written += len(text)
    if budget.written > MAX_WRITTEN:
        raise BudgetExceeded(f"wrote over {MAX_WRITTEN // 2**20} MiB")
    return text


HOOKS = (_iterate, _concat, _emit)
HOOK_IDS = frozenset(map(id, HOOKS))


def add_hooks(tree) -> None:
    """Route every loop, `~` and write of a parsed template through the budget hooks; refuse
    `include`, `import` and `extends` and names that would shadow the hooks."""
    from jinja2 import nodes

    def hook(name: str, *args) -> Any:
        return nodes.Call(nodes.Name(HOOK_PREFIX + name, "load"), list(args), [], None, None)

    for node in tree.find_all(nodes.Name):
        if node.name.startswith(HOOK_PREFIX):
            raise TemplateError(f"names starting with {HOOK_PREFIX!r} are reserved")
    for kind, tag in (*REFUSED_TAGS.items(), ("Extends", "extends")):
        if any(True for _ in tree.find_all(getattr(nodes, kind))):
            raise TemplateError(f"{{% {tag} %}} is not allowed: a chat template is one file")
    for loop in list(tree.find_all(nodes.For)):
        loop.iter = hook("iterate", loop.iter)
    for concat in list(tree.find_all(nodes.Concat)):
        concat.nodes = [hook("concat", *concat.nodes)]
    for output in list(tree.find_all(nodes.Output)):
        output.nodes = [
            hook("emit", nodes.Const(n.data) if isinstance(n, nodes.TemplateData) else n)
            for n in output.nodes
        ]


# -- compile and render ------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def environment():
    return _environment()


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    from jinja2 import TemplateSyntaxError

    env = environment()
    try:
        tree = env.parse(source)
    except TemplateSyntaxError as exc:
        raise TemplateError(f"syntax error: {one_line(exc)}") from None
    add_hooks(tree)
    return env.from_string(tree)


def one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render_template(source: str, /, *, template_name: str = "chat template", **context: Any) -> str:
    """Render `source` with `context` under the budget. Every failure is a TemplateError whose
    one-line message names the template."""
    name = template_name
    try:
        return _render(source, context)
    except TemplateError as exc:
        raise type(exc)(f"{name}: {one_line(exc)}") from None


def _render(source: str, context: dict[str, Any]) -> str:
    from jinja2 import TemplateError as JinjaError
    from jinja2.exceptions import SecurityError

    template = compile_template(source)
    token = _BUDGET.set(Budget(deadline=time.monotonic() + MAX_SECONDS))
    try:
        text = "".join(template.generate(**context))
    except TemplateError:
        raise
    except SecurityError as exc:
        raise TemplateError(f"unsafe operation refused: {one_line(exc)}") from None
    except JinjaError as exc:
        raise TemplateError(f"render failed: {one_line(exc)}") from None
    except RecursionError:
        raise BudgetExceeded("nests too deep") from None
    except MemoryError:
        raise BudgetExceeded("ran out of memory") from None
    except Exception as exc:  # a template fed data it does not expect (e.g. None + str)
        raise TemplateError(f"render failed: {type(exc).__name__}: {one_line(exc)}") from None
    finally:
        _BUDGET.reset(token)
    return check_size(text, "the rendered prompt")
