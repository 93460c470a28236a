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


GRID_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl"})
"""Images at their own resolution: a grid of patches per image (`image_grid_thw`), merged into tokens."""


def split_images(config: Any, input_ids: Sequence[int], processed: Mapping[str, Any]) -> list[ImageInput]:
    """The images of one processed prompt, in prompt order."""
    if config.model_type in GRID_FAMILIES:
        return _grid_images(config, input_ids, processed)
    if config.model_type == "llava_next":
        return _tiled_images(config, input_ids, processed)
    return _fixed_size_images(config, input_ids, processed)


def _tiled_images(config: Any, input_ids: Sequence[int], processed: Mapping[str, Any]) -> list[ImageInput]:
    """LLaVA-NeXT's: `pixel_values` `[images, most tiles, 3, H, W]`, each image's own tiles first (the number
    follows from its size, `image_sizes`); an image's tokens are one run of the image token, as many as its tiles'
    unpadded features."""
    # LLaVA-NeXT's modelling module (and the torch it imports) only where a NeXT model runs: this module is the
    # front end's too.
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    sizes = np.asarray(processed["image_sizes"], dtype=np.int64)
    pixel_values = np.asarray(processed["pixel_values"], dtype=np.float32)
    runs = _runs(input_ids, image_token_id(config))
    if len(runs) != len(sizes):
        raise ImageLayoutError(f"{len(runs)} runs of image tokens for {len(sizes)} images (each image needs its own)")
    images = []
    for (offset, length), size, pixels in zip(runs, sizes, pixel_values, strict=True):
        tiles = image_size_to_num_patches(tuple(size), config.image_grid_pinpoints, config.vision_config.image_size)
        data = {"pixel_values": np.ascontiguousarray(pixels[:tiles]), "image_sizes": size}
        images.append(ImageInput(offset, length, data, ImageInput.hash_of(data)))
    return images


def tokens_per_grid(config: Any, grid_thw: Sequence[int]) -> int:
    """A grid family's image tokens for a patch grid (time, height, width): one per merged square of patches."""
    merge = config.vision_config.spatial_merge_size
    return int(np.prod(grid_thw)) // merge**2


def _grid_images(config: Any, input_ids: Sequence[int], processed: Mapping[str, Any]) -> list[ImageInput]:
    """Qwen2-VL's: `pixel_values` holds every image's patches one after another (`[patches, C * T * P * P]`),
    `image_grid_thw` each image's grid; an image's tokens are one run of the image token."""
    grids = np.asarray(processed["image_grid_thw"], dtype=np.int64)
    pixel_values = np.asarray(processed["pixel_values"], dtype=np.float32)
    runs = _runs(input_ids, image_token_id(config))
    lengths = [tokens_per_grid(config, grid) for grid in grids]
    if [length for _, length in runs] != lengths:
        raise ImageLayoutError(f"image token runs of {[n for _, n in runs]} for images of {lengths} tokens")
    bounds = np.cumsum([0, *(int(np.prod(grid)) for grid in grids)])
    images = []
    for (offset, length), grid, first, end in zip(runs, grids, bounds[:-1], bounds[1:], strict=True):
        data = {"pixel_values": np.ascontiguousarray(pixel_values[first:end]), "image_grid_thw": grid}
        images.append(ImageInput(offset, length, data, ImageInput.hash_of(data)))
    return images


def _fixed_size_images(config: Any, input_ids: Sequence[int], processed: Mapping[str, Any]) -> list[ImageInput]:
    """LLaVA's: one `pixel_values` image each, every image the same number of tokens, each image's tokens a run of
    the image token (adjacent images make one longer run)."""
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
