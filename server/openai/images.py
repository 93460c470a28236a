"""Images in prompts: the image parts a request sends (chat's `image_url`, the Responses API's `input_image`),
loaded (server/media.py) and run through the model's own transformers processor, which expands each image's
placeholder into its tokens; engine/multimodal/families.py cuts the processor's arrays into one engine input per
image."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal

from transformers import AutoConfig, AutoProcessor

from engine.multimodal.families import ImageLayoutError, split_images
from engine.multimodal.inputs import ImageInput
from server.media import MediaPolicy, load_image
from server.openai.errors import APIError, invalid_request

IMAGE_PART: dict[str, Any] = {"type": "image"}
"""An image's place in a message's content as chat templates take it."""


@dataclass(frozen=True)
class ImageRef:
    """An image a request names: its URL, its place in the request (for errors) and OpenAI's `detail`."""

    url: str
    param: str
    detail: Literal["auto", "low", "high"] | None = None


def no_images(images: list[ImageRef]) -> None:
    """Refuse a request with images to a model that takes none."""
    if images:
        raise APIError(
            400, "This model takes no images: send text only, or serve an image model.",
            param=images[0].param, code="images_not_supported",
        )  # fmt: skip


class ImagePrompts:
    """An image model's prompts: rendered text with each image's placeholder, and the images, into token ids and
    the engine's per-image inputs."""

    def __init__(self, model_dir: str, policy: MediaPolicy, max_images: int) -> None:
        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.config = AutoConfig.from_pretrained(model_dir)
        self.policy = policy
        self.max_images = max_images

    async def prompt(self, text: str, images: list[ImageRef]) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt's token ids (each image's tokens in place of its placeholder) and its images."""
        if len(images) > self.max_images:
            raise APIError(
                400, f"{len(images)} images in one request: this server takes at most {self.max_images} "
                "(--limit-mm-per-prompt)", param=images[self.max_images].param, code="too_many_images",
            )  # fmt: skip
        loaded = await asyncio.gather(*(load_image(image.url, self.policy, image.param) for image in images))
        return await asyncio.to_thread(self._process, text, loaded)

    def _process(self, text: str, images: list[Any]) -> tuple[list[int], tuple[ImageInput, ...]]:
        try:
            processed = self.processor(text=text, images=images or None, add_special_tokens=False, return_tensors="np")
            ids = [int(token) for token in processed["input_ids"][0]]
            return ids, tuple(split_images(self.config, ids, processed)) if images else ()
        except (ValueError, ImageLayoutError) as exc:
            # The chat template placed a different number of image placeholders than the request has images.
            raise invalid_request(f"The prompt's images could not be placed: {exc}", "messages") from None
