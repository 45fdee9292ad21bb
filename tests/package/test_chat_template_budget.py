"""The chat template's render budget and the check export, inspect and run share
(flare/package/chat_template.py)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from flare.package.chat_template import (
    RENDER_SECONDS,
    ChatTemplateError,
    ChatTemplateLimit,
    check_chat_template,
    compile_chat_template,
    render_within_budget,
)

PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
CONTEXT = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}


@pytest.mark.parametrize(
    ("template", "why"),
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "within"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed"),
        ("{% for i in range(100000) %}{{ 'x' * 5000 }}{% endfor %}", "more than"),
        ("{{ 'x' * 470000000 }}", "builds a value"),
        ("{{ 10 ** 100000000 }}", "power"),
        ("{% set ns = namespace(n=0) %}{% for i in range(100000) %}{% for j in range(100000) %}"
         "{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}", "within"),
    ],
    ids=["loop", "recursion", "output", "repeat", "power", "loop-with-set"],
)
def test_a_template_past_its_budget_ends_with_a_limit_error(template: str, why: str) -> None:
    # A looping render and the check each run out the whole budget; each render keeps its budget
    # in its own thread, so the check runs beside the render instead of after it.
    with ThreadPoolExecutor(1) as pool:
        checked = pool.submit(check_chat_template, template)
        started = time.monotonic()
        with pytest.raises(ChatTemplateLimit, match=why):
            render_within_budget(compile_chat_template(template), CONTEXT)
        assert time.monotonic() - started < RENDER_SECONDS + 2
        assert why in (checked.result() or "")


def test_a_working_template_renders_and_passes_the_check() -> None:
    assert render_within_budget(compile_chat_template(PLAIN), CONTEXT) == "user: hi\n"
    assert check_chat_template(PLAIN) is None


def test_a_template_that_refuses_a_conversation_still_passes_the_check() -> None:
    refusing = "{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}{% endif %}ok"
    assert check_chat_template(refusing) is None
    with pytest.raises(ChatTemplateError, match="no system role"):
        render_within_budget(compile_chat_template(refusing), {"messages": [{"role": "system", "content": ""}]})


def test_a_template_that_does_not_compile_fails_the_check() -> None:
    assert "does not compile" in (check_chat_template("{% for %}") or "")
