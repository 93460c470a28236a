"""The runner's adapters: which slot each running request's adapter is in, the adapters kept loaded, and each
step's `LoRABatch`.

The scheduler lets the running requests use at most `max_loras` adapters at once, so each gets a slot of its own.
The manager learns who runs from the plans, as the input batch does: a new request's adapter takes a slot (the one
that already holds it, else a free one, the least recently used first), a finished or preempted request lets go of
it. A slot keeps its adapter after its last request leaves, so an adapter used again soon costs nothing.

Copies into a slot are the step's `SlotLoads`, which the runner makes on its forward thread just before the step's
forward pass: under async scheduling the next step is prepared while the previous one runs, and that one may still
read the slot being handed over.

Adapters are read from disk into `AdapterCache`, which keeps the `max_cpu_loras` most recently used.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from engine.config import EngineConfig, EngineStartupError, LoRAConfig
from engine.core.request import LoRARequest
from engine.core.step import SchedulerOutput
from engine.layers.linear import LinearBase, ShardId
from engine.lora.adapter import AdapterSpec, read_adapter
from engine.lora.batch import LoRABatch
from engine.lora.slots import LoRALayer, slot_rank
from engine.models.registry import NATIVE_MODELS

logger = logging.getLogger(__name__)

Targets = dict[tuple[int, str], tuple[LinearBase, ShardId]]
"""(layer, PEFT projection name) -> the linear layer computing it and its part there (a model's `lora_targets()`)."""

Pairs = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
"""(layer, projection) -> (A `[r, in]`, B `[out, r]`): an adapter's tensors."""


@dataclass(frozen=True)
class LoadedAdapter:
    spec: AdapterSpec
    pairs: Pairs


class AdapterCache:
    """Adapters read from disk, the `capacity` most recently used kept (--max-cpu-loras)."""

    def __init__(self, capacity: int, read: Callable[[LoRARequest], LoadedAdapter]) -> None:
        self.capacity = capacity
        self._read = read
        self._adapters: OrderedDict[int, LoadedAdapter] = OrderedDict()
        self.loads = 0
        """Adapters read from disk so far (a reload after an eviction counts again)."""

    def __contains__(self, lora_id: int) -> bool:
        return lora_id in self._adapters

    def get(self, lora: LoRARequest) -> LoadedAdapter:
        adapter = self._adapters.get(lora.lora_id)
        if adapter is not None:
            self._adapters.move_to_end(lora.lora_id)
            return adapter
        adapter = self._read(lora)
        self.loads += 1
        self._adapters[lora.lora_id] = adapter
        while len(self._adapters) > self.capacity:
            evicted, _ = self._adapters.popitem(last=False)
            logger.info("LoRA adapter %d evicted from memory (--max-cpu-loras %d)", evicted, self.capacity)
        return adapter


SlotLoads = list[tuple[int, LoadedAdapter]]
"""(slot, adapter) copies a step makes before its forward pass."""


@dataclass
class _Slot:
    lora_id: int | None = None
    scaling: float = 0.0
    users: set[str] = field(default_factory=set)
    last_used: int = 0


class LoRAManager:
    """Adapter slots of a model's adapted layers, and their assignment to the running requests' adapters."""

    def __init__(
        self, config: LoRAConfig, targets: Targets, hf_config: object, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.max_rank = config.max_lora_rank
        self.rank = slot_rank(config.max_lora_rank)
        """The slots' rank (engine/lora/slots.py)."""
        self.device, self.dtype = device, dtype
        self.targets = targets
        parts: dict[LinearBase, list[ShardId]] = {}
        for layer, shard_id in targets.values():
            parts.setdefault(layer, []).append(shard_id)
        self._layers = {
            layer: LoRALayer(layer, shard_ids, config.max_loras, self.rank, device, dtype)
            for layer, shard_ids in parts.items()
        }
        for layer, slots in self._layers.items():
            layer.lora = slots
        self._hf_config = hf_config
        self.cache = AdapterCache(config.cpu_capacity, self._read)
        self._slots = [_Slot() for _ in range(config.max_loras)]
        self._slot_of_request: dict[str, int] = {}
        self._scalings = np.zeros(config.max_loras, dtype=np.float32)
        self._clock = 0

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def _read(self, lora: LoRARequest) -> LoadedAdapter:
        spec = read_adapter(lora.path, self._hf_config, self.max_rank)
        tensors = load_file(spec.weights_file)
        prefix = "base_model.model.model.layers"
        pairs = {
            (layer, projection): (
                tensors[f"{prefix}.{layer}.{_block(projection)}.{projection}.lora_A.weight"],
                tensors[f"{prefix}.{layer}.{_block(projection)}.{projection}.lora_B.weight"],
            )
            for layer, projection in spec.modules
        }
        return LoadedAdapter(spec, pairs)

    def step(self, plan: SchedulerOutput) -> tuple[np.ndarray | None, SlotLoads]:
        """Follow the plan's requests (who left, who joined with which adapter). Returns each scheduled request's
        slot, in plan order (-1: the base model; None when none has an adapter), and the copies into slots the
        step makes first."""
        self._clock += 1
        for request_id in (*plan.finished_ids, *plan.preempted_ids):
            slot = self._slot_of_request.pop(request_id, None)
            if slot is not None:
                self._slots[slot].users.discard(request_id)
        loads: SlotLoads = []
        for new in plan.new_requests:
            if new.lora is not None:
                self._acquire(new.request_id, new.lora, loads)
        if not self._slot_of_request:
            return None, loads
        slot_of = self._slot_of_request
        return np.array([slot_of.get(request_id, -1) for request_id in plan.request_ids], dtype=np.int64), loads

    def batch(self, token_slots: np.ndarray) -> LoRABatch | None:
        """The step's batch of tokens in slots `token_slots` `[T]` (-1: the base model)."""
        return LoRABatch.of(token_slots, self._scalings, self.rank, self.device, self.dtype)

    def _acquire(self, request_id: str, lora: LoRARequest, loads: SlotLoads) -> None:
        slots = self._slots
        index = next((i for i, slot in enumerate(slots) if slot.lora_id == lora.lora_id), None)
        if index is None:
            free = [i for i, slot in enumerate(slots) if not slot.users]
            if not free:
                raise RuntimeError(f"no LoRA slot free for adapter {lora.name!r}: more adapters run than max_loras")
            # The lowest free slot that held nothing, else the least recently used: steps then use a prefix of the
            # slots (`LoRABatch.num_slots`), and an adapter just let go stays a while.
            index = min(free, key=lambda i: (slots[i].lora_id is not None, slots[i].last_used, i))
            adapter = self.cache.get(lora)
            slots[index].lora_id = lora.lora_id
            slots[index].scaling = adapter.spec.scaling
            self._scalings[index] = adapter.spec.scaling
            loads.append((index, adapter))
        slots[index].users.add(request_id)
        slots[index].last_used = self._clock
        self._slot_of_request[request_id] = index

    def load(self, loads: SlotLoads) -> None:
        """Copy a step's adapters into their slots (on the thread that runs the forward pass, after the previous
        step's)."""
        for slot, adapter in loads:
            by_layer: dict[LinearBase, dict[ShardId, tuple[torch.Tensor, torch.Tensor]]] = {}
            for key, pair in adapter.pairs.items():
                layer, shard_id = self.targets[key]
                by_layer.setdefault(layer, {})[shard_id] = pair
            for layer, slots in self._layers.items():
                slots.load(slot, by_layer.get(layer, {}))


def lora_manager(config: EngineConfig, model: nn.Module, hf_config: object, dtype: torch.dtype) -> LoRAManager | None:
    """The manager of `model`'s adapter slots with --enable-lora (None without); EngineStartupError for a model
    or option LoRA does not run with."""
    if not config.lora.enable_lora:
        return None
    targets = getattr(model, "lora_targets", None)
    if targets is None:
        raise EngineStartupError(
            f"--enable-lora runs on the natively implemented families ({', '.join(sorted(NATIVE_MODELS))}); this "
            f"model runs on the transformers fallback"
        )
    device = next(model.buffers()).device
    return LoRAManager(config.lora, targets(), hf_config, device, dtype)


def _block(projection: str) -> str:
    return "mlp" if projection in ("gate_proj", "up_proj", "down_proj") else "self_attn"
