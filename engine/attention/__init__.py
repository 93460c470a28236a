"""Paged attention backends behind one interface.

A backend turns one step's packed batch into layer-independent metadata once (`prepare`), then each attention
layer calls `forward` with that metadata: it writes the step's new K/V into the pages and attends over each
sequence's pages, block-diagonal and causal, so packing is exactly running each sequence alone.
"""

from __future__ import annotations

import functools
import logging

import torch

from engine.attention.base import AttentionBackend, StepMetadata
from engine.attention.cpu_kernel import KernelUnavailable, load_kernel
from engine.attention.cpu_paged import CPU_DTYPES, CpuPagedBackend
from engine.attention.torch_paged import TorchPagedBackend

__all__ = ["AttentionBackend", "CpuPagedBackend", "StepMetadata", "TorchPagedBackend", "select_backend"]

logger = logging.getLogger(__name__)


def select_backend(name: str, device_type: str, page_size: int, dtype: torch.dtype) -> AttentionBackend:
    """`auto` takes the C++ kernel on CPU when it builds here (else plain torch, with one warning), and on CUDA
    flash-attn when it is installed and the page size and dtype suit it, else plain torch.

    flash-attn computes in float16 and bfloat16 only, and the CPU kernel on CPU only: asking for either where it
    cannot run is refused here, when the backend is chosen, not at the first request.
    """
    if name == "torch":
        return TorchPagedBackend()
    if name == "cpu" or (name == "auto" and device_type == "cpu"):
        return _cpu_backend(name, device_type, dtype)
    if name == "auto" and device_type != "cuda":
        return TorchPagedBackend()
    from engine.attention.flash import FLASH_DTYPES, FlashBackend, flash_available

    if name == "flash":
        if dtype not in FLASH_DTYPES:
            raise ValueError(
                f"attention_backend='flash' runs float16 or bfloat16 only, not {dtype}: choose --dtype bfloat16 "
                "(or float16), or --attention-backend torch"
            )
        if device_type != "cuda" or not flash_available():
            raise ValueError("attention_backend='flash' needs a CUDA device and the flash-attn package")
        return FlashBackend(page_size)
    if dtype not in FLASH_DTYPES:
        logger.info("dtype %s: flash-attn runs float16 and bfloat16 only, so attention uses the torch backend", dtype)
        return TorchPagedBackend()
    if flash_available() and FlashBackend.supports_page_size(page_size):
        return FlashBackend(page_size)
    logger.warning(
        "CUDA without flash-attn paging (flash-attn missing, or page_size %d not a multiple of %d): the torch "
        "backend gathers each sequence's pages every step; install the gpu extra and use --page-size 256",
        page_size,
        256,
    )
    return TorchPagedBackend()


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
