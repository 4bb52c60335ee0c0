"""LoRA adapters through the server, with the official `openai` client: adapters named as `model`, listed
with their `parent`, loaded and unloaded at run time behind the API key, and their answers equal to the
merged-weights model's (the NumPy reference's greedy tokens)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from conftest import PROMPT
from novainfer import LLM
from numpy_qwen2 import Qwen2Reference, greedy_generate, load_checkpoint
from server_process import ServerProcess
from tiny_lora import merged, write_peft_adapter
from tiny_qwen2 import special_token_ids

KEY = "lora-test-key"
EOS = set(special_token_ids().values())


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("loras")
    config = json.loads((tiny_models["f32"] / "config.json").read_text())
    weights = load_checkpoint(tiny_models["f32"])
    out = {}
    for name, seed in (("alpha", 61), ("beta", 62), ("gamma", 63)):
        path, delta = write_peft_adapter(root / name, rank=8, alpha=16, seed=seed)
        out[name] = (path, Qwen2Reference(config, merged(weights, delta)))
    out["base"] = (None, Qwen2Reference(config, weights))
    return out


@pytest.fixture(scope="module")
def server(tiny_models, adapters):
    with ServerProcess(
        ["--model", str(tiny_models["f32"]), "--served-model-name", "tiny", "--kv-cache-dtype", "f32",
         "--lora-modules", f"alpha={adapters['alpha'][0]}",
         json.dumps({"name": "beta", "path": str(adapters["beta"][0])}),
         "--max-loras", "2", "--allow-runtime-lora", "--api-key", KEY]
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client(api_key=KEY)


def post(server, path: str, payload: dict, key: str | None = KEY):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(server.url + path, data=json.dumps(payload).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def expected_text(tiny_models, reference, n: int) -> str:
    ids = greedy_generate(reference, PROMPT, n, stop_ids=EOS)
    return LLM(tiny_models["f32"]).decode(ids)


def complete(client, model: str, n: int = 10, **kw) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0, **kw)
    return out.choices[0].text


def test_models_lists_adapters_with_their_parent(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) >= {"tiny", "alpha", "beta"}
    assert cards["alpha"].parent == "tiny" and cards["beta"].parent == "tiny"
    assert getattr(cards["tiny"], "parent", None) is None
    assert client.models.retrieve("alpha").parent == "tiny"


def test_each_adapter_answers_as_its_merged_model(client, adapters, tiny_models):
    answers = {}
    for name in ("alpha", "beta", "tiny"):
        ref = adapters["base" if name == "tiny" else name][1]
        answers[name] = complete(client, name)
        assert answers[name] == expected_text(tiny_models, ref, 10), name
    assert len(set(answers.values())) == 3, "each adapter answers differently from the base"
    chat = client.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    base_chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert chat.model == "alpha" and chat.choices[0].message.content != base_chat.choices[0].message.content
    emb = client.embeddings.create(model="alpha", input="hello").data[0].embedding
    base_emb = client.embeddings.create(model="tiny", input="hello").data[0].embedding
    assert emb != base_emb


def test_an_unknown_adapter_is_a_404_naming_it(client):
    with pytest.raises(openai.NotFoundError) as e:
        complete(client, "delta")
    assert "delta" in str(e.value) and "alpha" in str(e.value)


def test_runtime_load_needs_the_key_and_a_good_adapter(server, client, adapters, tiny_models, tmp_path):
    path = str(adapters["gamma"][0])
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": path}, key=None)[0] == 401
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": path})
    assert status == 200 and "gamma" in body, body
    assert complete(client, "gamma") == expected_text(tiny_models, adapters["gamma"][1], 10)
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": path})
    assert status == 400 and "already loaded" in body
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": path})
    assert status == 400 and "lora_name" in body
    # A corrupt file: a clear 400, and the server keeps serving every model.
    corrupt, _ = write_peft_adapter(tmp_path / "corrupt", seed=64)
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[:100])
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(corrupt)})
    assert status == 400 and "corrupt" in body, body
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "nowhere", "lora_path": str(tmp_path / "x")})
    assert status == 400 and "does not exist" in body and json.loads(body)["error"]["param"] == "lora_path", body
    assert complete(client, "alpha") == expected_text(tiny_models, adapters["alpha"][1], 10)
    assert "broken" not in {m.id for m in client.models.list().data}


def test_unload_lets_a_running_request_finish_and_refuses_new_ones(server, client, adapters, tiny_models):
    status, _ = post(server, "/v1/load_lora_adapter", {"lora_name": "temp", "lora_path": str(adapters["beta"][0])})
    assert status == 200
    want = expected_text(tiny_models, adapters["beta"][1], 40)
    stream = client.completions.create(model="temp", prompt=PROMPT, max_tokens=40, temperature=0, stream=True)
    # The request is in the engine once the response has started: unload under it.
    status, body = post(server, "/v1/unload_lora_adapter", {"lora_name": "temp"})
    assert status == 200 and "temp" in body
    assert "".join(c.choices[0].text for c in stream) == want
    with pytest.raises(openai.NotFoundError) as e:
        complete(client, "temp")
    assert "temp" in str(e.value)
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "temp"})[0] == 404
    assert "temp" not in {m.id for m in client.models.list().data}


def test_metrics_report_adapters(server, client):
    complete(client, "alpha", n=2)
    text = urllib.request.urlopen(server.url + "/metrics", timeout=30).read().decode()
    line = next(l for l in text.splitlines() if l.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line and 'model_name="tiny"' in line


def test_runtime_loading_is_off_by_default(tiny_models, adapters):
    with ServerProcess(["--model", str(tiny_models["f32"]), "--lora-modules", f"alpha={adapters['alpha'][0]}"]) as s:
        status, body = post(s, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["beta"][0])}, key=None)
        assert status == 404 and "--allow-runtime-lora" in body
        assert [m.id for m in s.client().models.list().data][1:] == ["alpha"]


def test_a_bad_lora_module_stops_the_server_with_a_clear_error(tiny_models, tmp_path):
    bad, _ = write_peft_adapter(tmp_path / "big", rank=32, seed=65)
    with pytest.raises(RuntimeError, match="max_lora_rank"):
        ServerProcess(["--model", str(tiny_models["f32"]), "--lora-modules", f"big={bad}"], timeout=60)
