"""Structured outputs (response_format, structured_outputs, StructuredOutputsParams) on the tiny random model.

A random model at temperature 1 is the hardest test of a token mask: it will pick any token the mask lets through,
so every output here must match its constraint exactly, for every seed. The tiny model is served twice (from
tokenizer.json and from GGUF metadata) so both tokenizer sources feed the grammar's vocabulary.
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from conftest import PROMPT
from novainfer import InvalidParameterError, SamplingParams, StructuredOutputsParams
from server_process import ServerProcess
from test_server import assert_openai_error, post_json

MODELS = ["tiny", "tiny-gguf"]
SEEDS = range(8)
MESSAGES = [{"role": "user", "content": "Describe a person."}]

# Bounded everywhere, so every output can finish well within max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["dev", "ops", "pm"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_models):
    with ServerProcess(
        ["--model", str(tiny_models["f32"]), "--served-model-name", "tiny",
         "--model", str(tiny_models["gguf"]), "--served-model-name", "tiny-gguf",
         "--kv-cache-bytes", str(8 << 20)]
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.mark.parametrize("model", MODELS)
def test_json_schema_outputs_always_validate(client, model):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in SEEDS:
        r = client.chat.completions.create(
            model=model, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=120,
            response_format=response_format,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        value = json.loads(choice.message.content)
        jsonschema.validate(value, PERSON)
        assert " " not in choice.message.content.replace(value["name"], ""), "JSON is compact by default"


@pytest.mark.parametrize("model", MODELS)
def test_regex_choice_and_grammar_outputs_match(client, model):
    for seed in SEEDS:
        r = client.completions.create(
            model=model, prompt=PROMPT, temperature=1.0, seed=seed, max_tokens=30,
            extra_body={"structured_outputs": {"regex": r"[a-z]{2,5}-[0-9]{2}"}},
        )
        assert r.choices[0].finish_reason == "stop"
        assert re.fullmatch(r"[a-z]{2,5}-[0-9]{2}", r.choices[0].text), r.choices[0].text

        choices = ["alpha", "beta", "gamma delta"]
        r = client.chat.completions.create(
            model=model, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=30,
            extra_body={"structured_outputs": {"choice": choices}},
        )
        assert r.choices[0].message.content in choices
        assert r.choices[0].finish_reason == "stop"

        grammar = 'start: "(" num ("," num)* ")"\nnum: /[1-9][0-9]?/'
        r = client.completions.create(
            model=model, prompt=PROMPT, temperature=1.0, seed=seed, max_tokens=60,
            extra_body={"structured_outputs": {"grammar": grammar}},
        )
        if r.choices[0].finish_reason == "stop":
            assert re.fullmatch(r"\((?:[1-9][0-9]?)(?:,[1-9][0-9]?)*\)", r.choices[0].text), r.choices[0].text


def test_json_object_gives_objects(client):
    finished = 0
    for seed in SEEDS:
        r = client.chat.completions.create(
            model="tiny", messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=200,
            response_format={"type": "json_object"},
        )
        c = r.choices[0]
        assert c.message.content.startswith("{")
        if c.finish_reason == "stop":
            finished += 1
            assert isinstance(json.loads(c.message.content), dict), c.message.content
    assert finished > 0


def test_a_cut_constrained_output_ends_with_length(client):
    r = client.completions.create(
        model="tiny", prompt=PROMPT, temperature=1.0, seed=1, max_tokens=4,
        extra_body={"structured_outputs": {"regex": "x{40}"}},
    )
    assert r.choices[0].finish_reason == "length"
    assert re.fullmatch("x+", r.choices[0].text)


def test_streamed_constrained_output_and_n(client):
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=1.0, seed=3, max_tokens=120, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)

    r = client.completions.create(
        model="tiny", prompt=PROMPT, temperature=1.0, seed=5, max_tokens=20, n=4,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    )
    assert len(r.choices) == 4
    assert all(c.text in {"yes", "no", "maybe"} and c.finish_reason == "stop" for c in r.choices)


def test_unconstrained_requests_in_the_same_batch_are_unaffected(client):
    def plain() -> str:
        r = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=24)
        return r.choices[0].text

    alone = plain()
    results: list[str] = []

    def constrained(seed: int) -> None:
        client.completions.create(
            model="tiny", prompt=PROMPT, temperature=1.0, seed=seed, max_tokens=24,
            extra_body={"structured_outputs": {"regex": "[0-9]+"}},
        )

    threads = [threading.Thread(target=constrained, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    results = [plain() for _ in range(2)]
    for t in threads:
        t.join()
    assert results == [alone, alone]


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs", "both"),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", ""),
        ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs", "nothing_here"),
        ({"structured_outputs": {"json": {"type": "no-such-type"}}}, "structured_outputs", "no-such-type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}},
         "response_format", "no-such-type"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
    ],
)
def test_bad_constraints_are_400_naming_the_problem(server, extra, param, needle):
    for path, body in [
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4}),
        ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}),
    ]:
        status, _, raw = post_json(server, path, {**body, **extra})
        err = assert_openai_error(status, raw, 400, param)
        assert needle in err["message"], err


def test_response_format_text_is_a_no_op(client):
    a = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=8)
    b = client.completions.create(
        model="tiny", prompt=PROMPT, temperature=0, max_tokens=8, extra_body={"response_format": {"type": "text"}}
    )
    assert a.choices[0].text == b.choices[0].text


def test_python_structured_outputs_params(tiny_llm):
    choices = ["red", "green", "blue"]
    params = SamplingParams(
        temperature=1.0, seed=7, max_tokens=10, n=3,
        structured_outputs=StructuredOutputsParams(choice=choices),
    )
    assert params.structured_outputs == StructuredOutputsParams(choice=choices)
    out = tiny_llm.generate([PROMPT], params)[0]
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.outputs)

    params = SamplingParams(
        temperature=1.0, seed=2, max_tokens=120, structured_outputs=StructuredOutputsParams(json=PERSON)
    )
    assert json.loads(params.structured_outputs.json) == PERSON
    text = tiny_llm.generate([PROMPT], params)[0].outputs[0].text
    jsonschema.validate(json.loads(text), PERSON)


def test_python_errors_name_structured_outputs(tiny_llm):
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", choice=["a"]))
    assert e.value.param == "structured_outputs"
    with pytest.raises(InvalidParameterError) as e:
        tiny_llm.generate([PROMPT], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
    assert e.value.param == "structured_outputs"
