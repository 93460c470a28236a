"""Paged attention backends behind one interface.

A backend turns one step's packed batch into layer-independent metadata once (`prepare`), then each attention
layer calls `forward` with that metadata: it writes the step's new K/V into the pages and attends over each
sequence's pages, block-diagonal and causal, so packing is exactly running each sequence alone.
"""

from __future__ import annotations

import logging

from engine.attention.base import AttentionBackend, StepMetadata
from engine.attention.torch_paged import TorchPagedBackend

__all__ = ["AttentionBackend", "StepMetadata", "TorchPagedBackend", "select_backend"]

logger = logging.getLogger(__name__)


def select_backend(name: str, device_type: str, page_size: int) -> AttentionBackend:
    """`auto` takes flash-attn on CUDA when it is installed and the page size suits it, else plain torch."""
    if name == "torch" or (name == "auto" and device_type != "cuda"):
        return TorchPagedBackend()
    from engine.attention.flash import FlashBackend, flash_available

    if name == "flash":
        if device_type != "cuda" or not flash_available():
            raise ValueError("attention_backend='flash' needs a CUDA device and the flash-attn package")
        return FlashBackend(page_size)
    if flash_available() and FlashBackend.supports_page_size(page_size):
        return FlashBackend(page_size)
    logger.warning(
        "CUDA without flash-attn paging (flash-attn missing, or page_size %d not a multiple of %d): the torch "
        "backend gathers each sequence's pages every step; install the gpu extra and use --page-size 256",
        page_size,
        256,
    )
    return TorchPagedBackend()
