"""lmc.runtime.process_group: processes spawned under own_group() leave the spawner's process group (a signal
to that group misses them, one to their pid still arrives) and get SIGTERM when the spawner dies."""

from __future__ import annotations

import multiprocessing
import multiprocessing.spawn
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lmc.runtime.process_group import WRAPPER, own_group

ROOT = Path(__file__).resolve().parents[1]


def _report(queue) -> None:
    queue.put((os.getpid(), os.getpgid(0), os.getsid(0)))


def test_a_spawned_process_runs_in_a_group_of_its_own_and_the_executable_is_restored():
    assert os.access(WRAPPER, os.X_OK)  # multiprocessing executes it
    context = multiprocessing.get_context("spawn")
    before = multiprocessing.spawn.get_executable()
    queue = context.Queue()
    with own_group():
        child = context.Process(target=_report, args=(queue,))
        child.start()
        pid, group, session = queue.get(timeout=60)
        child.join(60)
    assert child.exitcode == 0 and pid == child.pid
    assert group == pid != os.getpgid(0) and session == os.getsid(0)  # its own group, the same session
    assert multiprocessing.spawn.get_executable() == before
    assert "LMC_OWN_GROUP_PYTHON" not in os.environ and "LMC_OWN_GROUP_PARENT" not in os.environ
    with_plain = context.Process(target=_report, args=(queue,))
    with_plain.start()
    assert queue.get(timeout=60)[1] == os.getpgid(0)  # outside the block: the spawner's group, as before
    with_plain.join(60)


_SPAWNER = textwrap.dedent("""
    import multiprocessing, os, signal, sys, time
    from pathlib import Path
    from lmc.runtime.process_group import own_group

    def child(marker):
        import signal, sys, time
        from pathlib import Path
        # Like vLLM's engine core: it acts on SIGINT and SIGTERM.
        signal.signal(signal.SIGINT, lambda *a: Path(marker).write_text("SIGINT"))
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
        time.sleep(600)

    if __name__ == "__main__":
        with own_group():
            process = multiprocessing.get_context("spawn").Process(target=child, args=(sys.argv[1],))
            process.start()
        signal.signal(signal.SIGINT, lambda *a: (time.sleep(1), os._exit(0)))  # no multiprocessing clean-up
        print(process.pid, flush=True)
        time.sleep(600)
""")


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_a_group_signal_misses_the_child_and_the_spawners_death_ends_it(tmp_path):
    script, marker = tmp_path / "spawner.py", tmp_path / "child-had-sigint"
    script.write_text(_SPAWNER)
    spawner = subprocess.Popen([sys.executable, str(script), str(marker)], stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)
    child = None
    try:
        child = int(spawner.stdout.readline())
        deadline = time.monotonic() + 30  # own_group.sh and its Python run first: a fraction of a second
        while time.monotonic() < deadline and os.getpgid(child) != child:
            time.sleep(0.01)
        assert os.getpgid(child) == child != spawner.pid
        time.sleep(1)  # the child's handlers are in place (its interpreter started and imported)
        os.killpg(spawner.pid, signal.SIGINT)  # the spawner's group: the spawner alone
        assert spawner.wait(30) == 0
        assert not marker.exists()
        deadline = time.monotonic() + 30  # its parent gone, the child had SIGTERM and exits
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        for pid in (spawner.pid, child):
            try:
                if pid is not None:
                    os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        spawner.wait(30)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie left for init to reap counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
