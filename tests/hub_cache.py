"""A Hugging Face cache on disk, laid out as huggingface_hub writes it, for tests that must not touch the network.

`models--{org}--{name}/blobs/<sha256>` holds each file once; `snapshots/<commit>/<path>` links to its blob;
`refs/<branch or tag>` holds the commit a name points to.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_snapshot(cache: Path, repo_id: str, files_from: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """Put every file of the directory `files_from` into `cache` as the snapshot `commit` of `repo_id`, with the
    refs named pointing at it; returns the snapshot's directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for source in sorted(files_from.iterdir()):
        data = source.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / source.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot
