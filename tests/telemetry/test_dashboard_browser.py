"""`GET /dashboard` in a real browser: Debian's chromium (`/usr/bin/chromium`, installed by
`.ci/run`; Playwright never downloads one) driven by Playwright for Python.

While a long request streams, the page shows it in flight in `decode`; after it finishes, its
waterfall appears among the recent requests. The page and its data need the admin key (an admin
key, `tokenpath keys create --admin`) because this server has keys. A screenshot is kept under
`test-artifacts/` (gitignored).
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.capabilities import CHROMIUM
from tests.telemetry.conftest import Served, chat

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = pytest.mark.requires("chromium")


@pytest.fixture(scope="module")
def browser():
    from playwright import sync_api as playwright_api

    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS, headless=True)
        yield b
        b.close()


def _until(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.2)


def test_dashboard_needs_the_admin_key(served: Served, http: httpx.Client):
    assert http.get("/dashboard").status_code == 401
    assert http.get("/dashboard/data").status_code == 401
    assert http.get("/dashboard/data", headers=served.headers("acme")).status_code == 403
    assert http.get("/dashboard/data", headers=served.headers("admin")).status_code == 200


@pytest.mark.slow
def test_a_streaming_request_shows_in_decode_then_as_a_waterfall(served: Served, browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.add_cookies([{"name": "tokenpath_admin", "value": served.keys["admin"], "url": served.url + "/dashboard"}])
    page = context.new_page()
    page.goto(served.url + "/dashboard")
    page.wait_for_selector("#status:has-text('live')", timeout=15_000)

    started = threading.Event()
    request_id: list[str] = []
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            with httpx.Client(base_url=served.url, timeout=300) as client, client.stream(
                    "POST", "/v1/chat/completions", headers=served.headers(),
                    json=chat(1000, stream=True, ignore_eos=True)) as resp:  # seconds of decode, even on a quiet machine
                request_id.append(resp.headers["x-request-id"])
                started.set()
                for _ in resp.iter_lines():
                    pass
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)
            started.set()

    worker = threading.Thread(target=stream)
    worker.start()
    try:
        assert started.wait(120) and not errors, errors
        rid = request_id[0]
        row = page.wait_for_selector(f"tr.inflight-row[data-request-id='{rid}'][data-stage='decode']", timeout=60_000)
        assert "decode" in row.inner_text()
        # The numbers move while it decodes: its token count grows, and so does the replica's tok/s.
        # (Polled from Python: the page's CSP forbids the eval that wait_for_function needs.)
        tokens = f"tr.inflight-row[data-request-id='{rid}'] td.tokens"
        first = int(page.inner_text(tokens))
        _until(lambda: int(page.inner_text(tokens)) > first, "the in-flight token count to grow")
        _until(lambda: any(float(td.inner_text()) > 0 for td in page.query_selector_all("#replicas td.tok-s")),
               "a replica's tok/s above 0")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-decode.png"), full_page=True)
        worker.join(300)
        assert not worker.is_alive() and not errors, errors
        page.wait_for_selector(f"tr.recent-row[data-request-id='{rid}'] .seg[data-stage='decode']", timeout=15_000)
        assert page.query_selector(f"tr.inflight-row[data-request-id='{rid}']") is None
        assert page.query_selector("#stages tr[data-stage='decode']") is not None
        assert page.query_selector("#replicas tr[data-replica]") is not None
        # The error panel and the per-tenant rows count what happened in the window.
        assert httpx.post(served.url + "/v1/chat/completions", headers=served.headers(),
                          json=chat(2, n=0)).status_code == 400
        _until(lambda: int(page.inner_text("#errors-row td:nth-child(2)")) >= 1, "the 4xx count to show the 400")
        page.wait_for_selector("#tenants tr[data-tenant='acme']", timeout=15_000)
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    finally:
        worker.join(300)
        context.close()


def test_chromium_is_debians(browser):
    assert shutil.which("chromium") == CHROMIUM or Path(CHROMIUM).exists()
    assert browser.version
