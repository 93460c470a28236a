"""API hygiene against a real `ferry serve` (the embedded demo model): odd input gets OpenAI's error object and never
a 500, every response carries X-Request-Id (and the request's log lines too), /tokenize and /detokenize answer in
vLLM's shapes, and the OpenAPI document is what the server does: a schema-driven fuzzer (schemathesis) finds no
5xx, no response outside the document, and no input the document forbids that the server takes.

The server runs with --max-model-len 32 and small pages so that whatever the fuzzer asks for finishes quickly.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import hypothesis
import openai
import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server_harness import ServerProcess, server_process, sse_payloads

NAMES = ("demo", "alias")
MODEL = NAMES[0]
MAX_MODEL_LEN = 32
USER = [{"role": "user", "content": "Hello!"}]
FUZZ_EXAMPLES = 25
"""Examples per operation and per mode (schema-valid, schema-violating); derandomized, so every run sends the same."""
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with server_process(
        None, "--served-model-name", *NAMES, "--max-model-len", str(MAX_MODEL_LEN), "--page-size", "4",
        "--num-pages", "2048", "--log-format", "json", "--log-level", "info",
    ) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# ---------------------------------------------------------------------------------------------------- odd input


def raw_post(http: httpx.Client, path: str, body: str) -> httpx.Response:
    """POST `body` exactly as written (json.dumps would refuse some of it, or rewrite its numbers)."""
    return http.post(path, content=body.encode(), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", '{"model": "demo", "messages": [{"role": "user", "content": "\\ud800"}]}',
         "messages[0].content"),
        ("/v1/chat/completions", '{"model": "demo", "messages": [{"role": "user", "content": '
         '[{"type": "text", "text": "a\\udfffb"}]}]}', "messages[0].content[0].text"),
        ("/v1/chat/completions", '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
        ("/v1/completions", '{"model": "demo", "prompt": "x\\ud800"}', "prompt"),
        ("/v1/completions", '{"model": "demo", "prompt": ["ok", "\\udc00"]}', "prompt[1]"),
        ("/v1/completions", '{"model": "demo", "prompt": "x", "stop": ["\\ud83d"]}', "stop[0]"),
        ("/v1/completions", '{"model": "demo", "prompt": "x", "\\ud800": 1}', "\\ud800"),
        ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ],
)  # fmt: skip
def test_lone_surrogates_are_a_400_naming_the_field(http: httpx.Client, path: str, body: str, param: str) -> None:
    error = assert_openai_error(raw_post(http, path, body), 400)
    assert (error["param"], error["code"]) == (param, "invalid_unicode")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"temperature": 1e400}', "temperature"),
        ('{"temperature": NaN}', "temperature"),
        ('{"repetition_penalty": Infinity}', "repetition_penalty"),
        ('{"max_tokens": 1000000000000000000000000000000}', "prompt"),
        ('{"seed": 1000000000000000000000000000000}', "seed"),
        ('{"seed": 1e400}', "seed"),
        ('{"n": 1000000000000000000000000000000}', "n"),
        ('{"top_k": 1.5}', "top_k"),
        ('{"stop_token_ids": [1000000000000000000000000000000]}', "stop_token_ids[0]"),
        ('{"stop_token_ids": [-1]}', "stop_token_ids[0]"),
        ('{"logprobs": 1e30}', "logprobs"),
    ],
)
def test_huge_and_non_finite_numbers_are_a_400(http: httpx.Client, body: str, param: str) -> None:
    fields = json.dumps({"model": MODEL, "prompt": "x"})[:-1] + ", " + body[1:]
    assert assert_openai_error(raw_post(http, "/v1/completions", fields), 400)["param"] == param


def test_numbers_written_as_floats_are_the_integers_they_equal(http: httpx.Client) -> None:
    body = '{"model": "demo", "prompt": [5.0, 6, 7.0], "max_tokens": 2.0, "n": 1.0, "seed": 3.0}'
    response = raw_post(http, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}
    }  # fmt: skip


def test_odd_but_valid_text_is_served(http: httpx.Client) -> None:
    for text in ("a\\u0000b", "\U0001f642 \u202e right-to-left \ufeff", "\\ud83d\\ude42 (a surrogate pair: one char)"):
        response = raw_post(http, "/v1/completions", f'{{"model": "demo", "prompt": "{text}", "max_tokens": 2}}')
        assert response.status_code == 200, (text, response.text)
    long_name = "m" * 100_000
    error = assert_openai_error(http.post("/v1/completions", json={"model": long_name, "prompt": "x"}), 404)
    assert error["code"] == "model_not_found"


# ---------------------------------------------------------------------------------------------------- X-Request-Id


def test_every_response_carries_a_request_id(http: httpx.Client, server: ServerProcess) -> None:
    generated = []
    for response in (
        http.get("/v1/models"),
        http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "n": 0}),
        http.get("/v1/nope"),
        http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}),
        http.get("/metrics"),
    ):
        assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"]), response.headers
        generated.append(response.headers["x-request-id"])
    assert len(set(generated)) == len(generated)

    body = {"model": MODEL, "messages": USER, "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-42"}) as stream:
        assert stream.headers["x-request-id"] == "trace-42"
        assert sse_payloads(stream.read())[-1]["choices"][0]["finish_reason"] == "length"
    sanitised = http.get("/health", headers={"X-Request-Id": b"my id\t\xe9" + b"x" * 300}).headers["x-request-id"]
    assert sanitised == ("myid" + "x" * 300)[:128], "visible ASCII only, at most 128 characters"

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="alias", messages=USER, max_tokens=2, extra_headers={"X-Request-Id": "sdk-7"}
    )
    assert raw.headers["x-request-id"] == "sdk-7"
    assert raw.parse().model == MODEL, "any served name is accepted; responses report the first"

    records = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    assert {"time", "level", "logger", "message", "request_id"} <= set(records[0])
    mine = [r for r in records if r["request_id"] == "trace-42"]
    assert any(r["logger"] == "uvicorn.access" and "/v1/chat/completions" in r["message"] for r in mine), mine


# ---------------------------------------------------------------------------------------------------- tokenize


def test_tokenize_and_detokenize_in_vllms_shapes(http: httpx.Client) -> None:
    tokenized = http.post("/tokenize", json={"model": "alias", "prompt": "Ferry boats", "return_token_strs": True})
    assert tokenized.status_code == 200, tokenized.text
    result = tokenized.json()
    assert set(result) == {"count", "max_model_len", "tokens", "token_strs"}
    assert result["count"] == len(result["tokens"]) == len(result["token_strs"]) and result["count"] > 0
    assert result["max_model_len"] == MAX_MODEL_LEN
    completion = http.post("/v1/completions", json={"model": MODEL, "prompt": "Ferry boats", "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == result["count"]
    detokenized = http.post("/detokenize", json={"tokens": result["tokens"]})
    assert detokenized.json() == {"prompt": "Ferry boats"}

    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 1}).json()
    conversation = http.post("/tokenize", json={"messages": USER}).json()
    assert conversation["count"] == chat["usage"]["prompt_tokens"], "the same rendering as a chat completion"
    without_prompt = http.post("/tokenize", json={"messages": USER, "add_generation_prompt": False}).json()
    assert without_prompt["tokens"] == conversation["tokens"][:-1]
    with_specials = http.post("/tokenize", json={"messages": USER, "add_special_tokens": True}).json()
    assert with_specials["count"] >= conversation["count"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "x", "messages": USER}, 400, None),
        ("/tokenize", {}, 400, None),
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"prompt": "x", "add_generation_prompt": False}, 400, None),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens[1]"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ],
)
def test_tokenize_refusals(http: httpx.Client, path: str, body: dict[str, Any], status: int, param: str) -> None:
    assert assert_openai_error(http.post(path, json=body), status)["param"] == param


# ---------------------------------------------------------------------------------------------------- OpenAPI


def test_the_openapi_document_states_exact_bounds_and_refusals(http: httpx.Client) -> None:
    document = http.get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    (seed,) = (s for s in schemas["CompletionRequest"]["properties"]["seed"]["anyOf"] if s["type"] == "integer")
    assert (seed["minimum"], seed["maximum"]) == (-(2**63), 2**63 - 1)
    assert isinstance(seed["maximum"], int)
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["model"]["enum"] == list(NAMES)
    assert {"type": "array", "maxItems": 0} in chat["functions"]["anyOf"]
    assert chat["verbosity"]["type"] == "null"
    completion = schemas["CompletionRequest"]["properties"]
    assert {"type": "string", "maxLength": 0} in completion["suffix"]["anyOf"]
    assert (completion["priority"]["minimum"], completion["priority"]["maximum"]) == (-(2**31), 2**31 - 1)
    assert completion["echo"]["anyOf"][0]["type"] == "boolean", "echo is honoured, so any boolean is accepted"
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]
    assert list(metrics["content"]) == ["text/plain"]
    assert http.get("/metrics").headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"


OPERATIONS = [
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"), ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/health"),
    ("GET", "/ready"), ("GET", "/metrics"), ("GET", "/metrics.json"), ("GET", "/version"),
    # Pooling: this server's model generates, so these reach their refusal (tests/test_server_pooling.py serves them).
    ("POST", "/v1/embeddings"), ("POST", "/v1/rerank"), ("POST", "/rerank"), ("POST", "/v2/rerank"),
    ("POST", "/v1/score"), ("POST", "/score"),
    # Stored state: responses, conversations, files and batches (test_server_stored_responses.py,
    # test_server_batches.py).
    ("GET", "/v1/responses/{response_id}"), ("DELETE", "/v1/responses/{response_id}"),
    ("GET", "/v1/responses/{response_id}/input_items"), ("POST", "/v1/responses/{response_id}/cancel"),
    ("POST", "/v1/conversations"), ("GET", "/v1/conversations/{conversation_id}"),
    ("POST", "/v1/conversations/{conversation_id}"), ("DELETE", "/v1/conversations/{conversation_id}"),
    ("POST", "/v1/conversations/{conversation_id}/items"), ("GET", "/v1/conversations/{conversation_id}/items"),
    ("GET", "/v1/conversations/{conversation_id}/items/{item_id}"),
    ("DELETE", "/v1/conversations/{conversation_id}/items/{item_id}"),
    ("POST", "/v1/files"), ("GET", "/v1/files"), ("GET", "/v1/files/{file_id}"), ("DELETE", "/v1/files/{file_id}"),
    ("GET", "/v1/files/{file_id}/content"), ("POST", "/v1/batches"), ("GET", "/v1/batches"),
    ("GET", "/v1/batches/{batch_id}"), ("POST", "/v1/batches/{batch_id}/cancel"),
]  # fmt: skip
# Any string is a valid stored object's id, so a path of only such an id has no input that violates its schema.
_ANY_ID = {("GET", "/v1/responses/{response_id}"), ("DELETE", "/v1/responses/{response_id}"),
           ("POST", "/v1/responses/{response_id}/cancel"), ("GET", "/v1/conversations/{conversation_id}"),
           ("DELETE", "/v1/conversations/{conversation_id}"),
           ("GET", "/v1/conversations/{conversation_id}/items/{item_id}"),
           ("DELETE", "/v1/conversations/{conversation_id}/items/{item_id}"),
           ("GET", "/v1/files/{file_id}"), ("DELETE", "/v1/files/{file_id}"), ("GET", "/v1/files/{file_id}/content"),
           ("GET", "/v1/batches/{batch_id}"), ("POST", "/v1/batches/{batch_id}/cancel")}  # fmt: skip
WITH_INPUT = {
    operation
    for operation in OPERATIONS
    if (operation[0] == "POST" or "{" in operation[1]) and operation not in _ANY_ID
}
# Schema-violating input only where there is input: a body or a constrained path parameter.
FUZZ_RUNS = [(method, path, GenerationMode.POSITIVE) for method, path in OPERATIONS] + [
    (method, path, GenerationMode.NEGATIVE) for method, path in OPERATIONS if (method, path) in WITH_INPUT
]


@pytest.fixture(scope="module")
def api_schema(server: ServerProcess) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")


def test_the_fuzzer_covers_every_operation(http: httpx.Client) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    assert {(method.upper(), path) for path, ops in paths.items() for method in ops} == set(OPERATIONS)


@pytest.mark.parametrize(
    ("method", "path", "mode"), FUZZ_RUNS, ids=[f"{m} {p} {mode.value}" for m, p, mode in FUZZ_RUNS]
)
def test_schema_driven_fuzzing_finds_no_5xx_and_no_schema_violation(
    api_schema: schemathesis.BaseSchema, server: ServerProcess, method: str, path: str, mode: GenerationMode
) -> None:
    operation = api_schema[path][method]

    @hypothesis.settings(
        max_examples=FUZZ_EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(operation.as_strategy(generation_mode=mode))
    def fuzz(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=server.base_url, checks=CHECKS, timeout=60)

    fuzz()
