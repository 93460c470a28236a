"""`--compile` levels: the flag, the setups that refuse a level at start-up (naming the flag to change), a start-up
where inductor cannot build kernels, and what the warm-up compiles. Whether compiled engines compute what eager ones
do is the oracle's to say (tests/test_engine_equivalence.py::test_compiled_greedy_equals_generate)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, EngineCore
from engine.config import EngineStartupError
from engine.execution.compile import check_compile_level
from server import cli


def _serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *flags])


@pytest.mark.parametrize("level", ["none", "piecewise", "full"])
def test_each_level_is_a_serve_flag(tiny_llama: Path, level: str) -> None:
    config = cli.build_engine_config(_serve_args("--model", str(tiny_llama), "--compile", level))
    assert config.execution.compile == level


def test_an_unknown_level_is_refused(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _serve_args("--model", str(tiny_llama), "--compile", "max-autotune")
    assert "invalid choice: 'max-autotune'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="compile must be one of none, piecewise, full"):
        EngineConfig.of(model=str(tiny_llama), compile="max-autotune")  # type: ignore[arg-type]


@pytest.mark.parametrize("level", ["piecewise", "full"])
@pytest.mark.parametrize(("arch", "model_impl"), [("gpt2", "auto"), ("llama", "transformers")])
def test_the_transformers_adapter_refuses_compiled_levels(
    model_dir: Callable[[str], Path], arch: str, model_impl: str, level: str
) -> None:
    config = EngineConfig.of(model=str(model_dir(arch)), model_impl=model_impl, compile=level, num_pages=16)
    with pytest.raises(EngineStartupError, match=f"--compile {level} compiles the native .* use --compile none"):
        EngineCore(config)


def test_devices_other_than_cpu_refuse_compiled_levels(tiny_llama: Path) -> None:
    cuda = torch.device("cuda")
    check_compile_level(EngineConfig.of(model=str(tiny_llama)), native=True, device=cuda)
    with pytest.raises(EngineStartupError, match="--compile full is built and checked for CPU only"):
        check_compile_level(EngineConfig.of(model=str(tiny_llama), compile="full"), native=True, device=cuda)


def test_tensor_parallelism_refuses_compiled_levels_before_any_rank_starts(tiny_llama: Path) -> None:
    config = EngineConfig.of(model=str(tiny_llama), compile="piecewise", tensor_parallel_size=2, num_pages=16)
    with pytest.raises(EngineStartupError, match="--compile piecewise runs on one device: with --tensor-parallel"):
        EngineCore(config)


def test_a_start_up_where_inductor_cannot_build_kernels_is_refused(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No C++ compiler (none found, and no cached kernels to fall back on): the start-up fails, saying so, rather
    than serving eagerly under a compiled level."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    config = EngineConfig.of(model=str(tiny_llama), compile="piecewise", num_pages=16)
    no_compiler = {"cpp.cxx": (None, str(tmp_path / "no-such-c++")), "force_disable_caches": True}
    with torch._inductor.config.patch(no_compiler), pytest.raises(EngineStartupError) as refused:
        EngineCore(config)
    assert "--compile piecewise failed at start-up" in str(refused.value)
    assert "--compile none runs the model eagerly" in str(refused.value)
    torch._dynamo.reset()


@pytest.mark.parametrize("level", ["piecewise", "full"])
def test_the_warm_up_leaves_no_trace_in_the_runner(tiny_llama: Path, level: str, compiling: None) -> None:
    engine = EngineCore(EngineConfig.of(model=str(tiny_llama), compile=level, num_pages=32, debug_checks=True))
    assert not engine.runner.batch.seqs
    assert engine.is_idle_and_clean()
