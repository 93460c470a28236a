"""Trained models kept in the repository, by name: `ferry bench ... --model <name>` runs them.

`ferry-demo-512` is the embedded demo model of every figure before 2026-12-02 (512 positions, no tool
transcripts, scripts/train_demo_model.py's first phase): earlier rows of BENCHMARKS.md stay reproducible with it.
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINTS: dict[str, Path] = {"ferry-demo-512": Path(__file__).resolve().parent / "ferry-demo-512"}


def resolve(model: str) -> str:
    """A kept checkpoint's directory for its name; anything else (a named config, a path) as given."""
    return str(CHECKPOINTS[model]) if model in CHECKPOINTS else model
