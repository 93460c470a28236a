"""/v1/rerank and /v1/score: how relevant each document is to a query, scored the way the model's kind scores.

- A cross-encoder (`classify`): query and document are one input, tokenized as the tokenizer pairs two texts (BERT's
  token type ids go along), the query after the model's default prompt, as sentence-transformers' CrossEncoder
  does; the score is the head's output after its activation (what CrossEncoder.predict returns).
- A bi-encoder (`embed`): each text is embedded on its own, the query after the model's `query` prompt and each
  document after its `document` (else `passage`, else `corpus`) prompt, as sentence-transformers' encode_query and
  encode_document do; the score is the two embeddings' cosine similarity. Each text of the request is embedded once
  (one query against N documents: N + 1 inputs).
- A yes/no reranker (`yes_no`, --reranker-tokens): --reranker-template with `{query}` and `{document}` filled in,
  tokenized as /v1/completions tokenizes a prompt (the tokenizer's special tokens added, no chat template); the
  score is P(yes).

/v1/rerank takes Jina's and Cohere's request (served at /rerank and /v2/rerank too): documents ranked against one
query, best first. /v1/score takes vLLM's (also at /score): one text scored against many, or two lists pairwise.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from engine.pooling.config import PoolingConfig
from server.openai.errors import invalid_request
from server.openai.generation import ServingContext
from server.openai.pooling import InputLimit, PoolingInput, checked_text, pooling_model, start_pooling
from server.openai.pooling_schemas import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)

DOCUMENT_PROMPT_NAMES = ("document", "passage", "corpus")
"""The prompts sentence-transformers' encode_document looks for, in this order."""

_TEMPLATE_FIELD = re.compile(r"\{(query|document)\}")


async def serve_rerank(ctx: ServingContext, body: RerankRequest, request: Request) -> Response:
    arrival = time.monotonic()
    pooling = pooling_model(ctx, body.model, "/v1/rerank")
    query = _Text(checked_text(body.query, "query"), "query")
    if not body.documents:
        raise invalid_request("'documents' must not be empty: give at least one document to rank.", "documents")
    documents = _texts(body.documents, "documents")
    pairs = [(0, i) for i in range(len(documents))]
    scoring = _Scoring(ctx, pooling, [query], documents, pairs, body.truncate_prompt_tokens)
    response_id = f"rerank-{uuid.uuid4().hex}"
    call = await start_pooling(ctx, response_id, scoring.inputs, arrival, "documents")

    def build(vectors: list[list[float]]) -> RerankResponse:
        scores = scoring.scores(vectors)
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep the documents' order
        if body.top_n:
            ranked = ranked[: body.top_n]
        results = [
            RerankResult(
                index=i,
                relevance_score=scores[i],
                document=RerankDocument(text=body.documents[i]) if body.return_documents else None,
            )
            for i in ranked
        ]
        return RerankResponse(id=response_id, model=ctx.model_name, results=results, usage=call.usage)

    return await call.json_response(request, build)


async def serve_score(ctx: ServingContext, body: ScoreRequest, request: Request) -> Response:
    arrival = time.monotonic()
    pooling = pooling_model(ctx, body.model, "/v1/score")
    first, second = _score_sides(body)
    pairs = _score_pairs(first, second)
    scoring = _Scoring(ctx, pooling, first.texts, second.texts, pairs, body.truncate_prompt_tokens)
    response_id = f"score-{uuid.uuid4().hex}"
    call = await start_pooling(ctx, response_id, scoring.inputs, arrival, second.name)

    def build(vectors: list[list[float]]) -> ScoreResponse:
        data = [ScoreData(index=i, score=score) for i, score in enumerate(scoring.scores(vectors))]
        return ScoreResponse(
            id=response_id, created=int(time.time()), model=ctx.model_name, data=data, usage=call.usage
        )

    return await call.json_response(request, build)


@dataclass(frozen=True)
class _Text:
    text: str
    param: str
    """The request field it came from (`documents[2]`), for errors."""


def _texts(values: list[str], name: str) -> list[_Text]:
    return [_Text(checked_text(value, f"{name}[{i}]"), f"{name}[{i}]") for i, value in enumerate(values)]


@dataclass(frozen=True)
class _Side:
    """One side of a score request: its field's name and its texts."""

    name: str
    texts: list[_Text]


def _score_sides(body: ScoreRequest) -> tuple[_Side, _Side]:
    """The two sides of a score request, as `text_1` / `text_2` or as `queries` / `documents`."""
    query_form = body.queries is not None or body.documents is not None
    if query_form and (body.text_1 is not None or body.text_2 is not None):
        raise invalid_request("Give either 'text_1' and 'text_2', or 'queries' and 'documents'; not both.", "queries")
    names = ("queries", "documents") if query_form else ("text_1", "text_2")
    values = (body.queries, body.documents) if query_form else (body.text_1, body.text_2)
    sides = []
    for name, value in zip(names, values, strict=True):
        if value is None:
            raise invalid_request(f"Missing required parameter: '{name}'.", name, code="missing_required_parameter")
        if isinstance(value, str):
            sides.append(_Side(name, [_Text(checked_text(value, name), name)]))
        elif not value:
            raise invalid_request(f"'{name}' must not be empty.", name)
        else:
            sides.append(_Side(name, _texts(value, name)))
    return sides[0], sides[1]


def _score_pairs(first: _Side, second: _Side) -> list[tuple[int, int]]:
    """One text against every text of the other side, or both sides pairwise."""
    if len(first.texts) == 1:
        return [(0, j) for j in range(len(second.texts))]
    if len(first.texts) == len(second.texts):
        return [(i, i) for i in range(len(first.texts))]
    raise invalid_request(
        f"'{first.name}' has {len(first.texts)} texts and '{second.name}' {len(second.texts)}: give one "
        f"'{first.name}' text to score against every '{second.name}' text, or as many as '{second.name}' has to "
        "score them pairwise.",
        first.name,
    )


class _Scoring:
    """The engine inputs that score each (query, document) pair of indices, and the scores from their vectors."""

    def __init__(
        self,
        ctx: ServingContext,
        pooling: PoolingConfig,
        queries: list[_Text],
        documents: list[_Text],
        pairs: list[tuple[int, int]],
        truncate_prompt_tokens: int | None,
    ) -> None:
        self.pairs = pairs
        self.bi_encoder = pooling.kind == "embed"
        self.num_queries = len(queries)
        limit = InputLimit.of(ctx)
        truncate = limit.truncation(truncate_prompt_tokens)
        tokenizer = ctx.tokenizer

        def text(value: str, param: str, described: str | None = None) -> PoolingInput:
            return limit.checked(PoolingInput(tokenizer.encode(value, max_length=truncate), []), param, described)

        if self.bi_encoder:
            prompts = dict(pooling.prompts)
            query_prompt = prompts.get("query", "")
            document_prompt = next((prompts[name] for name in DOCUMENT_PROMPT_NAMES if name in prompts), "")
            self.inputs = [text(query_prompt + q.text, q.param) for q in queries] + [
                text(document_prompt + d.text, d.param) for d in documents
            ]
        elif pooling.kind == "classify":
            prompt = pooling.prompt(None)
            self.inputs = []
            for q, d in ((queries[i], documents[j]) for i, j in pairs):
                ids, types = tokenizer.encode_pair(prompt + q.text, d.text, max_length=truncate)
                self.inputs.append(limit.checked(PoolingInput(ids, types), d.param, _pair(q, d)))
        else:
            self.inputs = [
                text(_filled(ctx.reranker_template, q.text, d.text), d.param, _pair(q, d))
                for q, d in ((queries[i], documents[j]) for i, j in pairs)
            ]

    def scores(self, vectors: list[list[float]]) -> list[float]:
        """A score per pair, in pair order."""
        if self.bi_encoder:
            return [_cosine(vectors[i], vectors[self.num_queries + j]) for i, j in self.pairs]
        return [vector[0] for vector in vectors]


def _pair(query: _Text, document: _Text) -> str:
    return f"'{query.param}' with '{document.param}'"


def _filled(template: str, query: str, document: str) -> str:
    """The template with its `{query}` and `{document}` replaced in one pass (a text holding `{document}` stays
    as it is)."""
    values = {"query": query, "document": document}
    return _TEMPLATE_FIELD.sub(lambda match: values[match.group(1)], template)


def _cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))
    return dot / norms if norms else 0.0
