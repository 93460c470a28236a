"""Each image family's split of its transformers processor's output into one `ImageInput` per image.

A processor expands each image's placeholder in the prompt into the tokens its embeddings will replace and
stacks every image's arrays together; the engine keys, caches and encodes images one by one, so the arrays are
cut per image and each image's tokens located in the prompt here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from engine.multimodal.inputs import ImageInput


class ImageLayoutError(ValueError):
    """The processor's output does not place each image's tokens as the family lays them out."""


def image_token_id(config: Any) -> int:
    """The placeholder token an image's tokens are written as in an image model's prompt."""
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    if token is None:
        raise ImageLayoutError(f"the {config.model_type!r} config names no image token (image_token_id)")
    return int(token)


def split_images(config: Any, input_ids: Sequence[int], processed: Mapping[str, Any]) -> list[ImageInput]:
    """The images of one processed prompt, in prompt order: for LLaVA one `pixel_values` image each, its tokens
    one run of the image token (as many per image)."""
    pixel_values = np.asarray(processed["pixel_values"], dtype=np.float32)
    runs = _runs(input_ids, image_token_id(config))
    count = len(pixel_values)
    total = sum(length for _, length in runs)
    if count == 0 or total % count:
        raise ImageLayoutError(f"{total} image tokens in the prompt for {count} images")
    per_image = total // count
    offsets = [offset + k for offset, length in runs for k in range(0, length, per_image)]
    if any(length % per_image for _, length in runs) or len(offsets) != count:
        raise ImageLayoutError(f"image token runs of {[n for _, n in runs]} for {count} images of {per_image}")
    images = []
    for offset, pixels in zip(offsets, pixel_values, strict=True):
        data = {"pixel_values": np.ascontiguousarray(pixels)}
        images.append(ImageInput(offset, per_image, data, ImageInput.hash_of(data)))
    return images


def _runs(input_ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of `token` in `input_ids`."""
    ids = np.asarray(input_ids)
    is_token = np.concatenate([[False], ids == token, [False]])
    edges = np.flatnonzero(is_token[1:] != is_token[:-1])
    return [(int(start), int(end - start)) for start, end in zip(edges[::2], edges[1::2], strict=True)]
