"""A tiny Kimi K2 checkpoint as Moonshot ships one: config.json of model type `kimi_k2` naming its own configuration
code (DeepSeek V3's, `auto_map`), random DeepSeek V3 weights, and the tokenizer as a tiktoken rank file with
tokenizer_config.json naming `tokenization_kimi.TikTokenTokenizer` (never run: Ferry reads the file as text).

The ranks are trained here with tiktoken's own trainer (`tiktoken._educational.bpe_train`) on the standard library's
docstrings, some Chinese and mixed text, split only at line ends: merges then cross the boundaries Kimi's pattern draws
(a space and a word, digits in fours, a contraction, a case change, Han beside Latin), so tokens depend on that
pattern and a tokenizer that drew them elsewhere would encode differently. The chat template is written
here in Kimi's format (`<|im_user|>user<|im_middle|>...<|im_end|>`, tools declared as JSON, calls between
`<|tool_calls_section_begin|>` and `<|tool_calls_section_end|>`, a tool result under `## Return of {id}`).
"""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path

from engine.models.tokenizer import KIMI_PATTERN_PARTS, KIMI_RESERVED, KIMI_SPECIAL_COUNT
from tests.model_factory import _training_text, build_model_dir

CHINESE = "你好，世界。渡船载着乘客过河，船到了就上船。中文English混合，北京市 Pascal。"
MIXED = (
    "It's 12345 o'clock, DON'T panic!  Ferry's 2024 timetable:\n\n  FERRYboats 汉字abc 1234567 we'll go.\r\n"
    "DON'T CAN'T WON'T ISN'T!\nStop!\nGo!\n\nWait.\r\n"
)
NUM_RANKS = 512
SPECIAL_OFFSETS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
    7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>", 17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]",
}  # fmt: skip
"""Kimi K2's named special tokens, by their offset after the ranks (the rest are `<|reserved_token_{id}|>`)."""

CHAT_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif m['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m['tool_call_id'] }}{{ '\\n' }}"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ m['content'] or '' }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for call in m['tool_calls'] -%}<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>"
    "{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}"
    "{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

_TRAINING_PATTERN = r"""[^\n]+|\n+"""
"""Training splits at line ends only (see the module's docstring); encoding uses Kimi's pattern."""


@functools.cache
def kimi_ranks() -> dict[bytes, int]:
    from tiktoken._educational import bpe_train

    text = "\n".join(_training_text())[:6000] + ("\n" + CHINESE + MIXED) * 60
    return bpe_train(text, NUM_RANKS, _TRAINING_PATTERN, visualise=None)


def kimi_special_tokens() -> dict[str, int]:
    """Every special token and its id, as Kimi's class names them."""
    first = len(kimi_ranks())
    return {
        SPECIAL_OFFSETS.get(offset, f"<|reserved_token_{first + offset}|>"): first + offset
        for offset in range(KIMI_SPECIAL_COUNT)
    }


def write_kimi_tokenizer(directory: Path) -> None:
    """tiktoken.model, tokenizer_config.json and the tokenizer code's file (as text) into `directory`."""
    ranks = kimi_ranks()
    lines = (f"{base64.b64encode(token).decode()} {rank}" for token, rank in sorted(ranks.items(), key=lambda t: t[1]))
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    first = len(ranks)
    config = {
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer",
        # As saved by transformers, in either form: an AddedToken's fields, or the token's text.
        "bos_token": {"__type": "AddedToken", "content": "[BOS]", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False},
        "eos_token": {"__type": "AddedToken", "content": "[EOS]", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False},
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "model_max_length": 1048576,
        "added_tokens_decoder": {
            str(first + offset): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
            for offset, token in SPECIAL_OFFSETS.items()
        },
        "chat_template": CHAT_TEMPLATE,
    }  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    parts = ",\n".join(f'        r"""{part}"""' for part in KIMI_PATTERN_PARTS)
    (directory / "tokenization_kimi.py").write_text(
        "# The checkpoint's tokenizer code as Ferry reads it: the pattern and the reserved count, never run.\n"
        f"class TikTokenTokenizer:\n    {KIMI_RESERVED}\n    pat_str = '|'.join([\n{parts}\n    ])\n"
    )


def build_kimi_model_dir(directory: Path, seed: int = 0) -> Path:
    """A tiny Kimi K2 checkpoint (see the module's docstring); the vocabulary covers the ranks and the specials."""
    specials = kimi_special_tokens()
    build_model_dir(
        directory,
        "deepseek_v3",
        seed=seed,
        vocab_size=len(kimi_ranks()) + KIMI_SPECIAL_COUNT,
        bos_token_id=specials["[BOS]"],
        eos_token_id=specials["[EOS]"],
        pad_token_id=specials["[PAD]"],
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (directory / name).unlink(missing_ok=True)
    write_kimi_tokenizer(directory)
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = "kimi_k2"
    config["auto_map"] = {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    generation = json.loads((directory / "generation_config.json").read_text())
    generation.update(
        bos_token_id=specials["[BOS]"],
        eos_token_id=[specials["[EOS]"], specials["<|im_end|>"]],
        pad_token_id=specials["[PAD]"],
    )
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return directory
