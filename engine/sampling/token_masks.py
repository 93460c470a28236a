"""Grammar-constrained rows of a step: each constrained sequence's grammar state, and the one bias tensor per step
that bans every token those grammars forbid.

The runner keeps a `GrammarState` per constrained sequence, built by `StepGrammars.state_of` when the sequence
arrives (on resume after a preemption it replays the tokens generated so far), and advances it with each token
sampled (`StepGrammars.advance`); prefill chunks never touch it.

A JSON constraint also closes within its token budget (`BudgetClosing`): when the token sampled would leave too
few tokens to close the value along its shortest valid completion (engine/sampling/json_closing.py), that
completion is forced instead, one token a step (its row's mask allows that token alone), and the request ends
with `length` however it ends, so a client can tell the model did not close the value itself. `GrammarMasker.bias`
fills one bitmask for all the step's constrained rows with llguidance's batched fill on the CPU, then expands it on
the device into an additive bias, 0 where a token is allowed and -inf where it is not, which the sampler adds to
the logits in one operation.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence

import llguidance
import numpy as np
import torch

from engine.core.step import NewRequest
from engine.core.structured import CompiledGrammar, GrammarCompiler
from engine.sampling.json_closing import AnswerProgress

logger = logging.getLogger(__name__)

_NEG_INF_BITS = -8388608
"""0xFF800000 as int32: the bits of float32 -inf (and 0 is the bits of 0.0)."""


class GrammarState:
    """Where one sequence stands in its grammar.

    `end_token_ids` are the request's EOS and stop tokens: the ones it may end with once the grammar is complete.
    `max_output` is how many tokens it may generate in all (`max_new_tokens`, or less where the model length ends
    it first): a JSON constraint closes within it.
    """

    def __init__(
        self,
        compiled: CompiledGrammar,
        end_token_ids: frozenset[int],
        generated: Sequence[int],
        max_output: int,
        close_within_budget: bool = True,
    ) -> None:
        self.matcher = compiled.matcher()
        self.error: str | None = None
        """Set when the grammar library refused a token its own mask allowed: the request ends with this error."""
        self.end_token_ids = end_token_ids
        self.closing = BudgetClosing(compiled, max_output) if close_within_budget and compiled.closable else None
        for token in generated:
            self.advance(token)

    def choose(self, sampled: int) -> int:
        """The token this step keeps: `sampled`, unless the budget needs the value closed from here."""
        if self.closing is None or sampled in self.end_token_ids or not self.end_token_ids:
            return sampled
        return self.closing.choose(sampled, self.matcher, min(self.end_token_ids))

    def advance(self, token: int) -> None:
        # An end token finishes the request: the grammar has nothing left to follow.
        if token in self.end_token_ids:
            return
        if not self.matcher.consume_token(token) and self.error is None:
            # The mask allowed it, so this is the library disagreeing with itself (llguidance does where a literal
            # of the grammar spells a special token); the output could no longer be held to the grammar, so the
            # request ends with this error rather than with an answer cut short that looks whole.
            reason = self.matcher.get_error()
            self.error = (
                f"The grammar could not be followed: its library refused token {token}, which its own mask allowed "
                f"({reason.splitlines()[0] if reason else 'no reason given'})."
            )
            logger.error("grammar refused the token %d it allowed: %s", token, reason)
        if self.closing is not None:
            self.closing.advance(token)


class BudgetClosing:
    """Keeps a JSON value closable within the tokens a request has left.

    After each token it knows the value's shortest valid completion (`AnswerProgress`); `choose` looks one token
    ahead: a sampled token after which that completion would need more tokens than are left is replaced by the
    first token of the completion from before it, and the rest of that completion is forced after it. The
    completion is checked against the matcher before anything is forced: what this cannot close exactly, it
    leaves alone (the answer may then end unclosed, as without it).
    """

    def __init__(self, compiled: CompiledGrammar, max_output: int) -> None:
        self.tokenizer = compiled.tokenizer
        self.progress = AnswerProgress.of(compiled.answer_schema, compiled.tagged_calls)
        self.pending = b""
        """Bytes of a character split across tokens, decoded once its last byte arrives."""
        self.max_output = max_output
        self.num_generated = 0
        self.forced: deque[int] = deque()
        """The rest of the completion being forced: the next token is its first."""
        self.forced_any = False
        """The budget chose a token: the answer ends with `length` whatever the model does after."""
        self._looked: tuple[int, AnswerProgress, bytes] | None = None
        """`choose`'s look past the sampled token, which `advance` takes when that token is kept."""

    def choose(self, sampled: int, matcher: llguidance.LLMatcher, end_token: int) -> int:
        """`sampled`, or the first token of the closing from here (`end_token` when the value is complete
        already and `sampled` would reopen it)."""
        if self.forced:
            return self.forced[0]
        left = self.max_output - self.num_generated - 1  # tokens after this one
        progress, pending = self._after(self.progress, self.pending, sampled)
        self._looked = (sampled, progress, pending)
        if self._fits(progress, pending, left):
            return sampled
        closing = self._closing(self.progress, self.pending)
        if closing is None:
            return sampled
        tokens = self.tokenizer.tokenize_bytes(closing) if closing else [end_token]
        if len(tokens) > left + 1 or (closing and not _closes(matcher, tokens)):
            return sampled
        self.forced.extend(tokens)
        self.forced_any = True
        return tokens[0]

    def advance(self, token: int) -> None:
        self.num_generated += 1
        if self.forced and self.forced[0] == token:
            self.forced.popleft()
        looked, self._looked = self._looked, None
        if looked is not None and looked[0] == token:
            self.progress, self.pending = looked[1], looked[2]
        else:
            self.progress, self.pending = self._after(self.progress, self.pending, token)

    def _after(self, progress: AnswerProgress, pending: bytes, token: int) -> tuple[AnswerProgress, bytes]:
        data = pending + self.tokenizer.decode_bytes([token])
        text, rest = _decodable(data)
        return progress.feed(text), rest

    def _fits(self, progress: AnswerProgress, pending: bytes, left: int) -> bool:
        closing = self._closing(progress, pending)
        if closing is None:  # nothing known to keep: leave the sampled token be
            return True
        # A token holds at least one byte: most steps need no tokenizing.
        return len(closing) <= left or len(self.tokenizer.tokenize_bytes(closing)) <= left

    @staticmethod
    def _closing(progress: AnswerProgress, pending: bytes) -> bytes | None:
        """The bytes that close the value from here, a split character's missing bytes first."""
        finish = b""
        if pending:
            finish = _character_end(pending)
            if finish is None:
                return None
            progress = progress.feed((pending + finish).decode())
        text = progress.shortest_completion()
        return None if text is None else finish + text.encode()


def _decodable(data: bytes) -> tuple[str, bytes]:
    """`data` decoded as far as whole characters go, and the bytes of the character it ends inside."""
    for cut in range(len(data), max(-1, len(data) - 4), -1):
        try:
            return data[:cut].decode(), data[cut:]
        except UnicodeDecodeError:
            continue
    return data.decode(errors="replace"), b""


def _character_end(start: bytes) -> bytes | None:
    """Continuation bytes that make `start` (a character's first bytes) a valid UTF-8 character."""
    for second in (0x80, 0x90, 0xA0):
        for length in range(1, 4):
            tail = bytes([second] + [0x80] * (length - 1))
            try:
                (start + tail).decode()
            except UnicodeDecodeError:
                continue
            return tail
    return None


def _closes(matcher: llguidance.LLMatcher, tokens: list[int]) -> bool:
    """Whether the grammar takes `tokens` from where `matcher` stands and is complete after them."""
    trial = matcher.deep_copy()
    return all(trial.consume_token(token) for token in tokens) and trial.is_accepting()


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

    def bias(self, states: Sequence[GrammarState], drafts: Sequence[Sequence[int]] = ()) -> torch.Tensor:
        """`[len(states) + D, vocab_size]` float32 on the device: 0 where each row's grammar allows the token, else
        -inf. With `drafts` (per state, the tokens drafted after it; D in all), the D rows after the states' are
        each draft's position: the grammar after the drafts before it and the draft itself. A draft the grammar
        refuses makes the rows after it copies of its own (their tokens are never kept: verification stops at a
        refused draft, which no allowed token equals)."""
        rows = len(states)
        needed = rows + sum(map(len, drafts))
        if needed > len(self._packed):
            # Draft rows come on top of one a sequence: grown to what a step needs, pinned again on CUDA.
            grown = torch.zeros((needed, self._words), dtype=torch.int32, pin_memory=self._packed.is_pinned())
            self._packed, self._bits = grown, grown.numpy().view(np.uint32)
        self._executor.unsafe_compute_mask_ptr(
            [(state.matcher, row) for row, state in enumerate(states)],
            self._packed.data_ptr(),
            self._words * 4,
            rows,
        )
        for row, state in enumerate(states):
            if state.closing is not None and state.closing.forced:
                self._only(row, state.closing.forced[0])
            elif state.end_token_ids != self._library_ends:
                self._use_own_end_tokens(row, state.end_token_ids)
        for state, drafted in zip(states, drafts, strict=False):
            rows = self._draft_rows(state, drafted, rows)
        self.num_masked_rows += rows
        packed = self._packed[:rows].to(self.device, non_blocking=True)
        # Bit b of word w is token 32w + b: expand to one int32 per token (1 allowed, 0 not), then 1 -> 0.0 and
        # 0 -> -inf by bits alone (x - 1 is 0 or all ones, masked to -inf's pattern).
        bias = (packed.unsqueeze(-1) >> self._shifts).bitwise_and_(1).sub_(1).bitwise_and_(_NEG_INF_BITS)
        return bias.view(torch.float32).view(rows, -1)[:, : self.vocab_size]

    def _draft_rows(self, state: GrammarState, drafted: Sequence[int], row: int) -> int:
        """Fill the rows of `drafted`'s positions from `row` on (the matcher walks the drafts and comes back);
        returns the row after them."""
        matcher, consumed, refused = state.matcher, 0, False
        for token in drafted:
            # Tried, not consumed outright: a refused token would leave the matcher in error.
            refused = refused or token in state.end_token_ids or matcher.try_consume_tokens([token]) != 1
            if refused:
                self._bits[row] = self._bits[row - 1]  # after a refused draft or an end: never kept
            else:
                consumed += 1
                self._executor.unsafe_compute_mask_ptr(
                    [(matcher, row)], self._packed.data_ptr(), self._words * 4, len(self._packed)
                )
                if state.end_token_ids != self._library_ends:
                    self._use_own_end_tokens(row, state.end_token_ids)
            row += 1
        if consumed:
            matcher.rollback(consumed)
        return row

    def _only(self, row: int, token: int) -> None:
        """Allow `token` alone in the row: the budget is closing the value."""
        self._bits[row] = 0
        self._bits[row, token >> 5] = np.uint32(1) << np.uint32(token & 31)

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
        params = new.params
        return GrammarState(
            compiled,
            new.eos_token_ids | frozenset(params.stop_token_ids),
            new.output_ids,
            params.max_new_tokens if new.max_output_tokens is None else new.max_output_tokens,
            params.close_within_budget,
        )

    def bias(self, states: Sequence[GrammarState], drafts: Sequence[Sequence[int]] = ()) -> torch.Tensor:
        """`GrammarMasker.bias` of the step's constrained rows (and of their drafts' positions)."""
        if self.masker is None:
            self.masker = GrammarMasker(
                self.vocab_size, self.max_rows, self.device, frozenset(self.compiler.tokenizer.eos_tokens)
            )
        return self.masker.bias(states, drafts)

    @staticmethod
    def choose(states: Sequence[GrammarState], sampled: Sequence[list[int]]) -> list[int]:
        """Each state's pick for the token sampled for it (`GrammarState.choose`), in place; the indexes of the
        states whose token was replaced."""
        replaced = []
        for index, (state, tokens) in enumerate(zip(states, sampled, strict=True)):
            token = state.choose(tokens[0])
            if token != tokens[0]:
                tokens[0] = token
                replaced.append(index)
        return replaced

    @staticmethod
    def advance(states: Sequence[GrammarState], added: Sequence[Sequence[int]]) -> None:
        """Each state through the tokens its sequence was given this step."""
        for state, tokens in zip(states, added, strict=True):
            for token in tokens:
                state.advance(token)
