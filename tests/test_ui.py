"""The built-in page at `/` (chat playground and engine view).

In-process checks (the app without its engine) cover routing, headers, `--no-ui` and /metrics.json; the rest
drives the page in a real headless Chromium against a real `ferry serve` with the embedded demo model and an API
key: the key prompt, a streamed conversation, the engine view moving, Stop, and model output that tries to run
script. Chromium and chromedriver are Debian's (`.ci/run` installs them); without them the browser tests skip.

`FERRY_UI_SCREENSHOT=docs/playground.png python -m pytest tests/test_ui.py -k conversation` also saves a
screenshot of the page after the conversation (the one in README.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from engine.config import EngineConfig
from engine.core.stats import EngineStats
from server import cli
from server.app import create_app
from server.lifecycle import Lifecycle
from server.metrics import ServerMetrics
from server.settings import ServerSettings
from server.ui import STATIC_DIR, UI_DIR
from tests.server_harness import REPO_ROOT, ServerProcess, metric, parse_metrics, server_process, wait_until

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
API_KEY = "sk-ui-test"
MODEL = "default_model"  # the embedded demo model's directory name
WAIT_SECONDS = 20.0
TRAFFIC_MESSAGES = [{"role": "user", "content": "Tell me about ferry boats."}]


def app_client(**settings: Any) -> TestClient:
    """The app without its engine: TestClient outside `with` never runs the lifespan, so nothing is spawned."""
    app = create_app(EngineConfig.of(model=str(cli.DEFAULT_MODEL_DIR)), ServerSettings(**settings), Lifecycle(30.0))
    return TestClient(app)


# ------------------------------------------------------------------------------------------ no browser


def test_page_and_assets_load_without_the_key() -> None:
    client = app_client(api_key=API_KEY)
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "default-src 'none'" in csp
    assert "{{" not in page.text
    # Every asset is the server's own (no CDN, nothing from elsewhere), and loads without the key.
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert assets and not [url for url in assets if re.match(r"[a-z]+:|/", url)], assets  # relative: this server
    types = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml", ".json": "application/json"}
    for url in assets:
        response = client.get(f"/{url}")
        assert response.status_code == 200, url
        assert response.headers["content-type"].startswith(types[Path(url.split("?")[0]).suffix]), url
    for text in (page.text, *(path.read_text() for path in STATIC_DIR.iterdir())):
        hosts = set(re.findall(r"https?://([a-z0-9-]+(?:\.[a-z0-9-]+)+)", text)) - {"www.w3.org", "example.com"}
        assert not hosts, f"the page refers to other servers: {hosts}"
    # The key still guards /v1/*; /metrics and its JSON twin stay open, as they were.
    assert client.get("/v1/models").status_code == 401
    assert client.get("/metrics.json").status_code == 200
    assert client.get("/ui/../settings.py").status_code == 404


def test_no_ui_turns_the_page_off() -> None:
    client = app_client(ui=False)
    assert client.get("/").status_code == 404
    assert client.get("/ui/app.js").status_code == 404
    assert client.get("/metrics.json").status_code == 200  # the metrics endpoint is not part of the page


def test_ui_flag() -> None:
    parser = argparse.ArgumentParser()
    cli.add_serve_parser(parser.add_subparsers())
    assert cli.build_settings(parser.parse_args(["serve"])).ui is True
    assert cli.build_settings(parser.parse_args(["serve", "--no-ui"])).ui is False


def test_metrics_json_is_the_twin_of_metrics() -> None:
    metrics = ServerMetrics("m")
    assert metrics.snapshot()["prefix_cache_hit_rate"] is None  # nothing looked up yet
    metrics.observe_engine_stats(EngineStats(2, 3, 100, 60, 0.4, 64, 16, 1, 5, 8, cpu_threads=2))
    metrics.prompt_tokens.inc(64)
    metrics.generation_tokens.inc(7)
    metrics.count_success("stop")
    metrics.count_success("length")
    metrics.count_rejection("queue_full")
    snapshot = json.loads(json.dumps(metrics.snapshot()))
    samples = parse_metrics(metrics.render().decode())
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "request_rejected_total",
                 "cpu_threads"):  # fmt: skip
        assert snapshot[name] == metric(samples, f"ferry:{name}"), name
    assert (snapshot["num_requests_running"], snapshot["generation_tokens_total"]) == (2, 7)
    assert snapshot["request_success_total"] == 2 and snapshot["cpu_threads"] == 2
    assert snapshot["prefix_cache_hit_rate"] == 0.25
    assert snapshot["model_name"] == "m" and snapshot["time"] > 0


def test_the_package_ships_the_page() -> None:
    tomllib = pytest.importorskip("tomllib")
    package_data = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = package_data["server.ui"]
    files = [path.relative_to(UI_DIR) for path in UI_DIR.rglob("*") if path.is_file()]
    shipped = [f for f in files if f.suffix not in (".py", ".pyc")]
    assert shipped and all(any(f.match(p) for p in patterns) for f in shipped), (shipped, patterns)


_GLOB_PARTS = {"**/": "(.*/)?", "*": "[^/]*", "?": "[^/]"}


def _docker_ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore's patterns keep `path` out of the build context (the last matching pattern wins; a
    pattern that matches a folder matches what is inside it)."""
    ignored = False
    for pattern in patterns:
        parts = re.findall(r"\*\*/|\*|\?|\[[^]]*\]|[^*?[]+", pattern.removeprefix("!").strip("/"))
        regex = "".join(_GLOB_PARTS.get(p, p if p.startswith("[") else re.escape(p)) for p in parts)
        if re.fullmatch(regex + "(/.*)?", path):
            ignored = not pattern.startswith("!")
    return ignored


def test_the_docker_image_gets_the_page() -> None:
    patterns = [ln for ln in (REPO_ROOT / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert _docker_ignored("server/__pycache__/app.cpython-311.pyc", patterns)  # the reading is right
    assert not _docker_ignored("server/app.py", patterns)
    assert _docker_ignored("tests/test_ui.py", patterns)
    for path in UI_DIR.rglob("*"):
        relative = path.relative_to(REPO_ROOT).as_posix()
        if path.is_file() and path.suffix != ".pyc":
            assert not _docker_ignored(relative, patterns), relative
    assert re.search(r"^COPY server /src/server$", (REPO_ROOT / "Dockerfile").read_text(), re.M)


# ------------------------------------------------------------------------------------------- browser


def _browser_missing() -> str | None:
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.is_file()]
    if missing:
        return f"needs Debian's chromium and chromium-driver ({', '.join(missing)} missing; .ci/run installs them)"
    if importlib.util.find_spec("selenium") is None:
        return "needs selenium (in the test extra)"
    return None


# A mark, not a skip inside a fixture: without a browser, the server is not even started.
needs_browser = pytest.mark.skipif(_browser_missing() is not None, reason=str(_browser_missing()))


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with server_process(None, "--api-key", API_KEY, "--log-level", "warning") as running:
        yield running


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium driven through Debian's chromedriver, with its console log kept."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="ferry-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    "--no-first-run", "--window-size=1280,940", "--force-device-scale-factor=1",
                    f"--user-data-dir={profile}"):  # fmt: skip
            options.add_argument(arg)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        # An explicit driver path and browser binary: Selenium Manager never runs (nor downloads anything).
        driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
        try:
            yield driver
        finally:
            driver.quit()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


def wait_for(driver: Any, condition: Any, timeout: float = WAIT_SECONDS) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition)


def console_errors(driver: Any) -> list[str]:
    """Errors logged by the page since the last call (a CSP violation, an exception), except refused keys."""
    return [
        entry["message"]
        for entry in driver.get_log("browser")
        if entry["level"] == "SEVERE" and "status of 401" not in entry["message"]
    ]


def js(driver: Any, script: str, *args: Any) -> Any:
    return driver.execute_script(script, *args)


@pytest.fixture
def page(server: ServerProcess, browser: Any) -> Iterator[Any]:
    """The page, loaded with the key already given, connected to the model; no console errors by the end."""
    browser.get(server.base_url)
    js(browser, "sessionStorage.setItem('ferry.apiKey', arguments[0])", API_KEY)
    browser.get(server.base_url)  # a fresh load (a reload would restore the previous test's form values)
    wait_for(browser, lambda d: js(d, "return document.getElementById('model-name').textContent") == MODEL)
    yield browser
    assert not console_errors(browser)


def text_of(driver: Any, element_id: str) -> str:
    return js(driver, "return document.getElementById(arguments[0]).textContent", element_id)


def set_value(driver: Any, element_id: str, value: str) -> None:
    js(
        driver,
        "const e = document.getElementById(arguments[0]); e.value = arguments[1];"
        "e.dispatchEvent(new Event('input', {bubbles: true}));",
        element_id,
        value,
    )


def assistant_messages(driver: Any) -> list[dict[str, Any]]:
    return js(
        driver,
        """return [...document.querySelectorAll('.msg.assistant')].map((m) => ({
            state: m.dataset.state, text: m.querySelector('.body').textContent,
            meta: m.querySelector('.meta').textContent, tokens: Number(m.dataset.completionTokens || 0),
            ttft: Number(m.dataset.ttftMs || 0), html: m.querySelector('.body').innerHTML,
            tools: m.querySelector('.tool-calls').textContent}));""",
    )


def ask(driver: Any, question: str) -> None:
    from selenium.webdriver.common.by import By

    prompt = driver.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys(question)
    driver.find_element(By.ID, "send").click()


def last_answer_settled(driver: Any) -> dict[str, Any] | None:
    answers = assistant_messages(driver)
    return answers[-1] if answers and answers[-1]["state"] not in (None, "streaming") else None


def watch_streaming(driver: Any) -> None:
    """Record the answer text's length at every change the page makes while the answer is streaming."""
    js(
        driver,
        """window.__lengths = [];
        new MutationObserver(() => {
            const m = [...document.querySelectorAll('.msg.assistant')].pop();
            if (m && m.dataset.state === 'streaming') {
                window.__lengths.push(m.querySelector('.body').textContent.length);
            }
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});""",
    )


def stats(server: ServerProcess) -> dict[str, Any]:
    return httpx.get(f"{server.base_url}/metrics.json", timeout=10).json()


@needs_browser
def test_api_key_prompt(server: ServerProcess, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    browser.get(server.base_url)
    js(browser, "sessionStorage.clear()")
    browser.get(server.base_url)
    dialog_open = "return document.getElementById('key-dialog').open"
    wait_for(browser, lambda d: js(d, dialog_open))
    assert text_of(browser, "server-status") == "API key required"
    browser.find_element(By.ID, "key-input").send_keys("wrong-key\n")
    wait_for(browser, lambda d: "refused" in text_of(d, "key-error") and js(d, dialog_open))
    browser.find_element(By.ID, "key-input").send_keys(API_KEY + "\n")
    wait_for(browser, lambda d: text_of(d, "model-name") == MODEL)
    assert not js(browser, dialog_open)
    assert js(browser, "return sessionStorage.getItem('ferry.apiKey')") == API_KEY
    assert not console_errors(browser)


@needs_browser
def test_conversation_streams_and_the_engine_view_moves(server: ServerProcess, page: Any) -> None:
    from selenium.webdriver.common.by import By

    wait_for(page, lambda d: js(d, "return document.getElementById('stat-generated').dataset.value") is not None)
    generated_before = int(js(page, "return document.getElementById('stat-generated').dataset.value"))
    set_value(page, "temperature", "0")  # greedy: Regenerate must give the same answer back
    watch_streaming(page)
    ask(page, "What does a ferry do?")
    first = wait_for(page, last_answer_settled)
    assert first["state"] == "done", first
    assert len(first["text"]) > 20 and first["tokens"] > 0 and first["ttft"] > 0, first
    assert f"{first['tokens']} tokens" in first["meta"] and "TTFT" in first["meta"], first["meta"]
    assert "finish: stop" in first["meta"] or "finish: length" in first["meta"], first["meta"]
    # Streamed, not delivered at once: the page showed the answer growing while it was still streaming.
    lengths = js(page, "return window.__lengths")
    assert len({n for n in lengths if n > 0}) >= 2, lengths

    # The engine view follows /metrics: the counter moved by this answer's tokens, and the chart saw them.
    wait_for(
        page,
        lambda d: (
            int(js(d, "return document.getElementById('stat-generated').dataset.value"))
            >= generated_before + first["tokens"]
        ),
    )
    wait_for(page, lambda d: float(js(d, "return document.getElementById('tps-chart').dataset.peak")) > 0)
    wait_for(page, lambda d: int(js(d, "return document.getElementById('tps-chart').dataset.points")) >= 2)
    assert stats(server)["generation_tokens_total"] >= generated_before + first["tokens"]

    js(page, "document.querySelector('.msg.assistant').dataset.replaced = 'yes'")
    page.find_element(By.ID, "regenerate").click()
    wait_for(page, lambda d: not js(d, "return document.querySelector('[data-replaced]')") and last_answer_settled(d))
    answers = assistant_messages(page)
    assert len(answers) == 1 and answers[0]["text"] == first["text"], answers

    # A follow-up carries the conversation: its prompt is the first exchange plus the new question.
    ask(page, "What is Ferry?")
    wait_for(page, lambda d: len(assistant_messages(d)) == 2 and last_answer_settled(d))
    second = assistant_messages(page)[1]
    prompts = [int(re.search(r"prompt (\d+)", a["meta"])[1]) for a in (first, second)]  # type: ignore[index]
    assert second["state"] == "done" and prompts[1] > prompts[0] + first["tokens"], (prompts, second)

    if os.environ.get("FERRY_UI_SCREENSHOT"):
        save_screenshot(page, server, Path(os.environ["FERRY_UI_SCREENSHOT"]))


def save_screenshot(page: Any, server: ServerProcess, path: Path) -> None:
    """Some traffic from other clients first (bursts of concurrent requests), so the chart has a shape to show."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as client:
        body = {"model": MODEL, "max_tokens": 200, "ignore_eos": True, "messages": TRAFFIC_MESSAGES}
        for burst in (2, 4, 8, 3, 6):
            with ThreadPoolExecutor(burst) as pool:
                list(pool.map(lambda _: client.post("/v1/chat/completions", json=body), range(burst)))
            time.sleep(2)
    wait_for(page, lambda d: text_of(d, "stat-running") == "0")
    time.sleep(1.5)  # one more poll, so the tiles show the idle engine
    page.save_screenshot(str(path))


@needs_browser
def test_stop_aborts_the_request(server: ServerProcess, page: Any) -> None:
    from selenium.webdriver.common.by import By

    # A long answer: `ignore_eos` (a vLLM field the page does not send) added on the way out, with max tokens
    # near the demo model's 512-token context, so the answer is still streaming when Stop is clicked.
    js(
        page,
        """const realFetch = window.fetch.bind(window);
        window.fetch = (url, init) => {
            if (String(url).endsWith('v1/chat/completions')) {
                init = {...init, body: JSON.stringify({...JSON.parse(init.body), ignore_eos: true})};
            }
            return realFetch(url, init);
        };""",
    )
    set_value(page, "max-tokens", "480")
    generated_before = stats(server)["generation_tokens_total"]
    ask(page, "Tell me about ferries.")
    wait_for(page, lambda d: (a := assistant_messages(d)) and a[-1]["state"] == "streaming" and a[-1]["text"])
    page.find_element(By.ID, "stop").click()
    stopped = wait_for(page, last_answer_settled)
    assert stopped["state"] == "stopped" and "stopped" in stopped["meta"] and stopped["text"], stopped
    assert js(page, "return [document.getElementById('stop').hidden, document.getElementById('send').hidden]") == [
        True,
        False,
    ]
    # The server aborted the request when the page dropped the stream, long before its 480 tokens.
    wait_until(lambda: stats(server)["num_requests_running"] == 0, timeout=5)
    assert stats(server)["generation_tokens_total"] - generated_before < 480


# A scripted answer, served to the page by a stand-in fetch: HTML that must stay text, Markdown that must render,
# and a tool call split over two chunks (as a stream delivers it).
HOSTILE = (
    'Look: <img src=x onerror="window.__pwned = 1"> and <script>window.__pwned = 2</script>\n\n'
    "```html\n<script>window.__pwned = 3</script>\n```\n\n"
    "- **bold** and `code`\n- [bad](javascript:window.__pwned=4) [good](https://example.com/a)\n"
)
SCRIPTED_CHUNKS = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": HOSTILE[:40]}}]},
    {"choices": [{"index": 0, "delta": {"content": HOSTILE[40:]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": '}}
    ]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"<b>Oslo</b>"}'}}]},
                  "finish_reason": "tool_calls"}]},
    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}},
]  # fmt: skip


@needs_browser
def test_model_output_is_shown_never_run(page: Any) -> None:
    js(
        page,
        """const chunks = arguments[0];
        const realFetch = window.fetch.bind(window);
        window.fetch = (url, init) => {
            if (!String(url).endsWith('v1/chat/completions')) return realFetch(url, init);
            const encoder = new TextEncoder();
            const body = new ReadableStream({start(controller) {
                for (const chunk of chunks) controller.enqueue(encoder.encode('data: ' + chunk + '\\n\\n'));
                controller.enqueue(encoder.encode('data: [DONE]\\n\\n'));
                controller.close();
            }});
            return Promise.resolve(new Response(body, {headers: {'Content-Type': 'text/event-stream'}}));
        };""",
        [json.dumps(chunk) for chunk in SCRIPTED_CHUNKS],
    )
    ask(page, "Say something dangerous.")
    answer = wait_for(page, last_answer_settled)
    assert answer["state"] == "done", answer
    # The markup arrived as characters: visible as text, and no element made from it. (The page's CSP would also
    # block inline handlers; these checks do not rely on it.)
    assert '<img src=x onerror="window.__pwned = 1">' in answer["text"]
    assert "<script>window.__pwned = 2</script>" in answer["text"]
    body = "[...document.querySelectorAll('.msg.assistant .body')].pop()"
    assert js(page, f"return {body}.querySelectorAll('img, script, iframe, [onerror]').length") == 0
    assert js(page, "return window.__pwned") is None
    # Markdown rendered as elements: code fence, list, bold, inline code; only the http(s) link is a link.
    assert js(page, f"return {body}.querySelector('pre > code.language-html').textContent") == (
        "<script>window.__pwned = 3</script>"
    )
    assert js(page, f"return {body}.querySelectorAll('ul > li').length") == 2
    assert js(page, f"return {body}.querySelector('li strong').textContent") == "bold"
    assert js(page, f"return [...{body}.querySelectorAll('a')].map((a) => a.href)") == ["https://example.com/a"]
    assert "[bad](javascript:window.__pwned=4)" in answer["text"]
    # The tool call: its name and its arguments, joined from both chunks, as text.
    assert "get_weather" in answer["tools"] and '"city": "<b>Oslo</b>"' in answer["tools"], answer["tools"]
    assert js(page, "return document.querySelectorAll('.tool-call b').length") == 0
    assert "9 tokens" in answer["meta"] and "finish: tool_calls" in answer["meta"], answer["meta"]


MARKDOWN_CASES = [
    ("**bold**, *em*, _em_, `a<b`", "<p><strong>bold</strong>, <em>em</em>, <em>em</em>, <code>a&lt;b</code></p>"),
    ("line one\nline two\n\nnext", "<p>line one<br>line two</p><p>next</p>"),
    ("```py\nif a < b:\n    pass\n```", '<pre><code class="language-py">if a &lt; b:\n    pass</code></pre>'),
    ("```\nunclosed <b>", "<pre><code>unclosed &lt;b&gt;</code></pre>"),
    ("- a\n- b\n  - c\n\n3. d", "<ul><li>a</li><li>b<ul><li>c</li></ul></li></ul><ol start=\"3\"><li>d</li></ol>"),
    ("## Title\n> quoted", "<h2>Title</h2><blockquote><p>quoted</p></blockquote>"),
    ("see https://example.com/x.", '<p>see <a href="https://example.com/x" target="_blank" '
                                   'rel="noopener noreferrer nofollow">https://example.com/x</a>.</p>'),
    ("[x](data:text/html,<b>hi</b>)", "<p>[x](data:text/html,&lt;b&gt;hi&lt;/b&gt;)</p>"),
    ("[x](javascript:alert`1`)", "<p>[x](javascript:alert`1`)</p>"),  # refused: left as the text it was
    ("__init__ and 2 * 3 * 4 and \\*not em\\*", "<p>__init__ and 2 * 3 * 4 and *not em*</p>"),
    ("<script>alert(1)</script>", "<p>&lt;script&gt;alert(1)&lt;/script&gt;</p>"),
]  # fmt: skip


@needs_browser
def test_markdown_renderer(page: Any) -> None:
    rendered = js(
        page,
        """return arguments[0].map((text) => {
            const box = document.createElement('div');
            box.append(FerryMarkdown.render(text));
            return box.innerHTML;
        });""",
        [text for text, _ in MARKDOWN_CASES],
    )
    for (text, expected), html in zip(MARKDOWN_CASES, rendered, strict=True):
        assert html == expected, text


@needs_browser
def test_tool_call_deltas_merge(page: Any) -> None:
    merged = js(
        page,
        """const calls = [];
        FerryChat.mergeToolCalls(calls, [{index: 0, id: 'a', function: {name: 'f', arguments: '{"x"'}}]);
        FerryChat.mergeToolCalls(calls, [{index: 1, id: 'b', function: {name: 'g', arguments: ''}},
                                         {index: 0, function: {arguments: ': 1}'}}]);
        const whole = FerryChat.mergeToolCalls(
            [], [{id: 'c', type: 'function', function: {name: 'h', arguments: '{}'}}]);
        return [calls, whole];""",
    )
    assert merged == [
        [{"id": "a", "name": "f", "arguments": '{"x": 1}'}, {"id": "b", "name": "g", "arguments": ""}],
        [{"id": "c", "name": "h", "arguments": "{}"}],
    ]


@needs_browser
def test_json_mode_shows_the_json_it_asked_for(page: Any) -> None:
    """JSON mode sends response_format json_object; the answer closes within max tokens and shows indented."""
    js(page, "document.getElementById('json-mode').checked = true")
    set_value(page, "max-tokens", "24")
    set_value(page, "temperature", "1")
    ask(page, "Describe a ferry.")
    answer = wait_for(page, last_answer_settled)
    assert answer["state"] == "done", answer
    shown = js(
        page, "const p = document.querySelector('.msg.assistant .json-answer'); return [p.dataset.valid, p.textContent]"
    )
    assert shown[0] == "true" and isinstance(json.loads(shown[1]), dict), shown


@pytest.fixture(scope="module")
def reasoning_server(scripted_chat_model: Path) -> Iterator[ServerProcess]:
    with server_process(scripted_chat_model, "--api-key", API_KEY, "--log-level", "warning") as running:
        yield running


@needs_browser
def test_reasoning_streams_apart_and_folds_when_the_answer_starts(
    reasoning_server: ServerProcess, browser: Any
) -> None:
    """A reasoning model (the scripted one, qwen3's parser): its reasoning_content in a collapsible box of its
    own, open while it streams, folded once the answer starts; the answer alone in the message body."""
    from tests.scripted_chat import ANSWER, REASON, REASONING

    browser.get(reasoning_server.base_url)
    js(browser, "sessionStorage.setItem('ferry.apiKey', arguments[0])", API_KEY)
    browser.get(reasoning_server.base_url)
    wait_for(browser, lambda d: js(d, "return document.getElementById('model-name').textContent") != "connecting…")
    set_value(browser, "temperature", "0")
    ask(browser, f"Ferries? {REASON}")
    answer = wait_for(browser, last_answer_settled)
    box = js(
        browser,
        "const b = document.querySelector('.msg.assistant .reasoning');"
        "return [b.hidden, b.open, b.querySelector('.reasoning-body').textContent];",
    )
    assert box[0] is False and box[1] is False and box[2].strip() == REASONING, box
    assert answer["text"].strip() == ANSWER, answer
    assert not console_errors(browser)


@pytest.fixture(scope="module")
def image_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`ferry serve` of a tiny LLaVA (tests/vision_models.py), for the playground's image flow."""
    from tests.vision_models import build_llava_dir

    model = build_llava_dir(tmp_path_factory.mktemp("ui-llava"))
    with server_process(
        model, "--api-key", API_KEY, "--log-level", "warning", "--served-model-name", "llava"
    ) as running:
        yield running


@needs_browser
def test_an_attached_image_is_asked_about_and_the_engine_view_counts_it(
    image_server: ServerProcess, browser: Any, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    from tests.vision_models import random_image

    picture = tmp_path / "picture.png"
    random_image(3, 60, 40).save(picture)
    browser.get(image_server.base_url)
    js(browser, "sessionStorage.setItem('ferry.apiKey', arguments[0])", API_KEY)
    browser.get(image_server.base_url)
    wait_for(browser, lambda d: text_of(d, "model-name") == "llava")
    set_value(browser, "max-tokens", "8")
    # Picked from a file, as a user does (a drop reads the same files).
    browser.find_element(By.ID, "image-input").send_keys(str(picture))
    wait_for(browser, lambda d: js(d, "return document.querySelectorAll('#attachments img').length") == 1)
    ask(browser, "What is in the picture?")
    answer = wait_for(browser, last_answer_settled)
    assert answer["state"] == "done" and answer["tokens"] > 0, answer
    shown = js(browser, "return [...document.querySelectorAll('.msg.user .msg-images img')].map((i) => i.src)")
    assert len(shown) == 1 and shown[0].startswith("data:image/png;base64,"), shown
    assert js(browser, "return document.getElementById('attachments').hidden")  # sent: nothing left attached
    # The image's tokens are in the prompt the answer reports, and the engine view counts the image.
    prompt_tokens = int(re.search(r"prompt (\d+)", answer["meta"])[1])  # type: ignore[index]
    assert prompt_tokens > 4, answer["meta"]
    wait_for(browser, lambda d: js(d, "return document.getElementById('stat-images').dataset.value") == "1")
    assert stats(image_server)["images_processed_total"] == 1
    assert not console_errors(browser)
