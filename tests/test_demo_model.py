"""The embedded demo model (server/default_model) answers in English and stops by itself.

Checked with transformers' own `generate` on the committed directory, greedy, on chat-templated prompts — the
reference the engine- and server-based variants of this test compare against. Retrain the model with
`python scripts/train_demo_model.py`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

MODEL_DIR = Path(__file__).resolve().parents[1] / "server" / "default_model"
PROMPTS = [
    "What does a ferry do?",
    "What is a list?",
    "Explain the json module.",
    "What does a dictionary do?",
    "What is Python?",
]
MAX_NEW_TOKENS = 128
MIN_STOPPED = 3  # of the 5 prompts, at least this many must end with EOS before MAX_NEW_TOKENS
COMMON_WORDS = {"a", "an", "the", "is", "of", "and", "to", "it", "in", "that", "or", "for", "on", "can", "you"}


def _byte_decoder() -> dict[str, int]:
    """Inverse of byte-level BPE's byte -> printable character table (the GPT-2 scheme `tokenizers` uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


def _token_bytes(tokens: list[str]) -> bytes:
    decoder = _byte_decoder()
    return bytes(decoder[c] for token in tokens for c in token)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def answers(tokenizer: PreTrainedTokenizerBase) -> list[tuple[str, list[int], bool]]:
    """(prompt, generated ids without EOS, stopped by EOS) for each prompt, greedy."""
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    results = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        new = out[0, ids.shape[1] :].tolist()
        stopped = tokenizer.eos_token_id in new
        if stopped:
            new = new[: new.index(tokenizer.eos_token_id)]
        results.append((prompt, new, stopped))
    return results


def test_model_directory_is_small_and_complete() -> None:
    names = {p.name for p in MODEL_DIR.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    total = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert total < 20 * 1024 * 1024, f"default model is {total / 1e6:.1f} MB; it ships inside the package"


def test_chat_template_ends_with_assistant_prefix(tokenizer: PreTrainedTokenizerBase) -> None:
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text == "<|bos|><|system|>Be brief.<|eos|><|user|>Hi<|eos|><|assistant|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")


def test_generation_config_stops_at_eos(tokenizer: PreTrainedTokenizerBase) -> None:
    from transformers import GenerationConfig

    config = GenerationConfig.from_pretrained(MODEL_DIR)
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    assert tokenizer.eos_token_id in eos


def test_most_answers_end_with_eos(answers: list[tuple[str, list[int], bool]]) -> None:
    stopped = [prompt for prompt, _, done in answers if done]
    assert len(stopped) >= MIN_STOPPED, f"only {stopped} ended with EOS within {MAX_NEW_TOKENS} tokens"


@pytest.mark.parametrize("index", range(len(PROMPTS)), ids=PROMPTS)
def test_answer_is_english_looking_text(
    index: int, tokenizer: PreTrainedTokenizerBase, answers: list[tuple[str, list[int], bool]]
) -> None:
    prompt, ids, _ = answers[index]
    # Byte-level BPE can emit byte sequences that are not UTF-8 and `decode` would hide them behind U+FFFD, so
    # rebuild the raw bytes from the tokens and decode them strictly.
    raw = _token_bytes(tokenizer.convert_ids_to_tokens(ids))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        pytest.fail(f"{prompt!r} -> invalid UTF-8 ({error}): {raw!r}")
    assert text == tokenizer.decode(ids)
    assert text.strip(), f"{prompt!r} -> empty answer"
    plain = sum(c.isascii() and (c.isalpha() or c == " ") for c in text)
    assert plain / len(text) >= 0.8, f"{prompt!r} -> mostly not letters and spaces: {text!r}"
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) >= 3, f"{prompt!r} -> too few words: {text!r}"
    # English-looking: words have vowels, ordinary lengths, and common function words appear.
    with_vowel = sum(bool(re.search(r"[aeiouyAEIOUY]", w)) for w in words)
    assert with_vowel / len(words) >= 0.8, f"{prompt!r} -> not word-like: {text!r}"
    assert 2 <= sum(map(len, words)) / len(words) <= 10, f"{prompt!r} -> odd word lengths: {text!r}"
    assert COMMON_WORDS & {w.lower() for w in words}, f"{prompt!r} -> no common English words: {text!r}"
    stutter = re.search(r"\b(\w+)(\W+\1\b){2}", text)  # "the the the": an untrained or collapsed model
    assert stutter is None, f"{prompt!r} -> repeats {stutter.group(0)!r}: {text!r}"
