"""Helpers shared by the Web UI tests and their fixtures: finding Chromium and the server binary,
running a novainfer-server (or the development mock) on a free 127.0.0.1 port, reading /metrics,
and making browser contexts.

Invariants: a Server is healthy when its constructor returns, and stop() always reaps the process;
nothing here downloads anything.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING
from unittest import mock

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser, BrowserContext

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MODEL_NAME = "tiny-qwen2"
TEST_DEFAULTS = {"maxTokens": 24, "temperature": 0}
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")


def chromium_path() -> str | None:
    explicit = os.environ.get("NOVAINFER_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    return next((p for p in CHROMIUM_CANDIDATES if Path(p).is_file()), None)


def server_command() -> list[str]:
    """How to start the server: $NOVAINFER_SERVER_BIN, else the installed package's in-process
    server (`python -m novainfer.server`, what scripts/test builds and the server tests use), else
    `novainfer-server` on PATH, else the cargo release build."""
    explicit = os.environ.get("NOVAINFER_SERVER_BIN")
    if explicit:
        return [explicit]
    if importlib.util.find_spec("novainfer") and importlib.util.find_spec("novainfer.server"):
        return [sys.executable, "-m", "novainfer.server"]
    on_path = shutil.which("novainfer-server")
    if on_path:
        return [on_path]
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    built = target / "release" / "novainfer-server"
    if built.is_file():
        return [str(built)]
    pytest.fail("novainfer-server not found: set NOVAINFER_SERVER_BIN, pip install ., or cargo build --release "
                "-p novainfer-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running novainfer-server process and its base URL."""

    def __init__(self, model_dir: Path, log_path: Path, extra_args: tuple[str, ...] = (),
                 model_name: str = MODEL_NAME) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        args = [*server_command(), "--model", str(model_dir), "--served-model-name", model_name,
                "--host", "127.0.0.1", "--port", str(self.port), "--kv-cache-bytes", str(64 << 20), *extra_args]
        self.model = model_name
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_ready()

    def wait_ready(self, timeout: float = 120.0, path: str = "/health") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"novainfer-server exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}{path}", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"novainfer-server did not become healthy in {timeout} s:\n{self.log_text()}")

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as response:
            return response.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a Prometheus series over the samples whose labels include `labels`."""
        text = self.get("/metrics")
        total, found = 0.0, False
        for m in re.finditer(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
            have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += float(m.group(2))
                found = True
        assert found, f"/metrics has no series {name} with {labels}:\n{text[:2000]}"
        return total

    def wait_metric(self, name: str, value: float, timeout: float = 10.0) -> float:
        deadline = time.monotonic() + timeout
        current = self.metric(name)
        while current != value and time.monotonic() < deadline:
            time.sleep(0.05)
            current = self.metric(name)
        return current

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class MockServer(Server):
    """tests/ui/mock_server.py in place of the real server: NOVAINFER_UI_TEST_SERVER=mock, for
    working on the UI before the server builds. Never the default."""

    def __init__(self, log_path: Path, extra_args: tuple[str, ...] = ()) -> None:  # noqa: D107
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = "mock-qwen2"
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, str(HERE / "mock_server.py"), "--port", str(self.port), *extra_args],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_ready(path="/v1/models")


def start_server(model_dir: Path, log_path: Path, model_name: str = MODEL_NAME,
                 extra_args: tuple[str, ...] = ()) -> Server:
    if os.environ.get("NOVAINFER_UI_TEST_SERVER") == "mock":
        return MockServer(log_path, extra_args)
    return Server(model_dir, log_path, extra_args, model_name=model_name)


def write_wide_model(out_dir: Path) -> Path:
    """The tiny model's generator at 8× the width and 4× the depth (~30M parameters, 120 MB).

    The tiny model streams ~3000 tokens/s here: a whole reply is over before a click can land.
    This one takes ~2 s for 400 greedy tokens (its greedy replies run to max_tokens), long enough
    to press Stop mid-stream. Same tokenizer and chat template.
    """
    import tiny_qwen2

    with mock.patch.multiple(tiny_qwen2, HIDDEN_SIZE=512, INTERMEDIATE_SIZE=2048, NUM_LAYERS=8, NUM_HEADS=8,
                             NUM_KV_HEADS=2):
        return tiny_qwen2.write_tiny_model(out_dir)


def new_context(browser: Browser, **overrides: object) -> BrowserContext:
    # bypass_csp: Playwright evaluates its helpers with eval(), which the page's own CSP forbids.
    # It also makes the injection test stricter: the renderer must be safe without CSP's help.
    options: dict[str, object] = {"viewport": {"width": 1280, "height": 860}, "bypass_csp": True,
                                  "color_scheme": "light"}
    options.update(overrides)
    context = browser.new_context(**options)
    # New chats default to short greedy replies: the random model rambles until max_tokens or
    # its 512-token context, and multi-turn tests need room for several turns.
    context.add_init_script(f"localStorage.setItem('novainfer.defaults', '{json.dumps(TEST_DEFAULTS)}')")
    return context


