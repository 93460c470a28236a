"""Request and response shapes of the pooling endpoints: /v1/embeddings (OpenAI's), /v1/rerank (Jina's and
Cohere's) and /v1/score (vLLM's), with vLLM's extras.

Requests are as strict as the generation endpoints' (server/openai/schemas.py); what the fields' shapes cannot say
(an empty input, a `dimensions` the model does not offer, texts too long) is checked where they are used, with a
400 that names the field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, NonNegativeInt

from server.openai.schemas import _omitted_when_none, _RequestModel

TRUNCATE_DESCRIPTION = (
    "vLLM's extra: cut each input to this many tokens, where the tokenizer truncates (the end of a text, its special "
    "tokens kept; a pair's longer text first); -1: the model's maximum input length. Without it, a longer input is "
    "refused."
)


class EmbeddingRequest(_RequestModel):
    model: str
    input: str | list[str] | list[NonNegativeInt] | list[list[NonNegativeInt]] = Field(
        description="A text, texts, token ids or lists of token ids; none of them empty. Texts are tokenized with "
        "the tokenizer's special tokens, token ids are used as given."
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each embedding as its little-endian float32 bytes, base64-encoded."
    )
    dimensions: int | None = Field(
        None,
        ge=1,
        description="Truncate each embedding to its first `dimensions` values (renormalized where the model "
        "normalizes): the model's full size, or one of the Matryoshka sizes its config.json declares.",
    )
    user: str | None = None
    # Extras, as in vLLM and sentence-transformers.
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description=TRUNCATE_DESCRIPTION)
    prompt_name: str | None = Field(
        None,
        description="sentence-transformers' named prompt (config_sentence_transformers.json `prompts`, e.g. "
        "`query`), put before each text input; default: the model's default_prompt_name, if any.",
    )


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="The floats, or with encoding_format base64 their bytes.")


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class RerankRequest(_RequestModel):
    model: str | None = Field(None, description="Optional; when given, one of the served names.")
    query: str
    documents: list[str] = Field(description="The texts to rank against the query; at least one.")
    top_n: int | None = Field(None, ge=0, description="Return the best top_n results; none or 0: all of them.")
    return_documents: bool = Field(True, description="Each result carries its document's text.")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description=TRUNCATE_DESCRIPTION)


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int = Field(description="The document's position in the request's `documents`.")
    relevance_score: float
    document: RerankDocument | None = _omitted_when_none("With return_documents.")


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult] = Field(description="Best first (ties in the order the documents came).")
    usage: PoolingUsage


class ScoreRequest(_RequestModel):
    """Two sides to score: `text_1` and `text_2`, or (vLLM's newer names) `queries` and `documents`. One text on
    the first side is scored against every text of the second; otherwise both have as many texts, scored pairwise."""

    model: str | None = Field(None, description="Optional; when given, one of the served names.")
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description=TRUNCATE_DESCRIPTION)


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage
