"""Grammar-constrained rows of a step: each constrained sequence's grammar state, and the one bias tensor per step
that bans every token those grammars forbid.

The runner keeps a `GrammarState` per constrained sequence, built by `StepGrammars.state_of` when the sequence
arrives (on resume after a preemption it replays the tokens generated so far), and advances it with each token
sampled (`StepGrammars.advance`); prefill chunks never touch it. `GrammarMasker.bias`
fills one bitmask for all the step's constrained rows with llguidance's batched fill on the CPU, then expands it on
the device into an additive bias, 0 where a token is allowed and -inf where it is not, which the sampler adds to
the logits in one operation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import llguidance
import numpy as np
import torch

from engine.core.step import NewRequest
from engine.core.structured import CompiledGrammar, GrammarCompiler

logger = logging.getLogger(__name__)

_NEG_INF_BITS = -8388608
"""0xFF800000 as int32: the bits of float32 -inf (and 0 is the bits of 0.0)."""


class GrammarState:
    """Where one sequence stands in its grammar.

    `end_token_ids` are the request's EOS and stop tokens: the ones it may end with once the grammar is complete.
    """

    def __init__(self, compiled: CompiledGrammar, end_token_ids: frozenset[int], generated: Sequence[int]) -> None:
        self.matcher = compiled.matcher()
        self.end_token_ids = end_token_ids
        for token in generated:
            self.advance(token)

    def advance(self, token: int) -> None:
        # An end token finishes the request: the grammar has nothing left to follow.
        if token in self.end_token_ids:
            return
        if not self.matcher.consume_token(token):
            # The mask allowed it, so this is the library disagreeing with itself; from here its mask allows
            # only EOS, which ends the request.
            logger.error("grammar refused the token %d it allowed: %s", token, self.matcher.get_error())


class GrammarMasker:
    """Turns the grammar states of a step's constrained rows into one bias tensor for the sampler.

    `library_end_token_ids` are the tokens llguidance allows once a grammar is complete (the model's EOS); a request
    that ends on other tokens gets its own allowed there instead. The batched fill runs on llguidance's own threads
    (by default 80% of the cores, up to 32): torch is idle meanwhile on a CPU, and on a GPU the device is busy
    with the forward pass, issued before the fill.
    """

    def __init__(
        self,
        vocab_size: int,
        max_rows: int,
        device: torch.device,
        library_end_token_ids: frozenset[int],
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._words = -(-vocab_size // 32)
        pin = device.type == "cuda"
        # The library writes each row in place; on CUDA the buffer is pinned so its copy to the device is async.
        self._packed = torch.zeros((max_rows, self._words), dtype=torch.int32, pin_memory=pin)
        self._bits = self._packed.numpy().view(np.uint32)
        self._executor = llguidance.LLExecutor()
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)
        self._library_ends = library_end_token_ids
        self._library_words, self._library_bits = _word_bits(library_end_token_ids, vocab_size)
        self.num_masked_rows = 0
        """Rows masked since start-up: a step without constrained rows adds nothing."""

    def bias(self, states: Sequence[GrammarState]) -> torch.Tensor:
        """`[len(states), vocab_size]` float32 on the device: 0 where each row's grammar allows the token, else -inf."""
        rows = len(states)
        self._executor.unsafe_compute_mask_ptr(
            [(state.matcher, row) for row, state in enumerate(states)],
            self._packed.data_ptr(),
            self._words * 4,
            rows,
        )
        for row, state in enumerate(states):
            if state.end_token_ids != self._library_ends:
                self._use_own_end_tokens(row, state.end_token_ids)
        self.num_masked_rows += rows
        packed = self._packed[:rows].to(self.device, non_blocking=True)
        # Bit b of word w is token 32w + b: expand to one int32 per token (1 allowed, 0 not), then 1 -> 0.0 and
        # 0 -> -inf by bits alone (x - 1 is 0 or all ones, masked to -inf's pattern).
        bias = (packed.unsqueeze(-1) >> self._shifts).bitwise_and_(1).sub_(1).bitwise_and_(_NEG_INF_BITS)
        return bias.view(torch.float32).view(rows, -1)[:, : self.vocab_size]

    def _use_own_end_tokens(self, row: int, end_token_ids: frozenset[int]) -> None:
        """Where the library allowed its EOS (the grammar may end here), allow the request's end tokens instead."""
        bits = self._bits[row]
        complete = bool((bits[self._library_words] & self._library_bits).any())
        np.bitwise_and.at(bits, self._library_words, ~self._library_bits)
        if complete:
            words, masks = _word_bits(end_token_ids, self.vocab_size)
            np.bitwise_or.at(bits, words, masks)


def _word_bits(token_ids: frozenset[int], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Each token's bitmask word and its bit in that word (tokens outside the vocabulary left out)."""
    tokens = np.fromiter((t for t in token_ids if 0 <= t < vocab_size), dtype=np.int64)
    return tokens >> 5, (np.uint32(1) << (tokens & 31).astype(np.uint32)).astype(np.uint32)


class StepGrammars:
    """The runner's grammar side: the state of each constrained request it is handed, and each step's bias.

    The masker is built with the first constrained row: steps without any never touch a grammar.
    """

    def __init__(self, compiler: GrammarCompiler, vocab_size: int, max_rows: int, device: torch.device) -> None:
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self.device = device
        self.masker: GrammarMasker | None = None

    def state_of(self, new: NewRequest) -> GrammarState | None:
        """A constrained request's grammar state, caught up with the tokens it generated before a preemption."""
        structured_output = new.params.structured_output
        if structured_output is None:
            return None
        # Compiled before the request was admitted, so this is a cache hit (a recompile only if it was evicted).
        compiled = self.compiler.compile(structured_output)
        return GrammarState(compiled, new.eos_token_ids | frozenset(new.params.stop_token_ids), new.output_ids)

    def bias(self, states: Sequence[GrammarState]) -> torch.Tensor:
        """`GrammarMasker.bias` of the step's constrained rows."""
        if self.masker is None:
            self.masker = GrammarMasker(
                self.vocab_size, self.max_rows, self.device, frozenset(self.compiler.tokenizer.eos_tokens)
            )
        return self.masker.bias(states)

    @staticmethod
    def advance(states: Sequence[GrammarState], added: Sequence[Sequence[int]]) -> None:
        """Each state through the tokens its sequence was given this step."""
        for state, tokens in zip(states, added, strict=True):
            for token in tokens:
                state.advance(token)
