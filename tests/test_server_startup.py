"""`ferry serve` as vLLM users start it: a Hub id from the Hugging Face cache (offline, with a revision, a separate
tokenizer and several served names), a KV cache smaller than the model's length, and options that cannot run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.hub_cache import add_snapshot
from tests.model_factory import build_model_dir
from tests.server_harness import REPO_ROOT, ServerProcess, server_process

pytestmark = pytest.mark.timeout(300)

MAIN, V2, TOKENIZER = "1" * 40, "2" * 40, "3" * 40
OTHER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama's architecture and tokenizer with other weights."""
    return build_model_dir(tmp_path_factory.mktemp("other"), "llama", seed=1)


@pytest.fixture(scope="module")
def hub_cache(tiny_llama: Path, other_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """org/tiny: main is the other model, the tag v2 the tiny llama; org/tokenizer: the tokenizer alone, with a
    chat template of its own."""
    cache = tmp_path_factory.mktemp("hub") / "hub"
    add_snapshot(cache, "org/tiny", other_model, MAIN)
    add_snapshot(cache, "org/tiny", tiny_llama, V2, refs=("v2",))
    tokenizer_dir = tmp_path_factory.mktemp("tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / name, tokenizer_dir / name)
    (tokenizer_dir / "chat_template.jinja").write_text(OTHER_TEMPLATE)
    add_snapshot(cache, "org/tokenizer", tokenizer_dir, TOKENIZER)
    return cache


def greedy_text(model_dir: Path, prompt: list[int], max_new_tokens: int) -> str:
    """What the model's own `generate` answers greedily, decoded as the server decodes."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(prompt) :]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def offline(cache: Path) -> dict[str, str]:
    """The environment of a machine whose Hugging Face cache is `cache` and that must not download."""
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def hub_server(hub_cache: Path) -> Iterator[ServerProcess]:
    with server_process(
        None, "--model", "org/tiny", "--revision", "v2", "--tokenizer", "org/tokenizer",
        "--served-model-name", "tiny", "tiny-alias", "--num-pages", "8", "--log-level", "warning",
        env=offline(hub_cache),
    ) as running:  # fmt: skip
        yield running


def test_a_hub_model_serves_from_the_cache_offline(
    hub_server: ServerProcess, tiny_llama: Path, other_model: Path
) -> None:
    """`--num-pages 8` (128 tokens) with the model's 512 positions: the server lowers max_model_len, says so in
    /v1/models, and a chat request without max_tokens (the OpenAI SDK's default) is served."""
    http = httpx.Client(base_url=hub_server.base_url, timeout=60)
    cards = http.get("/v1/models").json()["data"]
    assert [(card["id"], card["max_model_len"]) for card in cards] == [("tiny", 128), ("tiny-alias", 128)]
    assert "max_model_len lowered to 128" in hub_server.log()

    client = openai.OpenAI(base_url=f"{hub_server.base_url}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Tell me about ferry boats."}]
    chat = client.chat.completions.create(model="tiny-alias", messages=messages, temperature=0)
    assert chat.model == "tiny" and chat.usage is not None
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens <= 128

    # The tokenizer is --tokenizer's (its own chat template), not the model's.
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ours = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=OTHER_TEMPLATE)
    expected = tokenizer.encode(ours, add_special_tokens=False)
    assert http.post("/tokenize", json={"messages": messages}).json()["tokens"] == expected
    assert chat.usage.prompt_tokens == len(expected)

    # --revision v2 is the tiny llama: greedy output is that model's, not main's.
    prompt = [5, 6, 7, 8]
    served = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0).choices[0].text
    assert served == greedy_text(tiny_llama, prompt, 6)
    assert served != greedy_text(other_model, prompt, 6), "the two revisions must differ for this to mean anything"


def serve_until_exit(
    *args: str, env: dict[str, str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """Run `ferry serve` expecting it to stop by itself, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "ferry", "serve", "--port", "0", *args],
        cwd=REPO_ROOT,
        env={"OMP_NUM_THREADS": "1", **(env or os.environ)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_cache_too_small_for_the_asked_max_model_len_stops_the_server(tiny_llama: Path) -> None:
    result = serve_until_exit("--model", str(tiny_llama), "--num-pages", "8", "--max-model-len", "512")
    assert result.returncode != 0
    for words in ("holds 128 tokens", "--max-model-len", "--num-pages", "--cpu-kv-cache-gib"):
        assert words in result.stderr, result.stderr[-3000:]
    # A refusal by name is one line, not a traceback.
    assert "Cannot serve this model" in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]


def test_a_hub_model_missing_offline_is_refused_before_anything_starts(hub_cache: Path) -> None:
    result = serve_until_exit("--model", "org/absent", env={**os.environ, **offline(hub_cache)}, timeout=60)
    assert result.returncode == 2
    assert "--model org/absent" in result.stderr and "HF_HUB_OFFLINE=1" in result.stderr
