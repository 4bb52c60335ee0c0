"""NovaInfer on Ray Serve (issue 15, part 4): `novainfer.ray` on a local Ray cluster, two replicas of the
tiny model behind the OpenAI ingress. Kept short: one cluster for the whole file.

Checked: chat and completions through the ingress (streaming included) with the official client; a
session's turns stay on one replica (prefix-cache affinity); a replica whose server dies is replaced by
Serve's health check and the application keeps answering.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import openai
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from novainfer.ray import HEADER, build_app  # noqa: E402
from test_server import KV  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(tiny_models):
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAYON_NUM_THREADS": "1"}})
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(str(tiny_models["f32"]), served_model_name="tiny", num_replicas=2,
                        server_args=[*KV, "--threads", "1"], health_check_period_s=1, health_check_timeout_s=5,
                        replica_cpus=0.5)
        serve.run(app, name="novainfer", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_clients_work_through_the_ingress(app_url):
    c = client(app_url)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    out = c.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0, stream=True)
        if ch.choices)
    whole = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                      temperature=0).choices[0].message.content
    assert streamed == whole and streamed


def test_a_sessions_turns_stay_on_one_replica(app_url):
    c = client(app_url)
    served_by: dict[int, set[str]] = {}
    for i in range(4):
        history = f"Session {i}: a long and distinct system prompt for this session. " * 6
        for turn in range(3):
            history += f"\nTurn {turn}:"
            raw = c.completions.with_raw_response.create(model="tiny", prompt=history, max_tokens=3, temperature=0)
            served_by.setdefault(i, set()).add(raw.headers[HEADER].split("/")[0])
            history += raw.parse().choices[0].text
    assert all(len(replicas) == 1 for replicas in served_by.values()), served_by


def test_a_replica_whose_server_dies_is_replaced(app_url):
    c = client(app_url)
    raw = c.completions.with_raw_response.create(model="tiny", prompt="who serves", max_tokens=2)
    replica, pid = raw.headers[HEADER].split("/")
    os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 120
    seen = set()
    while time.monotonic() < deadline:
        try:
            raw = c.completions.with_raw_response.create(model="tiny", prompt=f"again {len(seen)}", max_tokens=2)
            seen.add(raw.headers[HEADER].split("/")[0])
        except openai.APIError:
            pass
        status = serve.status().applications["novainfer"].deployments["NovaInferReplica"]
        running = status.replica_states.get("RUNNING", 0)
        if running == 2 and len(seen - {replica}) >= 2:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"no replacement: {serve.status()}, served by {seen}")
    assert replica not in seen, "the replica whose server died answered again"
