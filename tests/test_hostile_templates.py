"""Hostile chat templates: every rendering ends within its time bound, inside a memory bound, with the engine's own
``ChatTemplateError`` or a result (issue: hardening).

The cases the issue names are rendered here one by one with the real limits; the fuzz (200 templates made from loops,
string multiplication, recursion, format strings, padding filters, concatenation and growth through ``namespace``)
runs in a child interpreter, so that its peak memory is measured on its own, with the time limit lowered to keep the
suite fast (the check is the same code).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from mlx_engine.errors import ChatTemplateError, InvalidRequestError
from mlx_engine.models.text import template_sandbox
from mlx_engine.models.text.chat_template import render_chat_template

MESSAGES = [{"role": "user", "content": "hi"}]

ISSUE_CASES = {
    "nested loops with output": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "nested loops without output": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested loops over a list": "{% set l = range(100000)|list %}{% for a in l %}{% for b in l %}{% endfor %}"
                                "{% endfor %}",
    "a format width from an argument": "{{ '%*d' % (2000000000, 1) }}",
    "a huge format width": "{{ '%2000000000d' % 1 }}",
    "a huge str.format width": "{{ '{:>2000000000}'.format(1) }}",
    "string times 10**10": "{{ 'x' * 10**10 }}",
    "list times 10**8": "{{ ['a'] * 10**8 }}",
    "range(10**10)": "{{ range(10**10) }}",
    "a recursive macro": "{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}",
    "doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s | length }}",
    "doubling with +": "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
                       "{% endfor %}{{ ns.s | length }}",
    "center filter": "{{ 'x' | center(10**10) }}",
    "str.center": "{{ 'x'.center(10**10) }}",
    "a set block that grows": "{% set s = 'x' * 1000000 %}{% set b %}{% for i in range(100000) %}{{ s }}{% endfor %}"
                              "{% endset %}{{ b | length }}",
    "join with a long separator": "{% set s = 'x' * 1000000 %}{{ range(100000) | map('string') | join(s) }}",
    "replace that grows": "{{ ('x' * 1000000) | replace('x', 'yyyyyyyyyy') }}",
    "format filter width": "{{ '%2000000000d' | format(1) }}",
    "a huge power": "{{ 7 ** 100000 }}",
    "an escape": "{{ messages.__class__.__mro__ }}",
}


@pytest.mark.parametrize("name", sorted(ISSUE_CASES))
def test_the_issue_cases_end_with_a_chat_template_error(name):
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError) as e:
        render_chat_template(ISSUE_CASES[name], MESSAGES)
    took = time.perf_counter() - t0
    assert took < template_sandbox.TIME_LIMIT_S + 1.0, f"{name}: {took:.2f} s"
    message = str(e.value)
    assert "chat template" in message
    if "loop" in name:
        assert f"more than {template_sandbox.TIME_LIMIT_S:g} s" in message


def test_limits_leave_real_templates_alone():
    # a long conversation: the size limit grows with it
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 50_000} for i in range(21)]
    out = render_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}{{ 'ab' * 1000 }}", long)
    assert len(out) == 21 * 250_000 + 2000
    assert render_chat_template("{{ '%5.2f|%-4d|' % (3.14159, 7) }}{{ '{:>6}'.format('x') }}", MESSAGES) \
        == " 3.14|7   |     x"
    assert render_chat_template("{{ 'ab' | center(6) }}|{{ messages | map(attribute='role') | join(',') }}",
                                MESSAGES) == "  ab  |user"


def test_a_template_error_is_an_invalid_request_naming_the_model(smollm2_model):
    model = smollm2_model
    saved = model.tokenizer._chat_template
    try:
        model.tokenizer._chat_template = "{{ 'x' * 10**10 }}"
        with pytest.raises(InvalidRequestError) as e:
            model.chat_tokens(MESSAGES)
        assert model.name in str(e.value) and "limit is" in str(e.value)
    finally:
        model.tokenizer._chat_template = saved
    assert model.chat_tokens(MESSAGES)


FUZZ_CHILD = r"""
import json, random, resource, sys, time
from mlx_engine.errors import ChatTemplateError
from mlx_engine.models.text import template_sandbox
from mlx_engine.models.text.chat_template import render_chat_template

template_sandbox.TIME_LIMIT_S = float(sys.argv[3])
rng = random.Random(int(sys.argv[1]))
N = lambda: rng.choice([1, 3, 100, 1000, 10**5, 10**6, 2**31, 10**10])
BODIES = [
    lambda: "x", lambda: "{{ ns.s }}", lambda: "{% set ns.s = ns.s ~ ns.s %}", lambda: "{% set ns.s = ns.s + ns.s %}",
    lambda: "{{ 'ab' * %d }}" % N(), lambda: "{{ [ns.s] * %d }}" % N(), lambda: "{{ '%%%dd' %% 1 }}" % N(),
    lambda: "{{ '%%*d' %% (%d, 1) }}" % N(), lambda: "{{ '{:>%d}'.format(1) }}" % N(),
    lambda: "{{ m(%d) }}" % rng.choice([1, 10, 10**4]), lambda: "{{ ns.s | center(%d) }}" % N(),
    lambda: "{{ ns.s | indent(%d) }}" % N(), lambda: "{{ ns.s.ljust(%d) }}" % N(), lambda: "{{ 3 ** %d }}" % N(),
    lambda: "{{ range(%d) | join(ns.s) }}" % N(), lambda: "{{ ns.s.replace('a', ns.s) }}",
    lambda: "{{ messages[0].content * %d }}" % N(), lambda: "{{ raise_exception('no') }}",
    lambda: "{{ ns.__class__ }}", lambda: "{{ '%%d' | format(%d) }}" % N(),
    lambda: "{{ (ns.s * 2) | wordwrap(%d) }}" % N(),
    lambda: "{% set b %}{{ ns.s }}{{ ns.s }}{% endset %}{% set ns.s = b %}",
]

def body(depth):
    parts = []
    for _ in range(rng.randint(1, 3)):
        if depth < 3 and rng.random() < 0.4:
            parts.append("{%% for i%d in range(%d) %%}%s{%% endfor %%}" % (depth, rng.choice([2, 30, 1000, 10**5]),
                                                                          body(depth + 1)))
        else:
            parts.append(rng.choice(BODIES)())
    return "".join(parts)

results = []
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for i in range(int(sys.argv[2])):
    src = "{% set ns = namespace(s='ab') %}{% macro m(n) %}{{ m(n - 1) if n > 0 else 'end' }}{% endmacro %}" + body(0)
    t0 = time.perf_counter()
    try:
        out = render_chat_template(src, [{"role": "user", "content": "hello"}])
        outcome = "result"
    except ChatTemplateError as e:
        outcome = "ChatTemplateError"
    except BaseException as e:
        outcome = f"{type(e).__name__}: {e}"[:300]
    results.append({"template": src[:400], "outcome": outcome, "seconds": time.perf_counter() - t0})
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"results": results, "base_kb": base, "peak_kb": peak}))
"""


def test_template_fuzz_every_rendering_is_bounded():
    limit = 0.2
    proc = subprocess.run([sys.executable, "-c", FUZZ_CHILD, "1", "200", str(limit)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    results = report["results"]
    assert len(results) == 200
    raw = [r for r in results if r["outcome"] not in ("result", "ChatTemplateError")]
    assert not raw, raw[:3]
    slow = [r for r in results if r["seconds"] > limit + 1.0]
    assert not slow, slow[:3]
    kinds = {r["outcome"] for r in results}
    assert kinds == {"result", "ChatTemplateError"}, kinds  # the fuzz reaches both outcomes
    grown_mb = (report["peak_kb"] - report["base_kb"]) / 1024
    assert grown_mb < 512, f"the renderings took {grown_mb:.0f} MB"
