"""The recorded tokenizer class (server/tokenizer_class.py): a start that finds a record loads the tokenizer
AutoTokenizer loads, through the class AutoTokenizer chose, and anything that could change that choice asks
AutoTokenizer again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer, BertConfig, PreTrainedTokenizerBase, XLMRobertaConfig

from server.tokenizer_class import load_tokenizer, tokenizer_record
from tests.pooling_models import _sentencepiece_tokenizer, _wordpiece_tokenizer
from tests.server_harness import REPO_ROOT

DEMO = REPO_ROOT / "server" / "default_model"
QWEN2 = REPO_ROOT / "tests" / "fixtures" / "quantized" / "ct-w4a16-asym-qwen2"
TEXTS = ["Hello world, how are you?", "  leading spaces and ünïcödé ✓", "<|im_start|>user\nhi<|im_end|>", ""]


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _copy(source: Path, directory: Path) -> Path:
    """The model's tokenizer and config files (not its weights) in `directory`."""
    directory.mkdir()
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, directory / path.name)
    return directory


def _bert(directory: Path) -> Path:
    _wordpiece_tokenizer(128).save_pretrained(directory)
    BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(directory)
    return directory


def _xlm_roberta(directory: Path) -> Path:
    _sentencepiece_tokenizer(128).save_pretrained(directory)
    XLMRobertaConfig(vocab_size=512, hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(
        directory
    )
    return directory


def _llama_declared_over_byte_level(directory: Path) -> Path:
    """A checkpoint that names LlamaTokenizerFast over a ByteLevel tokenizer.json (Llama 3's files): AutoTokenizer
    overrides the declared class with TokenizersBackend."""
    _copy(DEMO, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "LlamaTokenizerFast"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _same(loaded: PreTrainedTokenizerBase, expected: PreTrainedTokenizerBase) -> None:
    assert type(loaded) is type(expected)
    assert loaded.backend_tokenizer.to_str() == expected.backend_tokenizer.to_str()
    assert loaded.init_kwargs == expected.init_kwargs
    assert loaded.get_vocab() == expected.get_vocab()
    assert loaded.special_tokens_map == expected.special_tokens_map
    assert str(loaded.added_tokens_decoder) == str(expected.added_tokens_decoder)
    assert loaded.chat_template == expected.chat_template
    assert (loaded.padding_side, loaded.truncation_side, loaded.model_max_length) == (
        expected.padding_side,
        expected.truncation_side,
        expected.model_max_length,
    )
    for text in TEXTS:
        assert loaded(text) == expected(text)
        assert loaded(text, TEXTS[0]) == expected(text, TEXTS[0])
        ids = expected.encode(text)
        assert loaded.decode(ids) == expected.decode(ids)


@pytest.mark.parametrize(
    ("build", "class_name"),
    [
        (lambda directory: _copy(DEMO, directory), "TokenizersBackend"),
        (lambda directory: _copy(QWEN2, directory), "Qwen2Tokenizer"),
        (_bert, "BertTokenizer"),
        (_xlm_roberta, "XLMRobertaTokenizer"),
        (_llama_declared_over_byte_level, "TokenizersBackend"),
    ],
    ids=["demo", "qwen2", "bert", "xlm-roberta", "llama-declared-byte-level"],
)
def test_a_recorded_class_loads_what_auto_tokenizer_loads(build, class_name: str, tmp_path: Path) -> None:
    directory = str(build(tmp_path / "model"))
    expected = AutoTokenizer.from_pretrained(directory)
    assert type(expected).__name__ == class_name
    first = load_tokenizer(directory)
    record = tokenizer_record(directory)
    assert json.loads(record.read_text()) == {"module": type(expected).__module__, "name": class_name}
    assert record.stat().st_mode & 0o777 == 0o644  # readable by a shared cache's other users
    _same(first, expected)
    _same(load_tokenizer(directory), expected)


def test_the_record_is_what_a_start_follows(tmp_path: Path) -> None:
    """A record is used as written (here one naming another class, which AutoTokenizer would not pick); one that
    cannot be read or names no tokenizer class is replaced by AutoTokenizer's answer."""
    directory = str(_copy(DEMO, tmp_path / "model"))
    record = tokenizer_record(directory)
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"module": "transformers.models.bert.tokenization_bert", "name": "BertTokenizer"}))
    assert type(load_tokenizer(directory)).__name__ == "BertTokenizer"
    broken_records = (
        "{not json",
        json.dumps({"module": "transformers.utils", "name": "logging"}),  # not a tokenizer class
        json.dumps({"module": "json", "name": "JSONDecoder"}),  # outside transformers: never imported
        json.dumps({"module": "transformers.nope"}),
    )
    for broken in broken_records:
        record.write_text(broken)
        assert type(load_tokenizer(directory)).__name__ == "TokenizersBackend"
        assert json.loads(record.read_text())["name"] == "TokenizersBackend"


@pytest.mark.parametrize("changed", ["config.json", "tokenizer_config.json", "tokenizer.json", "tekken.json"])
def test_what_the_choice_reads_is_in_the_key(changed: str, tmp_path: Path) -> None:
    directory = _copy(DEMO, tmp_path / "model")
    key = tokenizer_record(str(directory))
    path = directory / changed
    if path.exists():
        value = json.loads(path.read_text())
        value["changed"] = True
        path.write_text(json.dumps(value))
    else:  # a new file: Mistral's tekken.json selects another backend
        path.write_text("{}")
    assert tokenizer_record(str(directory)) != key
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "model", moved)
    assert tokenizer_record(str(moved)) != tokenizer_record(str(directory))


def test_a_tokenizer_with_its_own_code_is_never_recorded(tmp_path: Path) -> None:
    directory = _copy(DEMO, tmp_path / "model")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    _same(load_tokenizer(str(directory)), AutoTokenizer.from_pretrained(str(directory)))
    assert not tokenizer_record(str(directory)).parent.exists()


def test_a_cache_that_cannot_be_written_only_costs_speed(cache: Path, tmp_path: Path) -> None:
    cache.write_text("a file where the cache directory would be")
    directory = str(_copy(DEMO, tmp_path / "model"))
    _same(load_tokenizer(directory), AutoTokenizer.from_pretrained(directory))
