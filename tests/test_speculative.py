"""Speculative decoding: drafts verified in the step's forward pass change nothing of the output.

The oracle is each prompt decoded alone by the model's own `generate` (tests/test_engine_equivalence.py): with
every draft source (a noisy oracle that proposes the true continuation with wrong tokens mixed in, ngram, suffix)
the engine's greedy tokens and logprobs equal it, over mixed, chunked, preempted, prefix-shared, async and TP=2
runs. Seeded and unseeded sampled requests give the same tokens with and without drafts; and on a tiny vocabulary
the verified tokens follow the target distribution (chi-square).
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from engine import EngineConfig, EngineCore, SamplingParams, generate_batch
from engine.config import EngineStartupError, SpeculativeConfig
from engine.core.request import Request, RequestStatus, StructuredOutput
from engine.core.stats import EngineStats
from engine.sampling.sampler import CHECK_EACH_REQUEST, Sampler
from engine.sampling.verify import verify
from engine.speculative.gate import LEAST_PRIOR, Acceptance, DraftCost, StepCost, drafts_worth
from engine.speculative.ngram import NgramDrafts, lookup
from engine.speculative.source import DraftingRequest
from engine.speculative.speculator import Speculator
from tests.model_factory import build_cycling_model_dir, build_model_dir
from tests.test_engine_equivalence import CONFIGS, LOGPROB_TOLERANCE, _reference

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
"""Drafts whenever the source has some: what these tests check must not hang on the measured gate."""


class NoisyOracle:
    """Proposes each request's true greedy continuation, with one token in three replaced by a wrong one: drafts
    that are accepted in part, rejected at every position, or accepted whole."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.continuations = continuations
        self.vocab = vocab
        self.rng = random.Random(7)
        self.proposed = 0

    def propose(self, request: DraftingRequest, max_drafts: int) -> list[int]:
        truth = self.continuations[tuple(request.prompt_ids)]
        done = len(request.output_ids)
        drafts = list(truth[done : done + max_drafts])
        for i in range(len(drafts)):
            if self.rng.random() < 1 / 3:
                drafts[i] = (drafts[i] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
        self.proposed += len(drafts)
        return drafts

    def finished(self, request: DraftingRequest) -> None:
        pass


def _engine(path: Path, speculative: SpeculativeConfig | None, **overrides: object) -> EngineCore:
    config = EngineConfig.of(
        model=str(path), debug_checks=True, speculative_config=speculative, **{"num_pages": 512, **overrides}
    )
    return EngineCore(config)


def _check_greedy(engine: EngineCore, path: Path, arch: str, shared_prefix: int = 0) -> None:
    prompts, max_new, expected, expected_logprobs = _reference(path, arch, shared_prefix)
    params = [SamplingParams(max_new_tokens=n, logprobs=True) for n in max_new]
    results = generate_batch(prompts, params=params, engine=engine)
    for i, want in enumerate(expected):
        got = results[f"req_{i}"]
        assert got.generated_ids == want, f"request {i} (prompt {len(prompts[i])} tokens) diverged"
        assert got.logprobs is not None
        worst = max(abs(t.logprob - e) for t, e in zip(got.logprobs, expected_logprobs[i], strict=True))
        assert worst <= LOGPROB_TOLERANCE, f"request {i}: a logprob is {worst:.2e} off"
    assert engine.is_idle_and_clean()
    engine.kv_cache.check_invariants()


def _with_oracle(engine: EngineCore, path: Path, arch: str, shared_prefix: int) -> NoisyOracle:
    prompts, _, expected, _ = _reference(path, arch, shared_prefix)
    oracle = NoisyOracle({tuple(p): e for p, e in zip(prompts, expected, strict=True)}, engine.hf_config.vocab_size)
    assert engine.speculator is not None
    engine.speculator.source = oracle
    return oracle


@pytest.mark.parametrize(
    ("setup", "async_scheduling"), [("mixed", False), ("chunked", False), ("preempt", False), ("preempt", True)]
)
def test_drafts_keep_greedy_output(model_dir: Callable[[str], Path], setup: str, async_scheduling: bool) -> None:
    path = model_dir("llama")
    engine = _engine(path, NGRAM, async_scheduling=async_scheduling, **CONFIGS[setup])
    oracle = _with_oracle(engine, path, "llama", 0)
    _check_greedy(engine, path, "llama")
    speculator = engine.speculator
    assert speculator is not None and oracle.proposed > 0
    assert 0 < speculator.num_accepted_tokens < speculator.num_draft_tokens, "drafts all accepted or all rejected"
    if setup == "preempt":
        assert engine.scheduler.num_preemptions > 0
    engine.close()


def test_drafts_with_a_shared_prefix_and_sliding_windows(model_dir: Callable[[str], Path]) -> None:
    for arch, prefix in (("llama", 40), ("qwen2_hybrid", 0)):
        path = model_dir(arch)
        engine = _engine(path, NGRAM, max_batch_tokens=64, page_size=8)
        _with_oracle(engine, path, arch, prefix)
        _check_greedy(engine, path, arch, prefix)
        if prefix:
            assert engine.stats().prefix_cache_hits >= prefix // 8 * 8
        assert engine.speculator is not None and engine.speculator.num_accepted_tokens > 0
        engine.close()


@pytest.mark.timeout(300)
def test_drafts_at_tp2(model_dir: Callable[[str], Path]) -> None:
    """Rank 0 drafts and verifies; the other rank computes the drafted positions from the plans it is sent."""
    path = model_dir("llama")
    engine = _engine(
        path,
        NGRAM,
        tensor_parallel_size=2,
        max_batch_tokens=32,
        page_size=4,
        num_pages=None,
        cpu_kv_cache_gib=48 * 1024 / 2**30,
    )
    _with_oracle(engine, path, "llama", 16)
    _check_greedy(engine, path, "llama", 16)
    assert engine.speculator is not None and engine.speculator.num_accepted_tokens > 0
    engine.close()


def _repeating_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(10, vocab) for _ in range(length)] for length in (5, 9, 14)]


@pytest.fixture(scope="module")
def cycling_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_cycling_model_dir(tmp_path_factory.mktemp("cycling"))


SETUPS = {
    "mixed": dict(max_batch_tokens=96, page_size=16),
    "chunked": dict(max_batch_tokens=16, page_size=16),
    "preempt": dict(max_batch_tokens=256, page_size=4, num_pages=40),
    "async": dict(max_batch_tokens=96, page_size=4, async_scheduling=True),
}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_every_source_keeps_output(cycling_model: Path, method: str, setup: str) -> None:
    """Each method on a model whose output repeats itself (drafts mostly accepted; draft_model's draft is the model
    itself), with a shared prefix, under mixed, chunked, preempted and async steps: the same greedy, seeded and
    unseeded sampled tokens and logprobs as without drafts."""
    spec = SpeculativeConfig(
        method=method,
        num_speculative_tokens=5,
        model=str(cycling_model) if method == "draft_model" else None,
        adaptive=False,
    )
    plain = _engine(cycling_model, None, **SETUPS[setup])
    drafting = _engine(cycling_model, spec, **SETUPS[setup])
    vocab = plain.hf_config.vocab_size
    shared = _repeating_prompts(vocab)[2][:8]
    prompts = [shared + p for p in _repeating_prompts(vocab)]
    params = [SamplingParams(max_new_tokens=40, logprobs=True, top_logprobs=2)] * len(prompts) + [
        SamplingParams(max_new_tokens=40, temperature=0.9, top_p=0.95, seed=11, repetition_penalty=1.2),
        SamplingParams(max_new_tokens=40, temperature=1.3, frequency_penalty=0.5, logprobs=True),
    ] * len(prompts)
    inputs = prompts * 3
    want = generate_batch(inputs, params=params, engine=plain)
    # The suffix source also learns from finished requests: a second round drafts from the first's outputs.
    for _ in range(2 if method == "suffix" else 1):
        got = generate_batch(inputs, params=params, engine=drafting)
        for key, expected in want.items():
            assert got[key].generated_ids == expected.generated_ids, f"{method}: {key} differs"
            if expected.logprobs is not None:
                assert got[key].logprobs is not None
                for a, b in zip(got[key].logprobs, expected.logprobs, strict=True):
                    assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= LOGPROB_TOLERANCE
                    assert [t for t, _ in a.top] == [t for t, _ in b.top]
    speculator = drafting.speculator
    assert speculator.num_accepted_tokens > 0.5 * speculator.num_draft_tokens, f"{method}: few drafts accepted"
    stats = drafting.stats()
    assert stats.spec_decode_num_accepted_tokens == speculator.num_accepted_tokens
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == speculator.num_accepted_tokens
    assert stats.prefix_cache_hits > 0
    if setup == "preempt":
        assert drafting.scheduler.num_preemptions > 0
    assert drafting.is_idle_and_clean()
    drafting.kv_cache.check_invariants()
    plain.close()
    drafting.close()


def test_opted_out_requests_draft_nothing(cycling_model: Path) -> None:
    engine = _engine(cycling_model, NGRAM)
    prompts = _repeating_prompts(engine.hf_config.vocab_size)
    speculator = engine.speculator
    generate_batch(prompts, params=SamplingParams(max_new_tokens=30, speculate=False), engine=engine)
    assert speculator.num_drafts == 0
    generate_batch(prompts, params=SamplingParams(max_new_tokens=30), engine=engine)
    assert speculator.num_drafts > 0  # the same prompts draft when they may
    engine.close()


# -- the verifier alone ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Seq:
    params: SamplingParams
    generator_seed: int
    prompt_ids: tuple[int, ...] = (1,)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


def test_verified_tokens_follow_the_target_distribution() -> None:
    """A context-free target p over 6 tokens, two drafts per sequence: the first kept token and the token after an
    accepted first draft are both distributed as p. Accepting a draft more often than p(d) (or resampling from p
    instead of the residual) shifts the counts far past the test's bound at this many samples."""
    vocab, n = 6, 12_000
    p = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])
    sampler = Sampler(vocab, torch.device("cpu"), default_seed=5)
    seqs = [_Seq(SamplingParams(temperature=1.0), generator_seed=i) for i in range(n)]
    drafts = [(1, 3)] * n
    logits = p.log().expand(n * 3, vocab).contiguous()
    tokens, _ = verify(sampler, logits, seqs, drafts, None, CHECK_EACH_REQUEST)
    first = torch.tensor([t[0] for t in tokens])
    second = torch.tensor([t[1] for t in tokens if len(t) > 1])
    for observed in (first, second):
        counts = torch.bincount(observed, minlength=vocab).double()
        expected = p.double() / p.double().sum() * len(observed)
        assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3
    # The first draft (token 1) is accepted with probability p(1) = 0.3, the second given the first p(3) = 0.25.
    accepted = [len(t) - 1 for t in tokens]
    assert abs(sum(a >= 1 for a in accepted) / n - 0.3) < 0.02
    assert abs(sum(a == 2 for a in accepted) / n - 0.3 * 0.25) < 0.015


def test_verified_tokens_are_the_undrafted_draws() -> None:
    """Seeded or not, the tokens kept are those sampling without drafts draws at each position."""
    vocab = 50
    torch.manual_seed(0)
    sampler = Sampler(vocab, torch.device("cpu"), default_seed=5)
    rows = torch.randn(4, vocab) * 3
    for params in (
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(temperature=1.0, top_k=10, repetition_penalty=1.3),
        SamplingParams(),
    ):
        seq = _Seq(params, generator_seed=9, output_ids=[4, 8])
        plain: list[int] = []
        for position in range(3):
            state = _Seq(params, 9, output_ids=[4, 8, *plain])
            plain.append(sampler(rows[position : position + 1], [state]).token_ids[0])
        for drafted in ((plain[0], plain[1], 7), (plain[0], (plain[1] + 1) % vocab), ((plain[0] + 1) % vocab,)):
            tokens, _ = verify(sampler, rows[: 1 + len(drafted)], [seq], [drafted], None, CHECK_EACH_REQUEST)
            accepted = next((i for i, d in enumerate(drafted) if d != plain[i]), len(drafted))
            assert tokens[0] == plain[: accepted + 1]


# -- the parts ---------------------------------------------------------------------------------------------------


def test_ngram_lookup() -> None:
    seq = torch.tensor([5, 6, 7, 8, 9, 1, 5, 6, 7]).numpy()
    assert lookup(seq, 2, 4, 3) == [8, 9, 1]  # "5 6 7" occurred: what followed it
    assert lookup(seq, 2, 4, 1) == [8]
    assert lookup(torch.tensor([1, 2, 3, 4]).numpy(), 1, 3, 5) == []
    # The latest earlier occurrence of the longest n-gram wins.
    assert lookup(torch.tensor([1, 2, 9, 1, 2, 8, 3, 1, 2]).numpy(), 2, 3, 2) == [8, 3]
    assert lookup(torch.tensor([4, 1, 2, 9, 3, 1, 2]).numpy(), 2, 3, 2) == [9, 3]


def _lookup_by_definition(sequence: list[int], min_n: int, max_n: int, max_drafts: int) -> list[int]:
    """`lookup`'s docstring, literally: the longest n first, then the occurrences of the last n tokens."""
    length = len(sequence)
    if max_drafts <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        starts = [s for s in range(length - n) if sequence[s : s + n] == sequence[length - n :]]
        if starts:
            whole = [s for s in starts if s + n + max_drafts <= length]
            follow = (whole[-1] if whole else starts[0]) + n
            return sequence[follow : follow + max_drafts]
    return []


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.integers(0, 3), max_size=40),
    st.integers(1, 4),
    st.integers(0, 4),
    st.integers(0, 6),
)
def test_ngram_lookup_is_its_definition(sequence: list[int], min_n: int, extra: int, max_drafts: int) -> None:
    """On small alphabets (many repeats, runs, overlapping occurrences) the vectorised search finds what the
    definition does."""
    array = np.array(sequence, dtype=np.int64)
    assert lookup(array, min_n, min_n + extra, max_drafts) == _lookup_by_definition(
        sequence, min_n, min_n + extra, max_drafts
    )


def test_ngram_source_follows_a_growing_request() -> None:
    source = NgramDrafts(2, 3)
    request = Request("r", [3, 4, 5, 6, 3, 4], SamplingParams(), frozenset())
    assert source.propose(request, 2) == [5, 6]
    request.output_ids += [5, 6, 3]
    assert source.propose(request, 3) == [4, 5, 6]
    source.finished(request)
    assert source.propose(Request("r", [1, 2], SamplingParams(), frozenset()), 3) == []


def test_the_gate_steps_aside_under_load() -> None:
    # A step costs 10 ms plus 0.1 ms a token.
    cost = StepCost()
    for n in (1, 5, 3, 1, 8, 2):
        cost.record(n, 0.010 + 0.0001 * n)
    fit = cost.fit()
    assert fit is not None
    assert fit[0] == pytest.approx(0.010, rel=1e-6) and fit[1] == pytest.approx(0.0001, rel=1e-6)
    assert drafts_worth(0.5, 1, fit, 8) == 6  # 0.5^j * 10.1 ms > 0.1 ms for j <= 6
    assert drafts_worth(0.9, 1, fit, 8) == 8
    assert drafts_worth(0.9, 256, fit, 8) == 3  # 0.9^j * 0.139 ms > 0.1 ms for j <= 3.1
    assert drafts_worth(0.5, 256, fit, 8) == 0
    # Making a draft costs too (a draft model's passes): 0.05 ms a drafted token closes the large batch, and 2 ms
    # leaves a lone stream's 0.5-accepted drafts 2 of 6 (0.5^j * 10.1 ms > 2.1 ms for j <= 2.27).
    assert drafts_worth(0.9, 256, fit, 8, draft_cost=0.00005) == 0
    assert drafts_worth(0.5, 1, fit, 8, draft_cost=0.002) == 2
    draft_cost = DraftCost()
    assert draft_cost.per_token == 0.0
    draft_cost.record(0.004, 4)
    draft_cost.record(0.002, 4)
    assert draft_cost.per_token == pytest.approx((0.004 * 0.98 + 0.002) / (4 * 0.98 + 4))
    assert drafts_worth(0.5, 1, None, 8) == 8  # nothing measured yet: draft, and so measure
    acceptance = Acceptance()
    for _ in range(100):
        acceptance.record(4, 0)
    assert acceptance.rate < 0.05
    assert drafts_worth(acceptance.rate, 1, fit, 8) <= 1
    # A new request starts where the engine's drafts stand (rejected: the least prior), not at 1/2.
    assert acceptance.prior().rate == LEAST_PRIOR and Acceptance().prior().rate == 0.5


def test_disable_by_batch_size() -> None:
    speculator = Speculator(dataclasses.replace(NGRAM, disable_by_batch_size=1))
    requests = [Request(f"r{i}", [1, 2, 1, 2, 1], SamplingParams(), frozenset()) for i in range(2)]

    for request in requests:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = request.num_tokens - 1
    assert speculator.propose(requests) == {}
    assert speculator.propose(requests[:1]) == {"r0": [2, 1]}


class _SlowSource:
    """A draft source that takes at least `seconds` to propose, as a draft model's passes do."""

    def __init__(self, seconds: float, drafts: list[int]) -> None:
        self.seconds, self.drafts = seconds, drafts

    def propose(self, request: DraftingRequest, max_drafts: int) -> list[int]:
        time.sleep(self.seconds)
        return self.drafts[:max_drafts]

    def finished(self, request: DraftingRequest) -> None:
        pass


def test_drafting_time_is_measured_apart_from_the_step() -> None:
    """What drafting costs is taken out of the step the engine records (once) and weighed a drafted token at a
    time; a step whose source found nothing adds nothing to that per-token cost."""
    source = _SlowSource(0.01, [])
    speculator = Speculator(NGRAM, source=source)
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(), frozenset()) for i in range(2)]
    for request in requests:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = request.num_tokens - 1
    assert speculator.propose(requests[:1]) == {}  # found nothing (and r0 goes quiet)
    assert speculator.take_drafting_seconds() >= 0.01 and speculator.take_drafting_seconds() == 0.0
    assert speculator.draft_cost.per_token == 0.0
    source.drafts = [7, 8]
    assert speculator.propose(requests) == {"r1": [7, 8]}
    drafting = speculator.take_drafting_seconds()
    assert drafting >= 0.01
    assert speculator.draft_cost.per_token == pytest.approx(drafting / 2)  # the miss before weighs nothing


def test_speculative_config_json() -> None:
    config = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == ("ngram", 3, 4)
    for text, message in (
        ('{"method": "eagle"}', "speculative method must be one of"),
        ('{"num_speculative_tokens": 3}', "needs a method"),
        ('{"method": "ngram", "lookahead": 3}', "unknown keys ['lookahead']"),
        ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "1 <= min <= max"),
        ("[1]", "must be a JSON object"),
        ("{", "is not JSON"),
    ):
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            SpeculativeConfig.from_json(text)


def test_drafting_counters_reach_the_metrics() -> None:
    from server.metrics import ServerMetrics
    from tests.server_harness import metric, parse_metrics

    metrics = ServerMetrics("m")
    assert metrics.snapshot()["spec_decode_acceptance_rate"] is None
    base = (1, 0, 100, 60, 0.4, 0, 0, 0, 5, 8)
    for drafts, tokens, accepted, per_position in ((2, 8, 3, (2, 1, 0, 0)), (3, 12, 6, (3, 2, 1, 0))):
        stats = EngineStats(
            *base,
            spec_decode_num_drafts=drafts,
            spec_decode_num_draft_tokens=tokens,
            spec_decode_num_accepted_tokens=accepted,
            spec_decode_num_accepted_tokens_per_pos=per_position,
        )
        metrics.observe_engine_stats(stats)
    samples = parse_metrics(metrics.render().decode())
    assert metric(samples, "ferry:spec_decode_num_drafts_total") == 3
    assert metric(samples, "ferry:spec_decode_num_draft_tokens_total") == 12
    assert metric(samples, "ferry:spec_decode_num_accepted_tokens_total") == 6
    assert metric(samples, "ferry:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 2
    assert metrics.snapshot()["spec_decode_acceptance_rate"] == 0.5


# -- a draft model -------------------------------------------------------------------------------------------


def test_a_draft_model_drafts_and_keeps_output(model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """The served model as its own draft (every draft accepted), and a smaller random one (few accepted): both
    give the reference's tokens; the draft engine's pages come back between proposals."""
    path = model_dir("llama")
    small = build_model_dir(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1, hidden_size=32)
    for draft, least_accepted in ((path, 0.9), (small, 0.0)):
        spec = SpeculativeConfig(method="draft_model", model=str(draft), num_speculative_tokens=3)
        engine = _engine(path, spec, **CONFIGS["mixed"])
        _check_greedy(engine, path, "llama")
        speculator = engine.speculator
        assert speculator.num_draft_tokens > 0
        assert speculator.num_accepted_tokens >= least_accepted * speculator.num_draft_tokens
        assert engine._draft_engine is not None and engine._draft_engine.is_idle_and_clean()
        engine.close()


def test_a_draft_model_of_another_vocabulary_is_refused(model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    path = model_dir("llama")
    other = build_model_dir(tmp_path / "other", "llama", vocab_size=300)
    spec = SpeculativeConfig(method="draft_model", model=str(other))
    with pytest.raises(EngineStartupError, match="vocabulary has 300 tokens"):
        _engine(path, spec)
    with pytest.raises(ValueError, match="goes with method draft_model"):
        SpeculativeConfig(method="ngram", model=str(other))


# -- predicted outputs ---------------------------------------------------------------------------------------


def _edited(tokens: list[int], vocab: int) -> list[int]:
    """A prediction that is the answer with edits: a token replaced a third of the way in, two tokens inserted two
    thirds of the way (the model then writes two tokens fewer than predicted there)."""
    edited = list(tokens)
    if len(edited) >= 12:
        third = len(edited) // 3
        edited[third] = (edited[third] + 1) % vocab
        edited[2 * third : 2 * third] = [(edited[2 * third] + 7) % vocab] * 2
    return edited


def test_predictions_draft_without_a_flag_and_keep_output(model_dir: Callable[[str], Path]) -> None:
    path = model_dir("llama")
    engine = _engine(path, None, **CONFIGS["mixed"])
    prompts, max_new, expected, _ = _reference(path, "llama", 0)
    vocab = engine.hf_config.vocab_size
    counts: dict[str, tuple[int, int]] = {}
    for i, (prompt, want) in enumerate(zip(prompts, expected, strict=True)):
        engine.add_request(
            f"p{i}",
            prompt,
            SamplingParams(max_new_tokens=max_new[i], logprobs=True),
            prediction=tuple(_edited(want, vocab)),
        )
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            got.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.prediction_tokens is not None:
                counts[output.request_id] = output.prediction_tokens
    for i, want in enumerate(expected):
        assert got[f"p{i}"] == want, f"request {i} diverged"
    accepted = sum(a for a, _ in counts.values())
    rejected = sum(r for _, r in counts.values())
    assert accepted > 0.4 * sum(len(e) for e in expected), (accepted, rejected)
    assert rejected > 0  # the edits
    stats = engine.stats()
    assert (stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_draft_tokens) == (
        accepted,
        accepted + rejected,
    )
    assert not engine.speculator.active  # nothing kept once they finished
    assert engine.is_idle_and_clean()
    engine.close()


def test_prediction_through_the_openai_sdk(scripted_chat_model: Path) -> None:
    """On the scripted model, whose answer re-tokenizes into the tokens it generated, so that a prediction of it
    drafts the output's own tokens. A random model's answer re-tokenizes otherwise: its first draft is rejected
    and what is accepted after depends on whether the step-cost gate, measured on a busy machine, lets another
    draft through."""
    import openai

    from tests.scripted_chat import PLAIN, PLAIN_PIECES
    from tests.server_harness import running_server

    messages = [{"role": "user", "content": PLAIN}]
    with running_server(scripted_chat_model) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        plain = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0)
        answer = plain.choices[0].message.content or ""
        assert plain.usage is not None and plain.usage.completion_tokens_details is None
        assert answer == "".join(PLAIN_PIECES)
        # The whole answer, then its first two pieces and a third the model does not write.
        for prediction, stream in ((answer, False), ("".join(PLAIN_PIECES[:2]) + " and more", True)):
            if stream:
                chunks = list(
                    client.chat.completions.create(
                        model=model,
                        messages=messages,
                        max_tokens=40,
                        temperature=0,
                        prediction={"type": "content", "content": prediction},
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                )
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                usage = chunks[-1].usage
            else:
                response = client.chat.completions.create(
                    model=model,
                    messages=messages,
                    max_tokens=40,
                    temperature=0,
                    prediction={"type": "content", "content": [{"type": "text", "text": prediction}]},
                )
                text, usage = response.choices[0].message.content, response.usage
            assert text == answer
            assert usage is not None and usage.completion_tokens_details is not None
            details = usage.completion_tokens_details
            assert details.accepted_prediction_tokens > 0
            assert usage.completion_tokens == plain.usage.completion_tokens + details.rejected_prediction_tokens
        with pytest.raises(openai.BadRequestError, match="prediction"):
            client.chat.completions.create(
                model=model, messages=messages, max_tokens=5, prediction={"type": "image", "content": "x"}
            )


# -- structured output ---------------------------------------------------------------------------------------

REPEATING_SCHEMA = {
    "type": "array",
    "items": {"enum": ["alpha beta gamma", "alpha beta delta", "omega"]},
    "minItems": 2,
}


def test_grammar_masks_the_drafts(model_dir: Callable[[str], Path]) -> None:
    """JSON whose items repeat (ngram drafts them) under budgets that make the value close mid-draft: the same
    tokens, logprobs and finish reasons as without drafts, every answer valid JSON of the schema."""
    path = model_dir("llama")
    plain = _engine(path, None)
    drafting = _engine(
        path, SpeculativeConfig(method="ngram", num_speculative_tokens=6, prompt_lookup_min=1, adaptive=False)
    )
    schema = StructuredOutput("json_schema", json.dumps(REPEATING_SCHEMA))
    regex = StructuredOutput("regex", "(ab|abc|b){3,30}")
    rng = random.Random(2)
    prompts = [[rng.randrange(10, 300) for _ in range(n)] for n in (4, 9, 15, 6, 11, 8)]
    params = [
        SamplingParams(max_new_tokens=n, structured_output=schema, logprobs=True, top_logprobs=2) for n in (24, 37, 60)
    ] + [
        SamplingParams(max_new_tokens=33, structured_output=schema, temperature=0.8, seed=4, logprobs=True),
        SamplingParams(max_new_tokens=40, structured_output=regex, logprobs=True),
        SamplingParams(max_new_tokens=29, structured_output=schema, temperature=1.0, close_within_budget=False),
    ]
    want = generate_batch(prompts, params=params, engine=plain)
    got = generate_batch(prompts, params=params, engine=drafting)
    for key, expected in want.items():
        assert got[key].generated_ids == expected.generated_ids, f"{key} differs"
        assert got[key].finish_reason == expected.finish_reason
        if expected.logprobs is not None:
            for a, b in zip(got[key].logprobs or [], expected.logprobs, strict=True):
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= LOGPROB_TOLERANCE
    speculator = drafting.speculator
    assert speculator.num_accepted_tokens > 0 and speculator.num_accepted_tokens < speculator.num_draft_tokens
    assert any(o.finish_reason is not None and o.finish_reason.value == "length" for o in want.values())
    assert drafting.is_idle_and_clean()
    plain.close()
    drafting.close()


@pytest.mark.timeout(300)
def test_a_draft_model_at_tp2(cycling_model: Path) -> None:
    """The served model sharded over two ranks, its draft engine beside rank 0: the same tokens as one rank
    without drafts."""
    prompts = _repeating_prompts(300)
    params = [SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=30, temperature=0.8, seed=2)]
    plain = _engine(cycling_model, None)
    want = generate_batch(prompts * 2, params=params * 3, engine=plain)
    plain.close()
    spec = SpeculativeConfig(method="draft_model", model=str(cycling_model), num_speculative_tokens=4, adaptive=False)
    sharded = _engine(cycling_model, spec, tensor_parallel_size=2, num_pages=None, cpu_kv_cache_gib=0.01)
    got = generate_batch(prompts * 2, params=params * 3, engine=sharded)
    assert {k: v.generated_ids for k, v in got.items()} == {k: v.generated_ids for k, v in want.items()}
    assert sharded.speculator.num_accepted_tokens > 0.5 * sharded.speculator.num_draft_tokens
    sharded.close()
