"""Peak memory of a server's worker processes, sampled while the bench runs.

On CPU: the resident set (RSS) of every process under the server's (the fork server, each rank),
read from /proc every 50 ms, and at the end each one's kernel-kept peak (VmHWM), which no sampling
interval can miss. The worker figure is the largest single process: a TP rank, what the plan's
per-device memory describes. On GPU: device memory per process as nvidia-smi reports it
(`--query-compute-apps`), sampled the same way.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path


def _status_kib(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def descendants(root: int) -> list[int]:
    """Every process under `root` (not `root` itself), from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return sorted(found)


def parse_nvidia_smi(text: str) -> dict[int, int]:
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits` → {pid: bytes}."""
    used: dict[int, int] = {}
    for line in text.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            used[int(parts[0])] = used.get(int(parts[0]), 0) + int(parts[1]) * 2**20
    return used


class PeakMemory:
    """Samples the processes under `root` in a thread; `mark()` starts a new window (a concurrency
    level), `window_peak()` is the largest process seen in it, `overall()` the whole run's."""

    def __init__(self, root: int, device: str = "cpu", interval_s: float = 0.05):
        self.root = root
        self.device = device
        self.interval_s = interval_s
        self.source = ("nvidia-smi used_memory per process" if device == "gpu"
                       else "RSS per process under the server (/proc, every 50 ms; VmHWM at the end)")
        self._peaks: dict[int, int] = {}
        self._window: dict[int, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lmc-bench-memory", daemon=True)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.final()
        self._stop.set()
        self._thread.join(timeout=5)

    def _sample(self) -> dict[int, int]:
        pids = descendants(self.root)
        if self.device == "gpu":
            if shutil.which("nvidia-smi") is None:
                return {}
            result = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                    capture_output=True, text=True, timeout=10)
            used = parse_nvidia_smi(result.stdout)
            return {pid: used[pid] for pid in pids if pid in used}
        sizes = {}
        for pid in pids:
            kib = _status_kib(pid, "VmRSS")
            if kib:
                sizes[pid] = kib * 1024
        return sizes

    def _record(self, sizes: dict[int, int]) -> None:
        with self._lock:
            for pid, size in sizes.items():
                self._peaks[pid] = max(self._peaks.get(pid, 0), size)
                self._window[pid] = max(self._window.get(pid, 0), size)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._record(self._sample())

    def final(self) -> None:
        """Fold in each live process's kernel-kept peak (CPU): nothing between samples is missed."""
        self._record(self._sample())
        if self.device != "gpu":
            self._record({pid: kib * 1024 for pid in descendants(self.root)
                          if (kib := _status_kib(pid, "VmHWM"))})

    def mark(self) -> None:
        with self._lock:
            self._window = {}

    def window_peak(self) -> int | None:
        self._record(self._sample())
        with self._lock:
            return max(self._window.values(), default=None)

    def overall(self) -> dict[int, int]:
        with self._lock:
            return dict(self._peaks)
