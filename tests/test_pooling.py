"""The pooling oracle: Ferry's embeddings and scores against sentence-transformers' own (`SentenceTransformer.encode`,
`CrossEncoder.predict`) and against transformers' forward for a yes/no reranker, on tiny models that
sentence-transformers itself saved (tests/pooling_models.py). Inputs are tokenized as sentence-transformers does
(the prompt put before the text, special tokens added, truncated at max_seq_length) and checked to be the very ids it
computes on. Then what must not change a vector: batching, order, chunked prefill, generating requests beside it;
and the inputs the engine refuses."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from engine import EngineConfig, EngineCore, SamplingParams, generate_batch
from engine.api import pool_batch
from engine.core.request import GenerationOutput, PoolingParams, RequestRejected
from tests.pooling_models import (
    DECODER_HIDDEN,
    QWEN3_QUERY_PROMPT,
    YES_NO,
    build_bert_cross_encoder,
    build_bert_embedder,
    build_modernbert_cross_encoder,
    build_modernbert_embedder,
    build_old_format_embedder,
    build_qwen3_embedder,
    build_qwen3_reranker,
    build_xlm_roberta_cross_encoder,
    build_xlm_roberta_embedder,
)

COSINE_DISTANCE = 1e-5
SCORE_TOLERANCE = 1e-5
NORM_TOLERANCE = 1e-4
"""Relative: a cosine check alone passes a vector of the wrong length (a mean over the wrong token count)."""
RERANKER_TEMPLATE = "<Query>: {query}\n<Document>: {document}\n<Relevant>:"

TEXTS = [
    "hello world",
    "Ferry boats carry passengers across the river.",
    "a",
    "Return a new dictionary initialized from an optional positional argument and keyword arguments.",
    "héllo wörld — 你好，世界 🙂",
    "The quick brown fox jumps over the lazy dog",
    "Deserialize a string containing a JSON document to a Python object.",
    "ferry",
    "Split the pathname into a pair (head, tail) where tail is everything after the final slash.",
    "Wrap the single paragraph in text so every line is at most width characters long.",
    "queue",
    "Return the number of items in the deque, counting each only once.",
    "What time does the last ferry leave tonight?",
    "river crossing",
    "Dedent removes any common leading whitespace from every line in the text.",
    "Count elements from an iterable or initialize the count from another mapping of elements to their counts.",
    "tickets",
    "Is the harbour open on Sundays?",
    "Get the signature of a callable object, including its parameters and return annotation.",
    "boats",
]
LONG_TEXT = " ".join(TEXTS[1::2])
"""Far over the old layout's 48-token limit (truncated there), and over the chunked-prefill step of 16 tokens."""
PAIRS = [
    ("what does a ferry carry", "Ferry boats carry passengers across the river."),
    ("what does a ferry carry", "Deserialize a string containing a JSON document to a Python object."),
    ("how long is a line", "Wrap the single paragraph in text so every line is at most width characters long."),
    ("harbour hours", "Is the harbour open on Sundays?"),
    ("a", "b"),
    ("long", LONG_TEXT),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling")
    return {
        "bert_mean": build_bert_embedder(root / "bert_mean"),
        "bert_cls_dense": build_bert_embedder(root / "bert_cls_dense", pooling="cls", dense=True, normalize=True),
        "xlm_roberta": build_xlm_roberta_embedder(root / "xlm_roberta", dense=True),
        "qwen3": build_qwen3_embedder(root / "qwen3", prompts={"query": QWEN3_QUERY_PROMPT}),
        "old_format": build_old_format_embedder(root / "old_format"),
        "bert_cross_encoder": build_bert_cross_encoder(root / "bert_cross_encoder"),
        "bert_cross_encoder_3": build_bert_cross_encoder(root / "bert_cross_encoder_3", num_labels=3),
        "xlm_roberta_cross_encoder": build_xlm_roberta_cross_encoder(root / "xlm_roberta_cross_encoder"),
        "qwen3_reranker": build_qwen3_reranker(root / "qwen3_reranker"),
        "modernbert_mean": build_modernbert_embedder(root / "modernbert_mean"),
        "modernbert_cls": build_modernbert_embedder(root / "modernbert_cls", pooling="cls", normalize=False),
        "modernbert_cross_encoder": build_modernbert_cross_encoder(root / "modernbert_cross_encoder"),
    }


@pytest.fixture(scope="module")
def engines(models: dict[str, Path]) -> Iterator[Callable[..., EngineCore]]:
    """`engines(name, **options)`: an engine of that model (float32 on CPU), built once per set of options; a small
    KV cache (2048 tokens), as the default 1 GiB each would add up over the module's engines."""
    built: dict[tuple, EngineCore] = {}

    def get(name: str, **options: object) -> EngineCore:
        key = (name, tuple(sorted(options.items())))
        if key not in built:
            config = EngineConfig.of(model=str(models[name]), device="cpu", dtype="float32", num_pages=128, **options)
            built[key] = EngineCore(config)
        return built[key]

    yield get
    for engine in built.values():
        engine.close()


def st_token_ids(model: SentenceTransformer, texts: Sequence[str], prompt: str | None) -> list[list[int]]:
    """The ids sentence-transformers computes each text on, padding left out."""
    features = model.preprocess(list(texts), prompt=prompt)
    return [
        [token for token, kept in zip(ids, mask, strict=True) if kept]
        for ids, mask in zip(features["input_ids"].tolist(), features["attention_mask"].tolist(), strict=True)
    ]


def tokenize(model: SentenceTransformer, texts: Sequence[str], prompt: str = "") -> list[list[int]]:
    """What Ferry is given: the prompt before each text, tokenized with special tokens, truncated at
    max_seq_length; checked to be exactly sentence-transformers' own ids, so a mismatch below is the engine's."""
    tokenizer: PreTrainedTokenizerBase = model[0].tokenizer
    ids = [
        tokenizer(prompt + text, add_special_tokens=True, truncation=True, max_length=model.max_seq_length)["input_ids"]
        for text in texts
    ]
    assert ids == st_token_ids(model, texts, prompt or None)
    return ids


def assert_same_vectors(got: Sequence[Sequence[float]], expected: np.ndarray) -> None:
    got_array = np.asarray(got, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert got_array.shape == expected.shape
    for i, (a, b) in enumerate(zip(got_array, expected, strict=True)):
        cosine = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
        assert 1.0 - cosine <= COSINE_DISTANCE, f"input {i}: cosine distance {1.0 - cosine:.3g}"
        assert math.isclose(np.linalg.norm(a), np.linalg.norm(b), rel_tol=NORM_TOLERANCE), (
            f"input {i}: norm {np.linalg.norm(a)} vs {np.linalg.norm(b)}"
        )


# --- embeddings against SentenceTransformer.encode -----------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["bert_mean", "bert_cls_dense", "xlm_roberta", "old_format", "modernbert_mean", "modernbert_cls"]
)
def test_encoder_embeddings_match_sentence_transformers(
    models: dict[str, Path], engines: Callable[..., EngineCore], name: str
) -> None:
    model = SentenceTransformer(str(models[name]), device="cpu")
    texts = [*TEXTS, LONG_TEXT]
    expected = model.encode(texts, convert_to_numpy=True)
    assert_same_vectors(pool_batch(tokenize(model, texts), engine=engines(name)), expected)


def test_old_format_truncates_at_its_max_seq_length(models: dict[str, Path]) -> None:
    model = SentenceTransformer(str(models["old_format"]), device="cpu")
    assert model.max_seq_length == 48
    assert len(tokenize(model, [LONG_TEXT])[0]) == 48


def test_decoder_embeddings_with_a_named_prompt_match_sentence_transformers(
    models: dict[str, Path], engines: Callable[..., EngineCore]
) -> None:
    model = SentenceTransformer(str(models["qwen3"]), device="cpu")
    texts = [*TEXTS, LONG_TEXT]
    expected = model.encode(texts, prompt_name="query", convert_to_numpy=True)
    ids = tokenize(model, texts, QWEN3_QUERY_PROMPT)
    assert all(row[-1] == model[0].tokenizer.eos_token_id for row in ids)  # the appended EOS is what is pooled
    assert_same_vectors(pool_batch(ids, engine=engines("qwen3")), expected)


def test_decoder_chunked_prefill_gives_the_same_vectors(
    models: dict[str, Path], engines: Callable[..., EngineCore]
) -> None:
    model = SentenceTransformer(str(models["qwen3"]), device="cpu")
    texts = [LONG_TEXT, TEXTS[3], TEXTS[15], TEXTS[0]]
    ids = tokenize(model, texts, QWEN3_QUERY_PROMPT)
    assert len(ids[0]) >= 40 and len(ids[1]) > 16
    expected = model.encode(texts, prompt_name="query", convert_to_numpy=True)
    assert_same_vectors(pool_batch(ids, engine=engines("qwen3", max_batch_tokens=16)), expected)


def test_decoder_mean_pooling_chunked_matches_sentence_transformers(
    models: dict[str, Path], engines: Callable[..., EngineCore]
) -> None:
    # The same decoder with a Pooling module of mode `mean`: what --pooling-type mean asks of the saved model.
    mean_model = SentenceTransformer(
        modules=[Transformer(str(models["qwen3"])), Pooling(DECODER_HIDDEN, "mean"), Normalize()], device="cpu"
    )
    texts = [LONG_TEXT, TEXTS[3], TEXTS[2]]
    ids = tokenize(mean_model, texts, QWEN3_QUERY_PROMPT)
    expected = mean_model.encode(texts, prompt=QWEN3_QUERY_PROMPT, convert_to_numpy=True)
    engine = engines("qwen3", max_batch_tokens=16, pooling_type="mean")
    assert_same_vectors(pool_batch(ids, engine=engine), expected)


# --- what must not change a vector ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "prompt"), [("bert_mean", ""), ("qwen3", QWEN3_QUERY_PROMPT)])
def test_batching_and_order_change_nothing(
    models: dict[str, Path], engines: Callable[..., EngineCore], name: str, prompt: str
) -> None:
    model = SentenceTransformer(str(models[name]), device="cpu")
    ids = tokenize(model, TEXTS, prompt)
    engine = engines(name)
    alone = [pool_batch([row], engine=engine)[0] for row in ids]
    together = pool_batch(ids[::-1], engine=engine)[::-1]
    np.testing.assert_allclose(np.asarray(together), np.asarray(alone), atol=1e-5, rtol=0)
    assert engine.is_idle_and_clean()


# --- cross-encoders against CrossEncoder.predict -------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["bert_cross_encoder", "bert_cross_encoder_3", "xlm_roberta_cross_encoder", "modernbert_cross_encoder"]
)
def test_cross_encoder_scores_match_sentence_transformers(
    models: dict[str, Path], engines: Callable[..., EngineCore], name: str
) -> None:
    cross_encoder = CrossEncoder(str(models[name]), device="cpu")
    expected = np.asarray(cross_encoder.predict(PAIRS, convert_to_numpy=True), dtype=np.float64)
    tokenizer = AutoTokenizer.from_pretrained(models[name])
    encodings = [
        tokenizer(query, document, truncation=True, max_length=cross_encoder.max_seq_length)
        for query, document in PAIRS
    ]
    ids = [encoding["input_ids"] for encoding in encodings]
    types = [encoding.get("token_type_ids", []) for encoding in encodings]
    if name.startswith("bert"):
        assert all(1 in row for row in types)  # the second text of a BERT pair is segment 1
    got = np.asarray(pool_batch(ids, engine=engines(name), token_type_ids=types), dtype=np.float64)
    np.testing.assert_allclose(got.reshape(expected.shape), expected, atol=SCORE_TOLERANCE, rtol=0)


# --- the yes/no reranker against transformers' forward -------------------------------------------------------------


def yes_no_prompts(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    texts = [RERANKER_TEMPLATE.format(query=query, document=document) for query, document in PAIRS]
    return [tokenizer(text)["input_ids"] for text in texts]


def p_yes(model_dir: Path, prompts: list[list[int]]) -> list[float]:
    """P(yes) = softmax over the (yes, no) logits at each prompt's last token, by the model's own forward."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    yes, no = (tokenizer.convert_tokens_to_ids(word) for word in YES_NO)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    scores = []
    with torch.no_grad():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits[0, -1]
            scores.append(float(torch.softmax(logits[[yes, no]].double(), dim=0)[0]))
    return scores


def test_yes_no_reranker_matches_the_models_forward(
    models: dict[str, Path], engines: Callable[..., EngineCore]
) -> None:
    directory = models["qwen3_reranker"]
    prompts = yes_no_prompts(AutoTokenizer.from_pretrained(directory))
    expected = p_yes(directory, prompts)
    assert max(expected) - min(expected) > 1e-3  # scores that differ, so a mix-up of inputs shows
    got = pool_batch(prompts, engine=engines("qwen3_reranker", reranker_tokens="yes,no", max_batch_tokens=32))
    assert [len(vector) for vector in got] == [1] * len(prompts)
    np.testing.assert_allclose([vector[0] for vector in got], expected, atol=SCORE_TOLERANCE, rtol=0)


def run_together(engine: EngineCore, requests: list[tuple[str, list[int], PoolingParams | None]]) -> dict:
    """Add every request before the first step, then step until all finished: they share steps."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    outputs = {}
    for request_id, ids, pooling in requests:
        engine.add_request(request_id, ids, params, pooling=pooling)
        outputs[request_id] = GenerationOutput(request_id, list(ids))
    while engine.has_unfinished():
        for delta in engine.step():
            outputs[delta.request_id].merge(delta)
    return outputs


def test_pooling_beside_generation_changes_neither(models: dict[str, Path], engines: Callable[..., EngineCore]) -> None:
    directory = models["qwen3_reranker"]
    tokenizer = AutoTokenizer.from_pretrained(directory)
    engine = engines("qwen3_reranker", reranker_tokens="yes,no", max_batch_tokens=32)
    chats = [
        tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )["input_ids"]
        for text in (TEXTS[1], TEXTS[12], LONG_TEXT)
    ]
    alone = generate_batch(chats, params=SamplingParams(max_new_tokens=12, ignore_eos=True), engine=engine)
    prompts = yes_no_prompts(tokenizer)
    requests = [(f"gen_{i}", chat, None) for i, chat in enumerate(chats)]
    requests += [(f"pool_{i}", prompt, PoolingParams()) for i, prompt in enumerate(prompts)]
    outputs = run_together(engine, requests)
    for i in range(len(chats)):
        assert outputs[f"gen_{i}"].generated_ids == alone[f"req_{i}"].generated_ids
        assert outputs[f"gen_{i}"].pooled is None
    pooled = [outputs[f"pool_{i}"] for i in range(len(prompts))]
    assert all(output.finish_reason is not None and output.generated_ids == [] for output in pooled)
    np.testing.assert_allclose([o.pooled[0] for o in pooled], p_yes(directory, prompts), atol=SCORE_TOLERANCE, rtol=0)
    assert engine.is_idle_and_clean()


# --- inputs the engine refuses -------------------------------------------------------------------------------------


def test_encoder_input_longer_than_a_step_is_rejected(
    models: dict[str, Path], engines: Callable[..., EngineCore]
) -> None:
    engine = engines("bert_mean", max_batch_tokens=16)
    model = SentenceTransformer(str(models["bert_mean"]), device="cpu")
    long, short = tokenize(model, [LONG_TEXT, "hello"])
    assert len(long) > 16
    with pytest.raises(RequestRejected) as rejected:
        engine.add_request("long", long, SamplingParams(), pooling=PoolingParams())
    assert rejected.value.code == "context_length_exceeded"
    with pytest.raises(RequestRejected):
        pool_batch([short, long], engine=engine)
    assert len(pool_batch([short], engine=engine)[0]) == 32  # the engine still serves
    assert engine.is_idle_and_clean()


@pytest.mark.parametrize("name", ["bert_mean", "xlm_roberta"])
def test_encoder_input_longer_than_its_positions_is_rejected(engines: Callable[..., EngineCore], name: str) -> None:
    # 128 positions each (XLM-R's table has 130 rows: its positions start after the padding index).
    engine = engines(name)
    assert len(pool_batch([[5] * 128], engine=engine)[0]) > 0
    with pytest.raises(RequestRejected) as rejected:
        engine.add_request("too_long", [5] * 129, SamplingParams(), pooling=PoolingParams())
    assert rejected.value.code == "context_length_exceeded"


def test_pooling_request_on_a_generating_model_is_rejected(engines: Callable[..., EngineCore]) -> None:
    engine = engines("qwen3_reranker")  # no --reranker-tokens: it only generates
    assert engine.pooling is None
    with pytest.raises(RequestRejected) as rejected:
        engine.add_request("pool", [5, 6, 7], SamplingParams(), pooling=PoolingParams())
    assert rejected.value.code == "model_does_not_pool"
    with pytest.raises(RequestRejected):
        pool_batch([[5, 6, 7]], engine=engine)


def test_generating_request_on_a_pooling_model_is_rejected(engines: Callable[..., EngineCore]) -> None:
    engine = engines("bert_mean")
    with pytest.raises(RequestRejected) as rejected:
        engine.add_request("gen", [5, 6, 7], SamplingParams(max_new_tokens=4))
    assert rejected.value.code == "model_does_not_generate"


def test_token_types_of_the_wrong_length_are_rejected(engines: Callable[..., EngineCore]) -> None:
    engine = engines("bert_cross_encoder")
    with pytest.raises(RequestRejected, match="token type ids"):
        engine.add_request("pair", [2, 5, 3, 6, 3], SamplingParams(), pooling=PoolingParams((0, 0, 1)))
