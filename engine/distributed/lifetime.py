"""Child processes that never outlive their parent: the server's engine process and the tensor-parallel workers."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Have Linux SIGKILL this process when its parent dies (a no-op elsewhere, where pipe EOF and failed
    collectives cover the rest); exit at once if the parent is already gone."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the request above took effect
        sys.exit(0)
