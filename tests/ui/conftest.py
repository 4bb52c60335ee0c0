"""Fixtures for the Web UI tests: a real `novainfer-server` on 127.0.0.1 serving the tiny random
model, and headless Debian Chromium driven by Playwright for Python.

Invariants:
- Every test in this folder is marked `browser`; all of them skip, with the reason, when the
  `playwright` package or a Chromium binary is missing (nothing here downloads a browser).
- The server is $NOVAINFER_SERVER_BIN, else the installed package's (`python -m
  novainfer.server`), else `novainfer-server` on PATH, else the cargo release build; a missing
  server is a failure, not a skip, because a broken install must not pass quietly. The UI files
  are embedded when the server is compiled: after editing them, rebuild before testing.
- Each test gets a fresh browser context, so localStorage (the UI's conversations) starts empty;
  the server is shared by the session and a test leaves no request running on it.
- Screenshots go to tests/ui/screenshots/ (gitignored), named after the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import HERE, MODEL_NAME, Server, chromium_path, new_context, start_server, write_wide_model

SCREENSHOTS = HERE / "screenshots"

try:
    from playwright.sync_api import Browser, BrowserContext, Page, sync_playwright
except ImportError:  # pragma: no cover - exercised only where playwright is absent
    sync_playwright = None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "browser: drives the Web UI in headless Chromium (Playwright)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = None
    if sync_playwright is None:
        reason = "playwright is not installed (pip install playwright; scripts/test installs it)"
    elif chromium_path() is None:
        reason = "no Chromium binary (apt-get install chromium, or set NOVAINFER_CHROMIUM)"
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.browser)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


# ------------------------------------------------------------------ the server


@pytest.fixture(scope="session")
def server(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tiny_models["f32"], tmp_path_factory.mktemp("ui-server") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_wide_model(tmp_path_factory.mktemp("wide-model"))


@pytest.fixture(scope="session")
def slow_server(wide_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose replies last long enough to stop one by clicking (see write_wide_model)."""
    srv = start_server(wide_model, tmp_path_factory.mktemp("ui-slow-server") / "server.log", MODEL_NAME + "-wide")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def full_server(wide_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Slow replies and room for one request: a second one at the same time gets a 429."""
    srv = start_server(wide_model, tmp_path_factory.mktemp("ui-full-server") / "server.log", MODEL_NAME + "-wide",
                       ("--max-concurrent-requests", "1", "--max-queued-requests", "0"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def long_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny model with a 4096-token context (room for the tools' system prompt and a tool round trip),
    speculating by prompt lookup."""
    from unittest import mock

    import tiny_qwen2

    with mock.patch.object(tiny_qwen2, "MAX_POSITIONS", 4096):
        model = tiny_qwen2.write_tiny_model(tmp_path_factory.mktemp("long-model"))
    # Drafting whatever it costs: the UI test needs drafts to show, not a policy's judgement of the tiny model.
    ngram = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, '
             '"draft_policy": "always"}')
    srv = start_server(model, tmp_path_factory.mktemp("ui-long-server") / "server.log",
                       extra_args=("--speculative-config", ngram))
    yield srv
    srv.stop()


# ------------------------------------------------------------------ the browser


@pytest.fixture(scope="session")
def ui_browser() -> Iterator[Browser]:
    with sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture
def ui_context(ui_browser: Browser) -> Iterator[BrowserContext]:
    ctx = new_context(ui_browser)
    yield ctx
    ctx.close()


def open_page(context: BrowserContext, srv: Server) -> tuple[Page, list[str]]:
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda err: errors.append(str(err)))
    pg.goto(srv.url + "/")
    pg.wait_for_selector("#prompt")
    return pg, errors


@pytest.fixture
def ui_page(ui_context: BrowserContext, server: Server) -> Iterator[Page]:
    """The UI of `server`, freshly loaded; fails the test on any uncaught error in the page."""
    pg, errors = open_page(ui_context, server)
    yield pg
    assert not errors, f"uncaught errors in the page: {errors}"


@pytest.fixture
def full_page(ui_context: BrowserContext, full_server: Server) -> Iterator[Page]:
    """The UI of `full_server`."""
    pg, errors = open_page(ui_context, full_server)
    yield pg
    assert not errors, f"uncaught errors in the page: {errors}"


@pytest.fixture
def long_page(ui_context: BrowserContext, long_server: Server) -> Iterator[Page]:
    """The UI of `long_server`."""
    pg, errors = open_page(ui_context, long_server)
    yield pg
    assert not errors, f"uncaught errors in the page: {errors}"


@pytest.fixture
def slow_page(ui_context: BrowserContext, slow_server: Server) -> Iterator[Page]:
    """The UI of `slow_server`."""
    pg, errors = open_page(ui_context, slow_server)
    yield pg
    assert not errors, f"uncaught errors in the page: {errors}"


@pytest.fixture
def shot(request: pytest.FixtureRequest):  # noqa: ANN201 - a callable
    """shot(page, name) saves tests/ui/screenshots/<test>-<name>.png."""
    SCREENSHOTS.mkdir(exist_ok=True)

    def take(pg: Page, name: str, *, full_page: bool = False) -> Path:
        path = SCREENSHOTS / f"{request.node.name}-{name}.png"
        pg.screenshot(path=str(path), full_page=full_page)
        return path

    return take
