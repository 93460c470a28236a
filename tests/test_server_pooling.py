"""/v1/embeddings, /v1/rerank and /v1/score end to end: a real `ferry serve` per model kind (a BERT embedder in
sentence-transformers' files with Matryoshka sizes added to its config.json, a BERT cross-encoder, a Qwen3 causal LM
served as a yes/no reranker, a generate-only llama), driven by the clients people use (the OpenAI SDK, LangChain,
litellm) and by raw HTTP for the errors.

Oracles: sentence-transformers itself (encode, encode_query / encode_document, CrossEncoder.predict), the engine in
process (engine.api.pool_batch), and transformers' own logits for the yes/no reranker's P(yes).
"""

from __future__ import annotations

import base64
import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from engine.api import pool_batch
from engine.config import EngineConfig
from engine.pooling.config import pooling_config
from server.client import EngineClient
from server.lifecycle import Lifecycle
from server.lora import LoRARegistry
from server.metrics import ServerMetrics
from server.openai.errors import APIError
from server.openai.generation import ServingContext
from server.openai.pooling import pooling_model
from server.tokens import Tokenizer
from tests.pooling_models import (
    YES_NO,
    build_bert_cross_encoder,
    build_bert_embedder,
    build_qwen3_reranker,
)
from tests.server_harness import engine_idle, metric, metric_samples, running_server, wait_until
from tests.test_ui import browser, console_errors, js, needs_browser, text_of, wait_for  # noqa: F401 (a fixture)

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # litellm must not fetch its price list

EMBEDDER, CROSS_ENCODER, RERANKER, GENERATOR = "embedder", "cross-encoder", "reranker", "generator"
PROMPTS = {"query": "query: ", "document": "passage: "}
MAX_SEQ_LENGTH = 64
MATRYOSHKA = [8, 16]
TEXTS = ["Ferry boats carry passengers across the river.", "A dictionary that remembers insertion order.", "héllo"]
QUERY = "which boat crosses the river?"
DOCUMENTS = [
    "Return a new deque object initialized left-to-right.",
    "ferry boats carry passengers across the river",
    "The river is wide and the boat is slow.",
    "Dict subclass for counting hashable objects.",
]
LONG_TEXT = " ".join(["ferry boats carry passengers across the wide river"] * 12)  # well over 64 tokens
TEMPLATE = "<Query>: {query}\n<Document>: {document}\n<Relevant>:"  # --reranker-template's default
CROSS_ENCODER_KEY = "sk-pooling"
"""The cross-encoder's server wants an API key: the rerank and score routes outside /v1 are guarded too."""
API_KEYS: dict[str, str] = {}
"""Base URL -> the API key its server was started with."""


def _server(directory: Path, name: str, *flags: str) -> Iterator[str]:
    with running_server(directory, "--served-model-name", name, "--log-level", "warning", *flags) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = build_bert_embedder(
        tmp_path_factory.mktemp("embedder"), normalize=True, prompts=PROMPTS, max_seq_length=MAX_SEQ_LENGTH
    )
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["matryoshka_dimensions"] = MATRYOSHKA
    config_path.write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def embedder(embedder_dir: Path) -> Iterator[str]:
    yield from _server(embedder_dir, EMBEDDER)


@pytest.fixture(scope="module")
def st_embedder(embedder_dir: Path) -> SentenceTransformer:
    return SentenceTransformer(str(embedder_dir), device="cpu")


@pytest.fixture(scope="module")
def bert_tokenizer(embedder_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(embedder_dir))


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bert_cross_encoder(tmp_path_factory.mktemp("cross-encoder"))


@pytest.fixture(scope="module")
def cross_encoder(cross_encoder_dir: Path) -> Iterator[str]:
    for base_url in _server(cross_encoder_dir, CROSS_ENCODER, "--api-key", CROSS_ENCODER_KEY):
        API_KEYS[base_url] = CROSS_ENCODER_KEY
        yield base_url


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen3_reranker(tmp_path_factory.mktemp("reranker"))


@pytest.fixture(scope="module")
def reranker(reranker_dir: Path) -> Iterator[str]:
    yield from _server(reranker_dir, RERANKER, "--reranker-tokens", ",".join(YES_NO))


@pytest.fixture(scope="module")
def generator(model_dir: Callable[[str], Path]) -> Iterator[str]:
    yield from _server(model_dir("llama"), GENERATOR)


def _auth(base_url: str) -> dict[str, str]:
    key = API_KEYS.get(base_url)
    return {"Authorization": f"Bearer {key}"} if key else {}


def _post(base_url: str, path: str, **body: Any) -> dict[str, Any]:
    response = httpx.post(f"{base_url}{path}", json=body, headers=_auth(base_url), timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _embed(base_url: str, **body: Any) -> np.ndarray:
    data = _post(base_url, "/v1/embeddings", model=EMBEDDER, **body)["data"]
    assert [item["index"] for item in data] == list(range(len(data)))
    return np.array([item["embedding"] for item in data])


def _error(base_url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    response = httpx.post(f"{base_url}{path}", json=body, headers=_auth(base_url), timeout=120)
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return response.status_code, error


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# ------------------------------------------------------------------------------------------------ embeddings


def test_openai_sdk_base64_and_float_carry_the_engines_vectors(
    embedder: str, embedder_dir: Path, st_embedder: SentenceTransformer, bert_tokenizer: PreTrainedTokenizerBase
) -> None:
    client = openai.OpenAI(base_url=f"{embedder}/v1", api_key="none", max_retries=0)
    by_default = client.embeddings.create(model=EMBEDDER, input=TEXTS)  # the SDK asks for base64 and decodes it
    as_floats = client.embeddings.create(model=EMBEDDER, input=TEXTS, encoding_format="float")
    assert by_default.model == EMBEDDER and by_default.object == "list"
    vectors = [item.embedding for item in by_default.data]
    assert vectors == [item.embedding for item in as_floats.data]  # float32 values in both: exactly equal
    raw = _post(embedder, "/v1/embeddings", model=EMBEDDER, input=TEXTS[0], encoding_format="base64")
    assert isinstance(raw["data"][0]["embedding"], str)
    assert np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4").tolist() == vectors[0]

    ids = [bert_tokenizer.encode(text) for text in TEXTS]
    assert by_default.usage.prompt_tokens == by_default.usage.total_tokens == sum(map(len, ids))
    in_process = pool_batch(ids, EngineConfig.of(model=str(embedder_dir)))
    np.testing.assert_allclose(vectors, in_process, atol=1e-6)
    np.testing.assert_allclose(vectors, st_embedder.encode(TEXTS), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)


def test_langchain_and_litellm_embed_unchanged(embedder: str) -> None:
    import litellm
    from langchain_openai import OpenAIEmbeddings

    expected = _embed(embedder, input=TEXTS)
    langchain = OpenAIEmbeddings(
        model=EMBEDDER, base_url=f"{embedder}/v1", api_key="none", check_embedding_ctx_length=False, max_retries=0
    )
    np.testing.assert_allclose(langchain.embed_documents(TEXTS), expected, atol=1e-7)
    np.testing.assert_allclose(langchain.embed_query(TEXTS[1]), expected[1], atol=1e-7)
    reply = litellm.embedding(model=f"openai/{EMBEDDER}", api_base=f"{embedder}/v1", api_key="none", input=TEXTS)
    np.testing.assert_allclose([item["embedding"] for item in reply.data], expected, atol=1e-7)
    assert reply.usage.prompt_tokens > 0


def test_token_ids_are_embedded_as_given(embedder: str, bert_tokenizer: PreTrainedTokenizerBase) -> None:
    texts = _embed(embedder, input=TEXTS)
    ids = [bert_tokenizer.encode(text) for text in TEXTS]
    np.testing.assert_allclose(_embed(embedder, input=ids), texts, atol=1e-6)
    np.testing.assert_allclose(_embed(embedder, input=ids[2]), texts[2:], atol=1e-6)
    # No prompt and no special tokens are added to token ids: without [CLS] and [SEP] the vector differs.
    assert not np.allclose(_embed(embedder, input=ids[0][1:-1])[0], texts[0], atol=1e-3)


def test_prompt_names_are_sentence_transformers_prompts(embedder: str, st_embedder: SentenceTransformer) -> None:
    np.testing.assert_allclose(
        _embed(embedder, input=TEXTS, prompt_name="query"), st_embedder.encode(TEXTS, prompt_name="query"), atol=1e-5
    )
    np.testing.assert_allclose(
        _embed(embedder, input=TEXTS, prompt_name="document"), st_embedder.encode_document(TEXTS), atol=1e-5
    )


def test_dimensions_truncate_to_a_matryoshka_size_and_renormalize(
    embedder: str, st_embedder: SentenceTransformer
) -> None:
    full = _embed(embedder, input=TEXTS)
    np.testing.assert_array_equal(_embed(embedder, input=TEXTS, dimensions=32), full)
    truncated = _embed(embedder, input=TEXTS, dimensions=16)
    assert truncated.shape == (3, 16)
    expected = st_embedder.encode(TEXTS, truncate_dim=16)
    np.testing.assert_allclose(truncated, expected / np.linalg.norm(expected, axis=1, keepdims=True), atol=1e-5)
    as_base64 = _post(
        embedder, "/v1/embeddings", model=EMBEDDER, input=TEXTS[0], dimensions=8, encoding_format="base64"
    )
    decoded = np.frombuffer(base64.b64decode(as_base64["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == _embed(embedder, input=TEXTS[0], dimensions=8)[0].tolist()


def test_truncate_prompt_tokens_cuts_where_the_tokenizer_does(
    embedder: str, st_embedder: SentenceTransformer, bert_tokenizer: PreTrainedTokenizerBase
) -> None:
    # -1: the model's limit, max_seq_length, where sentence-transformers truncates by itself.
    np.testing.assert_allclose(
        _embed(embedder, input=LONG_TEXT, truncate_prompt_tokens=-1), st_embedder.encode([LONG_TEXT]), atol=1e-5
    )
    # A text keeps its start and its special tokens ([CLS] ... [SEP]); token ids keep their first ones.
    kept = bert_tokenizer.encode(LONG_TEXT, truncation=True, max_length=10)
    assert len(kept) == 10 and kept[-1] == bert_tokenizer.sep_token_id
    np.testing.assert_allclose(
        _embed(embedder, input=LONG_TEXT, truncate_prompt_tokens=10), _embed(embedder, input=kept), atol=1e-6
    )
    ids = bert_tokenizer.encode(LONG_TEXT)
    np.testing.assert_allclose(
        _embed(embedder, input=ids, truncate_prompt_tokens=10), _embed(embedder, input=ids[:10]), atol=1e-6
    )
    usage = _post(embedder, "/v1/embeddings", model=EMBEDDER, input=[LONG_TEXT], truncate_prompt_tokens=12)["usage"]
    assert usage == {"prompt_tokens": 12, "total_tokens": 12}


def test_a_bi_encoder_reranks_and_scores_by_cosine(embedder: str, st_embedder: SentenceTransformer) -> None:
    query = st_embedder.encode_query(QUERY)
    documents = st_embedder.encode_document(DOCUMENTS)
    expected = [_cosine(query, document) for document in documents]
    reranked = _post(embedder, "/v1/rerank", query=QUERY, documents=DOCUMENTS)
    assert [r["index"] for r in reranked["results"]] == sorted(range(4), key=lambda i: -expected[i])
    for result in reranked["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-5)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    scored = _post(embedder, "/v1/score", model=EMBEDDER, text_1=QUERY, text_2=DOCUMENTS)
    assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=1e-5)
    pairwise = _post(embedder, "/v1/score", queries=[QUERY, QUERY], documents=DOCUMENTS[:2])
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(expected[:2], abs=1e-5)


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code", "message"),
    [
        ("/v1/embeddings", {"input": ""}, 400, "input", "invalid_value", "'input' must not be empty"),
        ("/v1/embeddings", {"input": []}, 400, "input", "invalid_value", "'input' must not be empty"),
        ("/v1/embeddings", {"input": [[]]}, 400, "input[0]", "invalid_value", "'input[0]' must not be empty"),
        ("/v1/embeddings", {"input": ["a", ""]}, 400, "input[1]", "invalid_value", "'input[1]' must not be empty"),
        ("/v1/embeddings", {"input": ["a", LONG_TEXT]}, 400, "input[1]", "context_length_exceeded",
         "maximum input length is 64 tokens (sentence-transformers' max_seq_length). However, 'input[1]' has"),
        ("/v1/embeddings", {"input": list(range(5, 70))}, 400, "input", "context_length_exceeded",
         "'input' has 65 tokens"),
        ("/v1/embeddings", {"input": [1, 2, 99999]}, 400, "input", "invalid_value", "outside the vocabulary"),
        ("/v1/embeddings", {"input": "a", "dimensions": 12}, 400, "dimensions", "invalid_value",
         "'dimensions' must be one of 8, 16, 32; got 12"),
        ("/v1/embeddings", {"input": "a", "dimensions": 0}, 400, "dimensions", "invalid_value", "greater than"),
        ("/v1/embeddings", {"input": "a", "prompt_name": "title"}, 400, "prompt_name", "invalid_value",
         "no prompt named 'title' (its prompts: 'document', 'query')"),
        ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens",
         "invalid_value", "a positive number of tokens, or -1"),
        ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 65}, 400, "truncate_prompt_tokens",
         "invalid_value", "(65) is more than this model's maximum input length, 64 tokens"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, 400, "encoding_format", "invalid_value", ""),
        ("/v1/embeddings", {"input": [[5]] * 1025}, 400, "input", "too_many_inputs",
         "This call needs 1025 engine requests (one per input), more than the server's queue holds (1024"),
        ("/v1/embeddings", {"input": "a", "model": "other"}, 404, "model", "model_not_found", "'other'"),
        ("/v1/embeddings", {}, 400, "input", "missing_required_parameter", "'input'"),
        ("/v1/rerank", {"query": "a", "documents": []}, 400, "documents", "invalid_value",
         "'documents' must not be empty"),
        ("/v1/rerank", {"query": "", "documents": ["a"]}, 400, "query", "invalid_value", "'query' must not be empty"),
        ("/v1/rerank", {"query": "a", "documents": ["a", LONG_TEXT]}, 400, "documents[1]", "context_length_exceeded",
         "'documents[1]' has"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, 400, "text_1", "invalid_value",
         "'text_1' has 2 texts and 'text_2' 3"),
        ("/v1/score", {"text_1": "a", "documents": ["b"]}, 400, "queries", "invalid_value", "not both"),
        ("/v1/score", {"queries": "a"}, 400, "documents", "missing_required_parameter", "'documents'"),
        ("/v1/score", {"text_1": "a", "text_2": []}, 400, "text_2", "invalid_value", "'text_2' must not be empty"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "model",
         "model_does_not_generate", "The model 'embedder' is an embedding model"),
        ("/v1/completions", {"prompt": "hi"}, 400, "model", "model_does_not_generate", "does not generate text"),
        ("/v1/responses", {"input": "hi"}, 400, "model", "model_does_not_generate", "does not generate text"),
    ],
)  # fmt: skip
def test_bad_requests_to_an_embedder_get_precise_errors(
    embedder: str, path: str, body: dict[str, Any], status: int, param: str, code: str, message: str
) -> None:
    model = {} if path in ("/v1/rerank", "/v1/score") else {"model": EMBEDDER}
    got_status, error = _error(embedder, path, {**model, **body})
    assert (got_status, error["param"], error["code"]) == (status, param, code), error
    assert message in error["message"]


def test_models_card_metrics_and_openapi(embedder: str) -> None:
    card = httpx.get(f"{embedder}/v1/models").json()["data"][0]
    assert card["pooling"] == {
        "kind": "embed",
        "dimensions": 32,
        "matryoshka_dimensions": MATRYOSHKA,
        "generates": False,
    }
    http = httpx.Client(base_url=embedder, timeout=60)
    wait_until(lambda: engine_idle(http))
    before = metric_samples(http)
    usage = _post(embedder, "/v1/embeddings", model=EMBEDDER, input=TEXTS)["usage"]
    _post(embedder, "/v1/rerank", query=QUERY, documents=DOCUMENTS[:2])  # 3 inputs: the query and 2 documents
    after = metric_samples(http)

    def grew(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("ferry:request_success_total", finished_reason="stop") == 6
    assert grew("ferry:prompt_tokens_total") >= usage["prompt_tokens"] + 3
    assert grew("ferry:e2e_request_latency_seconds_count") == 6
    schema = httpx.get(f"{embedder}/openapi.json").json()
    assert {"/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score"} <= set(schema["paths"])
    request = schema["components"]["schemas"]["EmbeddingRequest"]
    assert request["properties"]["model"]["enum"] == [EMBEDDER]
    assert request["properties"]["encoding_format"]["enum"] == ["float", "base64"]
    assert schema["components"]["schemas"]["RerankRequest"]["properties"]["model"]["enum"] == [EMBEDDER, None]


def test_a_client_that_leaves_aborts_its_inputs(embedder: str) -> None:
    """A thousand inputs in one call; the client hangs up once they queue: the rest are aborted, not computed."""
    http = httpx.Client(base_url=embedder, timeout=60)
    wait_until(lambda: engine_idle(http))
    succeeded = metric(metric_samples(http), "ferry:request_success_total")
    num_inputs = 1000
    body = json.dumps({"model": EMBEDDER, "input": [[5 + i % 200] * 60 for i in range(num_inputs)]}).encode()
    host, port = embedder.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        # Each input finishes in the step that computes it: they show as waiting, never as running.
        wait_until(lambda: metric(metric_samples(http), "ferry:num_requests_waiting") > 0, timeout=60)
    wait_until(lambda: engine_idle(http), timeout=30)
    assert metric(metric_samples(http), "ferry:request_success_total") - succeeded < num_inputs


# ------------------------------------------------------------------------------------------------ cross-encoder


def test_a_cross_encoder_reranks_as_predict_scores(cross_encoder: str, cross_encoder_dir: Path) -> None:
    predicted = CrossEncoder(str(cross_encoder_dir), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -predicted[i])
    reranked = _post(cross_encoder, "/v1/rerank", model=CROSS_ENCODER, query=QUERY, documents=DOCUMENTS)
    assert reranked["id"].startswith("rerank-") and reranked["model"] == CROSS_ENCODER
    assert [r["index"] for r in reranked["results"]] == order
    for result in reranked["results"]:
        assert result["relevance_score"] == pytest.approx(float(predicted[result["index"]]), abs=1e-5)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    assert reranked["usage"]["prompt_tokens"] == reranked["usage"]["total_tokens"] > 0
    top = _post(cross_encoder, "/rerank", query=QUERY, documents=DOCUMENTS, top_n=2, return_documents=False)
    assert top["results"] == [{k: v for k, v in r.items() if k != "document"} for r in reranked["results"][:2]]
    assert (
        _post(cross_encoder, "/v2/rerank", query=QUERY, documents=DOCUMENTS, top_n=0)["results"]
        == (reranked["results"])
    )


def test_a_cross_encoder_scores_one_to_many_and_pairwise(cross_encoder: str, cross_encoder_dir: Path) -> None:
    model = CrossEncoder(str(cross_encoder_dir), device="cpu")
    one_to_many = _post(cross_encoder, "/v1/score", text_1=QUERY, text_2=DOCUMENTS)
    assert one_to_many["object"] == "list" and one_to_many["model"] == CROSS_ENCODER
    assert [(d["index"], d["object"]) for d in one_to_many["data"]] == [(i, "score") for i in range(4)]
    expected = model.predict([(QUERY, d) for d in DOCUMENTS])
    assert [d["score"] for d in one_to_many["data"]] == pytest.approx(expected.tolist(), abs=1e-5)
    queries = [QUERY, "a dictionary", "river", QUERY]
    pairwise = _post(cross_encoder, "/score", queries=queries, documents=DOCUMENTS)
    expected = model.predict(list(zip(queries, DOCUMENTS, strict=True)))
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(expected.tolist(), abs=1e-5)
    # A pair longer than the model's 128 positions: refused, or cut as the tokenizer cuts a pair (longest first),
    # which is what CrossEncoder.predict does by itself.
    long_document = LONG_TEXT * 3
    status, error = _error(cross_encoder, "/v1/score", {"text_1": QUERY, "text_2": [long_document]})
    assert (status, error["code"], error["param"]) == (400, "context_length_exceeded", "text_2[0]")
    assert "'text_1' with 'text_2[0]' has" in error["message"]
    cut = _post(cross_encoder, "/v1/score", text_1=QUERY, text_2=long_document, truncate_prompt_tokens=-1)
    assert cut["data"][0]["score"] == pytest.approx(float(model.predict([(QUERY, long_document)])[0]), abs=1e-5)


def test_a_cross_encoder_makes_no_embeddings_and_does_not_chat(cross_encoder: str) -> None:
    status, error = _error(cross_encoder, "/v1/embeddings", {"model": CROSS_ENCODER, "input": "a"})
    assert (status, error["code"], error["param"]) == (400, "model_does_not_embed", "model")
    assert "The model 'cross-encoder' is a cross-encoder" in error["message"]
    body = {"model": CROSS_ENCODER, "messages": [{"role": "user", "content": "hi"}]}
    status, error = _error(cross_encoder, "/v1/chat/completions", body)
    assert (status, error["code"]) == (400, "model_does_not_generate")
    card = httpx.get(f"{cross_encoder}/v1/models", headers=_auth(cross_encoder)).json()["data"][0]
    assert card["pooling"] == {"kind": "classify", "dimensions": 1, "generates": False}
    for path in ("/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score", "/v1/embeddings"):
        assert httpx.post(f"{cross_encoder}{path}", json={}).status_code == 401, path


def test_a_classifier_of_several_labels_does_not_score(tmp_path: Path) -> None:
    directory = build_bert_cross_encoder(tmp_path / "two-labels", num_labels=2)
    config = EngineConfig.of(model=str(directory))
    pooling = pooling_config(str(directory), json.loads((directory / "config.json").read_text()), runner="auto")
    assert pooling is not None and pooling.dimensions == 2
    lifecycle = Lifecycle(1.0)
    lifecycle.set_ready()
    ctx = ServingContext(
        client=EngineClient(config),
        tokenizer=Tokenizer.load(directory),
        model_dir=str(directory),
        metrics=ServerMetrics("two-labels"),
        lifecycle=lifecycle,
        model_names=("two-labels",),
        adapters=LoRARegistry(str(directory), 16, ("two-labels",)),
        max_model_len=128,
        request_timeout=None,
        sse_ping=0.0,
        reasoning=None,
        pooling=pooling,
    )
    for endpoint in ("/v1/rerank", "/v1/score"):
        with pytest.raises(APIError) as refused:
            pooling_model(ctx, None, endpoint)  # type: ignore[arg-type]
        assert refused.value.status_code == 400 and refused.value.info.code == "model_does_not_score"
        assert f"classifies into 2 labels (LABEL_0, LABEL_1): {endpoint} needs" in refused.value.info.message


# ------------------------------------------------------------------------------------------------ yes/no reranker


def test_a_yes_no_reranker_scores_p_yes_and_still_chats(reranker: str, reranker_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(reranker_dir))
    model = AutoModelForCausalLM.from_pretrained(str(reranker_dir), dtype=torch.float32)
    yes, no = (tokenizer.convert_tokens_to_ids(token) for token in YES_NO)
    expected = []
    with torch.no_grad():
        for document in DOCUMENTS:
            ids = tokenizer.encode(TEMPLATE.format(query=QUERY, document=document))
            logits = model(torch.tensor([ids])).logits[0, -1]
            expected.append(torch.softmax(logits[[yes, no]], dim=0)[0].item())
    reranked = _post(reranker, "/v1/rerank", query=QUERY, documents=DOCUMENTS, return_documents=False)
    assert [r["index"] for r in reranked["results"]] == sorted(range(4), key=lambda i: -expected[i])
    for result in reranked["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-5)
        assert "document" not in result
    # A text holding `{document}` stays as written: the template is filled in one pass.
    braces = _post(reranker, "/v1/score", text_1="{document}", text_2="x")["data"][0]["score"]
    ids = tokenizer.encode("<Query>: {document}\n<Document>: x\n<Relevant>:")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    assert braces == pytest.approx(torch.softmax(logits[[yes, no]], dim=0)[0].item(), abs=1e-5)
    chat = _post(reranker, "/v1/chat/completions", model=RERANKER, messages=[{"role": "user", "content": "hi"}],
                 max_tokens=3)  # fmt: skip
    assert chat["choices"][0]["message"]["role"] == "assistant"
    status, error = _error(reranker, "/v1/embeddings", {"model": RERANKER, "input": "a"})
    assert (status, error["code"]) == (400, "model_does_not_embed")
    assert "yes/no reranker (--reranker-tokens)" in error["message"]
    card = httpx.get(f"{reranker}/v1/models").json()["data"][0]
    assert card["pooling"] == {"kind": "yes_no", "dimensions": 1, "generates": True}


# ------------------------------------------------------------------------------------------------ generate-only


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"model": GENERATOR, "input": "a"}),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}),
        ("/v1/score", {"model": GENERATOR, "text_1": "a", "text_2": "b"}),
    ],
)
def test_a_generate_only_model_refuses_to_pool(generator: str, path: str, body: dict[str, Any]) -> None:
    status, error = _error(generator, path, body)
    assert (status, error["code"], error["param"]) == (400, "model_does_not_pool", "model")
    assert (
        f"The model 'generator' generates text and does not pool: it makes no embeddings or relevance scores for {path}"
        in error["message"]
    )
    assert "pooling" not in httpx.get(f"{generator}/v1/models").json()["data"][0]


# ------------------------------------------------------------------------------------------------ the page


@needs_browser
def test_the_page_shows_what_a_pooling_model_serves(embedder: str, reranker: str, browser: Any) -> None:  # noqa: F811
    def load(base_url: str) -> None:
        browser.get(base_url)
        wait_for(browser, lambda d: not js(d, "return document.getElementById('model-task').hidden"))

    load(embedder)
    assert text_of(browser, "model-task") == "Embedding model of 32 dimensions: /v1/embeddings, /v1/score, /v1/rerank"
    assert text_of(browser, "empty-hint") == (
        "embedder is a pooling model (embedding model) and does not chat: call /v1/embeddings, /v1/score, "
        "/v1/rerank from any OpenAI-compatible client."
    )
    assert js(browser, "return document.getElementById('send').disabled")
    load(reranker)
    assert text_of(browser, "model-task") == "Yes/no reranker: /v1/score, /v1/rerank, and chat"
    wait_for(browser, lambda d: not js(d, "return document.getElementById('send').disabled"))
    assert not console_errors(browser)
