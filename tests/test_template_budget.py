"""Chat templates are untrusted: hostile ones end in a one-line TemplateError, fast, and the
budget leaves ordinary templates alone."""

from __future__ import annotations

import time

import pytest

from atlas_cli.backend.chat_template import MAX_CHARS, render_template
from atlas_cli.errors import TemplateError

LOOP = "{% for i in range(100000) %}"
DOUBLING = "{% set ns = namespace(s='xy') %}{% for i in range(64) %}"

# Each one hangs, allocates gigabytes, aborts, escapes or gives a traceback without a budget.
HOSTILE = {
    "huge power": "{{ 10**10000000 }}",
    "power chain": "{% set ns = namespace(x=2) %}" + LOOP + "{% set ns.x = ns.x * ns.x %}"
    "{% endfor %}",
    "float power": "{{ 10.0 ** 100000 }}",
    "tojson indent": "{{ messages | tojson(indent=100000000) }}",
    "tojson separators": "{{ [1, 2] | tojson(separators=('x' * 100000000, ':')) }}",
    "string repeat": "{{ 'a' * 10000000000 }}",
    "list repeat": "{{ ['a'] * 10000000000 }}",
    "list of big": "{{ (['a' * 1000000] * 1000) | join }}",
    "concat doubling": DOUBLING + "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "plus doubling": DOUBLING + "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "list doubling": "{% set ns = namespace(s=[1]) %}{% for i in range(64) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
    "block set doubling": DOUBLING
    + "{% set b %}{{ ns.s }}{{ ns.s }}{% endset %}{% set ns.s = b %}{% endfor %}",
    "nested loops": LOOP + LOOP + "{% endfor %}{% endfor %}",
    "triple loops": LOOP + LOOP + LOOP + "x{% endfor %}{% endfor %}{% endfor %}",
    "loop over a string": "{% set s = 'a' * 1000000 %}{% for a in s %}{% for b in s %}"
    "{% endfor %}{% endfor %}",
    "output flood": LOOP + LOOP + "{{ 'x' * 1000 }}{% endfor %}{% endfor %}",
    "captured flood": "{% set b %}" + LOOP + "{{ 'x' * 100000 }}{% endfor %}{% endset %}",
    "macro recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "macro fork bomb": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
    "{% endmacro %}{{ f(60) }}",
    "macro doubling": "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s }}"
    "{% endif %}{% endmacro %}{{ d('ab', 64) }}",
    "recursive loop": "{% for m in [[1]] recursive %}{{ loop([[1]]) }}{% endfor %}",
    "block recursion": "{% block b %}{{ self.b() }}{% endblock %}",
    "caller recursion": "{% macro m() %}{{ caller() }}{% endmacro %}"
    "{% macro r() %}{% call m() %}{{ r() }}{% endcall %}{% endmacro %}{{ r() }}",
    "range huge": "{{ range(10**12) | list }}",
    "ljust": "{{ 'a'.ljust(10**10) }}",
    "center filter": "{{ 'a' | center(10**10) }}",
    "indent filter": "{{ ('a\\n' * 1000000) | indent(1000) }}",
    "printf width": "{{ '%0100000000d' % 1 }}",
    "printf star": "{{ '%*d' % (100000000, 1) }}",
    "format filter": "{{ '%.100000000f' | format(1.0) }}",
    "str.format width": "{{ '{:>100000000}'.format(1) }}",
    "str.format repeat": "{{ ('{0}' * 1000).format('x' * 100000) }}",
    "printf mapping": "{{ ('%(a)s' * 1000) % {'a': 'x' * 100000} }}",
    "replace empty": "{{ ('a' * 10000) | replace('', 'b' * 10000) }}",
    "str.replace": "{{ ('a' * 10000).replace('a', 'b' * 10000) }}",
    "str.join": "{{ ('x' * 1000000).join(['a'] * 1000) }}",
    "join separator": "{{ range(100000) | join('x' * 10000) }}",
    "expandtabs": "{{ ('\\t' * 100000).expandtabs(100000) }}",
    "wordwrap": "{{ ('a ' * 5000000) | wordwrap(1, wrapstring='x' * 1000) }}",
    "slice": "{{ 'ab' | slice(100000000) | list }}",
    "include": "{% include 'other.jinja' %}",
    "import": "{% import 'macros.jinja' as m %}",
    "from import": "{% from 'macros.jinja' import m %}",
    "extends": "{% extends 'base.jinja' %}",
    "type error": "{{ 1 + 'a' }}",
    "none plus str": "{{ messages[0].content + 1 }}",
    "undefined call": "{{ nothing() }}",
    "class escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals escape": "{{ raise_exception.__globals__['os'] }}",
    "mutation": "{% set x = messages.append(1) %}",
    "hook shadowing": "{% set __atlas_iterate = range %}{% for i in range(3) %}{% endfor %}",
    "strftime flood": "{{ strftime_now('%Y' * 1000000) }}",
    "deep nesting": "{% set ns = namespace(l=[]) %}" + LOOP + "{% set ns.l = [ns.l] %}"
    "{% endfor %}{{ ns.l | tojson }}",
    "syntax": "{% for m in messages %}",
    "unknown tag": "{% do messages %}",
    "raise": "{{ raise_exception('roles must alternate') }}",
    "lipsum": "{{ lipsum(n=100000000) }}",
    "dict repr flood": "{{ ({'a': 'x' * 1000000} | dictsort) * 100 }}",
    "zfill": "{{ '1'.zfill(10**10) }}",
}


@pytest.mark.parametrize("source", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_template_ends_in_a_clean_error(source):
    start = time.perf_counter()
    with pytest.raises(TemplateError) as info:
        render_template(
            source,
            template_name="chat template (evil.jinja)",
            messages=[{"role": "user", "content": None}],
        )
    elapsed = time.perf_counter() - start
    message = str(info.value)
    assert message.startswith("chat template (evil.jinja): ")
    assert "\n" not in message and len(message) < 400
    assert elapsed < 5.0, f"took {elapsed:.1f} s"


def test_limits_name_what_ran_out():
    def error(source: str) -> str:
        with pytest.raises(TemplateError) as info:
            render_template(source, messages=[])
        return str(info.value)

    assert "4096-bit" in error(HOSTILE["huge power"])
    assert "width or precision" in error(HOSTILE["str.format width"])
    assert "steps" in error(HOSTILE["nested loops"]) or " s" in error(HOSTILE["nested loops"])
    assert "deeper than 64" in error(HOSTILE["macro recursion"])
    assert "{% include %} is not allowed" in error(HOSTILE["include"])
    assert "tojson indent" in error(HOSTILE["tojson indent"])
    assert error(HOSTILE["raise"]) == "chat template: roles must alternate"


def test_budget_allows_big_ordinary_prompts():
    """A long conversation of long messages, tools JSON and a bit of everything the real
    templates use renders unchanged."""
    source = (
        "{% if tools %}{{ tools | tojson(indent=2) }}\n{% endif %}"
        "{% for m in messages %}{% if loop.first and m.role == 'system' %}[S]{% endif %}"
        "<|{{ m.role }}|>{{ m.content | trim }}{{ '\\n' if not loop.last }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    content = "word " * 200_000  # 1 MB
    messages = [{"role": "user" if i % 2 else "assistant", "content": content} for i in range(6)]
    messages += [{"role": "user", "content": f"q{i}"} for i in range(5000)]
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {}}} for i in range(50)
    ]
    start = time.perf_counter()
    out = render_template(source, messages=messages, tools=tools, add_generation_prompt=True)
    assert time.perf_counter() - start < 2.0
    assert out.count("<|user|>") == 5003 and out.endswith("q4999<|assistant|>")
    assert out.startswith('[\n  {\n    "type": "function"')
    assert len(out) < MAX_CHARS


def test_numbers_and_formats_that_fit_still_work():
    out = render_template(
        "{{ 2**64 }} {{ '%05d' % 42 }} {{ '{:>4}'.format('ab') }} {{ 'ab' | center(6) }}"
        "{{ (['x'] * 3) | join('-') }} {{ 'a-b'.replace('-', '+') }} {{ 10**12 }}",
        messages=[],
    )
    assert out == "18446744073709551616 00042   ab   ab  x-x-x a+b 1000000000000"
