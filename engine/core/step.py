"""The step boundary: what the scheduler hands the runner (`SchedulerOutput`) and what comes back
(`ModelRunnerOutput`). Pure Python, no torch: the same plan can be sent to another process or rank as it is.

A plan is self-contained for the runner: the token ids to compute, the pages newly given to each request, and
everything needed to sample a request the runner has not seen before. The runner keeps its own per-request state
(page tables, sampling state) from those deltas, so a step's plan stays small however long the sequences are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.core.request import LoRARequest, PoolingParams, SamplingParams, Spans, TokenLogprob
from engine.multimodal.inputs import ImageInput

PLACEHOLDER = -1
"""A token id the scheduler does not know yet: the token the runner samples for this request in the step before
(async scheduling plans step N+1 before step N's result is back; the runner fills it in from its own state)."""

PageTables = tuple[tuple[int, ...], ...]
"""One request's pages per KV-cache group, in group order (-1: a page its sliding window released)."""


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A request the runner does not know yet (first admission, or resume after preemption)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    """Tokens generated before a preemption (empty on first admission): penalties and seeds continue from them."""
    params: SamplingParams
    eos_token_ids: frozenset[int]
    generator_seed: int
    page_tables: PageTables
    """The whole table in every group, prefix-cache hits included."""
    noncausal_spans: Spans = ()
    """Positions whose tokens attend to each other in both directions (an image's, an encoder's input)."""
    max_output_tokens: int | None = None
    """Output tokens it may reach (`Request.max_output_tokens`: `max_new_tokens`, or fewer where the model length
    ends it first), as the scheduler's stop rule counts them; None: `params.max_new_tokens`."""
    pooling: PoolingParams | None = None
    """Set for a request that pools its prompt: the runner pools its hidden states and never samples it."""
    lora: LoRARequest | None = None
    """The LoRA adapter it runs with (None: the base model)."""
    images: tuple[ImageInput, ...] = ()
    """The images among its prompt tokens, in prompt order: their embeddings replace those tokens' embeddings."""
    state_slot: int | None = None
    """Its recurrent-state slot (engine/core/state_slots.py); None for a model without recurrent layers."""


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step, decided. Per scheduled request (packing order): compute `token_ids[i]`, which are the tokens
    from position `num_computed_tokens[i]` on, and sample after them when `samples[i]`. A decode planned while
    the step before it runs has the one token `PLACEHOLDER`: the token that step samples for the request.

    Drafts: a sampling request may carry `draft_token_ids[i]` (guesses of the tokens after its last known one).
    They are the last tokens of `token_ids[i]` and count in `num_new_tokens[i]`; the request is then sampled at
    its last known token and at each draft (1 + drafts positions). Its result holds 1 + accepted tokens: the
    accepted drafts, then the token sampled after the last of them. Only accepted positions become computed;
    the K/V slots written for rejected drafts are garbage, overwritten by a later step, and pages holding only
    such slots go back to the pool (see `Scheduler.update`). A request with drafts samples at its last position
    as well (`samples[i]` is true) and is never planned ahead of its result (async scheduling).
    """

    request_ids: tuple[str, ...] = ()
    num_computed_tokens: tuple[int, ...] = ()
    num_new_tokens: tuple[int, ...] = ()
    token_ids: tuple[Sequence[int], ...] = ()
    samples: tuple[bool, ...] = ()
    """A request samples when this step computes its last known token (a finished prefill, or a decode)."""
    draft_token_ids: tuple[tuple[int, ...], ...] = ()
    """Per scheduled request, the drafts ending its `token_ids` (empty: none); `()` when no request has any."""
    new_requests: tuple[NewRequest, ...] = ()
    """Scheduled requests the runner has not seen, with their whole page tables."""
    new_pages: tuple[tuple[str, PageTables], ...] = ()
    """Pages appended this step to the tables of requests the runner already knows (only those that got any)."""
    shrunk_tables: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Tables cut since the previous plan (pages of rejected drafts freed): their length per group, applied
    before `new_pages`."""
    preempted_ids: tuple[str, ...] = ()
    """Preempted while this step was planned: back in the waiting queue, holding no pages."""
    finished_ids: tuple[str, ...] = ()
    """Finished or aborted since the previous plan: the runner drops what it kept for them."""
    encodes: tuple[ImageInput, ...] = ()
    """Images to encode before this step's forward pass, each content once, kept (by content hash) until a plan
    frees it. Every image a chunk of this step reaches is encoded by
    it or held (engine/multimodal/encoder_cache.py)."""
    freed_encodings: tuple[str, ...] = ()
    """Content hashes of held encodings to drop, before this step's are made (no chunk of it reads them)."""

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_sampling(self) -> int:
        return sum(self.samples)

    def drafts(self, index: int) -> tuple[int, ...]:
        """The drafts of scheduled request `index` (empty without)."""
        return self.draft_token_ids[index] if self.draft_token_ids else ()


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Logprobs of prompt tokens `first_position ...` of one request, each given the tokens before it."""

    request_id: str
    first_position: int
    entries: list[TokenLogprob]


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """What the step produced: per sampling request, in plan order, its new tokens and (when asked) their logprobs.

    A request gets at least one token and at most 1 + its drafts: the drafts accepted, in order, then the token
    sampled after the last accepted one. A runner may also return tokens it knows to follow by other means (a
    scripted runner in the tests); tokens beyond the accepted drafts have no K/V yet and are computed by a later
    step. The scheduler applies the stop rules to each token in order and drops those after the one that stops.
    """

    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)
    """Per sampling request, one entry per token of `token_ids` (None: logprobs not asked for)."""
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    """For requests with `prompt_logprobs` whose prompt this step computed part of."""
    pooled: dict[str, list[float]] = field(default_factory=dict)
    """By request id, the vector of each pooling request whose prompt this step finished computing."""
    closed_by_budget: list[int] = field(default_factory=list)
    """Sampling rows (indexes into `token_ids`) whose JSON the budget is closing (engine/sampling/token_masks.py
    BudgetClosing): they end with `length`."""
    grammar_errors: dict[int, str] = field(default_factory=dict)
    """Sampling rows whose grammar could not be followed this step (`GrammarState.error`): they end with ABORT and
    the error, without this step's tokens."""
    prepare_seconds: float = 0.0
    """Host time building the step's input tensors."""
    forward_seconds: float = 0.0
    """Time in the model; on CUDA partly asynchronous, completed by the sampler's single sync."""
    sample_seconds: float = 0.0


def num_accepted(drafts: Sequence[int], tokens: Sequence[int]) -> int:
    """How many leading drafts a result confirmed: those equal to its tokens, the last token excluded (it is the
    one sampled after the accepted drafts)."""
    accepted = 0
    for draft, token in zip(drafts, tokens[:-1], strict=False):
        if draft != token:
            break
        accepted += 1
    return accepted
