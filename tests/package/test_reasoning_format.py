"""A package's reasoning format is its chat template's: a tiny package with Qwen 3's template
reads its answers' `<think>` reasoning apart, one with the default model's template answers at once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from flare.engine.tokenizer import Tokenizer
from flare.package.directory import open_package
from flare.package.reasoning_formats import THINK, opens_inside

QWEN3_TEMPLATE = (Path(__file__).parent.parent / "fixtures" / "templates" / "qwen3.jinja").read_text()
HI = [{"role": "user", "content": "Hi"}]


def test_a_package_whose_template_thinks_has_the_think_format_and_its_switch(make_package: Callable[..., Path]) -> None:
    tokenizer = Tokenizer.from_package(open_package(make_package(chat_template=QWEN3_TEMPLATE)))
    fmt = tokenizer.reasoning_format
    assert fmt is not None and (fmt.start, fmt.end) == (THINK.start, THINK.end) and fmt.switchable
    thinking = tokenizer.render_chat(HI, template_kwargs={"enable_thinking": True})
    quiet = tokenizer.render_chat(HI, template_kwargs={"enable_thinking": False})
    assert not opens_inside(thinking, fmt) and quiet.endswith("<think>\n\n</think>\n\n")
    assert not opens_inside(quiet, fmt)


def test_a_template_that_opens_the_reasoning_starts_the_answer_inside_it(make_package: Callable[..., Path]) -> None:
    r1_like = QWEN3_TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
    assert r1_like != QWEN3_TEMPLATE
    tokenizer = Tokenizer.from_package(open_package(make_package(chat_template=r1_like)))
    fmt = tokenizer.reasoning_format
    assert fmt is not None and opens_inside(tokenizer.render_chat(HI), fmt)


def test_the_default_models_template_does_not_reason(tiny_package: Path) -> None:
    assert Tokenizer.from_package(open_package(tiny_package)).reasoning_format is None
