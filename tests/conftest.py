from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.model_factory import build_model_dir, build_scripted_model_dir
from tests.postgres_server import PostgresServer, postgres_server, unavailable_reason
from tests.scripted_chat import CHAT_TEMPLATE, SCRIPTS

if not torch.cuda.is_available():
    # Triton's interpreter runs the Triton attention kernel on CPU tensors (tests/test_triton_attention.py). It is
    # chosen when a kernel is decorated, for triton's own library functions too, which are decorated when triton is
    # first imported: torch imports it as soon as a test touches torch.compile, so it must be on from the start.
    # Never where a CUDA device is: there the kernels (inductor's too) run compiled (tests/test_gpu.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Stored state (server/state/) of the servers and apps the tests start goes into a folder of this run, never the
# user's own; a test that restarts a server on the same state passes --state-dir itself.
if "FERRY_STATE_DIR" not in os.environ:
    os.environ["FERRY_STATE_DIR"] = tempfile.mkdtemp(prefix="ferry-test-state-")
# So is what Ferry derives from models (GGUF directories, tokenizer classes), one record per temporary model.
if "FERRY_CACHE_DIR" not in os.environ:
    os.environ["FERRY_CACHE_DIR"] = tempfile.mkdtemp(prefix="ferry-test-cache-")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`model_dir("llama")` -> path of a tiny saved model of that architecture (built once per session)."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_model_dir(tmp_path_factory.mktemp(arch), arch)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def tiny_llama(model_dir: Callable[[str], Path]) -> Path:
    return model_dir("llama")


@pytest.fixture(scope="session")
def scripted_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model of tests/scripted_chat.py: its greedy output is a script chosen by the prompt's last token."""
    return build_scripted_model_dir(tmp_path_factory.mktemp("scripted"), SCRIPTS, CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def _inductor_compiles() -> bool:
    """Whether torch's inductor builds kernels here (it needs a C++ compiler)."""
    try:
        torch.compile(lambda x: x * 2 + 1, fullgraph=True)(torch.ones(3))
    except Exception:  # whatever inductor raises without a working compiler
        return False
    finally:
        torch._dynamo.reset()
    return True


@pytest.fixture
def compiling(_inductor_compiles: bool) -> None:
    """For tests of compiled engines: skipped where inductor cannot compile; each starts from a clean dynamo cache,
    so that its graphs and recompiles are its own (dynamo keeps them per code object, across engines)."""
    if not _inductor_compiles:
        pytest.skip("torch inductor cannot compile here (no C++ compiler)")
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A real PostgreSQL server for the session (skipped, saying why, only where one truly cannot start)."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with postgres_server() as server:
        yield server
