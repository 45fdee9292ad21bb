"""The chat page at / in a real browser: Debian's chromium, headless, driven by selenium through
chromium-driver, against the real daemon and default model.

Skipped (with the reason) only where chromium or chromium-driver is not installed; `.ci/run`
installs both.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
from tests.integration.daemon_process import DaemonProcess, start_daemon

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra has it)")
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.actions.wheel_input import ScrollOrigin  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver") or shutil.which("chromium-driver")
pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(
        CHROMIUM is None or CHROMEDRIVER is None,
        reason="chromium and chromium-driver are not installed (apt-get install chromium chromium-driver; .ci/run does)",
    ),
]
# As root in a container: no sandbox, and nothing that reaches for the network by itself.
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1100,800",
)
WAIT_S = 120.0
T = TypeVar("T")


@pytest.fixture(scope="module")
def daemon(default_package: Path) -> Iterator[DaemonProcess]:
    # One running request at a time and no queue: a second request is refused with 429 at once.
    process = start_daemon(default_package, ["--max-concurrency", "1", "--max-waiting", "0"])
    yield process
    assert process.stop() == 0, process.log()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(check: Callable[[], T], what: str, timeout_s: float = WAIT_S) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def open_page(browser: WebDriver, daemon: DaemonProcess) -> None:
    browser.get(f"{daemon.base_url}/")
    model = daemon.model_name()
    wait_for(lambda: browser.find_element(By.ID, "model").text == model, "the page to show the model name")


def set_field(browser: WebDriver, element_id: str, value: str) -> None:
    field = browser.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def ask(browser: WebDriver, question: str) -> None:
    box = browser.find_element(By.ID, "prompt")
    box.send_keys(question)
    box.send_keys(Keys.ENTER)


def running_requests(daemon: DaemonProcess) -> float:
    metrics = httpx.get(f"{daemon.base_url}/metrics", timeout=10).text
    match = re.search(r"^flare_requests_running (\S+)$", metrics, re.MULTILINE)
    assert match is not None, "the daemon exports flare_requests_running"
    return float(match.group(1))


def answers(browser: WebDriver) -> list:
    return browser.find_elements(By.CSS_SELECTOR, ".turn.assistant")


def test_a_question_sent_with_enter_streams_an_answer(browser: WebDriver, daemon: DaemonProcess) -> None:
    open_page(browser, daemon)
    box = browser.find_element(By.ID, "prompt")
    box.send_keys("first line", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "second line")
    assert box.get_attribute("value") == "first line\nsecond line", "Shift+Enter adds a line and sends nothing"
    assert answers(browser) == []
    box.clear()
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "24")
    ask(browser, "What is the capital of France?")
    user = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".turn.user"), "the question to show")
    assert user[0].text == "What is the capital of France?"
    answer = wait_for(lambda: [a for a in answers(browser) if "streaming" not in a.get_attribute("class")],
                      "the answer to finish")[0]
    text = answer.find_element(By.CSS_SELECTOR, ".text").text
    assert "Paris" in text
    # What the package policy applied is shown beside the answer.
    applied = answer.find_element(By.CSS_SELECTOR, "details.flare")
    applied.find_element(By.TAG_NAME, "summary").click()
    assert "temperature" in applied.text and "max_tokens" in applied.text
    assert browser.find_elements(By.CSS_SELECTOR, ".turn.error") == []


def test_stop_cancels_the_stream_and_the_daemon_stops_generating(browser: WebDriver, daemon: DaemonProcess) -> None:
    open_page(browser, daemon)
    # Greedy, this question's answer is 459 tokens long (it ends on its own at the same token every
    # run): it overflows the window within its first 150 or so, and keeps streaming after the
    # reader scrolls. At temperature 1 the story sometimes ended before the reader had scrolled.
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "500")
    ask(browser, "Write a long story about a dragon who learns to cook.")
    answer = wait_for(lambda: [a for a in answers(browser) if a.find_element(By.CSS_SELECTOR, ".text").text],
                      "the first tokens")[0]
    assert running_requests(daemon) == 1
    browser.find_element(By.ID, "stop").click()
    wait_for(lambda: "stopped" in answer.text, "the answer to say it was stopped", 10)
    wait_for(lambda: running_requests(daemon) == 0, "the daemon's running count to return to 0", 10)
    assert browser.find_element(By.ID, "send").is_displayed()
    # The conversation goes on, the stopped answer part of it.
    set_field(browser, "max-tokens", "8")
    ask(browser, "Thank you.")
    wait_for(lambda: len([a for a in answers(browser) if "streaming" not in a.get_attribute("class")]) == 2,
             "the next answer")
    assert browser.find_elements(By.CSS_SELECTOR, ".turn.error") == []


def test_a_refused_parameter_shows_the_servers_message(browser: WebDriver, daemon: DaemonProcess) -> None:
    open_page(browser, daemon)
    set_field(browser, "temperature", "-1")
    ask(browser, "Hello")
    error = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".turn.error"), "the error message")[0]
    assert "HTTP 400" in error.text and "temperature" in error.text
    assert answers(browser) == []
    # The page still works: the next question is answered.
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "8")
    ask(browser, "Hello")
    wait_for(lambda: [a for a in answers(browser) if "streaming" not in a.get_attribute("class")], "an answer")


def test_a_busy_server_429_shows_as_a_message(browser: WebDriver, daemon: DaemonProcess) -> None:
    open_page(browser, daemon)
    model = daemon.model_name()
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 500, "temperature": 1, "stream": True}
    # Another client holds the only running slot while the page asks.
    with httpx.stream("POST", f"{daemon.base_url}/v1/chat/completions", json=body, timeout=60) as held:
        lines = held.iter_lines()
        wait_for(lambda: next(lines).startswith("data: ") and running_requests(daemon) == 1, "the other request to run")
        ask(browser, "Hello")
        error = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".turn.error"), "the busy message")[0]
    assert "busy" in error.text and "Try again in" in error.text
    assert answers(browser) == []
    assert browser.find_element(By.ID, "prompt").is_enabled()


def test_with_api_keys_the_page_asks_for_one_and_keeps_it_in_the_session_only(
    browser: WebDriver, tiny_package: Path
) -> None:
    keyed = start_daemon(tiny_package, ["--api-key", "sk-page-test"])
    try:
        browser.get(f"{keyed.base_url}/")
        panel = browser.find_element(By.ID, "key-panel")
        wait_for(panel.is_displayed, "the page to ask for a key")
        set_field(browser, "api-key", "sk-page-test")
        browser.find_element(By.ID, "api-key").send_keys(Keys.ENTER)
        wait_for(lambda: browser.find_element(By.ID, "model").text not in ("", "connecting…", "needs an API key"),
                 "the model name once the key is given")
        assert not panel.is_displayed()
        set_field(browser, "max-tokens", "4")
        ask(browser, "Hello")
        wait_for(lambda: [a for a in answers(browser) if "streaming" not in a.get_attribute("class")], "an answer")
        assert browser.find_elements(By.CSS_SELECTOR, ".turn.error") == []
        assert browser.execute_script("return sessionStorage.getItem('flare.apiKey')") == "sk-page-test"
        assert browser.execute_script("return localStorage.length") == 0
        assert browser.get_cookies() == []
    finally:
        assert keyed.stop() == 0, keyed.log()


def last_line_bottoms(browser: WebDriver) -> dict:
    """Where the conversation's last line ends, against the bottom of the conversation's visible area (above
    any scrollbar) and the window's."""
    return browser.execute_script(
        "const main = document.getElementById('conversation');"
        "const last = main.lastElementChild.lastElementChild;"
        "const area = main.getBoundingClientRect().top + main.clientTop + main.clientHeight;"
        "return {line: last.getBoundingClientRect().bottom, area: area, sideways: main.scrollWidth - main.clientWidth,"
        "        window: window.innerHeight, status: last.className};"
    )


def test_a_long_answer_ends_with_its_status_line_in_view(
    browser: WebDriver, tiny_package: Path
) -> None:
    tiny = start_daemon(tiny_package)
    try:
        browser.set_window_size(700, 500)
        browser.get(f"{tiny.base_url}/")
        model = tiny.model_name()
        wait_for(lambda: browser.find_element(By.ID, "model").text == model, "the page to show the model name")
        set_field(browser, "max-tokens", "400")
        ask(browser, "Tell me a long story.")
        answer = wait_for(lambda: [a for a in answers(browser) if "streaming" not in a.get_attribute("class")],
                          "the answer to finish")[0]
        assert "stopped at the max tokens limit" in answer.text
        overflow = browser.execute_script(
            "const main = document.getElementById('conversation'); return main.scrollHeight - main.clientHeight;")
        assert overflow > 200, "the answer is longer than the window (the test would prove nothing)"
        # The last line on the page is the answer's status line, and it is in view, not under the text box.
        bottoms = last_line_bottoms(browser)
        assert bottoms["status"] == "status"
        assert bottoms["line"] <= bottoms["area"] <= bottoms["window"], bottoms
        assert bottoms["sideways"] == 0, "long runs of text wrap: no sideways scrollbar covers the last line"
    finally:
        assert tiny.stop() == 0, tiny.log()


def test_a_reader_who_scrolled_up_is_not_pulled_down_while_the_answer_streams(
    browser: WebDriver, daemon: DaemonProcess
) -> None:
    browser.set_window_size(700, 500)
    open_page(browser, daemon)
    # Greedy, this question's answer is 459 tokens long (it ends on its own at the same token every
    # run): it overflows the window within its first 150 or so, and keeps streaming after the
    # reader scrolls. At temperature 1 the story sometimes ended before the reader had scrolled.
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "500")
    ask(browser, "Write a long story about a dragon who learns to cook.")
    scroll_height = "return document.getElementById('conversation').scrollHeight"
    client_height = browser.execute_script("return document.getElementById('conversation').clientHeight")
    wait_for(lambda: browser.execute_script(scroll_height) > client_height + 100, "the answer to overflow the window")
    # The streaming answer followed the text so far; the reader now scrolls back to the question
    # with the mouse wheel, while text keeps arriving.
    conversation = browser.find_element(By.ID, "conversation")
    ActionChains(browser).scroll_from_origin(ScrollOrigin.from_element(conversation), 0, -100000).perform()
    wait_for(lambda: browser.execute_script("return document.getElementById('conversation').scrollTop") == 0,
             "the view to reach the question")
    grown_from = browser.execute_script(scroll_height)
    wait_for(lambda: browser.execute_script(scroll_height) > grown_from + 100, "more of the answer")
    assert browser.execute_script("return document.getElementById('conversation').scrollTop") == 0
    browser.find_element(By.ID, "stop").click()
    wait_for(lambda: not browser.find_elements(By.CSS_SELECTOR, ".turn.streaming"), "the answer to stop")
    assert browser.execute_script("return document.getElementById('conversation').scrollTop") == 0


def test_a_stopped_daemon_is_named_as_unreachable_with_what_to_check(
    browser: WebDriver, tiny_package: Path
) -> None:
    tiny = start_daemon(tiny_package)
    try:
        browser.get(f"{tiny.base_url}/")
        model = tiny.model_name()
        wait_for(lambda: browser.find_element(By.ID, "model").text == model, "the page to show the model name")
    finally:
        assert tiny.stop() == 0, tiny.log()
    ask(browser, "Hello")
    error = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".turn.error"), "the error message")[0]
    assert error.text.startswith(f"Cannot reach the flare daemon at {tiny.base_url}/"), error.text
    assert "flare run" in error.text and "flare ctl status" in error.text and "journalctl -u flare" in error.text
    assert "Failed to fetch" not in error.text
    assert answers(browser) == []
    assert browser.find_element(By.ID, "model").text == "daemon not reachable"
    # The question never reached the daemon: it is back in the box, and sending it again says the same.
    box = browser.find_element(By.ID, "prompt")
    assert box.is_enabled() and box.get_attribute("value") == "Hello"
    box.send_keys(Keys.ENTER)
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".turn.error")) == 2, "the second error message")
    assert browser.find_elements(By.CSS_SELECTOR, ".turn.error")[1].text == error.text


def test_a_daemon_lost_mid_answer_is_told_apart_from_one_never_reached(
    browser: WebDriver, tiny_package: Path
) -> None:
    tiny = start_daemon(tiny_package)
    try:
        browser.get(f"{tiny.base_url}/")
        model = tiny.model_name()
        wait_for(lambda: browser.find_element(By.ID, "model").text == model, "the page to show the model name")
        set_field(browser, "max-tokens", "100000")
        ask(browser, "Tell me a very long story.")
        answer = wait_for(lambda: [a for a in answers(browser) if a.find_element(By.CSS_SELECTOR, ".text").text],
                          "the first tokens")[0]
    finally:
        tiny.kill()
    error = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".turn.error"), "the error message")[0]
    assert error.text.startswith("The connection to the flare daemon was lost mid-answer"), error.text
    assert "flare ctl status" in error.text
    # What arrived stays on the page, no longer shown as streaming.
    assert answer.find_element(By.CSS_SELECTOR, ".text").text
    assert "streaming" not in answer.get_attribute("class")
