#!/usr/bin/env python
"""Writes bench/data/demo_heldout.jsonl: held-out conversations of the demo model's own kind, for
`ferry bench perplexity` (how much quantization costs the embedded model).

The same generator as the training's phase 2 (scripts/train_demo_model.py: short exchanges, tool conversations and
long multi-turn chats up to 2,048 tokens) with the held-out seed its training info reports perplexity on (seed +
1000: other values, other orders than training saw). Each line: `{"ids": [...], "scored": [...]}`, the token ids as
the chat template renders them and, as 0/1, which tokens are scored (the assistant's, as in training). Committed,
so a benchmark never depends on this Python's standard library docstrings (the QA pool is built from them).

Usage:  python scripts/demo_heldout.py [--count 16]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_demo_model as training  # a script beside this one, not a package

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "data" / "demo_heldout.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1000)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(REPO / "server" / "default_model")
    pairs, _ = training.build_qa(training.stdlib_docstrings())
    pool = pairs + [pair for pair in training.HANDWRITTEN for _ in range(training.HANDWRITTEN_REPEAT)]
    rng = random.Random(args.seed)
    with OUT.open("w") as out:
        for _ in range(args.count):
            ids, labels = training.phase2_example(rng, tokenizer, pool)
            out.write(json.dumps({"ids": ids, "scored": [int(label != -100) for label in labels]}) + "\n")
    print(f"wrote {args.count} conversations to {OUT}")


if __name__ == "__main__":
    main()
