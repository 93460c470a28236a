"""The cyclic garbage collector around a process's start-up imports.

Importing torch and transformers (the engine process) or the web stack (the front end) makes 290-520 thousand
objects, and the collector's full passes rescan all of them as they pile up: measured on the demo model, the engine
process's imports and model took 3.1-3.6 s with it and 2.6 s without; the front end's imports and tokenizer 1.8-2.1
against 1.55 s. What the imports made then lives as long as the process, so it is frozen (never scanned again)
rather than collected once more: a full pass over it costs 0.16-0.26 s of a start, and the cyclic garbage it would
free is what the imports left, about 9,000 objects and 1.2 MB (measured). Nothing large is made while paused: the
weights load after.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_collector() -> Iterator[None]:
    """Run the block without the cyclic collector, then freeze every object alive and resume collecting."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
