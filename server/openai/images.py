"""Images in prompts: the image parts a request sends (chat's `image_url`, the Responses API's `input_image`),
loaded (server/media.py) and run through the model's own transformers processor, which expands each image's
placeholder into its tokens; engine/multimodal/families.py cuts the processor's arrays into one engine input per
image."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from engine.multimodal.families import GRID_FAMILIES, image_token_id, split_images, tokens_per_grid
from engine.multimodal.inputs import ImageInput
from server.media import MediaPolicy, load_image
from server.openai.errors import APIError, invalid_request

if TYPE_CHECKING:
    from transformers import PretrainedConfig

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


def model_processor(model_dir: str, config: PretrainedConfig) -> Any:
    """The model's processor: transformers' own, or for Qwen2-VL and Qwen2.5-VL, whose processor classes insist
    on a video processor that needs torchvision (which does not load beside the CPU torch), `GridProcessor`."""
    # Imported here: transformers' processing modules bring its modelling stack (seconds at start-up), which a
    # text model's front end never needs.
    from transformers import AutoProcessor

    if config.model_type in GRID_FAMILIES:
        return GridProcessor(model_dir, config)
    return AutoProcessor.from_pretrained(model_dir)


class GridProcessor:
    """Qwen2-VL's processor for images: the model's own image processor (its PIL implementation), and each image's
    placeholder token repeated once per merged square of its patch grid, as `Qwen2VLProcessor` does."""

    def __init__(self, model_dir: str, config: PretrainedConfig) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        self.config = config
        self.image_processor = AutoImageProcessor.from_pretrained(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.image_token_id = image_token_id(config)
        self.image_token = self.tokenizer.convert_ids_to_tokens(self.image_token_id)

    def __call__(self, text: str, images: list[Any] | None = None, **kwargs: Any) -> dict[str, Any]:
        pieces = text.split(self.image_token)
        processed: dict[str, Any] = {}
        if images:
            processed = dict(self.image_processor(images=images, return_tensors="np"))
        grids = processed.get("image_grid_thw", [])
        if len(pieces) - 1 != len(grids):
            raise ValueError(f"{len(pieces) - 1} image placeholders in the prompt for {len(grids)} images")
        expanded = pieces[0] + "".join(
            self.image_token * tokens_per_grid(self.config, grid) + piece
            for grid, piece in zip(grids, pieces[1:], strict=True)
        )
        ids = self.tokenizer(expanded, add_special_tokens=kwargs.get("add_special_tokens", True))["input_ids"]
        # Which tokens are an image's (1), as the processor marks them: the model's own forward pass reads them to
        # place M-RoPE positions.
        types = [[int(token == self.image_token_id) for token in ids]]
        return {"input_ids": [ids], "mm_token_type_ids": types, **processed}


class ImagePrompts:
    """An image model's prompts: rendered text with each image's placeholder, and the images, into token ids and
    the engine's per-image inputs."""

    def __init__(self, model_dir: str, policy: MediaPolicy, max_images: int) -> None:
        from transformers import AutoConfig

        self.config = AutoConfig.from_pretrained(model_dir)
        self.processor = model_processor(model_dir, self.config)
        self.policy = policy
        self.max_images = max_images

    async def prompt(self, text: str, images: list[ImageRef], param: str) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt's token ids (each image's tokens in place of its placeholder) and its images; `param`: the
        request field the conversation came from (`messages`, `input`)."""
        if len(images) > self.max_images:
            raise APIError(
                400, f"{len(images)} images in one request: this server takes at most {self.max_images} "
                "(--limit-mm-per-prompt)", param=images[self.max_images].param, code="too_many_images",
            )  # fmt: skip
        loaded = await asyncio.gather(*(load_image(image.url, self.policy, image.param) for image in images))
        return await asyncio.to_thread(self._process, text, loaded, param)

    def _process(self, text: str, images: list[Any], param: str) -> tuple[list[int], tuple[ImageInput, ...]]:
        try:
            processed = self.processor(text=text, images=images or None, add_special_tokens=False, return_tensors="np")
            ids = [int(token) for token in processed["input_ids"][0]]
            return ids, tuple(split_images(self.config, ids, processed)) if images else ()
        except ValueError as exc:  # ImageLayoutError among them
            # The chat template placed a different number of image placeholders than the request has images.
            raise invalid_request(f"The prompt's images could not be placed: {exc}", param) from None
