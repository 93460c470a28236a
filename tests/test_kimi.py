"""Kimi K2 as Moonshot ships it (tests/kimi_model.py): a `kimi_k2` config naming its own code, read as DeepSeek V3's;
a tiktoken tokenizer of its own code, built without running it; Kimi's tool-call format through the server.

The oracles: tiktoken itself on the same ranks and Kimi's pattern (what Kimi's class encodes with), and transformers'
DeepSeek V3 `generate` on the same weights. What is neither transformers' nor Kimi's is refused by name.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import tiktoken
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from engine import EngineConfig, EngineCore, FinishReason, SamplingParams, StructuredOutput, generate_batch
from engine.models.config_record import load_config
from engine.models.support import UnsupportedModelError
from engine.models.tokenizer import KIMI_PATTERN_PARTS, UnsupportedTokenizer, auto_tokenizer
from tests.kimi_model import (
    CHAT_TEMPLATE,
    CHINESE,
    MIXED,
    NUM_RANKS,
    SPECIAL_OFFSETS,
    build_kimi_model_dir,
    kimi_ranks,
    kimi_special_tokens,
)
from tests.model_factory import build_model_dir, build_scripted_model_dir
from tests.server_harness import ServerProcess, server_process
from tests.test_engine_equivalence import generate_alone
from tests.test_server_startup import serve_until_exit

MODEL = "kimi-k2-tiny"
CITY = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY}}
]


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_kimi_model_dir(tmp_path_factory.mktemp("kimi-k2"))


@pytest.fixture(scope="module")
def encoding() -> tiktoken.Encoding:
    """What Kimi's own class encodes with: tiktoken over the ranks, its pattern and its special tokens."""
    return tiktoken.Encoding(
        "kimi", pat_str="|".join(KIMI_PATTERN_PARTS), mergeable_ranks=kimi_ranks(), special_tokens=kimi_special_tokens()
    )


_TEXT = st.text(
    st.sampled_from([*"aBcDeZ's'T'LL09 \n\r\t.,!?-_\"()", *CHINESE, "é", "ß", "🙂", "\u0301"]),
    max_size=60,
)
_SPECIALS = st.sampled_from([*SPECIAL_OFFSETS.values(), f"<|reserved_token_{NUM_RANKS + 5}|>"])
_CORPUS = MIXED + CHINESE
_SLICES = st.tuples(st.integers(0, len(_CORPUS)), st.integers(1, 40)).map(lambda at: _CORPUS[at[0] : sum(at)])
"""Pieces of the text the ranks were trained on, where merges across the pattern's boundaries apply."""


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(st.one_of(_TEXT, _SPECIALS, _SLICES), max_size=8))
@example(pieces=[MIXED, CHINESE, "<|im_end|>", MIXED])
def test_the_tokenizer_encodes_and_decodes_as_tiktoken_does(
    kimi_dir: Path, encoding: tiktoken.Encoding, pieces: list[str]
) -> None:
    tokenizer = auto_tokenizer(str(kimi_dir))
    text = "".join(pieces)
    ids = encoding.encode(text, allowed_special="all")
    assert tokenizer.encode(text, add_special_tokens=False) == ids
    assert tokenizer.decode(ids) == encoding.decode(ids) == text


def test_ids_and_named_tokens_are_kimis(kimi_dir: Path) -> None:
    tokenizer = auto_tokenizer(str(kimi_dir))
    specials = kimi_special_tokens()
    assert len(tokenizer) == len(kimi_ranks()) + len(specials)
    assert {token: tokenizer.convert_tokens_to_ids(token) for token in specials} == specials
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("[BOS]", "[EOS]", "[PAD]")
    # A Han run is a pre-token of its own: "中文English混合" splits before and after "English".
    assert [tokenizer.decode([i]) for i in tokenizer.encode("中文English", add_special_tokens=False)][-1:] != ["文E"]


def test_tools_render_with_sorted_keys_as_kimis_class_renders_them(kimi_dir: Path) -> None:
    tokenizer = auto_tokenizer(str(kimi_dir))
    tools = [{"type": "function", "function": {"parameters": {"type": "object", "properties": {"b": {}, "a": {}}},
                                               "name": "f"}}]  # fmt: skip
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, tokenize=False)
    # The server reads which names rendering takes from the signature: the base class's, not (conversation, tools).
    assert {"add_generation_prompt", "tokenize"} <= set(inspect.signature(tokenizer.apply_chat_template).parameters)
    declared = prompt.split("<|im_middle|>", 1)[1].split("<|im_end|>", 1)[0]
    assert declared == json.dumps(
        [{"function": {"name": "f", "parameters": {"properties": {"a": {}, "b": {}}, "type": "object"}},
          "type": "function"}]
    )  # fmt: skip


@pytest.mark.parametrize("setup", ["mixed", "chunked"])
def test_greedy_equals_deepseek_v3_generate(kimi_dir: Path, setup: str) -> None:
    assert load_config(str(kimi_dir)).model_type == "deepseek_v3"
    values = json.loads((kimi_dir / "config.json").read_text())
    config = DeepseekV3Config.from_dict({k: v for k, v in values.items() if k not in ("model_type", "auto_map")})
    hf = DeepseekV3ForCausalLM.from_pretrained(kimi_dir, config=config, dtype=torch.float32)
    tokenizer = auto_tokenizer(str(kimi_dir))
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False),
            add_special_tokens=False,
        )
        for text in ("Hello!", CHINESE, "Ferries float. " * 6)
    ]
    max_new = [12, 9, 14]
    expected, expected_logprobs = generate_alone(hf, prompts, max_new)
    batch_tokens = {"mixed": 96, "chunked": 16}[setup]
    engine = EngineCore(
        EngineConfig.of(model=str(kimi_dir), max_batch_tokens=batch_tokens, page_size=16, num_pages=128)
    )
    params = [SamplingParams(max_new_tokens=n, logprobs=True, ignore_eos=True) for n in max_new]
    results = generate_batch(prompts, params=params, engine=engine)
    for i, (tokens, logprobs) in enumerate(zip(expected, expected_logprobs, strict=True)):
        assert results[f"req_{i}"].generated_ids == tokens
        assert [t.logprob for t in results[f"req_{i}"].logprobs] == pytest.approx(logprobs, abs=1e-4)


def test_a_grammar_its_library_cannot_follow_ends_the_request_with_an_error(kimi_dir: Path) -> None:
    """llguidance allows a special token where a literal of the grammar spells its text, then refuses it: the
    request ends with ABORT and that error, never as an answer cut short that looks whole."""
    engine = EngineCore(EngineConfig.of(model=str(kimi_dir), num_pages=64))
    regex = re.escape("Checking.<|tool_calls_section_begin|>done")
    constrained = SamplingParams(max_new_tokens=40, structured_output=StructuredOutput("regex", regex))
    results = generate_batch(
        [[5, 6, 7], [5, 6, 7]], params=[constrained, SamplingParams(max_new_tokens=4)], engine=engine
    )
    failed, other = results["req_0"], results["req_1"]
    assert failed.finish_reason is FinishReason.ABORT and "grammar could not be followed" in (failed.error or "")
    assert other.finish_reason is not FinishReason.ABORT and len(other.generated_ids) == 4


def test_own_code_that_is_not_kimis_is_refused_by_name(tmp_path: Path) -> None:
    directory = build_model_dir(tmp_path / "own", "llama")
    config = json.loads((directory / "config.json").read_text())
    # Code of its own for a model type transformers knows is read through transformers' class, as transformers does.
    config.update(auto_map={"AutoConfig": "configuration_llama.LlamaConfig"})
    (directory / "config.json").write_text(json.dumps(config))
    results = generate_batch([[5, 6, 7]], params=[SamplingParams(max_new_tokens=2)], engine=EngineCore(
        EngineConfig.of(model=str(directory), num_pages=16)))  # fmt: skip
    assert len(results["req_0"].generated_ids) == 2
    config.update(model_type="my_llama", auto_map={"AutoConfig": "configuration_my.MyConfig"})
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"'my_llama'.*configuration_my\.MyConfig.*runs no checkpoint code"):
        EngineCore(EngineConfig.of(model=str(directory)))
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config.update(auto_map={"AutoTokenizer": ["tokenization_my.MyTokenizer", None]},
                            tokenizer_class="MyTokenizer")  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (directory / "tokenizer.json").unlink()
    with pytest.raises(UnsupportedTokenizer, match=r"tokenization_my\.MyTokenizer.*does not run"):
        auto_tokenizer(str(directory))
    served = serve_until_exit("--model", str(directory))
    assert served.returncode != 0 and "Traceback" not in served.stderr, served.stderr[-3000:]
    assert "configuration_my.MyConfig" in served.stderr and "tokenization_my.MyTokenizer" in served.stderr


def test_kimi_code_is_read_by_its_pattern_whatever_its_module_name(tmp_path: Path, kimi_dir: Path) -> None:
    directory = tmp_path / "kimi"
    directory.mkdir()
    for name in ("tiktoken.model", "tokenizer_config.json"):
        (directory / name).write_bytes((kimi_dir / name).read_bytes())
    with pytest.raises(UnsupportedTokenizer, match=r"tokenization_kimi\.py is not in the directory"):
        auto_tokenizer(str(directory))
    code = (kimi_dir / "tokenization_kimi.py").read_text()
    (directory / "tokenization_kimi.py").write_text(code)
    (directory / "tiktoken.model").rename(directory / "ranks.moved")
    with pytest.raises(UnsupportedTokenizer, match=r"tiktoken\.model, the ranks .* is missing"):
        auto_tokenizer(str(directory))
    (directory / "ranks.moved").rename(directory / "tiktoken.model")
    (directory / "tokenization_kimi.py").write_text(code.replace(r"\p{N}{1,3}", r"\p{N}{1,4}"))
    with pytest.raises(UnsupportedTokenizer, match="does not hold the pattern"):
        auto_tokenizer(str(directory))
    # Moonshot's other checkpoints name their module otherwise (Moonlight's tokenization_moonshot.py): the same code
    # under another name is read alike.
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_moonshot.TikTokenTokenizer", None]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "tokenization_moonshot.py").write_text(code)
    text = CHINESE + MIXED
    assert auto_tokenizer(str(directory)).encode(text) == auto_tokenizer(str(kimi_dir)).encode(text)


# ---------------------------------------------------------------------------------------------------- served


@pytest.fixture(scope="module")
def server(kimi_dir: Path) -> Iterator[ServerProcess]:
    with server_process(kimi_dir, "--served-model-name", MODEL, "--log-level", "warning") as running:
        yield running


def test_served_prompts_are_kimis_tokens(server: ServerProcess, encoding: tiktoken.Encoding) -> None:
    messages = [{"role": "user", "content": CHINESE}]
    reply = httpx.post(f"{server.base_url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=60)
    assert reply.status_code == 200, reply.text
    rendered = f"<|im_user|>user<|im_middle|>{CHINESE}<|im_end|><|im_assistant|>assistant<|im_middle|>"
    assert reply.json()["tokens"] == encoding.encode(rendered, allowed_special="all")


KIMI_CALL_SCRIPT = {
    "[weather?]": ["Checking.", "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.get_weather:0",
                   "<|tool_call_argument_begin|>", '{"city": "Oslo"}', "<|tool_call_end|>",
                   "<|tool_calls_section_end|>"],
    "[sunny]": ["It is sunny."],
}  # fmt: skip
"""What the scripted model writes after a prompt ending in each trigger: a call in Kimi's format, then an answer."""
SCRIPTED_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}", ""
).replace("{%- endif -%}<|im_end|>{%- endfor -%}", "{%- endif -%}{%- endfor -%}")
"""Kimi's format, each message's end and the generation prompt left out so that a prompt ends in its last message's
trigger (the scripted model picks its script by the last token)."""


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = build_scripted_model_dir(tmp_path_factory.mktemp("kimi-calls"), KIMI_CALL_SCRIPT, SCRIPTED_TEMPLATE)
    with server_process(directory, "--served-model-name", MODEL, "--log-level", "warning") as running:
        yield running


def test_calls_in_kimis_format_come_back_with_the_models_ids(scripted_server: ServerProcess) -> None:
    """Kimi's call format, read by the parser the chat template selects: the model's call id comes back, and goes
    back into the conversation as the template writes it."""
    sdk = openai.OpenAI(base_url=f"{scripted_server.base_url}/v1", api_key="none", max_retries=0)
    user = [{"role": "user", "content": "Weather in Oslo? [weather?]"}]
    reply = sdk.chat.completions.create(model=MODEL, messages=user, tools=TOOLS, max_tokens=40)  # type: ignore[arg-type]
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (made,) = choice.message.tool_calls or []
    assert (made.id, made.function.name, json.loads(made.function.arguments)) == (
        "functions.get_weather:0", "get_weather", {"city": "Oslo"}
    )  # fmt: skip
    stream = sdk.chat.completions.create(model=MODEL, messages=user, tools=TOOLS, max_tokens=40, stream=True)  # type: ignore[arg-type]
    deltas = [delta for chunk in stream if chunk.choices for delta in chunk.choices[0].delta.tool_calls or []]
    assert deltas[0].id == "functions.get_weather:0" and deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Oslo"}
    conversation = [*user, choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": made.id, "content": "sunny [sunny]"}]  # fmt: skip
    answer = sdk.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS, max_tokens=40)  # type: ignore[arg-type]
    assert answer.choices[0].message.content == "It is sunny." and not answer.choices[0].message.tool_calls
    rendered = httpx.post(f"{scripted_server.base_url}/tokenize", json={"model": MODEL, "messages": conversation},
                          timeout=60).json()["tokens"]  # fmt: skip
    text = httpx.post(f"{scripted_server.base_url}/detokenize", json={"model": MODEL, "tokens": rendered},
                      timeout=60).json()["prompt"]  # fmt: skip
    assert "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>" in text
    assert "## Return of functions.get_weather:0\nsunny [sunny]" in text
