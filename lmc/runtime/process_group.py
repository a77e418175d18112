"""vLLM's engine processes in a process group of their own, so that only lmc's front end decides when
they stop.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group; `tini -g`, dumb-init and
systemd's control-group stop send SIGTERM to every process. vLLM's engine core takes either as "shut
down now" (with its default `--shutdown-timeout 0` it aborts every request in flight) and its workers
exit on it, so a group signal cut streams off mid-answer while the front end meant to drain them.

`vllm serve` itself leaves its engine core in the server's group; only its data-parallel supervisor moves
its servers to groups of their own (`os.setpgrp()`, "so that CTRL-C is propagated cleanly"). lmc does
that for the engine core: while `own_group()` is active, multiprocessing spawns through
`own_group.sh` (the way vLLM's NUMA binding spawns through its `numa_wrapper.sh`), which runs this
module: the new process leaves the caller's group, asks the kernel for SIGTERM when its parent dies, and
becomes the Python multiprocessing meant to start. The engine core's workers, spawned by it, join its
group. A signal to the front end's group then reaches the front end alone; the front end drains and
stops the engine as it always does (vLLM's engine client sends SIGTERM to the engine core's pid, which
still arrives).
"""

from __future__ import annotations

import contextlib
import multiprocessing.spawn
import os
import signal
import sys
from pathlib import Path
from typing import Iterator

from lmc.environ import environ

WRAPPER = Path(__file__).with_name("own_group.sh")
PYTHON_ENV = "LMC_OWN_GROUP_PYTHON"  # the interpreter own_group.sh starts
PARENT_ENV = "LMC_OWN_GROUP_PARENT"  # the pid of the process that spawned it
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@contextlib.contextmanager
def own_group() -> Iterator[None]:
    """Processes spawned by multiprocessing (spawn start method) while this is active start in process
    groups of their own. Main thread only (multiprocessing's executable is process-wide)."""
    previous = os.fsdecode(multiprocessing.spawn.get_executable())
    with environ(**{PYTHON_ENV: previous, PARENT_ENV: str(os.getpid())}):
        multiprocessing.spawn.set_executable(str(WRAPPER))
        try:
            yield
        finally:
            multiprocessing.spawn.set_executable(previous)


def _die_with_parent(parent: int) -> None:
    """SIGTERM to this process when its parent dies (vLLM's engine core shuts down on it), as it would
    have had from the parent's group otherwise. Linux only; elsewhere nothing."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> None:
    """own_group.sh's work: leave the parent's process group, then exec the interpreter with `argv`."""
    os.setpgid(0, 0)
    parent = os.environ.pop(PARENT_ENV, "")
    if parent.isdigit():
        _die_with_parent(int(parent))
    python = os.environ.pop(PYTHON_ENV, "") or sys.executable
    os.execv(python, [python, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
