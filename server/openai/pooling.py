"""What the pooling endpoints share (/v1/embeddings, /v1/rerank, /v1/score): the model check, inputs to token ids
(truncation, length limits), and one API call's engine requests from admission to cleanup.

Every input of a call is one pooling request (engine/core/request.py PoolingParams), all sent to the engine at
once and in order, so the scheduler batches them with each other and with whatever else runs. Admission is awaited
before answering, so an engine refusal is the client's 4xx; the call answers once every input is pooled, and
aborts them all if the client leaves first or the request timeout passes. They count in the metrics as requests
like any other (prompt tokens at admission; queue time, latency and success at the end).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from engine.core.driver import EngineRequest
from engine.core.request import FinishReason, PoolingParams, SamplingParams
from engine.pooling.config import PoolingConfig
from server.client import EngineDeadError, RequestGroup
from server.metrics import RequestTimer
from server.openai.errors import APIError, engine_failure, invalid_request
from server.openai.generation import (
    ServingContext,
    request_deadline,
    unless_disconnected,
    wait_admitted,
)
from server.openai.pooling_schemas import PoolingUsage

Endpoint = Literal["/v1/embeddings", "/v1/rerank", "/v1/score"]
"""The route a request came to (its aliases, /rerank and the like, are named by their /v1 path)."""


def pooling_model(ctx: ServingContext, model: str | None, endpoint: Endpoint) -> PoolingConfig:
    """What the model pools, once the server accepts work, `model` (when given) is served, and the model can
    answer `endpoint`: embeddings need an embedding model, rerank and score a model with one score per pair."""
    ctx.lifecycle.check_accepting()
    if model is not None and ctx.check_model(model) is not None:
        raise invalid_request(
            f"The model '{model}' is a LoRA adapter: adapters generate text (chat, completions, responses) and make "
            f"no embeddings or relevance scores for {endpoint}; send the base model's name, '{ctx.model_name}'.",
            "model",
            code="model_does_not_pool",
        )
    name = model or ctx.model_name
    pooling = ctx.pooling
    if pooling is None:
        raise invalid_request(
            f"The model '{name}' generates text and does not pool: it makes no embeddings or relevance scores "
            f"for {endpoint} (serve an embedding model or a cross-encoder, or a causal LM with --reranker-tokens "
            "for /v1/rerank and /v1/score).",
            "model",
            code="model_does_not_pool",
        )
    if endpoint == "/v1/embeddings" and pooling.kind != "embed":
        what = "a cross-encoder" if pooling.kind == "classify" else "a yes/no reranker (--reranker-tokens)"
        raise invalid_request(
            f"The model '{name}' is {what}: it scores query-document pairs through /v1/rerank and /v1/score, and "
            "makes no embeddings.",
            "model",
            code="model_does_not_embed",
        )
    if pooling.kind == "classify" and pooling.dimensions != 1:
        raise invalid_request(
            f"The model '{name}' classifies into {pooling.dimensions} labels ({', '.join(pooling.labels)}): "
            f"{endpoint} needs a cross-encoder with a single relevance score.",
            "model",
            code="model_does_not_score",
        )
    return pooling


@dataclass(frozen=True)
class PoolingInput:
    """One engine request's input: its token ids, and each token's segment where the model reads segments."""

    token_ids: list[int]
    token_type_ids: list[int]


@dataclass(frozen=True)
class InputLimit:
    """The longest input the model takes, and what sets it (for the message of a refusal)."""

    tokens: int
    source: str

    @classmethod
    def of(cls, ctx: ServingContext) -> InputLimit:
        pooling = ctx.pooling
        assert pooling is not None
        limits = [InputLimit(ctx.max_model_len, "the model's context length")]
        if pooling.max_seq_length is not None:
            limits.append(InputLimit(pooling.max_seq_length, "sentence-transformers' max_seq_length"))
        if pooling.bidirectional:
            limits.append(
                InputLimit(ctx.max_batch_tokens, "--max-batch-tokens: an encoder computes each input in one step")
            )
        return min(limits, key=lambda limit: limit.tokens)

    def truncation(self, truncate_prompt_tokens: int | None) -> int | None:
        """`truncate_prompt_tokens` as a number of tokens to keep (-1: this limit); None: no truncation."""
        if truncate_prompt_tokens is None:
            return None
        if truncate_prompt_tokens == -1:
            return self.tokens
        if truncate_prompt_tokens == 0:
            raise invalid_request(
                "'truncate_prompt_tokens' must be a positive number of tokens, or -1 for the model's maximum input "
                "length.",
                "truncate_prompt_tokens",
            )
        if truncate_prompt_tokens > self.tokens:
            raise invalid_request(
                f"'truncate_prompt_tokens' ({truncate_prompt_tokens}) is more than this model's maximum input length, "
                f"{self.tokens} tokens ({self.source}).",
                "truncate_prompt_tokens",
            )
        return truncate_prompt_tokens

    def checked(self, pooling_input: PoolingInput, param: str, described: str | None = None) -> PoolingInput:
        """The input, if it has tokens and fits; a 400 naming `param` otherwise (`described`: what the message calls
        the input, when it is more than that field, a query-document pair)."""
        length = len(pooling_input.token_ids)
        described = described or f"'{param}'"
        if length == 0:
            raise invalid_request(f"{described} must not be empty.", param)
        if length > self.tokens:
            raise invalid_request(
                f"This model's maximum input length is {self.tokens} tokens ({self.source}). However, {described} "
                f"has {length} tokens. Please shorten it, or set 'truncate_prompt_tokens' to cut it.",
                param,
                code="context_length_exceeded",
            )
        return pooling_input


def checked_token_ids(ctx: ServingContext, token_ids: list[int], param: str) -> list[int]:
    vocab_size = ctx.tokenizer.vocab_size
    bad = next((t for t in token_ids if t >= vocab_size), None)
    if bad is not None:
        raise invalid_request(f"Token id {bad} is outside the vocabulary [0, {vocab_size}).", param)
    return token_ids


def checked_text(text: str, param: str) -> str:
    if not text:
        raise invalid_request(f"'{param}' must not be empty.", param)
    return text


class PoolingCall:
    """One API call's pooling requests in flight: their vectors as they finish, the deadline, the cleanup."""

    def __init__(
        self, ctx: ServingContext, inputs: Sequence[PoolingInput], group: RequestGroup, arrival: float
    ) -> None:
        self.ctx = ctx
        self.inputs = inputs
        self.group = group
        self.timers = [RequestTimer(ctx.metrics, arrival) for _ in inputs]
        self._closed = False
        ctx.lifecycle.request_started()
        self._deadline = request_deadline(ctx, arrival, group)

    @property
    def usage(self) -> PoolingUsage:
        prompt_tokens = sum(len(i.token_ids) for i in self.inputs)
        return PoolingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)

    async def vectors(self) -> list[list[float]]:
        """Every input's vector, in input order, once all are pooled."""
        vectors: list[list[float] | None] = [None] * len(self.inputs)
        remaining = len(self.inputs)
        while remaining:
            try:
                index, output, received = await self.group.get()
            except EngineDeadError as exc:
                raise engine_failure(str(exc)) from exc
            timer = self.timers[index]
            timer.on_output(received, 0, output.queue_seconds)
            if not output.finished:
                continue
            if output.finish_reason is FinishReason.ABORT or output.pooled is None:
                raise engine_failure(output.error or f"The engine finished input {index} without its vector.")
            timer.on_finish(received, output.finish_reason.value)
            vectors[index] = output.pooled
            remaining -= 1
        return vectors  # type: ignore[return-value]

    async def json_response(self, request: Request, build: Callable[[list[list[float]]], BaseModel]) -> Response:
        """Answer with what `build` makes of the vectors, unless the client leaves first."""

        async def work() -> Response:
            return Response(build(await self.vectors()).model_dump_json(), media_type="application/json")

        return await unless_disconnected(request, work(), self.close)

    def close(self) -> None:
        """Abort what still runs and release everything; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._deadline is not None:
            self._deadline.cancel()
        self.group.close()
        self.ctx.lifecycle.request_finished()


async def start_pooling(
    ctx: ServingContext,
    response_id: str,
    inputs: Sequence[PoolingInput],
    arrival: float,
    param: str,
    *,
    batch: bool = False,
) -> PoolingCall:
    """Submit one pooling request per input and wait until the engine took them all; `param` names the field the
    inputs came from. `batch`: the call is a line of the Batch API (`is_batch`), whose engine requests wait behind
    every interactive request."""
    if ctx.max_queue_size and len(inputs) > ctx.max_queue_size:
        # The engine would queue some and refuse the rest as a full queue: a 429 that no retry could ever pass.
        raise invalid_request(
            f"This call needs {len(inputs)} engine requests (one per input), more than the server's queue holds "
            f"({ctx.max_queue_size}, --max-queue-size): split it into calls of at most {ctx.max_queue_size}.",
            param,
            code="too_many_inputs",
        )
    requests = [
        EngineRequest(
            f"{response_id}-{i}",
            pooling_input.token_ids,
            SamplingParams(max_new_tokens=1),
            batch=batch,
            pooling=PoolingParams(tuple(pooling_input.token_type_ids)),
        )
        for i, pooling_input in enumerate(inputs)
    ]
    try:
        group = ctx.client.submit(requests)
    except EngineDeadError as exc:
        raise APIError(503, str(exc), type="service_unavailable_error", code="engine_dead") from exc
    call = PoolingCall(ctx, inputs, group, arrival)
    try:
        await wait_admitted(group)
    except BaseException:
        call.close()
        raise
    ctx.metrics.prompt_tokens.inc(sum(len(i.token_ids) for i in inputs))
    return call
