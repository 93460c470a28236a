"""Tensor parallelism over torch.distributed: this process's place among the ranks, the collectives a model shard
calls, and the step's plan travelling from the driver (rank 0, the engine process) to every other rank.

Three process groups, because their waits differ:
- the default group (gloo), joined at start-up with a long timeout: ranks meet there while every rank loads its
  shard, which takes as long as the slowest rank's disk;
- the plan group (gloo: a plan is pickled bytes and stays on the host), with `distributed_timeout`: one broadcast
  per step, an empty plan when the engine idles, a stop message at the end;
- the tensor group, with `distributed_timeout`: the all-reduces and the logits gather of the forward pass. NCCL
  on CUDA; on CPU it is the plan group itself (gloo either way, and one group keeps one set of connections).
A peer that died fails the next collective at once (its connections close); one that hangs fails it after the
timeout. Either way the collective raises and the engine fails instead of waiting for ever.
"""

from __future__ import annotations

import datetime
import pickle
import socket
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from engine.config import EngineConfig, EngineStartupError
from engine.core.step import SchedulerOutput

STARTUP_TIMEOUT = datetime.timedelta(minutes=30)
"""How long ranks wait for each other while they start and load their shards (a big checkpoint, a slow disk)."""
MULTI_NODE_MASTER_PORT = 29500
"""torchrun's default port, for runs across machines that name none."""
_PLAN_BUFFER_BYTES = 64 * 1024
"""One broadcast carries a plan of up to this size (a decode step of hundreds of sequences); a bigger one (many
new requests with long prompts) sends the rest in a second broadcast."""
_GATHER_SUM_MAX_ELEMENTS = 1 << 16
"""gloo's all-reduce takes 1.2-1.6 ms for anything up to 256K floats between two CPU processes here, while an
all-gather of the same tensor plus a local sum takes 0.5-0.7 ms up to 64K (a decode step's activations), and
loses beyond 256K: small tensors go through the gather (measured with torch 2.13's gloo on this 2-core VM)."""
_HEADER_BYTES = 8
_STOP = 0
"""The payload length that tells the ranks to stop."""


COLLECTIVES = ("plan", "all_reduce", "gather")


# torch 2.13 renamed all_gather_into_tensor (deprecating the old name); older releases have only that one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CollectiveFailed(RuntimeError):
    """A collective failed: a peer rank died, hung past the timeout, or the group is gone."""


def with_rendezvous(config: EngineConfig) -> EngineConfig:
    """`config` with a master port every rank can be given: a free local port for a one-node run that named
    none (so two servers on one machine never collide), torchrun's default across nodes."""
    if config.parallel.master_port is not None:
        return config
    if config.parallel.nnodes > 1:
        return config.replace(master_port=MULTI_NODE_MASTER_PORT)
    with socket.socket() as sock:
        sock.bind((config.parallel.master_addr, 0))
        return config.replace(master_port=sock.getsockname()[1])


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """Each rank's device: CUDA device `local_rank` on a GPU machine, else the CPU."""
    if config.model.device.startswith("cuda:"):
        raise EngineStartupError(
            f"--device {config.model.device} names one GPU, but with tensor parallelism each rank takes its own: "
            "rank r on a node uses cuda:r (pass --device cuda, or auto)"
        )
    use_cuda = config.model.device == "cuda" or (config.model.device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise EngineStartupError("device='cuda' was asked for but no CUDA device is available")
    if torch.cuda.device_count() < config.parallel.ranks_per_node:
        raise EngineStartupError(
            f"{config.parallel.ranks_per_node} tensor-parallel ranks per node need as many GPUs, but this machine has "
            f"{torch.cuda.device_count()}"
        )
    return torch.device("cuda", local_rank)


@dataclass
class TensorParallel:
    """This process's rank and the collectives of its group; rank 0 is the driver (scheduler and sampler)."""

    rank: int
    size: int
    device: torch.device
    _group: dist.ProcessGroup
    _plan_group: dist.ProcessGroup
    failed: bool = False
    """Set once a collective raised: the group is unusable and no one may wait on it again."""
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COLLECTIVES, 0.0))
    """Seconds this rank spent in each kind of collective, waits for slower ranks included: what tensor
    parallelism costs a step (on CPU; on CUDA the tensor collectives are asynchronous and this is their launch)."""

    last_broadcast: float = 0.0
    """`time.monotonic()` of the driver's last plan (or keep-alive) broadcast."""

    def __post_init__(self) -> None:
        self._gather_small = self.device.type == "cpu"  # gloo; NCCL's all-reduce is the fastest it has
        self._plan_buffer = torch.zeros(_PLAN_BUFFER_BYTES, dtype=torch.uint8)
        self._plan_bytes = self._plan_buffer.numpy()
        self._plan_length = self._plan_bytes[:_HEADER_BYTES].view(np.int64)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # -- the forward pass ----------------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it. Every rank gets the same bits."""
        started = time.perf_counter()
        try:
            if self._gather_small and tensor.numel() <= _GATHER_SUM_MAX_ELEMENTS:
                # Concatenated (gloo gathers no stacked output), then summed in rank order, the same on every rank.
                parts = torch.empty((self.size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype)
                _all_gather_single(parts, tensor.contiguous(), group=self._group)
                torch.sum(parts.view(self.size, *tensor.shape), dim=0, out=tensor)
            else:
                dist.all_reduce(tensor, group=self._group)
        except Exception as exc:
            raise self._failure("all-reduce", exc) from exc
        self.seconds["all_reduce"] += time.perf_counter() - started
        return tensor

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `[rows, n]` part side by side, `[rows, size * n]`, on the driver; None on the others."""
        started = time.perf_counter()
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.is_driver else None
        try:
            dist.gather(tensor.contiguous(), parts, dst=0, group=self._group)
        except Exception as exc:
            raise self._failure("logits gather", exc) from exc
        gathered = torch.cat(parts, dim=-1) if parts is not None else None
        self.seconds["gather"] += time.perf_counter() - started
        return gathered

    # -- start-up and the step's plan ------------------------------------------------------------------------------

    def wait_for_peers(self) -> None:
        """Start-up: return once every rank got here (on the default group, which waits as long as loading may)."""
        try:
            dist.barrier()
        except Exception as exc:
            raise self._failure("start-up barrier", exc) from exc

    def min_over_ranks(self, values: list[int]) -> list[int]:
        """Each value's minimum over the ranks (start-up: the KV-cache pages every rank can hold)."""
        tensor = torch.tensor(values, dtype=torch.int64)
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN)  # the default group: ranks may still be loading
        except Exception as exc:
            raise self._failure("start-up all-reduce", exc) from exc
        return tensor.tolist()

    def broadcast_plan(self, plan: SchedulerOutput) -> None:
        """Driver: send this step's plan to every rank (one broadcast unless the plan is unusually big)."""
        started = time.perf_counter()
        self._send(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))
        self.seconds["plan"] += time.perf_counter() - started

    def send_stop(self) -> None:
        """Driver: tell every rank to leave its loop."""
        self._send(b"")

    def receive_plan(self) -> SchedulerOutput | None:
        """Other ranks: the driver's next plan; None when it says stop."""
        self._broadcast(self._plan_buffer)
        length = int(self._plan_length[0])
        if length == _STOP:
            return None
        room = _PLAN_BUFFER_BYTES - _HEADER_BYTES
        data = self._plan_bytes[_HEADER_BYTES : _HEADER_BYTES + min(length, room)].tobytes()
        if length > room:
            data += self._broadcast(torch.empty(length - room, dtype=torch.uint8)).numpy().tobytes()
        return pickle.loads(data)

    def _send(self, data: bytes) -> None:
        self.last_broadcast = time.monotonic()
        room = _PLAN_BUFFER_BYTES - _HEADER_BYTES
        self._plan_length[0] = len(data)
        head = np.frombuffer(data, dtype=np.uint8, count=min(len(data), room))
        self._plan_bytes[_HEADER_BYTES : _HEADER_BYTES + len(head)] = head
        self._broadcast(self._plan_buffer)
        if len(data) > room:
            rest = np.frombuffer(data, dtype=np.uint8, offset=room).copy()
            self._broadcast(torch.from_numpy(rest))

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            dist.broadcast(tensor, src=0, group=self._plan_group)
        except Exception as exc:
            raise self._failure("plan broadcast", exc) from exc
        return tensor

    def _failure(self, what: str, cause: Exception) -> CollectiveFailed:
        self.failed = True
        detail = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        return CollectiveFailed(
            f"tensor-parallel {what} failed on rank {self.rank} of {self.size}, a peer rank died or hung: "
            + detail[:300]
        )

    def close(self) -> None:
        """Leave the process groups (so that this process can join another later)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def init_tensor_parallel(config: EngineConfig, rank: int) -> TensorParallel:
    """Join the ranks of `config` (whose master port is set: `with_rendezvous`) as `rank`; blocks until all came."""
    assert config.parallel.master_port is not None, "with_rendezvous(config) first"
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a tensor-parallel group: one tensor-parallel engine per process "
            "(close() the other one first)"
        )
    local_rank = rank % config.parallel.ranks_per_node
    device = rank_device(config, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{config.parallel.master_addr}:{config.parallel.master_port}",
        rank=rank,
        world_size=config.parallel.tensor_parallel_size,
        timeout=STARTUP_TIMEOUT,
    )
    step_timeout = datetime.timedelta(seconds=config.parallel.distributed_timeout)
    plan_group = dist.new_group(backend="gloo", timeout=step_timeout)
    group = plan_group if device.type == "cpu" else dist.new_group(backend="nccl", timeout=step_timeout)
    return TensorParallel(rank, config.parallel.tensor_parallel_size, device, group, plan_group)
