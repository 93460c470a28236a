"""What goes in (a request with its sampling parameters) and what comes out (per-step deltas, final outputs).

A request's progress is two numbers: `num_computed_tokens` (tokens whose K/V sit in the cache) and `num_tokens`
(prompt + generated). Prefill, chunked prefill, decode and resume after preemption are all "compute the tokens
from computed to total, within the budget": there are no phase flags to keep in sync.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Literal

from engine.multimodal.inputs import ImageInput


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class RequestRejected(ValueError):
    """A request that can never be served; `code` is machine-readable (e.g. `context_length_exceeded`)."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code


class QueueFull(RuntimeError):
    """The waiting queue is at `max_queue_size`; the caller may retry later."""


StructuredOutputKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "tool_calls", "harmony"]


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on what a request may generate; the engine masks every token that would break it.

    `spec` by `kind`:
    - `json_schema`: the JSON Schema, as JSON text (an object). Generated JSON has no free whitespace.
    - `json_object`: empty; any JSON object.
    - `regex`: a regular expression (Rust `regex` syntax) the whole output must match.
    - `choice`: a JSON array of strings, the output is exactly one of them.
    - `grammar`: a grammar in llguidance's Lark dialect (`start: ...`; engine/core/structured.py links its syntax).
    - `tool_calls`: calls in the model's own format, as a JSON object: `{"begin": "<tool_call>\\n", "end":
      "\\n</tool_call>", "call": <schema of one call object>, "parallel": true, "answer": <schema> or null,
      "text": false}`: one call (or several, `parallel`) each a JSON object between `begin` and `end`; or, where
      `answer` is given, a JSON answer of that schema instead; or, with `text`, any text that does not start
      with `begin` (a model free to answer, whose calls must be valid once it starts one).
    - `harmony`: a reply in gpt-oss's Harmony format (its special tokens by name), as a JSON object: `{"answer":
      <schema> or null, "calls": {"<function>": <schema of its arguments>, ...}}`: an analysis (reasoning)
      message or none, then either a call to one of `calls` (a commentary message to `functions.<function>`, its
      arguments JSON of that schema, ending with `<|call|>`) or, where `answer` is given, a final message whose
      text is JSON of that schema (ending with `<|return|>`).

    Once the constraint is satisfied only the request's EOS and stop tokens may follow, so the request ends with
    `stop`; `ignore_eos` and `min_new_tokens` cannot go with it.
    Checked here for shape only; `engine.core.structured.check(structured_output, tokenizer_dir)` compiles it, so what
    the grammar library refuses is a 400 before anything streams.
    """

    kind: StructuredOutputKind
    spec: str = ""

    def __post_init__(self) -> None:
        problem = _structured_output_problem(self.kind, self.spec)
        if problem:
            raise RequestRejected(problem, code="invalid_structured_output")


def _structured_output_problem(kind: str, spec: str) -> str | None:
    kinds = StructuredOutputKind.__args__
    if kind not in kinds:
        return f"structured output kind must be one of {', '.join(kinds)}, got {kind!r}"
    if not isinstance(spec, str):
        return f"a {kind} structured output spec must be a string, got {type(spec).__name__}"
    if kind == "json_object":
        return "json_object takes no spec (it means any JSON object)" if spec.strip() else None
    if not spec.strip():
        return f"the {kind} structured output needs a non-empty spec"
    if kind not in ("json_schema", "choice", "tool_calls", "harmony"):
        return None
    try:
        value = json.loads(spec)
    except json.JSONDecodeError as exc:
        return f"the {kind} spec is not valid JSON: {exc}"
    if kind == "json_schema" and not isinstance(value, dict):
        return f"a JSON schema must be a JSON object, got {type(value).__name__}"
    if kind == "tool_calls":
        return _tool_calls_problem(value)
    if kind == "harmony":
        return _harmony_problem(value)
    if kind == "choice" and not (
        isinstance(value, list) and value and all(isinstance(item, str) and item for item in value)
    ):
        return "a choice spec must be a non-empty JSON array of non-empty strings"
    return None


def _tool_calls_problem(value: object) -> str | None:
    if not isinstance(value, dict) or set(value) != {"begin", "end", "call", "parallel", "answer", "text"}:
        return "a tool_calls spec is a JSON object with begin, end, call, parallel, answer and text"
    if not isinstance(value["text"], bool) or (value["text"] and value["answer"] is not None):
        return "a tool_calls spec's text must be true or false, and false where it has an answer"
    if not (isinstance(value["begin"], str) and value["begin"] and isinstance(value["end"], str) and value["end"]):
        return "a tool_calls spec's begin and end must be non-empty strings"
    if not isinstance(value["call"], dict) or not (value["answer"] is None or isinstance(value["answer"], dict)):
        return "a tool_calls spec's call must be a JSON schema object, its answer one or null"
    if not isinstance(value["parallel"], bool):
        return "a tool_calls spec's parallel must be true or false"
    return None


def _harmony_problem(value: object) -> str | None:
    if not isinstance(value, dict) or set(value) != {"answer", "calls"}:
        return "a harmony spec is a JSON object with answer and calls"
    answer, calls = value["answer"], value["calls"]
    if not (answer is None or isinstance(answer, dict)):
        return "a harmony spec's answer must be a JSON schema object or null"
    if not isinstance(calls, dict) or not all(name and isinstance(schema, dict) for name, schema in calls.items()):
        return "a harmony spec's calls must map function names to JSON schema objects"
    if answer is None and not calls:
        return "a harmony spec needs an answer, calls, or both"
    return None


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 0.0
    """0 means greedy."""
    top_k: int = 0
    """0 disables top-k."""
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    """Same seed, same tokens, whatever else shares the batch."""
    logprobs: bool = False
    top_logprobs: int = 0
    """Alternatives returned beside the chosen token's logprob (needs `logprobs`)."""
    stop_token_ids: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None
    """None means the model's own EOS ids (from its generation config)."""
    ignore_eos: bool = False
    record_timestamps: bool = False
    prompt_logprobs: int | None = None
    """Also return each prompt token's logprob (from the second token on), with this many alternatives; such a
    request computes its whole prompt (no prefix-cache hits: cached positions have no logits)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before anything else (OpenAI's `logit_bias`; -100 bans)."""
    structured_output: StructuredOutput | None = None
    """Constrains the output (JSON schema, regex, ...); None leaves it free."""
    close_within_budget: bool = True
    """A JSON constraint's value closes within `max_new_tokens` (its shortest valid completion forced when the
    tokens left are just enough), and the request then ends with `length`; False lets it run out unclosed."""
    speculate: bool = True
    """Whether the engine may draft tokens for it (with --speculative-config): False opts a request out, as one
    whose drafts would rarely be accepted, at no change to its output."""

    def __post_init__(self) -> None:
        checks = [
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (self.min_new_tokens >= 0, f"min_new_tokens must be >= 0, got {self.min_new_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (0 < self.top_p <= 1 or self.top_p == 0, f"top_p must be in [0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (
                -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (0 <= self.top_logprobs <= 20, f"top_logprobs must be in [0, 20], got {self.top_logprobs}"),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
            ),
            (
                all(-100 <= bias <= 100 for _, bias in self.logit_bias),
                "logit_bias values must be in [-100, 100]",
            ),
            (
                self.structured_output is None or not self.ignore_eos,
                "ignore_eos cannot go with structured output: a satisfied constraint allows only EOS",
            ),
            (
                self.structured_output is None or not self.min_new_tokens,
                "min_new_tokens cannot go with structured output: a satisfied constraint allows only EOS",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestRejected(message, code="invalid_value")

    @property
    def greedy(self) -> bool:
        # top_p == 0 keeps only the most likely token, which is greedy decoding too.
        return self.temperature == 0 or self.top_k == 1 or self.top_p == 0

    @property
    def penalised(self) -> bool:
        """Whether the sampler changes this request's logits before choosing (`Sampler.apply_penalties`)."""
        return bool(
            self.logit_bias
            or self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.min_new_tokens
        )


@dataclass(frozen=True)
class PoolingParams:
    """Marks a request that computes its prompt and returns one vector instead of generating (an embedding, a
    classifier's scores, a yes/no reranker's score: what the model's pooler makes, engine/pooling/). Such a request
    samples nothing and finishes with `stop` once its prompt is computed; its pages are freed then."""

    token_type_ids: tuple[int, ...] = ()
    """Per prompt token, its segment (BERT's second text of a pair is 1); empty: all 0. A model without segments
    (ModernBERT, a decoder) does not read them."""


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    """The `top_logprobs` most likely tokens at this position, most likely first."""


Spans = tuple[tuple[int, int], ...]
"""Position ranges `[start, end)`, in order and not overlapping: a request's non-causal spans (an image's tokens, an
encoder's input), whose tokens attend to each other in both directions (engine/attention/base.py)."""


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """The LoRA adapter a request runs with (engine/lora/): its name, the directory PEFT saved it in, and `lora_id`,
    unique to one loading of it, so an adapter reloaded from other files under the same name is another adapter
    to the prefix cache and the runner's caches."""

    name: str
    lora_id: int
    path: str

    def __post_init__(self) -> None:
        if self.lora_id < 1:
            raise ValueError(f"a LoRA adapter's id must be >= 1, got {self.lora_id}")

    @property
    def extra_key(self) -> ExtraKey:
        """Its key for the prefix cache: every page of a request with this adapter depends on it."""
        return ExtraKey(0, 1, ("lora", self.lora_id))


@dataclass(frozen=True, slots=True)
class ExtraKey:
    """Something besides the token ids that the K/V of tokens `[start, end)` depend on: a LoRA adapter, an image
    (its hash), a client's cache salt. The prefix cache mixes `key` into the hash of every page the range overlaps
    (engine/core/page_pool.py), so requests with equal tokens and different keys never share those pages or any
    after them. A key for the whole request (an adapter, a salt) covers `[0, 1)`: the chain carries it onward."""

    start: int
    end: int
    key: Hashable

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"an extra key's token range must be non-empty, from 0 on: [{self.start}, {self.end})")


@dataclass(slots=True)
class Request:
    """Engine-side state of one sequence. Only the engine thread/process touches it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at first admission (reported as usage.cached_tokens)."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    generator_seed: int = 0
    priority: int = 0
    """Lower runs first under the `priority` scheduling policy."""
    batch: bool = False
    """A line of the Batch API: it waits behind every interactive request, under either scheduling policy, and
    is preempted before any of them."""
    num_prompt_logprobs: int = 0
    """Prompt positions whose logprobs were already reported (a recompute after preemption repeats none)."""
    num_in_flight_tokens: int = 0
    """Tokens of planned steps whose results are not applied yet (with async scheduling, one step ahead)."""
    num_pending_samples: int = 0
    """Planned steps that sample this request, results not applied yet: tokens it has but does not know yet."""
    noncausal_spans: Spans = ()
    """Positions attended in both directions (engine/attention/base.py); a plan computes each one whole."""
    extra_keys: tuple[ExtraKey, ...] = ()
    """What its pages' K/V depend on besides token ids, for the prefix cache's page hashes."""
    lora: LoRARequest | None = None
    """The LoRA adapter it runs with (its key is among `extra_keys`); None: the base model."""
    stop_ids: frozenset[int] = frozenset()
    """The tokens that stop it once `min_new_tokens` are out (EOS unless ignored, `stop_token_ids`); set by the
    scheduler when it takes the request, with `max_output_tokens`."""
    max_output_tokens: int = 0
    """Output tokens it may reach: `max_new_tokens`, or fewer where the model length ends it first."""
    closed_by_budget: bool = False
    """The runner forced its JSON closed to fit the tokens left: it ends with `length`, even on EOS."""
    pooling: PoolingParams | None = None
    """Set for a request that pools its prompt instead of generating."""
    predicted_ids: tuple[int, ...] = ()
    """The output the client predicts (OpenAI's Predicted Outputs), drafted from as the output follows it."""
    images: tuple[ImageInput, ...] = ()
    """The images among its prompt tokens, in prompt order (their hashes are among `extra_keys`)."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole sequence."""
        n = len(self.prompt_ids)
        if start >= n:
            # A decode step: the one token sampled last.
            if end == start + 1 == n + len(self.output_ids):
                return [self.output_ids[-1]]
            return self.output_ids[start - n : end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(slots=True)
class StepOutput:
    """One request's news from one engine step: the tokens it gained, and whether it finished.

    The engine sends deltas (one message per step for all requests), consumers accumulate them.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    new_logprobs: list[TokenLogprob] | None = None
    new_timestamps: list[float] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    """Set when the request failed inside the engine (finish_reason is then ABORT)."""
    queue_seconds: float | None = None
    """Set on the first delta of a request: seconds from arrival to first being scheduled."""
    new_prompt_logprobs: list[TokenLogprob] | None = None
    """Logprobs of the next prompt tokens, in order from the second (with `prompt_logprobs`)."""
    pooled: list[float] | None = None
    """A pooling request's vector, on its final delta."""
    prediction_tokens: tuple[int, int] | None = None
    """For a request with a prediction: its drafted tokens accepted and rejected so far."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationOutput:
    """Everything one request produced so far; final once `finish_reason` is set."""

    request_id: str
    prompt_ids: list[int]
    generated_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    timestamps: list[float] | None = None
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    """With `prompt_logprobs`: one entry per prompt token from the second on."""
    pooled: list[float] | None = None
    """A pooling request's vector, once finished."""
    prediction_tokens: tuple[int, int] | None = None
    """With a prediction, once finished: its drafted tokens accepted and rejected."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, delta: StepOutput) -> None:
        self.generated_ids.extend(delta.new_token_ids)
        if delta.new_prompt_logprobs is not None:
            self.prompt_logprobs = (self.prompt_logprobs or []) + delta.new_prompt_logprobs
        if delta.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.new_logprobs
        if delta.new_timestamps is not None:
            self.timestamps = (self.timestamps or []) + delta.new_timestamps
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.pooled is not None:
            self.pooled = delta.pooled
        if delta.prediction_tokens is not None:
            self.prediction_tokens = delta.prediction_tokens
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.error = delta.error
