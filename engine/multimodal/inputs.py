"""One image of a prompt, processed: where its tokens sit and the tensors its vision encoder reads."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class ImageInput:
    """An image as the prompt holds it: the placeholder tokens `[offset, offset + length)` that its encoder's
    output replaces (one embedding per token), and the model processor's arrays for this image alone
    (`pixel_values`, and per family e.g. `image_grid_thw`). `content_hash` names its processed content: equal
    hashes encode to equal embeddings, so the encoder cache and the prefix cache key by it."""

    offset: int
    length: int
    data: dict[str, np.ndarray] = field(compare=False)
    content_hash: str

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise ValueError(f"an image's tokens must be a non-empty range from 0 on: {self.offset}+{self.length}")

    @property
    def end(self) -> int:
        return self.offset + self.length

    @staticmethod
    def hash_of(data: dict[str, np.ndarray]) -> str:
        """A hash of the processed arrays (names, shapes, dtypes and bytes): the same image processed the same way
        hashes the same, whatever URL or encoding it came in."""
        digest = hashlib.sha256()
        for name in sorted(data):
            array = np.ascontiguousarray(data[name])
            digest.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
            digest.update(array.tobytes())
        return digest.hexdigest()
