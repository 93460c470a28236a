"""Paged attention backends behind one interface.

A backend turns one step's packed batch into layer-independent metadata once (`prepare`), then each attention
layer calls `forward` with that metadata: it writes the step's new K/V into the pages and attends over each
sequence's pages, block-diagonal and causal, so packing is exactly running each sequence alone.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

from engine.attention.base import NO_NEEDS, AttentionBackend, AttentionNeeds, StepMetadata, UnsupportedAttention
from engine.attention.cpu_kernel import KernelUnavailable, load_kernel
from engine.attention.cpu_paged import CPU_DTYPES, CpuPagedBackend
from engine.attention.torch_paged import TorchPagedBackend

__all__ = [
    "AttentionBackend",
    "AttentionNeeds",
    "CpuPagedBackend",
    "StepMetadata",
    "TorchPagedBackend",
    "UnsupportedAttention",
    "select_backend",
]

logger = logging.getLogger(__name__)


def select_backend(
    name: str, device_type: str, page_size: int, dtype: torch.dtype, needs: AttentionNeeds = NO_NEEDS
) -> AttentionBackend:
    """A backend that computes what the model `needs` (its layers' features, its cache's dtype), else
    `UnsupportedAttention` naming the backend and each need it lacks: an explicit one is refused, `auto` passes
    over a kernel that lacks one to the next, down to the torch backend, which computes every feature.

    `auto` takes the C++ kernel on CPU when it builds here (else plain torch, with one warning), and on CUDA
    flash-attn when it is installed and the page size and dtype suit it, else the Triton kernel when triton is
    installed (torch's CUDA wheels bring it), else plain torch with a warning.

    flash-attn computes in float16 and bfloat16 only, the CPU kernel runs on CPU only and the Triton kernel on
    CUDA only (or on the CPU under Triton's interpreter, `TRITON_INTERPRET=1`, which is how its tests run it):
    asking for one where it cannot run is refused here, when the backend is chosen, not at the first request.
    triton is imported only once it is chosen, so the CPU start-up never pays for it.
    """
    backend = _select(name, device_type, page_size, dtype, needs)
    missing = backend.missing(needs, dtype)
    if missing:
        raise UnsupportedAttention(f"attention_backend={backend.name!r} cannot compute {'; '.join(missing)}")
    return backend


def _select(name: str, device_type: str, page_size: int, dtype: torch.dtype, needs: AttentionNeeds) -> AttentionBackend:
    if name == "torch":
        return TorchPagedBackend()
    if name == "cpu" or (name == "auto" and device_type == "cpu"):
        backend = _cpu_backend(name, device_type, dtype)
        return TorchPagedBackend() if name == "auto" and backend.missing(needs, dtype) else backend
    if name == "triton":
        return _triton_backend(device_type, dtype)
    if name == "auto" and device_type != "cuda":
        return TorchPagedBackend()
    from engine.attention.flash import FLASH_DTYPES, FlashBackend, flash_available

    if name == "flash":
        if dtype not in FLASH_DTYPES:
            raise ValueError(
                f"attention_backend='flash' runs float16 or bfloat16 only, not {dtype}: choose --dtype bfloat16 "
                "(or float16), or --attention-backend triton"
            )
        if device_type != "cuda" or not flash_available():
            raise ValueError("attention_backend='flash' needs a CUDA device and the flash-attn package")
        return FlashBackend(page_size)
    suits_flash = dtype in FLASH_DTYPES and FlashBackend.supports_page_size(page_size)
    if suits_flash and not FlashBackend.missing(needs, dtype) and flash_available():
        return FlashBackend(page_size)
    if _triton_installed():
        from engine.attention.triton_paged import TRITON_DTYPES, TritonPagedBackend

        if dtype in TRITON_DTYPES and not TritonPagedBackend.missing(needs, dtype):
            return _triton_backend(device_type, dtype)
    logger.warning(
        "CUDA without a paged kernel for %s at page_size %d (flash-attn needs float16 or bfloat16, its package "
        "and pages a multiple of %d; the Triton kernel float32, bfloat16 or float16 and the triton package; or the "
        "model needs what neither computes): the torch backend gathers each sequence's pages every step",
        dtype,
        page_size,
        256,
    )
    return TorchPagedBackend()


def _triton_installed() -> bool:
    """Whether triton can be imported, without importing it (a second or so)."""
    return importlib.util.find_spec("triton") is not None


def _triton_backend(device_type: str, dtype: torch.dtype) -> AttentionBackend:
    interpreted = device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    if device_type != "cuda" and not interpreted:
        raise ValueError(
            f"attention_backend='triton' runs on CUDA, not {device_type} (on the CPU only under Triton's "
            "interpreter, TRITON_INTERPRET=1, for tests)"
        )
    if not _triton_installed():
        raise ValueError("attention_backend='triton' needs the triton package (torch's CUDA wheels install it)")
    from engine.attention.triton_paged import TRITON_DTYPES, TritonPagedBackend

    if dtype not in TRITON_DTYPES:
        raise ValueError(f"attention_backend='triton' runs float32, bfloat16 or float16, not {dtype}")
    return TritonPagedBackend()


def _cpu_backend(name: str, device_type: str, dtype: torch.dtype) -> AttentionBackend:
    if device_type != "cpu" or dtype not in CPU_DTYPES:
        if name == "cpu":
            raise ValueError(
                f"attention_backend='cpu' runs on the CPU in float32, bfloat16 or float16, not {device_type} {dtype}"
            )
        return TorchPagedBackend()
    try:
        return CpuPagedBackend(load_kernel())
    except KernelUnavailable as error:
        if name == "cpu":
            raise ValueError(f"attention_backend='cpu': the kernel does not build here: {error}") from error
        _warn_fallback(str(error))
        return TorchPagedBackend()


@functools.cache
def _warn_fallback(error: str) -> None:
    """Once per process: every engine a process builds would otherwise repeat it."""
    logger.warning(
        "the CPU attention kernel does not build here (%s): using the torch backend, which copies each sequence's "
        "pages every step",
        error,
    )
