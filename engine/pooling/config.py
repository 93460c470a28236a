"""What a pooling model turns a prompt into, read once at start-up: from sentence-transformers' files where the model
directory has them (modules.json, 1_Pooling/config.json, 2_Dense, the Normalize module,
config_sentence_transformers.json's prompts), else from config.json, and from the flags that override both.

Pure Python (no torch): the engine reads it to build its pooler (engine/pooling/pooler.py), and the front end gets
it in `EngineReady` to answer `/v1/embeddings`, `/v1/rerank` and `/v1/score`.

Three kinds:
- `embed`: one vector per input: the hidden states pooled (`last` token, `mean` of the tokens, or `cls`, the first
  token), through each Dense module, then scaled to unit length where the model normalizes;
- `classify`: a sequence classifier (`*ForSequenceClassification`, a cross-encoder): its head's scores after the
  activation sentence-transformers' CrossEncoder applies (sigmoid for one label, none otherwise);
- `yes_no`: a causal LM scored by two tokens' logits at the end of the prompt (Qwen3-Reranker style):
  P(yes) = softmax over (yes, no).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Literal

from engine.config import EngineStartupError

PoolingKind = Literal["embed", "classify", "yes_no"]
PoolingType = Literal["last", "mean", "cls"]
Activation = Literal["identity", "tanh", "sigmoid", "relu", "gelu"]

ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "modernbert"})
"""Bidirectional encoders the pooling path runs (their inputs attend in both directions: one non-causal span)."""
REFUSED_ENCODERS = {
    "distilbert": "position ids made inside the model (it takes none, so a packed row would number its inputs as one)",
}
"""Encoder families refused by name, with the feature the engine lacks for them."""

_ACTIVATIONS: dict[str, Activation] = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.ReLU": "relu",
    "torch.nn.modules.activation.GELU": "gelu",
}
"""sentence-transformers' activation names (the classes' import paths) that the pooler implements."""

_ST_MODULES = {
    "Transformer": "transformer",
    "Pooling": "pooling",
    "Dense": "dense",
    "Normalize": "normalize",
}
"""The sentence-transformers modules the pooler implements, by class name (their module paths moved between
releases: `sentence_transformers.models.Pooling`, later
`sentence_transformers.sentence_transformer.modules.pooling.Pooling`)."""


class UnsupportedPooling(EngineStartupError):
    """The model's pooling, as its files or the flags describe it, is something the pooler does not compute: refused
    at start-up, by name."""


@dataclass(frozen=True)
class DenseModule:
    """One sentence-transformers Dense module: `activation(x @ weight.T + bias)`, its weights in `path`."""

    path: str
    in_features: int
    out_features: int
    bias: bool
    activation: Activation


@dataclass(frozen=True)
class PoolingConfig:
    kind: PoolingKind
    pooling: PoolingType
    normalize: bool
    """Embeddings scaled to unit length (after the Dense modules)."""
    dimensions: int
    """Length of the vector a request gets: the embedding's, the classifier's labels, or 1 (yes/no)."""
    dense: tuple[DenseModule, ...] = ()
    matryoshka_dimensions: tuple[int, ...] | None = None
    """Embedding sizes a request may truncate to (`dimensions`, renormalized); None: none declared. config.json's
    `matryoshka_dimensions`, or every size when it says `is_matryoshka` (vLLM reads the same two keys)."""
    prompts: tuple[tuple[str, str], ...] = ()
    """sentence-transformers' named prompts (`query`, `document`, ...): text put before an input that names it."""
    default_prompt_name: str | None = None
    max_seq_length: int | None = None
    """sentence-transformers' `max_seq_length`: longer inputs are refused (or truncated when a request asks)."""
    activation: Activation = "identity"
    """`classify`: applied to the head's logits (sentence-transformers' CrossEncoder activation)."""
    labels: tuple[str, ...] = ()
    """`classify`: the head's label names, index order."""
    yes_no_tokens: tuple[str, str] | None = None
    """`yes_no`: the tokens whose logits score a prompt, true one first, as the flag names them."""
    bidirectional: bool = False
    """An encoder: each input attends in both directions, and is computed in one step."""
    generates: bool = False
    """The model also generates (a yes/no reranker is a causal LM): chat and completions stay open."""

    def prompt(self, name: str | None) -> str:
        """The text of the named prompt (None: the default one, or none); KeyError for a name the model lacks."""
        name = name if name is not None else self.default_prompt_name
        if name is None:
            return ""
        return dict(self.prompts)[name]


def _json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _module_kind(entry: dict) -> str:
    class_name = entry["type"].rpartition(".")[2]
    kind = _ST_MODULES.get(class_name)
    if kind is None:
        raise UnsupportedPooling(
            f"the sentence-transformers module {entry['type']!r} (modules.json) is not computed by Ferry's pooler "
            f"(it computes {', '.join(sorted(_ST_MODULES))})"
        )
    return kind


def _st_pooling_mode(config: dict) -> tuple[PoolingType, bool]:
    """The mode of a Pooling module's config, in the current (`pooling_mode`) or the older (`pooling_mode_*`
    booleans) form; and whether its prompt tokens count."""
    if "pooling_mode" in config:
        modes = config["pooling_mode"]
        modes = [modes] if isinstance(modes, str) else list(modes)
    else:
        names = {
            "pooling_mode_cls_token": "cls",
            "pooling_mode_mean_tokens": "mean",
            "pooling_mode_max_tokens": "max",
            "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
            "pooling_mode_weightedmean_tokens": "weightedmean",
            "pooling_mode_lasttoken": "lasttoken",
        }
        modes = [mode for key, mode in names.items() if config.get(key)]
    aliases = {"cls": "cls", "mean": "mean", "lasttoken": "last", "last": "last"}
    if len(modes) != 1 or modes[0] not in aliases:
        raise UnsupportedPooling(
            f"sentence-transformers pooling {modes} (1_Pooling/config.json): Ferry pools by one of cls, mean and "
            "lasttoken"
        )
    return aliases[modes[0]], bool(config.get("include_prompt", True))


def _activation(name: str | None, where: str) -> Activation:
    if name is None:
        return "identity"
    activation = _ACTIVATIONS.get(name)
    if activation is None:
        raise UnsupportedPooling(f"the activation {name!r} ({where}) is not one Ferry's pooler computes")
    return activation


@dataclass(frozen=True)
class _SentenceTransformers:
    """What a sentence-transformers model directory says (modules.json and the files it points to)."""

    pooling: PoolingType | None
    normalize: bool
    dense: tuple[DenseModule, ...]
    prompts: tuple[tuple[str, str], ...]
    default_prompt_name: str | None
    max_seq_length: int | None
    cross_encoder: bool
    activation: str | None
    """A CrossEncoder's activation, as its config names it (None: not named)."""


def _sentence_transformers(model_dir: str) -> _SentenceTransformers | None:
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    pooling: PoolingType | None = None
    normalize = False
    dense: list[DenseModule] = []
    for entry in sorted(_json(modules_path), key=lambda e: e["idx"]):
        kind = _module_kind(entry)
        folder = os.path.join(model_dir, entry.get("path", ""))
        if kind == "transformer" and entry.get("path", "") not in ("", "."):
            raise UnsupportedPooling(
                f"a Transformer module in the sub-folder {entry['path']!r}: Ferry serves the model in the directory "
                "itself"
            )
        if kind == "pooling":
            pooling, include_prompt = _st_pooling_mode(_json(os.path.join(folder, "config.json")))
            if not include_prompt and pooling != "last":
                raise UnsupportedPooling(
                    "pooling that leaves the prompt's tokens out (include_prompt: false, 1_Pooling/config.json)"
                )
        elif kind == "dense":
            config = _json(os.path.join(folder, "config.json"))
            if normalize:
                raise UnsupportedPooling(f"a Dense module after the Normalize module ({entry['path']}, modules.json)")
            if config.get("use_residual"):
                raise UnsupportedPooling(f"a Dense module with a residual connection ({entry['path']}/config.json)")
            if config.get("module_input_name", "sentence_embedding") != "sentence_embedding":
                raise UnsupportedPooling(
                    f"a Dense module over {config['module_input_name']!r} ({entry['path']}/config.json): Ferry's "
                    "Dense modules map the pooled sentence_embedding"
                )
            dense.append(
                DenseModule(
                    folder,
                    int(config["in_features"]),
                    int(config["out_features"]),
                    bool(config.get("bias", True)),
                    _activation(config.get("activation_function"), f"{entry['path']}/config.json"),
                )
            )
        elif kind == "normalize":
            if pooling is None:
                raise UnsupportedPooling("a Normalize module before the Pooling module (modules.json)")
            normalize = True
    st_config_path = os.path.join(model_dir, "config_sentence_transformers.json")
    st_config = _json(st_config_path) if os.path.isfile(st_config_path) else {}
    bert_config_path = os.path.join(model_dir, "sentence_bert_config.json")
    bert_config = _json(bert_config_path) if os.path.isfile(bert_config_path) else {}
    if "message" in (bert_config.get("modality_config") or {}):
        # sentence-transformers 6 then renders each text through the chat template (a prompt as a system message)
        # before tokenizing it; Ferry embeds the text as it is (as sentence-transformers 5 and vLLM do).
        raise UnsupportedPooling(
            "inputs rendered through the chat template (a 'message' entry in sentence_bert_config.json's "
            "modality_config): Ferry embeds texts as they are; remove that entry to serve the model so"
        )
    max_seq_length = bert_config.get("max_seq_length")
    if max_seq_length is None:
        # sentence-transformers 5+ saves it as the tokenizer's model_max_length (capped at the positions on load).
        tokenizer_config_path = os.path.join(model_dir, "tokenizer_config.json")
        tokenizer_config = _json(tokenizer_config_path) if os.path.isfile(tokenizer_config_path) else {}
        max_seq_length = tokenizer_config.get("model_max_length")
        positions = _json(os.path.join(model_dir, "config.json")).get("max_position_embeddings")
        if max_seq_length is not None and positions not in (None, -1):
            max_seq_length = min(int(max_seq_length), int(positions))
    prompts = st_config.get("prompts") or {}
    return _SentenceTransformers(
        pooling,
        normalize,
        tuple(dense),
        tuple((str(name), str(text)) for name, text in prompts.items()),
        st_config.get("default_prompt_name"),
        max_seq_length,
        st_config.get("model_type") == "CrossEncoder",
        st_config.get("activation_fn"),
    )


def is_classifier(architecture: str) -> bool:
    return architecture.endswith("ForSequenceClassification")


def pooling_config(
    model_dir: str,
    hf_config: dict,
    *,
    runner: Literal["auto", "generate", "pooling"],
    pooling_type: Literal["auto", "last", "mean", "cls"] = "auto",
    pooling_normalize: Literal["auto", "true", "false"] = "auto",
    reranker_tokens: str | None = None,
) -> PoolingConfig | None:
    """What the model at `model_dir` pools, or None for a model that only generates. `hf_config` is config.json's
    dict. Raises UnsupportedPooling for pooling the files ask for that the pooler does not compute, and for
    `runner="pooling"` on a model with nothing to pool by."""
    architectures = hf_config.get("architectures") or []
    arch = architectures[0] if architectures else ""
    model_type = hf_config.get("model_type", "")
    if model_type in REFUSED_ENCODERS and runner != "generate":
        raise UnsupportedPooling(f"model_type {model_type!r}: {REFUSED_ENCODERS[model_type]} is not supported")
    encoder = model_type in ENCODER_TYPES
    st = _sentence_transformers(model_dir)
    if reranker_tokens is not None:
        return _yes_no(hf_config, reranker_tokens, runner, encoder, arch)
    classifier = is_classifier(arch) or (st is not None and st.cross_encoder)
    pools = encoder or classifier or (st is not None and st.pooling is not None)
    if runner == "generate" or (runner == "auto" and not pools):
        return None
    if classifier:
        if pooling_type not in ("auto", "cls") or pooling_normalize != "auto":
            raise UnsupportedPooling(
                "--pooling-type and --pooling-normalize on a sequence classifier: its head reads the first token's "
                "state and its scores are not normalized"
            )
        return _classifier(hf_config, st, encoder, arch)
    if st is not None and st.pooling is None and st.dense:
        raise UnsupportedPooling("Dense modules without a Pooling module before them (modules.json)")
    pooling: PoolingType = (
        pooling_type
        if pooling_type != "auto"
        else (st.pooling if st is not None and st.pooling is not None else ("cls" if encoder else "last"))
    )
    if pooling_normalize == "auto":
        normalize = st.normalize if st is not None and st.pooling is not None else True
    else:
        normalize = pooling_normalize == "true"
    dense = st.dense if st is not None else ()
    hidden = int(hf_config.get("hidden_size", 0))
    width = hidden
    for module in dense:
        if module.in_features != width:
            raise UnsupportedPooling(
                f"a Dense module of {module.in_features} inputs after {width}-wide embeddings ({module.path})"
            )
        width = module.out_features
    matryoshka = hf_config.get("matryoshka_dimensions")
    if matryoshka is not None:
        dims: tuple[int, ...] | None = tuple(sorted(int(d) for d in matryoshka))
    elif hf_config.get("is_matryoshka"):
        dims = tuple(range(1, width + 1))
    else:
        dims = None
    return PoolingConfig(
        "embed",
        pooling,
        normalize,
        width,
        dense,
        matryoshka_dimensions=dims,
        prompts=st.prompts if st is not None else (),
        default_prompt_name=st.default_prompt_name if st is not None else None,
        max_seq_length=st.max_seq_length if st is not None else None,
        bidirectional=encoder,
    )


def _classifier(hf_config: dict, st: _SentenceTransformers | None, encoder: bool, arch: str) -> PoolingConfig:
    if not encoder or not is_classifier(arch):
        raise UnsupportedPooling(
            f"a sequence classifier of architecture {arch!r}: Ferry's classifiers are the encoders' "
            f"({', '.join(sorted(ENCODER_TYPES))}) *ForSequenceClassification heads"
        )
    id2label = hf_config.get("id2label") or {}
    num_labels = int(hf_config.get("num_labels") or len(id2label) or 2)
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels))
    # sentence-transformers' CrossEncoder: the activation its config names; else sigmoid for one label, none for
    # several (older releases kept it in config.json's `sentence_transformers` section).
    named = st.activation if st is not None else None
    if named is None:
        named = (hf_config.get("sentence_transformers") or {}).get("activation_fn")
    activation = (
        _activation(named, "the CrossEncoder's activation_fn")
        if named is not None
        else ("sigmoid" if num_labels == 1 else "identity")
    )
    # ModernBERT's head reads the mean or the first token (`classifier_pooling`); the others' the first token.
    pooling: PoolingType = "mean" if hf_config.get("classifier_pooling") == "mean" else "cls"
    return PoolingConfig(
        "classify",
        pooling,
        False,
        num_labels,
        activation=activation,
        labels=labels,
        max_seq_length=st.max_seq_length if st is not None else None,
        prompts=st.prompts if st is not None else (),
        default_prompt_name=st.default_prompt_name if st is not None else None,
        bidirectional=True,
    )


def _yes_no(hf_config: dict, tokens: str, runner: str, encoder: bool, arch: str) -> PoolingConfig:
    parts = tuple(part.strip() for part in tokens.split(","))
    if len(parts) != 2 or not all(parts) or parts[0] == parts[1]:
        raise UnsupportedPooling(f"--reranker-tokens takes two different tokens, `yes,no`; got {tokens!r}")
    if encoder or is_classifier(arch):
        raise UnsupportedPooling(f"--reranker-tokens on {arch!r}: yes/no reranking scores a causal LM's logits")
    if runner == "pooling":
        raise UnsupportedPooling("--reranker-tokens with --runner pooling: a yes/no reranker is a generating model")
    return PoolingConfig("yes_no", "last", False, 1, yes_no_tokens=(parts[0], parts[1]), generates=True)
