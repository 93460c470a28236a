"""Each step's drafts: which running requests carry some, how many, from which source; and what came of them.

The engine asks `propose(running)` before planning a step and hands the dict to `Scheduler.schedule(drafts)`,
which plans them where they fit; after the step `observe(plan, result)` reads which drafts the runner accepted
(engine/sampling/verify.py), for each request's acceptance rate, the step-cost fit (engine/speculative/gate.py)
and the counters the metrics report. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from engine.config import SpeculativeConfig
from engine.core.request import Request, RequestStatus
from engine.core.step import ModelRunnerOutput, SchedulerOutput
from engine.speculative.gate import Acceptance, StepCost, drafts_worth
from engine.speculative.ngram import NgramDrafts
from engine.speculative.source import DraftSource

RETRY_PLANS = 8
"""Under async scheduling, a request the source found no drafts for runs ahead this many plans before it is held
back to try again (holding it costs it the overlap of planning with the step before)."""


def draft_source(config: SpeculativeConfig) -> DraftSource:
    if config.method == "ngram":
        return NgramDrafts(config.prompt_lookup_min, config.prompt_lookup_max)
    from engine.speculative.suffix import SuffixDrafts  # TEMP until the module lands

    return SuffixDrafts(
        max_tree_depth=config.suffix_decoding_max_tree_depth,
        max_cached_requests=config.suffix_decoding_max_cached_requests,
        min_token_prob=config.suffix_decoding_min_token_prob,
        max_spec_factor=config.suffix_decoding_max_spec_factor,
    )


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.source = draft_source(config)
        self.cost = StepCost()
        self._acceptance: dict[str, Acceptance] = {}
        self._found_nothing: dict[str, int] = {}
        """By request, the plan at which the source last proposed nothing for it (none since: absent)."""
        self._num_plans = 0
        self._seen: dict[str, Request] = {}
        """Requests the source keeps state for: told when they finish."""
        self.num_drafts = 0
        """Draft runs verified (one per request and step that carried drafts)."""
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens

    def propose(self, running: Collection[Request]) -> dict[str, list[int]]:
        """Drafts for the running decodes that may carry some this step (nothing of them in flight, sampled
        freely: a grammar's requests and those that opted out draft nothing), as many as pay (gate.py)."""
        candidates = [request for request in running if _may_draft(request)]
        if not candidates:
            return {}
        batch = len(running)
        limit = self.config.disable_by_batch_size
        if limit is not None and batch > limit:
            return {}
        cost = self.cost.fit()
        drafts: dict[str, list[int]] = {}
        for request in candidates:
            wanted = self._worth(request, batch, cost)
            if wanted:
                proposed = self.source.propose(request, wanted)
                if proposed:
                    drafts[request.request_id] = proposed
                    self._found_nothing.pop(request.request_id, None)
                else:
                    self._found_nothing[request.request_id] = self._num_plans
        self._num_plans += 1
        return drafts

    def hold(self, running: Collection[Request]) -> list[str]:
        """Under async scheduling: the running decodes with a step in flight that the next plan should leave out,
        so that the plan after it can give them drafts. Those the gate would let draft, unless the source found
        nothing for them lately (they run ahead as usual until `RETRY_PLANS` plans have passed)."""
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return []
        cost = self.cost.fit()
        held = []
        for request in running:
            if not (request.num_in_flight_tokens and _drafts_allowed(request)):
                continue
            since = self._found_nothing.get(request.request_id)
            if since is not None and self._num_plans - since < RETRY_PLANS:
                continue
            if self._worth(request, len(running), cost):
                held.append(request.request_id)
        return held

    def _worth(self, request: Request, batch: int, cost: tuple[float, float] | None) -> int:
        acceptance = self._acceptance.get(request.request_id)
        if acceptance is None:
            acceptance = self._acceptance[request.request_id] = Acceptance()
            self._seen[request.request_id] = request
        return drafts_worth(acceptance.rate, batch, cost, self.config.num_speculative_tokens)

    def observe(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """A step's result: its cost, and how many of each request's drafts were accepted."""
        if plan.request_ids:
            self.cost.record(plan.num_tokens, result.forward_seconds + result.sample_seconds)
        if not plan.draft_token_ids:
            return
        row = -1
        for request_id, samples, drafts in zip(plan.request_ids, plan.samples, plan.draft_token_ids, strict=True):
            row += samples
            if not drafts:
                continue
            tokens = result.token_ids[row]
            accepted = 0
            while accepted < min(len(drafts), len(tokens) - 1) and tokens[accepted] == drafts[accepted]:
                accepted += 1
            self.num_drafts += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += accepted
            for position in range(accepted):
                self.accepted_per_position[position] += 1
            acceptance = self._acceptance.get(request_id)
            if acceptance is not None:
                acceptance.record(len(drafts), accepted)

    def counters(self) -> dict[str, Any]:
        """The drafting counters, by their `EngineStats` names."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": tuple(self.accepted_per_position),
        }

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests that finished or were aborted: the source gets a last look at each, then nothing is kept."""
        for request_id in request_ids:
            request = self._seen.pop(request_id, None)
            if request is not None:
                self.source.finished(request)
                del self._acceptance[request_id]
                self._found_nothing.pop(request_id, None)


def _drafts_allowed(request: Request) -> bool:
    """A running request that samples freely: a grammar's requests and those that opted out draft nothing."""
    return (
        request.status is RequestStatus.RUNNING
        and request.pooling is None
        and request.params.structured_output is None
        and request.params.speculate
    )


def _may_draft(request: Request) -> bool:
    """A decode that can carry drafts in the next plan: nothing of it in flight."""
    return (
        _drafts_allowed(request)
        and not request.num_in_flight_tokens
        and not request.num_pending_samples
        and request.num_computed_tokens == request.num_tokens - 1
    )
