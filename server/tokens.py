"""Text in, token ids out, and back: tokenizer, chat template, incremental detokenizer, stop strings.

All of it runs in the front-end process so the engine process only ever sees token ids.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend
from transformers.utils.chat_template_utils import _compile_jinja_template

from server.tokenizer_class import load_tokenizer

# A byte-level token that ends inside a multi-byte UTF-8 character decodes to U+FFFD until the token carrying
# the rest of the character arrives; text ending in it is held back rather than streamed.
REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded ahead of the output: tokenizers that mark word starts (SentencePiece's "▁") only render
# an output token's leading space when it follows something, as it does in the full text.
DETOKENIZER_CONTEXT_TOKENS = 5


class ChatTemplateError(ValueError):
    """The messages cannot be rendered into a prompt (no template, or the template rejected them)."""


class Tokenizer:
    """The model's tokenizer, loaded from its directory, plus the operations the API needs."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self._special_ids = frozenset(tokenizer.all_special_ids) | {
            token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special
        }
        # Every streamed token is decoded twice (IncrementalDetokenizer): transformers' `decode` of a tokenizers-backed
        # tokenizer is its Rust tokenizer's decode behind 7 us of Python (9.4 against 2.7 us on the demo model's
        # vocabulary), unless a subclass decodes its own way.
        plain = (
            isinstance(tokenizer, TokenizersBackend)
            and type(tokenizer).decode is PreTrainedTokenizerBase.decode
            and type(tokenizer)._decode is TokenizersBackend._decode
        )
        self._backend = tokenizer.backend_tokenizer if plain else None

    @classmethod
    def load(cls, model_dir: str | Path) -> Tokenizer:
        return cls(load_tokenizer(str(model_dir)))

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        """`max_length`: at most that many tokens, cut as the tokenizer truncates (its special tokens kept)."""
        if max_length is None:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        ids = self._tokenizer.encode(
            text, add_special_tokens=add_special_tokens, truncation=True, max_length=max_length
        )
        # The tokenizer leaves a text whole when its special tokens alone exceed max_length: cut the ids then.
        return self.truncated(ids, max_length)

    def encode_pair(self, text: str, pair: str, max_length: int | None = None) -> tuple[list[int], list[int]]:
        """Two texts as one input, the way the tokenizer pairs them (BERT: `[CLS] a [SEP] b [SEP]`): the token ids,
        and each token's segment where the model reads segments (an empty list where it does not: all 0).
        `max_length` truncates the longer text first, as the tokenizer's `longest_first` does."""
        truncation = {"truncation": True, "max_length": max_length} if max_length is not None else {}
        encoded = self._tokenizer(text, pair, **truncation)
        ids = list(encoded["input_ids"])
        types = list(encoded.get("token_type_ids") or [])
        if max_length is not None and len(ids) > max_length:
            # Its special tokens alone exceed max_length (the tokenizer then leaves the pair whole): cut the ids.
            keep = self.truncated(list(range(len(ids))), max_length)
            ids = [ids[i] for i in keep]
            types = [types[i] for i in keep] if types else []
        return ids, types

    def truncated(self, token_ids: list[int], max_length: int) -> list[int]:
        """At most `max_length` of the ids, dropped from the side the tokenizer truncates (its `truncation_side`:
        the end, for almost every tokenizer)."""
        if len(token_ids) <= max_length:
            return token_ids
        if self._tokenizer.truncation_side == "left":
            return token_ids[len(token_ids) - max_length :]
        return token_ids[:max_length]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._decode(list(token_ids), skip_special_tokens)

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        # No clean-up of spaces: it rewrites text depending on what follows, which would make the decode of a
        # prefix disagree with the prefix of the decode.
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self._tokenizer.decode(
            token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each token as the vocabulary spells it (byte-level BPE's `Ġ` for a space included), as vLLM reports."""
        return self._tokenizer.convert_ids_to_tokens(list(token_ids))

    def decode_keeping(self, token_ids: Sequence[int], kept: frozenset[int]) -> str:
        """Decode like `decode`, but keep the special tokens in `kept` (a tool-call format's markers)."""
        return self._decode([t for t in token_ids if t in kept or t not in self._special_ids], False)

    def special_token_ids(self, tokens: Sequence[str]) -> frozenset[int]:
        """The ids of those of `tokens` that are special tokens of this vocabulary (the rest decode as text anyway)."""
        kept = set()
        for token in tokens:
            token_id = self._tokenizer.convert_tokens_to_ids(token)
            # An unknown token maps to the unknown-token id, which must not be kept in its place.
            if token_id in self._special_ids and self._tokenizer.convert_ids_to_tokens(token_id) == token:
                kept.add(token_id)
        return frozenset(kept)

    def token_text(self, token_id: int) -> str:
        """One token's own text, as reported in logprobs (special tokens included)."""
        return self._decode([token_id], False)

    @functools.cached_property
    def chat_template(self) -> str | None:
        """The template chat requests render with (the default one, where a model names several)."""
        if not self._tokenizer.chat_template:
            return None
        return self._tokenizer.get_chat_template()

    @functools.cached_property
    def chat_template_options(self) -> frozenset[str]:
        """The names the chat template reads that a request may set (`enable_thinking`, `reasoning_effort`, ...):
        every free variable of the template except what the renderer itself passes in."""
        if self.chat_template is None:
            return frozenset()
        # transformers' own compiled template (its environment knows the `{% generation %}` tag), parsed back
        # into the AST that jinja2 reads free variables from. transformers is pinned, which keeps this private
        # helper where it is.
        template = _compile_jinja_template(self.chat_template)
        variables = jinja2.meta.find_undeclared_variables(template.environment.parse(self.chat_template))
        rendering = set(inspect.signature(self._tokenizer.apply_chat_template).parameters)
        rendering |= {"messages", *template.environment.globals, *self._tokenizer.special_tokens_map}
        return frozenset(variables - rendering)

    def render_chat_template(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation (and the tools offered, in OpenAI's shape) as the model's template writes it;
        `template_kwargs` become template variables.

        transformers renders chat templates in jinja2's ImmutableSandboxedEnvironment, so a template (or
        message content) cannot reach Python internals.
        """
        if self.chat_template is None:
            raise ChatTemplateError("This model has no chat template; use /v1/completions with a plain prompt.")
        try:
            return self._tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(template_kwargs or {}),
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"The chat template rejected the messages: {exc}") from exc

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Render the conversation and tokenize it. The rendered text already holds the template's special tokens
        (BOS and the like), so by default it is tokenized without adding them a second time."""
        text = self.render_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        return self.encode(text, add_special_tokens=add_special_tokens)

    def encode_rendered(self, text: str) -> list[int]:
        """Token ids of a rendered chat prompt (its special tokens are already in the text)."""
        return self.encode(text, add_special_tokens=False)

    def detokenizer(self, prompt_ids: Sequence[int], keep_tokens: Sequence[str] = ()) -> IncrementalDetokenizer:
        """`keep_tokens`: special tokens to keep in the text (a tool-call format's markers); others are dropped."""
        kept = self.special_token_ids(keep_tokens)
        if not kept:
            return IncrementalDetokenizer(self.decode, prompt_ids)
        return IncrementalDetokenizer(lambda ids: self.decode_keeping(ids, kept), prompt_ids)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas whose concatenation is the full text.

    Each call decodes a short window (the tokens already emitted since the last boundary plus the new ones)
    and emits the text beyond the window's already-emitted part. Text ending in U+FFFD is held back: it is a
    multi-byte character whose remaining bytes are still to come.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], prompt_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt_ids[-DETOKENIZER_CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = decode(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add new tokens; return the text that is now certain."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The output is complete: return whatever was held back (an incomplete character stays U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(self._prefix_text) or (text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        delta = text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return delta


class StopStringMatcher:
    """Cuts a text stream at the first stop string, never letting any part of a stop string out.

    Text that could be the start of a stop string (a suffix equal to a stop string's prefix) is held back
    until the following text settles it, so a stop string split across tokens or deltas is still caught.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = [s for s in stop if s]
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was reached). After a stop, emit nothing more."""
        if not self._stop:
            return text, False
        self._pending += text
        # Generation would have stopped at the first character that completes a stop string, so the match
        # that ends first wins (then the longer one); the result does not depend on how text was chunked.
        matches = [(i + len(s), i) for s, i in ((s, self._pending.find(s)) for s in self._stop) if i >= 0]
        if matches:
            _, cut = min(matches)
            out, self._pending = self._pending[:cut], ""
            return out, True
        hold = self._partial_match_length()
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold :]
        return out, False

    def flush(self) -> str:
        """The stream ended without a stop string: release the held-back text."""
        out, self._pending = self._pending, ""
        return out

    def _partial_match_length(self) -> int:
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(s[:k]):
                    best = k
                    break
        return best
