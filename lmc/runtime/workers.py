"""Worker process groups: `replicas` groups of `tensor_parallel_degree` processes each.

Each process imports the artifact's model.py, calls `create_engine()` and `engine.load(model_dir,
rank, world_size)`. Rank 0 of a group talks to the front end over a Pipe; it broadcasts every batch
to the other ranks over a gloo control group, all ranks call `engine.generate` in lockstep, and rank
0 sends tokens and results back. During a batch, rank 0 reads the pipe once per step (the engine's
cancel probe): `("cancel", batch, request id)` stops that row on every rank; any other message waits
for the batch's end (a `stop` also stops the batch's rows). A supervisor thread per group (in the
front-end process) watches the pipe and every process sentinel: when any rank dies, the group is torn
down, the batch it held fails with a message, and the group is started again. Every rank also holds the
read end of a lifeline pipe that nothing is written to: when the front end dies or gives the group up,
the pipe reads end-of-file and the rank exits at once, whatever it was doing (waiting at the gate,
loading, decoding). The front end's messages to rank 0 go through a sender thread, so a rank that stops
reading can never block the event loop.

The front end never imports torch: only the worker processes do (inside `worker_main`).
"""

from __future__ import annotations

import gc
import importlib
import logging
import math
import multiprocessing
import os
import queue
import re
import signal
import socket
import sys
import threading
import time
import types
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Protocol

from lmc.errors import LmcError
from lmc.runtime.engines.base import Piece

log = logging.getLogger("lmc.runtime")
# How long stop() waits for a group still starting its ranks (its fork server may still be importing).
STARTING_JOIN_S = 60.0

# CPU ranks are forked from a fork server that imported torch, transformers and the engine once, at the
# very start of `lmc runtime` (start_process_server): a rank then costs a fork, not seconds of imports
# on cores the ranks share, and a restarted group starts as fast. The server is a fresh interpreter
# (not a fork of the threaded front end) that only imports: no Python threads, no OpenMP pool.
# Forking after `import torch` is what DataLoader workers do by default. torch.distributed is
# initialised after the fork, in each rank.
# GPU and Neuron ranks are spawned: a library that initialises the CUDA driver (or the Neuron runtime)
# at import would leave every forked rank unable to use the device, and those hosts have the cores
# to import in parallel (each rank imports while the hashes are checked, see _warm_imports).
_FORKSERVER = multiprocessing.get_context("forkserver")
_SPAWN = multiprocessing.get_context("spawn")
# Rank 0 broadcasts a no-op this often while idle: the other ranks' collectives never reach the
# process-group timeout, and a dead peer is noticed even with no traffic.
HEARTBEAT_S = 30.0
_COLLECTIVE_TIMEOUT_S = 600.0
AUDIT_ENV = "LMC_AUDIT_OPENS"


# ---------------------------------------------------------------- layout (pure)

def device_kind(plan: dict[str, Any]) -> str:
    """'neuron', 'gpu' or 'cpu' for a plan dict."""
    if plan.get("engine") == "neuronx":
        return "neuron"
    accelerator = str((plan.get("target") or {}).get("accelerator", "cpu")).lower()
    return "cpu" if accelerator in ("cpu", "local", "") else "gpu"


def groups_per_instance(plan: dict[str, Any]) -> int:
    """Worker groups this container runs: the plan's replicas spread over its instances."""
    instances = int((plan.get("target") or {}).get("instances", 1) or 1)
    return max(1, math.ceil(int(plan["replicas"]) / instances))


def processes_per_group(plan: dict[str, Any]) -> int:
    # transformers-neuronx drives all of a group's NeuronCores from one process.
    return 1 if device_kind(plan) == "neuron" else int(plan["tensor_parallel_degree"])


def device_env(plan: dict[str, Any], group: int, local_rank: int) -> dict[str, str]:
    """The environment pinning one process of `group` to that group's contiguous devices."""
    tp = int(plan["tensor_parallel_degree"])
    first = group * tp
    kind = device_kind(plan)
    if kind == "gpu":
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in range(first, first + tp)),
                "LOCAL_RANK": str(local_rank)}
    if kind == "neuron":
        cores = str(first) if tp == 1 else f"{first}-{first + tp - 1}"
        # NEURON_RT_VISIBLE_CORES alone picks the group's cores (NEURON_RT_NUM_CORES is the other way to
        # say how many; the two are not meant to be combined).
        return {"NEURON_RT_VISIBLE_CORES": cores, "LOCAL_RANK": str(local_rank)}
    # CPU ranks share the host; keep their thread pools from oversubscribing it.
    return {"LOCAL_RANK": str(local_rank), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------- the worker process

@dataclass(frozen=True)
class WorkerSpec:
    model_dir: str
    group: int
    rank: int
    world_size: int
    backend: str  # "gloo" | "nccl" | "none"
    env: dict[str, str] = field(default_factory=dict)
    engine: str = ""  # the plan's engine and model family: which libraries to import while
    family: str = ""  # start-up verification runs
    scheduling: str = "dynamic"  # the plan's: "continuous" runs _serve_continuous where the engine can
    kv_block_size: int = 16  # the plan's kv_cache.block_size: a paged cache's block, the unit of the KV metrics


def worker_spec(model_dir: Path, plan: dict[str, Any], group: int, rank: int, backend: str, port: int,
                extra_env: dict[str, str] | None = None) -> WorkerSpec:
    """What rank `rank` of worker group `group` runs: its environment (torch.distributed's names) and its role."""
    tp = processes_per_group(plan)
    where = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(tp)}
    env = {**where, **device_env(plan, group, rank), **(extra_env or {})}
    return WorkerSpec(str(model_dir), group, rank, tp, backend, env, engine=str(plan.get("engine", "")),
                      family=str((plan.get("model") or {}).get("family", "")),
                      scheduling=str(plan.get("scheduling") or "dynamic"),
                      kv_block_size=int((plan.get("kv_cache") or {}).get("block_size") or 16))


def load_model_module(model_dir: Path):
    """The artifact's model.py, run from its source (the file lmc.json vouches for): never from a
    __pycache__ .pyc, which the manifest check lets through and an import would prefer to the
    source whenever its recorded mtime and size match. Nothing is written into the model dir."""
    path = Path(model_dir) / "model.py"
    module = types.ModuleType("lmc_artifact_model")
    module.__file__ = str(path)
    sys.modules["lmc_artifact_model"] = module
    exec(compile(path.read_bytes(), str(path), "exec"), module.__dict__)
    if not callable(getattr(module, "create_engine", None)):
        raise RuntimeError(f"{path}: defines no create_engine()")
    return module


def _install_open_audit(log_path: str, rank: int, group: int) -> None:
    """Log every path this process opens (tests check each rank read only its own shard)."""
    handle = open(f"{log_path}.g{group}r{rank}.{os.getpid()}", "a", buffering=1, encoding="utf-8")

    def hook(event: str, args: tuple) -> None:
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            handle.write(f"{os.fsdecode(args[0])}\n")

    sys.addaudithook(hook)


def _warm_imports(engine: str, family: str) -> None:
    """Import the engine's libraries (seconds of a cold start) before the artifact is verified.
    Nothing from the artifact is read here: its model.py is imported only after the gate; the
    family name only picks which transformers module to import."""
    if engine in ("hf", "deepspeed"):
        import torch  # noqa: F401
        import transformers.modeling_utils  # noqa: F401
        from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401

        if re.fullmatch(r"[a-z0-9_]+", family):
            importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    if engine == "deepspeed":
        import deepspeed  # noqa: F401


def mp_context(plan: dict[str, Any]):
    """The multiprocessing context `plan`'s worker processes (and the objects they share) come from."""
    # vLLM starts its own processes (spawned); lmc starts none for it: no fork server to warm.
    return _FORKSERVER if device_kind(plan) == "cpu" and plan.get("engine") != "vllm" else _SPAWN


def preload_modules(plan: dict[str, Any]) -> list[str]:
    """What the fork server imports before forking ranks: the engine's libraries, the model family's
    transformers module and lmc's worker code. Missing ones are skipped (the engine reports them)."""
    engine = str(plan.get("engine", ""))
    family = str((plan.get("model") or {}).get("family", ""))
    modules = ["lmc.runtime.preload", "lmc.runtime.workers"]  # preload first: it pauses the collector
    if engine in ("hf", "deepspeed"):
        modules += ["torch", "torch.distributed", "transformers", "transformers.modeling_utils",
                    "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
                    "transformers.tokenization_utils_fast", "lmc.runtime.engines.hf", "lmc.runtime.engines.tp",
                    "lmc.runtime.engines.generate", "lmc.safetensors_header"]
        if re.fullmatch(r"[a-z0-9_]+", family):
            modules.append(f"transformers.models.{family}.modeling_{family}")
        if engine == "deepspeed":
            modules.append("deepspeed")
    return modules


def start_process_server(plan: dict[str, Any]) -> None:
    """Start the fork server now, importing `preload_modules(plan)` in the background: call it first
    thing, so those seconds overlap the artifact's verification. Main thread only. Nothing to do
    for plans whose ranks are spawned (mp_context).

    The server ignores SIGTERM (the disposition is inherited across exec): a SIGTERM sent to the
    container's whole process group must not take it down, and with it every rank's sentinel, while
    the front end drains. It exits by itself when the front end does."""
    from multiprocessing import forkserver

    if mp_context(plan) is not _FORKSERVER:
        return
    _FORKSERVER.set_forkserver_preload(preload_modules(plan))
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _watch_lifeline(lifeline: Connection) -> None:
    """Exit this rank when the front end closes its end of `lifeline` (nothing is ever sent on it): it
    died, or it tore this group down and could not kill this process itself (once the fork server is
    gone, a forked rank looks dead to it while it still runs)."""
    try:
        lifeline.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(LIFELINE_EXIT)


def worker_main(spec: WorkerSpec, conn: Connection | None, gate=None, lifeline: Connection | None = None) -> None:
    """Entry point of one rank (forked from the fork server, or spawned). Exits when told to stop, when the front end goes away, or
    (non-zero) when a peer dies. With a `gate` (an Event), waits for it before touching the
    artifact: the front end sets it once every file's sha256 is verified. See _watch_lifeline."""
    started = time.monotonic()
    if lifeline is not None:
        threading.Thread(target=_watch_lifeline, args=(lifeline,), name="lmc-lifeline", daemon=True).start()
    # The front end decides when workers stop: a Ctrl-C or a SIGTERM sent to the whole process group
    # must not kill them under the requests it is draining. They still exit when the front end goes
    # away (rank 0 reads EOF, the other ranks' collectives fail) and on SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s[g{spec.group}r{spec.rank}]: %(message)s")
    os.environ.update(spec.env)
    # The fork server imported everything with the collector off (lmc.runtime.preload): what it imported
    # lives as long as the process, so keep it out of every collection (no scans, no copy-on-write
    # of those pages) and collect what this rank allocates from now on.
    gc.freeze()
    gc.enable()
    if "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        # torch was imported in the fork server, before this rank's OMP_NUM_THREADS was set.
        sys.modules["torch"].set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    if os.environ.get(AUDIT_ENV):
        _install_open_audit(os.environ[AUDIT_ENV], spec.rank, spec.group)
    if gate is not None and not gate.is_set():
        try:
            _warm_imports(spec.engine, spec.family)
        except ImportError:
            pass  # the engine reports what is missing, with its own message, when it loads
        # Debug only: ranks forked from the preloaded fork server get here at once, and a start-up that
        # fails verification must print its one-line error alone.
        log.debug("libraries imported in %.1fs; waiting for the artifact to be verified", time.monotonic() - started)
        gate.wait()
    control = None
    if spec.world_size > 1:
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=_COLLECTIVE_TIMEOUT_S)
        if spec.backend == "nccl":
            import torch

            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", spec.rank)))
        dist.init_process_group(spec.backend, rank=spec.rank, world_size=spec.world_size, timeout=timeout)
        # Control messages go over gloo even on GPUs: an idle NCCL broadcast would spin and time out.
        control = dist.new_group(backend="gloo", timeout=timeout) if spec.backend != "gloo" else dist.group.WORLD

    try:
        engine = load_model_module(Path(spec.model_dir)).create_engine()
        engine.load(Path(spec.model_dir), spec.rank, spec.world_size)
    except BaseException as exc:
        # An LmcError (missing SDK, unreadable shard, no CUDA) fails the same way on every restart:
        # say so, so the front end stops instead of retrying while /ping answers 503 forever.
        fatal = isinstance(exc, LmcError)
        message = " ".join(str(exc).split()) if fatal else f"{type(exc).__name__}: {exc}"
        if conn is not None:
            conn.send(("load_failed", message, exc.exit_code if fatal else None))
        if fatal:
            log.error("rank %d cannot load the model: %s", spec.rank, message)
            sys.exit(FATAL_LOAD_EXIT)
        log.exception("rank %d failed to load the model", spec.rank)
        sys.exit(LOAD_RAISED_EXIT)
    log.info("loaded rank %d/%d in %.1fs since the process started", spec.rank, spec.world_size, time.monotonic() - started)
    if spec.world_size > 1:
        import torch.distributed as dist

        # The group is ready when every rank is, not when rank 0 is: /ping must not say 200 earlier.
        dist.barrier(group=control)
    if conn is not None:
        conn.send(("ready",))
    # Continuous batching needs the engine's running batch.
    if spec.scheduling == "continuous" and _runs_continuous(engine):
        _serve_continuous(engine, spec, conn, control)
    else:
        _serve_loop(engine, spec, conn, control)
    if spec.world_size > 1:
        from lmc.runtime.engines.tp import leave_process_group

        leave_process_group()


def _next_message(spec: WorkerSpec, conn: Connection | None, control, inbox: deque) -> tuple:
    message: tuple | None = None
    if spec.rank == 0:
        assert conn is not None
        try:
            message = inbox.popleft() if inbox else conn.recv() if conn.poll(HEARTBEAT_S) else ("noop",)
        except (EOFError, OSError):  # the front end is gone
            message = ("stop",)
        if message[0] == "cancel":  # for a batch that has ended
            message = ("noop",)
    if spec.world_size > 1:
        import torch.distributed as dist

        box = [message]
        dist.broadcast_object_list(box, src=0, group=control)
        message = box[0]
    assert message is not None
    return message


def _serve_loop(engine, spec: WorkerSpec, conn: Connection | None, control) -> None:
    inbox: deque = deque()  # rank 0: messages that came during a batch and wait for its end
    while True:
        message = _next_message(spec, conn, control, inbox)
        kind = message[0]
        if kind == "stop":
            return
        if kind == "noop":
            continue
        _, batch_id, requests, forward = message
        on_token = None
        if spec.rank == 0:
            assert conn is not None
            seen: set[str] = set()
            cancelled: set[str] = set()

            def on_token(request_id: str, piece: Piece | str, _batch=batch_id, _forward=frozenset(forward), _seen=seen,
                         _cancelled=cancelled) -> None:
                # Streaming requests get every piece; the others only their first (for TTFT).
                if request_id not in _cancelled and (request_id in _forward or request_id not in _seen):
                    _seen.add(request_id)
                    if not _send(conn, ("token", _batch, request_id, piece if isinstance(piece, Piece) else Piece(piece))):
                        _cancelled.add(request_id)  # the front end is gone: the next probe stops every row

            def probe(_batch=batch_id, _cancelled=cancelled, _ids=[r.id for r in requests]) -> set[str]:
                if _read_cancellations(conn, _batch, _cancelled, inbox):
                    _cancelled.update(_ids)  # nobody reads any of them
                return _cancelled
        try:
            results = engine.generate(list(requests), on_token, cancel_probe=probe if spec.rank == 0 else None)
        except Exception as exc:  # a model failure: answered 424, the group keeps serving
            if spec.rank == 0 and not _send(conn, ("error", batch_id, f"model failure: {type(exc).__name__}: {exc}")):
                inbox.append(("stop",))
            continue
        if spec.rank == 0 and not _send(conn, ("result", batch_id, results)):
            inbox.append(("stop",))


def _runs_continuous(engine) -> bool:
    """Whether `engine` can batch continuously (else the dynamic loop serves: the front end's one-request
    batches then run one after another, slower but right). Every rank decides alike: same engine, same model."""
    try:
        engine.running_batch()
    except (AttributeError, LmcError) as exc:
        log.warning("continuous batching planned, but this engine cannot: %s; batching dynamically", exc)
        return False
    return True


# Rank 0 reports the rows decoded at each step (the /metrics tokens-per-step histogram) this often.
STEP_REPORT_S = 0.5


def _serve_continuous(engine, spec: WorkerSpec, conn: Connection | None, control) -> None:
    """Iteration-level scheduling: the batches the front end sends (one request each, as it dispatches
    them) join the running rows before the next decode step, and each request's result goes back the
    step it finishes. Rank 0 reads the pipe between steps and broadcasts what joins to the other ranks,
    so every rank makes the same joins at the same step; cancellations reach rank 0's probe, whose
    choice the token broadcast carries to every rank. A model failure fails every request running."""
    inbox: deque = deque()
    batches: dict[int, tuple[list[str], dict[str, Any], frozenset]] = {}  # id: (request ids, results, streamed)
    owner: dict[str, int] = {}  # request id: its batch
    cancelled: set[str] = set()
    seen: set[str] = set()

    pieces: list[tuple[int, str, Piece]] = []  # this step's, sent together after it: one message per step

    def on_token(request_id: str, piece: Piece | str) -> None:
        batch_id = owner.get(request_id)
        if batch_id is None or request_id in cancelled:
            return
        # Streaming requests get every piece; the others only their first (for TTFT).
        if request_id in batches[batch_id][2] or request_id not in seen:
            seen.add(request_id)
            pieces.append((batch_id, request_id, piece if isinstance(piece, Piece) else Piece(piece)))

    def probe() -> set[str]:
        return cancelled

    running = engine.running_batch(on_token if spec.rank == 0 else None, spec.kv_block_size)
    reported = time.monotonic()
    gone = False  # the front end stopped reading: stop

    def deliver(finished: list) -> None:
        """The step's tokens chosen, its finished rows out, its forward still to run: send the tokens and
        the finished requests' results now, so they reach the clients while the forward runs."""
        nonlocal reported, gone
        if pieces:
            if not _send(conn, ("tokens", pieces)):
                cancelled.update(request_id for _, request_id, _ in pieces)  # the front end is gone
            pieces.clear()
        # Before the results: a client that has its answer finds the metrics past its request.
        if spec.rank != 0:
            running.decoded.clear()
        elif (time.monotonic() - reported >= STEP_REPORT_S or not len(running) or finished) and running.decoded:
            _send(conn, ("steps", running.decoded, running.kv_blocks()))
            running.decoded, reported = [], time.monotonic()
        for row in finished:
            request_id = row.request.id
            batch_id = owner.pop(request_id)
            cancelled.discard(request_id)
            seen.discard(request_id)
            ids, results, _ = batches[batch_id]
            results[request_id] = running.result(row)
            if len(results) == len(ids):
                del batches[batch_id]
                if spec.rank == 0 and not _send(conn, ("result", batch_id, [results[i] for i in ids])):
                    gone = True

    while not gone:
        if not len(running):
            messages = [_next_message(spec, conn, control, inbox)]
        else:
            messages = _joining(spec, conn, control, inbox, cancelled)
        for message in messages:
            if message[0] == "stop":
                return
            if message[0] != "batch":
                continue
            _, batch_id, requests, forward = message
            try:
                running.join(list(requests))
            except Exception as exc:  # a prompt that does not fit: this batch fails, the others go on
                if spec.rank == 0:
                    _send(conn, ("error", batch_id, f"model failure: {type(exc).__name__}: {exc}"))
                continue
            batches[batch_id] = ([r.id for r in requests], {}, frozenset(forward))
            owner.update((r.id, batch_id) for r in requests)
        try:
            running.step(probe if spec.rank == 0 else None, deliver)
        except Exception as exc:  # a model failure: every running request is answered 424, the group goes on
            log.exception("rank %d: decode step failed", spec.rank)
            for batch_id in batches:
                if spec.rank == 0:
                    _send(conn, ("error", batch_id, f"model failure: {type(exc).__name__}: {exc}"))
            batches.clear(), owner.clear(), cancelled.clear(), seen.clear(), pieces.clear()
            running = engine.running_batch(on_token if spec.rank == 0 else None, spec.kv_block_size)


def _joining(spec: WorkerSpec, conn: Connection | None, control, inbox: deque, cancelled: set[str]) -> list[tuple]:
    """Between two steps: the messages that came (rank 0 reads them without waiting; cancellations go into
    `cancelled`), the same list on every rank."""
    messages: list[tuple] = []
    if spec.rank == 0:
        assert conn is not None
        messages = list(inbox)
        inbox.clear()
        try:
            while conn.poll(0):
                message = conn.recv()
                if message[0] == "cancel":
                    cancelled.add(message[2])
                elif message[0] != "noop":
                    messages.append(message)
        except (EOFError, OSError):  # the front end is gone
            messages.append(("stop",))
    if spec.world_size > 1:
        import torch
        import torch.distributed as dist

        count = torch.tensor([len(messages)], dtype=torch.long)
        dist.broadcast(count, src=0, group=control)
        if int(count[0]):
            box = [messages]
            dist.broadcast_object_list(box, src=0, group=control)
            messages = box[0]
    return messages


def _read_cancellations(conn: Connection, batch_id: int, cancelled: set[str], inbox: deque) -> bool:
    """Rank 0, during a batch: take the front end's messages that have come. Cancellations of this batch's
    requests go into `cancelled`; anything else waits in `inbox`. True when the whole batch is to stop:
    the front end is gone (a stop is then queued) or has said stop (its drain gave up: nobody will
    read the answers)."""
    try:
        while conn.poll(0):
            message = conn.recv()
            if message[0] != "cancel":
                inbox.append(message)
            elif message[1] == batch_id:
                cancelled.add(message[2])
    except (EOFError, OSError):
        if ("stop",) not in inbox:
            inbox.append(("stop",))
        return True
    return ("stop",) in inbox


def _send(conn: Connection, message: tuple) -> bool:
    """Rank 0's answer to the front end; False when it is gone."""
    try:
        conn.send(message)
    except (OSError, ValueError):
        return False
    return True


# ---------------------------------------------------------------- the supervisor (front end)

# A rank's exit status when it could not load the model for a reason restarting cannot fix.
FATAL_LOAD_EXIT = 78  # EX_CONFIG
# A rank's exit status when loading raised something else: maybe passing (restarted), unless every
# load fails so LOAD_ATTEMPTS times in a row (a broken file the manifest vouches for, say): then the
# group gives up as for FATAL_LOAD_EXIT, rather than restart forever while /ping answers 503.
LOAD_RAISED_EXIT = 75  # EX_TEMPFAIL
LOAD_ATTEMPTS = 3
LIFELINE_EXIT = 70  # EX_SOFTWARE: the front end is gone or gave this group up


class ModelLoadError(LmcError):
    """A worker group cannot load the model (and retrying would not help): the runtime exits."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class GroupEvents(Protocol):
    """What a group reports. Called from the group's supervisor thread."""

    def on_ready(self, group: int) -> None: ...
    def on_token(self, group: int, batch_id: int, request_id: str, piece: Piece) -> None: ...
    def on_result(self, group: int, batch_id: int, results: list) -> None: ...
    def on_failure(self, group: int, batch_id: int, message: str) -> None: ...
    def on_down(self, group: int, reason: str) -> None: ...
    def on_restart(self, group: int) -> None: ...
    def on_tokens(self, group: int, pieces: list[tuple[int, str, Piece]]) -> None: ...
    def on_steps(self, group: int, rows: list[int], kv_blocks: int) -> None: ...
    def on_fatal(self, group: int, error: ModelLoadError) -> None: ...


class WorkerGroup:
    """One replica: spawns its ranks, restarts them when one dies, forwards their messages."""

    def __init__(self, model_dir: Path, plan: dict[str, Any], group: int, events: GroupEvents,
                 extra_env: dict[str, str] | None = None, restart_backoff_s: float = 0.5, gate=None):
        self.model_dir = Path(model_dir)
        self.plan = plan
        self.group = group
        self.events = events
        self.extra_env = dict(extra_env or {})
        self.world_size = processes_per_group(plan)
        kind = device_kind(plan)
        self.backend = "none" if self.world_size == 1 else ("nccl" if kind == "gpu" else "gloo")
        self.restart_backoff_s = restart_backoff_s
        self.gate = gate
        self.restarts = 0
        self.ready = False
        self.pids: list[int] = []
        self._procs: list[Any] = []
        self._conn: Connection | None = None
        self._lifeline: Connection | None = None  # see _watch_lifeline
        # _state_lock guards ready, _conn, _generation and _in_flight; _pipe_lock is held while a message
        # is written to rank 0's pipe (by the sender thread only) and while that pipe is closed. Order:
        # _pipe_lock, then _state_lock.
        self._state_lock = threading.Lock()
        self._pipe_lock = threading.Lock()
        # (generation, message) for the sender thread; a message for an earlier incarnation is dropped.
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._generation = 0
        self._stopping = threading.Event()
        self._in_flight: set[int] = set()  # batches rank 0 holds (several at once with continuous batching)
        self._thread: threading.Thread | None = None
        self.fatal: ModelLoadError | None = None  # set when a rank cannot load the model for good
        self._load_failures = 0  # attempts in a row whose load raised (see LOAD_RAISED_EXIT)
        self._load_failure = ""  # why: rank 0's message, else which rank died (for the line that gives up)

    # -- public, called from the event loop

    def start(self) -> None:
        if self._thread is not None:
            return
        threading.Thread(target=self._send_loop, name=f"lmc-group-{self.group}-send", daemon=True).start()
        self._thread = threading.Thread(target=self._supervise, name=f"lmc-group-{self.group}", daemon=True)
        self._thread.start()

    def submit(self, batch_id: int, requests: list, stream_ids: list[str]) -> None:
        """Queue a batch for rank 0 (never blocks). Raises RuntimeError if the group is not up. A batch
        that never reaches rank 0 fails when the group goes down (its supervisor sees the death)."""
        with self._state_lock:
            if not self.ready or self._conn is None:
                raise RuntimeError(f"worker group {self.group} is not ready")
            self._in_flight.add(batch_id)
            self._outbox.put((self._generation, ("batch", batch_id, requests, stream_ids)))

    def cancel(self, batch_id: int, request_id: str) -> None:
        """Tell rank 0 that `request_id` of the running batch `batch_id` is no longer wanted: it stops
        decoding that row before its next step. Nothing when that batch is over. Never blocks."""
        with self._state_lock:
            if self._conn is not None and batch_id in self._in_flight:
                self._outbox.put((self._generation, ("cancel", batch_id, request_id)))

    def _send_loop(self) -> None:
        """The sender thread: writes queued messages to the current rank 0, in order, until stop()."""
        while True:
            generation, message = self._outbox.get()
            if message is None:
                return
            with self._pipe_lock:
                with self._state_lock:
                    conn = self._conn if generation == self._generation else None
                # None: for a group that has gone down since. A failed send: rank 0 is gone; its
                # supervisor says so and fails what it held.
                if conn is not None:
                    _send(conn, message)

    def kill(self, reason: str) -> None:
        """Tear the group down now (a hung batch); the supervisor restarts it."""
        log.error("worker group %d: %s; restarting it", self.group, reason)
        for proc in list(self._procs):
            if proc.is_alive():
                proc.kill()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        # A rank still being started (_spawn waits in proc.start() while the fork server imports, seconds
        # under load) must be started and killed before this process exits: a rank that unpickles its
        # arguments after the exit finds the gate's semaphore gone and prints a traceback beside lmc's one line.
        spawning_s = 5.0
        if not self.ready:  # starting, loading or waiting at the gate: nothing to finish
            timeout_s, spawning_s = 0.0, STARTING_JOIN_S
            for proc in list(self._procs):
                if proc.is_alive():
                    proc.kill()
            self._close_lifeline()  # and the ranks _spawn is still starting exit as they start
        with self._state_lock:
            if self._conn is not None:
                self._outbox.put((self._generation, ("stop",)))
        if self._thread is not None:
            self._thread.join(timeout_s + spawning_s)
        self._reap(timeout_s)
        self._close_lifeline()
        self._outbox.put((0, None))  # the sender thread ends

    # -- the supervisor thread

    def _supervise(self) -> None:
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                self._spawn()
            except Exception as exc:  # e.g. out of processes; retry like a crash
                reason = f"could not start: {type(exc).__name__}: {exc}"
            else:
                try:
                    reason = self._pump()
                except Exception as exc:  # e.g. a message that does not unpickle: same path as a crash
                    log.exception("worker group %d: supervisor error", self.group)
                    reason = f"supervisor error: {type(exc).__name__}: {exc}"
            self._down(reason)
            if self._load_failures >= LOAD_ATTEMPTS and self.fatal is None:
                self.fatal = ModelLoadError(f"worker group {self.group} cannot load the model: {self._load_failure} "
                                            f"({LOAD_ATTEMPTS} attempts in a row failed)", 1)
            if self.fatal is not None and not self._stopping.is_set():
                log.error("worker group %d cannot load the model; not restarting it: %s", self.group, self.fatal)
                self.events.on_fatal(self.group, self.fatal)
                return
            if self._stopping.is_set():
                return
            self.restarts += 1
            self.events.on_restart(self.group)
            log.error("worker group %d went down (%s); restarting (restart %d)", self.group, reason, self.restarts)
            # A group that dies while loading would otherwise spin; back off, up to 30 s.
            if time.monotonic() - started < 10.0:
                self._stopping.wait(min(30.0, self.restart_backoff_s * 2 ** min(self.restarts, 6)))

    def _spawn(self) -> None:
        port = free_port()
        context = mp_context(self.plan)
        parent, child = context.Pipe(duplex=True)
        lifeline, self._lifeline = context.Pipe(duplex=False)  # (read end, write end)
        procs = []
        for rank in range(self.world_size):
            if self._stopping.is_set():
                break
            spec = worker_spec(self.model_dir, self.plan, self.group, rank, self.backend, port, self.extra_env)
            proc = context.Process(target=worker_main, args=(spec, child if rank == 0 else None, self.gate, lifeline),
                               name=f"lmc-worker-g{self.group}r{rank}", daemon=True)
            proc.start()
            procs.append(proc)
        child.close()
        lifeline.close()  # the ranks hold the read ends; the write end stays here, never written
        self._procs = procs
        self.pids = [p.pid for p in procs]
        with self._state_lock:
            self._conn = parent  # (_down moved _generation past every message queued for the last one)
        if self._stopping.is_set():
            self._close_lifeline()  # stop() came while these started (a fork server start takes seconds)

    def _pump(self) -> str:
        """Forward messages until a process exits or the group is stopped; returns why it ended."""
        assert self._conn is not None
        conn = self._conn
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        while True:
            ready = wait([conn, *sentinels], timeout=1.0)
            if conn in ready:
                try:
                    while conn.poll():
                        self._handle(conn.recv())
                except (EOFError, OSError):
                    pass  # rank 0 is gone: its sentinel says how
            dead = [sentinels[s] for s in ready if s in sentinels]
            if dead:
                rank = dead[0]
                self._procs[rank].join(1.0)  # reap it, so exitcode is known
                code = self._procs[rank].exitcode
                if self._stopping.is_set():
                    return "stopped"
                if code == FATAL_LOAD_EXIT and self.fatal is None:
                    self.fatal = ModelLoadError(f"worker group {self.group}: rank {rank} cannot load the model "
                                                "(its log line above says why)", 1)
                if code == LOAD_RAISED_EXIT and not self.ready:
                    self._load_failures += 1
                    self._load_failure = self._load_failure or f"rank {rank} failed to load it (its log says why)"
                how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                return f"worker process rank {rank} (pid {self._procs[rank].pid}) died: {how}"
            if self._stopping.is_set() and not any(p.is_alive() for p in self._procs):
                return "stopped"

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "ready":
            self.ready = True
            self._load_failures, self._load_failure = 0, ""
            self.events.on_ready(self.group)
        elif kind == "token":
            self.events.on_token(self.group, message[1], message[2], message[3])
        elif kind == "result":
            self._in_flight.discard(message[1])
            self.events.on_result(self.group, message[1], message[2])
        elif kind == "error":
            self._in_flight.discard(message[1])
            self.events.on_failure(self.group, message[1], message[2])
        elif kind == "tokens":  # a continuous batch's step: (batch id, request id, piece) each
            self.events.on_tokens(self.group, message[1])
        elif kind == "steps":
            self.events.on_steps(self.group, message[1], message[2])
        elif kind == "load_failed":
            log.error("worker group %d failed to load the model: %s", self.group, message[1])
            self._load_failure = message[1]  # rank 0's reason, for the line that gives up
            if message[2] is not None:
                self.fatal = ModelLoadError(f"worker group {self.group} cannot load the model: {message[1]}", message[2])

    def _down(self, reason: str) -> None:
        with self._state_lock:
            self.ready = False
            in_flight, self._in_flight = self._in_flight, set()
            self._generation += 1  # what is still queued for this incarnation is dropped
            conn, self._conn = self._conn, None
        self._reap(2.0 if self._stopping.is_set() else 0.0)
        self._close_lifeline()  # a rank still running (it could not be killed: see _watch_lifeline) exits
        if conn is not None:
            with self._pipe_lock:  # after a send in progress fails (every rank is gone by now) or ends
                conn.close()
        for batch_id in sorted(in_flight):
            self.events.on_failure(self.group, batch_id, f"worker group {self.group} failed: {reason}")
        self.events.on_down(self.group, reason)

    def _close_lifeline(self) -> None:
        lifeline, self._lifeline = self._lifeline, None
        if lifeline is not None:
            lifeline.close()

    def _reap(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
