"""Chat templates that hang, crash or exhaust memory (issue 29, item 8), through the real daemon.

The package's template does something pathological only for a trigger message, so the daemon
starts (its start-up check renders a plain conversation) and each case is a request: a loop of
10^10 steps ends its request with a 400 naming the template within its time budget while other
requests are served; a macro that recurses for ever is a 400 (not a 500 with a traceback); a
render of 470 MB stops at the output budget without the daemon's memory growing by it. SIGTERM
during a looping render ends the daemon in seconds. A template that loops on every
conversation is refused by `flare run` and `flare inspect`, as is one with a syntax error."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from tests.package_commands import flare
from tests.reliability.reliability_daemon import Daemon, is_error_body, launch, report

from flare.package.chat_template import RENDER_SECONDS

ROOT = Path(__file__).resolve().parents[2]
TRIGGERED = (
    "{% macro forever(n) %}{{ forever(n + 1) }}{% endmacro %}"
    "{% for m in messages %}"
    "{% if m.content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif m.content == 'recurse' %}{{ forever(0) }}"
    "{% elif m.content == 'huge' %}{% for i in range(100000) %}{{ 'x' * 4700 }}{% endfor %}"
    "{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ALWAYS_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
SYNTAX_ERROR = "{% for m in messages %}{{ m.content }"


@pytest.fixture(scope="module")
def triggered_package(make_package: Callable[..., Path]) -> Path:
    return make_package(chat_template=TRIGGERED)


def _chat(daemon: Daemon, content: str) -> httpx.Response:
    return httpx.post(
        f"{daemon.url}/v1/chat/completions",
        json=daemon.body(messages=[{"role": "user", "content": content}], max_tokens=2),
        timeout=120,
    )


async def _served_while(daemon: Daemon, content: str) -> tuple[httpx.Response, float, int]:
    """The pathological request, its seconds, and how many plain requests were served meanwhile."""
    async with httpx.AsyncClient(base_url=daemon.url, timeout=120) as http:
        started = time.monotonic()
        slow = asyncio.create_task(
            http.post("/v1/chat/completions", json=daemon.body(messages=[{"role": "user", "content": content}]))
        )
        served = 0
        while not slow.done():
            answer = await http.post("/v1/chat/completions", json=daemon.body(max_tokens=2))
            served += answer.status_code == 200
            await asyncio.sleep(0.2)
        return await slow, time.monotonic() - started, served


def test_a_looping_template_ends_its_request_with_a_400_naming_it_while_others_are_served(
    triggered_package: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    daemon = daemon_factory(triggered_package)
    response, seconds, served = asyncio.run(_served_while(daemon, "loop"))
    report("template_loop", status=response.status_code, seconds=round(seconds, 1), served_meanwhile=served)
    assert response.status_code == 400 and is_error_body(response.json()), response.text
    error = response.json()["error"]
    assert error["code"] == "chat_template_limit" and error["param"] == "messages"
    assert "chat template" in error["message"] and seconds < RENDER_SECONDS + 10
    assert served > 0 and daemon.serves()


def test_a_recursive_macro_is_a_400_not_a_500(triggered_package: Path, daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory(triggered_package)
    response = _chat(daemon, "recurse")
    assert response.status_code == 400 and is_error_body(response.json()), response.text
    assert "recursed" in response.json()["error"]["message"]
    assert daemon.serves()


def test_a_template_rendering_470_mb_stops_at_the_budget_without_growing_the_daemon(
    triggered_package: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    daemon = daemon_factory(triggered_package)
    before = daemon.rss_kib()
    response = _chat(daemon, "huge")
    grown_mib = (daemon.rss_kib() - before) / 1024
    report("template_470mb", status=response.status_code, rss_growth_mib=round(grown_mib, 1))
    assert response.status_code == 400 and "more than" in response.json()["error"]["message"], response.text
    assert grown_mib < 200
    assert daemon.serves()


def test_sigterm_during_a_looping_render_ends_the_daemon_in_seconds(
    triggered_package: Path, tmp_path: Path
) -> None:
    daemon = launch(triggered_package, tmp_path)
    try:
        looping = subprocess.Popen(
            [sys.executable, "-c", f"import httpx; httpx.post('{daemon.url}/v1/chat/completions', "
             f"json={daemon.body(messages=[{'role': 'user', 'content': 'loop'}])!r}, timeout=60)"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        time.sleep(1.5)  # the render is under way
        started = time.monotonic()
        code = daemon.process.stop(timeout_s=60)
        seconds = time.monotonic() - started
        looping.kill()
    finally:
        daemon.process.kill()
    report("template_sigterm", exit_code=code, seconds=round(seconds, 1))
    assert code == 0 and seconds < RENDER_SECONDS + 5


def test_run_and_inspect_refuse_a_template_that_always_loops_or_does_not_compile(
    make_package: Callable[..., Path], tmp_path: Path
) -> None:
    cases = (("loops", ALWAYS_LOOPS, "within"), ("syntax", SYNTAX_ERROR, "does not compile"))
    packages = {name: make_package(tmp_path / name, chat_template=template) for name, template, _ in cases}
    # Each `flare run` refuses in its own process while inspect refuses in this one: the loop's
    # render budget is waited out side by side rather than once after the other.
    runs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "flare.cli.main", "run", str(package), "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )
        for name, package in packages.items()
    }
    try:
        for name, package in packages.items():
            assert flare("inspect", str(package)) == 1, name
        for name, _, why in cases:
            stdout, stderr = runs[name].communicate(timeout=120)
            assert runs[name].returncode != 0 and why in stderr + stdout, (runs[name].returncode, stderr[-2000:])
            assert "Traceback" not in stderr
    finally:
        for run in runs.values():
            run.kill()
            run.wait()
