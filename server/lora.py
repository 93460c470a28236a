"""LoRA adapters as the server serves them: which names stand for which adapter, and the bodies of vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter.

A request names an adapter as its `model`; the registry gives the engine's LoRARequest for that name, which the
request carries to its end. Unloading forgets the name only: requests already running keep their LoRARequest
(the engine keeps the adapter for them) and finish with it, while new requests for the name get a 404. Each
loading gets a new `lora_id`, so an adapter reloaded under the same name from other files is another adapter to
the engine and its prefix cache.

Adapters are checked with the engine's own reader (engine/lora/adapter.py: the config and the safetensors header,
no tensors) before they are served, so one the engine would refuse is refused here, with its reason.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from engine.config import EngineConfig
from engine.core.request import LoRARequest
from engine.lora.adapter import AdapterError, read_adapter
from server.openai.errors import APIError, invalid_request
from server.openai.schemas import _RequestModel
from server.settings import LoRAModule, ServerSettings

logger = logging.getLogger(__name__)


class LoadLoRAAdapterRequest(_RequestModel):
    lora_name: str = Field(min_length=1, description="The name requests will send as `model` to use the adapter.")
    lora_path: str = Field(min_length=1, description="The directory PEFT saved the adapter in, on the server.")
    load_inplace: bool = Field(
        False, description="Replace the adapter already loaded under this name (requests running with it finish "
        "with the one they started with)."
    )  # fmt: skip


class UnloadLoRAAdapterRequest(_RequestModel):
    lora_name: str = Field(min_length=1, description="The adapter's name.")
    lora_int_id: int | None = Field(
        None, ge=1, description="Unload only if the name still stands for this loading of it (its engine id)."
    )


class LoRAStartupError(Exception):
    """LoRA flags the server cannot start with; the message names the flag and says why."""


@dataclass(frozen=True)
class ServedAdapter:
    """An adapter the server serves: what requests for it run with, and the served model it adapts."""

    request: LoRARequest
    parent: str


class LoRARegistry:
    """The adapters served now, by name, in the order they were loaded."""

    def __init__(self, model_dir: str, max_rank: int, model_names: tuple[str, ...]) -> None:
        self._model_dir = model_dir
        self._max_rank = max_rank
        self._model_names = model_names
        self._adapters: dict[str, ServedAdapter] = {}
        self._ids = itertools.count(1)

    @functools.cached_property
    def _hf_config(self) -> Any:
        """The model's config, which adapters are checked against (read at the first adapter: a server without
        adapters never needs it)."""
        # Imported here: the engine process imports this package's settings, and needs no transformers there.
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self._model_dir)

    @property
    def adapters(self) -> list[ServedAdapter]:
        return list(self._adapters.values())

    def get(self, name: str) -> ServedAdapter | None:
        return self._adapters.get(name)

    def add(self, module: LoRAModule) -> ServedAdapter:
        """Serve a --lora-modules adapter (at start-up: the files are read in the caller's thread)."""
        parent = module.base_model_name or self._model_names[0]
        if parent not in self._model_names:
            raise invalid_request(
                f"base_model_name '{parent}' is not a served model name ({', '.join(self._model_names)}).",
                "base_model_name",
                code="model_not_found",
            )
        self._check_name(module.name, replace=False)
        return self._insert(module.name, self._read(module.path), parent)

    async def load(self, body: LoadLoRAAdapterRequest) -> ServedAdapter:
        """Serve the adapter of a load request, its files read in a worker thread so that streams keep flowing."""
        self._check_name(body.lora_name, body.load_inplace)
        path = await asyncio.to_thread(self._read, body.lora_path)
        # Checked again: another load of this name may have finished while the files were read.
        self._check_name(body.lora_name, body.load_inplace)
        adapter = self._insert(body.lora_name, path, self._model_names[0])
        logger.info("Loaded LoRA adapter '%s' (id %d) from %s", body.lora_name, adapter.request.lora_id, path)
        return adapter

    def unload(self, body: UnloadLoRAAdapterRequest) -> None:
        adapter = self._adapters.get(body.lora_name)
        if adapter is None:
            raise APIError(
                404, f"The LoRA adapter '{body.lora_name}' cannot be found.", param="lora_name", code="lora_not_found"
            )
        if body.lora_int_id is not None and body.lora_int_id != adapter.request.lora_id:
            raise APIError(
                404,
                f"The LoRA adapter '{body.lora_name}' is loaded with id {adapter.request.lora_id}, not "
                f"{body.lora_int_id}.",
                param="lora_int_id",
                code="lora_not_found",
            )
        del self._adapters[body.lora_name]
        logger.info("Unloaded LoRA adapter '%s' (id %d)", body.lora_name, adapter.request.lora_id)

    def _check_name(self, name: str, replace: bool) -> None:
        if name in self._model_names:
            raise invalid_request(
                f"'{name}' is the name of a served model; a LoRA adapter needs a name of its own.",
                "lora_name",
                code="lora_name_taken",
            )
        if name in self._adapters and not replace:
            raise invalid_request(
                f"The LoRA adapter '{name}' has already been loaded (unload it first, or send load_inplace).",
                "lora_name",
                code="lora_name_taken",
            )

    def _read(self, path: str) -> str:
        """The adapter directory `path`, resolved, once the engine's reader has found it fit for this model."""
        try:
            return read_adapter(path, self._hf_config, self._max_rank).path
        except AdapterError as error:
            raise invalid_request(
                f"Cannot serve this LoRA adapter: {error}.", "lora_path", code="invalid_lora"
            ) from error

    def _insert(self, name: str, path: str, parent: str) -> ServedAdapter:
        adapter = ServedAdapter(LoRARequest(name, next(self._ids), path), parent)
        self._adapters[name] = adapter
        return adapter


def startup_registry(
    engine_config: EngineConfig, settings: ServerSettings, model_names: tuple[str, ...]
) -> LoRARegistry:
    """The registry serving --lora-modules' adapters, each checked against the model; LoRAStartupError for flags
    that need --enable-lora without it, or for an adapter that cannot be served."""
    lora = engine_config.lora
    if not lora.enable_lora:
        for flag, given in (
            ("--lora-modules", settings.lora_modules),
            ("--allow-runtime-lora-updating", settings.allow_runtime_lora_updating),
        ):
            if given:
                raise LoRAStartupError(f"{flag} serves LoRA adapters, which needs --enable-lora")
    registry = LoRARegistry(engine_config.model.path, lora.max_lora_rank, model_names)
    for module in settings.lora_modules or ():
        try:
            registry.add(module)
        except APIError as error:
            raise LoRAStartupError(f"--lora-modules {module.name}: {error}") from None
    return registry
