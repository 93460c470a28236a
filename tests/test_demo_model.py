"""The embedded demo model (server/default_model) answers in English and stops by itself, deep into its 2,048-token
context too, and calls an offered tool when asked what the tool answers, then answers from the tool's result.

Checked with transformers' own `generate` on the committed directory, greedy, on chat-templated prompts — the
reference the engine- and server-based variants of this test compare against. Retrain the model with
`python scripts/train_demo_model.py`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

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
def model() -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


def _greedy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    tools: list[dict] | None = None,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> tuple[list[int], bool]:
    """Greedy ids after the chat-templated messages, without EOS, and whether it stopped with EOS."""
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, ids.shape[1] :].tolist()
    stopped = tokenizer.eos_token_id in new
    return (new[: new.index(tokenizer.eos_token_id)] if stopped else new), stopped


@pytest.fixture(scope="module")
def answers(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[tuple[str, list[int], bool]]:
    """(prompt, generated ids without EOS, stopped by EOS) for each prompt, greedy."""
    return [(prompt, *_greedy(model, tokenizer, [{"role": "user", "content": prompt}])) for prompt in PROMPTS]


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


# ------------------------------------------------------------------------------------------------ long context


def _long_history(
    tokenizer: PreTrainedTokenizerBase, answers: list[tuple[str, list[int], bool]], tokens: int
) -> list[dict]:
    """Earlier exchanges (the prompts and the model's own answers, round after round) filling about `tokens`."""
    history: list[dict] = []
    while len(_ids(tokenizer, history or [{"role": "user", "content": ""}])) < tokens:
        for prompt, ids, _ in answers:
            history += [{"role": "user", "content": prompt}, {"role": "assistant", "content": tokenizer.decode(ids)}]
    return history


def _ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])


def test_context_fits_framework_prompts(tokenizer: PreTrainedTokenizerBase) -> None:
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["max_position_embeddings"] >= 2048 and tokenizer.model_max_length >= 2048


def test_answers_deep_in_the_context_are_still_words(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, answers: list[tuple[str, list[int], bool]]
) -> None:
    """After ~1,000 tokens of earlier turns most prompts get the very answer they get at the start of a
    conversation; after ~1,800 each still gets words that end with EOS (this history, the same five exchanges
    over and over, is harder than the varied chats of training_info.json's perplexity by position)."""
    for tokens, same_at_least in ((1000, MIN_STOPPED), (1800, 0)):
        history = _long_history(tokenizer, answers, tokens)
        same = 0
        for prompt, ids, _ in answers:
            late, stopped = _greedy(model, tokenizer, [*history, {"role": "user", "content": prompt}])
            assert stopped and _mostly_words(tokenizer.decode(late)), (tokens, prompt, tokenizer.decode(late))
            same += late == ids
        assert same >= same_at_least, (tokens, same)


def test_perplexity_does_not_grow_with_position(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, answers: list[tuple[str, list[int], bool]]
) -> None:
    """The answers of a 2,000-token conversation are as predictable at its end as at its start."""
    ids = _ids(tokenizer, _long_history(tokenizer, answers, 2000))[:2048]
    assistant = tokenizer.convert_tokens_to_ids("<|assistant|>")
    labels, inside = [], False
    for token in ids:
        labels.append(inside)
        inside = token == assistant or (inside and token != tokenizer.eos_token_id)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
    scored = torch.tensor(labels[1:])
    early = nll[:512][scored[:512]].mean().exp().item()
    late = nll[1536:][scored[1536:]].mean().exp().item()
    assert late <= 1.5 * early + 0.5, f"perplexity {early:.2f} at 0-512, {late:.2f} at 1536-2048"


# ------------------------------------------------------------------------------------------------ tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


UNCONSTRAINED_NAMES = pytest.mark.xfail(
    strict=True,
    reason="without the server's grammar, and with two tools offered, the 4-layer demo model writes the names of its "
    "training rather than the offered ones (`calculator_add` for `add`, `first` for `a`, `city_name` for `city`); "
    "`ferry serve` holds calls to the offered names. Strict, so a model that has learned them fails here until it goes",
)


@pytest.mark.parametrize("question", ["What is the weather in Lisbon?", "What is 123 plus 456?"])
def test_writes_a_call_in_its_format_when_an_offered_tool_fits(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, question: str
) -> None:
    """With tools offered, a question a tool answers gets a Hermes call (what `ferry serve` reads back with the
    hermes parser, and holds to the offered tools with `tool_choice: auto`): one JSON object, name and arguments."""
    ids, stopped = _greedy(model, tokenizer, [{"role": "user", "content": question}], [WEATHER, ADD])
    text = tokenizer.decode(ids)
    assert stopped and text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>"), text
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert set(call) == {"name", "arguments"} and isinstance(call["arguments"], dict), call


@UNCONSTRAINED_NAMES
@pytest.mark.parametrize(
    ("question", "call", "result", "words"),
    [
        ("What is the weather in Lisbon?", {"name": "get_weather", "arguments": {"city": "Lisbon"}},
         '{"city": "Lisbon", "temperature": 19, "condition": "cloudy"}', ["19", "cloudy", "Lisbon"]),
        ("What is 123 plus 456?", {"name": "add", "arguments": {"a": 123, "b": 456}}, '{"result": 579}', ["579"]),
    ],
)  # fmt: skip
def test_calls_the_offered_tool_then_answers_from_its_result(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, question: str, call: dict, result: str, words: list
) -> None:
    ask = [{"role": "user", "content": question}]
    ids, stopped = _greedy(model, tokenizer, ask, [WEATHER, ADD])
    text = tokenizer.decode(ids)
    assert stopped and text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>"), text
    assert json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")) == call
    called = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}
    ids, stopped = _greedy(model, tokenizer, [*ask, called, {"role": "tool", "content": result}], [WEATHER, ADD])
    answer = tokenizer.decode(ids)
    assert stopped and "<tool_call>" not in answer and all(word in answer for word in words), answer


def test_a_question_no_tool_answers_gets_a_plain_answer(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, answers: list[tuple[str, list[int], bool]]
) -> None:
    ids, stopped = _greedy(model, tokenizer, [{"role": "user", "content": "What is a list?"}], [WEATHER])
    assert stopped and "<tool_call>" not in tokenizer.decode(ids) and _mostly_words(tokenizer.decode(ids))


def test_template_renders_replayed_arguments_as_they_are(tokenizer: PreTrainedTokenizerBase) -> None:
    """A client may replay a call its token limit cut off: its arguments text goes into the prompt unchanged."""
    cut = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Par'}}]}  # fmt: skip
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, cut], tools=[WEATHER], tokenize=False)
    assert '{"name": "get_weather", "arguments": {"city": "Par}' in text


def _mostly_words(text: str) -> bool:
    letters_and_spaces = sum(ch.isascii() and (ch.isalpha() or ch == " ") for ch in text)
    return len(text) > 0 and letters_and_spaces / len(text) >= 0.8


def test_training_leaves_a_json_answers_opening_brace_to_the_grammar(
    tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A JSON answer whose prompt reads like a sentence answer's leaves its `{` to the grammar: on a plain question
    always (JSON mode), after a tool's result all but TYPED_OPENING_LEARNED of the time (learned every time, the
    `{` made the model answer a plain weather question in JSON; never, it lost to a second call under the Agents
    SDK's grammar). What follows the `{` is learned; so are answers to questions that ask for JSON, and sentence
    answers after a tool's result, from their first token."""
    import random

    monkeypatch.syspath_prepend(str(MODEL_DIR.parents[1] / "scripts"))
    import train_demo_model as training

    assistant, user = tokenizer.convert_tokens_to_ids("<|assistant|>"), tokenizer.convert_tokens_to_ids("<|user|>")
    seen = {"plain json": 0, "json asked": 0, "typed learned": 0, "typed left": 0, "sentence": 0}
    for seed in range(600):
        ids, labels = training.phase3_example(random.Random(seed), tokenizer, [(["What is x?"], "x is y.")], ["word"])
        start = len(ids) - ids[::-1].index(assistant)  # the last answer's first token
        if ids[-1] != tokenizer.eos_token_id or user in ids[start:]:
            continue  # cut at the context (its last answer is not whole), or ending in a tool's reply
        answer = tokenizer.decode(ids[start:])
        asked = tokenizer.decode(ids[len(ids) - ids[::-1].index(user) : start])
        after_result = "</tool_response>" in tokenizer.decode(ids[max(0, start - 24) : start])
        assert labels[start + 1 :] == ids[start + 1 :], answer
        if answer.startswith("{") and after_result:
            seen["typed learned" if labels[start] == ids[start] else "typed left"] += 1
        elif answer.startswith("{"):
            kind = "json asked" if "JSON" in asked else "plain json"
            seen[kind] += 1
            assert labels[start] == (ids[start] if kind == "json asked" else -100), (asked, answer)
        elif after_result and answer[:1].isalpha():
            seen["sentence"] += 1
            assert labels[start] == ids[start], answer
    assert min(seen.values()) >= 5 and seen["sentence"] >= 20, seen
    typed = seen["typed learned"] + seen["typed left"]
    assert abs(seen["typed learned"] / typed - training.TYPED_OPENING_LEARNED) < 0.25, seen
