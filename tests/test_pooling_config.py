"""engine/pooling/config.py: what `pooling_config` reads from sentence-transformers' files (as the installed release
writes them, and as the older layout on the Hub has them), from config.json, and from the flags that override both;
and what it refuses. The directories built by sentence-transformers are checked against the library's own reading
of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sentence_transformers import CrossEncoder, SentenceTransformer
from sentence_transformers.base.modules import Dense, Normalize
from sentence_transformers.sentence_transformer.modules import Pooling

from engine.pooling.config import PoolingConfig, UnsupportedPooling, pooling_config
from tests.pooling_models import (
    DENSE_OUT,
    OLD_FORMAT_MAX_SEQ_LENGTH,
    QWEN3_QUERY_PROMPT,
    build_bert_cross_encoder,
    build_bert_embedder,
    build_old_format_embedder,
    build_qwen3_embedder,
    build_qwen3_reranker,
    build_xlm_roberta_cross_encoder,
    build_xlm_roberta_embedder,
)

ST_TRANSFORMER = "sentence_transformers.base.modules.transformer.Transformer"
ST_POOLING = "sentence_transformers.sentence_transformer.modules.pooling.Pooling"
ST_DENSE = "sentence_transformers.base.modules.dense.Dense"
ST_NORMALIZE = "sentence_transformers.base.modules.normalize.Normalize"
OLD_TRANSFORMER = "sentence_transformers.models.Transformer"
OLD_POOLING = "sentence_transformers.models.Pooling"
OLD_DENSE = "sentence_transformers.models.Dense"
OLD_NORMALIZE = "sentence_transformers.models.Normalize"
TANH = "torch.nn.modules.activation.Tanh"
SIGMOID = "torch.nn.modules.activation.Sigmoid"
IDENTITY = "torch.nn.modules.linear.Identity"

BERT_CONFIG = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 32}
QWEN3_CONFIG = {"architectures": ["Qwen3Model"], "model_type": "qwen3", "hidden_size": 64}
CAUSAL_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64}


def read(directory: Path, **flags: Any) -> PoolingConfig | None:
    """`pooling_config` as the engine calls it: on the directory and its config.json."""
    hf_config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    return pooling_config(str(directory), hf_config, **{"runner": "auto", **flags})


def write(directory: Path, config: dict, files: dict[str, Any] | None = None) -> Path:
    """A model directory of JSON files only (config.json and sentence-transformers' files): what the reader reads."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in {"config.json": config, **(files or {})}.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content), encoding="utf-8")
    return directory


def modules(*entries: tuple[str, str]) -> list[dict]:
    """modules.json of (type, path) entries, in order."""
    return [{"idx": i, "name": str(i), "path": path, "type": kind} for i, (kind, path) in enumerate(entries)]


def st_embedder(
    directory: Path,
    pooling: dict,
    extra: tuple[tuple[str, str], ...] = (),
    files: dict[str, Any] | None = None,
    config: dict = BERT_CONFIG,
) -> Path:
    """A hand-written sentence-transformers embedder: Transformer, Pooling (its config.json `pooling`), then
    `extra` modules (type, folder) whose files `files` holds."""
    layout = modules((ST_TRANSFORMER, ""), (ST_POOLING, "1_Pooling"), *extra)
    return write(directory, config, {"modules.json": layout, "1_Pooling/config.json": pooling, **(files or {})})


MEAN = {"embedding_dimension": 32, "pooling_mode": "mean", "include_prompt": True}


def dense_config(in_features: int, out_features: int, activation: str | None = TANH, **extra: Any) -> dict:
    config: dict[str, Any] = {"in_features": in_features, "out_features": out_features, "bias": True, **extra}
    if activation is not None:
        config["activation_function"] = activation
    return config


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every kind of model directory tests/pooling_models.py builds, saved by sentence-transformers."""
    root = tmp_path_factory.mktemp("pooling_config")
    return {
        "bert_mean": build_bert_embedder(root / "bert_mean"),
        "bert_cls_dense": build_bert_embedder(root / "bert_cls_dense", pooling="cls", dense=True, normalize=True),
        "bert_short": build_bert_embedder(root / "bert_short", max_seq_length=40),
        "xlm_roberta": build_xlm_roberta_embedder(root / "xlm_roberta", normalize=True),
        "qwen3": build_qwen3_embedder(root / "qwen3"),
        "qwen3_default_prompt": build_qwen3_embedder(root / "qwen3_default_prompt", default_prompt_name="query"),
        "old_format": build_old_format_embedder(root / "old_format"),
        "bert_cross_encoder": build_bert_cross_encoder(root / "bert_cross_encoder"),
        "bert_cross_encoder_3": build_bert_cross_encoder(root / "bert_cross_encoder_3", num_labels=3),
        "xlm_roberta_cross_encoder": build_xlm_roberta_cross_encoder(root / "xlm_roberta_cross_encoder"),
        "qwen3_reranker": build_qwen3_reranker(root / "qwen3_reranker"),
    }


# --- the built directories, read as sentence-transformers reads them ---------------------------------------------

ST_EMBEDDERS = [
    "bert_mean",
    "bert_cls_dense",
    "bert_short",
    "xlm_roberta",
    "qwen3",
    "qwen3_default_prompt",
    "old_format",
]


@pytest.mark.parametrize("name", ST_EMBEDDERS)
def test_embedder_read_as_sentence_transformers_reads_it(built: dict[str, Path], name: str) -> None:
    config = read(built[name])
    model = SentenceTransformer(str(built[name]), device="cpu")
    pooling_module = next(m for m in model if isinstance(m, Pooling))
    dense_modules = [m for m in model if isinstance(m, Dense)]
    assert config is not None and config.kind == "embed"
    assert config.pooling == {"mean": "mean", "cls": "cls", "lasttoken": "last"}[pooling_module.pooling_mode]
    assert config.normalize == any(isinstance(m, Normalize) for m in model)
    assert config.dimensions == model.get_embedding_dimension()
    assert [(d.in_features, d.out_features, d.bias) for d in config.dense] == [
        (m.in_features, m.out_features, m.bias) for m in dense_modules
    ]
    # sentence-transformers adds empty `query` and `document` prompts of its own: an empty prompt is no prompt.
    assert {name: text for name, text in config.prompts if text} == {
        name: text for name, text in model.prompts.items() if text
    }
    assert config.default_prompt_name == model.default_prompt_name
    assert config.matryoshka_dimensions is None
    assert not config.generates
    # sentence-transformers' rule: sentence_bert_config.json's max_seq_length (older layouts), else the tokenizer's
    # model_max_length (where the installed release saves it), capped at max_position_embeddings.
    assert config.max_seq_length == model.max_seq_length


def test_encoders_are_bidirectional_and_decoders_are_not(built: dict[str, Path]) -> None:
    assert all(read(built[name]).bidirectional for name in ("bert_mean", "xlm_roberta", "old_format"))  # type: ignore[union-attr]
    assert not read(built["qwen3"]).bidirectional  # type: ignore[union-attr]


def test_dense_module_read_with_its_folder_and_activation(built: dict[str, Path]) -> None:
    config = read(built["bert_cls_dense"])
    assert config is not None and len(config.dense) == 1
    dense = config.dense[0]
    assert Path(dense.path) == built["bert_cls_dense"] / "2_Dense"
    assert (dense.in_features, dense.out_features, dense.activation) == (32, DENSE_OUT, "tanh")


def test_named_prompts_and_the_default_one(built: dict[str, Path]) -> None:
    plain = read(built["qwen3"])
    defaulted = read(built["qwen3_default_prompt"])
    assert plain is not None and defaulted is not None
    assert plain.prompt("query") == QWEN3_QUERY_PROMPT and plain.prompt(None) == ""
    assert defaulted.default_prompt_name == "query" and defaulted.prompt(None) == QWEN3_QUERY_PROMPT
    with pytest.raises(KeyError):
        plain.prompt("passage")


def test_old_format_max_seq_length_is_sentence_bert_configs(built: dict[str, Path]) -> None:
    config = read(built["old_format"])
    assert config is not None and config.max_seq_length == OLD_FORMAT_MAX_SEQ_LENGTH
    assert (config.pooling, config.normalize, config.dimensions) == ("mean", True, 32)


@pytest.mark.parametrize(
    ("name", "labels", "activation"),
    [
        ("bert_cross_encoder", ("LABEL_0",), "sigmoid"),
        ("bert_cross_encoder_3", ("LABEL_0", "LABEL_1", "LABEL_2"), "identity"),
        ("xlm_roberta_cross_encoder", ("LABEL_0",), "sigmoid"),
    ],
)
def test_cross_encoder_read_as_sentence_transformers_reads_it(
    built: dict[str, Path], name: str, labels: tuple[str, ...], activation: str
) -> None:
    config = read(built[name])
    model = CrossEncoder(str(built[name]), device="cpu")
    assert type(model.activation_fn).__name__.lower() == activation
    assert config is not None and config.kind == "classify" and config.bidirectional
    assert (config.labels, config.activation, config.dimensions) == (labels, activation, model.num_labels)
    assert not config.generates
    assert config.max_seq_length == model.max_seq_length


def test_causal_lm_only_generates_unless_a_flag_says(built: dict[str, Path]) -> None:
    directory = built["qwen3_reranker"]
    assert read(directory) is None
    yes_no = read(directory, reranker_tokens=" yes , no ")
    assert yes_no is not None
    assert (yes_no.kind, yes_no.yes_no_tokens, yes_no.dimensions, yes_no.generates) == (
        "yes_no",
        ("yes", "no"),
        1,
        True,
    )
    embed = read(directory, runner="pooling")
    assert embed is not None
    assert (embed.kind, embed.pooling, embed.normalize, embed.dimensions) == ("embed", "last", True, 64)


# --- Pooling module formats ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pooling", "expected"),
    [
        ({"embedding_dimension": 32, "pooling_mode": "cls"}, "cls"),
        ({"embedding_dimension": 32, "pooling_mode": "lasttoken"}, "last"),
        ({"embedding_dimension": 32, "pooling_mode": ["mean"]}, "mean"),
        ({"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
        ({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}, "mean"),
        ({"word_embedding_dimension": 32, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}, "last"),
    ],
)
def test_pooling_mode_in_both_formats(tmp_path: Path, pooling: dict, expected: str) -> None:
    config = read(st_embedder(tmp_path, pooling))
    assert config is not None and config.pooling == expected and not config.normalize


def test_old_module_paths_read_like_new_ones(tmp_path: Path) -> None:
    layout = modules((OLD_TRANSFORMER, ""), (OLD_POOLING, "1_Pooling"), (OLD_DENSE, "2_Dense"), (OLD_NORMALIZE, "3_N"))
    files = {
        "modules.json": layout,
        "1_Pooling/config.json": {"word_embedding_dimension": 32, "pooling_mode_cls_token": True},
        "2_Dense/config.json": dense_config(32, 8),
    }
    config = read(write(tmp_path, BERT_CONFIG, files))
    assert config is not None
    assert (config.pooling, config.normalize, config.dimensions, config.dense[0].activation) == ("cls", True, 8, "tanh")


@pytest.mark.parametrize(
    "pooling",
    [
        {"embedding_dimension": 32, "pooling_mode": "max"},
        {"embedding_dimension": 32, "pooling_mode": "weightedmean"},
        {"embedding_dimension": 32, "pooling_mode": "mean_sqrt_len_tokens"},
        {"embedding_dimension": 32, "pooling_mode": ["mean", "max"]},
        {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True},
        {"word_embedding_dimension": 32, "pooling_mode_weightedmean_tokens": True},
        {"embedding_dimension": 32, "pooling_mode": "mean", "include_prompt": False},
    ],
)
def test_pooling_the_pooler_does_not_compute_is_refused(tmp_path: Path, pooling: dict) -> None:
    with pytest.raises(UnsupportedPooling, match="Pooling"):
        read(st_embedder(tmp_path, pooling))


def test_last_token_leaving_the_prompt_out_is_the_same_last_token(tmp_path: Path) -> None:
    pooling = {"embedding_dimension": 64, "pooling_mode": "lasttoken", "include_prompt": False}
    config = read(st_embedder(tmp_path, pooling, config=QWEN3_CONFIG))
    assert config is not None and config.pooling == "last"


# --- Dense and Normalize -------------------------------------------------------------------------------------------


def test_dense_chain_sets_the_width(tmp_path: Path) -> None:
    extra = ((ST_DENSE, "2_Dense"), (ST_DENSE, "3_Dense"), (ST_NORMALIZE, "4_Normalize"))
    files = {"2_Dense/config.json": dense_config(32, 24), "3_Dense/config.json": dense_config(24, 8, IDENTITY)}
    config = read(st_embedder(tmp_path, MEAN, extra, files))
    assert config is not None
    assert [(d.in_features, d.out_features, d.activation) for d in config.dense] == [
        (32, 24, "tanh"),
        (24, 8, "identity"),
    ]
    assert (config.dimensions, config.normalize) == (8, True)


def test_dense_without_an_activation_named_is_linear(tmp_path: Path) -> None:
    files = {"2_Dense/config.json": dense_config(32, 8, activation=None, bias=False)}
    config = read(st_embedder(tmp_path, MEAN, ((ST_DENSE, "2_Dense"),), files))
    assert config is not None and config.dense[0].activation == "identity" and not config.dense[0].bias


@pytest.mark.parametrize(
    ("extra", "files", "match"),
    [
        (((ST_DENSE, "2_Dense"),), {"2_Dense/config.json": dense_config(24, 8)}, "24 inputs after 32-wide"),
        (
            ((ST_DENSE, "2_Dense"),),
            {"2_Dense/config.json": dense_config(32, 8, "torch.nn.modules.activation.Softplus")},
            "Softplus",
        ),
        (((ST_DENSE, "2_Dense"),), {"2_Dense/config.json": dense_config(32, 32, use_residual=True)}, "residual"),
        (
            ((ST_DENSE, "2_Dense"),),
            {"2_Dense/config.json": dense_config(32, 32, module_input_name="token_embeddings")},
            "token_embeddings",
        ),
        (
            ((ST_NORMALIZE, "2_Normalize"), (ST_DENSE, "3_Dense")),
            {"3_Dense/config.json": dense_config(32, 8)},
            "Normalize",
        ),
        (
            (("sentence_transformers.models.WordWeights", "2_WordWeights"),),
            {"2_WordWeights/config.json": {}},
            "WordWeights",
        ),
        (
            (("sentence_transformers.sentence_transformer.modules.layer_norm.LayerNorm", "2_LayerNorm"),),
            {"2_LayerNorm/config.json": {"dimension": 32}},
            "LayerNorm",
        ),
    ],
    ids=[
        "dense-width",
        "dense-activation",
        "dense-residual",
        "dense-on-tokens",
        "dense-after-normalize",
        "word-weights",
        "layer-norm",
    ],
)
def test_modules_the_pooler_does_not_compute_are_refused(
    tmp_path: Path, extra: tuple[tuple[str, str], ...], files: dict[str, Any], match: str
) -> None:
    with pytest.raises(UnsupportedPooling, match=match):
        read(st_embedder(tmp_path, MEAN, extra, files))


def test_normalize_before_pooling_is_refused(tmp_path: Path) -> None:
    # sentence-transformers' Normalize scales `sentence_embedding`, which does not exist before Pooling: it would do
    # nothing there, while a reader that just notes "normalize" scales the vector.
    layout = modules((ST_TRANSFORMER, ""), (ST_NORMALIZE, "1_Normalize"), (ST_POOLING, "2_Pooling"))
    directory = write(tmp_path, BERT_CONFIG, {"modules.json": layout, "2_Pooling/config.json": MEAN})
    with pytest.raises(UnsupportedPooling, match="Normalize"):
        read(directory)


def test_dense_without_pooling_is_refused(tmp_path: Path) -> None:
    layout = modules((ST_TRANSFORMER, ""), (ST_DENSE, "1_Dense"))
    directory = write(tmp_path, BERT_CONFIG, {"modules.json": layout, "1_Dense/config.json": dense_config(32, 8)})
    with pytest.raises(UnsupportedPooling, match="Dense"):
        read(directory)


def test_transformer_in_a_sub_folder_is_refused(tmp_path: Path) -> None:
    layout = modules((ST_TRANSFORMER, "0_Transformer"), (ST_POOLING, "1_Pooling"))
    directory = write(tmp_path, BERT_CONFIG, {"modules.json": layout, "1_Pooling/config.json": MEAN})
    with pytest.raises(UnsupportedPooling, match="0_Transformer"):
        read(directory)


# --- prompts and lengths -------------------------------------------------------------------------------------------


def test_prompts_and_lengths_from_hand_written_files(tmp_path: Path) -> None:
    files = {
        "config_sentence_transformers.json": {
            "prompts": {"query": "query: ", "passage": "passage: "},
            "default_prompt_name": "passage",
        },
        "sentence_bert_config.json": {"max_seq_length": 77, "do_lower_case": False},
    }
    config = read(st_embedder(tmp_path, MEAN, files=files))
    assert config is not None
    assert dict(config.prompts) == {"query": "query: ", "passage": "passage: "}
    assert (config.prompt(None), config.prompt("query"), config.max_seq_length) == ("passage: ", "query: ", 77)


# --- cross-encoders ------------------------------------------------------------------------------------------------


def classifier_config(num_labels: int, model_type: str = "bert", **extra: Any) -> dict:
    architecture = {"bert": "BertForSequenceClassification", "xlm-roberta": "XLMRobertaForSequenceClassification"}
    return {
        "architectures": [architecture.get(model_type, "Qwen3ForSequenceClassification")],
        "model_type": model_type,
        "hidden_size": 32,
        "id2label": {str(i): f"LABEL_{i}" for i in range(num_labels)},
        **extra,
    }


def cross_encoder_files(activation: str | None) -> dict[str, Any]:
    st_config: dict[str, Any] = {"model_type": "CrossEncoder", "prompts": {}, "default_prompt_name": None}
    if activation is not None:
        st_config["activation_fn"] = activation
    return {"modules.json": modules((ST_TRANSFORMER, "")), "config_sentence_transformers.json": st_config}


@pytest.mark.parametrize(
    ("config", "files", "activation"),
    [
        # No sentence-transformers files (a plain transformers classifier): CrossEncoder's defaults.
        (classifier_config(1), {}, "sigmoid"),
        (classifier_config(3), {}, "identity"),
        # The activation the CrossEncoder saved, whatever the labels.
        (classifier_config(1), cross_encoder_files(IDENTITY), "identity"),
        (classifier_config(2), cross_encoder_files(SIGMOID), "sigmoid"),
        (classifier_config(1, "xlm-roberta"), cross_encoder_files(None), "sigmoid"),
        # sentence-transformers 3.x kept it in config.json.
        (classifier_config(2, sentence_transformers={"activation_fn": SIGMOID}), {}, "sigmoid"),
    ],
    ids=["bare-1", "bare-3", "st-identity", "st-sigmoid", "st-unnamed", "config-json"],
)
def test_cross_encoder_activation(tmp_path: Path, config: dict, files: dict[str, Any], activation: str) -> None:
    read_config = read(write(tmp_path, config, files))
    assert read_config is not None and read_config.kind == "classify"
    assert read_config.activation == activation


def test_classifier_labels_and_their_count(tmp_path: Path) -> None:
    names = {"0": "contradiction", "1": "entailment", "2": "neutral"}
    config = read(write(tmp_path, {**classifier_config(3), "id2label": names}))
    assert config is not None
    assert (config.dimensions, config.labels) == (3, ("contradiction", "entailment", "neutral"))


def test_classifier_without_id2label_has_transformers_two_labels(tmp_path: Path) -> None:
    config = read(write(tmp_path, {k: v for k, v in classifier_config(2).items() if k != "id2label"}))
    assert config is not None and config.labels == ("LABEL_0", "LABEL_1") and config.activation == "identity"


@pytest.mark.parametrize(
    ("config", "files", "match"),
    [
        (classifier_config(1, "qwen3"), {}, "Qwen3ForSequenceClassification"),
        (classifier_config(1), cross_encoder_files("torch.nn.modules.activation.Softmax"), "Softmax"),
    ],
    ids=["decoder-classifier", "activation"],
)
def test_classifiers_the_pooler_does_not_compute_are_refused(
    tmp_path: Path, config: dict, files: dict[str, Any], match: str
) -> None:
    with pytest.raises(UnsupportedPooling, match=match):
        read(write(tmp_path, config, files))


# --- matryoshka ----------------------------------------------------------------------------------------------------


def test_matryoshka_dimensions_listed(tmp_path: Path) -> None:
    config = read(st_embedder(tmp_path, MEAN, config={**BERT_CONFIG, "matryoshka_dimensions": [32, 8, 16]}))
    assert config is not None and config.matryoshka_dimensions == (8, 16, 32)


def test_matryoshka_flag_allows_every_size_of_the_final_width(tmp_path: Path) -> None:
    files = {"2_Dense/config.json": dense_config(32, 8)}
    config = read(st_embedder(tmp_path, MEAN, ((ST_DENSE, "2_Dense"),), files, {**BERT_CONFIG, "is_matryoshka": True}))
    assert config is not None and config.matryoshka_dimensions == tuple(range(1, 9))


# --- flags ---------------------------------------------------------------------------------------------------------


def test_pooling_flags_override_the_files(built: dict[str, Path]) -> None:
    config = read(built["qwen3"], pooling_type="mean", pooling_normalize="false")
    assert config is not None and (config.pooling, config.normalize) == ("mean", False)
    config = read(built["bert_mean"], pooling_type="cls", pooling_normalize="true")
    assert config is not None and (config.pooling, config.normalize) == ("cls", True)


def test_generate_runner_turns_pooling_off(built: dict[str, Path]) -> None:
    assert read(built["bert_mean"], runner="generate") is None


def test_models_without_sentence_transformers_files(tmp_path: Path) -> None:
    encoder = read(write(tmp_path / "bert", BERT_CONFIG))
    assert encoder is not None
    assert (encoder.kind, encoder.pooling, encoder.normalize, encoder.bidirectional) == ("embed", "cls", True, True)
    assert read(write(tmp_path / "causal", CAUSAL_CONFIG)) is None
    decoder = read(write(tmp_path / "pooled", CAUSAL_CONFIG), runner="pooling", pooling_type="mean")
    assert decoder is not None and (decoder.pooling, decoder.normalize, decoder.dimensions) == ("mean", True, 64)


@pytest.mark.parametrize(
    ("config", "tokens", "runner", "match"),
    [
        (CAUSAL_CONFIG, "yes", "auto", "two different tokens"),
        (CAUSAL_CONFIG, "yes,yes", "auto", "two different tokens"),
        (CAUSAL_CONFIG, "yes,no,maybe", "auto", "two different tokens"),
        (CAUSAL_CONFIG, "yes,", "auto", "two different tokens"),
        (BERT_CONFIG, "yes,no", "auto", "causal LM"),
        (classifier_config(1), "yes,no", "auto", "causal LM"),
        (CAUSAL_CONFIG, "yes,no", "pooling", "generating model"),
    ],
)
def test_reranker_tokens_refused(tmp_path: Path, config: dict, tokens: str, runner: str, match: str) -> None:
    with pytest.raises(UnsupportedPooling, match=match):
        read(write(tmp_path, config), reranker_tokens=tokens, runner=runner)
