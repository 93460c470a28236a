#!/usr/bin/env python
"""Train Ferry's embedded demo model from scratch on CPU, reproducibly from a seed.

Ferry cannot download a model in its quick start, so it ships a tiny one that writes short English answers.
Everything here is built from text that exists on every machine with Python: the docstrings of the Python
standard library (PSF License), plus a few hand-written exchanges about Ferry and Python basics.

Four phases, each starting from the one before:
  0. copying (`--copy-steps`, until it copies COPY_FORMED of random spans: from seed 0, 0.29 after 3,000 steps,
     0.60 after 5,000 and 0.80 at 7,400, ~29 min on 2 cores): the fresh model, its embedding frozen at the random
     start, learns to repeat spans of random tokens of the whole vocabulary (induction heads). Without this the
     model never learned to copy a city or a number from its prompt into a tool call or an answer (see
     `phase_zero` for what was tried);
  1. short exchanges (`--steps`, ~9 min): a byte-level BPE tokenizer trained on the corpus, with BOS/EOS/pad, role
     tokens and a chat template, and a small Llama-architecture model (float32 safetensors, tied embeddings) that
     answers after the assistant prefix and stops with EOS, within 512 positions;
  2. long context (`--long-steps`, ~10 min): the same model at 2,048 positions, fine-tuned on a mix of the short
     exchanges, multi-turn chats up to 2,048 tokens, and synthetic tool transcripts (scripts/demo_transcripts.py)
     rendered by the chat template with tools: call an offered tool when the question is what it answers, then
     answer in a sentence from its result; answer directly when no tool fits;
  3. tools and copying (`--tool-steps`, ~6 min): mostly tool conversations (with earlier turns; a quarter end in
     a typed result, through an output tool or as a JSON answer, as agent frameworks ask), questions answered from
     their own text, plain questions answered in JSON (JSON mode), short exchanges, and phase 2's mix.
Phases 1-3 mix COPY_SHARE of repeats into their examples to keep what phase 0 formed. Measured from a 7,000-step
phase 0 (copy accuracy 0.76), 600 steps of phase 1 at 1 thread: a share of 0.15 took it to 0.37 even with the
embedding kept frozen; 0.4 at half the learning rate held it (0.80); the whole 2,400 steps at 0.4 raised it to 0.91
(lr 1e-3) and 0.93 (lr 2e-3, the default: the lower final loss too). An earlier 0.15 took 0.585 to 0.176 in 300.
Most of phase 3's JSON answers leave their `{` to the grammar (see `phase3_example`).

What it writes into `server/default_model/` (or `--out`): the tokenizer, the model, generation_config.json
(greedy, with eos_token_id) and training_info.json (what produced the weights, answers, exact tool calls on
held-out conversations, copy accuracy, and the perplexity of held-out conversations by position).

Usage:  python scripts/train_demo_model.py            # every phase
        python scripts/train_demo_model.py --copy-steps 100 --steps 50 --long-steps 20 --tool-steps 20 --out /tmp/demo
        # a smoke run
Phases 0-1, phase 2 and phase 3 can each run alone on the one before (`--base`; a phase-3 run on a phase-2 base
reports the base's phases 1-2). The shipped model was made so (2026-12-07; its training_info.json's made_by):
        python scripts/train_demo_model.py --long-steps 0 --tool-steps 0 --out /tmp/phase1     # phases 0-1, ~38 min
        python scripts/train_demo_model.py --base /tmp/phase1 --tool-steps 0 --out /tmp/phase2  # phase 2, ~11 min
        python scripts/train_demo_model.py --base /tmp/phase2 --long-steps 0                    # phase 3, ~7 min
What the runs before it taught, each a phase-2-3 run on that phase 1 (held-out copy 0.87-0.91, 42-52% of final
answers from a tool's result exact, against the model before's 18%): a typed JSON answer whose `{` was learned made
the weather answer JSON; with every such `{` left to the grammar, LangChain's JSON mode never closed its object (an
endless key) until plain questions answered in JSON were added, and the Agents SDK's loop called tools until its
turns ran out (see TYPED_OPENING_LEARNED). Phases 2-3 also blur phase 1's answers when sampled: at temperature 1, 34
of 40 samples of the five eval answers follow the greedy answer after phase 1, 24 after phase 2, 15 after a phase 3
without short exchanges of its own, 23 with them (a tenth of phase 3; at 0.7: 36 of 40).

The docstrings come from the running interpreter, so the same seed gives the same weights on the same Python,
torch and tokenizers versions (recorded in training_info.json); another Python version gives a similar model.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import itertools
import json
import math
import os
import platform
import random
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

# Set before torch loads OpenMP: on a shared machine, busy-waiting threads that lose their core make every
# parallel region wait for a descheduled spinner (measured 10x slower steps with 2 threads under load).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import demo_transcripts  # the script's own folder is on sys.path
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "server" / "default_model"

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = [PAD, BOS, EOS, *(f"<|{role}|>" for role in ROLES)]
# Same shape as the test models' template (tests/model_factory.py): every turn ends with EOS, so the model
# learns to emit EOS right after its answer, and the generation prompt is just the assistant role token.
# With `tools`, it also writes them the way Hermes / Qwen templates do (a system turn listing them, calls as
# `<tool_call>` JSON, results as `<tool_response>` user turns), so that `ferry serve` reads its calls with the
# hermes parser. Training never passes tools: a conversation without them renders exactly as before. Newlines
# are `{{ '\n' }}` because transformers renders templates with trim_blocks (a newline after a tag is dropped).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{{ '\\n\\n' }}{% endif %}"
    "# Tools{{ '\\n\\n' }}You may call one or more functions to assist with the user query.{{ '\\n\\n' }}"
    "You are provided with function signatures within <tools></tools> XML tags:{{ '\\n' }}<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>{{ '\\n\\n' }}"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:{{ '\\n' }}<tool_call>{{ '\\n' }}"
    '{"name": <function-name>, "arguments": <args-json-object>}'
    "{{ '\\n' }}</tool_call>{{ eos_token }}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if tools and loop.first and m['role'] == 'system' %}"
    "{% elif m['role'] == 'tool' %}"
    "<|user|><tool_response>{{ '\\n' }}{{ m['content'] }}{{ '\\n' }}</tool_response>{{ eos_token }}"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}<|assistant|>{{ m['content'] or '' }}"
    "{% for call in m['tool_calls'] %}<tool_call>{{ '\\n' }}"
    "{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": "
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}}"
    "{{ '\\n' }}</tool_call>{% endfor %}{{ eos_token }}"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VOCAB_SIZE = 4096
MAX_TOKENS = 160  # longest phase-1 exchange kept; answers are a sentence or two
BASE_POSITIONS = 512  # phase 1's context
LONG_POSITIONS = 2048  # phase 2's: framework tool prompts and multi-turn agent loops fit
LONG_BATCH_TOKENS = 6144  # phase-2 batches hold this many (padded) tokens: one 2,048-token chat or many short
POSITION_BUCKETS = (0, 256, 512, 1024, 1536, 2048)  # where held-out perplexity is reported

# Prompts whose greedy answers are printed at the end (and checked by tests/test_demo_model.py).
EVAL_PROMPTS = [
    "What does a ferry do?",
    "What is a list?",
    "Explain the json module.",
    "What does a dictionary do?",
    "What is Python?",
]

# Modules that open windows or browsers, print on import, or are only build/packaging helpers.
SKIP_MODULES = {
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "ensurepip",
    "pydoc_data", "posix", "nt",
}  # fmt: skip

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are Ferry, a small demo model.",
    "Answer in one or two sentences.",
    "You are a friendly assistant that explains Python.",
]

# Hand-written exchanges: several phrasings of a question -> one short answer. These are what a newcomer asks
# first, so they are repeated more often than the docstring pairs (see HANDWRITTEN_REPEAT).
HANDWRITTEN: list[tuple[list[str], str]] = [
    (["What does a ferry do?", "What is a ferry?", "Explain what a ferry is.", "Tell me about ferries."],
     "A ferry carries passengers, cars and goods across a river, a lake or a stretch of sea, "
     "going back and forth on a regular schedule."),
    (["How does a ferry work?", "How do ferries work?"],
     "A ferry loads people and vehicles at one dock, crosses the water, unloads them at the other side "
     "and then returns for the next trip."),
    (["What is Ferry?", "What is the Ferry server?", "Explain Ferry."],
     "Ferry is an inference server that runs language models and answers requests through an API "
     "that is compatible with OpenAI."),
    (["Who are you?", "What are you?", "Introduce yourself."],
     "I am a tiny demo model that ships with Ferry. I was trained on the documentation of the "
     "Python standard library, so my answers are short and simple."),
    (["Hello!", "Hi!", "Hello", "Hi there.", "Good morning!"],
     "Hello! Ask me about Python or about ferries, and I will try to answer in a sentence or two."),
    (["Thank you!", "Thanks!", "Thanks for the help."],
     "You are welcome. I am glad I could help."),
    (["What can you do?", "How can you help me?"],
     "I can answer short questions about Python, its standard library and ferries."),
    # Off-topic questions get an honest deflection instead of made-up words.
    (["Tell me a joke.", "What is the capital of France?", "Write a poem about the sea.", "What is the weather like?",
      "Who won the game yesterday?", "What time is it?", "Can you sing a song?", "What is the meaning of life?",
      "How tall is the tallest mountain?", "Who is the president?"],
     "I am a small demo model, so I only know a little about Python and ferries. Try asking me about one of those."),
    (["What is a boat?", "What does a boat do?"],
     "A boat is a small vessel that floats on water and carries people or goods from one place to another."),
    (["What is a river?"],
     "A river is a large stream of fresh water that flows across the land into a lake or the sea."),
    (["What is a ship?"],
     "A ship is a large vessel that carries passengers or cargo across the sea."),
    (["What is Python?", "Tell me about Python.", "Explain Python."],
     "Python is a programming language that is easy to read and write. It is used for scripts, "
     "web servers, data analysis and much more."),
    (["What is a list?", "What does a list do?", "Explain lists.", "What is a Python list?"],
     "A list is an ordered collection of items that can be changed. You can add, remove and sort "
     "its items."),
    (["What is a dictionary?", "What does a dictionary do?", "Explain dictionaries.", "What is a dict?"],
     "A dictionary maps keys to values, so you can look up a value quickly by its key."),
    (["What is a tuple?", "What does a tuple do?", "Explain tuples."],
     "A tuple is an ordered collection of items that cannot be changed after it is created."),
    (["What is a set?", "What does a set do?", "Explain sets."],
     "A set is an unordered collection of unique items. It is useful to remove duplicates and to test "
     "membership."),
    (["What is a string?", "What does a string do?", "Explain strings."],
     "A string is a sequence of characters used to store text."),
    (["What is a function?", "What does a function do?", "Explain functions."],
     "A function is a named block of code that takes arguments, does some work and returns a result."),
    (["What is a class?", "What does a class do?", "Explain classes."],
     "A class describes a kind of object: the data it holds and the methods that work on that data."),
    (["What is a module?", "What does a module do?", "Explain modules."],
     "A module is a file of Python code that you can import to reuse its functions and classes."),
    (["What is a variable?", "Explain variables."],
     "A variable is a name that refers to a value, so that you can use the value later."),
    (["What is a loop?", "What does a loop do?", "Explain loops."],
     "A loop runs the same block of code again and again, once for each item or until a condition is false."),
    (["What is an integer?", "What is an int?"],
     "An integer is a whole number without a fractional part, such as one, two or minus five."),
    (["What is a file?", "What does a file do?"],
     "A file stores data on a disk under a name, so that programs can read and write it later."),
    (["What is an exception?", "What does an exception do?", "Explain exceptions."],
     "An exception signals that an error happened. It stops the normal flow of the program until it is "
     "handled."),
    (["What is the standard library?", "Explain the standard library."],
     "The standard library is the large set of modules that comes with Python, such as json, os and math."),
    (["Explain the json module.", "What does the json module do?", "What is the json module?",
      "What is json?"],
     "The json module encodes Python objects as JSON text and decodes JSON text back into Python objects."),
    (["Explain the os module.", "What does the os module do?", "What is the os module?"],
     "The os module lets a program use the operating system: files, directories, processes and "
     "environment variables."),
    (["Explain the math module.", "What does the math module do?", "What is the math module?"],
     "The math module provides mathematical functions such as square roots, logarithms and sines."),
    (["Explain the random module.", "What does the random module do?", "What is the random module?"],
     "The random module makes pseudo random numbers and picks random items from sequences."),
    (["Explain the re module.", "What does the re module do?", "What is the re module?"],
     "The re module searches and replaces text with regular expressions."),
    (["Explain the sys module.", "What does the sys module do?", "What is the sys module?"],
     "The sys module gives access to the interpreter itself, such as its arguments, paths and version."),
]  # fmt: skip
HANDWRITTEN_REPEAT = 6  # copies of each hand-written question per epoch (one phrasing drawn per copy)

FUNCTION_QUESTIONS = ["What does {} do?", "Explain {}.", "What is {} for?", "Tell me what {} does."]
CLASS_QUESTIONS = ["What is {}?", "Explain {}.", "What does {} do?", "Tell me about {}."]
MODULE_QUESTIONS = [
    "Explain the {} module.",
    "What does the {} module do?",
    "What is the {} module?",
    "What is {} for?",
]

# Docstrings open with an imperative ("Return the ..."); answering "It returns the ..." reads as English.
_VERBS = """
    accept acquire add append apply build calculate call cancel change check clear close compare
    compile compute configure connect construct convert copy count create decode delete determine
    encode ensure execute extend extract fetch find flush format generate get handle initialize
    insert iterate join load look make mark move open parse perform pop print process push put raise
    read receive register release remove rename replace reset resolve restore return run save search
    send set show split start stop test translate truncate try update validate verify wait write
    yield
"""
IMPERATIVE_VERBS = set(_VERBS.split())


# ----------------------------------------------------------------------------------------------------------
# Corpus: standard-library docstrings


def _import_quietly(name: str):
    """Import a stdlib module without letting it print or warn (some do on import); None when unavailable."""
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except Exception:  # platform-specific modules (winreg, msvcrt, ...) or missing optional C extensions
        return None


def _own_doc(obj: object) -> str | None:
    # `inspect.getdoc` would fall back to the type's docstring (every int constant documents `int`); only the
    # object's own docstring describes it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # typing.io and friends warn on attribute access
        doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else None


def stdlib_docstrings() -> list[tuple[str, str, str]]:
    """(kind, subject, docstring) for public stdlib modules, their classes and functions, and class methods.

    kind is "module", "class" or "function". Sorted and deduplicated so the corpus does not depend on import
    order or on dict ordering of the interpreter's internals.
    """
    entries: dict[str, tuple[str, str]] = {}
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP_MODULES:
            continue
        module = _import_quietly(name)
        if module is None:
            continue
        if doc := _own_doc(module):
            entries[f"the {name} module"] = ("module", doc)
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            owner = getattr(obj, "__module__", None) or ""
            # Keep objects defined here (or in its C accelerator `_name`, or `posix` for os); skip re-exports.
            if (
                name != "builtins"
                and owner.lstrip("_") != name
                and not owner.startswith(name + ".")
                and not (name == "os" and owner == "posix")
            ):
                continue
            subject = attr if name == "builtins" else f"{name}.{attr}"
            if doc := _own_doc(obj):
                entries.setdefault(subject, ("class" if inspect.isclass(obj) else "function", doc))
            if inspect.isclass(obj):
                for method_name, method in sorted(vars(obj).items()):
                    if method_name.startswith("_") or not inspect.isroutine(method):
                        continue
                    if doc := _own_doc(method):
                        entries.setdefault(f"{subject}.{method_name}", ("function", doc))
    return [(kind, subject, doc) for subject, (kind, doc) in sorted(entries.items())]


def _clean(text: str) -> str:
    text = re.sub(r"<https?://[^>]*>|https?://\S+", "", text)  # links read as noise in a one-line answer
    text = re.sub(r":[a-z]+:`~?!?([^`]*)`", r"\1", text)  # reST roles such as :func:`len` -> len
    text = re.sub(r"\*{1,2}(\w+)\*{1,2}", r"\1", text)  # *emphasis* but keep x**y
    text = text.replace("``", "").replace("`", "")
    return " ".join(text.split())


def _looks_like_signature(paragraph: str) -> bool:
    first_line = paragraph.splitlines()[0] if paragraph else ""
    return bool(re.match(r"^[\w.]+\(.*\)", first_line)) or "->" in first_line


def answer_from_doc(doc: str, kind: str) -> str | None:
    """The first sentence or two of a docstring as a short plain-English answer; None if it is not prose."""
    paragraphs = [p for p in doc.split("\n\n") if p.strip()]
    while paragraphs and _looks_like_signature(paragraphs[0]):  # "dict() -> new empty dictionary" etc.
        paragraphs.pop(0)
    if not paragraphs:
        return None
    text = _clean(paragraphs[0])
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z])", text)
    answer = ""
    for sentence in sentences:
        if answer and len(answer) + len(sentence) > 200:
            break
        answer = f"{answer} {sentence}".strip()
        if len(answer) >= 60:  # one sentence is enough unless it is very short
            break
    if answer and answer[-1] not in ".!?":
        answer += "."
    if not (20 <= len(answer) <= 220) or not answer[0].isupper():
        return None
    if ">>>" in answer or "->" in answer or answer.endswith(":."):
        return None
    plain = sum(c.isascii() and (c.isalpha() or c == " ") for c in answer)
    if plain / len(answer) < 0.85:  # mostly code or symbols: not what the demo should learn to write
        return None
    first, _, rest = answer.partition(" ")
    if kind == "function" and first.lower() in IMPERATIVE_VERBS and rest:
        answer = f"It {_third_person(first.lower())} {rest}"
    return answer


def _third_person(verb: str) -> str:
    if verb.endswith(("s", "sh", "ch", "x", "z")):
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def build_qa(docs: list[tuple[str, str, str]]) -> tuple[list[tuple[list[str], str]], list[str]]:
    """(question phrasings, answer) pairs from the docstrings, plus the raw docstrings for the tokenizer."""
    handwritten_questions = {q.lower() for questions, _ in HANDWRITTEN for q in questions}
    pairs: list[tuple[list[str], str]] = []
    for kind, subject, doc in docs:
        answer = answer_from_doc(doc, kind)
        if answer is None:
            continue
        if kind == "module":
            name = subject.removeprefix("the ").removesuffix(" module")
            questions = [q.format(name) for q in MODULE_QUESTIONS]
        else:
            templates = CLASS_QUESTIONS if kind == "class" else FUNCTION_QUESTIONS
            questions = [q.format(subject) for q in templates]
        # A hand-written answer wins: two different targets for one question would teach neither.
        questions = [q for q in questions if q.lower() not in handwritten_questions]
        if questions:
            pairs.append((questions, answer))
    return pairs, [doc for _, _, doc in docs]


# ----------------------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(texts: list[str], out: Path) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable: any UTF-8 works
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = BASE_POSITIONS
    fast.save_pretrained(out)
    return fast


# ----------------------------------------------------------------------------------------------------------
# Training data


def encode_chat(tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids of the chat-templated conversation and labels that are -100 except on assistant replies.

    Built turn by turn so the assistant span is known exactly; `main` checks it equals apply_chat_template.
    """
    ids = [tokenizer.bos_token_id]
    labels = [-100]
    for message in messages:
        turn = [tokenizer.convert_tokens_to_ids(f"<|{message['role']}|>")]
        content = [*tokenizer.encode(message["content"], add_special_tokens=False), tokenizer.eos_token_id]
        ids += turn + content
        # Loss on the reply and its EOS only: the model must learn to answer and to stop, not to ask.
        labels += [-100] + (content if message["role"] == "assistant" else [-100] * len(content))
    return ids, labels


def sample_conversation(
    rng: random.Random, pair: tuple[list[str], str], extra: tuple[list[str], str] | None
) -> list[dict[str, str]]:
    messages = []
    if rng.random() < 0.25:  # clients often send a system prompt; the answer must not depend on it
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    if extra is not None:  # an earlier exchange, so later turns of a conversation work too
        messages += [
            {"role": "user", "content": rng.choice(extra[0])},
            {"role": "assistant", "content": extra[1]},
        ]
    messages += [{"role": "user", "content": rng.choice(pair[0])}, {"role": "assistant", "content": pair[1]}]
    return messages


def epoch_examples(
    rng: random.Random, tokenizer: PreTrainedTokenizerFast, pairs: list[tuple[list[str], str]]
) -> list[tuple[list[int], list[int]]]:
    pool = pairs + [pair for pair in HANDWRITTEN for _ in range(HANDWRITTEN_REPEAT)]
    examples = []
    for pair in pool:
        extra = rng.choice(pool) if rng.random() < 0.1 else None
        ids, labels = encode_chat(tokenizer, sample_conversation(rng, pair, extra))
        if len(ids) <= MAX_TOKENS:
            examples.append((ids, labels))
    rng.shuffle(examples)
    return examples


Example = tuple[list[int], list[int]]


def batches(
    rng: random.Random, examples: list[tuple[list[int], list[int]]], batch_size: int, pad_id: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Length-bucketed, right-padded batches: sorting within windows of 50 batches keeps padding small."""
    window = batch_size * 50
    chunks = []
    for start in range(0, len(examples), window):
        group = sorted(examples[start : start + window], key=lambda e: len(e[0]))
        chunks += [group[i : i + batch_size] for i in range(0, len(group), batch_size)]
    rng.shuffle(chunks)
    for chunk in chunks:
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        for row, (example_ids, example_labels) in enumerate(chunk):
            ids[row, : len(example_ids)] = torch.tensor(example_ids)
            labels[row, : len(example_labels)] = torch.tensor(example_labels)
        # Right padding under a causal mask never reaches real tokens, so no attention mask is needed.
        yield ids, labels


# ----------------------------------------------------------------------------------------------------------
# Copying: induction heads first, kept by every later phase

COPY_FORMED = 0.8
"""Whole-vocabulary copy accuracy at which phase 0 stops early."""
COPY_SHARE = 0.4
"""Of every later phase's examples, the share that are repeats: what keeps the heads while language is learned
(0.15 lost most of them within 600 steps of phase 1). Repeats are short, so in phases 2-3, whose examples run to
hundreds of tokens, they are a few percent of the tokens."""


def copy_tokens(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Every ordinary token of the vocabulary (special tokens stay out of the drill)."""
    return list(range(len(SPECIAL_TOKENS), len(tokenizer)))


def repeat_example(
    rng: random.Random, tokenizer: PreTrainedTokenizerFast, tokens: list[int], length: int | None = None
) -> Example:
    """A span of random tokens and then the same span again, with the loss on the repeat (from its second token: the
    first cannot be known). Nothing but copying what came before predicts it: the induction-head drill."""
    length = length or rng.randint(8, 40)
    span = [rng.choice(tokens) for _ in range(length)]
    return [tokenizer.bos_token_id, *span, *span], [-100] * (length + 2) + span[1:]


def repeat_batch(
    rng: random.Random, tokenizer: PreTrainedTokenizerFast, tokens: list[int], batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One span length for the whole batch: no padding."""
    length = rng.randint(8, 40)
    rows = [repeat_example(rng, tokenizer, tokens, length) for _ in range(batch_size)]
    return torch.tensor([ids for ids, _ in rows]), torch.tensor([labels for _, labels in rows])


@torch.no_grad()
def copy_accuracy(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, seed: int) -> float:
    """Greedy next-token accuracy over the repeats of 64 held-out spans of the whole vocabulary (one length, drawn)."""
    was_training = model.training
    model.eval()
    rng = random.Random(seed)
    ids, labels = repeat_batch(rng, tokenizer, copy_tokens(tokenizer), 64)
    predicted = model(input_ids=ids).logits[:, :-1].argmax(-1)
    targets = labels[:, 1:]
    mask = targets != -100
    model.train(was_training)
    return round(float((predicted[mask] == targets[mask]).float().mean()), 3)


def phase_zero(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, rng: random.Random, args: argparse.Namespace
) -> dict:
    """The fresh model learns to copy any token: repeats of spans of the whole vocabulary, with the (tied) embedding
    frozen at its random start, until it copies COPY_FORMED of them (checked every 100 steps, `--copy-steps` at most).

    Frozen, the embeddings stay nearly orthogonal, so the heads that form match and copy tokens by what any two
    vectors share, not by features learned for a few. Measured on this shape: with trained embeddings, heads formed
    on spans of 64 tokens within ~1,100 steps (per-token accuracy 0.04 -> 0.93) but were those tokens' own (0.05 on
    256 tokens, 0.00 on the vocabulary), and on the whole vocabulary a fresh model, or one trained on language
    first, stayed below 0.05 after 1,100-1,500 steps; frozen, the whole vocabulary climbed to 0.15 by 2,100 steps,
    0.60 by 5,000 and 0.80 by 7,400 (seed 0, one run).
    A constant learning rate and no weight decay: heads form after a plateau, which a decaying rate lengthens."""
    tokens = copy_tokens(tokenizer)
    embedding = model.get_input_embeddings().weight
    embedding.requires_grad_(False)
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=args.copy_lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    started, step, accuracy, loss = time.time(), 0, 0.0, torch.tensor(0.0)
    while step < args.copy_steps and accuracy < COPY_FORMED:
        for _ in range(100):
            step += 1
            for group in optimizer.param_groups:
                group["lr"] = args.copy_lr * min(1.0, step / 50)
            ids, labels = repeat_batch(rng, tokenizer, tokens, args.batch_size)
            loss = model(input_ids=ids, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            optimizer.step()
        accuracy = copy_accuracy(model, tokenizer, args.seed + 3000)
        print(f"phase 0 step {step}  loss {loss.item():.3f}  copy accuracy {accuracy}  "
              f"{(time.time() - started) / 60:.1f} min", flush=True)  # fmt: skip
    embedding.requires_grad_(True)
    return {"steps": step, "lr": args.copy_lr, "final_loss": round(loss.item(), 4), "copy_accuracy": accuracy}


# ----------------------------------------------------------------------------------------------------------
# Phase 2: long context and tools


def encode_rendered(
    tokenizer: PreTrainedTokenizerFast, messages: list[dict], tools: list[dict] | None = None
) -> Example:
    """Token ids of the conversation as the chat template renders it (with `tools`), and labels that are -100
    except on the assistant turns: from after each assistant role token through its EOS.

    Exact because special tokens are split out before BPE: text between them tokenizes on its own.
    """
    ids = list(
        tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True, return_dict=True)["input_ids"]
    )
    assistant, eos = tokenizer.convert_tokens_to_ids("<|assistant|>"), tokenizer.eos_token_id
    labels, inside = [], False
    for token in ids:
        labels.append(token if inside else -100)
        if token == assistant:
            inside = True
        elif token == eos:
            inside = False
    return ids, labels


def _qa_turn(rng: random.Random, pool: list[tuple[list[str], str]]) -> list[dict]:
    questions, reply = rng.choice(pool)
    return [{"role": "user", "content": rng.choice(questions)}, {"role": "assistant", "content": reply}]


def _turn_tokens(tokenizer: PreTrainedTokenizerFast, turn: list[dict]) -> int:
    """About the rendered length of a turn's messages (role token, content, EOS; calls as JSON)."""
    text = " ".join(str(m.get("content") or "") + json.dumps(m.get("tool_calls") or "") for m in turn)
    return len(tokenizer.encode(text, add_special_tokens=False)) + 3 * len(turn)


def phase2_example(
    rng: random.Random, tokenizer: PreTrainedTokenizerFast, pool: list[tuple[list[str], str]]
) -> Example:
    """A short exchange (a third), a tool conversation (a third), or a multi-turn chat filling a length drawn up to
    LONG_POSITIONS (a third, half of them with tools), so that every position up to the context is trained."""
    kind = rng.random()
    if kind < 1 / 3:
        return encode_rendered(tokenizer, sample_conversation(rng, rng.choice(pool), None))
    offered = demo_transcripts.offer_tools(rng)
    tools = [o.tool for o in offered]
    messages = demo_transcripts.opening(rng)
    if kind < 2 / 3:
        for _ in range(rng.choice([0, 0, 0, 1, 2])):  # earlier turns, as in an agent loop
            messages += _qa_turn(rng, pool) if rng.random() < 0.5 else demo_transcripts.exchange(rng, offered, pool)
        return encode_rendered(tokenizer, messages + demo_transcripts.exchange(rng, offered, pool), tools)
    if rng.random() < 0.5:
        tools = []
    target = rng.randint(256, LONG_POSITIONS)
    length = 150 + sum(_turn_tokens(tokenizer, [o.tool]) for o in offered) if tools else 0
    while True:
        turn = demo_transcripts.exchange(rng, offered, pool) if tools and rng.random() < 0.5 else _qa_turn(rng, pool)
        length += _turn_tokens(tokenizer, turn)
        if length > target and len(messages) >= 2:
            break
        messages += turn
    ids, labels = encode_rendered(tokenizer, messages, tools)
    # The estimate may fall short; turns cut at the context still train, their tail just goes unseen.
    return ids[:LONG_POSITIONS], labels[:LONG_POSITIONS]


TYPED_SHARE = 0.25
"""Of phase 3's tool conversations, the share that end in a typed result (an output tool or a JSON answer)."""
TYPED_OPENING_LEARNED = 0.75
"""Of the JSON answers after a tool's result, the share whose `{` is learned: next to a weather result, `{` must lose
to the sentence's "It" (greedy answers stay words) yet beat a second call's `<` (under the Agents SDK's grammar, a
call or the JSON object, the loop must end). Measured there: all of them, `{` 0.38 against "It" 0.41 and greedy
answers became JSON; none, 0.000004 against `<` 0.02, and the loop called tools until its turns ran out; 0.5, 0.03
and 0.013 in two runs against `<` 0.02; 0.75 (the shipped model), `{` 0.03, `<` 0.02, "It" 0.74."""


def _leave_opening_to_grammar(ids: list[int], labels: list[int], tokenizer: PreTrainedTokenizerFast) -> None:
    """Unlearn the last answer's first token (its `{`): the first token after the last assistant role token."""
    labels[len(ids) - ids[::-1].index(tokenizer.convert_tokens_to_ids("<|assistant|>"))] = -100


def phase3_example(
    rng: random.Random, tokenizer: PreTrainedTokenizerFast, pool: list[tuple[list[str], str]], words: list[str]
) -> Example:
    """Copying, then tools: a short exchange as phase 1's (a tenth), a question answered from its own text (three
    twentieths), a plain question answered in JSON (a tenth), a tool conversation (half, earlier turns included;
    TYPED_SHARE of them ending in a typed result), or phase 2's mix (three twentieths), so that nothing phases 1-2
    learned is lost (without the short exchanges, 15 of 40 answers sampled at temperature 1 followed the greedy
    ones; with them, 23).

    A JSON answer whose prompt reads like a sentence answer's (the request's format is in the grammar, not the
    prompt) leaves its `{` to the grammar (after a tool's result, all but TYPED_OPENING_LEARNED of the time): only
    what follows it is learned."""
    kind = rng.random()
    if kind < 0.1:
        return encode_rendered(tokenizer, sample_conversation(rng, rng.choice(pool), None))
    if kind < 0.35:
        messages = demo_transcripts.opening(rng)
        for _ in range(rng.choice([0, 0, 1, 2])):
            messages += _qa_turn(rng, pool)
        if kind < 0.25:
            return encode_rendered(tokenizer, messages + demo_transcripts.copy_exchange(rng, words))
        last, asks_json = demo_transcripts.json_exchange(rng, pool)
        ids, labels = encode_rendered(tokenizer, messages + last)
        if not asks_json:
            _leave_opening_to_grammar(ids, labels, tokenizer)
        return ids, labels
    if kind < 0.85:
        offered = demo_transcripts.offer_tools(rng)
        messages = demo_transcripts.opening(rng)
        for _ in range(rng.choice([0, 0, 1, 2, 3])):
            messages += demo_transcripts.exchange(rng, offered, pool)
        typed = demo_transcripts.typed_exchange(rng, offered) if rng.random() < TYPED_SHARE else None
        last, tools = typed or (demo_transcripts.exchange(rng, offered, pool), [o.tool for o in offered])
        ids, labels = encode_rendered(tokenizer, messages + last, tools)
        if typed and last[-1]["role"] == "assistant" and rng.random() >= TYPED_OPENING_LEARNED:
            _leave_opening_to_grammar(ids, labels, tokenizer)
        return ids[:LONG_POSITIONS], labels[:LONG_POSITIONS]
    return phase2_example(rng, tokenizer, pool)


def packed_stream(
    rng: random.Random, tokenizer: PreTrainedTokenizerFast, draw: Callable[[], Example]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of `draw()`n examples: 64 at a time, sorted by length, packed up to LONG_BATCH_TOKENS each."""
    while True:
        drawn = sorted((draw() for _ in range(64)), key=lambda e: len(e[0]))
        groups: list[list[Example]] = [[]]
        for example in drawn:
            if groups[-1] and len(example[0]) * (len(groups[-1]) + 1) > LONG_BATCH_TOKENS:
                groups.append([])
            groups[-1].append(example)
        rng.shuffle(groups)
        for group in groups:
            yield next(batches(rng, group, len(group), tokenizer.pad_token_id))


@torch.no_grad()
def perplexity_by_position(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, pool: list[tuple[list[str], str]], seed: int
) -> dict[str, float]:
    """Perplexity of the assistant tokens of held-out chats (drawn with another seed: other values, other
    orders), by where they sit in the context: the answers at 1,500-2,048 tokens must read like those at 0-256."""
    rng = random.Random(seed)
    sums = [0.0] * (len(POSITION_BUCKETS) - 1)
    counts = [0] * (len(POSITION_BUCKETS) - 1)
    examples = []
    while len(examples) < 24:  # long chats only: every bucket sees the same conversations
        ids, labels = phase2_example(rng, tokenizer, pool)
        if len(ids) > 1800:
            examples.append((ids, labels))
    for ids, labels in examples:
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
        targets = torch.tensor(labels[1:])
        mask = targets != -100
        nll = torch.nn.functional.cross_entropy(logits[mask], targets[mask], reduction="none")
        positions = torch.arange(1, len(ids))[mask]
        for b, (lo, hi) in enumerate(itertools.pairwise(POSITION_BUCKETS)):
            inside = (positions >= lo) & (positions < hi)
            sums[b] += float(nll[inside].sum())
            counts[b] += int(inside.sum())
    return {
        f"{lo}-{hi}": round(math.exp(sums[b] / counts[b]), 3)
        for b, (lo, hi) in enumerate(itertools.pairwise(POSITION_BUCKETS))
        if counts[b]
    }


@torch.no_grad()
def tool_accuracy(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, pool: list[tuple[list[str], str]], seed: int
) -> dict[str, float]:
    """Greedy, on 60 held-out tool conversations: how often the first assistant turn is exactly the expected
    call (or direct answer), and how often the turn after the tool's result is exactly the expected answer."""
    rng = random.Random(seed)
    hits = {"first_turn_exact": 0, "final_answer_exact": 0}
    total = 60
    for _ in range(total):
        offered = demo_transcripts.offer_tools(rng)
        tools = [o.tool for o in offered]
        messages = demo_transcripts.opening(rng) + demo_transcripts.exchange(rng, offered, pool)
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        hits["first_turn_exact"] += _greedy_matches(model, tokenizer, messages, first, tools)
        hits["final_answer_exact"] += _greedy_matches(model, tokenizer, messages, len(messages) - 1, tools)
    return {name: round(count / total, 3) for name, count in hits.items()}


def _greedy_matches(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, messages: list[dict], turn: int, tools: list[dict]
) -> bool:
    """Whether greedy decoding after messages[:turn] writes exactly messages[turn] and its EOS."""
    prompt = tokenizer.apply_chat_template(
        messages[:turn], tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    whole = encode_rendered(tokenizer, messages[: turn + 1], tools)[0]
    expected = whole[len(prompt) :]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=len(expected), do_sample=False)[0, len(prompt) :]
    return out.tolist() == expected


# ----------------------------------------------------------------------------------------------------------
# Model and training


def make_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=BASE_POSITIONS,
        tie_word_embeddings=True,  # the embedding is a quarter of the weights: sharing it halves that part
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine down to 10% of peak


def train(
    model: LlamaForCausalLM, stream: Iterator[tuple[torch.Tensor, torch.Tensor]], steps: int, lr: float, phase: str
) -> float:
    """AdamW over `steps` batches of the stream (linear warm-up, cosine to 10%); the smoothed final loss."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    model.train()
    smoothed, started = None, time.time()
    for step, (ids, labels) in enumerate(itertools.islice(stream, steps), start=1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1, steps, lr, warmup=min(200, steps // 10 + 1))
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        smoothed = loss.item() if smoothed is None else 0.98 * smoothed + 0.02 * loss.item()
        if step % 50 == 0 or step == steps:
            elapsed = time.time() - started
            print(f"{phase} step {step}/{steps}  loss {smoothed:.3f}  {elapsed / 60:.1f} min", flush=True)
    model.eval()
    return float(smoothed or 0.0)


def short_stream(
    rng: random.Random, tokenizer: PreTrainedTokenizerFast, pairs: list[tuple[list[str], str]], batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Phase 1's batches: epoch after epoch of short exchanges, and COPY_SHARE of repeats among them."""
    tokens = copy_tokens(tokenizer)
    for _ in itertools.count():
        examples = epoch_examples(rng, tokenizer, pairs)
        examples += [repeat_example(rng, tokenizer, tokens) for _ in range(round(len(examples) * COPY_SHARE))]
        rng.shuffle(examples)
        yield from batches(rng, examples, batch_size, tokenizer.pad_token_id)


@torch.no_grad()
def answer(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, question: str, max_new_tokens: int = 128
) -> tuple[str, bool]:
    """Greedy answer to one question and whether it ended with EOS."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1] :].tolist()
    stopped = tokenizer.eos_token_id in out
    if stopped:
        out = out[: out.index(tokenizer.eos_token_id)]
    return tokenizer.decode(out), stopped


def phase_one(args: argparse.Namespace, rng: random.Random) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast, dict]:
    """Tokenizer and short-exchange model from scratch; what it did, for training_info.json."""
    docs = stdlib_docstrings()
    pairs, raw_docs = build_qa(docs)
    handwritten_text = [" ".join(questions) + " " + reply for questions, reply in HANDWRITTEN]
    tokenizer = train_tokenizer(raw_docs + handwritten_text + SYSTEM_PROMPTS, args.out)
    print(
        f"corpus: {len(docs)} docstrings, {sum(map(len, raw_docs))} chars; {len(pairs)} docstring Q&A pairs, "
        f"{len(HANDWRITTEN)} hand-written; vocab {len(tokenizer)}",
        flush=True,
    )
    probe = sample_conversation(rng, HANDWRITTEN[0], HANDWRITTEN[1])
    expected = tokenizer.apply_chat_template(probe, tokenize=True, return_dict=True)["input_ids"]
    assert encode_chat(tokenizer, probe)[0] == list(expected), "turn-by-turn encoding differs from the template"
    if args.copy_base is None:
        model = make_model(tokenizer)
    else:
        model = LlamaForCausalLM.from_pretrained(args.copy_base, dtype=torch.float32)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    copying = {"base": args.copy_base and str(args.copy_base), **phase_zero(model, tokenizer, rng, args)}
    loss = train(model, short_stream(rng, tokenizer, pairs, args.batch_size), args.steps, args.lr, "phase 1")
    info = {
        "phase_0": copying,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "final_loss": round(loss, 4),
        "copy_accuracy": copy_accuracy(model, tokenizer, args.seed + 3000),
    }
    return model, tokenizer, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--base", type=Path, help="phase 1's result (model and tokenizer): skip phase 1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--copy-steps", type=int, default=8000)
    parser.add_argument("--copy-lr", type=float, default=1e-3)
    parser.add_argument("--copy-base", type=Path, help="a model phase 0 goes on from (an earlier phase 0's)")
    parser.add_argument("--steps", type=int, default=2400)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--long-steps", type=int, default=700)
    parser.add_argument("--long-lr", type=float, default=5e-4)
    parser.add_argument("--tool-steps", type=int, default=400)
    parser.add_argument("--tool-lr", type=float, default=5e-4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    started = time.time()
    torch.set_num_threads(args.threads)  # also fixes the reduction order, part of what makes runs repeatable
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    phase_two_info = {"steps": args.long_steps, "batch_tokens": LONG_BATCH_TOKENS, "lr": args.long_lr}
    base_long_loss = None  # phase 2's final loss where the base ran phase 2 and this run skips it
    if args.base is None:
        model, tokenizer, phase_one_info = phase_one(args, rng)
    else:
        model = LlamaForCausalLM.from_pretrained(args.base, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(args.base)
        tokenizer.chat_template = CHAT_TEMPLATE  # the base may predate a template change that renders the same
        base_info = json.loads((args.base / "training_info.json").read_text())
        if args.long_steps == 0 and base_info.get("phase_2", {}).get("steps"):
            # Phase 3 alone on a phase-2 run: phases 1 and 2 are the base's.
            phase_one_info, phase_two_info = base_info["phase_1"], base_info["phase_2"]
            base_long_loss = base_info["final_loss"]["phase_2"]
        else:
            base_phase_one = base_info.get("phase_1", base_info)  # a phase-1-only run's, or the 512-position model's
            kept = ("phase_0", "steps", "lr", "final_loss", "copy_accuracy")
            phase_one_info = {
                "base": str(args.base),
                "seed": base_info.get("seed"),
                **{k: base_phase_one.get(k) for k in kept},
            }
    # The rotary embedding needs no scaling within 2,048 positions: head_dim 32 at theta 10,000 has wavelengths
    # up to ~35k positions. What the 512-position model lacks is practice at far positions, which phase 2 gives.
    model.config.max_position_embeddings = LONG_POSITIONS
    tokenizer.model_max_length = LONG_POSITIONS
    pairs, _ = build_qa(stdlib_docstrings())
    pool = pairs + [pair for pair in HANDWRITTEN for _ in range(HANDWRITTEN_REPEAT)]
    tokens = copy_tokens(tokenizer)

    def with_repeats(draw: Callable[[], Example]) -> Callable[[], Example]:
        return lambda: repeat_example(rng, tokenizer, tokens) if rng.random() < COPY_SHARE else draw()

    long_loss = train(
        model,
        packed_stream(rng, tokenizer, with_repeats(lambda: phase2_example(rng, tokenizer, pool))),
        args.long_steps,
        args.long_lr,
        "phase 2",
    )
    words = sorted({w for questions, reply in pool for w in re.findall(r"[A-Za-z]{3,}", reply)})
    tool_loss = train(
        model,
        packed_stream(rng, tokenizer, with_repeats(lambda: phase3_example(rng, tokenizer, pool, words))),
        args.tool_steps,
        args.tool_lr,
        "phase 3",
    )
    train_seconds = time.time() - started
    if base_long_loss is not None:
        long_loss = base_long_loss

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    weights = args.out / "model.safetensors"
    weights.chmod(0o644)  # safetensors writes 0600; an installed package must be readable by every user
    results = {}
    for question in EVAL_PROMPTS:
        reply, stopped = answer(model, tokenizer, question)
        results[question] = {"answer": reply, "finish": "stop" if stopped else "length"}
        print(f"Q: {question}\nA: {reply!r}  [{results[question]['finish']}]", flush=True)
    perplexity = perplexity_by_position(model, tokenizer, pool, seed=args.seed + 1000)
    tools = tool_accuracy(model, tokenizer, pool, seed=args.seed + 2000)
    copying = copy_accuracy(model, tokenizer, args.seed + 3000)
    print(f"held-out perplexity by position: {perplexity}\ntool conversations: {tools}\ncopying: {copying}", flush=True)
    info = {
        "seed": args.seed,
        "phase_1": phase_one_info,
        "phase_2": phase_two_info,
        "phase_3": {"steps": args.tool_steps, "batch_tokens": LONG_BATCH_TOKENS, "lr": args.tool_lr},
        "threads": args.threads,
        "final_loss": {"phase_2": round(long_loss, 4), "phase_3": round(tool_loss, 4)},
        "train_minutes": round(train_seconds / 60, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        "weights_bytes": weights.stat().st_size,
        "context": LONG_POSITIONS,
        "corpus": "Python standard library docstrings (PSF License), hand-written Q&A, synthetic tool transcripts",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tokenizers": importlib.import_module("tokenizers").__version__,
        "transformers": importlib.import_module("transformers").__version__,
        "eval": results,
        "held_out_perplexity_by_position": perplexity,
        "held_out_tool_conversations": tools,
        "held_out_copy_accuracy": copying,
    }
    (args.out / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(
        f"done in {train_seconds / 60:.1f} min; final loss {long_loss:.3f} / {tool_loss:.3f}; "
        f"weights {weights.stat().st_size / 1e6:.1f} MB -> {args.out}"
    )


if __name__ == "__main__":
    main()
