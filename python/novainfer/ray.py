"""NovaInfer on Ray Serve: N replicas behind an OpenAI-compatible ingress (``pip install novainfer[ray]``).

Each Serve replica runs one NovaInfer server (the Rust server, ``python -m novainfer.server``) on a
loopback port of its node and forwards requests to it, streams included. Requests reach the replicas
through `PrefixAffinityRouter` (a Serve request router): a request goes to the replica that last served the
longest prefix of its prompt, so a session's turns find their KV in that replica's prefix cache, unless that
replica's queue is much longer than the shortest. Ray's health checks
call the replica's ``check_health``, which fails once the server process has exited or its ``/health``
says the engine died, so Serve replaces that replica; Ray's autoscaling sizes the deployment by requests
in flight.

    from ray import serve
    from novainfer.ray import build_app

    serve.run(build_app("qwen2.5-coder-0.5b", num_replicas=2), route_prefix="/")
    # then: OpenAI clients at http://127.0.0.1:8000/v1

Every response carries ``x-novainfer-replica: <replica id>/<server pid>`` (which replica served it).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

__all__ = ["build_app", "NovaInferReplica", "OpenAIIngress", "PrefixAffinityRouter", "CompletionCall", "ChatCall",
           "GetCall"]

_URL = re.compile(r"(http://127\.0\.0\.1:\d+)")
HEADER = "x-novainfer-replica"


@dataclass
class CompletionCall:
    """A `/v1/completions` body on its way to a replica; `prompt` is what the prefix router matches."""

    body: dict[str, Any]
    prompt: Any


@dataclass
class ChatCall:
    """A `/v1/chat/completions` body on its way to a replica; the router matches `messages`."""

    body: dict[str, Any]
    messages: Any


@dataclass
class GetCall:
    """A GET forwarded to a replica (`/v1/models`); its empty `prompt` lets the prefix router pass it."""

    path: str
    prompt: str = ""


def _prompt_text(pending: PendingRequest | None) -> str:
    """The prompt a forwarded call carries, as one string (chat messages concatenated)."""
    arg = pending.args[0] if pending is not None and pending.args else None
    # By attribute, not isinstance: the call may arrive as a copy of the class (Ray pickles by value).
    prompt = getattr(arg, "prompt", None)
    if prompt is not None:
        return prompt if isinstance(prompt, str) else json.dumps(prompt)
    messages = getattr(arg, "messages", None)
    return json.dumps(messages, sort_keys=True) if messages is not None else ""


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Routes a request to the replica that last served the longest prefix of its prompt.

    Prompts are cut into chunks of `CHUNK` characters; the hash of each chunk-aligned prefix remembers
    the replica that served it (the most recent `max_prefixes`, least recently used forgotten). With no
    known prefix, or when the owner's queue is `imbalance` requests longer than the shortest, the less loaded
    of two replicas drawn at random (Serve's default policy).
    """

    CHUNK = 64

    def initialize_state(self, imbalance: int = 8, max_prefixes: int = 100_000) -> None:
        """Router options, from `RequestRouterConfig.request_router_kwargs`."""
        self._owner: OrderedDict[int, ReplicaID] = OrderedDict()
        self._imbalance = imbalance
        self._max_prefixes = max_prefixes

    def _prefix_keys(self, text: str) -> list[int]:
        return [hash(text[:end]) for end in range(self.CHUNK, len(text) + 1, self.CHUNK)]

    def _queue_len(self, replica: RunningReplica) -> int | None:
        cache = getattr(self, "_replica_queue_len_cache", None)
        return cache.get(replica.replica_id) if cache is not None else None

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """The replica owning the longest known prefix, else the less loaded of two drawn at random.

        The choice is remembered here, as it is made: Serve reports where a request went only in its
        strict queue-length mode.
        """
        keys = self._prefix_keys(_prompt_text(pending_request))
        chosen = self._owner_of(keys, candidate_replicas) or self._less_loaded(candidate_replicas)
        for key in keys:
            self._owner[key] = chosen.replica_id
            self._owner.move_to_end(key)
        while len(self._owner) > self._max_prefixes:
            self._owner.popitem(last=False)
        return [[chosen]]

    def _owner_of(self, keys: list[int], candidates: list[RunningReplica]) -> RunningReplica | None:
        by_id = {r.replica_id: r for r in candidates}
        for key in reversed(keys):
            owner = by_id.get(self._owner.get(key))  # type: ignore[arg-type]
            if owner is None:
                continue
            lengths = [n for n in map(self._queue_len, candidates) if n is not None]
            mine = self._queue_len(owner)
            if mine is None or not lengths or mine - min(lengths) < self._imbalance:
                return owner
            return None
        return None

    def _less_loaded(self, candidates: list[RunningReplica]) -> RunningReplica:
        pair = random.sample(candidates, min(2, len(candidates)))
        return min(pair, key=lambda r: self._queue_len(r) or 0)


def _path(call: CompletionCall | ChatCall) -> str:
    return "/v1/chat/completions" if isinstance(call, ChatCall) else "/v1/completions"


class NovaInferReplica:
    """One Serve replica: a NovaInfer server process on a free loopback port, and a client for it."""

    def __init__(self, server_args: Sequence[str], startup_timeout_s: float = 600.0) -> None:
        """Starts the server with `server_args` (``novainfer serve`` options) and waits until it is ready."""
        cmd = [sys.executable, "-m", "novainfer.server", "--host", "127.0.0.1", "--port", "0", *server_args]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.url = self._read_url(startup_timeout_s)
        self._wait_ready(startup_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self.name = f"{serve.get_replica_context().replica_id.unique_id}/{self._proc.pid}"

    def _read_url(self, timeout_s: float) -> str:
        assert self._proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self._proc.stdout.readline()
            if not line:
                raise RuntimeError(f"novainfer server exited with {self._proc.wait()} before listening")
            found = _URL.search(line)
            if found:
                return found.group(1)
        raise RuntimeError("novainfer server did not print its URL in time")

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=10):
                    return
            except OSError:
                if self._proc.poll() is not None:
                    raise RuntimeError("novainfer server exited while warming up") from None
                time.sleep(0.05)
        raise RuntimeError("novainfer server not ready in time")

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def check_health(self) -> None:
        """Ray's health check: fails once the server exited or reports a dead engine."""
        if self._proc.poll() is not None:
            raise RuntimeError(f"novainfer server exited with {self._proc.returncode}")
        async with self._client().get(self.url + "/health") as r:
            if r.status != 200:
                raise RuntimeError(f"novainfer /health answered {r.status}: {await r.text()}")

    async def call(self, call: CompletionCall | ChatCall) -> tuple[int, bytes, str]:
        """A non-streaming request: (status, body, this replica's name)."""
        async with self._client().post(self.url + _path(call), json=call.body) as r:
            return r.status, await r.read(), self.name

    async def stream(self, call: CompletionCall | ChatCall) -> AsyncIterator[bytes]:
        """A streaming request: the replica's name first, then the SSE bytes as they come."""
        yield self.name.encode()
        async with self._client().post(self.url + _path(call), json=call.body) as r:
            async for chunk in r.content.iter_any():
                yield chunk

    async def get(self, call: GetCall) -> tuple[int, bytes, str]:
        """A GET on the server (`/v1/models`, `/metrics`)."""
        async with self._client().get(self.url + call.path) as r:
            return r.status, await r.read(), self.name

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()


class OpenAIIngress:
    """The HTTP face: OpenAI's completions, chat completions and models, forwarded to the replicas.

    A plain Serve HTTP deployment (Starlette request in, response out) rather than a FastAPI class view:
    the routes are three, and it keeps the ingress independent of FastAPI's version.
    """

    def __init__(self, replicas: DeploymentHandle) -> None:
        """`replicas`: the handle of the `NovaInferReplica` deployment."""
        self._replicas = replicas

    async def __call__(self, request: Request) -> Response:
        """Routes `GET /v1/models`, `POST /v1/completions` and `POST /v1/chat/completions`."""
        route = (request.method, request.url.path.rstrip("/"))
        if route == ("GET", "/v1/models"):
            status, body, name = await self._replicas.get.remote(GetCall("/v1/models"))
            return Response(body, status_code=status, media_type="application/json", headers={HEADER: name})
        if route in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
            parsed = await _json(request)
            if isinstance(parsed, Response):
                return parsed
            if route[1] == "/v1/completions":
                return await self._forward(CompletionCall(body=parsed, prompt=parsed.get("prompt", "")))
            return await self._forward(ChatCall(body=parsed, messages=parsed.get("messages", [])))
        return JSONResponse({"error": {"message": f"no route {route[0]} {route[1]}", "type": "invalid_request_error",
                                       "param": None, "code": "not_found"}}, status_code=404)

    async def _forward(self, call: CompletionCall | ChatCall) -> Response:
        if call.body.get("stream"):
            chunks = self._replicas.options(stream=True).stream.remote(call)
            name = (await chunks.__anext__()).decode()
            return StreamingResponse(chunks, media_type="text/event-stream", headers={HEADER: name})
        status, body, name = await self._replicas.call.remote(call)
        return Response(body, status_code=status, media_type="application/json", headers={HEADER: name})


async def _json(request: Request) -> dict[str, Any] | Response:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _error(f"the request body is not valid JSON: {e}")
    if not isinstance(body, dict):
        return _error("the request body must be a JSON object")
    return body


def _error(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": None}}, status_code=400)


def build_app(
    model: str,
    *,
    served_model_name: str | None = None,
    num_replicas: int | None = 2,
    autoscaling_config: dict[str, Any] | None = None,
    server_args: Sequence[str] = (),
    prefix_affinity: bool = True,
    health_check_period_s: float = 10.0,
    health_check_timeout_s: float = 30.0,
    replica_cpus: float = 1.0,
) -> serve.Application:
    """A Ray Serve application: replicas of `model` behind the OpenAI ingress.

    `num_replicas` fixes the count; `autoscaling_config` (Ray's: ``{"min_replicas": 1, "max_replicas": 4,
    "target_ongoing_requests": 8}``) lets Serve size it instead. `server_args` are extra ``novainfer serve``
    options (``--kv-cache-bytes``, ``--threads``, ...). `prefix_affinity` routes by prompt prefix (Ray's
    ``PrefixCacheAffinityRouter``); off, Serve's power-of-two-choices router balances load.
    """
    if autoscaling_config is not None:
        num_replicas = None
    args = ["--model", model, *(["--served-model-name", served_model_name] if served_model_name else []),
            *server_args]
    options: dict[str, Any] = {
        "health_check_period_s": health_check_period_s,
        "health_check_timeout_s": health_check_timeout_s,
        "ray_actor_options": {"num_cpus": replica_cpus},
        "autoscaling_config": autoscaling_config,
        "num_replicas": num_replicas,
    }
    if prefix_affinity:
        options["request_router_config"] = RequestRouterConfig(request_router_class=PrefixAffinityRouter)
    replica = serve.deployment(NovaInferReplica, name="NovaInferReplica").options(**options)
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress", ray_actor_options={"num_cpus": 0})
    return ingress.bind(replica.bind(list(args)))


def _main() -> None:  # pragma: no cover - manual use: python -m novainfer.ray MODEL [N]
    from ray import serve as _serve

    model = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b"
    replicas = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    _serve.run(build_app(model, num_replicas=replicas), route_prefix="/")
    print(f"NovaInfer on Ray Serve: {replicas} replicas of {model} at http://127.0.0.1:8000/v1", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    _main()
