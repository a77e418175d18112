"""Which pipeline stage this node runs, from the rendezvous the cluster provides. Pure: no torch.

A plan with pipeline degree P > 1 runs on P instances (nodes), each running `lmc runtime` on the same
artifact. Kubernetes' LeaderWorkerSet starts them as one group and tells each pod, in its environment:

  LWS_LEADER_ADDRESS  the leader pod's address (the group's torch.distributed store runs there)
  LWS_GROUP_SIZE      pods in the group: must equal the plan's pipeline degree
  LWS_WORKER_INDEX    this pod's index, 0 for the leader: the pipeline stage it runs

The leader (stage 0) serves HTTP and drives generation; the others only compute their stage. The
node's TP ranks are global ranks stage·TP … stage·TP + TP − 1 of one torch.distributed world of P·TP
processes (MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK in torch's terms, derived from the above).

  LMC_RENDEZVOUS_PORT        the store's port on the leader (default MASTER_PORT, else 29500, torchrun's)
  LMC_RENDEZVOUS_TIMEOUT_S   how long a node waits for the others to join (default 900 s)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from lmc.errors import LmcError
from lmc.layouts import pipeline_degree

DEFAULT_PORT = 29500
DEFAULT_TIMEOUT_S = 900.0
LWS_ENV = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")


class RendezvousError(LmcError):
    """The cluster's rendezvous is missing, disagrees with the plan, or the other nodes never came."""


@dataclass(frozen=True)
class PipelineRole:
    """This node's place in a pipeline-parallel deployment."""

    stage: int  # LWS_WORKER_INDEX: 0 is the leader
    stages: int  # the plan's pipeline degree (= LWS_GROUP_SIZE)
    tp: int  # TP ranks per stage (processes on this node)
    leader_address: str
    port: int
    timeout_s: float

    @property
    def world_size(self) -> int:
        return self.stages * self.tp

    @property
    def is_leader(self) -> bool:
        return self.stage == 0

    def global_rank(self, local_rank: int) -> int:
        return self.stage * self.tp + local_rank

    def describe(self) -> str:
        return f"pipeline stage {self.stage} of {self.stages} (leader {self.leader_address}:{self.port})"


def resolve_role(plan: Mapping[str, Any], environ: Mapping[str, str]) -> PipelineRole | None:
    """This node's role for `plan` (None: a one-instance plan, nothing to join). Raises RendezvousError
    (one line) when the environment lacks the rendezvous or disagrees with the plan."""
    stages = pipeline_degree(dict(plan))
    if stages == 1:
        return None
    missing = [name for name in LWS_ENV if not environ.get(name)]
    if missing:
        raise RendezvousError(f"the plan runs on {stages} instances (pipeline parallel degree {stages}) but "
                              f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: run it as a "
                              f"LeaderWorkerSet of size {stages} (lmc deploy --target kubernetes)")
    size = integer_env(environ, "LWS_GROUP_SIZE")
    index = integer_env(environ, "LWS_WORKER_INDEX")
    if size != stages:
        raise RendezvousError(f"LWS_GROUP_SIZE = {size}, but the plan's pipeline parallel degree is {stages}: "
                              f"the LeaderWorkerSet's size must be {stages}")
    if not 0 <= index < size:
        raise RendezvousError(f"LWS_WORKER_INDEX = {index}: outside the group of {size} (0 … {size - 1})")
    port_name = "LMC_RENDEZVOUS_PORT" if environ.get("LMC_RENDEZVOUS_PORT") else "MASTER_PORT"
    port = integer_env(environ, port_name) if environ.get(port_name) else DEFAULT_PORT
    if not 0 < port < 65536:
        raise RendezvousError(f"{port_name} = {port}: not a TCP port number")
    return PipelineRole(stage=index, stages=stages, tp=int(plan["tensor_parallel_degree"]),
                        leader_address=environ["LWS_LEADER_ADDRESS"], port=port, timeout_s=rendezvous_timeout(environ))


def rendezvous_timeout(environ: Mapping[str, str]) -> float:
    """LMC_RENDEZVOUS_TIMEOUT_S (default 900 s): how long a node waits for the others."""
    timeout = DEFAULT_TIMEOUT_S
    if environ.get("LMC_RENDEZVOUS_TIMEOUT_S"):
        try:
            timeout = float(environ["LMC_RENDEZVOUS_TIMEOUT_S"])
        except ValueError:
            timeout = -1.0
        if not 0 < timeout < float("inf"):
            raise RendezvousError(f"LMC_RENDEZVOUS_TIMEOUT_S = {environ['LMC_RENDEZVOUS_TIMEOUT_S']!r}: "
                                  "not a positive number of seconds")
    return timeout


def integer_env(environ: Mapping[str, str], name: str) -> int:
    value = environ[name].strip()
    if not value.lstrip("-").isdigit():
        raise RendezvousError(f"{name} = {environ[name]!r}: not an integer")
    return int(value)
