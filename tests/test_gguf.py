"""GGUF files (engine/models/gguf.py), made by llama.cpp's own converter and llama-quantize
(scripts/make_gguf_fixtures.py, committed under tests/fixtures/gguf/): Ferry's greedy tokens and logprobs against
transformers loading the same file (it dequantizes every type there), the tokenizer and chat template from the
file, the Q/K row order the converter changes put back, refusals by name, `ferry serve --model file.gguf` through
the OpenAI SDK, and, where llama.cpp is installed, greedy tokens equal to llama-server's on the same file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import gguf
import httpx
import numpy as np
import openai
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.config import EngineConfig
from engine.kernels import quant_linear
from engine.layers.linear import LinearBase
from engine.models.gguf import GGUFError, _unpermute, checkpoint_name, materialize, source_file
from engine.quantization.gguf import (
    GGUFQ4_0Method,
    GGUFQ8_0Method,
    q4_0_blocks,
    q8_0_blocks,
    quantize_q4_0,
    quantize_q8_0,
)
from server.model_source import ModelSourceError, resolve
from tests.server_harness import REPO_ROOT, free_port, server_process

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"
FILES = sorted(path.name for path in FIXTURES.glob("*.gguf"))
PROMPTS = [[1, 45, 74, 81, 365, 308], [1, 20, 30, 40], [1, 7, 200, 100, 50, 25, 12, 300]]
LLAMA_CPP = Path(os.environ.get("FERRY_LLAMA_CPP", "/tmp/llama-cpp"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ferry-cache")


def _ferry(model_dir: Path, max_new_tokens: int = 8) -> list[tuple[list[int], list[float]]]:
    from engine.api import generate_batch
    from engine.core.engine_core import EngineCore
    from engine.core.request import SamplingParams

    engine = EngineCore(EngineConfig.of(model=str(model_dir), dtype="float32", num_pages=64))
    params = SamplingParams(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, logprobs=True)
    results = generate_batch(PROMPTS, params=params, engine=engine)
    outputs = [results[f"req_{i}"] for i in range(len(PROMPTS))]
    return [(list(out.generated_ids), [entry.logprob for entry in out.logprobs or []]) for out in outputs]


def test_fixtures_are_there() -> None:
    assert len(FILES) == 8, FILES


def test_tensor_names_follow_transformers() -> None:
    assert checkpoint_name("token_embd.weight") == "model.embed_tokens.weight"
    assert checkpoint_name("output.weight") == "lm_head.weight"
    assert checkpoint_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert checkpoint_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert checkpoint_name("blk.1.ffn_down.weight") == "model.layers.1.mlp.down_proj.weight"
    assert checkpoint_name("rope_freqs.weight") is None


@given(heads=st.integers(1, 4), half=st.integers(1, 4), columns=st.integers(1, 5))
def test_the_converters_row_order_is_undone(heads: int, half: int, columns: int) -> None:
    """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute) interleaves each head's two halves."""
    weight = torch.arange(heads * 2 * half * columns, dtype=torch.float32).reshape(heads * 2 * half, columns)
    converted = weight.reshape(heads, 2, half, columns).swapaxes(1, 2).reshape(weight.shape)
    assert torch.equal(_unpermute(converted, heads), weight)


@pytest.mark.parametrize("name", FILES)
def test_greedy_tokens_and_logprobs_equal_transformers_on_the_same_file(name: str, cache: Path) -> None:
    model_dir = materialize(FIXTURES / name, cache)
    assert source_file(str(model_dir)) == (FIXTURES / name).resolve()
    # transformers reads the tensors and dequantizes them its own way; the config is the directory's (transformers'
    # own GGUF config reader leaves a Qwen3 head_dim at its default, which the directory corrects).
    config = AutoConfig.from_pretrained(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(FIXTURES, gguf_file=name, config=config, dtype=torch.float32)
    for prompt, (tokens, logprobs) in zip(PROMPTS, _ferry(model_dir), strict=True):
        with torch.no_grad():
            logits = reference.eval()(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, dim=-1)
        assert tokens == expected.argmax(-1).tolist(), name
        chosen = expected.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs), chosen, atol=2e-4, rtol=0)


def test_the_directory_carries_the_files_tokenizer_and_chat_template(cache: Path) -> None:
    model_dir = materialize(FIXTURES / "qwen3-f16.gguf", cache)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    ours = AutoTokenizer.from_pretrained(model_dir)
    theirs = AutoTokenizer.from_pretrained(FIXTURES, gguf_file="qwen3-f16.gguf")
    text = "héllo wörld, ferry boats carry passengers 🙂"
    assert ours.encode(text) == theirs.encode(text) and ours.decode(ours.encode(text)) == text
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == "<|bos|><|user|>hi<|eos|>"
    assert materialize(FIXTURES / "qwen3-f16.gguf", cache) == model_dir, "made once"


def test_a_bfloat16_file_loads_in_bfloat16(cache: Path) -> None:
    assert json.loads((materialize(FIXTURES / "llama-bf16.gguf", cache) / "config.json").read_text())["dtype"] == (
        "bfloat16"
    )


def test_quantized_types_are_named_as_they_are_dequantized(cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        materialize(FIXTURES / "llama-wide-q4_k_m.gguf", cache)
    assert "Q4_K (5 tensors), Q6_K (3 tensors) dequantized" in caplog.text


def _write_gguf(path: Path, architecture: str) -> Path:
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_what_ferry_cannot_serve_is_refused_by_name(cache: Path, tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match=r"architecture 'gemma3'.*llama, qwen2, qwen3"):
        materialize(_write_gguf(tmp_path / "other.gguf", "gemma3"), cache)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelSourceError, match=r"garbage\.gguf: not a GGUF file"):
        resolve(str(garbage), flag="--model", revision=None, download_dir=str(cache), offline=True, weights=True)
    with pytest.raises(ModelSourceError, match="revision applies to Hub ids only"):
        resolve(str(FIXTURES / FILES[0]), flag="--model", revision="v1", download_dir=None, offline=True, weights=True)


def _without_tokenizer(source: Path, target: Path) -> Path:
    """`source` written again without its `tokenizer.*` metadata (as gguf's own gguf_new_metadata.py copies)."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, arch=reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "tokenizer.", "general.architecture")):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor_info(
            tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data)
    writer.close()
    return target


def test_a_file_without_a_tokenizer_serves_with_another(
    cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stripped = _without_tokenizer(FIXTURES / "llama-f16.gguf", tmp_path / "bare.gguf")
    with caplog.at_level("WARNING"):
        model_dir = materialize(stripped, cache)
    assert "its tokenizer could not be read" in caplog.text and not (model_dir / "tokenizer.json").exists()
    tokenizer_dir = materialize(FIXTURES / "llama-f16.gguf", cache)
    assert _ferry(model_dir) == _ferry(tokenizer_dir)  # the same weights: the tokenizer was all it lacked
    env = {"FERRY_CACHE_DIR": str(tmp_path / "serve-cache")}
    refused = subprocess.run(
        [sys.executable, "-m", "ferry", "serve", "--model", str(stripped)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert refused.returncode == 2 and "its tokenizer could not be read; pass --tokenizer" in refused.stderr
    with server_process(None, "--model", str(stripped), "--tokenizer", str(tokenizer_dir), env=env) as s:
        client = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="none", max_retries=0)
        answer = client.completions.create(model="bare.gguf", prompt="hello", max_tokens=3, temperature=0)
        assert answer.usage is not None and answer.usage.completion_tokens == 3


def test_a_changed_file_is_read_again(cache: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.gguf"
    shutil.copy(FIXTURES / "llama-q8_0.gguf", copy)
    first = materialize(copy, cache)
    os.utime(copy, ns=(time.time_ns(), time.time_ns() + 10**9))
    with pytest.raises(GGUFError, match="changed since"):
        source_file(str(first))
    assert materialize(copy, cache) != first


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_blocks_are_read_back_from_their_dequantized_weights(kind: str) -> None:
    """The blocks llama.cpp's quantizers make (the gguf package's ports of them), dequantized as the loader does,
    come back as the grouped kernels' codes, float16 scales and minimums: the file's weights exactly; and where
    weights are not on such a grid, quantizing them as llama.cpp does gives its blocks."""
    weights = np.random.default_rng(0).normal(size=(48, 256)).astype(np.float32)
    ggml_type = gguf.GGMLQuantizationType[kind]
    dequantized = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(weights, ggml_type), ggml_type))
    dequantized = dequantized.reshape(48, 256)
    read_back, requantize = (q4_0_blocks, quantize_q4_0) if kind == "Q4_0" else (q8_0_blocks, quantize_q8_0)
    blocks = read_back(dequantized)
    assert blocks is not None
    pack = quant_linear.pack_int4 if kind == "Q4_0" else quant_linear.pack_int8_groups
    dequantize = quant_linear.dequantize_int4 if kind == "Q4_0" else quant_linear.dequantize_int8_groups
    assert torch.equal(dequantize(pack(*blocks, torch.float16), 48, 256), dequantized)
    assert read_back(torch.from_numpy(weights)) is None, "weights not on the grid are not taken for blocks"
    again = dequantize(pack(*requantize(torch.from_numpy(weights)), torch.float16), 48, 256)
    assert torch.equal(again, dequantized)


@pytest.mark.parametrize(("name", "method"), [("llama-q4_0.gguf", GGUFQ4_0Method), ("qwen2-q8_0.gguf", GGUFQ8_0Method)])
def test_kept_types_run_on_the_files_own_codes(name: str, method: type, cache: Path) -> None:
    """Q4_0 and Q8_0 linears on the int4 and grouped int8 kernels, the Q8_0 head too (a tied one: the embedding
    reads its rows back from it): the same weights as transformers dequantizing the file."""
    from engine.models.loader import load_model

    model = load_model(EngineConfig.of(model=str(materialize(FIXTURES / name, cache)), dtype="float32")).model
    methods = {type(m.method) for m in model.modules() if isinstance(m, LinearBase)}
    assert methods == {method, GGUFQ8_0Method}
    assert type(model.lm_head.method) is GGUFQ8_0Method


def test_two_ranks_compute_what_one_does(cache: Path) -> None:
    """Tensor parallelism shards a GGUF file's dequantized weights as any checkpoint's (Q/K rows unpermuted first)."""
    from engine.api import generate_batch
    from engine.core.engine_core import EngineCore
    from engine.core.request import SamplingParams

    model_dir = str(materialize(FIXTURES / "llama-q4_0.gguf", cache))
    params = SamplingParams(max_new_tokens=6, min_new_tokens=6)
    outputs = []
    for ranks in (1, 2):
        engine = EngineCore(EngineConfig.of(model=model_dir, num_pages=64, cpu_threads=1, tensor_parallel_size=ranks))
        try:
            results = generate_batch(PROMPTS, params=params, engine=engine)
        finally:
            engine.close()
        outputs.append([results[f"req_{i}"].generated_ids for i in range(len(PROMPTS))])
    assert outputs[0] == outputs[1]


def test_ferry_serve_takes_a_gguf_file(tmp_path: Path) -> None:
    """A Q4_0 file served at its defaults: its linears run as int4 on the file's own codes, its Q8_0 head as int8 in
    groups (its card says so; its Q4_0 embedding is looked up dequantized)."""
    name = "llama-q4_0.gguf"
    with server_process(None, "--model", str(FIXTURES / name), env={"FERRY_CACHE_DIR": str(tmp_path)}) as s:
        client = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="none", max_retries=0)
        (model,) = client.models.list().data
        assert model.id == name
        card = httpx.get(f"{s.base_url}/v1/models").json()["data"][0]
        types = Counter(tensor.tensor_type.name for tensor in gguf.GGUFReader(FIXTURES / name).tensors)
        assert card["quantization"] == "int4"
        assert card["gguf"] == {
            "file": name,
            "tensor_types": dict(types),
            "dequantized": ["Q4_0"],
            "kept": ["Q4_0", "Q8_0"],
        }
        assert card["checkpoint_quantization"]["format"] == "gguf"
        chat = client.chat.completions.create(
            model=model.id, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
        )
        rendered = AutoTokenizer.from_pretrained(FIXTURES, gguf_file=name).apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True
        )
        assert chat.usage is not None and chat.usage.prompt_tokens == len(rendered["input_ids"])
        completion = client.completions.create(
            model=model.id, prompt=rendered["input_ids"], max_tokens=4, temperature=0
        )
        assert chat.choices[0].message.content == completion.choices[0].text


@pytest.mark.skipif(
    not (LLAMA_CPP / "bin" / "llama-server").is_file(),
    reason="llama.cpp is not installed ($FERRY_LLAMA_CPP, ../shared/peers/install-llama-cpp.sh)",
)
@pytest.mark.parametrize("name", ["llama-f16.gguf", "qwen3-f16.gguf", "llama-bf16.gguf"])
def test_greedy_tokens_equal_llama_server_on_the_same_file(name: str, cache: Path) -> None:
    port = free_port()
    command = [str(LLAMA_CPP / "bin" / "llama-server"), "-m", str(FIXTURES / name), "--port", str(port), "-t", "2"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "llama-server did not start"
            time.sleep(0.2)
        text = "héllo wörld, ferry boats carry passengers 🙂 across the river"
        tokenized = httpx.post(f"http://127.0.0.1:{port}/tokenize", json={"content": text}).json()["tokens"]
        assert AutoTokenizer.from_pretrained(materialize(FIXTURES / name, cache)).encode(text) == tokenized
        theirs = []
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_tokens": True, "ignore_eos": True}
            answer = httpx.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=60).json()
            theirs.append(answer["tokens"])
    finally:
        server.terminate()
        server.wait(10)
    ours = [tokens for tokens, _ in _ferry(materialize(FIXTURES / name, cache))]
    assert ours == theirs
