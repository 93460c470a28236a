"""Trained models kept in the repository, by name: `ferry bench ... --model <name>` runs them.

Each is an embedded demo model that earlier figures of BENCHMARKS.md ran, kept so that those rows stay
reproducible after the model changes:
- `ferry-demo-512`: every figure before 2026-12-02 (512 positions, no tool transcripts, scripts/train_demo_model.py's
  first phase alone);
- `ferry-demo-2048-nocopy`: 2026-12-02 to 2026-12-07 (2,048 positions and tool transcripts, made from
  `ferry-demo-512` without the copying phase: its calls and answers rarely copy the values asked about).
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent
CHECKPOINTS: dict[str, Path] = {name: _HERE / name for name in ("ferry-demo-512", "ferry-demo-2048-nocopy")}


def resolve(model: str) -> str:
    """A kept checkpoint's directory for its name; anything else (a named config, a path) as given."""
    return str(CHECKPOINTS[model]) if model in CHECKPOINTS else model
