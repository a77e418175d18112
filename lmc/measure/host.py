"""What a measurement ran on: figures taken on a shared host move with its load, so they say so."""

from __future__ import annotations

import os
from pathlib import Path


def host_line() -> str:
    """The CPU model, its cores and the load when measured: figures on a shared host move with it."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return f"{model or 'unknown CPU'}, {os.cpu_count()} cores, load average {load}"

