"""Chat-template rendering is bounded in output size and time, and whatever goes wrong
while rendering is a ChatTemplateError (a 400 from the server), not a crash."""

from __future__ import annotations

import json
import sys
import threading
import time
import tracemalloc

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pyagent_framework import chat_templates
from pyagent_framework.chat_templates import ChatTemplateError, render_chat_template

MESSAGES = [{"role": "user", "content": "Hi"}]
MAX_PEAK = 100 * 2**20  # bytes

# Templates that would build a huge value: each must stop on a size check, early.
SIZE_ATTACKS = {
    "str repeat": "{{ 'a' * 10**9 }}",
    "str repeat, literal": "{{ 'a' * 1000000000 }}",
    "list repeat": "{{ 'x'|list * 10**9 }}",
    "tuple repeat": "{{ (1, 2) * 10**9 }}",
    "~ doubling": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "+ doubling": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "list + doubling": "{% set ns = namespace(s=['ab']) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    # Small in memory (each level holds the last one twice), 2**60 'ab's once printed.
    "nested lists": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = [ns.s, ns.s] %}{% endfor %}{{ ns.s|length }}",
    "nested dicts": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = dict(a=ns.s, b=ns.s) %}{% endfor %}{{ ns.s|length }}",
    "macro varargs": "{% macro m() %}{{ varargs|length }}{% endmacro %}{% set s = 'x' * 3000000 %}{{ m(s, s) }}",
    "join": "{{ range(100000)|map('string')|join('x' * 100000) }}",
    "join of big items": "{% set s = 'x' * 4000000 %}{{ [s, s, s]|join }}",
    "replace": "{{ ('a' * 100000)|replace('a', 'b' * 100000) }}",
    "replace empty": "{% set s = 'x' * 3000 %}{{ s|replace('', s) }}",
    "center": "{{ 'a'|center(10**9) }}",
    "center, literal": "{{ 'a'|center(1000000000) }}",
    "indent": "{{ 'a\na\na'|indent(10**9) }}",
    "wordwrap": "{{ ('a ' * 100000)|wordwrap(1, wrapstring='x' * 1000) }}",
    "format filter, * width": "{{ '%*d'|format(10**9, 1) }}",
    "format filter, width": "{{ '%01000000000d'|format(1) }}",
    "% width": "{{ '%*d' % (10**9, 1) }}",
    "% precision": "{{ '%.1000000000f' % 1.0 }}",
    "% mapping": "{% set s = 'x' * 1000000 %}{{ ('%(a)s' * 100) % {'a': s} }}",
    "str.format width": "{{ '{:>1000000000}'.format(1) }}",
    "str.format nested width": "{{ '{:>{w}}'.format(1, w=10**9) }}",
    "str.format fields": "{% set s = 'x' * 1000000 %}{{ ('{0}' * 100).format(s) }}",
    "str.ljust": "{{ 'a'.ljust(10**9) }}",
    "str.zfill": "{{ '1'.zfill(10**9) }}",
    "str.expandtabs": "{{ ('\t' * 100000).expandtabs(100000) }}",
    "str.join": "{% set s = 'x' * 100000 %}{{ s.join(range(100000)|map('string')) }}",
    "str.replace": "{% set s = 'x' * 3000 %}{{ s.replace('', s) }}",
    "str.translate": "{{ ('a' * 100000).translate({97: 'b' * 100000}) }}",
    "int.to_bytes": "{{ (1).to_bytes(10**9, 'big') }}",
    "batch fill": "{{ [1]|batch(10**9, 'x') }}",
    "slice": "{{ [1]|slice(10**8) }}",
    "sum of lists": "{{ ([[1]] * 60000)|sum(start=[]) }}",
    "tojson indent": "{% set ns = namespace(l=[1]) %}{% for i in range(500) %}{% set ns.l = [ns.l] %}{% endfor %}{{ ns.l|tojson(indent=100000) }}",
    "urlencode": "{{ ('\U0001f600' * 1000000)|urlencode }}",
    "strftime": "{{ strftime_now('%c' * 1000000) }}",
    "dict.fromkeys": "{% set s = 'x' * 1000000 %}{{ {}.fromkeys(range(100000), s)|length }}",
    "output": "{% for i in range(99999) %}{% for j in range(99999) %}abcdefgh{% endfor %}{% endfor %}",
    "set block": "{% set x %}{% for i in range(99999) %}{% for j in range(99999) %}abcdefgh{% endfor %}{% endfor %}{% endset %}",
}

# Integers: `**` is left-associative in Jinja, so 10**10**10 is (10**10)**10 = 10**100,
# harmless; the parenthesized one is not.
NUMBER_ATTACKS = {
    "power": "{{ 10 ** (10 ** 10) }}",
    "big power": "{{ 2 ** 100000000 }}",
    "squaring": "{% set ns = namespace(x=10**100) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x > 0 }}",
}

# Templates that would run for ever, most of them writing nothing.
TIME_ATTACKS = {
    "nested loops": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "range|list in a loop": "{% for i in range(100000) %}{% set l = range(10**5)|list %}{% endfor %}",
    "big values in a loop": "{% for i in range(100000) %}{% for j in range(100000) %}{% set s = 'a' * 4000000 %}{% endfor %}{% endfor %}",
    "macro tree": "{% macro a(n) %}{% if n %}{{ a(n - 1) }}{{ a(n - 1) }}{% endif %}{% endmacro %}{{ a(60) }}",
    "silent macro tree": "{% macro a(n) %}{% if n %}{% set x = a(n - 1) %}{% set y = a(n - 1) %}{% endif %}{% endmacro %}{{ a(60) }}",
    "recursive loop": "{% for x in [1, 1] recursive %}{% if loop.depth < 60 %}{{ loop([1, 1]) }}{% endif %}{% endfor %}",
}

# Whatever Python or the sandbox raises comes back as a ChatTemplateError naming it.
ERRORS = {
    "{% for i in range(10**9) %}{% endfor %}": "OverflowError",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}": "RecursionError",
    "{{ 1 / 0 }}": "ZeroDivisionError",
    "{{ ''.__class__.__mro__ }}": "unsafe",
    "{{ cycler.__init__.__globals__ }}": "unsafe",
    "{{ 'x' + 1 }}": "TypeError",
    "{{ 2 ** 16000 }}": "ValueError",  # more digits than Python prints
    "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}": "does not compile",
}


def _render_timed(source: str, **kwargs) -> tuple[ChatTemplateError, float]:
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError) as info:
        render_chat_template(source, MESSAGES, **kwargs)
    return info.value, time.perf_counter() - start


def _peak_bytes(source: str, **kwargs) -> int:
    tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateError):
            render_chat_template(source, MESSAGES, **kwargs)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("source", SIZE_ATTACKS.values(), ids=SIZE_ATTACKS.keys())
def test_size_attacks_stop_early_and_small(source):
    error, elapsed = _render_timed(source)
    assert f"exceeds {chat_templates.MAX_OUTPUT_CHARS} characters" in str(error)
    assert elapsed < chat_templates.RENDER_TIMEOUT
    assert _peak_bytes(source) < MAX_PEAK


@pytest.mark.parametrize("source", NUMBER_ATTACKS.values(), ids=NUMBER_ATTACKS.keys())
def test_huge_integers_are_refused(source):
    error, elapsed = _render_timed(source)
    assert f"exceeds {chat_templates.MAX_INT_BITS} bits" in str(error)
    assert elapsed < 1


def test_namespaces_print_without_their_contents():
    # A namespace is the one mutable thing: here each holds the last one twice.
    source = (
        "{% set ns = namespace(cur=namespace(x='aaaa')) %}{% for i in range(60) %}{% set n = namespace() %}"
        "{% set n.a = ns.cur %}{% set n.b = ns.cur %}{% set ns.cur = n %}{% endfor %}"
        "{{ ns.cur }} {{ ns.cur|string }} {{ '%s' % ns.cur }} {{ [ns.cur] }} {{ ns.cur.a is sameas ns.cur.b }}"
    )
    assert render_chat_template(source, MESSAGES) == "<Namespace> <Namespace> <Namespace> [<Namespace>] True"


def test_left_associative_power_is_harmless():
    assert render_chat_template("{{ 10**10**10 }}", MESSAGES) == str(10**100)


@pytest.mark.parametrize("source", TIME_ATTACKS.values(), ids=TIME_ATTACKS.keys())
def test_time_attacks_stop_at_the_timeout(source):
    error, elapsed = _render_timed(source, timeout=0.3)
    assert "took longer than 0.3 s to render" in str(error)
    assert elapsed < 0.3 + 1


def test_the_default_timeout_applies():
    error, elapsed = _render_timed(TIME_ATTACKS["nested loops"])
    assert f"took longer than {chat_templates.RENDER_TIMEOUT:g} s to render" in str(error)
    assert chat_templates.RENDER_TIMEOUT <= elapsed < chat_templates.RENDER_TIMEOUT + 1


@pytest.mark.parametrize("source, name", ERRORS.items(), ids=ERRORS.values())
def test_every_error_is_a_chat_template_error(source, name):
    error, elapsed = _render_timed(source)
    assert name in str(error)
    assert elapsed < 1


def test_the_limits_are_named_and_can_be_set():
    with pytest.raises(ChatTemplateError, match="^chat template output exceeds 100 characters$"):
        render_chat_template("{% for i in range(20) %}0123456789{% endfor %}", MESSAGES, max_output_chars=100)
    with pytest.raises(ChatTemplateError, match="chat template value exceeds 100 characters"):
        render_chat_template("{{ ('x' * 101)|length }}", MESSAGES, max_output_chars=100)
    with pytest.raises(ChatTemplateError, match="^chat template took longer than 0.1 s to render$"):
        render_chat_template(TIME_ATTACKS["nested loops"], MESSAGES, timeout=0.1)
    assert render_chat_template("{% for i in range(10) %}0123456789{% endfor %}", MESSAGES, max_output_chars=100) == "0123456789" * 10


def test_module_constants_are_the_defaults(monkeypatch):
    monkeypatch.setattr(chat_templates, "MAX_OUTPUT_CHARS", 50)
    with pytest.raises(ChatTemplateError, match="exceeds 50 characters"):
        render_chat_template("{{ 'x' * 51 }}", MESSAGES)
    assert render_chat_template("{{ 'x' * 51 }}", MESSAGES, max_output_chars=51) == "x" * 51


def test_a_long_conversation_still_renders():
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i} " + "word " * 200} for i in range(2000)]
    text = render_chat_template(chat_templates.templates_dir().joinpath("chat", "chatml.jinja").read_text(), messages)
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"
    assert text == expected and len(text) > 2 * 10**6


def test_rendering_after_an_attack_is_unaffected():
    before = sys.gettrace()
    for source, kwargs in ((SIZE_ATTACKS["~ doubling"], {"max_output_chars": 1000}), (TIME_ATTACKS["nested loops"], {"timeout": 0.1})):
        with pytest.raises(ChatTemplateError):
            render_chat_template(source, MESSAGES, **kwargs)
        assert sys.gettrace() is before
        assert chat_templates._limits.get() is None
        assert render_chat_template("{{ 'x' * 5000 }}{% for i in range(3) %}{{ i }}{% endfor %}", MESSAGES) == "x" * 5000 + "012"


def test_limits_are_per_render_across_threads():
    results = {}

    def slow():
        try:
            render_chat_template(TIME_ATTACKS["nested loops"], MESSAGES, timeout=0.5, max_output_chars=100)
        except ChatTemplateError as exc:
            results["slow"] = str(exc)

    thread = threading.Thread(target=slow)
    thread.start()
    for _ in range(50):  # meanwhile, renders with the default limits are unaffected
        assert render_chat_template("{{ 'x' * 1000 }}", MESSAGES) == "x" * 1000
    thread.join()
    assert "took longer than 0.5 s" in results["slow"]


# Features chat templates use must render exactly as in Jinja's plain sandbox.
SAME_AS_JINJA = [
    "{% for m in messages %}{{ loop.index }}{{ m.role }}{% if not loop.last %}, {% endif %}{% endfor %}",
    "{% for m in messages if m.role == 'user' %}{{ m.content|trim }}{% else %}none{% endfor %}",
    "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.content }}{% break %}{% endfor %}",
    "{% for k, v in {'a': 1, 'b': [2, 3]}|dictsort %}{{ k }}={{ v }};{% endfor %}",
    "{% for x in [1, [2, [3]]] recursive %}{% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}{% endif %}{% endfor %}",
    "{% macro say(who, greeting='hi') %}{{ greeting ~ ' ' ~ who }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ say('you', 'yo', 1, x=2) }}",
    "{% macro box() %}[{{ caller() }}]{% endmacro %}{% call box() %}inside {{ messages|length }}{% endcall %}",
    "{% set block %}{% for m in messages %}{{ m.role }} {% endfor %}{% endset %}{{ block|upper }}",
    "{% filter upper %}{% for m in messages %}{{ m.content }}{% endfor %}{% endfilter %}",
    "{% set ns = namespace(n=0, seen=[]) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% set ns.seen = ns.seen + [m.role] %}{% endfor %}{{ ns.n }} {{ ns.seen }}",
    "{{ messages|map(attribute='role')|join(', ') }} {{ messages|selectattr('role', 'eq', 'user')|list|length }}",
    "{{ tools|tojson }} {{ tools|tojson(indent=2) }} {{ tools[0]|tojson(indent='\t')|indent(4, first=true) }}",
    "{{ 'ab' * 3 }} {{ [1] * 2 }} {{ 2 ** 10 }} {{ 7 % 3 }} {{ '%s-%05.1f' % ('x', 2.5) }} {{ '%(a)s' % {'a': 1} }}",
    "{{ '{} {:>5} {x}'.format(1, 'b', x=3) }} {{ '{a}'.format_map({'a': 4}) }} {{ '%d items'|format(3) }}",
    "{{ 'abc'|center(9) }}|{{ 'a b c d'|wordwrap(3) }}|{{ 'aXbX'|replace('X', '--') }}|{{ 'long text'|truncate(7, true, '') }}",
    "{{ [1, 2, 3, 4, 5]|batch(2, 0)|list }} {{ [1, 2, 3, 4, 5]|slice(2)|list }} {{ [[1], [2]]|sum(start=[]) }} {{ 'abc'|list }}",
    "{{ 'a,b'.split(',') }} {{ ' x '.strip() }} {{ 'x'.ljust(3) ~ '|' }} {{ '-'.join(['a', 'b']) }} {{ 'ab'.replace('a', 'c') }}",
    "{{ (1, 'a') }} {{ [messages[0].role, {'k': messages[0].content}] }} {{ {'a': [1, 2]}['a'] }}",
    "{{ bos_token }}{{ messages[0]['content'] + eos_token }}{% if add_generation_prompt %}<gen>{% endif %}",
    "{{ raise_exception is defined }} {{ x is undefined }} {{ 'a' ~ none ~ 1 }} {{ messages[0].nope|default('d') }}",
    "{% for m in messages if (m.role + '!') != 'system!' %}{{ loop.index ~ m.role + '/' + loop.cycle('a', 'b') }}{% endfor %}",
    "{% macro m(a, b=messages[0].role + '?') %}{{ a + b }}{% endmacro %}{{ m('x') }}{% with y = 'w' + 'z' %}{{ m(y, y + y) }}{% endwith %}",
    "{% set a, b = messages[0].role + '1', [messages[1].role] + ['2'] %}{{ a }}{{ b }}{{ (a + 'x') if b else 'n' }}",
    "{% macro row(x) %}<{{ caller(x + 1) }}>{% endmacro %}{% call(v) row(1) %}{{ v + 1 }}{% endcall %}",
    "{% block b %}{{ messages[0].role + '-block' }}{% for m in messages %}{{ m.role }}{% endfor %}{% endblock %}",
]


def _plain_jinja(source: str, **variables) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = lambda message: None
    return env.from_string(source).render(**variables)


@pytest.mark.parametrize("source", SAME_AS_JINJA)
def test_templates_render_as_in_plain_jinja(source):
    variables = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}],
        "add_generation_prompt": True,
        "bos_token": "<s>",
        "eos_token": "</s>",
    }
    expected = _plain_jinja(source, **variables)
    assert render_chat_template(source, **variables) == expected
