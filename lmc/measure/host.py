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
    return f"{model or 'unknown CPU'}, {os.cpu_count()} cores, load average {load_average()}"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as "1.00, 0.50, 0.25" ("?" where the OS has none)."""
    return ", ".join(f"{value:.2f}" for value in os.getloadavg()) if hasattr(os, "getloadavg") else "?"

