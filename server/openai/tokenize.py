"""/tokenize and /detokenize, in vLLM's shapes: text or a conversation to the model's token ids, and ids back to text.

/tokenize takes `prompt` (tokenized as /v1/completions does, special tokens added by default) or `messages`
(rendered by the chat template exactly as /v1/chat/completions renders them, the generation prompt added by
default), and answers `{"count", "max_model_len", "tokens"}` (plus `token_strs` when asked). /detokenize takes
`tokens` and answers `{"prompt"}`, special tokens included: the text those ids stand for.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, NonNegativeInt, model_validator

from server.openai.errors import invalid_request, unsupported_parameter
from server.openai.generation import ServingContext
from server.openai.schemas import ChatCompletionRequest, ChatMessage, _RequestModel
from server.tokens import ChatTemplateError


class TokenizeRequest(_RequestModel):
    model: str | None = Field(None, description="Optional; when given, one of the served names.")
    prompt: str | None = Field(None, description="Text to tokenize (exactly one of prompt and messages).")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="A conversation, rendered with the model's chat template first."
    )
    add_generation_prompt: bool = Field(True, description="With messages: end with the assistant's turn opening.")
    add_special_tokens: bool | None = Field(
        None, description="Add the tokenizer's special tokens (BOS...); default true for a prompt, false for messages "
        "(the chat template writes its own)."
    )  # fmt: skip
    return_token_strs: bool = Field(False, description="Also return each token as the vocabulary spells it.")

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        if self.messages is None and not self.add_generation_prompt:
            raise ValueError("'add_generation_prompt' applies to 'messages' only")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_RequestModel):
    model: str | None = Field(None, description="Optional; when given, one of the served names.")
    tokens: list[NonNegativeInt]


class DetokenizeResponse(BaseModel):
    prompt: str


def serve_tokenize(ctx: ServingContext, body: TokenizeRequest) -> TokenizeResponse:
    if body.model is not None:
        ctx.check_model(body.model)
    if body.messages is not None:
        # The same rendering as a chat completion of these messages: the count is what that request would use.
        messages = ChatCompletionRequest.model_construct(messages=body.messages).template_messages()
        if ctx.harmony is not None:  # Harmony's rendering, which ends where the assistant's reply starts
            if not body.add_generation_prompt:
                raise unsupported_parameter(
                    "add_generation_prompt",
                    "false under gpt-oss's Harmony format (its prompt ends where replies start).",
                )
            tokens = ctx.harmony.render(messages, [], None, "messages")
        else:
            try:
                tokens = ctx.tokenizer.apply_chat_template(
                    messages, body.add_generation_prompt, add_special_tokens=bool(body.add_special_tokens)
                )
            except ChatTemplateError as exc:
                raise invalid_request(str(exc), "messages") from exc
    else:
        assert body.prompt is not None
        add_special = body.add_special_tokens is None or body.add_special_tokens
        tokens = ctx.tokenizer.encode(body.prompt, add_special_tokens=add_special)
    return TokenizeResponse(
        count=len(tokens),
        max_model_len=ctx.max_model_len,
        tokens=tokens,
        token_strs=ctx.tokenizer.token_strings(tokens) if body.return_token_strs else None,
    )


def serve_detokenize(ctx: ServingContext, body: DetokenizeRequest) -> DetokenizeResponse:
    if body.model is not None:
        ctx.check_model(body.model)
    vocab_size = ctx.tokenizer.vocab_size
    bad = next((i for i, token in enumerate(body.tokens) if token >= vocab_size), None)
    if bad is not None:
        raise invalid_request(
            f"Token id {body.tokens[bad]} is outside the vocabulary [0, {vocab_size}).", f"tokens[{bad}]"
        )
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens, skip_special_tokens=False))
