"""The web page at ``/`` in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver`` packages, installed by ``make test``) driven by Selenium against the test server.

It loads the page, sends a message and sees the streamed answer (equal to the non-streamed one),
stops a long answer midway (the server aborts it), sees the KV block map move while a request
runs and settle when it ends, and attaches an image for an image-text model (a tiny LLaVA).
"""

from __future__ import annotations

import shutil
import time

import httpx
import pytest

selenium = pytest.importorskip("selenium")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Debian's chromium and chromium-driver")


@pytest.fixture(scope="module")
def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,900"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


def _wait(predicate, timeout: float = 120.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _open(browser, url: str, served_model: str, max_tokens: int) -> None:
    browser.get(url + "/")
    _wait(lambda: browser.find_element(By.ID, "model-name").text == served_model, 60, "the model name")
    browser.find_element(By.ID, "settings").click()
    for field, value in (("temperature", "0"), ("max-tokens", str(max_tokens))):
        el = browser.find_element(By.ID, field)
        el.clear()
        el.send_keys(value)


def _send(browser, text: str) -> None:
    box = browser.find_element(By.ID, "prompt")
    box.send_keys(text)
    browser.find_element(By.ID, "send").click()


def _last_answer(browser):
    answers = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")
    return answers[-1] if answers else None


def _block_counts(browser) -> dict[str, int]:
    """Blocks per state as the page last drew them (one attribute read: the page redraws every 500 ms)."""
    states = browser.find_element(By.ID, "block-map").get_attribute("data-states") or ""
    return {"free": states.count("0"), "used": states.count("1"), "cached": states.count("2")}


def test_page_streams_an_answer_equal_to_the_api(browser, server_url, served_model):
    _open(browser, server_url, served_model, max_tokens=24)
    assert browser.title == "pagedllm"
    _send(browser, "What is the capital of France?")
    answer = _wait(lambda: (a := _last_answer(browser)) is not None and a.get_attribute("data-finish") and a,
                   what="the answer to finish")
    text = answer.find_element(By.CLASS_NAME, "content").text
    meta = answer.find_element(By.CLASS_NAME, "meta").text
    ref = httpx.post(f"{server_url}/v1/chat/completions", timeout=120, json={
        "model": served_model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "top_p": 1, "max_tokens": 24}).json()
    assert text == ref["choices"][0]["message"]["content"].strip()
    usage = ref["usage"]
    assert f"{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens" in meta
    assert "tokens/s" in meta and answer.get_attribute("data-finish") == ref["choices"][0]["finish_reason"]
    # regenerate replaces the answer (greedy: the same text again)
    browser.find_element(By.ID, "regenerate").click()
    _wait(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 1
          and _last_answer(browser).get_attribute("data-finish"), what="the regenerated answer")
    assert _last_answer(browser).find_element(By.CLASS_NAME, "content").text == text


def test_stop_ends_a_long_answer_and_the_block_map_moves(browser, server_url, served_model, tmp_path):
    _open(browser, server_url, served_model, max_tokens=1500)
    browser.find_element(By.ID, "clear").click()
    idle = _wait(lambda: _block_counts(browser) if sum(_block_counts(browser).values()) else None,
                 what="the block map")
    assert idle["used"] == 0, idle
    _send(browser, "Write a very long story about a lighthouse keeper.")
    _wait(lambda: len(_last_answer(browser).find_element(By.CLASS_NAME, "content").text) > 40, what="streamed text")
    running = _wait(lambda: (c := _block_counts(browser))["used"] > 0 and c, 30, "blocks in use")
    assert browser.find_element(By.ID, "num-running").text == "1"
    # the header's KV figure is not "0%" while blocks are held (a few of thousands)
    _wait(lambda: browser.find_element(By.ID, "kv-usage").text not in ("", "0%"), 10, "the KV figure")
    assert browser.execute_script("return [kvPercent(0.0004), kvPercent(0.0024), kvPercent(0.5)]") == \
        ["<0.1%", "0.2%", "50%"]
    browser.save_screenshot(str(tmp_path / "page.png"))
    assert (tmp_path / "page.png").stat().st_size > 10_000
    browser.find_element(By.ID, "stop").click()
    answer = _last_answer(browser)
    _wait(lambda: answer.get_attribute("data-finish") == "stopped", 30, "the stopped answer")
    # the server aborted the request: its blocks come back (full ones stay cached, evictable)
    after = _wait(lambda: (c := _block_counts(browser))["used"] == 0 and c, 30, "the blocks to be freed")
    assert after["cached"] >= 1 and after["free"] + after["cached"] == sum(running.values())
    assert httpx.get(f"{server_url}/stats").json()["num_running"] == 0
    assert browser.find_element(By.ID, "send").is_enabled()


@pytest.fixture(scope="module")
def llava_url(tiny_llava, thread_server):
    """The page's server over the tiny LLaVA (images, issue 41), in process."""
    from pagedllm.config import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.server.app import build_app
    llm = AsyncLLM(LLMEngine(EngineArgs(model=str(tiny_llava[0]), num_kv_blocks=64, block_size=4)))
    server = None
    try:
        server = thread_server(build_app(llm, "tiny-llava"))
        yield server.url
    finally:
        if server is not None:
            server.stop()
        llm.shutdown()


def test_page_attaches_an_image(browser, llava_url, tmp_path):
    """An image attached from a file shows as a thumbnail, goes with the message as an image_url part,
    and the answer equals the API's for the same file and text."""
    import base64

    import numpy as np
    from PIL import Image
    path = tmp_path / "picture.png"
    Image.fromarray((np.random.default_rng(5).random((40, 50, 3)) * 255).astype("uint8")).save(path)
    _open(browser, llava_url, "tiny-llava", max_tokens=8)
    field = browser.find_element(By.ID, "image")
    browser.execute_script("arguments[0].hidden = false", field)
    field.send_keys(str(path))
    _wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#attachments img.thumb"), 30, "the thumbnail")
    _send(browser, "What is in this picture?")
    answer = _wait(lambda: (a := _last_answer(browser)) is not None and a.get_attribute("data-finish") and a,
                   what="the answer to finish")
    assert browser.find_elements(By.CSS_SELECTOR, ".msg.user img.thumb")  # the image shown with the message
    assert not browser.find_elements(By.CSS_SELECTOR, "#attachments img.thumb")  # and no longer attached
    url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    ref = httpx.post(f"{llava_url}/v1/chat/completions", timeout=120, json={
        "model": "tiny-llava", "temperature": 0, "top_p": 1, "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is in this picture?"}]}]})
    assert answer.find_element(By.CLASS_NAME, "content").text == ref.json()["choices"][0]["message"]["content"].strip()
