"""End to end against a real `ferry serve` (uvicorn on 127.0.0.1, engine process, tiny llama): the OpenAI SDK,
raw SSE framing, concurrency, sampling, text handling, disconnects, error shapes and metrics."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server_harness import (
    ServerProcess,
    engine_idle,
    metric,
    metric_samples,
    server_process,
    sse_payloads,
    wait_until,
)

MODEL = "tiny"
API_KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_REQUEST_BYTES = 200_000
USER = [{"role": "user", "content": "Tell me about ferry boats."}]


@pytest.fixture(scope="module")
def server(model_dir: Callable[[str], Path]) -> Iterator[ServerProcess]:
    with server_process(
        model_dir("llama"),
        "--served-model-name", MODEL, "--api-key", API_KEY, "--num-pages", "1024",
        "--max-request-bytes", str(MAX_REQUEST_BYTES), "--log-level", "warning",
    ) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=120) as client:
        yield client


def complete(http: httpx.Client, **body: Any) -> dict[str, Any]:
    response = http.post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream_completion(http: httpx.Client, **body: Any) -> list[Any]:
    response = http.post("/v1/completions", json={"model": MODEL, "stream": True, **body})
    assert response.status_code == 200, response.text
    return sse_payloads(response.content)


def texts_by_index(chunks: list[Any]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts


# ---------------------------------------------------------------------------------------------------- basics


def test_probes_models_version_and_openapi(server: ServerProcess, http: httpx.Client) -> None:
    bare = httpx.Client(base_url=server.base_url)
    assert bare.get("/health").json() == {"status": "ok"}
    assert bare.get("/ready").status_code == 200
    assert "version" in bare.get("/version").json()
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"] == [
        {"id": MODEL, "object": "model", "created": models["data"][0]["created"], "owned_by": "ferry",
         "max_model_len": 512, "quantization": "none", "weight_bytes": models["data"][0]["weight_bytes"],
         "kv_cache_dtype": "float32"}
    ]  # fmt: skip
    assert models["data"][0]["weight_bytes"] > 0
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert bare.get("/v1/models", headers={"Authorization": f"bearer {API_KEY}"}).status_code == 200
    assert bare.get("/v1/models", headers={"Authorization": f"Basic {API_KEY}"}).status_code == 401
    assert http.get("/v1/models/other").status_code == 404
    schema = bare.get("/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready", "/metrics"} <= set(
        schema["paths"]
    )
    assert "HTTPValidationError" not in schema["components"]["schemas"], "no route advertises FastAPI's 422 shape"


def test_tokenize_and_detokenize_need_the_key(server: ServerProcess, http: httpx.Client) -> None:
    bare = httpx.Client(base_url=server.base_url)
    for path, body in (("/tokenize", {"prompt": "Ferry"}), ("/detokenize", {"tokens": [5]})):
        assert bare.post(path, json=body).status_code == 401
        assert http.post(path, json=body).status_code == 200


def test_openai_sdk_sync_chat_and_completions(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=0)
    assert chat.object == "chat.completion" and chat.model == MODEL and chat.id.startswith("chatcmpl-")
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert chat.usage is not None and 1 <= chat.usage.completion_tokens <= 8
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    stream = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content

    completion = client.completions.create(model=MODEL, prompt="Ferry boats", max_tokens=8, temperature=0)
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    streamed = client.completions.create(model=MODEL, prompt="Ferry boats", max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text


def test_openai_sdk_async_chat_and_completions(server: ServerProcess) -> None:
    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
        chat, completion = await asyncio.gather(
            client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0),
            client.completions.create(model=MODEL, prompt="Ferry boats", max_tokens=6, temperature=0),
        )
        stream = await client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
        assert chunks[-1].choices == [] and chunks[-1].usage == chat.usage
        text = ""
        async for chunk in await client.completions.create(
            model=MODEL, prompt="Ferry boats", max_tokens=6, temperature=0, stream=True
        ):
            text += chunk.choices[0].text
        assert text == completion.choices[0].text
        await client.close()

    asyncio.run(run())


@pytest.mark.parametrize("include_usage", [False, True])
def test_sse_framing_byte_for_byte(http: httpx.Client, include_usage: bool) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": USER, "max_tokens": 5, "temperature": 0, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    chunks = sse_payloads(response.content)
    ids = {chunk["id"] for chunk in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert all(("usage" in c) == include_usage for c in chunks)
    if include_usage:
        *chunks, last = chunks
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
        assert set(last["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
        assert all(c["usage"] is None for c in chunks)
    assert chunks[0]["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert chunks[-1]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    for chunk in chunks[1:-1]:
        (choice,) = chunk["choices"]
        assert set(choice["delta"]) == {"content"} and choice["finish_reason"] is None


# ---------------------------------------------------------------------------------------------------- behaviour


def test_64_concurrent_streams_match_solo_requests(http: httpx.Client, server: ServerProcess) -> None:
    prompts = [f"Request {i}: ferry boats carry " + "passengers " * (i % 7) for i in range(64)]
    body = {"model": MODEL, "max_tokens": 10, "temperature": 0}
    solo = [complete(http, prompt=prompt, **body)["choices"][0]["text"] for prompt in prompts]

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        response = await client.post("/v1/completions", json={**body, "prompt": prompt, "stream": True})
        assert response.status_code == 200
        return texts_by_index(sse_payloads(response.content))[0]

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, prompt) for prompt in prompts))

    assert asyncio.run(run()) == solo


def test_n_choices_with_a_seed_are_reproducible(http: httpx.Client) -> None:
    body = {"prompt": "Ferry boats", "n": 3, "seed": 1234, "temperature": 1.0, "max_tokens": 12}
    first, second = complete(http, **body), complete(http, **body)
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in first["choices"]]
    assert texts == [c["text"] for c in second["choices"]]
    assert len(set(texts)) > 1, "choice i samples with seed + i: the choices differ"
    prompt_tokens = complete(http, prompt="Ferry boats", max_tokens=1)["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens"] == prompt_tokens, "a prompt shared by n choices counts once"
    assert texts_by_index(stream_completion(http, **body)) == dict(enumerate(texts))


def test_multibyte_text_streams_exactly_as_returned_whole(http: httpx.Client) -> None:
    outputs = []
    for seed in range(6):
        body = {"prompt": "你好，世界 🙂 héllo", "seed": seed, "temperature": 1.0, "max_tokens": 32}
        whole = complete(http, **body)["choices"][0]["text"]
        assert texts_by_index(stream_completion(http, **body))[0] == whole
        outputs.append(whole)
    assert any(ord(ch) > 127 for text in outputs for ch in text), "the test needs multi-byte output to mean anything"


def test_stop_string_split_across_tokens_is_honoured_and_absent(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": USER, "temperature": 0, "max_tokens": 40, "logprobs": True}
    whole = http.post("/v1/chat/completions", json=body).json()
    text = whole["choices"][0]["message"]["content"]
    tokens = [entry["token"] for entry in whole["choices"][0]["logprobs"]["content"]]
    # A stop string made of the last character of token k and the first of token k+1, first seen there.
    for k in range(len(tokens) - 1):
        prefix = "".join(tokens[: k + 1])
        stop = tokens[k][-1:] + tokens[k + 1][:1]
        if len(stop) == 2 and stop.isascii() and text.startswith(prefix) and text.find(stop) == len(prefix) - 1:
            break
    else:
        pytest.fail(f"no usable token boundary in {tokens}")
    expected = text[: len(prefix) - 1]
    stopped = http.post("/v1/chat/completions", json={**body, "stop": [stop, "never appears"]}).json()
    assert stopped["choices"][0]["message"]["content"] == expected
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == k + 2, "tokens up to the one completing the stop string"
    response = http.post("/v1/chat/completions", json={**body, "stop": stop, "stream": True})
    chunks = sse_payloads(response.content)
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert "".join(deltas) == expected and not any(stop in d for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 2.0, "top_p": 1.0, "presence_penalty": -2.0, "frequency_penalty": 2.0, "seed": -(2**63)},
        {"temperature": 0.5, "top_p": 0.0, "seed": 2**63 - 1, "n": 128},
        {"top_k": -1, "min_p": 1.0, "repetition_penalty": 0.5, "min_tokens": 2, "stop_token_ids": [5], "stop": []},
        {"logprobs": 20, "max_tokens": 1, "user": "u", "best_of": 1, "echo": False, "suffix": None},
    ],
)
def test_openai_value_ranges_are_accepted(http: httpx.Client, fields: dict[str, Any]) -> None:
    completion = complete(http, prompt="Ferry", **{"max_tokens": 2, **fields})
    assert len(completion["choices"]) == fields.get("n", 1)


def test_logit_bias_forces_and_bans_tokens(http: httpx.Client, model_dir: Callable[[str], Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    forced = 100
    body = {"prompt": "Ferry boats", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    biased = complete(http, **body, logit_bias={str(forced): 100})
    assert biased["choices"][0]["text"] == tokenizer.decode([forced] * 3)
    # Every token but one banned: only that one can come out.
    ban_all_but = {str(token): -100 for token in range(len(tokenizer)) if token != forced + 1}
    banned = complete(http, **body, logit_bias=ban_all_but)
    assert banned["choices"][0]["text"] == tokenizer.decode([forced + 1] * 3)
    response = http.post("/v1/completions", json={"model": MODEL, **body, "logit_bias": {"999999": 1}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "logit_bias"


def test_echo_returns_the_prompt_and_its_logprobs_streamed_or_not(http: httpx.Client, server: ServerProcess) -> None:
    prompt = "Ferry boats cross the river"
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "echo": True}
    plain = complete(http, **body)["choices"][0]
    assert plain["text"].startswith(prompt) and plain["logprobs"] is None
    scored = complete(http, **body, logprobs=2)["choices"][0]
    assert scored["text"] == plain["text"]
    logprobs = scored["logprobs"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp is not None and lp <= 0 for lp in logprobs["token_logprobs"][1:])
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"][1:])
    assert len(logprobs["tokens"]) == complete(http, **body, logprobs=2)["usage"]["prompt_tokens"] + 5
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY)
    sdk_body = {k: v for k, v in body.items() if k != "ignore_eos"}
    chunks = list(
        client.completions.create(model=MODEL, stream=True, logprobs=2, extra_body={"ignore_eos": True}, **sdk_body)
    )
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert streamed[0].text == prompt and "".join(c.text for c in streamed) == scored["text"]
    tokens = [t for c in streamed if c.logprobs for t in c.logprobs.tokens]
    values = [v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs]
    assert tokens == logprobs["tokens"] and values == logprobs["token_logprobs"]


def test_usage_reports_prefix_cache_hits(http: httpx.Client) -> None:
    prompt = [(7 * i) % 300 + 10 for i in range(40)]  # 2 full pages of 16, then the page of the last token
    first = complete(http, prompt=prompt, max_tokens=2)
    second = complete(http, prompt=prompt, max_tokens=2)
    assert first["usage"]["prompt_tokens"] == 40
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}


def test_n_choices_compute_the_prompt_once(http: httpx.Client) -> None:
    prompt = [(11 * i) % 300 + 10 for i in range(40)]  # 2 full pages of 16, then the page of the last token
    before = metric_samples(http)
    reply = complete(http, prompt=prompt, n=3, max_tokens=2)
    after = metric_samples(http)
    assert len(reply["choices"]) == 3
    hits = metric(after, "ferry:prefix_cache_hits_total") - metric(before, "ferry:prefix_cache_hits_total")
    assert hits == 2 * 32, "choices 1 and 2 share the two full prompt pages choice 0 computed"


def test_logprobs_shapes(http: httpx.Client) -> None:
    chat = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": USER, "max_tokens": 4, "logprobs": True, "top_logprobs": 2},
    ).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    assert all(len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0 for entry in content)
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    completion = complete(http, prompt="Ferry", max_tokens=4, logprobs=2)
    logprobs = completion["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 4
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"]) and logprobs["text_offset"][0] == 0


def test_disconnect_mid_stream_frees_the_engine_pages(http: httpx.Client, server: ServerProcess) -> None:
    wait_until(lambda: engine_idle(http))
    body = {"model": MODEL, "prompt": "Ferry boats", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines, strict=False) if line.startswith("data: ")) == 3
        samples = metric_samples(http)
        assert metric(samples, "ferry:num_requests_running") == 1
        assert metric(samples, "ferry:kv_cache_usage_perc") > 0
    wait_until(lambda: engine_idle(http), timeout=5)


def test_disconnect_while_waiting_for_a_whole_response_frees_the_engine_pages(
    http: httpx.Client, server: ServerProcess
) -> None:
    wait_until(lambda: engine_idle(http))
    body = json.dumps({"model": MODEL, "prompt": "Ferry boats", "max_tokens": 400, "ignore_eos": True}).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: metric(metric_samples(http), "ferry:num_requests_running") == 1)
    wait_until(lambda: engine_idle(http), timeout=5)


# ---------------------------------------------------------------------------------------------------- errors

LONG_PROMPT = [10 + i % 300 for i in range(450)]


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [
        ("/v1/chat/completions", {"messages": USER, "max_tokens": "5"}, 400, "max_tokens", "invalid_value"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": -3}, 400, "max_tokens", "invalid_value"),
        ("/v1/chat/completions", {"messages": USER, "n": 0}, 400, "n", "invalid_value"),
        ("/v1/chat/completions", {"messages": USER, "temperature": -1}, 400, "temperature", "invalid_value"),
        ("/v1/chat/completions", {"messages": USER, "top_p": 1.5}, 400, "top_p", "invalid_value"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "invalid_value"),
        ("/v1/chat/completions", {"messages": USER, "model": "gpt-4o"}, 404, "model", "model_not_found"),
        ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools[0].function",
         "missing_required_parameter"),
        ("/v1/chat/completions", {"messages": USER, "functions": [{"name": "f"}]}, 400, "functions",
         "unsupported_parameter"),
        ("/v1/chat/completions", {"messages": USER, "frobnicate": True}, 400, "frobnicate", "unknown_parameter"),
        ("/v1/chat/completions", {"messages": USER, "stream_options": {"include_usage": True}}, 400,
         "stream_options", "invalid_value"),
        ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 100}, 400, "prompt", "context_length_exceeded"),
        ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 100, "stream": True}, 400, "prompt",
         "context_length_exceeded"),
        ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "prompt", "invalid_value"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt", "invalid_value"),
        ("/v1/completions", {"prompt": "x", "priority": 3}, 400, "priority", "invalid_priority"),
        ("/v1/completions", {}, 400, "prompt", "missing_required_parameter"),
    ],
)  # fmt: skip
def test_bad_inputs_get_openai_errors(
    http: httpx.Client, path: str, body: dict[str, Any], status: int, param: str, code: str
) -> None:
    response = http.post(path, json={"model": MODEL, **body})
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)


@pytest.mark.parametrize(
    ("content", "headers", "status", "code"),
    [
        (b'{"model": "tiny", "messages": [', {}, 400, "invalid_json"),
        (b"[1, 2]", {}, 400, "invalid_request_body"),
        (b"{}", {"Authorization": "Bearer wrong"}, 401, "invalid_api_key"),
        (b"{}", {"Authorization": ""}, 401, "invalid_api_key"),
        (b"x" * (MAX_REQUEST_BYTES + 1), {}, 413, "request_too_large"),
    ],
)
def test_malformed_unauthorized_and_oversized_requests(
    http: httpx.Client, content: bytes, headers: dict[str, str], status: int, code: str
) -> None:
    response = http.post(
        "/v1/chat/completions", content=content, headers={"Content-Type": "application/json", **headers}
    )
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code


def test_unknown_routes_and_methods_use_the_error_shape(http: httpx.Client) -> None:
    for response, status in ((http.get("/v1/nope"), 404), (http.get("/v1/chat/completions"), 405)):
        assert response.status_code == status
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


# ---------------------------------------------------------------------------------------------------- metrics

METRIC_NAMES = [
    "ferry:num_requests_running", "ferry:num_requests_waiting", "ferry:kv_cache_usage_perc",
    "ferry:prompt_tokens_total", "ferry:generation_tokens_total", "ferry:request_success_total",
    "ferry:prefix_cache_queries_total", "ferry:prefix_cache_hits_total", "ferry:num_preemptions_total",
    "ferry:time_to_first_token_seconds_count", "ferry:inter_token_latency_seconds_count",
    "ferry:e2e_request_latency_seconds_count", "ferry:request_queue_time_seconds_count",
    "ferry:iteration_tokens_total_count", "ferry:request_rejected_total", "ferry:cpu_threads",
]  # fmt: skip


def test_metrics_parse_and_move_by_the_right_amounts(http: httpx.Client) -> None:
    wait_until(lambda: engine_idle(http))
    before = metric_samples(http)
    usages = [
        complete(http, prompt=[11, 12, 13, 14, 15], max_tokens=7, ignore_eos=True)["usage"],
        http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 3, "ignore_eos": True}
        ).json()["usage"],
    ]
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 0}).status_code == 400
    after = metric_samples(http)

    names = {name for name, _ in after}
    assert set(METRIC_NAMES) <= names, set(METRIC_NAMES) - names
    assert all(dict(labels).get("model_name") == MODEL for name, labels in after if name.startswith("ferry:"))

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("ferry:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("ferry:generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == 10
    assert delta("ferry:request_success_total", finished_reason="length") == 2
    assert delta("ferry:e2e_request_latency_seconds_count") == 2
    assert delta("ferry:time_to_first_token_seconds_count") == 2
    assert delta("ferry:request_queue_time_seconds_count") == 2
    assert delta("ferry:inter_token_latency_seconds_count") == 8  # every token after each request's first
    assert delta("ferry:iteration_tokens_total_count") >= 7
    assert delta("ferry:prefix_cache_queries_total") >= 5
    assert delta("ferry:request_rejected_total", reason="invalid") == 1
    # The server's engine runs on the CPU: its last step's torch threads, at least one, at most the cores.
    assert 1 <= metric(after, "ferry:cpu_threads") <= len(os.sched_getaffinity(0))
