"""When drafts pay: a step-cost model measured on the machine while it serves, and each request's acceptance.

A step computing n tokens costs about t(n) = a + b*n: `a` is what every step pays whatever it computes (reading
the weights, once per step, dominates it on CPU at small batches), `b` what each token adds. A step of B decodes
makes B tokens for t(B): t(B)/B a token. A draft costs `b` more in the step and brings a token only if accepted;
the j-th draft of a request is accepted with probability about alpha^j (alpha: the request's measured rate of
accepting a draft given the one before was accepted). So draft j is worth sending while

    alpha^j * t(B) / B  >  b

which at one stream (t(1) = a + b, a >> b) lets even poorly accepted drafts through, and at a large batch (t(B)/B
near b) lets through almost none: speculation steps aside under load by the same rule, with no threshold guessed.
`a` and `b` are a least-squares fit of the recent steps' (tokens, seconds), old steps fading, so the model follows
the machine (its speed drifts) and the workload.

Making a draft costs too: a draft model's passes (one per drafted position, for every request drafting that far)
and its catching up on the tokens the target kept, or an n-gram search. That cost, `d` a drafted token
(`DraftCost`: the drafting's seconds over the tokens it drafted, recent steps weighing more), is kept out of the
steps' fit and added to `b`:

    alpha^j * t(B) / B  >  b + d

Without it a draft model at a large batch looked free to draft for (measured: a 67M target drafted for by the 4M
demo model at 32 sequences, 70% accepted, ran at 0.84x of no drafts in process).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_DECAY = 0.98
"""Weight kept by older steps at each new one: the fit remembers about the last 50 steps."""
_PRIOR_TRIALS = 2.0
"""A new request's acceptance starts from the engine's recent one as if from this many draft trials: a few of its
own outcomes outweigh it."""
LEAST_PRIOR = 0.05
"""The lowest acceptance a new request starts from: where a draft costs little (one stream on a CPU) it still
drafts a token now and then, so that a workload whose drafts start to be accepted is noticed."""


@dataclass
class Acceptance:
    """Drafts so far (a request's, or the engine's): `accepted` out of `trials` (positions whose draft was checked
    with all drafts before it accepted), old ones fading. The engine's starts at 1/2."""

    accepted: float = _PRIOR_TRIALS / 2
    trials: float = _PRIOR_TRIALS

    @property
    def rate(self) -> float:
        return self.accepted / self.trials

    def prior(self) -> Acceptance:
        """A new request's starting point: this (the engine's) rate, at least `LEAST_PRIOR`, as `_PRIOR_TRIALS`
        trials."""
        return Acceptance(max(self.rate, LEAST_PRIOR) * _PRIOR_TRIALS, _PRIOR_TRIALS)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        # Position num_accepted (if any draft is left) was tried and failed; those before it succeeded.
        tried = num_accepted + (num_accepted < num_drafts)
        self.accepted = self.accepted * _DECAY + num_accepted
        self.trials = self.trials * _DECAY + tried


class StepCost:
    """Least-squares fit of t(n) = a + b*n over recent steps, recent ones weighing more."""

    def __init__(self) -> None:
        self._w = self._n = self._t = self._nn = self._nt = 0.0

    def record(self, num_tokens: int, seconds: float) -> None:
        d = _DECAY
        self._w = self._w * d + 1.0
        self._n = self._n * d + num_tokens
        self._t = self._t * d + seconds
        self._nn = self._nn * d + num_tokens * num_tokens
        self._nt = self._nt * d + num_tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b), once steps of different sizes were seen; None before (nothing to tell a from b)."""
        w = self._w
        if w == 0.0:
            return None
        variance = self._nn / w - (self._n / w) ** 2
        mean_n = self._n / w
        if variance < 1e-6 * max(1.0, mean_n * mean_n):
            return None
        b = (self._nt / w - mean_n * self._t / w) / variance
        b = max(b, 0.0)
        a = max(self._t / w - b * mean_n, 0.0)
        return a, b


class DraftCost:
    """Seconds of drafting per drafted token over recent steps (old ones fading as in `StepCost`); 0 until a step
    drafted."""

    def __init__(self) -> None:
        self._seconds = self._tokens = 0.0

    def record(self, seconds: float, num_tokens: int) -> None:
        self._seconds = self._seconds * _DECAY + seconds
        self._tokens = self._tokens * _DECAY + num_tokens

    @property
    def per_token(self) -> float:
        if self._tokens <= 0.0:
            return 0.0
        return self._seconds / self._tokens


def drafts_worth(alpha: float, batch: int, cost: tuple[float, float] | None, most: int, draft_cost: float = 0.0) -> int:
    """How many drafts (at most `most`) a request accepting at `alpha` should carry in a step of `batch` decodes,
    each costing `draft_cost` seconds to make, by the rule in the module docstring; `most` while the steps' cost
    is not known yet (drafting is how it gets known)."""
    if cost is None:
        return most
    a, b = cost
    if b <= 0.0:
        return most
    per_token = (a + b * batch) / batch
    paid = b + draft_cost
    if alpha <= 0.0 or per_token <= paid:
        return 0
    if alpha >= 1.0:
        return most
    # alpha^j * per_token > paid  <=>  j < log(paid / per_token) / log(alpha)
    bound = math.log(paid / per_token) / math.log(alpha)
    return max(0, min(most, math.ceil(bound) - 1))
