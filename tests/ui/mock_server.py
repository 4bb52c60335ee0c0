#!/usr/bin/env python3
"""A stand-in for novainfer-server's chat API, for working on the Web UI without building the server.

    python tests/ui/mock_server.py [--port 8765]     # then open http://127.0.0.1:8765/

It serves crates/novainfer-server/ui/ at `/` and fakes `GET /v1/models`, streamed
`POST /v1/chat/completions` (OpenAI SSE chunks with reasoning_content, a usage chunk with
cached_tokens for message prefixes seen before, `data: [DONE]`), `POST /v1/requests/{id}/cancel` and a
`/metrics` gauge of running requests. Magic words in the last user message: `!429`, `!400` (error
responses), `!drop` (connection lost mid-stream), `!think` (a reasoning block first), `!slow`.

Not used by the test suite, which runs against the real server; a development aid only.
"""

from __future__ import annotations

import argparse
import json
import mimetypes
import re
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

UI_DIR = Path(__file__).resolve().parents[2] / "crates" / "novainfer-server" / "ui"
MODEL = "mock-qwen2"
MAX_CONCURRENT = 1 << 30

REPLY = (
    "Here is a **short** answer with a list:\n\n"
    "1. Prefix caching reuses KV blocks.\n"
    "2. Sessions keep `session_id` stable.\n\n"
    "```python\ndef hello(name: str) -> str:\n    # greet someone\n    return f\"Hello, {name}!\"\n```\n\n"
    "| turn | cached |\n|---:|:---|\n| 1 | 0 |\n| 2 | most |\n\n"
    "> Quote with a [link](https://example.com).\n"
)
REASONING = "The user asks something. Let me think step by step about the KV cache and sessions."


class State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[str, threading.Event] = {}
        self.history: list[list[tuple[str, str]]] = []
        self.aborted = 0


STATE = State()


def words(text: str) -> list[str]:
    return re.findall(r"\s*\S+|\s+", text)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: object) -> None:  # quiet
        pass

    def send_json(self, status: int, body: object, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        self.send_json(status, {"error": {"message": message, "type": "invalid_request_error",
                                          "param": None, "code": status}}, headers)

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"},
                                                            {"id": "mock-other", "object": "model"}]})
            return
        if self.path == "/metrics":
            with STATE.lock:
                n = len(STATE.running)
            with STATE.lock:
                aborted = STATE.aborted
            data = (f'# TYPE novainfer:num_requests_running gauge\nnovainfer:num_requests_running{{model_name="{MODEL}"}} {n}\n'
                    f'novainfer:request_success_total{{model_name="{MODEL}",finished_reason="abort"}} {aborted}\n').encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        rel = "index.html" if self.path in ("/", "") else self.path.lstrip("/").split("?")[0]
        path = (UI_DIR / rel).resolve()
        if UI_DIR not in path.parents and path != UI_DIR or not path.is_file():
            self.error(404, "not found")
            return
        data = path.read_bytes()
        ctype = "text/javascript" if path.suffix == ".js" else mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        m = re.fullmatch(r"/v1/requests/([^/]+)/cancel", self.path)
        if m:
            with STATE.lock:
                event = STATE.running.get(m.group(1))
            if event:
                event.set()
            self.send_json(200 if event else 404, {"cancelled": bool(event)})
            return
        if self.path != "/v1/chat/completions":
            self.error(404, "not found")
            return
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            self.error(400, "bad JSON")
            return
        last = next((m["content"] for m in reversed(body.get("messages", [])) if m["role"] == "user"), "")
        with STATE.lock:
            full = len(STATE.running) >= MAX_CONCURRENT
        if "!429" in last or full:
            self.error(429, "Too many requests: the server is at --max-concurrent-requests.", {"Retry-After": "3"})
            return
        max_tokens = body.get("max_tokens") or 0
        if "!400" in last or max_tokens > 500:
            self.error(400, f"prompt (12 tokens) + max_tokens ({max_tokens}) exceeds max_model_len (512)")
            return
        self.stream(body, last)

    def stream(self, body: dict, last: str) -> None:
        rid = f"chatcmpl-{uuid.uuid4().hex[:16]}"
        cancel = threading.Event()
        with STATE.lock:
            STATE.running[rid] = cancel
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        delay = 0.15 if "!slow" in last else 0.03
        messages = [(m["role"], m["content"]) for m in body["messages"]]
        prompt_tokens = sum(len(c.split()) + 4 for _, c in messages)
        with STATE.lock:
            # Like a prefix cache: the tokens of the longest run of leading messages seen before.
            cached = 0
            for seen in STATE.history:
                common = 0
                for a, b in zip(seen, messages):
                    if a != b:
                        break
                    common += len(a[1].split()) + 4
                cached = max(cached, common)
        pieces: list[tuple[str, str]] = []
        if "!think" in last:
            pieces += [("reasoning_content", w) for w in words(REASONING)]
        text = REPLY if "<script>" not in last else "Echo: " + last
        pieces += [("content", w) for w in words(text)]
        max_tokens = body.get("max_tokens")
        if max_tokens:
            pieces = pieces[:max_tokens]

        def send(obj: object) -> None:
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

        def chunk(delta: dict, finish: str | None = None) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": body["model"],
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        try:
            send(chunk({"role": "assistant", "content": ""}))
            self.wfile.write(b": keep-alive\n\n")
            for n, (field, piece) in enumerate(pieces):
                if cancel.is_set():
                    with STATE.lock:
                        STATE.aborted += 1
                    return
                if "!drop" in last and n == 5:
                    self.connection.shutdown(2)
                    return
                time.sleep(delay)
                send(chunk({field: piece}))
            finish = "length" if max_tokens and len(pieces) >= max_tokens else "stop"
            send(chunk({}, finish))
            send({"id": rid, "object": "chat.completion.chunk", "choices": [], "usage": {
                "prompt_tokens": prompt_tokens, "completion_tokens": len(pieces),
                "total_tokens": prompt_tokens + len(pieces), "prompt_tokens_details": {"cached_tokens": cached}}})
            self.wfile.write(b"data: [DONE]\n\n")
            with STATE.lock:
                STATE.history.append([*messages, ("assistant", "".join(p for f, p in pieces if f == "content"))])
        except (BrokenPipeError, ConnectionResetError, OSError):
            with STATE.lock:
                STATE.aborted += 1
        finally:
            with STATE.lock:
                STATE.running.pop(rid, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--max-concurrent-requests", type=int, default=1 << 30)
    parser.add_argument("--max-queued-requests", type=int, default=0)  # accepted for symmetry; no queue
    args = parser.parse_args()
    global MAX_CONCURRENT  # noqa: PLW0603 - a development tool's one setting
    MAX_CONCURRENT = args.max_concurrent_requests
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"mock UI server on http://127.0.0.1:{args.port}/", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
