"""The chat template's render budget and the check export, inspect and run share
(flare/package/chat_template.py)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from flare.package import chat_template
from flare.package.chat_template import (
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
        ("{% set q = [] %}{% for i in range(100000) %}{% for j in range(100000) %}"
         "{% set _ = q.append(j) %}{% endfor %}{% endfor %}", "within"),
    ],
    ids=["loop", "recursion", "output", "repeat", "power", "loop-with-set", "loop-with-append"],
)
def test_a_template_past_its_budget_ends_with_a_limit_error(template: str, why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A looping render and the check each run out the whole budget; each render keeps its budget
    # in its own thread, so the check runs beside the render instead of after it. A budget of 0.5 s
    # here (the daemon's tests run out the real one: tests/reliability/test_chat_templates.py).
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.5)
    with ThreadPoolExecutor(1) as pool:
        checked = pool.submit(check_chat_template, template)
        started = time.monotonic()
        with pytest.raises(ChatTemplateLimit, match=why):
            render_within_budget(compile_chat_template(template), CONTEXT)
        assert time.monotonic() - started < chat_template.RENDER_SECONDS + 2
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


def test_a_template_may_queue_in_a_list_but_never_changes_the_callers_lists() -> None:
    """Kimi K2's templates pair tool results with their calls through a queue (`append`, `pop`);
    each render works on its own copy of the conversation, and every other change to a list or
    a dict stays refused, as in the immutable sandbox transformers renders in."""
    queue = (
        "{% set q = namespace(ids=[]) %}{% for m in messages %}{% set _ = q.ids.append(m.content) %}{% endfor %}"
        "{{ q.ids.pop(0) }},{{ q.ids | length }};{% set _ = messages.pop() %}{% set _ = messages[0].parts.append(9) %}"
    )
    context = {"messages": [{"role": "user", "content": "a", "parts": [1]}, {"role": "user", "content": "b", "parts": []}]}
    assert render_within_budget(compile_chat_template(queue), context) == "a,1;"
    assert len(context["messages"]) == 2 and context["messages"][0]["parts"] == [1]
    # (a template that never calls append or pop by name keeps the immutable sandbox whole)
    for change in ("{% set _ = messages.extend(messages) %}", "{% set _ = messages[0].update({'role': 'system'}) %}",
                   "{% set _ = messages.sort() %}", "{% set _ = messages['pop']() %}"):
        with pytest.raises(ChatTemplateError, match="unsafe"):
            render_within_budget(compile_chat_template(change), context)
