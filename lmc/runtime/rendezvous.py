"""The rendezvous the cluster provides, for a plan across instances (lmc.runtime.vllm_nodes, vLLM's
multi-node mode; lmc.runtime.vllm_ray reads Ray's). Pure: no torch.

Kubernetes' LeaderWorkerSet starts one `lmc runtime` per instance of a group and tells each pod, in its
environment:

  LWS_LEADER_ADDRESS  the leader pod's address
  LWS_GROUP_SIZE      pods in the group
  LWS_WORKER_INDEX    this pod's index, 0 for the leader

  LMC_RENDEZVOUS_TIMEOUT_S   how long a node waits for the others to join (default 900 s)
"""

from __future__ import annotations

from typing import Mapping

from lmc.errors import LmcError

DEFAULT_TIMEOUT_S = 900.0
LWS_ENV = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")


class RendezvousError(LmcError):
    """The cluster's rendezvous is missing, disagrees with the plan, or the other nodes never came."""


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
