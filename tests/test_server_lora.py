"""LoRA adapters served over HTTP: `--lora-modules`, `model=<adapter>` through the OpenAI SDK and LangChain (PEFT's
own model is the oracle), /v1/models' cards, vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (an unload
never breaks a running request), refusals with their reasons, `vllm:lora_requests_info`, start-up errors and the
playground's model picker.

One server for the module: a tiny Llama named `tiny` (and `tiny-alias`) with two adapters from the start (the JSON
form gives one of them the alias as its parent) and runtime updating on. Tests that load adapters unload them
again, so every test starts from those two.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import openai
import pytest
import schemathesis
import torch
from fastapi.testclient import TestClient
from schemathesis import GenerationMode
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.config import EngineConfig
from engine.core.stats import EngineStats
from server import cli
from server.app import create_app
from server.lifecycle import Lifecycle
from server.lora import LoRAStartupError, startup_registry
from server.metrics import ServerMetrics
from server.settings import LoRAModule, ServerSettings
from tests.lora_adapters import build_adapter_dir, build_adapters, peft_model
from tests.model_factory import build_model_dir
from tests.server_harness import ServerProcess, metric, metric_samples, parse_metrics, server_process
from tests.test_server_hygiene import CHECKS
from tests.test_server_startup import serve_until_exit
from tests.test_ui import chromium, js, needs_browser, set_value, text_of, wait_for

pytestmark = pytest.mark.timeout(300)

NAMES = ("tiny", "tiny-alias")
STATIC = ("attn-r8", "mlp-r4")
"""The adapters served from the start: attn-r8 as `name=path`, mlp-r4 in the JSON form with parent tiny-alias."""
RUNTIME = "all-r16"
"""The adapter the tests load and unload while serving."""
PROMPT = [5, 6, 7, 8, 9, 10]
USER = [{"role": "user", "content": "Tell me about ferry boats."}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_adapters(tiny_llama, tmp_path_factory.mktemp("adapters"), (*STATIC, RUNTIME))


@pytest.fixture(scope="module")
def unfit(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters the server must refuse, by what is wrong with them."""
    root = tmp_path_factory.mktemp("unfit")
    other_base = build_model_dir(root / "other-base", "llama", intermediate_size=96)
    return {
        "rank": build_adapter_dir(tiny_llama, root / "r32", r=32, lora_alpha=32, target_modules=["q_proj"]),
        "dora": build_adapter_dir(
            tiny_llama, root / "dora", r=4, lora_alpha=8, target_modules=["v_proj"], use_dora=True
        ),
        "missing": root / "absent",
        "other-base": build_adapter_dir(other_base, root / "other", r=4, lora_alpha=8, target_modules=["up_proj"]),
    }


@pytest.fixture(scope="module")
def server(tiny_llama: Path, adapters: dict[str, Path]) -> Iterator[ServerProcess]:
    json_module = f'{{"name": "mlp-r4", "path": "{adapters["mlp-r4"]}", "base_model_name": "tiny-alias"}}'
    with server_process(
        tiny_llama, "--served-model-name", *NAMES, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--lora-modules", f"attn-r8={adapters['attn-r8']}", "--lora-modules", json_module,
        "--allow-runtime-lora-updating", "--log-level", "warning",
    ) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


@torch.no_grad()
def peft_text(base: Path, adapter: Path | None, prompt: list[int], max_new_tokens: int = MAX_TOKENS) -> str:
    """PEFT's greedy answer to `prompt` with `adapter` (None: the base model alone), decoded as the server decodes."""
    if adapter is None:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    else:
        model = peft_model(base, adapter)
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(prompt) :]
    tokenizer = AutoTokenizer.from_pretrained(base)
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def completion_text(client: openai.OpenAI, model: str, prompt: list[int] = PROMPT) -> str:
    response = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert response.model == model, "the response names the adapter (or base name) it ran"
    return response.choices[0].text


def load(http: httpx.Client, name: str, path: Path | str, **extra: Any) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra})


def unload(http: httpx.Client, name: str, **extra: Any) -> httpx.Response:
    return http.post("/v1/unload_lora_adapter", json={"lora_name": name, **extra})


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return response.json()["error"]


# ------------------------------------------------------------------------------------------------ serving


def test_models_lists_each_adapter_with_its_parent(http: httpx.Client, adapters: dict[str, Path]) -> None:
    cards = http.get("/v1/models").json()["data"]
    assert [card["id"] for card in cards] == [*NAMES, *STATIC]
    for card in cards[: len(NAMES)]:
        assert "root" not in card and "parent" not in card
    by_id = {card["id"]: card for card in cards}
    assert (by_id["attn-r8"]["parent"], by_id["mlp-r4"]["parent"]) == ("tiny", "tiny-alias")
    for name in STATIC:
        assert by_id[name]["root"] == str(adapters[name].resolve())
        assert by_id[name]["max_model_len"] == by_id["tiny"]["max_model_len"]
        assert http.get(f"/v1/models/{name}").json() == by_id[name]
    assert error_of(http.get("/v1/models/absent"), 404)["code"] == "model_not_found"


def test_the_sdk_serves_each_adapter_as_peft_does(
    client: openai.OpenAI, http: httpx.Client, tiny_llama: Path, adapters: dict[str, Path]
) -> None:
    """Completions, chat (whole and streamed) and responses with `model=<adapter>`: the greedy answer is PEFT's for
    the same prompt tokens, and differs from the base model's."""
    base_text = completion_text(client, "tiny")
    assert base_text == peft_text(tiny_llama, None, PROMPT)
    chat_prompt = http.post("/tokenize", json={"model": "attn-r8", "messages": USER}).json()["tokens"]
    for name in STATIC:
        text = completion_text(client, name)
        assert text == peft_text(tiny_llama, adapters[name], PROMPT), name
        assert text != base_text, f"{name} must change this prompt's answer for the comparison to mean anything"

        chat = client.chat.completions.create(model=name, messages=USER, max_tokens=MAX_TOKENS, temperature=0)
        assert chat.model == name and chat.usage is not None and chat.usage.prompt_tokens == len(chat_prompt)
        assert chat.choices[0].message.content == peft_text(tiny_llama, adapters[name], chat_prompt), name
        chunks = list(
            client.chat.completions.create(model=name, messages=USER, max_tokens=MAX_TOKENS, temperature=0, stream=True)
        )
        assert {chunk.model for chunk in chunks} == {name}
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content

        response = client.responses.create(model=name, input=USER, max_output_tokens=MAX_TOKENS, temperature=0)
        assert response.model == name and response.output_text == chat.choices[0].message.content


def test_langchain_chat_openai_with_an_adapter(server: ServerProcess, client: openai.OpenAI) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="none", model="mlp-r4", max_tokens=MAX_TOKENS,
                     temperature=0, max_retries=0)  # fmt: skip
    reply = llm.invoke(USER[0]["content"])
    chat = client.chat.completions.create(model="mlp-r4", messages=USER, max_tokens=MAX_TOKENS, temperature=0)
    assert reply.content == chat.choices[0].message.content
    assert reply.response_metadata["model_name"] == "mlp-r4"


def test_a_forced_tool_call_and_logprobs_with_an_adapter(client: openai.OpenAI) -> None:
    """Tools per adapter: a named tool_choice gives a call whose arguments match the tool's schema, reported under
    the adapter's name, with logprobs for its tokens."""
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
        },
    }
    chat = client.chat.completions.create(
        model="attn-r8", messages=USER, tools=[tool], tool_choice={"type": "function", "function": {"name": "lookup"}},
        max_tokens=40, temperature=0, logprobs=True,
    )  # fmt: skip
    assert chat.model == "attn-r8"
    calls = chat.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "lookup"
    assert isinstance(json.loads(calls[0].function.arguments)["id"], int)
    assert chat.choices[0].logprobs is not None


def test_pooling_endpoints_refuse_an_adapter_by_name(http: httpx.Client) -> None:
    for path, body in (("/v1/embeddings", {"input": "x"}), ("/v1/score", {"text_1": "a", "text_2": "b"})):
        error = error_of(http.post(path, json={"model": "attn-r8", **body}), 400)
        assert (error["code"], error["param"]) == ("model_does_not_pool", "model")
        assert "'attn-r8' is a LoRA adapter" in error["message"] and "'tiny'" in error["message"]
    assert error_of(http.post("/v1/completions", json={"model": "absent", "prompt": "x"}), 404)["param"] == "model"


# ----------------------------------------------------------------------------------------- load and unload


def test_load_use_unload_and_reload_while_a_request_runs(
    http: httpx.Client, client: openai.OpenAI, tiny_llama: Path, adapters: dict[str, Path]
) -> None:
    response = load(http, RUNTIME, adapters[RUNTIME])
    assert response.status_code == 200 and response.text == f"Success: LoRA adapter '{RUNTIME}' added successfully."
    assert RUNTIME in [card["id"] for card in http.get("/v1/models").json()["data"]]
    expected = peft_text(tiny_llama, adapters[RUNTIME], PROMPT)
    assert completion_text(client, RUNTIME) == expected

    # A long request with the adapter, unloaded after its first token: it still finishes, as it would have.
    long = {"model": RUNTIME, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    whole = http.post("/v1/completions", json=long).json()["choices"][0]["text"]
    with http.stream("POST", "/v1/completions", json={**long, "stream": True}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        response = unload(http, RUNTIME)
        assert response.text == f"Success: LoRA adapter '{RUNTIME}' removed successfully."
        assert metric(metric_samples(http), "ferry:num_requests_running") == 1, "unloaded while the request ran"
        rest = [line for line in lines if line.startswith("data: ")]
    payloads = [json.loads(line[len("data: ") :]) for line in [first, *rest[:-1]]]
    assert rest[-1] == "data: [DONE]"
    assert "".join(p["choices"][0]["text"] for p in payloads) == whole
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"

    error = error_of(http.post("/v1/completions", json={"model": RUNTIME, "prompt": "x"}), 404)
    assert error["code"] == "model_not_found"
    assert error_of(unload(http, RUNTIME), 404)["code"] == "lora_not_found"
    assert RUNTIME not in [card["id"] for card in http.get("/v1/models").json()["data"]]

    # Loaded again: served as before, under a new id (1 and 2 are the start-up adapters').
    assert load(http, RUNTIME, adapters[RUNTIME]).status_code == 200
    assert completion_text(client, RUNTIME) == expected
    error = error_of(unload(http, RUNTIME, lora_int_id=1), 404)
    assert (error["param"], error["code"]) == ("lora_int_id", "lora_not_found")
    assert f"The LoRA adapter '{RUNTIME}' is loaded with id" in error["message"]
    assert unload(http, RUNTIME).status_code == 200


def test_load_inplace_replaces_an_adapter(http: httpx.Client, client: openai.OpenAI, adapters: dict[str, Path]) -> None:
    assert load(http, RUNTIME, adapters["attn-r8"]).status_code == 200
    assert completion_text(client, RUNTIME) == completion_text(client, "attn-r8")
    assert error_of(load(http, RUNTIME, adapters[RUNTIME]), 400)["code"] == "lora_name_taken"
    assert load(http, RUNTIME, adapters[RUNTIME], load_inplace=True).status_code == 200
    assert completion_text(client, RUNTIME) != completion_text(client, "attn-r8")
    assert unload(http, RUNTIME).status_code == 200


@pytest.mark.parametrize(
    ("what", "reason"),
    [
        ("rank", "has rank 32, above --max-lora-rank 16"),
        ("dora", "uses DoRA (use_dora), which Ferry does not serve"),
        ("missing", "adapter_config.json is missing"),
        ("other-base", "was not trained on this model"),
    ],
)
def test_an_adapter_that_does_not_fit_is_refused_with_the_reason(
    http: httpx.Client, unfit: dict[str, Path], what: str, reason: str
) -> None:
    error = error_of(load(http, "unfit", unfit[what]), 400)
    assert (error["param"], error["code"]) == ("lora_path", "invalid_lora")
    assert reason in error["message"], error["message"]
    assert error_of(http.get("/v1/models/unfit"), 404)["code"] == "model_not_found"


def test_names_and_bodies_that_are_refused(http: httpx.Client, adapters: dict[str, Path]) -> None:
    for name in (*NAMES, *STATIC):
        error = error_of(load(http, name, adapters[RUNTIME]), 400)
        assert (error["param"], error["code"]) == ("lora_name", "lora_name_taken"), name
    assert error_of(unload(http, "absent"), 404)["message"] == "The LoRA adapter 'absent' cannot be found."
    assert error_of(unload(http, "tiny"), 404)["code"] == "lora_not_found", "the base model cannot be unloaded"
    assert error_of(http.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400)["param"] == "lora_path"
    assert error_of(load(http, "", adapters[RUNTIME]), 400)["param"] == "lora_name"
    assert error_of(unload(http, "x", lora_int_id=0), 400)["param"] == "lora_int_id"


# --------------------------------------------------------------------------------------- metrics, document


def test_lora_requests_info_follows_the_engine(http: httpx.Client, client: openai.OpenAI) -> None:
    started = time.time()
    completion_text(client, "attn-r8")
    samples = metric_samples(http)
    info = {dict(labels)["running_lora_adapters"]: value for (name, labels), value in samples.items()
            if name == "vllm:lora_requests_info"}  # fmt: skip
    assert info["attn-r8"] >= started, "the series of the step that ran attn-r8, stamped with its time"
    assert {dict(labels)["max_lora"] for name, labels in samples if name == "vllm:lora_requests_info"} == {"2"}


def test_lora_requests_info_is_vllms_gauge() -> None:
    assert "lora_requests_info" not in ServerMetrics("m").render().decode(), "absent without --enable-lora"
    metrics = ServerMetrics("m", max_loras=4)
    before = time.time()
    metrics.observe_engine_stats(
        EngineStats(2, 1, 100, 60, 0.4, 64, 16, 1, 5, 8, running_lora_adapters=("a", "b"), waiting_lora_adapters=("c",))
    )
    text = metrics.render().decode()
    assert "# HELP vllm:lora_requests_info Running stats on lora requests.\n" in text
    assert "# TYPE vllm:lora_requests_info gauge\n" in text
    ((labels, value),) = [(dict(k[1]), v) for k, v in parse_metrics(text).items() if k[0] == "vllm:lora_requests_info"]
    assert labels == {"max_lora": "4", "running_lora_adapters": "a,b", "waiting_lora_adapters": "c"}
    assert before <= value <= time.time()


def test_the_openapi_document_describes_the_lora_endpoints(http: httpx.Client) -> None:
    document = http.get("/openapi.json").json()
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert list(document["paths"][path]["post"]["responses"]["200"]["content"]) == ["text/plain"]
    schemas = document["components"]["schemas"]
    assert "enum" not in schemas["ChatCompletionRequest"]["properties"]["model"], "adapters come and go"
    assert schemas["LoadLoRAAdapterRequest"]["required"] == ["lora_name", "lora_path"]


def test_without_runtime_updating_the_document_lists_the_adapters(tiny_llama: Path, adapters: dict[str, Path]) -> None:
    """The app alone (TestClient outside `with` runs no lifespan, so no engine): adapters from the start only, so
    `model` takes the served names and theirs, and the load and unload routes do not exist."""
    settings = ServerSettings(
        served_model_name=("tiny",), lora_modules=(LoRAModule("attn-r8", str(adapters["attn-r8"])),)
    )
    app = create_app(EngineConfig.of(model=str(tiny_llama), enable_lora=True), settings, Lifecycle(1.0))
    http = TestClient(app)
    document = http.get("/openapi.json").json()
    assert document["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]["enum"] == [
        "tiny",
        "attn-r8",
    ]
    assert "/v1/load_lora_adapter" not in document["paths"] and "LoadLoRAAdapterRequest" not in str(document)
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}).status_code == 404


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda mode: mode.value)
@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_schema_driven_fuzzing_of_the_lora_endpoints(server: ServerProcess, path: str, mode: GenerationMode) -> None:
    operation = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")[path]["POST"]

    @hypothesis.settings(max_examples=10, derandomize=True, deadline=None, database=None,
                         phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
                         suppress_health_check=list(hypothesis.HealthCheck))  # fmt: skip
    @hypothesis.given(operation.as_strategy(generation_mode=mode))
    def fuzz(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=server.base_url, checks=CHECKS, timeout=60)

    fuzz()


# ------------------------------------------------------------------------------------------------ start-up


def test_lora_modules_flags() -> None:
    parser = argparse.ArgumentParser()
    cli.add_serve_parser(parser.add_subparsers())
    json_form = '{"name": "c", "path": "/w", "base_model_name": "m"}'
    args = parser.parse_args(["serve", "--lora-modules", "a=/x", "b=/y=z", "--lora-modules", json_form])
    assert cli.build_settings(args).lora_modules == (
        LoRAModule("a", "/x"),
        LoRAModule("b", "/y=z"),
        LoRAModule("c", "/w", "m"),
    )
    for text, words in (
        ("no-equals", "neither name=path nor a JSON object"),
        ("=/x", "needs a name and a path"),
        ('{"name": "a"', "is not JSON"),
        ('{"name": "a", "path": "/x", "rank": 4}', "object of name, path and base_model_name"),
        ('{"name": "a", "path": 4}', "name and path are strings"),
    ):
        with pytest.raises(ValueError, match=words):
            LoRAModule.from_flag(text)
    with pytest.raises(ValueError, match="a repeat"):
        ServerSettings(lora_modules=(LoRAModule("a", "/x"), LoRAModule("a", "/y")))


def test_startup_refusals_name_the_flag(tiny_llama: Path, adapters: dict[str, Path]) -> None:
    config = EngineConfig.of(model=str(tiny_llama), enable_lora=True)
    module = LoRAModule("a", str(adapters["attn-r8"]))
    cases: list[tuple[EngineConfig, ServerSettings, str]] = [
        (EngineConfig.of(model=str(tiny_llama)), ServerSettings(lora_modules=(module,)), "--lora-modules serves"),
        (EngineConfig.of(model=str(tiny_llama)), ServerSettings(allow_runtime_lora_updating=True), "--enable-lora"),
        (config, ServerSettings(lora_modules=(LoRAModule("tiny", module.path),)), "--lora-modules tiny: 'tiny' is"),
        (
            config,
            ServerSettings(lora_modules=(LoRAModule("a", module.path, "other"),)),
            "--lora-modules a: base_model_name 'other' is not a served model name (tiny)",
        ),
    ]
    for engine_config, settings, words in cases:
        with pytest.raises(LoRAStartupError, match=words.replace("(", r"\(").replace(")", r"\)")):
            startup_registry(engine_config, settings, ("tiny",))


def test_the_server_refuses_to_start_with_bad_lora_flags(tiny_llama: Path, unfit: dict[str, Path]) -> None:
    result = serve_until_exit("--model", str(tiny_llama), "--lora-modules", f"big={unfit['rank']}", timeout=120)
    assert result.returncode == 2 and "--lora-modules serves LoRA adapters, which needs --enable-lora" in result.stderr
    result = serve_until_exit(
        "--model", str(tiny_llama), "--enable-lora", "--lora-modules", f"big={unfit['rank']}", timeout=120
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--lora-modules big: Cannot serve this LoRA adapter:" in result.stderr
    assert "has rank 32, above --max-lora-rank 16" in result.stderr


# ---------------------------------------------------------------------------------------------- playground


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


@needs_browser
def test_the_playground_chats_with_the_chosen_adapter(
    server: ServerProcess, http: httpx.Client, browser: Any, adapters: dict[str, Path]
) -> None:
    browser.get(server.base_url)
    wait_for(browser, lambda d: text_of(d, "model-name") == "tiny")
    options = "return [...document.getElementById('model-select').options].map((o) => [o.value, o.textContent])"
    assert js(browser, "return document.getElementById('model-picker').hidden") is False
    assert js(browser, options) == [
        ["tiny", "tiny"],
        ["attn-r8", "attn-r8 (LoRA adapter of tiny)"],
        ["mlp-r4", "mlp-r4 (LoRA adapter of tiny-alias)"],
    ]
    # What the page sends, recorded on the way out.
    js(
        browser,
        """window.__sent = [];
        const realFetch = window.fetch.bind(window);
        window.fetch = (url, init) => {
            if (String(url).endsWith('v1/chat/completions')) window.__sent.push(JSON.parse(init.body));
            return realFetch(url, init);
        };""",
    )
    set_value(browser, "model-select", "attn-r8")
    js(browser, "document.getElementById('model-select').dispatchEvent(new Event('change'))")
    assert text_of(browser, "model-name") == "attn-r8"
    set_value(browser, "max-tokens", str(MAX_TOKENS))
    js(browser, "document.getElementById('prompt').value = 'Hello'; document.getElementById('send').click()")
    wait_for(browser, lambda d: js(d, "return document.querySelector('.msg.assistant')?.dataset.state") == "done")
    assert [body["model"] for body in js(browser, "return window.__sent")] == ["attn-r8"]

    # An adapter loaded while the page is open shows up when the picker is opened; once unloaded, it is gone.
    assert load(http, RUNTIME, adapters[RUNTIME]).status_code == 200
    choices = "return [...document.getElementById('model-select').options].map((o) => o.value)"
    try:
        js(browser, "document.getElementById('model-select').focus()")
        wait_for(browser, lambda d: RUNTIME in js(d, choices))
        assert js(browser, "return document.getElementById('model-select').value") == "attn-r8", "the choice stays"
    finally:
        assert unload(http, RUNTIME).status_code == 200
    js(browser, "document.getElementById('model-select').blur(); document.getElementById('model-select').focus()")
    wait_for(browser, lambda d: RUNTIME not in js(d, choices))
