"""A model directory's tokenizer: what transformers' `AutoTokenizer` loads, or, for a checkpoint whose tokenizer is
code of its own around a tiktoken rank file (Moonshot's: Kimi K2's `tokenization_kimi.TikTokenTokenizer` in
tokenizer_config.json's `auto_map`, and any `*.TikTokenTokenizer` whose code holds the same pattern and layout), the
same tokenizer built from its files without running that code.

Kimi's class encodes with tiktoken over `tiktoken.model`'s ranks and a pre-tokenizing pattern written in its code
(runs of Han characters split from other letters); the ids after the ranks are 256 + 2 special tokens, named by
tokenizer_config.json's `added_tokens_decoder` or else `<|reserved_token_{id}|>`; special tokens in a text encode as
themselves; and its `apply_chat_template` sorts the keys of every object in the tools before rendering. Here the ranks
become a byte-level BPE whose merges are derived from them (tiktoken merges the adjacent pair whose joined bytes rank
lowest, which is what BPE does with the merges ordered by the joined token's rank) behind the same pattern, so
encoding, decoding and rendering equal its class's (tests/test_kimi.py holds them to tiktoken itself).

Ferry runs no checkpoint code: the shipped tokenizer code is read as text, and the tokenizer is built only when that
text holds the pattern and the reserved count written here; any other tokenizer code is refused by name
(`UnsupportedTokenizer`).
"""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

KIMI_CLASS = "TikTokenTokenizer"
"""The class name Moonshot's tokenizer code defines (in tokenization_kimi.py for Kimi K2)."""
KIMI_RANKS_FILE = "tiktoken.model"
KIMI_PATTERN_PARTS = (
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
)
"""Kimi's pre-tokenizing pattern, joined by `|`, as its tokenization_kimi.py writes it."""
KIMI_RESERVED = "num_reserved_special_tokens = 256"
KIMI_SPECIAL_COUNT = 256 + 2
"""Special ids after the ranks: the reserved count, and two more, as Kimi's class lays them out."""
KIMI_DEFAULTS = {"bos_token": "[BOS]", "eos_token": "[EOS]"}
"""Its class's defaults where tokenizer_config.json names none."""


class UnsupportedTokenizer(ValueError):
    """The model directory's tokenizer is code of its own that Ferry does not run."""


class KimiTokenizer(PreTrainedTokenizerFast):
    """Kimi's tiktoken tokenizer on the Rust backend (see the module's docstring)."""

    # Wrapped, so that its signature (what a caller inspects for the names rendering takes) is the base class's.
    @functools.wraps(PreTrainedTokenizerFast.apply_chat_template)
    def apply_chat_template(self, conversation: Any, tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> Any:
        # Kimi's class renders the tools with every object's keys sorted: its templates show them so.
        return super().apply_chat_template(conversation, tools=_sorted_keys(tools), **kwargs)


def auto_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    """The tokenizer of `model_dir` (see the module's docstring); raises `UnsupportedTokenizer` for tokenizer code of
    a checkpoint's own that is not Kimi's."""
    directory = Path(model_dir)
    tokenizer_config = read_tokenizer_config(directory)
    code = (tokenizer_config.get("auto_map") or {}).get("AutoTokenizer")
    own_code = next((name for name in code if name), None) if isinstance(code, list) else code
    module, _, class_name = (own_code or "").rpartition(".")
    if class_name == KIMI_CLASS and module.isidentifier():
        return kimi_tokenizer(directory, module, tokenizer_config)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except ValueError as exc:
        # transformers asks to run the checkpoint's code where it has no class of its own for the tokenizer.
        if own_code is None or "trust_remote_code" not in str(exc):
            raise
        raise UnsupportedTokenizer(
            f"{model_dir}: its tokenizer is the checkpoint's own code ({own_code}, in tokenizer_config.json's "
            f"auto_map), which Ferry does not run; Ferry reads transformers' tokenizers and Kimi's (*.{KIMI_CLASS})"
        ) from exc


def kimi_tokenizer(directory: Path, module: str, tokenizer_config: dict[str, Any]) -> KimiTokenizer:
    """Kimi's tokenizer from `directory`, whose code is `module`.py (see the module's docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    code = directory / f"{module}.py"
    source = code.read_text(encoding="utf-8") if code.is_file() else None
    if source is None or KIMI_RESERVED not in source or not all(part in source for part in KIMI_PATTERN_PARTS):
        why = "is not in the directory" if source is None else "does not hold the pattern and layout Ferry reads"
        raise UnsupportedTokenizer(f"{directory}: the tokenizer code {code.name} {why} ({module}.{KIMI_CLASS})")
    if not (directory / KIMI_RANKS_FILE).is_file():
        raise UnsupportedTokenizer(f"{directory}: {KIMI_RANKS_FILE}, the ranks {module}.{KIMI_CLASS} reads, is missing")
    ranks = read_ranks(directory / KIMI_RANKS_FILE)
    vocab, merges = byte_level_bpe(ranks)
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("|".join(KIMI_PATTERN_PARTS)), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    named = {
        int(i): token["content"] if isinstance(token, dict) else str(token)
        for i, token in (tokenizer_config.get("added_tokens_decoder") or {}).items()
    }
    first = len(ranks)
    # Added in id order: the backend numbers them on from the ranks, as Kimi's class does.
    tokenizer.add_special_tokens([
        AddedToken(named.get(i, f"<|reserved_token_{i}|>"), special=True, normalized=False)
        for i in range(first, first + KIMI_SPECIAL_COUNT)
    ])  # fmt: skip
    options = {
        name: tokenizer_config[name]
        for name in ("bos_token", "eos_token", "unk_token", "pad_token", "model_max_length", "padding_side")
        if tokenizer_config.get(name) is not None
    }
    for name, value in options.items():
        if isinstance(value, dict):  # a token saved as an AddedToken's fields
            options[name] = value.get("content")
    template_file = directory / "chat_template.jinja"
    template = (
        template_file.read_text(encoding="utf-8") if template_file.is_file() else tokenizer_config.get("chat_template")
    )
    if isinstance(template, list):  # named templates, as tokenizer_config.json lists them
        template = {entry["name"]: entry["template"] for entry in template}
    return KimiTokenizer(tokenizer_object=tokenizer, chat_template=template, **{**KIMI_DEFAULTS, **options})


def read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken rank file: a token's bytes in base64 and its rank, a line each; the ranks must be 0..n-1 (each id
    is its rank)."""
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise UnsupportedTokenizer(f"{path}: its ranks are not the ids 0..{len(ranks) - 1}, one each")
    return ranks


def byte_level_bpe(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """tiktoken's ranks as a byte-level BPE: the vocabulary spelled in GPT-2's byte alphabet, and the merges of
    every split of a token into two ranked tokens, ordered by the joined token's rank (ties by the halves' ranks)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()

    def spelled(token: bytes) -> str:
        return "".join(alphabet[byte] for byte in token)

    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return {spelled(token): rank for token, rank in ranks.items()}, [(spelled(a), spelled(b)) for *_, a, b in merges]


def _sorted_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _sorted_keys(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(item) for item in value]
    return value


def read_tokenizer_config(directory: Path) -> dict[str, Any]:
    """tokenizer_config.json's object; empty where there is none."""
    try:
        with open(directory / "tokenizer_config.json", encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        return {}
    return value if isinstance(value, dict) else {}
