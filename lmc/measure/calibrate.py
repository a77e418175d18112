"""`lmc calibrate`: measure this machine as the planner sees it, for the engines installed here.

Each measurement is one function returning plain numbers; `calibrate()` runs them in order with a
progress bar and hands the figures to `lmc.measure.profile`, which writes the catalog-format TOML.
torch is imported here, never in the planner.

What is measured, and what the latency model reads it as (lmc/planner/measured.py):
- stream bandwidth: a 256 MiB tensor copy (read + write), the peak `memory_bandwidth_bytes_per_s`;
- matmul TFLOPS per dtype: square matmuls, the peak `tflops`;
- the engine's fixed costs: two tiny models (2 and 12 layers) built and served by `lmc runtime`,
  driven as `lmc bench` drives one: per token = step + layers · layer overhead, the request's own cost,
  the worker's memory besides its weights;
- per dtype, a ~512 MB random Llama served the same way: its batch-1 and batch-8 TPOT and its
  128-token TTFT become the achieved decode bandwidth, decode TFLOPS and prefill TFLOPS by inverting
  the planner's latency model (`solve_figures`), so a plan reproduces them by construction;
- all-reduce latency and bandwidth across 2 local processes (gloo on CPU, NCCL across GPUs);
- storage read bandwidth: a file written, flushed, evicted from the page cache, read back.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from lmc.errors import MissingDependencyError
from lmc.measure.host import host_line

# The decode and prefill model: Llama-shaped, as wide as the 1-3 B models a CPU serves (narrower
# matrices reach less of the memory bandwidth: 10 GB/s at 1024 wide against 16 GB/s at 2048 here), and
# large enough (~512 MB per dtype) that no cache holds it.
_DECODE_WIDTH = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=4)
_DECODE_BYTES = 512 * 2**20
_PREFILL_TOKENS = 128
_DECODE_PROMPT = _PREFILL_TOKENS  # the decode steps follow the same prompt
_DECODE_TOKENS = 16
_OVERHEAD_LAYERS = (2, 12)


@dataclass
class Calibration:
    """Everything `lmc calibrate` measured (the profile writer's input); rates in bytes/s, TFLOPS, ms."""

    device: str  # "cpu" or "cuda"
    accelerator: str  # "cpu", or the GPU's name
    devices: int
    device_memory_bytes: int
    host_memory_bytes: int
    stream_bandwidth: float
    matmul_tflops: dict[str, float]
    decode_bandwidth: dict[str, float]
    prefill_tflops: dict[str, float]
    step_overhead_ms: float
    layer_overhead_ms: float
    runtime_overhead_bytes: int | None
    allreduce_latency_us: float | None
    allreduce_bandwidth: float | None
    allreduce_backend: str
    load_bandwidth: float
    decode_tflops: dict[str, float] = field(default_factory=dict)
    prefill_overhead_ms: float = 0.0
    engine: str = "hf"
    measured_at: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc)
                             .strftime("%Y-%m-%d %H:%M UTC"))
    host: str = ""
    notes: list[str] = field(default_factory=list)


# --- the pieces ----------------------------------------------------------------------------------

def _best_rate(work: float, run: Callable[[], None], sync: Callable[[], None], budget_s: float, min_reps: int = 3) -> float:
    """The best of repeated runs of `run` (each doing `work` units), within about `budget_s` seconds."""
    run()
    sync()
    best = 0.0
    started = time.perf_counter()
    reps = 0
    while reps < min_reps or time.perf_counter() - started < budget_s:
        begin = time.perf_counter()
        run()
        sync()
        best = max(best, work / (time.perf_counter() - begin))
        reps += 1
        if reps >= 50:
            break
    return best


def _sync(device: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def stream_bandwidth(device: str, size_bytes: int = 256 * 2**20) -> float:
    """Bytes per second a tensor copy moves (read + write)."""
    import torch

    source = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    return _best_rate(2 * size_bytes, lambda: target.copy_(source), _sync(device), budget_s=1.0)


def matmul_tflops(device: str, dtype: str, n: int = 1024) -> float:
    """Dense TFLOPS of an n×n matmul in `dtype`."""
    import torch

    torch_dtype = _torch_dtype(dtype)
    if device == "cuda":
        n = 8192
    a = torch.randn(n, n, device=device).to(torch_dtype)
    b = torch.randn(n, n, device=device).to(torch_dtype)
    return _best_rate(2 * n**3 / 1e12, lambda: torch.matmul(a, b), _sync(device), budget_s=1.0)


def _torch_dtype(dtype: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]


_TORCH_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_SPEC = """\
[model]
id = "lmc/calibration-{name}"
path = "checkpoint-{name}"
[target]
{target}
[workload]
max_input_tokens = {prompt}
max_output_tokens = {output}
concurrency = {concurrency}
[pin]
engine = "hf"
dtype = "{dtype}"
tensor_parallel_degree = 1
"""


@dataclass
class ServedRun:
    """One calibration model served by `lmc runtime`, driven as `lmc bench` drives one."""

    samples: dict[str, list]  # per request shape: the good Samples
    worker_peak_bytes: int
    weights_bytes: int
    max_batch_delay_ms: int


def serve_and_drive(root: Path, name: str, dtype: str, layers: int, width: dict, target: str, device: str,
                    prompt: int, shapes: list[tuple[str, int, int, int]], made: bool = False) -> ServedRun:
    """Build a random Llama (`layers` of `width`, in `dtype`; `made`: already written to root/checkpoint-NAME,
    as bench/gpu draws a wide one on the GPU) into an artifact under `root`, serve it, and run each shape
    (label, output tokens, concurrency, requests) after its warm-up round."""
    import asyncio

    from lmc.emitters.build import build_artifact
    from lmc.measure.bench import BenchSetup, open_target
    from lmc.measure.loadgen import _completion_body, build_prompt, make_client, run_level, served_model, word_token
    from lmc.measure.procmem import PeakMemory
    from lmc.schema import load_spec
    from lmc.testing.checkpoints import make_checkpoint

    if not made:
        make_checkpoint("llama", root / f"checkpoint-{name}", dtype=_TORCH_NAMES[dtype], num_hidden_layers=layers,
                        **width)
    output = max(tokens for _, tokens, _, _ in shapes)
    concurrency = max(c for _, _, c, _ in shapes)
    (root / f"{name}.toml").write_text(_SPEC.format(name=name, target=target, prompt=prompt, output=output,
                                                    concurrency=concurrency, dtype=dtype), encoding="utf-8")
    result = build_artifact(load_spec(root / f"{name}.toml"), root / f"model-{name}", fmt="dir")
    weights = sum(f.stat().st_size for f in (root / f"model-{name}" / "shards").rglob("*.safetensors"))
    setup = BenchSetup(str(root / f"model-{name}"), False, prompt, output, [1], None, None, None, None, 300.0, 300.0)

    async def drive(url: str) -> dict[str, list]:
        async with make_client(300.0, concurrency) as client:
            model = await served_model(client, url)
            text, word = await build_prompt(client, url, model, prompt)
            bias = word_token(root / f"model-{name}" / "tokenizer.json", word)
            found = {}
            for label, tokens, level, requests in shapes:
                body = _completion_body(text, tokens, model, stream=True, bias_token=bias)
                samples, _ = await run_level(client, url, body, level, requests)
                good = [s for s in samples if s.error is None and s.completion_tokens == tokens]
                if not good:
                    raise MissingDependencyError(f"the calibration model {name} served no complete answer: "
                                                 f"{samples[0].error if samples else 'no samples'}")
                found[label] = good
            return found

    for old in (root / f"checkpoint-{name}").glob("*.safetensors"):
        old.unlink()  # the artifact holds the weights now; keep the scratch space small
    with open_target(setup, quiet=True) as served:
        with PeakMemory(served.pid, "gpu" if device == "cuda" else "cpu") as sampler:
            samples = asyncio.run(drive(served.url))
        peak = max(sampler.overall().values(), default=0)
    return ServedRun(samples, peak, weights, result.plan.max_batch_delay_ms)


def _median(samples: list, key: str) -> float:
    return statistics.median(getattr(s, key) for s in samples) * 1e3


def fixed_costs(end_to_end: dict[int, tuple[list[float], list[float]]]) -> tuple[float, float, float]:
    """(step ms, per-layer ms, request ms) from served batch-1 runs of models that differ only in their layer
    count: per layer count, the end-to-end times (ms) of its 32-token and of its 2-token requests. Per token =
    (median end-to-end of 32 tokens − of 2) / 30; the request's own cost (HTTP, tokenizing, the queue, the
    pipe) is the fewest layers' 2-token median less two tokens.
    Medians, not the fastest runs: the plan predicts the typical (p50) step, and the fastest of a few runs
    sits below it by the host's spread (on an H200, 2026-11-28: 6.35 ms for 8 layers from the fastest runs,
    6.97 from the medians; the 7B-wide model itself served at 8.99 fastest, 9.87 median)."""
    per_token = {layers: (statistics.median(long) - statistics.median(short)) / 30
                 for layers, (long, short) in end_to_end.items()}
    l1, l2 = min(per_token), max(per_token)
    layer = max((per_token[l2] - per_token[l1]) / (l2 - l1), 0.0)
    request = max(statistics.median(end_to_end[l1][1]) - 2 * per_token[l1], 0.0)
    return max(per_token[l1] - l1 * layer, 0.0), layer, request


def engine_overheads(root: Path, target: str, device: str) -> tuple[float, float, float, int]:
    """(step ms, per-layer ms, request ms, worker bytes besides the weights) from two tiny models (2 and
    12 layers, 64 wide) served at batch 1, 5 requests of each length (`fixed_costs`). End-to-end times,
    not the gaps between chunks: with sub-millisecond steps streamed chunks arrive in bursts, so the time
    between them says nothing, the end of a request does."""
    end_to_end, memory = {}, 0
    shapes = [("long", 32, 1, 5), ("short", 2, 1, 5)]
    for layers in _OVERHEAD_LAYERS:
        run = serve_and_drive(root, f"tiny{layers}", "fp32", layers, {}, target, device, 16, shapes)
        end_to_end[layers] = tuple([s.e2e_s * 1e3 for s in run.samples[label]] for label in ("long", "short"))
        if layers == _OVERHEAD_LAYERS[0]:
            memory = max(run.worker_peak_bytes - run.weights_bytes, 0)
    return (*fixed_costs(end_to_end), memory)


_DECODE_BATCH = 8


@dataclass(frozen=True)
class EngineFigures:
    """What one dtype's calibration model gave, in the latency model's terms."""

    decode_bandwidth: float  # bytes/s
    prefill_tflops: float
    decode_tflops: float


def _solve(predict: Callable[[float], float], measured: float) -> float | None:
    """The rate x at which `predict(x)` equals `measured`, for predictions of the form a + b/x (a time
    is fixed costs plus work over a rate); None when the fixed part alone exceeds the measurement."""
    f1, f2 = predict(1.0), predict(2.0)
    b = 2 * (f1 - f2)
    a = f1 - b
    if b <= 0 or measured <= a:
        return None
    return b / (measured - a)


def _calibration_hardware(dtype: str, figures: EngineFigures, step_ms: float, layer_ms: float, request_ms: float = 0.0):
    """A CPU whose hf engine achieves `figures` (peaks far above them: only the achieved rates matter)."""
    from lmc.planner.facts import HardwareFacts, InterconnectFacts, MeasuredEngineFacts

    measured = MeasuredEngineFacts(decode_bandwidth_bytes_per_s={dtype: figures.decode_bandwidth},
                                   prefill_tflops={dtype: figures.prefill_tflops},
                                   decode_tflops={dtype: figures.decode_tflops},
                                   step_overhead_ms=step_ms, layer_overhead_ms=layer_ms, prefill_overhead_ms=request_ms)
    return HardwareFacts(name="local", accelerator="cpu", kind="cpu", devices=1, device_memory_bytes=2**40,
                         memory_bandwidth_bytes_per_s=1e18, tflops={dtype: 1e9}, dtypes=[dtype],
                         interconnect=InterconnectFacts(name="none", bandwidth_bytes_per_s=1e9, latency_us=0),
                         source="lmc calibrate (solving)", measured={"hf": measured})


def solve_figures(model_facts, dtype: str, step_ms: float, layer_ms: float, tpot_1: float, tpot_n: float,
                  ttft: float, guess: EngineFigures, peak_tflops: float = math.inf,
                  request_ms: float = 0.0) -> EngineFigures | None:
    """The achieved rates at which the planner's own latency model (lmc.planner.latency) reproduces the
    measured batch-1 and batch-8 decode steps and the prefill: each time is linear in its rate's
    reciprocal, the three couple weakly, so a few rounds settle them. None where a measurement is
    below the model's fixed costs (a disturbed run)."""
    from dataclasses import replace

    from lmc.planner import latency
    from lmc.planner.engines import engine_facts

    engine = engine_facts()["hf"]
    figures = guess

    def tpot(f: EngineFigures, batch: int) -> float:
        hardware = _calibration_hardware(dtype, f, step_ms, layer_ms, request_ms)
        return latency.tpot_ms(model_facts, hardware, engine, dtype, 1, batch, _DECODE_PROMPT, _DECODE_TOKENS)

    def prefill(f: EngineFigures) -> float:
        hardware = _calibration_hardware(dtype, f, step_ms, layer_ms, request_ms)
        return latency.ttft_ms(model_facts, hardware, engine, dtype, 1, _PREFILL_TOKENS)

    for _ in range(4):
        bandwidth = _solve(lambda x: tpot(replace(figures, decode_bandwidth=x * 1e9), 1), tpot_1)
        if bandwidth is None:
            return None
        figures = replace(figures, decode_bandwidth=bandwidth * 1e9)
        prefill_tflops = _solve(lambda x: prefill(replace(figures, prefill_tflops=x)), ttft)
        if prefill_tflops is None:
            return None
        figures = replace(figures, prefill_tflops=prefill_tflops)
        decode_tflops = _solve(lambda x: tpot(replace(figures, decode_tflops=x), _DECODE_BATCH), tpot_n)
        # Rows cannot be computed faster than the matmul peak: a batch that came out cheaper (its compute
        # hidden under the weight reads, or noise) is charged at the peak.
        figures = replace(figures, decode_tflops=min(decode_tflops or math.inf, peak_tflops))
    return figures


def decode_and_prefill(root: Path, target: str, device: str, dtype: str, step_ms: float, layer_ms: float,
                       request_ms: float, guess: EngineFigures, peak_tflops: float) -> EngineFigures | None:
    """A ~512 MB random Llama in `dtype`, served: its batch-1 and batch-8 TPOT (p50) and its 128-token
    TTFT at concurrency 1 (less the batching delay the plan added), turned into rates by `solve_figures`."""
    from lmc.planner.architecture import facts_from_config
    from lmc.planner.facts import DTYPE_BYTES
    from lmc.testing.checkpoints import config_for

    hidden, inner = _DECODE_WIDTH["hidden_size"], _DECODE_WIDTH["intermediate_size"]
    per_layer = (2.5 * hidden * hidden + 3 * hidden * inner) * DTYPE_BYTES[dtype]  # q,o full; k,v a quarter each
    layers = max(2, round(_DECODE_BYTES / per_layer))
    # Two full batches: one batch's 8 rows share every step, so they are one sample, not eight.
    shapes = [("one", _DECODE_TOKENS, 1, 3), ("batch", _DECODE_TOKENS, _DECODE_BATCH, 2 * _DECODE_BATCH)]
    run = serve_and_drive(root, f"decode-{dtype}", dtype, layers, _DECODE_WIDTH, target, device, _PREFILL_TOKENS, shapes)
    config = config_for("llama", num_hidden_layers=layers, **_DECODE_WIDTH)
    facts = facts_from_config(config.to_dict(), "calibration", source="lmc calibrate")
    facts = facts.model_copy(update={"parameters": run.weights_bytes // int(DTYPE_BYTES[dtype]), "torch_dtype": dtype})
    tpot_1 = _median(run.samples["one"], "tpot_s")
    tpot_n = _median(run.samples["batch"], "tpot_s")
    ttft = _median(run.samples["one"], "ttft_s") - run.max_batch_delay_ms
    return solve_figures(facts, dtype, step_ms, layer_ms, tpot_1, tpot_n, ttft, guess, peak_tflops, request_ms)


_ATTEMPTS = 3


def implausible(stream: float, matmul: dict[str, float], figures: dict[str, EngineFigures | None]) -> str | None:
    """Why these figures cannot be this machine's (another process took the cores mid-measurement:
    the fixed costs came out too large, and what is left of a step over-states the bandwidth), or None.
    A decode step reads its weights from memory: it cannot beat the copy bandwidth by half again, nor a
    prefill the matmul peak."""
    for dtype, f in figures.items():
        if f is None:
            return f"{dtype}: a step took less than the fixed costs measured before it"
        if f.decode_bandwidth > 1.5 * stream:
            return f"decode {dtype} {f.decode_bandwidth / 1e9:.1f} GB/s against a {stream / 1e9:.1f} GB/s copy"
        if dtype in matmul and f.prefill_tflops > 1.5 * matmul[dtype]:
            return f"prefill {dtype} {f.prefill_tflops:.3f} TFLOPS against {matmul[dtype]:.3f} in a matmul"
    return None


def overhead_bound_on_gpu(stream: float, matmul: dict[str, float],
                          figures: dict[str, EngineFigures | None]) -> tuple[dict[str, EngineFigures | None], str | None]:
    """On a GPU the hf engine's decode step is its fixed costs: the calibration model's weights read in
    less time than those costs vary (seen on an H200: 7.5 ms steps of which the reads are 0.8 ms), so no
    rate can be solved from it (none, or one beyond what the device measured). There such a dtype takes
    the device's own measurements (the copy bandwidth for decode, the matmul rate for prefill and batched
    decode) and a note says so; the fixed costs, which decide the engine's steps there, stay measured.
    Returns (figures, note or None)."""
    unsolved = [dtype for dtype, f in figures.items() if dtype in matmul and implausible(stream, matmul, {dtype: f})]
    if not unsolved:
        return figures, None
    filled = dict(figures)
    for dtype in unsolved:
        filled[dtype] = EngineFigures(stream, matmul[dtype], matmul[dtype])
    return filled, (f"{', '.join(unsolved)}: the hf engine's steps on this GPU are its fixed costs (the weights "
                    "read in less than their variation); decode and prefill take the copy bandwidth and the "
                    "matmul rate measured above")


def allreduce(device: str, timeout_s: float = 60.0) -> tuple[float, float, str]:
    """(latency µs of a 4-byte all-reduce, bus bandwidth bytes/s of a 16 MiB one, backend) between two
    local processes: gloo on CPU, NCCL on two GPUs."""
    backend = "nccl" if device == "cuda" else "gloo"
    from lmc.runtime.workers import free_port

    code = f"from lmc.measure.calibrate import _allreduce_rank; _allreduce_rank({backend!r})"
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    try:
        outputs = [proc.communicate(timeout=timeout_s) for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        raise MissingDependencyError(f"the {backend} all-reduce between 2 local processes did not finish in {timeout_s:.0f} s")
    if any(proc.returncode for proc in procs):
        err = next(out[1] for proc, out in zip(procs, outputs) if proc.returncode)
        raise MissingDependencyError(f"the {backend} all-reduce between 2 local processes failed: "
                                     f"{err.strip().splitlines()[-1] if err.strip() else 'no message'}")
    figures = json.loads(outputs[0][0].strip().splitlines()[-1])
    return figures["latency_us"], figures["bandwidth"], backend


def _allreduce_rank(backend: str) -> None:
    """One rank of `allreduce` (run in its own process)."""
    import torch
    import torch.distributed as dist

    from lmc.runtime.engines.tp import exit_rank

    rank = int(os.environ["RANK"])
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, rank=rank, world_size=2)
    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)

    def timed(tensor, reps: int) -> float:
        for _ in range(3):
            dist.all_reduce(tensor)
        sync()
        samples = []
        for _ in range(reps):
            begin = time.perf_counter()
            dist.all_reduce(tensor)
            sync()
            samples.append(time.perf_counter() - begin)
        return statistics.median(samples)

    small = timed(torch.ones(1, device=device), 200)
    big_bytes = 16 * 2**20
    big = timed(torch.ones(big_bytes // 4, device=device), 10)
    # Ring all-reduce moves 2(p−1)/p of the message per rank: p = 2 moves the message once.
    bandwidth = big_bytes / max(big - small, 1e-9)
    if rank == 0:
        print(json.dumps({"latency_us": small * 1e6, "bandwidth": bandwidth}))
    exit_rank()  # (allreduce reads the exit codes)


def storage_read_bandwidth(directory: Path, size_bytes: int = 256 * 2**20) -> float:
    """Bytes per second reading a file not in the page cache (written, flushed, evicted, read back)."""
    chunk = os.urandom(8 * 2**20)
    with tempfile.NamedTemporaryFile(dir=directory, prefix="lmc-calibrate-", delete=True) as handle:
        for _ in range(size_bytes // len(chunk)):
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        with open(handle.name, "rb", buffering=0) as reader:
            begin = time.perf_counter()
            total = 0
            while block := reader.read(len(chunk)):
                total += len(block)
            return total / (time.perf_counter() - begin)


# --- the run -------------------------------------------------------------------------------------

def calibrate(device: str = "cpu", dtypes: tuple[str, ...] | None = None, scratch: Path | None = None,
              progress: bool | None = None, accelerator: str | None = None) -> Calibration:
    """Measure this machine (see the module docstring); `progress` None shows a bar on a terminal.
    `accelerator` (a catalog name) is what the served calibration models target on a GPU."""
    from tqdm import tqdm

    stages = ["stream bandwidth", "matmul", "engine overheads (served)", "decode & prefill (served)", "all-reduce",
              "storage read"]
    bar = tqdm(total=len(stages), desc="lmc calibrate", unit="stage", disable=None if progress is None else not progress,
               file=sys.stderr, bar_format="{desc}: {n_fmt}/{total_fmt} {bar} {elapsed} {postfix}")

    def stage(name: str) -> None:
        bar.set_postfix_str(name)

    def done(line: str) -> None:
        bar.update(1)
        bar.write(f"  {line}", file=sys.stderr)

    if device == "cuda" and accelerator is None:
        raise MissingDependencyError("--device cuda needs --base (the catalog accelerator or instance these GPUs are)")
    target = 'instance = "local"' if device == "cpu" else f'accelerator = "{accelerator}"\ndevices = 1'
    scratch = scratch or Path(tempfile.gettempdir())
    notes: list[str] = []
    with bar, tempfile.TemporaryDirectory(prefix="lmc-calibrate-", dir=scratch) as tmp:
        root = Path(tmp)
        torch = _import_torch(device)
        dtypes = dtypes or (("fp32", "bf16") if device == "cpu" else ("fp16", "bf16"))
        stage(stages[0])
        stream = stream_bandwidth(device)
        done(f"stream bandwidth {stream / 1e9:.2f} GB/s")
        stage(stages[1])
        matmul = {dtype: matmul_tflops(device, dtype) for dtype in dtypes}
        done("matmul " + ", ".join(f"{dtype} {value:.3f} TFLOPS" for dtype, value in matmul.items()))
        filled = None
        for attempt in range(_ATTEMPTS):
            stage(stages[2] if attempt == 0 else f"{stages[2]}, again")
            step, layer, request_ms, overhead = engine_overheads(root, target, device)
            stage(stages[3])
            figures = {dtype: decode_and_prefill(root, target, device, dtype, step, layer, request_ms,
                                                 EngineFigures(stream / 2, matmul[dtype] / 2, matmul[dtype] / 2),
                                                 matmul[dtype])
                       for dtype in dtypes}
            if device == "cuda":
                figures, filled = overhead_bound_on_gpu(stream, matmul, figures)
            doubt = implausible(stream, matmul, figures)
            if doubt is None:
                break
            bar.write(f"  disturbed ({doubt}); measuring again", file=sys.stderr)
        else:
            notes.append(f"the engine figures looked disturbed in {_ATTEMPTS} tries ({doubt}): calibrate again "
                         "when the machine is quiet")
        if filled:
            notes.append(filled)
        done(f"engine hf served by lmc runtime: {step:.2f} ms per step + {layer:.3f} ms per layer, "
             f"{request_ms:.1f} ms per request; a worker holds {overhead / 2**20:.0f} MiB besides its weights")
        figures = {dtype: f for dtype, f in figures.items() if f is not None}
        if not figures:
            raise MissingDependencyError("every engine measurement came out below the fixed costs (the machine "
                                         "was too busy): calibrate again when it is quieter")
        decode = {dtype: f.decode_bandwidth for dtype, f in figures.items()}
        prefill = {dtype: f.prefill_tflops for dtype, f in figures.items()}
        decode_tflops = {dtype: f.decode_tflops for dtype, f in figures.items()}
        done("decode " + ", ".join(f"{d} {v / 1e9:.2f} GB/s" for d, v in decode.items())
             + "; prefill " + ", ".join(f"{d} {v:.3f} TFLOPS" for d, v in prefill.items())
             + f"; batch-{_DECODE_BATCH} decode " + ", ".join(f"{d} {v:.3f} TFLOPS" for d, v in decode_tflops.items()))
        stage(stages[4])
        devices = torch.cuda.device_count() if device == "cuda" else 1
        if device == "cpu" or devices >= 2:
            latency_us, bandwidth, backend = allreduce(device)
            done(f"all-reduce ({backend}, 2 processes): {latency_us:.0f} µs + {bandwidth / 1e9:.2f} GB/s")
        else:
            latency_us = bandwidth = None
            backend = "nccl"
            notes.append("one GPU: no all-reduce measured (the base instance's interconnect figures stand)")
            done("all-reduce: one device, skipped")
        stage(stages[5])
        load = storage_read_bandwidth(scratch)
        done(f"storage read {load / 1e9:.2f} GB/s")
    return Calibration(
        device=device, accelerator=_accelerator_name(device), devices=devices,
        device_memory_bytes=_device_memory(device), host_memory_bytes=_ram_bytes(),
        stream_bandwidth=stream, matmul_tflops=matmul, decode_bandwidth=decode, prefill_tflops=prefill,
        decode_tflops=decode_tflops, prefill_overhead_ms=request_ms,
        step_overhead_ms=step, layer_overhead_ms=layer, runtime_overhead_bytes=overhead,
        allreduce_latency_us=latency_us, allreduce_bandwidth=bandwidth, allreduce_backend=backend,
        load_bandwidth=load, host=host_line(), notes=notes)


def _import_torch(device: str):
    try:
        import torch
    except ImportError:
        raise MissingDependencyError("lmc calibrate needs torch and transformers: pip install 'lmc[engines]'") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise MissingDependencyError("--device cuda: torch sees no CUDA GPU here; calibrate on the GPU host, "
                                     "or use --device cpu")
    return torch


def _accelerator_name(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(0)


def _device_memory(device: str) -> int:
    if device == "cpu":
        return _ram_bytes()
    import torch

    return torch.cuda.get_device_properties(0).total_memory


def _ram_bytes() -> int:
    from lmc.planner.catalog import _total_ram_bytes

    return _total_ram_bytes()
