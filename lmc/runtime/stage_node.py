"""`lmc runtime` on a pipeline worker node (LWS_WORKER_INDEX > 0): no HTTP, only this node's stage.

The node starts its stage's TP ranks (the same worker processes the leader runs, lmc.runtime.workers)
and waits for them. They join the pipeline's torch.distributed world at the leader, load this stage's
shard and serve steps until the leader says stop (its drain ended): then they exit 0, and so does
`lmc runtime`. A rank that cannot join or load, or dies, ends `lmc runtime` with one line and exit 1:
the group is restarted as a whole by the cluster (a LeaderWorkerSet's RecreateGroupOnPodRestart), as
a torch.distributed world cannot take a new member in place of a dead one.
"""

from __future__ import annotations

import logging
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from lmc.runtime.rendezvous import PipelineRole
from lmc.runtime.workers import (FATAL_LOAD_EXIT, ModelLoadError, device_kind, mp_context, processes_per_group,
                                 worker_main, worker_spec)

log = logging.getLogger("lmc.runtime")


def run_stage_node(model_dir: Path, plan: dict[str, Any], role: PipelineRole) -> int:
    """Run this node's stage until the leader stops it (returns 0). Raises ModelLoadError (one line)."""
    context = mp_context(plan)
    backend = "nccl" if device_kind(plan) == "gpu" else "gloo"
    parent, child = context.Pipe(duplex=True)
    lifeline_read, lifeline = context.Pipe(duplex=False)  # closed when this process ends: the ranks exit
    procs = []
    for rank in range(processes_per_group(plan)):
        spec = worker_spec(model_dir, plan, 0, rank, backend, role.port, role)
        proc = context.Process(target=worker_main, args=(spec, child if rank == 0 else None, None, lifeline_read),
                               name=f"lmc-stage{role.stage}-r{rank}", daemon=True)
        proc.start()
        procs.append(proc)
    child.close()
    lifeline_read.close()
    log.info("%s: started %d rank(s); waiting for the leader", role.describe(), len(procs))
    reason = ""
    try:
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(procs)}
        while sentinels:
            ready = wait([*([parent] if parent is not None else []), *sentinels], timeout=5.0)
            if parent is not None and parent in ready:
                try:
                    message = parent.recv()
                except (EOFError, OSError):
                    parent.close()
                    parent = None
                else:
                    if message[0] == "ready":
                        log.info("%s: loaded and joined; serving steps", role.describe())
                    elif message[0] == "load_failed":
                        reason = message[1]
            for sentinel in [s for s in ready if s in sentinels]:
                rank = sentinels.pop(sentinel)
                procs[rank].join(1.0)
                code = procs[rank].exitcode
                if code != 0:
                    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                    if not reason:
                        reason = f"rank {rank} died ({how})" + (" (its log line above says why)"
                                                                 if code == FATAL_LOAD_EXIT else "")
                    raise ModelLoadError(reason if reason.startswith(role.describe()) else f"{role.describe()}: {reason}", 1)
    finally:
        lifeline.close()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5.0)
    log.info("%s: the leader stopped the pipeline", role.describe())
    return 0
