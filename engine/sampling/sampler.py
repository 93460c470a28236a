"""Next-token selection for a batch whose requests each carry their own sampling parameters.

One call serves the whole batch with tensor ops; per-request parameters become small tensors built once per
call. Randomness is Gumbel-max (an exponential race): the token is argmax(log p + G), with Gumbel noise G
drawn from a generator stream that belongs to the request alone, seeded from (seed, tokens generated so far).
A seeded request therefore draws the same tokens whatever shares its batch, at any position in it, and again
when it is recomputed after a preemption. The caller's logits are never modified: logprobs are read from them
(vLLM's default), after the grammar mask of constrained rows: a structured-output request's logprobs are those of
the tokens its grammar allowed (renormalised over them), and its top alternatives are tokens it could have emitted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.core.request import SamplingParams, TokenLogprob
from engine.kernels.library import cpu_kernels_take

_MASK64 = (1 << 64) - 1


class SamplingState(Protocol):
    """What sampling reads of a sequence: its parameters, its tokens so far, its seed."""

    params: SamplingParams
    eos_token_ids: frozenset[int]
    generator_seed: int

    @property
    def prompt_ids(self) -> Sequence[int]: ...

    @property
    def output_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...


def _splitmix64(x: int) -> int:
    """SplitMix64 finaliser: maps neighbouring inputs to unrelated 64-bit values."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _stream_seed(*parts: int) -> int:
    """Generator seed for one draw.

    Hashing, not `seed + step`, keeps seed 7 step 1 apart from seed 8 step 0.
    """
    h = 0
    for part in parts:
        h = _splitmix64(h ^ (part & _MASK64))
    return h


@dataclass(frozen=True, slots=True)
class BatchNeeds:
    """Which per-request features of the sampler a batch's requests may use. One that none uses is skipped without
    a look at each request: a step of 1024 greedy rows then costs an argmax and no loop in Python."""

    penalties: bool = True
    """logit_bias, a repetition, presence or frequency penalty, or min_new_tokens (`SamplingParams.penalised`)."""
    random: bool = True
    """A request that is not greedy."""
    logprobs: bool = True


CHECK_EACH_REQUEST = BatchNeeds()


@dataclass
class SampleResult:
    token_ids: list[int]
    """One token per request, in request order."""
    logprobs: list[TokenLogprob | None]
    """None where the request did not ask for logprobs."""


_PLAIN_ARGMAX_ELEMENTS = 100_000
"""Without the kernel, below this many logits torch's own argmax is the fastest (one stream over a 32k vocabulary:
41 us, blocked 57)."""


def argmax_rows(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """`x.argmax(dim=-1)` of a `[rows, vocab]` tensor, exactly (the first maximum).

    torch's CPU argmax walks each row element by element (4.5 ms for 64 x 32000, 2.1 ms for 1024 x 1024 here).
    float32 logits on the CPU go to the kernel library's one vectorised pass (engine/kernels/cpu_argmax.cpp: one
    row of 151,936 logits in 23 us against torch's 195). Without it, two vectorised passes: take each block's maximum
    (`amax`), pick the first block holding the row's maximum, and run argmax on that block alone (0.43 ms and 0.64
    ms). Two argmaxes walk W / block and block elements a row, so a block near sqrt(W) walks the fewest; `block`
    forces this path and that block.
    """
    if block is None and x.dtype == torch.float32 and cpu_kernels_take(x):
        return torch.ops.ferry_kernels.argmax_rows(x)
    rows, width = x.shape
    if block is None:
        if x.device.type != "cpu" or rows * width < _PLAIN_ARGMAX_ELEMENTS or width < 128:
            return x.argmax(dim=-1)
        block = min(256, 1 << round(math.log2(width) / 2))
    whole = width // block * block
    block_max = x[:, :whole].view(rows, -1, block).amax(dim=-1)
    if whole < width:
        block_max = torch.cat([block_max, x[:, whole:].amax(dim=-1, keepdim=True)], dim=1)
    first = block_max.argmax(dim=-1, keepdim=True) * block
    # The last block may be short: its window is clamped to the row, and the repeats sit after the real end.
    window = (first + torch.arange(block, device=x.device)).clamp_(max=width - 1)
    return first.squeeze(1) + x.gather(1, window).argmax(dim=-1)


class Sampler:
    """Picks one token per request from logits taken at each request's last position."""

    def __init__(self, vocab_size: int, device: torch.device, default_seed: int) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # Mixed into the streams of requests without a seed, so the engine seed decides their draws.
        self.default_seed = default_seed
        # One generator reseeded before each request's draw: its noise depends on nothing but its own stream.
        self._generator = torch.Generator(device=self.device)
        # Pinned staging makes host->device copies of parameters asynchronous: the one sync is the final read.
        self._pin_memory = self.device.type == "cuda"
        self._positions = torch.arange(vocab_size, device=self.device)

    def __call__(
        self,
        logits: torch.Tensor,
        requests: Sequence[SamplingState],
        grammar_bias: tuple[list[int], torch.Tensor] | None = None,
        needs: BatchNeeds = CHECK_EACH_REQUEST,
    ) -> SampleResult:
        """`logits`: [len(requests), >= vocab_size], one row per request, in the same order.

        `grammar_bias`: the constrained rows and, for each, 0 for the tokens its grammar allows and -inf for the
        rest (engine/sampling/token_masks.py); added before penalties and temperature, so a banned token is never
        picked. `needs`: what the requests may use, at least (the caller may know it without looking at each).
        """
        if not requests:
            return SampleResult([], [])
        # A padded lm_head emits columns past the real vocabulary: those ids must never be picked.
        logits = logits[:, : self.vocab_size].float()
        if grammar_bias is not None:
            rows, bias = grammar_bias
            # One operation, out of place: the caller's logits stay as they were.
            logits = (
                logits + bias
                if len(rows) == len(requests)
                else logits.index_add(0, self._tensor(rows, torch.long), bias)
            )
        work = self.apply_penalties(logits, requests) if needs.penalties else logits
        sampled = [row for row, request in enumerate(requests) if not request.params.greedy] if needs.random else []
        if not sampled:
            tokens = argmax_rows(work)
        elif len(sampled) == len(requests):
            tokens = self._sample(work, requests)
        else:
            rows = self._tensor(sampled, torch.long)
            picked = self._sample(work.index_select(0, rows), [requests[row] for row in sampled])
            tokens = argmax_rows(work).index_copy_(0, rows, picked)
        return self._collect(logits, tokens, requests, needs.logprobs)

    def apply_penalties(self, logits: torch.Tensor, requests: Sequence[SamplingState]) -> torch.Tensor:
        """Logits after logit_bias, repetition, presence, frequency penalties and the min_new_tokens ban, in that
        order.

        Returns `logits` itself when no request needs any of them, so the common case costs nothing; otherwise
        a penalised copy. Greedy requests are penalised too: penalties change which token is the most likely.
        Token ids are flattened over all requests into one tensor each, so there is no loop over tokens.
        """
        rep_rows: list[int] = []
        rep_values: list[float] = []
        rep_lengths: list[int] = []
        rep_tokens: list[int] = []
        freq_rows: list[int] = []
        presence: list[float] = []
        frequency: list[float] = []
        freq_lengths: list[int] = []
        freq_tokens: list[int] = []
        ban_rows: list[int] = []
        ban_tokens: list[int] = []
        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        for row, request in enumerate(requests):
            params = request.params
            if params.logit_bias:
                bias_rows += [row] * len(params.logit_bias)
                for token, bias in params.logit_bias:
                    bias_tokens.append(token)
                    bias_values.append(bias)
            if params.repetition_penalty != 1.0:
                # Hugging Face semantics: every token of the prompt and of the output, each counted once.
                rep_rows.append(row)
                rep_values.append(params.repetition_penalty)
                rep_lengths.append(request.num_tokens)
                rep_tokens += request.prompt_ids
                rep_tokens += request.output_ids
            if (params.presence_penalty or params.frequency_penalty) and request.output_ids:
                # OpenAI semantics: generated tokens only.
                freq_rows.append(row)
                presence.append(params.presence_penalty)
                frequency.append(params.frequency_penalty)
                freq_lengths.append(len(request.output_ids))
                freq_tokens += request.output_ids
            if len(request.output_ids) < params.min_new_tokens:
                banned = set(params.stop_token_ids)
                if not params.ignore_eos:
                    banned |= request.eos_token_ids
                # An id past the vocabulary can never be generated, so there is nothing to ban.
                in_vocab = [token for token in banned if 0 <= token < self.vocab_size]
                ban_rows += [row] * len(in_vocab)
                ban_tokens += in_vocab
        if not (bias_rows or rep_rows or freq_rows or ban_rows):
            return logits
        work = logits.clone(memory_format=torch.contiguous_format)  # `view(-1)` below needs it dense
        if bias_rows:
            # Accumulate: a token listed twice for one request gets the sum of its biases, in any order.
            work.index_put_(
                (self._tensor(bias_rows, torch.long), self._tensor(bias_tokens, torch.long)),
                self._tensor(bias_values, torch.float32),
                accumulate=True,
            )
        if rep_rows:
            lengths = self._tensor(rep_lengths, torch.long)
            rows = self._repeat(rep_rows, torch.long, lengths, len(rep_tokens))
            penalty = self._repeat(rep_values, torch.float32, lengths, len(rep_tokens))
            tokens = self._tensor(rep_tokens, torch.long)
            values = work[rows, tokens]
            # A repeated token writes the same value each time it appears, so it is penalised exactly once.
            work[rows, tokens] = torch.where(values > 0, values / penalty, values * penalty)
        if freq_rows:
            lengths = self._tensor(freq_lengths, torch.long)
            total = len(freq_tokens)
            rows = self._repeat(freq_rows, torch.long, lengths, total)
            tokens = self._tensor(freq_tokens, torch.long)
            # Presence counts once (duplicates write one identical value); frequency adds per occurrence.
            work[rows, tokens] = work[rows, tokens] - self._repeat(presence, torch.float32, lengths, total)
            work.index_put_((rows, tokens), -self._repeat(frequency, torch.float32, lengths, total), accumulate=True)
        if ban_rows:
            # index_fill_ takes -inf as a scalar: assigning it through `work[rows, tokens] = ...` makes it a CPU
            # tensor first, whose copy to the GPU waits for the device (the H200 run's second sync per call).
            flat = self._tensor(ban_rows, torch.long) * work.shape[1] + self._tensor(ban_tokens, torch.long)
            work.view(-1).index_fill_(0, flat, float("-inf"))
        return work

    def _sample(self, logits: torch.Tensor, requests: Sequence[SamplingState]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then an exponential race per row; every row here samples."""
        params = [request.params for request in requests]
        x = logits / self._tensor([p.temperature for p in params], torch.float32)[:, None]
        truncated = [row for row, p in enumerate(params) if p.top_k > 0 or p.top_p < 1]
        if len(truncated) == len(params):
            self._top_k_top_p(x, params)
        elif truncated:
            # Sorting is the expensive part: only rows that use top-k/top-p pay for it.
            rows = self._tensor(truncated, torch.long)
            subset = x.index_select(0, rows)
            self._top_k_top_p(subset, [params[row] for row in truncated])
            x.index_copy_(0, rows, subset)
        if any(p.min_p > 0 for p in params):
            # p >= min_p * p_max  <=>  logit >= max logit + log(min_p); log(0) = -inf keeps every token.
            log_min_p = self._tensor([p.min_p for p in params], torch.float32).log()
            x.masked_fill_(x < x.amax(dim=-1, keepdim=True) + log_min_p[:, None], float("-inf"))
        # log p differs from x by a per-row constant, so argmax(x + G) is a draw from softmax(x).
        return argmax_rows(x.add_(self._gumbel_noise(requests)))

    def _top_k_top_p(self, x: torch.Tensor, params: list[SamplingParams]) -> None:
        """Mask, in place, all but each row's top-k tokens and, of those, the shortest prefix with top-p mass.

        Both filters keep a prefix of the sorted row, so one threshold logit per row applies them together;
        ties with the threshold survive, as in Hugging Face's warpers.
        """
        vocab = x.shape[-1]
        top_k_list = [min(p.top_k, vocab) or vocab for p in params]
        top_k = self._tensor(top_k_list, torch.long)
        if all(p.top_p >= 1 for p in params):
            # Top-k alone needs only a partial selection, far cheaper than sorting the vocabulary.
            threshold = x.topk(max(top_k_list), dim=-1).values.gather(1, top_k[:, None] - 1)
        else:
            ordered = x.sort(dim=-1, descending=True).values
            ordered.masked_fill_(self._positions >= top_k[:, None], float("-inf"))
            cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
            top_p = self._tensor([p.top_p for p in params], torch.float32)
            # Keep tokens up to and including the one whose cumulative mass first reaches top_p.
            keep = (cumulative < top_p[:, None]).sum(dim=-1) + 1
            # top_p == 1 keeps all top-k left, even where float rounding lets the mass reach 1 early.
            keep = torch.where(top_p >= 1, top_k, torch.minimum(keep, top_k))
            threshold = ordered.gather(1, keep[:, None] - 1)
        x.masked_fill_(x < threshold, float("-inf"))

    def _gumbel_noise(self, requests: Sequence[SamplingState]) -> torch.Tensor:
        """G = -log(E), E = -log(U) ~ Exp(1), one row per request drawn from that request's own stream.

        The loop over requests is the price of per-request reproducibility: one batched draw would make a
        request's noise depend on its neighbours and its position in the batch.
        """
        noise = torch.empty((len(requests), self.vocab_size), device=self.device)
        for row, request in zip(noise, requests, strict=True):
            step = len(request.output_ids)
            if request.params.seed is not None:
                seed = _stream_seed(request.params.seed, step)
            else:
                seed = _stream_seed(self.default_seed, request.generator_seed, step)
            self._generator.manual_seed(seed)
            # Uniform draws then two logs: on CPU, exponential_ costs several times as much as uniform_.
            row.uniform_(generator=self._generator)
        # E = 0 (U = 1 after rounding) would make G = +inf and pick its token whatever p is.
        return noise.log_().neg_().clamp_(min=torch.finfo(noise.dtype).tiny).log_().neg_()

    def logprobs_of(
        self, logits: torch.Tensor, tokens: list[int], requests: Sequence[SamplingState]
    ) -> list[TokenLogprob | None]:
        """The logprobs `__call__` reports for `tokens` (one per row, each request's), had it picked them: for a
        token the grammar chose after sampling. `logits` as `__call__` sees them after the grammar bias."""
        logits = logits[:, : self.vocab_size].float()
        return self._collect(logits, self._tensor(tokens, torch.long), requests, True).logprobs

    def _collect(
        self, logits: torch.Tensor, tokens: torch.Tensor, requests: Sequence[SamplingState], logprobs_asked: bool
    ) -> SampleResult:
        """Bring the tokens, and logprobs where asked, to the host in one device->host transfer."""
        wanted = [row for row, request in enumerate(requests) if request.params.logprobs] if logprobs_asked else []
        if not wanted:
            return SampleResult(tokens.tolist(), [None] * len(requests))
        rows = self._tensor(wanted, torch.long)
        logprobs = torch.log_softmax(logits.index_select(0, rows), dim=-1)
        chosen = logprobs.gather(1, tokens.index_select(0, rows)[:, None]).squeeze(1)
        # A vocabulary smaller than top_logprobs (tiny test models) has only that many alternatives.
        num_top = min(max(requests[row].params.top_logprobs for row in wanted), self.vocab_size)
        top = logprobs.topk(num_top, dim=-1)
        # float64 holds every token id exactly, so ids and logprobs travel together.
        host = torch.cat(
            [tokens.double(), chosen.double(), top.values.double().flatten(), top.indices.double().flatten()]
        ).tolist()
        num_rows, num_wanted = len(requests), len(wanted)
        token_ids = [int(token) for token in host[:num_rows]]
        top_values = host[num_rows + num_wanted : num_rows + num_wanted * (1 + num_top)]
        top_ids = host[num_rows + num_wanted * (1 + num_top) :]
        result: list[TokenLogprob | None] = [None] * num_rows
        for index, row in enumerate(wanted):
            start = index * num_top
            alternatives = [
                (int(top_ids[start + rank]), top_values[start + rank])
                for rank in range(min(requests[row].params.top_logprobs, num_top))
            ]
            result[row] = TokenLogprob(token_ids[row], host[num_rows + index], alternatives)
        return SampleResult(token_ids, result)

    def _tensor(self, values: list[int] | list[float], dtype: torch.dtype) -> torch.Tensor:
        """A small per-call tensor on the device, copied without blocking the host."""
        staged = torch.tensor(values, dtype=dtype, pin_memory=self._pin_memory)
        return staged.to(self.device, non_blocking=True)

    def _repeat(
        self, values: list[int] | list[float], dtype: torch.dtype, lengths: torch.Tensor, total: int
    ) -> torch.Tensor:
        """Each request's value repeated over its tokens; `total` is passed so the device need not sync."""
        return torch.repeat_interleave(self._tensor(values, dtype), lengths, output_size=total)
