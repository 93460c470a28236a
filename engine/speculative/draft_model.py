"""Drafts from a smaller model (`method: draft_model`): a second engine of Ferry's own, on the same tokenizer.

Each proposal is one greedy generation of k tokens per drafting request, all in one batch: the draft engine takes
every request's known tokens (prompt + output) as a prompt, and its steps (a prefill of what is new, then k - 1
decodes) are batched over the requests. The draft engine keeps its own paged KV cache with prefix caching, so
a request's pages from its previous proposal are found again and only the tokens since then (the accepted drafts
and the target's own token) are computed: a rejected draft's K/V is simply never matched. Drafts are greedy
(a deterministic function of the context), so verification (engine/sampling/verify.py) keeps greedy and seeded
output identical to decoding without them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.core.request import RequestRejected, SamplingParams, StepOutput
from engine.speculative.source import DraftingRequest


class DraftEngine(Protocol):
    """What drafting uses of the draft model's engine (an `EngineCore`, which the served model's builds)."""

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> bool: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[StepOutput]: ...


class DraftModelDrafts:
    """`DraftSource` over a draft engine."""

    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine

    def propose(self, request: DraftingRequest, max_drafts: int) -> list[int]:
        return self.propose_batch([request], [max_drafts])[0]

    def propose_batch(self, requests: Sequence[DraftingRequest], max_drafts: Sequence[int]) -> list[list[int]]:
        """Up to `max_drafts[i]` greedy tokens of the draft model after each request's tokens, in one batch."""
        engine = self.engine
        drafts: dict[str, list[int]] = {}
        for request, most in zip(requests, max_drafts, strict=True):
            tokens = [*request.prompt_ids, *request.output_ids]
            try:
                engine.add_request(request.request_id, tokens, SamplingParams(max_new_tokens=most, ignore_eos=True))
            except RequestRejected:
                continue  # longer than the draft model takes: this request drafts nothing
            drafts[request.request_id] = []
        while engine.has_unfinished():
            for output in engine.step():
                if output.request_id in drafts:
                    drafts[output.request_id] += output.new_token_ids
        return [drafts.get(request.request_id, []) for request in requests]

    def finished(self, request: DraftingRequest) -> None:
        """Nothing to drop: each proposal's draft request ends with it."""
