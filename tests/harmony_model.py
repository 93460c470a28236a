"""A tiny gpt-oss that writes Harmony: the real architecture (transformers' GptOss, o200k_harmony's 201,088 ids),
trained here, in seconds, to answer two scripted turns of a tool loop exactly, then saved and loaded back through
the real loading path, with a Hugging Face tokenizer converted from the o200k vocabulary by transformers' own
`TikTokenConverter`.

The turns (`TRANSCRIPTS`): asked for the weather in Paris with `get_weather` offered, it reasons, then calls the
tool; given the call's result, it reasons, then answers. Each is keyed by its prompt as Ferry's Harmony rendering
writes it (server/openai/harmony.py), so a request that renders to another prompt gets no scripted reply.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

from server.openai.harmony import VOCABULARY, VOCABULARY_ENV, Harmony, load_encoding
from server.openai.tools import FunctionTool

WEATHER = FunctionTool(
    "get_weather",
    "The weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
QUESTION = "What is the weather in Paris?"
ARGUMENTS = '{"city": "Paris"}'
RESULT = '{"sky": "sunny"}'
REASONING = ["Need the weather.", "It is sunny."]
ANSWER = "Sunny in Paris."


def conversation(call_id: str = "call_0") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The two turns' messages as `template_messages` gives them: the question; then it, the call and its result."""
    first = [{"role": "user", "content": QUESTION}]
    call = {"id": call_id, "type": "function", "function": {"name": WEATHER.name, "arguments": {"city": "Paris"}}}
    second = [
        *first,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": RESULT, "tool_call_id": call_id, "name": WEATHER.name},
    ]
    return first, second


COMPLETIONS = [
    f"<|channel|>analysis<|message|>{REASONING[0]}<|end|><|start|>assistant to=functions.get_weather"
    f"<|channel|>commentary <|constrain|>json<|message|>{ARGUMENTS}<|call|>",
    f"<|channel|>analysis<|message|>{REASONING[1]}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"
    "<|return|>",
]
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
VOCAB_SIZE = 201088
FIRST_SPECIAL = 199998
"""o200k_base's 199,998 byte-pair tokens come first, then `<|startoftext|>`, `<|endoftext|>` and Harmony's."""


def build_harmony_model_dir(directory: Path, steps: int = 120) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    encoding = load_encoding(directory / "tiktoken")
    harmony = Harmony(encoding)
    specials = [encoding.decode([i]) for i in range(FIRST_SPECIAL, VOCAB_SIZE)]
    vocabulary = Path(os.environ[VOCABULARY_ENV]) / VOCABULARY.name.removesuffix(".gz")
    converted = TikTokenConverter(str(vocabulary), pattern=O200K_PATTERN, extra_special_tokens=specials).converted()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=converted, bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>"
    )
    assert tokenizer.convert_tokens_to_ids("<|call|>") == encoding.encode("<|call|>", allowed_special="all")[0]
    tokenizer.save_pretrained(directory)

    first, second = conversation()
    prompts = [harmony.render(messages, [WEATHER], None, "messages") for messages in (first, second)]
    completions = [encoding.encode(text, allowed_special="all") for text in COMPLETIONS]
    stops = list(harmony.stop_token_ids)
    config = AutoConfig.for_model(
        "gpt_oss",
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=stops,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _memorize(model, prompts, completions, steps)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(directory)
    return directory


def _memorize(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], steps: int) -> None:
    """Train until greedy decoding of each prompt writes its completion. The embedding stays as initialised and the
    head reads only the completions' positions: the 201k-row matrices would otherwise cost most of each step."""
    rows = [prompt + completion for prompt, completion in zip(prompts, completions, strict=True)]
    length = max(map(len, rows))
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    # Position p predicts token p + 1: the positions from each prompt's last token to the completion's second last.
    where = [(i, p) for i, prompt in enumerate(prompts) for p in range(len(prompt) - 1, len(rows[i]) - 1)]
    batch, position = torch.tensor(where).T
    targets = ids[batch, position + 1]
    model.get_input_embeddings().weight.requires_grad_(False)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(steps):
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = model.lm_head(hidden[batch, position])
        loss = torch.nn.functional.cross_entropy(logits, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if logits.argmax(-1).eq(targets).all() and loss.item() < 0.05:
            break
    model.eval()
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions, strict=True):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=len(completion) + 2, do_sample=False)
            assert out[0, len(prompt) :].tolist() == completion, "the tiny gpt-oss did not learn its script"
