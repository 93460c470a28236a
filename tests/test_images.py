"""Images in prompts, in the engine: the oracle (greedy tokens and logprobs equal the model's own `generate` over the
same processed inputs) under mixed batches, chunked prefill through an image, preemption and shared prefixes; the
encoder cache's account (encoded once, never evicted while needed, within its budget); the step budget counting
the encoder's work; and the refusals."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.api import generate_batch
from engine.config import EngineConfig, SchedulerConfig
from engine.core.engine_core import EngineCore
from engine.core.kv_cache import GroupLayout, KVCacheManager
from engine.core.page_pool import PagePool
from engine.core.request import ExtraKey, Request, RequestRejected, SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.step import ModelRunnerOutput
from engine.models.llava import feature_depth
from engine.models.support import UnsupportedModelError
from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.inputs import ImageInput
from tests.model_factory import build_model_dir
from tests.vision_models import BUILDERS, Prompts, build_llava_dir, random_image

MAX_NEW = 6
CONTENTS = [
    ([{"type": "image"}, {"type": "text", "text": "what is in the picture?"}], [0]),
    ([{"type": "text", "text": "compare"}, {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}],
     [1, 2]),
    ([{"type": "text", "text": "a question with no picture at all"}], []),
    ([{"type": "image"}, {"type": "text", "text": "describe it"}], [0]),
]  # fmt: skip
"""Per prompt: its content and which of the test images it holds (the first and last share an image)."""


SIZES = [(40, 30), (90, 60), (60, 100)]
"""The test images' sizes (width, height): Qwen2-VL gives each its own grid; LLaVA resizes them all alike."""


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llava_dir(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model of each image family."""
    return BUILDERS[request.param](tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def oracle(family: Path) -> tuple[Prompts, list, list, list]:
    """The prompts as engine inputs, and each one's tokens and logprobs from `generate` alone."""
    prompts = Prompts(family)
    images = [random_image(seed, *size) for seed, size in enumerate(SIZES)]
    inputs, expected = [], []
    for content, which in CONTENTS:
        pictures = [images[i] for i in which]
        inputs.append(prompts.engine_inputs(content, pictures))
        expected.append(prompts.generate(content, pictures, MAX_NEW))
    return prompts, images, inputs, expected


def _run(llava: Path, inputs: list, engine: EngineCore | None = None, **options: object) -> list:
    config = EngineConfig.of(model=str(llava), device="cpu", dtype="float32", page_size=4, debug_checks=True,
                             **options)  # fmt: skip
    outputs = generate_batch(
        [ids for ids, _ in inputs],
        None if engine is not None else config,
        engine=engine,
        params=SamplingParams(max_new_tokens=MAX_NEW, logprobs=True),
        images=[images for _, images in inputs],
    )
    return [outputs[f"req_{i}"] for i in range(len(inputs))]


@pytest.mark.parametrize("case", ["whole", "chunked", "preempted", "async", "tiny-encoder-cache"])
def test_greedy_tokens_and_logprobs_equal_generate(family: Path, oracle: tuple, case: str) -> None:
    _, _, inputs, expected = oracle
    longest = max(image.length for _, images in inputs for image in images)
    pages = -(-max(len(ids) for ids, _ in inputs) // 4) + 2
    options = {
        "whole": {},
        # Chunks stop inside images: an image's rest is read from the encoder cache a step later.
        # (Gemma 3's image tokens are a span, computed in one step beside the image's encoding: 2x its tokens.)
        "chunked": {"max_batch_tokens": 2 * longest if oracle[0].config.model_type == "gemma3" else longest + 3},
        # Too few pages for all: preemption, and recompute.
        "preempted": {"num_pages": pages + 4, "max_batch_tokens": 256},
        "async": {"async_scheduling": True, "max_batch_tokens": longest + 5},
        # Room for the largest image alone: the others wait, and none is evicted while a prefill needs it.
        "tiny-encoder-cache": {"encoder_cache_tokens": longest, "max_batch_tokens": longest + 5},
    }[case]
    for output, (tokens, logprobs) in zip(_run(family, inputs, **options), expected, strict=True):
        assert output.generated_ids == tokens
        np.testing.assert_allclose([lp.logprob for lp in output.logprobs], logprobs, atol=1e-4)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_prompt_logprobs_over_image_tokens_equal_the_models_forward(family: Path, oracle: tuple, chunked: bool) -> None:
    """Each prompt position's logprob reads that position's hidden state: where an image token's embedding, its
    M-RoPE position or (Gemma 3) its view of the other image tokens were wrong, these would differ."""
    prompts, images, inputs, _ = oracle
    content, which = CONTENTS[1]
    ids, pictures = inputs[1]
    budget = max(image.length for image in pictures) + 4 if chunked else 2048
    config = EngineConfig.of(model=str(family), device="cpu", dtype="float32", page_size=4, max_batch_tokens=budget)
    output = generate_batch(
        [ids], config, params=SamplingParams(max_new_tokens=1, prompt_logprobs=0), images=[pictures]
    )["req_0"]
    want = prompts.prompt_logprobs(content, [images[i] for i in which])
    got = [entry.logprob for entry in output.prompt_logprobs][-len(want) :]
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_an_image_is_encoded_once_and_its_pages_shared_only_with_the_same_image(family: Path, oracle: tuple) -> None:
    prompts, images, inputs, expected = oracle
    engine = EngineCore(EngineConfig.of(model=str(family), device="cpu", dtype="float32", page_size=4))
    content = CONTENTS[0][0]
    first = _run(family, [inputs[0]], engine)[0]
    assert (engine.encoder_cache.misses, engine.encoder_cache.hits) == (1, 0)
    again = _run(family, [inputs[0]], engine)[0]
    assert again.generated_ids == first.generated_ids == expected[0][0]
    image = inputs[0][1][0]
    assert again.num_cached_tokens >= image.end  # the image's pages came from the prefix cache
    # Equal token ids, another picture: no page holding the image's tokens may be shared, and it answers as itself.
    picture = random_image(99, *SIZES[0])  # the first image's size: the same number of tokens
    other = prompts.engine_inputs(content, [picture])
    assert other[0] == inputs[0][0] and other[1][0].content_hash != image.content_hash
    third = _run(family, [other], engine)[0]
    assert third.num_cached_tokens <= image.offset
    assert third.generated_ids == prompts.generate(content, [picture], MAX_NEW)[0]
    assert engine.encoder_cache.misses == 2
    # The first image again, after text of its own: its pages are not cached, its encoding is.
    later = prompts.engine_inputs([{"type": "text", "text": "see"}, {"type": "image"}], [images[0]])
    assert (
        _run(family, [later], engine)[0].generated_ids
        == prompts.generate([{"type": "text", "text": "see"}, {"type": "image"}], [images[0]], MAX_NEW)[0]
    )
    assert (engine.encoder_cache.misses, engine.encoder_cache.hits) == (2, 1)


def test_the_vision_tower_stops_at_its_deepest_feature_layer(llava: Path) -> None:
    """LLaVA reads the second-to-last layer's states: the last layer is neither built nor read (the oracle tests
    above show the features unchanged)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(llava)
    depth = config.vision_config.num_hidden_layers
    engine = EngineCore(EngineConfig.of(model=str(llava), device="cpu"))
    tower = engine.runner.model.vision_tower
    assert tower.config.num_hidden_layers == depth - 1
    assert len(tower.encoder.layers) == depth - 1
    config.vision_feature_layer = [1, -1, -3]  # several, counted from either end
    layers, tower_config = feature_depth(config)
    assert layers == [1, depth, depth - 2]
    assert tower_config.num_hidden_layers == depth
    assert config.vision_config.num_hidden_layers == depth, "the model's own config is left as it was"


def test_refusals(llava: Path, tmp_path: Path) -> None:
    prompts = Prompts(llava)
    inputs = [prompts.engine_inputs(content, [random_image(i) for i in which]) for content, which in CONTENTS]
    limited = EngineCore(EngineConfig.of(model=str(llava), device="cpu", limit_mm_per_prompt="image=1"))
    with pytest.raises(RequestRejected, match="at most 1") as error:
        limited.add_request("two", inputs[1][0], SamplingParams(), images=tuple(inputs[1][1]))
    assert error.value.code == "too_many_images"
    text_only = EngineCore(EngineConfig.of(model=str(llava), device="cpu", limit_mm_per_prompt="image=0"))
    with pytest.raises(RequestRejected, match="text-only") as error:
        text_only.add_request("one", inputs[0][0], SamplingParams(), images=tuple(inputs[0][1]))
    assert error.value.code == "images_not_supported"
    assert text_only.add_request("text", inputs[2][0], SamplingParams())
    small = EngineCore(EngineConfig.of(model=str(llava), device="cpu", max_batch_tokens=4))
    with pytest.raises(RequestRejected, match="max-batch-tokens") as error:
        small.add_request("big", inputs[0][0], SamplingParams(), images=tuple(inputs[0][1]))
    assert error.value.code == "image_too_large"
    text_model = EngineCore(EngineConfig.of(model=str(build_model_dir(tmp_path / "llama", "llama")), device="cpu"))
    with pytest.raises(RequestRejected, match="takes no images"):
        text_model.add_request("img", [5, 6, 7, 8, 9], SamplingParams(), images=(_image(1, 4, "x"),))


def test_unsupported_options_and_families_are_refused_by_name_or_served_text_only(llava: Path) -> None:
    with pytest.raises(ValueError, match="--enable-lora: this 'llava' image model"):
        EngineCore(EngineConfig.of(model=str(llava), device="cpu", enable_lora=True))
    # A family with no vision side here: LLaVA's files under another architecture's name.
    other = llava.parent / "other"
    shutil.copytree(llava, other)
    config = (other / "config.json").read_text()
    (other / "config.json").write_text(
        config.replace("LlavaForConditionalGeneration", "PaliGemmaForConditionalGeneration")
    )
    with pytest.raises(UnsupportedModelError, match=r"images through PaliGemmaForConditionalGeneration.*image=0"):
        EngineCore(EngineConfig.of(model=str(other), device="cpu"))
    # Served text-only as asked: its language model answers as the whole model does to text.
    text_only = EngineCore(EngineConfig.of(model=str(other), device="cpu", limit_mm_per_prompt="image=0"))
    prompt = [5, 6, 7, 8, 9, 10]
    alone = generate_batch([prompt], engine=text_only, params=SamplingParams(max_new_tokens=MAX_NEW))["req_0"]
    whole = generate_batch([prompt], EngineConfig.of(model=str(llava), device="cpu"), params=SamplingParams(
        max_new_tokens=MAX_NEW))["req_0"]  # fmt: skip
    assert alone.generated_ids == whole.generated_ids
    with pytest.raises(RequestRejected, match="text-only"):
        text_only.add_request("img", [5, 6, 7, 8, 9], SamplingParams(), images=(_image(1, 4, "x"),))


# -- the scheduler and the encoder cache, without a model --------------------------------------------------------


def _image(offset: int, length: int, content: str) -> ImageInput:
    return ImageInput(offset, length, {"pixel_values": np.zeros(1, np.float32)}, content)


_ids = itertools.count()


def _request(images: list[ImageInput], prompt_len: int, max_new: int = 2) -> Request:
    base = 1000 * (next(_ids) + 1)
    request = Request(f"r{base}", list(range(base, base + prompt_len)), SamplingParams(max_new_tokens=max_new),
                      frozenset({2}))  # fmt: skip
    request.images = tuple(images)
    request.extra_keys = tuple(ExtraKey(i.offset, i.end, ("image", i.content_hash)) for i in images)
    return request


def _scheduler(budget: int, cache_tokens: int) -> Scheduler:
    pool = PagePool(256, 4, enable_prefix_caching=True, debug_checks=True)
    return Scheduler(
        SchedulerConfig(max_batch_tokens=budget), KVCacheManager([GroupLayout(None, (0,), 1)], [pool]), 1 << 20,
        encoder_cache=EncoderCache(cache_tokens),
    )  # fmt: skip


def _finish_steps(scheduler: Scheduler, budget: int) -> list:
    """Run the scheduler to the end with a fake model; every plan, checked against the budget and the cache."""
    plans, held = [], set()
    while scheduler.has_unfinished:
        plan = scheduler.schedule()
        plans.append(plan)
        assert plan.num_tokens + sum(image.length for image in plan.encodes) <= budget
        held -= set(plan.freed_encodings)
        held |= {image.content_hash for image in plan.encodes}
        assert scheduler.encoder_cache is not None and scheduler.encoder_cache.used <= scheduler.encoder_cache.capacity
        for request_id, start, count in zip(plan.request_ids, plan.num_computed_tokens, plan.num_new_tokens,
                                            strict=True):  # fmt: skip
            request = scheduler.running.get(request_id)
            assert request is not None
            for image in request.images:
                if image.offset < start + count and image.end > start:
                    assert image.content_hash in held  # every image a chunk reaches is encoded by now
        tokens = [[7] for samples in plan.samples if samples]
        scheduler.update(plan, ModelRunnerOutput(tokens, [None] * len(tokens)))
    return plans


def test_the_encoders_work_counts_in_the_step_budget_and_decodes_keep_running() -> None:
    scheduler = _scheduler(budget=12, cache_tokens=64)
    decoding = _request([], 3, max_new=8)
    scheduler.add(decoding)
    first = scheduler.schedule()
    scheduler.update(first, ModelRunnerOutput([[7]], [None]))
    burst = [_request([_image(2, 8, f"img{i}")], 14) for i in range(3)]
    for request in burst:
        scheduler.add(request)
    plans = _finish_steps(scheduler, budget=12)
    # The decode is in every step until it ends, beside at most one image's encoding (8 + 1 + a chunk <= 12).
    for plan in plans[: len(decoding.output_ids) - 1]:
        assert decoding.request_id in plan.request_ids and len(plan.encodes) <= 1


@settings(max_examples=40, deadline=None)
@given(
    budget=st.integers(6, 24),
    cache_tokens=st.integers(5, 20),
    shapes=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 5), st.integers(0, 3)), min_size=1, max_size=6),
)
def test_every_chunk_finds_its_images_encoded_within_budget_and_cache(budget: int, cache_tokens: int,
                                                                        shapes: list) -> None:  # fmt: skip
    scheduler = _scheduler(budget, cache_tokens)
    for before, length, content in shapes:
        length = min(length, budget - 1, cache_tokens)
        scheduler.add(_request([_image(before, length, f"c{content}")], before + length + 3))
    _finish_steps(scheduler, budget)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6), st.sets(st.integers(0, 5))), max_size=30))
def test_the_encoder_cache_never_exceeds_its_budget_nor_evicts_what_is_in_use(operations: list) -> None:
    cache = EncoderCache(10)
    held: dict[str, int] = {}  # what the runner would hold, from what the cache tells it
    for content, length, in_use in operations:
        key, used = f"i{content}", {f"i{k}" for k in in_use}
        if key in held:
            assert cache.lookup(key)
            continue
        admitted = cache.admit(key, length, lambda in_use=used: in_use)
        freed = set(cache.take_freed())
        assert not freed & used  # nothing in use was evicted
        assert admitted or not freed  # a refusal evicts nothing
        for gone in freed:
            del held[gone]
        if admitted:
            held[key] = length
        assert cache.used == sum(held.values()) <= cache.capacity
        assert all(k in cache for k in held) and len(cache) == len(held)
