"""Paged attention backends behind one interface.

A backend turns one step's packed batch into layer-independent metadata once (`prepare`), then each attention
layer calls `forward` with that metadata: it writes the step's new K/V into the pages and attends over each
sequence's pages, block-diagonal and causal, so packing is exactly running each sequence alone.
"""

from __future__ import annotations

import logging

import torch

from engine.attention.base import AttentionBackend, StepMetadata
from engine.attention.torch_paged import TorchPagedBackend

__all__ = ["AttentionBackend", "StepMetadata", "TorchPagedBackend", "select_backend"]

logger = logging.getLogger(__name__)


def select_backend(name: str, device_type: str, page_size: int, dtype: torch.dtype) -> AttentionBackend:
    """`auto` takes flash-attn on CUDA when it is installed and the page size and dtype suit it, else plain torch.

    flash-attn computes in float16 and bfloat16 only: asking for it with another dtype is refused here, when the
    backend is chosen, not at the first request.
    """
    if name == "torch" or (name == "auto" and device_type != "cuda"):
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
