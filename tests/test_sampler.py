"""Sampler: greedy, truncation filters, penalties, bans, per-request seeds and logprobs, one batch at a time.

Every random draw here is seeded, so the statistical checks give the same answer on every run.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import RepetitionPenaltyLogitsProcessor

from engine.core.request import Request, RequestRejected, SamplingParams
from engine.core.step import NewRequest, SchedulerOutput
from engine.execution.input_batch import InputBatch
from engine.sampling.sampler import BatchNeeds, Sampler, argmax_rows

EOS = 2

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def make_request(
    params: SamplingParams | None = None,
    *,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    generator_seed: int = 0,
) -> Request:
    return Request(
        "r",
        [5, 6, 7] if prompt is None else prompt,
        params or SamplingParams(),
        frozenset({EOS}),
        output_ids=list(output or []),
        generator_seed=generator_seed,
    )


def random_logits(rows: int, vocab: int, seed: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=generator) * 3).to(device)


def draw_counts(
    sampler: Sampler, row: torch.Tensor, params: SamplingParams, draws: int, output: list[int] | None = None
) -> torch.Tensor:
    """How often each token comes out over `draws` requests that differ only in their generator seed."""
    requests = [make_request(params, output=output, generator_seed=i) for i in range(draws)]
    tokens = sampler(row.expand(draws, -1), requests).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=sampler.vocab_size).double()


def support(sampler: Sampler, row: torch.Tensor, params: SamplingParams, draws: int = 2000) -> set[int]:
    return set(torch.nonzero(draw_counts(sampler, row, params, draws)).flatten().tolist())


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    present = expected > 0
    assert counts[~present].sum() == 0, "a token outside the support was drawn"
    return float(((counts[present] - expected[present]) ** 2 / expected[present]).sum())


def probs_logits(probs: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(probs, device=device).log()[None, :]


def test_empty_batch(device: torch.device) -> None:
    result = Sampler(8, device, 0)(torch.empty(0, 8, device=device), [])
    assert result.token_ids == [] and result.logprobs == []


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.0, top_k=50, top_p=0.5),
        SamplingParams(temperature=1.3, top_k=1),
        SamplingParams(temperature=1.3, top_p=0.0),
    ],
    ids=["temperature0", "temperature0_filters", "top_k1", "top_p0"],
)
def test_greedy_is_argmax(device: torch.device, params: SamplingParams) -> None:
    logits = random_logits(6, 100, seed=1, device=device)
    result = Sampler(100, device, 0)(logits, [make_request(params, generator_seed=i) for i in range(6)])
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.logprobs == [None] * 6


@pytest.mark.parametrize("block", [None, 32, 256, 1024])
@pytest.mark.parametrize(
    ("rows", "width"), [(17, 100), (17, 4096), (17, 4097), (1100, 1000), (17, 32001), (1, 151_936)]
)
def test_blockwise_argmax_is_torch_argmax_first_maximum_included(rows: int, width: int, block: int | None) -> None:
    generator = torch.Generator().manual_seed(width)
    # Few distinct values: every row has many tied maxima, across blocks and in the short last block.
    tied = torch.randint(-3, 3, (rows, width), generator=generator).float()
    assert torch.equal(argmax_rows(tied, block), tied.argmax(dim=-1))
    last = torch.randn(5, width, generator=generator)
    last[:, -1] = 100.0
    assert torch.equal(argmax_rows(last, block), torch.full((5,), width - 1))
    strided = torch.randn(4, width + 7, generator=generator)[:, :width]
    assert torch.equal(argmax_rows(strided, block), strided.argmax(dim=-1))


@pytest.mark.parametrize("width", [1, 7, 31, 32, 33, 63, 64, 65, 100, 4097])
def test_argmax_is_torch_argmax_with_infinities_nans_and_signed_zeros(width: int) -> None:
    """Every width around the kernel's 32-logit stride (engine/kernels/cpu_argmax.cpp), on float32 CPU logits:
    ties, infinities, a row of -inf, NaNs (torch counts the first as the maximum), -0.0 against 0.0, strided rows."""
    generator = torch.Generator().manual_seed(width)
    rows = torch.randint(-2, 2, (12, width), generator=generator).float()
    rows[1] = float("-inf")
    rows[2, -1] = float("inf")
    rows[3, ::3] = float("inf")
    rows[4, width // 2] = float("nan")
    rows[5, -1] = float("nan")
    rows[5, width // 3] = float("nan")
    rows[6] = 0.0
    rows[6, -1] = -0.0
    rows[7] = -0.0
    rows[8, width // 2 :] = float("-inf")
    for x in (rows, torch.cat([rows, torch.zeros(12, 5)], dim=1)[:, :width]):
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(rows[:0]).shape == (0,)


class _NoNoiseSampler(Sampler):
    def _gumbel_noise(self, *_: object) -> torch.Tensor:
        raise AssertionError("an all-greedy batch must not draw noise")


def test_all_greedy_batch_draws_no_noise(device: torch.device) -> None:
    sampler = _NoNoiseSampler(50, device, 0)
    logits = random_logits(4, 50, seed=2, device=device)
    requests = [make_request(SamplingParams(top_k=1, temperature=0.7)), make_request()]
    assert sampler.apply_penalties(logits, requests) is logits
    assert sampler(logits[:2], requests).token_ids == logits[:2].argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=1.0), [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]),
        (SamplingParams(temperature=0.5), None),
        (SamplingParams(temperature=2.0), None),
        (SamplingParams(temperature=1.0, top_k=3), [0.4 / 0.8, 0.25 / 0.8, 0.15 / 0.8, 0, 0, 0]),
        (SamplingParams(temperature=1.0, top_p=0.6), [0.4 / 0.65, 0.25 / 0.65, 0, 0, 0, 0]),
        (SamplingParams(temperature=1.0, min_p=0.3), [0.4 / 0.8, 0.25 / 0.8, 0.15 / 0.8, 0, 0, 0]),
    ],
    ids=["t1", "t0.5", "t2", "top_k3", "top_p0.6", "min_p0.3"],
)
def test_draws_follow_the_processed_distribution(
    device: torch.device, params: SamplingParams, expected: list[float] | None
) -> None:
    base = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
    logits = probs_logits(base, device)
    probs = (
        torch.tensor(expected)
        if expected is not None
        else torch.softmax(torch.tensor(base).log() / params.temperature, dim=-1)
    )
    counts = draw_counts(Sampler(6, device, 0), logits, params, draws=6000)
    # At most 5 degrees of freedom: the 99.99th percentile is 25.7. The draws are seeded: this cannot flake.
    assert chi_square(counts, probs) < 25.7


def test_top_k_restricts_support(device: torch.device) -> None:
    logits = random_logits(1, 64, seed=3, device=device)
    top5 = set(logits[0].topk(5).indices.tolist())
    assert support(Sampler(64, device, 0), logits, SamplingParams(temperature=3.0, top_k=5)) == top5


@pytest.mark.parametrize(
    ("top_p", "nucleus"),
    [(0.45, {0}), (0.7, {0, 1}), (0.85, {0, 1, 2}), (0.97, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_keeps_the_nucleus(device: torch.device, top_p: float, nucleus: set[int]) -> None:
    logits = probs_logits([0.5, 0.3, 0.15, 0.05], device)
    assert support(Sampler(4, device, 0), logits, SamplingParams(temperature=1.0, top_p=top_p)) == nucleus


def test_top_k_and_top_p_combine(device: torch.device) -> None:
    logits = probs_logits([0.5, 0.3, 0.15, 0.05], device)
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.9)
    assert support(Sampler(4, device, 0), logits, params) == {0, 1}


@pytest.mark.parametrize(("min_p", "kept"), [(0.2, {0, 1, 2}), (0.5, {0, 1}), (1.0, {0})])
def test_min_p_restricts_support(device: torch.device, min_p: float, kept: set[int]) -> None:
    # Thresholds are min_p * 0.5 = 0.1, 0.25 and 0.5.
    logits = probs_logits([0.5, 0.3, 0.15, 0.05], device)
    assert support(Sampler(4, device, 0), logits, SamplingParams(temperature=1.0, min_p=min_p)) == kept


def test_repetition_penalty_matches_hugging_face(device: torch.device) -> None:
    vocab = 40
    logits = random_logits(3, vocab, seed=4, device=device)
    requests = [
        make_request(SamplingParams(repetition_penalty=1.7), prompt=[1, 3, 3, 9], output=[9, 12, 1]),
        make_request(SamplingParams(), prompt=[1, 3], output=[4]),
        make_request(SamplingParams(temperature=1.0, repetition_penalty=0.6), prompt=[0, 39, 20], output=[]),
    ]
    penalised = Sampler(vocab, device, 0).apply_penalties(logits, requests).cpu()
    for row, request in enumerate(requests):
        processor = RepetitionPenaltyLogitsProcessor(request.params.repetition_penalty)
        expected = processor(torch.tensor([request.all_token_ids]), logits[row : row + 1].cpu())
        torch.testing.assert_close(penalised[row : row + 1], expected, rtol=0, atol=0)


def test_presence_and_frequency_penalties_follow_openai(device: torch.device) -> None:
    vocab = 30
    logits = random_logits(3, vocab, seed=5, device=device)
    requests = [
        make_request(SamplingParams(presence_penalty=0.8, frequency_penalty=0.3), prompt=[4, 4], output=[4, 7, 7, 7]),
        make_request(SamplingParams(frequency_penalty=-1.5), prompt=[1], output=[2, 2, 11]),
        # Repetition (prompt + output) then presence (output only): prompt token 6 gets only the former.
        make_request(SamplingParams(repetition_penalty=2.0, presence_penalty=1.0), prompt=[6], output=[8]),
    ]
    penalised = Sampler(vocab, device, 0).apply_penalties(logits, requests).cpu()
    expected = logits.cpu().clone()
    for row, request in enumerate(requests):
        params = request.params
        for token in set(request.all_token_ids) if params.repetition_penalty != 1 else ():
            value = expected[row, token]
            expected[row, token] = value / 2.0 if value > 0 else value * 2.0
        for token in set(request.output_ids):
            count = request.output_ids.count(token)
            expected[row, token] -= params.frequency_penalty * count + params.presence_penalty
    torch.testing.assert_close(penalised, expected)


def test_penalties_steer_greedy_requests(device: torch.device) -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]], device=device)
    sampler = Sampler(4, device, 0)

    def greedy(params: SamplingParams, output: list[int]) -> int:
        return sampler(logits, [make_request(params, prompt=[0], output=output)]).token_ids[0]

    assert greedy(SamplingParams(), [1]) == 1
    assert greedy(SamplingParams(repetition_penalty=1.5), [1]) == 2
    assert greedy(SamplingParams(frequency_penalty=0.6), [1, 1]) == 2
    assert greedy(SamplingParams(presence_penalty=0.6), [1, 1]) == 1


def test_min_new_tokens_bans_eos_and_stop_ids(device: torch.device) -> None:
    vocab = 10
    logits = torch.zeros(1, vocab, device=device)
    logits[0, EOS], logits[0, 7], logits[0, 4] = 9.0, 8.0, 7.0
    sampler = Sampler(vocab, device, 0)
    # 999 lies past the vocabulary: nothing to ban, and it must not break the ban of the others.
    params = SamplingParams(min_new_tokens=2, stop_token_ids=(7, 999))

    def greedy(params: SamplingParams, generated: int) -> int:
        return sampler(logits, [make_request(params, output=[3] * generated)]).token_ids[0]

    assert [greedy(params, n) for n in range(4)] == [4, 4, EOS, EOS]
    # ignore_eos: EOS is not banned by min_new_tokens (stopping is the core's business); stop ids still are.
    assert greedy(SamplingParams(min_new_tokens=2, stop_token_ids=(7,), ignore_eos=True), 0) == EOS
    assert greedy(SamplingParams(min_new_tokens=2, stop_token_ids=(EOS,), ignore_eos=True), 0) == 7

    sampled = SamplingParams(temperature=1.0, min_new_tokens=5, stop_token_ids=(7,))
    counts = draw_counts(sampler, logits, sampled, draws=500, output=[3, 3])
    assert counts[EOS] == 0 and counts[7] == 0 and counts.sum() == 500


def seed7_tokens(sampler: Sampler, logits: torch.Tensor, position: int, neighbours: list[Request]) -> list[int]:
    """Tokens of one seed-7 request over 12 steps, placed at `position` among `neighbours`."""
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    request = make_request(params, generator_seed=123)
    for _ in range(12):
        batch = [*neighbours[:position], request, *neighbours[position:]]
        token = sampler(logits[: len(batch)], batch).token_ids[position]
        request.output_ids.append(token)
    return request.output_ids


def test_seed_gives_the_same_tokens_whatever_the_batch(device: torch.device) -> None:
    vocab = 500
    sampler = Sampler(vocab, device, 0)
    # Every row holds the same logits, so only the batch around the seeded request changes.
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(6)).to(device).expand(8, -1)
    neighbours = [
        make_request(SamplingParams(), generator_seed=1),
        make_request(SamplingParams(temperature=0.9), generator_seed=2),
        make_request(SamplingParams(temperature=1.0, seed=8), output=[4]),
        make_request(SamplingParams(temperature=1.2, top_k=5, repetition_penalty=1.3, presence_penalty=0.5)),
        make_request(SamplingParams(temperature=0.8, min_p=0.1, logprobs=True, top_logprobs=3)),
        make_request(SamplingParams(top_k=1, temperature=1.0, frequency_penalty=1.0), output=[9, 9]),
        make_request(SamplingParams(temperature=1.0, seed=7), output=[1, 2, 3]),
    ]
    alone = seed7_tokens(sampler, logits, 0, [])
    assert len(set(alone)) > 1, "a seeded stream must move on from step to step"
    assert seed7_tokens(sampler, logits, 0, neighbours) == alone
    assert seed7_tokens(sampler, logits, 3, neighbours) == alone
    assert seed7_tokens(sampler, logits, 7, neighbours) == alone
    assert seed7_tokens(sampler, logits, 2, list(reversed(neighbours[:4]))) == alone
    # The engine seed only matters to requests without a seed of their own.
    assert seed7_tokens(Sampler(vocab, device, 99), logits, 1, neighbours[2:]) == alone


def test_unseeded_requests_follow_generator_and_engine_seed(device: torch.device) -> None:
    vocab = 500
    logits = random_logits(1, vocab, seed=7, device=device).expand(64, -1)
    params = SamplingParams(temperature=1.0)
    requests = [make_request(params, generator_seed=i) for i in range(64)]
    first = Sampler(vocab, device, 0)(logits, requests).token_ids
    shuffled = list(reversed(requests))
    assert list(reversed(Sampler(vocab, device, 0)(logits, shuffled).token_ids)) == first
    assert Sampler(vocab, device, 1)(logits, requests).token_ids != first
    assert len(set(first)) > 10, "different generator seeds must give independent draws"


def test_logprobs_come_from_the_raw_logits(device: torch.device) -> None:
    vocab = 200
    logits = random_logits(4, vocab, seed=8, device=device)
    requests = [
        make_request(SamplingParams(logprobs=True, top_logprobs=5, repetition_penalty=1.5), output=[3]),
        make_request(SamplingParams(temperature=0.7, top_k=20)),
        make_request(SamplingParams(temperature=1.1, top_p=0.9, logprobs=True, top_logprobs=20)),
        make_request(SamplingParams(temperature=0.9, logprobs=True)),
    ]
    result = Sampler(vocab, device, 0)(logits, requests)
    reference = torch.log_softmax(logits.cpu().double(), dim=-1)
    assert result.logprobs[1] is None
    for row in (0, 2, 3):
        entry = result.logprobs[row]
        assert entry is not None
        assert entry.token_id == result.token_ids[row]
        assert entry.logprob == pytest.approx(float(reference[row, entry.token_id]), abs=1e-5)
        assert len(entry.top) == requests[row].params.top_logprobs
        values = [value for _, value in entry.top]
        assert values == sorted(values, reverse=True)
        if entry.top:
            expected = reference[row].topk(len(entry.top))
            assert [token for token, _ in entry.top] == expected.indices.tolist()
            assert values == pytest.approx(expected.values.tolist(), abs=1e-5)
    assert result.logprobs[0] is not None and result.logprobs[0].top[0][0] == int(logits[0].argmax())


def test_top_logprobs_past_a_tiny_vocabulary(device: torch.device) -> None:
    logits = probs_logits([0.1, 0.6, 0.3], device)
    entry = Sampler(3, device, 0)(logits, [make_request(SamplingParams(logprobs=True, top_logprobs=20))]).logprobs[0]
    assert entry is not None and [token for token, _ in entry.top] == [1, 2, 0]


def test_mixed_batch_gives_greedy_rows_their_argmax(device: torch.device) -> None:
    vocab = 300
    logits = random_logits(8, vocab, seed=9, device=device)
    requests = [
        make_request(SamplingParams(), generator_seed=0),
        make_request(SamplingParams(temperature=1.5, top_k=3), generator_seed=1),
        make_request(SamplingParams(temperature=0.8, repetition_penalty=1.4, frequency_penalty=0.5), output=[1]),
        make_request(SamplingParams(top_p=0.0, temperature=1.0, logprobs=True, top_logprobs=2)),
        make_request(SamplingParams(temperature=1.0, min_p=0.2, seed=3)),
        make_request(SamplingParams(temperature=1.0, top_k=1, presence_penalty=0.1)),
        make_request(SamplingParams(temperature=1.2, top_p=0.5, min_new_tokens=3), output=[4]),
        make_request(SamplingParams(temperature=0.0, seed=11)),
    ]
    tokens = Sampler(vocab, device, 0)(logits, requests).token_ids
    argmax = logits.argmax(dim=-1).tolist()
    for row in (0, 3, 5, 7):
        assert tokens[row] == argmax[row]
    assert tokens[1] in logits[1].topk(3).indices.tolist()


def test_padding_columns_past_the_vocabulary_are_never_picked(device: torch.device) -> None:
    vocab = 20
    logits = torch.cat([random_logits(2, vocab, seed=10, device=device), torch.full((2, 4), 50.0, device=device)], 1)
    requests = [make_request(), make_request(SamplingParams(temperature=1.0, logprobs=True, top_logprobs=3))]
    result = Sampler(vocab, device, 0)(logits, requests)
    assert result.token_ids[0] == int(logits[0, :vocab].argmax())
    assert all(token < vocab for token in result.token_ids)
    assert result.logprobs[1] is not None
    assert math.fsum(math.exp(value) for _, value in result.logprobs[1].top) < 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_device_to_host_sync_per_call() -> None:
    device = torch.device("cuda")
    vocab = 1000
    sampler = Sampler(vocab, device, 0)
    logits = random_logits(6, vocab, seed=11, device=device)
    requests = [
        make_request(SamplingParams(repetition_penalty=1.2, logprobs=True, top_logprobs=4), output=[3, 3]),
        make_request(
            SamplingParams(temperature=0.9, top_k=10, presence_penalty=0.4, frequency_penalty=0.2), output=[1]
        ),
        make_request(SamplingParams(temperature=1.0, top_p=0.8, seed=5)),
        make_request(SamplingParams(temperature=1.0, min_p=0.1, min_new_tokens=4)),
        make_request(SamplingParams(temperature=0.7)),
        make_request(SamplingParams(logprobs=True)),
    ]
    sampler(logits, requests)  # warm-up: first-use allocations are not what this test measures
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sampler(logits, requests)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [f"{w.filename}:{w.lineno}" for w in syncs]  # the lines whose op synchronized


def test_logit_bias_is_added_per_request(device: torch.device) -> None:
    sampler = Sampler(50, device, 0)
    logits = random_logits(3, 50, seed=7, device=device)
    plain = logits.argmax(dim=-1).tolist()
    forced = 1 if plain[0] != 1 else 2
    requests = [
        make_request(SamplingParams(logit_bias=((forced, 100.0),))),
        make_request(SamplingParams(logit_bias=((plain[1], -100.0),))),
        make_request(),
    ]
    work = sampler.apply_penalties(logits, requests)
    assert work is not logits and torch.equal(logits, random_logits(3, 50, seed=7, device=device)), "input untouched"
    torch.testing.assert_close(work[0, forced], logits[0, forced] + 100)
    assert torch.equal(work[2], logits[2])
    tokens = sampler(logits, requests).token_ids
    assert tokens[0] == forced and tokens[1] != plain[1] and tokens[2] == plain[2]


def test_logit_bias_values_are_bounded() -> None:
    with pytest.raises(RequestRejected):
        SamplingParams(logit_bias=((3, 101.0),))


_NEEDS_PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.8),
    SamplingParams(logprobs=True, top_logprobs=2),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(min_new_tokens=2),
    SamplingParams(logit_bias=((3, 5.0),)),
]


def _needs_of(params: list[SamplingParams]) -> BatchNeeds:
    return BatchNeeds(
        penalties=any(p.penalised for p in params),
        random=any(not p.greedy for p in params),
        logprobs=any(p.logprobs for p in params),
    )


@given(st.lists(st.tuples(st.booleans(), st.integers(0, len(_NEEDS_PARAMS) - 1)), max_size=30))
def test_the_input_batch_knows_what_its_sequences_ask_of_the_sampler(changes: list[tuple[bool, int]]) -> None:
    """Adding and dropping sequences in any order: the batch's needs are those of the sequences it holds."""
    batch = InputBatch(1, max_seqs=32, max_tokens=64, max_pages=2, page_size=16, device=torch.device("cpu"))
    held: dict[str, SamplingParams] = {}
    for number, (add, kind) in enumerate(changes):
        if add or not held:
            request_id, params = f"r{number}", _NEEDS_PARAMS[kind]
            new = NewRequest(request_id, (1, 2), (), params, frozenset({EOS}), 0, ((),))
            batch.apply(SchedulerOutput(new_requests=(new,)), lambda _: None)
            held[request_id] = params
        else:
            request_id = sorted(held)[kind % len(held)]
            batch.apply(SchedulerOutput(finished_ids=(request_id,)), lambda _: None)
            del held[request_id]
        assert batch.sampling_needs == _needs_of(list(held.values()))


@pytest.mark.parametrize("kinds", [[0, 0, 0], [0, 1], [0, 2, 0], [3, 0], [4, 0], [5], [0, 1, 2, 3, 4, 5]])
def test_needs_that_cover_the_batch_sample_as_checking_each_request(kinds: list[int]) -> None:
    """The sampler skips only what no request uses: tokens and logprobs are those of looking at every request."""
    device = torch.device("cpu")
    params = [_NEEDS_PARAMS[kind] for kind in kinds]
    requests = [make_request(p, output=[4], generator_seed=i) for i, p in enumerate(params)]
    logits = random_logits(len(requests), 100, seed=3, device=device)
    checked = Sampler(100, device, 0)(logits, requests)
    skipped = Sampler(100, device, 0)(logits, requests, needs=_needs_of(params))
    assert skipped.token_ids == checked.token_ids
    assert skipped.logprobs == checked.logprobs
