"""What a start imports (issue 32's start-up target): each heavy import below cost `ferry serve` on the demo model
between 0.4 and 2.4 s. Checked in fresh interpreters, since this test session has imported everything already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.server_harness import REPO_ROOT

# transformers' modelling modules (and with them torch._dynamo, scipy and triton) and torch._dynamo itself: what the
# transformers fallback, image models and torch.compile need, and a native text model does not.
FALLBACK_ONLY = (
    "torch._dynamo",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "scipy",
    "triton",
)


def _modules_after(code: str, env: dict[str, str] | None = None) -> set[str]:
    """The modules a fresh interpreter holds after running `code` (with `env` added to the environment)."""
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def _first_and_warm(code: str, cache: Path) -> tuple[set[str], set[str]]:
    """The modules of a first start of `code` (with an empty Ferry cache at `cache`) and of the next (its records
    written)."""
    env = {"FERRY_CACHE_DIR": str(cache)}
    return _modules_after(code, env), _modules_after(code, env)


def test_the_command_line_imports_neither_torch_nor_transformers() -> None:
    """`ferry serve` spawns its engine process right after parsing its flags: the parser (both subcommands' flags,
    their defaults included) must not import what the engine process imports again anyway."""
    modules = _modules_after(
        "from ferry.cli import main\n"
        "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
        "try:\n    main(['bench', 'embed', '--help'])\nexcept SystemExit:\n    pass"
    )
    assert "ferry.cli" in modules and "bench.embed_config" in modules
    assert not {"torch", "transformers"} & modules


def test_a_native_model_starts_without_the_fallback_machinery() -> None:
    modules = _modules_after(
        "from engine import EngineConfig, EngineCore\nEngineCore(EngineConfig.of(model='server/default_model'))"
    )
    assert "engine.models.llama" in modules
    assert not set(FALLBACK_ONLY) & modules
    # The other families' modules stay unimported too.
    assert not {"engine.models.hybrid", "engine.models.llava", "engine.models.transformers_loading"} & modules


def test_the_fallback_still_gets_its_machinery() -> None:
    """The lazy imports must not leave the fallback without what it uses: a model under --model-impl transformers
    loads its modelling modules."""
    modules = _modules_after(
        "from engine import EngineConfig, EngineCore\n"
        "EngineCore(EngineConfig.of(model='server/default_model', model_impl='transformers'))"
    )
    assert {"transformers.modeling_utils", "engine.models.transformers_loading"} <= modules


def test_a_warm_front_end_imports_neither_torch_nor_the_auto_classes(tmp_path: Path) -> None:
    """The front end's web stack and its tokenizer, the second time a model's tokenizer loads: the class recorded
    the first time (server/tokenizer_class.py) spares it AutoTokenizer and, through transformers' config classes,
    torch (1.7-2.2 s of its start on the demo model)."""
    load = "import server.app\nfrom server.tokens import Tokenizer\nTokenizer.load('server/default_model')"
    first, warm = _first_and_warm(load, tmp_path)
    assert "transformers.models.auto.tokenization_auto" in first
    assert "transformers.tokenization_utils_tokenizers" in warm
    assert not {"torch", "transformers.models.auto.tokenization_auto", "transformers.configuration_utils"} & warm


def test_a_warm_engine_imports_neither_transformers_nor_sympy(tmp_path: Path) -> None:
    """The second start of a native model builds its config from the record of the first
    (engine/models/config_record.py): `AutoConfig` would import transformers (~1 s) and the Llama config class, whose
    validators import torch's distributed tensors and sympy (~0.5 s more); so would `Module.to_empty` on the meta
    device (sympy, through torch's reference `empty_like`)."""
    start = "from engine import EngineConfig, EngineCore\nEngineCore(EngineConfig.of(model='server/default_model'))"
    first, warm = _first_and_warm(start, tmp_path)
    assert "transformers.models.llama.configuration_llama" in first
    assert "engine.models.llama" in warm
    assert not {module for module in warm if module.split(".")[0] in ("transformers", "sympy")}
    assert "torch.distributed.tensor" not in warm
