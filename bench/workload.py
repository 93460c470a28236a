"""Seeded synthetic workloads: how many requests, how long their prompts and outputs are, what they share.

Lengths are drawn from a distribution written as a short spec string so that a benchmark command line says exactly
what it ran: `fixed:N`, `uniform:LO:HI`, `lognormal:MEDIAN:SIGMA:MAX` or `pareto:LO:MAX[:ALPHA]`. The last two
are the skewed long-tail shapes (most outputs short, a few very long) where static batching wastes the most.
Token ids are uniform over the vocabulary: with random weights their content does not matter, only their count.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class LengthDist:
    """One length distribution; `sample` always returns an integer in [1, max_value]."""

    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        kind, *raw = spec.split(":")
        arity = {"fixed": (1, 1), "uniform": (2, 2), "lognormal": (3, 3), "pareto": (2, 3)}
        if kind not in arity:
            raise ValueError(f"unknown length distribution {kind!r} in {spec!r}; use one of {sorted(arity)}")
        low, high = arity[kind]
        if not low <= len(raw) <= high:
            raise ValueError(f"{kind} takes {low}-{high} parameters, got {spec!r}")
        try:
            params = tuple(float(value) for value in raw)
        except ValueError:
            raise ValueError(f"non-numeric parameter in length distribution {spec!r}") from None
        if kind == "pareto" and len(params) == 2:
            params = (*params, 1.0)
        dist = cls(kind, params)
        if dist.min_value < 1 or dist.max_value < dist.min_value:
            raise ValueError(f"length distribution {spec!r} must stay within [1, max] with max >= min")
        return dist

    @property
    def min_value(self) -> int:
        if self.kind == "lognormal":
            return 1
        return int(self.params[0])

    @property
    def max_value(self) -> int:
        return int(self.params[{"fixed": 0, "uniform": 1, "lognormal": 2, "pareto": 1}[self.kind]])

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.params[0])
        if self.kind == "uniform":
            return rng.randint(int(self.params[0]), int(self.params[1]))
        if self.kind == "lognormal":
            median, sigma, top = self.params
            value = rng.lognormvariate(math.log(median), sigma)
        else:
            low, top, alpha = self.params
            value = low * rng.paretovariate(alpha)
        # Clipping keeps the tail inside the model's context; the clipped mass lands exactly on the maximum.
        return max(1, min(int(top), round(value)))

    def __str__(self) -> str:
        return ":".join([self.kind, *(f"{p:g}" for p in self.params)])


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 64
    prompt_len: LengthDist = LengthDist("uniform", (16.0, 256.0))
    """Length of each prompt's own part, after the shared prefix."""
    output_len: LengthDist = LengthDist("uniform", (16.0, 256.0))
    """Exact number of tokens generated for each request (EOS is ignored)."""
    prefix_len: int = 0
    """Tokens every prompt starts with (the same ids), to exercise prefix caching."""
    seed: int = 0

    def describe(self) -> dict[str, object]:
        return {
            "num_requests": self.num_requests,
            "prompt_len": str(self.prompt_len),
            "output_len": str(self.output_len),
            "prefix_len": self.prefix_len,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    prompts: list[list[int]]
    output_lens: list[int]

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def total_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def max_seq_len(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens, strict=True))

    def cache_pages(self, slots: int, page_size: int) -> int:
        """Pages for `slots` requests of the longest length at once, plus one spare each.

        Every system gets this capacity: none of them preempts, and none sizes its cache from free memory (which
        on a CPU host would claim most of its RAM).
        """
        return slots * (math.ceil(self.max_seq_len / page_size) + 1)

    def head(self, n: int) -> Workload:
        """The first `n` requests: a small warm-up run with the same shapes."""
        return Workload(self.spec, self.prompts[:n], self.output_lens[:n])


def make_workload(spec: WorkloadSpec, vocab_size: int) -> Workload:
    if spec.num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {spec.num_requests}")
    if spec.prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {spec.prefix_len}")
    rng = random.Random(spec.seed)
    prefix = [rng.randrange(vocab_size) for _ in range(spec.prefix_len)]
    prompts, output_lens = [], []
    for _ in range(spec.num_requests):
        length = spec.prompt_len.sample(rng)
        prompts.append(prefix + [rng.randrange(vocab_size) for _ in range(length)])
        output_lens.append(spec.output_len.sample(rng))
    return Workload(spec, prompts, output_lens)
