from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.model_factory import build_model_dir, build_scripted_model_dir
from tests.scripted_chat import CHAT_TEMPLATE, SCRIPTS


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
