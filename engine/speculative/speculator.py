"""Each step's drafts: which running requests carry some, how many, from which source; and what came of them.

Two sources: the one --speculative-config names (ngram, suffix, a draft model), for every request; and a
request's own prediction (OpenAI's Predicted Outputs, engine/speculative/prediction.py), which takes its place for
that request and needs no flag.

The engine asks `propose(running)` before planning a step and hands the dict to `Scheduler.schedule(drafts)`,
which plans them where they fit; after the step `observe(plan, result)` reads which drafts the runner accepted
(engine/sampling/verify.py), for each request's and the engine's acceptance rate and the counters the metrics
report, and the engine records the step's time in `cost` (engine/speculative/gate.py). Pure Python, no torch.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from typing import Any

from engine.config import SpeculativeConfig
from engine.core.request import Request, RequestStatus, StepOutput
from engine.core.step import ModelRunnerOutput, SchedulerOutput, num_accepted
from engine.speculative.draft_model import DraftModelDrafts
from engine.speculative.gate import Acceptance, DraftCost, StepCost, drafts_worth
from engine.speculative.ngram import NgramDrafts
from engine.speculative.prediction import PredictionDrafts
from engine.speculative.source import DraftSource
from engine.speculative.suffix import SuffixDrafts

PREDICTION_DRAFTS = 8
"""Most drafts a prediction gives one step without --speculative-config (whose num_speculative_tokens rules
otherwise): a prediction is usually right for long runs, so more than a guessed source's."""
MOST_QUIET_PLANS = 64
"""A request the source found no drafts for is not asked again for 2, 4, 8, ... plans after each miss in a row, up
to this many: a search costs tens of microseconds a request, which at a large batch of answers that repeat
nothing would slow every step (and under async scheduling, asking means holding the request back a plan)."""
BEST_ACCEPTANCE = 0.95
"""The acceptance a step's drafts are weighed at before any request is looked at: where even this would not pay,
the step drafts nothing."""


def draft_source(config: SpeculativeConfig) -> DraftSource:
    """The source of a method that needs nothing but its config (draft_model's needs an engine: EngineCore)."""
    if config.method == "ngram":
        return NgramDrafts(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method != "suffix":
        raise ValueError(f"the {config.method} source is built by the engine that runs it")
    return SuffixDrafts(
        max_tree_depth=config.suffix_decoding_max_tree_depth,
        max_cached_requests=config.suffix_decoding_max_cached_requests,
        min_token_prob=config.suffix_decoding_min_token_prob,
        max_spec_factor=config.suffix_decoding_max_spec_factor,
    )


class Speculator:
    def __init__(self, config: SpeculativeConfig | None, source: DraftSource | None = None) -> None:
        """`source`: --speculative-config's, when the engine builds it (a draft model's engine); by default the
        one `draft_source` makes of the config."""
        self.config = config
        self.source: DraftSource | None = source or (draft_source(config) if config is not None else None)
        """--speculative-config's source; None without the flag (only predictions draft then)."""
        self.most = config.num_speculative_tokens if config is not None else PREDICTION_DRAFTS
        self.predictions = PredictionDrafts()
        self._predicted: dict[str, list[int]] = {}
        """Requests with a prediction, not finished: their drafted tokens [accepted, rejected] so far."""
        self.cost = StepCost()
        """The target's steps, drafting left out (the engine records them, less `take_drafting_seconds()`)."""
        self.draft_cost = DraftCost()
        self._drafting_seconds = 0.0
        """Time spent drafting (sources asked, a draft model's passes) since `take_drafting_seconds`."""
        self.overall = Acceptance()
        """Every request's drafts: where a new request's acceptance starts (a workload whose drafts are rejected
        stops drafting for its next requests too, without each learning it again)."""
        self._acceptance: dict[str, Acceptance] = {}
        self._quiet: dict[str, tuple[int, int]] = {}
        """By request whose source found nothing last time: (the plan before which it is not asked again, misses in
        a row)."""
        self._num_plans = 0
        self._seen: dict[str, Request] = {}
        """Every request taken while there is a source, and every one with a prediction (`add`): told when they
        finish, when what is kept for them goes too."""
        self.num_drafts = 0
        """Draft runs verified (one per request and step that carried drafts)."""
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.most

    @property
    def active(self) -> bool:
        """Whether any request may draft: with --speculative-config, or while a request with a prediction runs."""
        return self.source is not None or bool(self._predicted)

    def add(self, request: Request) -> None:
        """A request taken by the engine: one with a prediction drafts from it; the source sees every request
        finish (a suffix tree learns from all outputs, drafted or not)."""
        if self.source is not None:
            self._seen[request.request_id] = request
        if request.predicted_ids:
            self.predictions.add(request.request_id, request.predicted_ids)
            self._predicted[request.request_id] = [0, 0]
            self._seen[request.request_id] = request

    def propose(self, running: Collection[Request]) -> dict[str, list[int]]:
        """Drafts for the running decodes that may carry some this step (nothing of them in flight, not opted
        out), as many as pay (gate.py)."""
        self._num_plans += 1
        candidates = [request for request in running if _may_draft(request) and not self._is_quiet(request)]
        if not candidates:
            return {}
        batch = len(running)
        cost = self.cost.fit()
        if self._disabled(batch) or not self._may_pay(batch, cost):
            return {}  # not even drafts that are always accepted would pay: no request is looked at
        started = time.perf_counter()
        drafts: dict[str, list[int]] = {}
        batched: list[tuple[Request, int]] = []
        for request in candidates:
            source = self.predictions if request.request_id in self._predicted else self.source
            wanted = self._worth(request, batch, cost) if source is not None else 0
            if not wanted:
                continue
            if isinstance(source, DraftModelDrafts):
                batched.append((request, wanted))  # one batched pass of the draft model per token, below
            else:
                self._take(drafts, request, source.propose(request, wanted))  # type: ignore[union-attr]
        if batched:
            assert isinstance(self.source, DraftModelDrafts)
            proposals = self.source.propose_batch([r for r, _ in batched], [k for _, k in batched])
            for (request, _), proposed in zip(batched, proposals, strict=True):
                self._take(drafts, request, proposed)
        seconds = time.perf_counter() - started
        self._drafting_seconds += seconds
        if drafts:
            # Only steps that drafted: searches that found nothing are the quiet plans' business (a cost recorded
            # against no tokens would keep every later request from drafting, and never be measured again).
            self.draft_cost.record(seconds, sum(len(d) for d in drafts.values()))
        return drafts

    def take_drafting_seconds(self) -> float:
        """The time spent drafting since the last call (the engine leaves it out of the step it records)."""
        seconds, self._drafting_seconds = self._drafting_seconds, 0.0
        return seconds

    def _take(self, drafts: dict[str, list[int]], request: Request, proposed: list[int]) -> None:
        if proposed:
            drafts[request.request_id] = proposed
            self._quiet.pop(request.request_id, None)
        elif request.request_id not in self._predicted:  # a prediction is cheap to ask, and realigns when asked
            misses = self._quiet.get(request.request_id, (0, 0))[1] + 1
            self._quiet[request.request_id] = (self._num_plans + min(2**misses, MOST_QUIET_PLANS), misses)

    def _is_quiet(self, request: Request) -> bool:
        quiet = self._quiet.get(request.request_id) if self._quiet else None
        return quiet is not None and self._num_plans < quiet[0]

    def hold(self, running: Collection[Request]) -> list[str]:
        """Under async scheduling: the running decodes with a step in flight that the next plan should leave out,
        so that the plan after it can give them drafts. Those the gate would let draft, unless the source found
        nothing for them lately (they run ahead as usual while quiet: `MOST_QUIET_PLANS`)."""
        cost = self.cost.fit()
        if self._disabled(len(running)) or not self._may_pay(len(running), cost):
            return []
        held = []
        for request in running:
            if not (request.num_in_flight_tokens and _drafts_allowed(request)):
                continue
            if self.source is None and request.request_id not in self._predicted:
                continue
            if self._is_quiet(request):
                continue
            if self._worth(request, len(running), cost):
                held.append(request.request_id)
        return held

    def _may_pay(self, batch: int, cost: tuple[float, float] | None) -> bool:
        if self.config is not None and not self.config.adaptive:
            return True
        return drafts_worth(BEST_ACCEPTANCE, batch, cost, 1, self.draft_cost.per_token) > 0

    def _disabled(self, batch: int) -> bool:
        limit = self.config.disable_by_batch_size if self.config is not None else None
        return limit is not None and batch > limit

    def _worth(self, request: Request, batch: int, cost: tuple[float, float] | None) -> int:
        acceptance = self._acceptance.get(request.request_id)
        if acceptance is None:
            acceptance = self._acceptance[request.request_id] = self.overall.prior()
        if self.config is not None and not self.config.adaptive:
            return self.most
        return drafts_worth(acceptance.rate, batch, cost, self.most, self.draft_cost.per_token)

    def observe(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """A step's result: how many of each request's drafts were accepted. (Its cost the engine records in
        `cost`, the step's whole time.)"""
        if not plan.draft_token_ids:
            return
        row = -1
        for request_id, samples, drafts in zip(plan.request_ids, plan.samples, plan.draft_token_ids, strict=True):
            row += samples
            if not drafts:
                continue
            accepted = num_accepted(drafts, result.token_ids[row])
            self.num_drafts += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += accepted
            for position in range(accepted):
                self.accepted_per_position[position] += 1
            counts = self._predicted.get(request_id)
            if counts is not None:
                counts[0] += accepted
                counts[1] += len(drafts) - accepted
            self.overall.record(len(drafts), accepted)
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

    def finish(self, outputs: Iterable[StepOutput]) -> None:
        """A step's outputs: each of a request with a prediction carries the counts of its drafts so far; a
        finished request's source gets a last look at it (a suffix tree learns its output), and nothing of it
        is kept here."""
        predicted = self._predicted
        for output in outputs:
            request_id = output.request_id
            counts = predicted.get(request_id) if predicted else None
            if counts is not None:
                output.prediction_tokens = (counts[0], counts[1])
            if not output.finished:
                continue
            predicted.pop(request_id, None)
            request = self._seen.pop(request_id, None)
            if request is not None:
                source = self.predictions if counts is not None else self.source
                if source is not None:
                    source.finished(request)
                self._acceptance.pop(request_id, None)
                self._quiet.pop(request_id, None)


def _drafts_allowed(request: Request) -> bool:
    """A running request that generates and has not opted out (a grammar's drafts are masked by it: verify.py)."""
    return request.status is RequestStatus.RUNNING and request.pooling is None and request.params.speculate


def _may_draft(request: Request) -> bool:
    """A decode that can carry drafts in the next plan: nothing of it in flight."""
    return (
        _drafts_allowed(request)
        and not request.num_in_flight_tokens
        and not request.num_pending_samples
        and request.num_computed_tokens == request.num_tokens - 1
    )
