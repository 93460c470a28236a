"""Tiny pooling model directories (embedders, cross-encoders, a yes/no reranker) with random weights, written by
sentence-transformers itself (`SentenceTransformer(modules=[...]).save`, `CrossEncoder(...).save`) so their files are
exactly what the library writes today, plus one directory in the older layout that most Hub checkpoints still have.

Each builder first writes a plain transformers directory (random weights, a tokenizer trained locally with
`tokenizers`) to a scratch folder, loads it through sentence-transformers' Transformer module, and saves the whole
model into the target directory. Nothing here touches the network.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from sentence_transformers import CrossEncoder, SentenceTransformer
from sentence_transformers.base.modules import Dense, Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    BertTokenizerFast,
    GenerationConfig,
    ModernBertConfig,
    ModernBertForSequenceClassification,
    ModernBertModel,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    XLMRobertaConfig,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
    XLMRobertaTokenizerFast,
)

from tests.model_factory import CHAT_TEMPLATE, _training_text

ENCODER_HIDDEN = 32
DECODER_HIDDEN = 64
DENSE_OUT = 16
ENCODER_MAX_POSITIONS = 128
QWEN3_EOS = "<|endoftext|>"
"""Qwen3-Embedding's tokenizer appends this token to every input (its post-processor), and pads with it."""
QWEN3_QUERY_PROMPT = "Instruct: find\nQuery: "
YES_NO = ("yes", "no")


def _sharpen(model: PreTrainedModel, std: float) -> PreTrainedModel:
    """Random init's std 0.02 leaves every output near the same value (a cross-encoder scores all pairs ~0.5): wider
    weights make inputs differ, so a comparison that mixes inputs up fails."""
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, std)
    return model


VOCAB_WORDS = 240
"""Whole words in the WordPiece and Unigram vocabularies, besides every character of the training text."""


def _counts(pieces: Iterable[str]) -> list[tuple[str, int]]:
    """Each piece with its count, most frequent first, ties alphabetical: the same list on every run (the trainers
    of `tokenizers` break ties in hash order, which changes between processes)."""
    return sorted(Counter(pieces).items(), key=lambda item: (-item[1], item[0]))


def _pre_tokenized(normalizer: normalizers.Normalizer, pre_tokenizer: pre_tokenizers.PreTokenizer) -> list[str]:
    return [
        word for text in _training_text() for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text))
    ]


def _wordpiece_tokenizer(model_max_length: int) -> BertTokenizerFast:
    """BERT's layout: [CLS] a [SEP] b:1 [SEP]:1, so a pair gets token_type_ids. The vocabulary: the training text's
    frequent words, and each of its characters both word-initial and as a `##` continuation."""
    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    words = _pre_tokenized(normalizer, pre_tokenizer)
    characters = sorted({character for word in words for character in word})
    pieces = [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
        *characters,
        *(f"##{character}" for character in characters),
        *(word for word, _ in _counts(word for word in words if len(word) > 1)[:VOCAB_WORDS]),
    ]
    tokenizer = Tokenizer(models.WordPiece({piece: i for i, piece in enumerate(pieces)}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.WordPiece()
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return BertTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        mask_token="[MASK]",
        model_max_length=model_max_length,
    )


def _sentencepiece_tokenizer(model_max_length: int) -> XLMRobertaTokenizerFast:
    """XLM-R's layout: <s>=0 <pad>=1 </s>=2 <unk>=3, a Unigram vocabulary, <s> a </s></s> b </s>. The vocabulary:
    the training text's characters and frequent `▁`-words, scored by their log frequency."""
    normalizer = normalizers.NFKC()
    pre_tokenizer = pre_tokenizers.Metaspace()
    words = _pre_tokenized(normalizer, pre_tokenizer)
    characters = _counts(character for word in words for character in word)
    frequent = _counts(word for word in words if len(word) > 1)[:VOCAB_WORDS]
    total = sum(count for _, count in characters)
    scored = [(piece, math.log(count / total)) for piece, count in [*characters, *frequent]]
    specials = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    tokenizer = Tokenizer(models.Unigram([*specials, *scored], unk_id=3))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.add_special_tokens(["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    return XLMRobertaTokenizerFast(tokenizer_object=tokenizer, model_max_length=model_max_length)


def _byte_level_tokenizer(append_eos: bool, padding_side: str = "right") -> PreTrainedTokenizerFast:
    """Qwen3's kind: byte-level BPE. `append_eos`: every input ends in QWEN3_EOS, as Qwen3-Embedding's post-processor
    makes it. "yes" and "no" are single tokens (a yes/no reranker scores their logits). No chat template: with one,
    sentence-transformers 6 saves an embedder as a chat model and puts a prompt into a system message instead of
    before the text, which Qwen3-Embedding's (older) files do not ask for."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [QWEN3_EOS, "<|im_start|>", "<|im_end|>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([*_training_text(), *(["yes", "no"] * 1000)], trainer)
    byte_level = processors.ByteLevel(trim_offsets=False)
    if append_eos:
        eos = tokenizer.token_to_id(QWEN3_EOS)
        template = processors.TemplateProcessing(
            single=f"$A:0 {QWEN3_EOS}:0",
            pair=f"$A:0 {QWEN3_EOS}:0 $B:1 {QWEN3_EOS}:1",
            special_tokens=[(QWEN3_EOS, eos)],
        )
        tokenizer.post_processor = processors.Sequence([byte_level, template])
    else:
        tokenizer.post_processor = byte_level
    for word in YES_NO:
        if tokenizer.token_to_id(word) is None:
            raise AssertionError(f"{word!r} is not a single token of the trained vocabulary")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=QWEN3_EOS, pad_token=QWEN3_EOS, padding_side=padding_side
    )


def _save_embedder(
    directory: Path,
    scratch: str,
    pooling: str,
    dense: bool,
    normalize: bool,
    prompts: Mapping[str, str] | None,
    default_prompt_name: str | None,
    max_seq_length: int,
    hidden: int,
) -> Path:
    modules: list[torch.nn.Module] = [Transformer(scratch, max_seq_length=max_seq_length), Pooling(hidden, pooling)]
    if dense:
        torch.manual_seed(1)
        modules.append(Dense(hidden, DENSE_OUT))
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(
        modules=modules, device="cpu", prompts=dict(prompts or {}), default_prompt_name=default_prompt_name
    )
    model.save(str(directory))
    return directory


def _bert_config(tokenizer: BertTokenizerFast, **extra: object) -> BertConfig:
    return BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=ENCODER_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=ENCODER_MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )


def build_bert_embedder(
    directory: Path,
    pooling: str = "mean",
    dense: bool = False,
    normalize: bool = False,
    prompts: Mapping[str, str] | None = None,
    max_seq_length: int = ENCODER_MAX_POSITIONS,
) -> Path:
    """A BertModel (hidden 32, 2 layers, 4 heads) embedder: Transformer, Pooling(`pooling`), optional Dense(32 -> 16,
    tanh) and Normalize."""
    directory = Path(directory)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = _wordpiece_tokenizer(max_seq_length)
        tokenizer.save_pretrained(scratch)
        _sharpen(BertModel(_bert_config(tokenizer)), 0.1).save_pretrained(scratch)
        return _save_embedder(
            directory, scratch, pooling, dense, normalize, prompts, None, max_seq_length, ENCODER_HIDDEN
        )


MODERNBERT_LOCAL_ATTENTION = 8
"""ModernBERT's local layers see 4 positions either way here (local_attention // 2), so inputs of a few dozen
tokens exercise the window."""


def _modernbert_config(tokenizer: BertTokenizerFast, **extra: object) -> ModernBertConfig:
    # Three layers, global every third: layer 0 global, layers 1 and 2 local.
    return ModernBertConfig(
        vocab_size=len(tokenizer),
        hidden_size=ENCODER_HIDDEN,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=ENCODER_MAX_POSITIONS,
        local_attention=MODERNBERT_LOCAL_ATTENTION,
        global_attn_every_n_layers=3,
        pad_token_id=tokenizer.pad_token_id,
        cls_token_id=tokenizer.cls_token_id,
        sep_token_id=tokenizer.sep_token_id,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        **extra,
    )


def build_modernbert_embedder(directory: Path, pooling: str = "mean", normalize: bool = True) -> Path:
    """A ModernBertModel embedder (hidden 32, 3 layers, local layers of an 8-position window) with the WordPiece
    tokenizer: Transformer, Pooling(`pooling`), Normalize."""
    directory = Path(directory)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = _wordpiece_tokenizer(ENCODER_MAX_POSITIONS)
        tokenizer.save_pretrained(scratch)
        _sharpen(ModernBertModel(_modernbert_config(tokenizer)), 0.1).save_pretrained(scratch)
        return _save_embedder(
            directory, scratch, pooling, False, normalize, None, None, ENCODER_MAX_POSITIONS, ENCODER_HIDDEN
        )


def build_modernbert_cross_encoder(directory: Path, classifier_pooling: str = "mean") -> Path:
    """A ModernBertForSequenceClassification cross-encoder: its head over the mean (or first) token state."""
    directory = Path(directory)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = _wordpiece_tokenizer(ENCODER_MAX_POSITIONS)
        tokenizer.save_pretrained(scratch)
        config = _modernbert_config(tokenizer, num_labels=1, classifier_pooling=classifier_pooling)
        _sharpen(ModernBertForSequenceClassification(config), 0.1).save_pretrained(scratch)
        return _save_cross_encoder(directory, scratch)


def _xlm_roberta_config(vocab_size: int, **extra: object) -> XLMRobertaConfig:
    # Positions start after padding_idx (1), as XLM-R's do: 128 tokens need 130 position rows.
    return XLMRobertaConfig(
        vocab_size=vocab_size,
        hidden_size=ENCODER_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=ENCODER_MAX_POSITIONS + 2,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        type_vocab_size=1,
        **extra,
    )


def build_xlm_roberta_embedder(
    directory: Path,
    pooling: str = "mean",
    dense: bool = False,
    normalize: bool = False,
    prompts: Mapping[str, str] | None = None,
    max_seq_length: int = ENCODER_MAX_POSITIONS,
) -> Path:
    """An XLMRobertaModel embedder (hidden 32, 2 layers): Transformer, Pooling, optional Dense and Normalize."""
    directory = Path(directory)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = _sentencepiece_tokenizer(max_seq_length)
        tokenizer.save_pretrained(scratch)
        _sharpen(XLMRobertaModel(_xlm_roberta_config(len(tokenizer))), 0.1).save_pretrained(scratch)
        return _save_embedder(
            directory, scratch, pooling, dense, normalize, prompts, None, max_seq_length, ENCODER_HIDDEN
        )


def _qwen3_config(vocab_size: int, tokenizer: PreTrainedTokenizerFast) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=DECODER_HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def build_qwen3_embedder(
    directory: Path,
    prompts: Mapping[str, str] | None = None,
    default_prompt_name: str | None = None,
    pooling: str = "lasttoken",
    normalize: bool = True,
    max_seq_length: int = 256,
) -> Path:
    """A Qwen3-Embedding-like model: a Qwen3 decoder (hidden 64, 2 layers, head_dim 16, 2 KV heads) saved through the
    Transformer module (config.json says Qwen3Model, weights without the `model.` prefix), last-token pooling and
    Normalize; its tokenizer appends EOS to every input and pads on the left. `prompts` default to a `query` one."""
    directory = Path(directory)
    prompts = {"query": QWEN3_QUERY_PROMPT} if prompts is None else prompts
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = _byte_level_tokenizer(append_eos=True, padding_side="left")
        tokenizer.model_max_length = max_seq_length
        tokenizer.save_pretrained(scratch)
        _sharpen(Qwen3Model(_qwen3_config(len(tokenizer), tokenizer)), 0.2).save_pretrained(scratch)
        return _save_embedder(
            directory, scratch, pooling, False, normalize, prompts, default_prompt_name, max_seq_length, DECODER_HIDDEN
        )


def _save_cross_encoder(directory: Path, scratch: str) -> Path:
    CrossEncoder(scratch, device="cpu").save(str(directory))
    return directory


def build_bert_cross_encoder(directory: Path, num_labels: int = 1) -> Path:
    """A BertForSequenceClassification cross-encoder (sigmoid over one label; no activation over several)."""
    directory = Path(directory)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = _wordpiece_tokenizer(ENCODER_MAX_POSITIONS)
        tokenizer.save_pretrained(scratch)
        config = _bert_config(tokenizer, num_labels=num_labels)
        _sharpen(BertForSequenceClassification(config), 0.1).save_pretrained(scratch)
        return _save_cross_encoder(directory, scratch)


def build_xlm_roberta_cross_encoder(directory: Path, num_labels: int = 1) -> Path:
    """An XLMRobertaForSequenceClassification cross-encoder (its head: dense, tanh, out_proj on the <s> token)."""
    directory = Path(directory)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = _sentencepiece_tokenizer(ENCODER_MAX_POSITIONS)
        tokenizer.save_pretrained(scratch)
        config = _xlm_roberta_config(len(tokenizer), num_labels=num_labels)
        _sharpen(XLMRobertaForSequenceClassification(config), 0.1).save_pretrained(scratch)
        return _save_cross_encoder(directory, scratch)


def build_qwen3_reranker(directory: Path) -> Path:
    """A Qwen3-Reranker-like causal LM (Qwen3ForCausalLM): "yes" and "no" are single tokens of its vocabulary; served
    with `--reranker-tokens yes,no`, it still generates (a chat template is included)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _byte_level_tokenizer(append_eos=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    model = _sharpen(Qwen3ForCausalLM(_qwen3_config(len(tokenizer), tokenizer)), 0.2)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(directory)
    return directory


OLD_FORMAT_MAX_SEQ_LENGTH = 48
"""The old layout's sentence_bert_config.json max_seq_length: below the tokenizer's model_max_length, as on the Hub
(all-MiniLM-L6-v2: 256 against 512), so a reader that takes the tokenizer's value is caught."""


def build_old_format_embedder(directory: Path) -> Path:
    """A BERT mean-pooling, normalizing embedder in the layout sentence-transformers 2.x wrote (most Hub checkpoints
    today): `sentence_transformers.models.*` module types, 1_Pooling/config.json with `word_embedding_dimension` and
    the `pooling_mode_*` booleans, max_seq_length in sentence_bert_config.json. Written by hand, as the old library
    did, since the installed one writes the new layout."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _wordpiece_tokenizer(ENCODER_MAX_POSITIONS)
    tokenizer.save_pretrained(directory)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=ENCODER_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=ENCODER_MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
    )
    _sharpen(BertModel(config), 0.1).save_pretrained(directory)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    pooling = {
        "word_embedding_dimension": ENCODER_HIDDEN,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False,
        "include_prompt": True,
    }
    files = {
        "modules.json": modules,
        "1_Pooling/config.json": pooling,
        "sentence_bert_config.json": {"max_seq_length": OLD_FORMAT_MAX_SEQ_LENGTH, "do_lower_case": False},
        "config_sentence_transformers.json": {
            "__version__": {"sentence_transformers": "2.2.2", "transformers": "4.30.2", "pytorch": "2.0.1"},
            "prompts": {},
            "default_prompt_name": None,
        },
    }
    for name, content in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content, indent=2), encoding="utf-8")
    (directory / "2_Normalize").mkdir(exist_ok=True)
    return directory
