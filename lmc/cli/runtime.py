"""`lmc runtime [serve] [--model-dir DIR | ARCHIVE] [--port N] [--host H]`: the container entrypoint.

SageMaker starts the container as `<entrypoint> serve`; with no path the artifact is /opt/ml/model
and the port SAGEMAKER_BIND_TO_PORT or 8080. The artifact is verified (every file's size and
sha256) before any worker starts.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from pathlib import Path

from lmc.errors import EXIT_INTERRUPTED, UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("words", nargs="*", metavar="[serve] [ARCHIVE|DIR]",
                        help="`serve` (as SageMaker passes it) and/or a model.tar.gz or artifact directory")
    parser.add_argument("--model-dir", type=Path, default=None, help="artifact directory (default /opt/ml/model)")
    parser.add_argument("--port", type=int, default=None, help="port (default $SAGEMAKER_BIND_TO_PORT or 8080)")
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    parser.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                        help="per-request timeout (default $LMC_REQUEST_TIMEOUT_S, else derived from the plan)")
    parser.add_argument("--max-body-bytes", type=int, default=None,
                        help="largest request body accepted (default $LMC_MAX_BODY_BYTES or 6 MB, SageMaker's payload limit)")
    parser.add_argument("--generation-config", choices=("auto", "none"), default=None,
                        help="auto: the model's generation_config.json sets the OpenAI routes' sampling defaults "
                             "(temperature, top_p, top_k, repetition_penalty, chat max_tokens), as in vLLM; "
                             "none: OpenAI's defaults (default $LMC_GENERATION_CONFIG or auto)")


def _artifact_path(args: argparse.Namespace) -> Path | None:
    words = [w for w in args.words if w != "serve"]
    if len(words) > 1:
        raise UsageError(f"runtime takes one ARCHIVE or DIR, got {len(words)}: {' '.join(words)}")
    if words and args.model_dir is not None:
        raise UsageError("give either --model-dir or ARCHIVE, not both")
    return Path(words[0]) if words else args.model_dir


def _float_env(name: str) -> float | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return _positive(name, float(value))
    except ValueError:
        raise UsageError(f"{name} = {value!r}: not a number") from None


def _generation_config(flag: str | None) -> str:
    value = flag or os.environ.get("LMC_GENERATION_CONFIG") or "auto"
    if value not in ("auto", "none"):
        raise UsageError(f"LMC_GENERATION_CONFIG = {value!r}: must be auto or none")
    return value


def _positive(name: str, value: float | None) -> float | None:
    """`value` unless it is zero, negative, infinite or NaN (a usage error); None passes through."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise UsageError(f"{name} = {value!r}: must be a positive number")
    return value


class _Terminated(BaseException):
    """SIGTERM before the server serves (extracting, verifying, starting workers): nothing is in flight,
    so stop what was started and exit 0, as a drain with nothing to drain would."""


def _terminate(signum, frame) -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the cleanup short
    raise _Terminated()


def run(args: argparse.Namespace) -> int:
    import signal

    # Until uvicorn installs its own handler (serve), SIGTERM unwinds start-up through every cleanup
    # below: the default action would leave workers waiting at the gate and an extracted archive behind.
    default_sigterm = signal.signal(signal.SIGTERM, _terminate)
    try:
        # Before start-up's imports (a second and more): a SIGTERM among them is still said in the log.
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return _run(args)
    except _Terminated:
        logging.getLogger("lmc.runtime").info("SIGTERM during start-up: stopped before serving")
        return 0
    finally:
        signal.signal(signal.SIGTERM, default_sigterm)


def _run(args: argparse.Namespace) -> int:
    from lmc.runtime.startup import open_artifact, resolve_port
    from lmc.runtime.workers import start_process_server

    path = _artifact_path(args)
    port = resolve_port(args.port)
    timeout = _positive("--request-timeout", args.request_timeout) or _float_env("LMC_REQUEST_TIMEOUT_S")
    max_body = _positive("--max-body-bytes", args.max_body_bytes) or _float_env("LMC_MAX_BODY_BYTES")
    generation_config = _generation_config(args.generation_config)
    artifact = open_artifact(path, check_hashes=False)  # the manifest, every file present, sizes
    try:
        if artifact.plan.get("engine") == "vllm":
            return _run_vllm(artifact, args, port, timeout, max_body, generation_config)
        _refuse_lmc_pipeline(artifact.plan)
        # First, so the engine's imports (seconds) overlap everything else: on CPU hosts the fork server
        # imports them once and every rank is forked from it. It touches nothing from the artifact.
        start_process_server(artifact.plan)
        from lmc.runtime.server import listen_socket

        sock = listen_socket(args.host, port)  # after the fork server starts: it never holds the socket
        try:
            cut_short, runtime = _serve_lmc(artifact, args.host, sock, timeout, max_body, generation_config)
        finally:
            sock.close()
        if runtime.scheduler.fatal is not None:
            raise runtime.scheduler.fatal  # one line, its exit code (the workers are stopped by now)
    finally:
        artifact.cleanup()
    return EXIT_INTERRUPTED if cut_short else 0


def _serve_lmc(artifact, host: str, sock, timeout: float | None, max_body: float | None,
               generation_config: str):
    """lmc's own front end over the artifact's worker groups, on `sock`, until it stops: (cut short, runtime)."""
    from lmc.runtime.server import DEFAULT_MAX_BODY_BYTES, Runtime, serve
    from lmc.runtime.startup import default_request_timeout_s
    from lmc.runtime.workers import mp_context

    timeout = timeout or default_request_timeout_s(artifact.plan)
    max_body = int(max_body or DEFAULT_MAX_BODY_BYTES)
    # Workers start now and wait at the gate; they touch nothing from the artifact (not even
    # model.py) until every file's sha256 is verified.
    gate = mp_context(artifact.plan).Event()
    # None: the Runtime reads the model's generation_config.json itself.
    runtime = Runtime(artifact.model_dir, artifact.plan, request_timeout_s=timeout, max_body_bytes=max_body,
                      worker_gate=gate, sampling_defaults=None if generation_config == "auto" else {})
    port = sock.getsockname()[1]  # the port bound (--port 0: the one the system chose)
    try:
        runtime.scheduler.start_groups()
        _verify(artifact)
        gate.set()
        log = logging.getLogger("lmc.runtime")
        log.info("serving %s on %s:%d: engine %s, %d group(s) x TP %d, batch %d, queue %d, timeout %gs",
                 artifact.model_dir, host, port, artifact.plan["engine"], runtime.scheduler.group_count,
                 artifact.plan["tensor_parallel_degree"], artifact.plan["batch_size"],
                 artifact.plan["job_queue_size"], timeout)
        if runtime.sampling_defaults:
            log.info("OpenAI routes default to the model's generation_config.json: %s",
                     ", ".join(f"{key} {value}" for key, value in runtime.sampling_defaults.items()))
        return serve(runtime, host, port, sock=sock), runtime
    except BaseException:  # a bad file, Ctrl-C or SIGTERM before uvicorn took the signals over
        runtime.scheduler.stop_groups()
        raise


def _refuse_lmc_pipeline(plan) -> None:
    """An artifact built for lmc's own hf pipeline (removed: vLLM runs plans across instances) stops here."""
    from lmc.errors import ArtifactError
    from lmc.layouts import pipeline_degree

    stages = pipeline_degree(dict(plan))
    if stages > 1:
        raise ArtifactError(f"this artifact splits the model into {stages} pipeline stages for lmc's own "
                            f"{plan.get('engine')} pipeline, which was removed: plan and build the spec again (vLLM "
                            "runs models across instances)")


def _verify(artifact, where: str = "") -> None:
    """Every file's sha256 against lmc.json (an ArtifactError, one line, names the first altered), then
    the log line saying so, and `where` this node stands."""
    from lmc.runtime.startup import verify_hashes

    verify_hashes(artifact.model_dir, artifact.manifest)
    logging.getLogger("lmc.runtime").info("verified %d files against lmc.json%s", len(artifact.manifest["files"]),
                                          f"; {where}" if where else "")


def _run_vllm(artifact, args, port: int, timeout: float | None, max_body: float | None, generation_config: str) -> int:
    """A vLLM plan: vLLM's own OpenAI server (lmc.runtime.vllm_server) once the artifact is verified;
    across instances, this node's place from the rendezvous (a worker node runs its ranks headless) or on
    the Ray cluster the environment names."""
    from lmc.runtime.server import DEFAULT_MAX_BODY_BYTES
    from lmc.runtime.startup import default_request_timeout_s
    from lmc.runtime.vllm_nodes import resolve_vllm_node
    from lmc.runtime.vllm_ray import resolve_ray_place, run_worker, serve_on_ray
    from lmc.runtime.vllm_server import describe, serve

    def serve_here(node) -> int:
        logging.getLogger("lmc.runtime").info("%s", describe(artifact.plan))
        return serve(artifact, host=args.host, port=port,
                     request_timeout_s=timeout or default_request_timeout_s(artifact.plan),
                     max_body_bytes=int(max_body or DEFAULT_MAX_BODY_BYTES),
                     generation_config=generation_config, node=node)

    place = resolve_ray_place(artifact.plan, os.environ)
    if place is not None:  # a Ray cluster (KServe's multi-node InferenceService, KubeRay): lmc.runtime.vllm_ray
        _verify(artifact, place.describe())
        if not place.is_leader:
            from lmc.runtime.vllm_backend import engine_environment

            os.environ.update(engine_environment(artifact.plan))  # inherited by Ray's workers on this node
            return run_worker(place)
        return serve_on_ray(artifact, place, lambda: serve_here(place))
    node = resolve_vllm_node(artifact.plan, os.environ)
    if node is not None and not node.is_leader:
        return _run_vllm_node(artifact, node)
    _verify(artifact, f"{node.describe()}: this node serves HTTP" if node is not None else "")
    return serve_here(node)


def _run_vllm_node(artifact, node) -> int:
    """A vLLM worker node: verify the artifact, then run this node's ranks headless until the leader stops."""
    from lmc.runtime.vllm_backend import engine_arguments, engine_environment
    from lmc.runtime.vllm_nodes import run_worker_node

    _verify(artifact, node.describe())
    return run_worker_node(engine_arguments(artifact.plan, artifact.model_dir), engine_environment(artifact.plan),
                           node)
