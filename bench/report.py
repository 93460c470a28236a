"""Plain-text tables and the machine description every saved result carries."""

from __future__ import annotations

import datetime
import os
import platform
import sys


def machine() -> dict[str, object]:
    # Imported here: the `ferry` command line imports this module (through its subcommands' defaults) and must not
    # pay for torch and transformers before `ferry serve` has spawned its engine.
    import torch
    import transformers

    info: dict[str, object] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def stamp() -> dict[str, object]:
    """When, where and with what command a result was produced."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "machine": machine(),
    }


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned first column, right-aligned numbers, two spaces between columns."""
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        first = str(cells[0]).ljust(widths[0])
        return "  ".join([first, *(str(c).rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))]).rstrip()

    rule = "-" * len(line(headers))
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "" if value is None else f"{value:,.{digits}f}{suffix}"
