"""A real `novainfer-server` process on 127.0.0.1 for the server tests.

Started as ``python -m novainfer.server --port 0 ...`` (the installed package's in-process Rust server), or
as a given ``novainfer-server`` executable (a test build with fault injection, say); the URL is read from the one line the server prints on stdout once it listens. Its stderr (the request
log) goes to a file that failing tests can show.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

_URL = re.compile(r"(http://127\.0\.0\.1:\d+)")


class ServerProcess:
    """A running server; `stop()` (or use as a context manager) terminates it."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float = 120.0,
        executable: str | None = None,
    ) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="novainfer-server-", suffix=".log", delete=False)
        # The log's text once `stop()` has removed its file (a test may still ask for it then).
        self._final_log: str | None = None
        program = [executable] if executable else [sys.executable, "-m", "novainfer.server"]
        cmd = [*program, "--host", "127.0.0.1", "--port", "0", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env={**os.environ, **(env or {})}
        )
        self.url = self._wait_for_url(timeout)
        self.base_url = self.url + "/v1"
        self._wait_warm(timeout)

    def _wait_for_url(self, timeout: float) -> str:
        found: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                m = _URL.search(line)
                if m:
                    found.append(m.group(1))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        if not found:
            self.stop()
            raise RuntimeError(f"server did not start within {timeout} s:\n{self.logs()}")
        return found[0]

    def _wait_warm(self, timeout: float) -> None:
        """Waits while `/ready` says the model is warming up (the port opens before the warm-up ends)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=30):
                    return
            except urllib.error.HTTPError as e:
                code = json.loads(e.read() or b"{}").get("error", {}).get("code")
                if e.code != 503 or code != "warming_up":
                    return
            time.sleep(0.02)

    def logs(self) -> str:
        if self._final_log is not None:
            return self._final_log
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def client(self, **kwargs):  # noqa: ANN201 - openai.OpenAI
        import openai

        kwargs.setdefault("api_key", "unused")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120)
        return openai.OpenAI(base_url=self.base_url, **kwargs)

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {"name{labels}": value}."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def engine_idle(self, model: str) -> bool:
        m = self.metrics()
        label = f'{{model_name="{model}"}}'
        return (
            m[f"novainfer:kv_cache_used_blocks{label}"] == 0
            and m[f"novainfer:num_requests_running{label}"] == 0
            and m[f"novainfer:num_requests_waiting{label}"] == 0
        )

    def wait_idle(self, model: str, timeout: float = 10.0) -> None:
        """Waits until the model's engine runs nothing and holds no KV block; fails after `timeout`."""
        deadline = time.monotonic() + timeout
        while not self.engine_idle(model):
            if time.monotonic() > deadline:
                raise AssertionError(f"engine of {model} still busy after {timeout} s: {self.metrics()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._final_log is None:
            # Kept in memory rather than left in the temporary directory (every server a test
            # run started used to leave its log there).
            self._final_log = self.logs()
            self.log.close()
            os.unlink(self.log.name)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
