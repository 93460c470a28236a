"""/v1/embeddings: texts or token ids -> one pooling request each -> OpenAI's list of embeddings.

`input` is a text, texts, token ids or lists of token ids. Texts are tokenized with the tokenizer's special tokens,
as sentence-transformers does, after the named prompt (sentence-transformers' `prompt_name`; by default the model's
default prompt, if it names one); token ids go to the model as given, without a prompt. `dimensions` keeps the first
values of each embedding (renormalized where the model normalizes), for the sizes the model declares Matryoshka;
`encoding_format: base64` sends each embedding's float32 bytes, little-endian, as the OpenAI SDK asks by default.
The embeddings are float32 values in both formats, so both carry exactly the same numbers.
"""

from __future__ import annotations

import base64
import math
import sys
import time
import uuid
from array import array

from fastapi import Request
from fastapi.responses import Response

from engine.pooling.config import PoolingConfig
from server.openai.errors import invalid_request
from server.openai.generation import ServingContext, is_batch
from server.openai.pooling import (
    InputLimit,
    PoolingInput,
    checked_text,
    checked_token_ids,
    pooling_model,
    start_pooling,
)
from server.openai.pooling_schemas import EmbeddingData, EmbeddingRequest, EmbeddingResponse


async def serve_embeddings(ctx: ServingContext, body: EmbeddingRequest, request: Request) -> Response:
    arrival = time.monotonic()
    pooling = pooling_model(ctx, body.model, "/v1/embeddings")
    dimensions = _dimensions(body.dimensions, pooling)
    prompt = _prompt(body.prompt_name, pooling)
    limit = InputLimit.of(ctx)
    inputs = _inputs(ctx, body, prompt, limit)
    response_id = f"embd-{uuid.uuid4().hex}"
    call = await start_pooling(ctx, response_id, inputs, arrival, "input", batch=is_batch(request))

    def build(vectors: list[list[float]]) -> EmbeddingResponse:
        data = [
            EmbeddingData(
                index=i, embedding=_encoded(_sized(vector, dimensions, pooling.normalize), body.encoding_format)
            )
            for i, vector in enumerate(vectors)
        ]
        return EmbeddingResponse(
            id=response_id, created=int(time.time()), model=ctx.model_name, data=data, usage=call.usage
        )

    return await call.json_response(request, build)


def _inputs(ctx: ServingContext, body: EmbeddingRequest, prompt: str, limit: InputLimit) -> list[PoolingInput]:
    truncate = limit.truncation(body.truncate_prompt_tokens)
    tokenizer = ctx.tokenizer

    def text(value: str, param: str) -> PoolingInput:
        ids = tokenizer.encode(prompt + checked_text(value, param), max_length=truncate)
        return limit.checked(PoolingInput(ids, []), param)

    def token_ids(value: list[int], param: str) -> PoolingInput:
        ids = checked_token_ids(ctx, value, param)
        return limit.checked(PoolingInput(tokenizer.truncated(ids, truncate) if truncate else ids, []), param)

    raw = body.input
    if isinstance(raw, str):
        return [text(raw, "input")]
    if not raw:
        raise invalid_request("'input' must not be empty.", "input")
    if isinstance(raw[0], str):
        return [text(value, f"input[{i}]") for i, value in enumerate(raw)]  # type: ignore[arg-type]
    if isinstance(raw[0], int):
        return [token_ids(raw, "input")]  # type: ignore[arg-type]
    return [token_ids(value, f"input[{i}]") for i, value in enumerate(raw)]  # type: ignore[arg-type]


def _prompt(name: str | None, pooling: PoolingConfig) -> str:
    try:
        return pooling.prompt(name)
    except KeyError:
        names = ", ".join(f"'{prompt_name}'" for prompt_name, _ in pooling.prompts) or "none"
        raise invalid_request(
            f"The model has no prompt named '{name}' (its prompts: {names}).", "prompt_name"
        ) from None


def _dimensions(requested: int | None, pooling: PoolingConfig) -> int | None:
    """The size to truncate to; None: the model's own."""
    full = pooling.dimensions
    if requested is None or requested == full:
        return None
    declared = pooling.matryoshka_dimensions or ()
    if requested in declared and requested < full:
        return requested
    sizes = sorted({*declared, full})
    if not declared:
        allowed = f"{full} (the model declares no Matryoshka sizes to truncate to)"
    elif sizes == list(range(1, full + 1)):
        allowed = f"from 1 to {full}"
    else:
        allowed = "one of " + ", ".join(map(str, sizes))
    raise invalid_request(
        f"The model makes {full}-dimensional embeddings: 'dimensions' must be {allowed}; got {requested}.",
        "dimensions",
    )


def _sized(vector: list[float], dimensions: int | None, normalize: bool) -> array[float]:
    """The first `dimensions` values (all: None), scaled back to unit length where the model normalizes, as
    float32."""
    if dimensions is not None:
        vector = vector[:dimensions]
        if normalize:
            norm = math.sqrt(math.fsum(x * x for x in vector))
            vector = [x / norm for x in vector] if norm > 0 else vector
    return array("f", vector)


def _encoded(values: array[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return values.tolist()
    if sys.byteorder == "big":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")
