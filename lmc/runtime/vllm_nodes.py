"""A vLLM plan across instances: vLLM's own multi-node mode, placed by the cluster's rendezvous.

LeaderWorkerSet starts one `lmc runtime` per instance of a group and tells each its place
(LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX; lmc.runtime.rendezvous reads the same for lmc's
own pipeline). With vLLM, lmc writes no distributed code: every node gives vLLM's multiprocessing
backend its place (`nnodes`, `node_rank`, `master_addr`, `master_port`). The leader (index 0) runs the
engine with the HTTP server, as a one-instance vLLM plan does; the others run vLLM headless, the way
`vllm serve --headless` does (a MultiprocExecutor for their ranks), and serve no HTTP. vLLM places the
ranks: tensor parallel within a node, pipeline parallel across nodes when the plan has stages.

What vLLM does not do, lmc adds: a lifeline, one TCP connection from each worker node to the leader
(LMC_LIFELINE_PORT, default 29510). vLLM notices a lost node only when a request's collective fails;
the leader notices the connection close at once, answers /ping 503 and exits non-zero (so the
LeaderWorkerSet, `RecreateGroupOnPodRestart`, recreates the group). A worker node whose leader stops
(SIGTERM: it says "bye") stops its ranks and exits 0; one whose leader vanished exits 1.

  LMC_VLLM_MASTER_PORT      vLLM's torch.distributed port on the leader (default 29501)
  LMC_LIFELINE_PORT         the lifeline's port on the leader (default 29510)
  LMC_RENDEZVOUS_TIMEOUT_S  how long the nodes wait for each other (default 900 s)
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from lmc.layouts import data_parallel_degree, instances_per_copy, parallel_layout, pipeline_degree
from lmc.runtime.rendezvous import LWS_ENV, RendezvousError, integer_env, rendezvous_timeout

log = logging.getLogger("lmc.runtime")

DEFAULT_MASTER_PORT = 29501
DEFAULT_LIFELINE_PORT = 29510
BYE = b"bye\n"


@dataclass(frozen=True)
class VllmNode:
    """This instance's place in a vLLM deployment across `nodes` instances."""

    index: int  # LWS_WORKER_INDEX: vLLM's node_rank; 0 serves HTTP
    nodes: int  # LWS_GROUP_SIZE: vLLM's nnodes
    leader: str  # LWS_LEADER_ADDRESS: vLLM's master_addr
    master_port: int
    lifeline_port: int
    timeout_s: float

    @property
    def is_leader(self) -> bool:
        return self.index == 0

    def engine_arguments(self) -> dict[str, Any]:
        """What vLLM's multi-node mode needs beside the plan's engine arguments."""
        return {"nnodes": self.nodes, "node_rank": self.index, "master_addr": self.leader,
                "master_port": self.master_port}

    def describe(self) -> str:
        return f"vLLM node {self.index} of {self.nodes} (leader {self.leader}:{self.master_port})"

    def watch(self, on_lost: Callable[[str], None]) -> "Lifeline":
        """The leader's lifeline to the worker nodes, started."""
        lifeline = Lifeline(self, on_lost)
        lifeline.start()
        return lifeline


def resolve_vllm_node(plan: Mapping[str, Any], environ: Mapping[str, str]) -> VllmNode | None:
    """This node's place for a vLLM plan (None: one instance, nothing to join); a one-line
    RendezvousError when the rendezvous is missing or cannot place the plan's ranks."""
    plan = dict(plan)
    stages, dp, copy = pipeline_degree(plan), data_parallel_degree(plan), instances_per_copy(plan)
    layout = parallel_layout(plan["tensor_parallel_degree"], dp, stages)
    present = [name for name in LWS_ENV if environ.get(name)]
    if not present:
        if copy > 1:
            raise RendezvousError(f"the plan runs on {copy} instances ({layout}) but {', '.join(LWS_ENV)} are not "
                                  f"set: run it as a LeaderWorkerSet of size {copy} (lmc deploy --target kubernetes)")
        return None
    missing = [name for name in LWS_ENV if name not in present]
    if missing:
        raise RendezvousError(f"{', '.join(missing)} not set beside {', '.join(present)}: the LeaderWorkerSet's "
                              "environment is incomplete")
    nodes, index = integer_env(environ, "LWS_GROUP_SIZE"), integer_env(environ, "LWS_WORKER_INDEX")
    world = int(plan["tensor_parallel_degree"]) * stages * dp
    if nodes < 1 or world % nodes:
        raise RendezvousError(f"LWS_GROUP_SIZE = {nodes} does not divide the plan's {world} vLLM ranks "
                              f"({layout}) into equal nodes")
    if copy > 1 and nodes != copy:
        raise RendezvousError(f"LWS_GROUP_SIZE = {nodes}, but the plan lays its {layout} ranks on {copy} "
                              f"instances: the LeaderWorkerSet's size must be {copy}")
    if not 0 <= index < nodes:
        raise RendezvousError(f"LWS_WORKER_INDEX = {index}: outside the group of {nodes} (0 … {nodes - 1})")
    if nodes == 1:
        return None
    return VllmNode(index=index, nodes=nodes, leader=environ["LWS_LEADER_ADDRESS"],
                    master_port=_port(environ, "LMC_VLLM_MASTER_PORT", DEFAULT_MASTER_PORT),
                    lifeline_port=_port(environ, "LMC_LIFELINE_PORT", DEFAULT_LIFELINE_PORT),
                    timeout_s=rendezvous_timeout(environ))


def _port(environ: Mapping[str, str], name: str, default: int) -> int:
    port = integer_env(environ, name) if environ.get(name) else default
    if not 0 < port < 65536:
        raise RendezvousError(f"{name} = {port}: not a TCP port number")
    return port


def _close_in_forked_children(sockets: Callable[[], list[socket.socket]]) -> None:
    """vLLM forks its engine and worker processes: a lifeline socket they inherited would keep the
    connection open after this process died, and the other end would never hear of it."""
    def close_all() -> None:
        for sock in sockets():
            try:
                sock.close()
            except OSError:
                pass
    os.register_at_fork(after_in_child=close_all)


class Lifeline:
    """The leader's end: accepts the worker nodes' connections and calls `on_lost(why)` (from its own
    thread) the moment one closes, or when they have not all joined within the timeout."""

    def __init__(self, node: VllmNode, on_lost: Callable[[str], None]):
        self.node, self.on_lost = node, on_lost
        self._server = socket.create_server(("", node.lifeline_port), reuse_port=False)
        self._peers: dict[socket.socket, int] = {}
        self._closing = False
        self._thread = threading.Thread(target=self._watch, name="lmc-lifeline", daemon=True)
        _close_in_forked_children(lambda: [self._server, *self._peers])

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._server, selectors.EVENT_READ)
        deadline = time.monotonic() + self.node.timeout_s
        try:
            while not self._closing:
                if len(self._peers) < self.node.nodes - 1 and time.monotonic() > deadline:
                    self._lost(f"{self.node.nodes - 1 - len(self._peers)} worker node(s) never joined within "
                               f"{self.node.timeout_s:g}s (LMC_RENDEZVOUS_TIMEOUT_S)")
                    return
                for key, _ in selector.select(timeout=0.5):
                    if key.fileobj is self._server:
                        peer, _ = self._server.accept()
                        index = _read_index(peer)
                        self._peers[peer] = index
                        selector.register(peer, selectors.EVENT_READ)
                        log.info("vLLM node %d of %d joined the group", index, self.node.nodes)
                        continue
                    peer = key.fileobj
                    if not _alive(peer):  # a worker's end closed: its node is gone
                        self._lost(f"vLLM node {self._peers.get(peer, '?')} left the group (its lifeline closed)")
                        return
        except OSError as exc:
            if not self._closing:
                self._lost(f"the lifeline failed: {exc}")

    def _lost(self, why: str) -> None:
        if not self._closing:
            self.on_lost(why)

    def close(self) -> None:
        """An orderly stop: every worker node is told to stop its ranks and exit 0."""
        self._closing = True
        for peer in list(self._peers):
            try:
                peer.sendall(BYE)
                peer.close()
            except OSError:
                pass
        self._server.close()


def _read_index(peer: socket.socket) -> int:
    peer.settimeout(10)
    data = b""
    while not data.endswith(b"\n") and len(data) < 32:
        chunk = peer.recv(32)
        if not chunk:
            break
        data += chunk
    peer.settimeout(None)
    try:
        return int(data.strip())
    except ValueError:
        return -1


def _alive(peer: socket.socket) -> bool:
    try:
        return bool(peer.recv(64, socket.MSG_PEEK))
    except OSError:
        return False


def join_leader(node: VllmNode) -> socket.socket:
    """A worker node's end of the lifeline, retried until the leader listens (within the timeout)."""
    deadline = time.monotonic() + node.timeout_s
    while True:
        try:
            connection = socket.create_connection((node.leader, node.lifeline_port), timeout=5)
            connection.settimeout(None)
            connection.sendall(f"{node.index}\n".encode())
            _close_in_forked_children(lambda: [connection])
            return connection
        except OSError as exc:
            if time.monotonic() > deadline:
                raise RendezvousError(f"the leader {node.leader}:{node.lifeline_port} never answered within "
                                      f"{node.timeout_s:g}s: {exc}") from None
            time.sleep(1.0)


def run_worker_node(arguments: dict[str, Any], environment: dict[str, str], node: VllmNode) -> int:
    """A worker node: hold the lifeline, then run this node's vLLM ranks headless (as `vllm serve
    --headless` does) with the plan's engine `arguments` and `environment` (lmc.runtime.vllm_backend),
    until the leader stops (exit 0) or vanishes (exit 1)."""
    lifeline = join_leader(node)
    outcome = {"code": 1}

    def watch() -> None:
        data = b""
        try:
            while True:
                chunk = lifeline.recv(64)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
        outcome["code"] = 0 if data.startswith(BYE) else 1
        log.info("the leader %s; stopping this node's vLLM ranks", "stopped" if outcome["code"] == 0 else "is gone")
        os.kill(os.getpid(), signal.SIGTERM)

    def stop(signum, frame) -> None:
        raise SystemExit

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    threading.Thread(target=watch, name="lmc-lifeline", daemon=True).start()
    os.environ.update(environment)
    if int(arguments.get("data_parallel_size") or 1) > 1:
        return _run_data_parallel_node(arguments, node, lifeline, outcome)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    config = AsyncEngineArgs(**arguments, **node.engine_arguments()).create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER, headless=True)
    log.info("%s: running this node's vLLM ranks headless", node.describe())
    executor = None
    try:
        executor = MultiprocExecutor(config, monitor_workers=False)
        executor.start_worker_monitor(inline=True)
    except SystemExit:
        pass
    finally:
        if executor is not None:
            executor.shutdown()
        lifeline.close()
    return outcome["code"]


def _run_data_parallel_node(arguments: dict[str, Any], node: VllmNode, lifeline: socket.socket,
                            outcome: dict[str, int]) -> int:
    """A worker node of a data-parallel plan: its whole DP groups (vLLM infers which from nnodes and
    node_rank) run as `vllm serve --headless` runs them, by vLLM's own run_headless: engine cores that
    hand-shake with the leader's front end over the data-parallel RPC port (the master address). vLLM's
    SIGTERM handler stops them; the lifeline's end sends that signal."""
    from vllm.entrypoints.cli.serve import run_headless
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from lmc.runtime.vllm_backend import cli_flags

    argv = cli_flags({**arguments, **node.engine_arguments(), "headless": True})
    args = make_arg_parser(FlexibleArgumentParser(prog="lmc runtime")).parse_args(argv)
    args.api_server_count = 0  # headless: no API server on this node (as `vllm serve --headless` sets)
    log.info("%s: running this node's data-parallel engines headless", node.describe())
    try:
        run_headless(args)
    except SystemExit:
        pass
    finally:
        lifeline.close()
    return outcome["code"]
