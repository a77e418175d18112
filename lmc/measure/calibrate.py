"""`lmc calibrate`: measure this machine as the planner sees it, for the engines installed here.

Each measurement is one function returning plain numbers; `calibrate()` runs them in order with a
progress bar and hands the figures to `lmc.measure.profile`, which writes the catalog-format TOML.
torch is imported here, never in the planner.

What is measured, and what the latency model reads it as (lmc/planner/measured.py):
- stream bandwidth: a 256 MiB tensor copy (read + write), the peak `memory_bandwidth_bytes_per_s`;
- matmul TFLOPS per dtype: square matmuls, the peak `tflops`;
- the engine's fixed costs: batch-1 decode steps of two tiny models (2 and 12 layers) through lmc's
  own decode loop, fitted as step + layers · layer overhead;
- per dtype, a ~256 MB random Llama through the same loop: its prompt prefill gives the achieved
  prefill TFLOPS, its batch-1 decode step the achieved decode bandwidth (weight bytes / step time,
  less the fixed costs and the compute the model adds), so the model reproduces both by construction;
- all-reduce latency and bandwidth across 2 local processes (gloo on CPU, NCCL across GPUs);
- a worker's memory with the engine loaded (torch, transformers, a tiny model served): the runtime
  overhead in the memory model;
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

# The decode and prefill model: Llama-shaped, wide enough that its matrices are GEMV/GEMM-bound and
# large enough (~256 MB per dtype) that no cache holds it.
_DECODE_WIDTH = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4)
_DECODE_BYTES = 256 * 2**20
_PREFILL_TOKENS = 128
_DECODE_PROMPT = 8
_DECODE_TOKENS = 12
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


def _tokenizer():
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from lmc.testing.checkpoints import EOS_ID, SPECIAL_TOKENS, tokenizer_json

    pad, bos, eos, unk = SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json()),
                                        pad_token=pad, bos_token=bos, eos_token=eos, unk_token=unk)
    return tokenizer, {EOS_ID}


def _llama(layers: int, dtype: str, device: str, **width):
    import torch
    import transformers

    from lmc.testing.checkpoints import config_for

    config = config_for("llama", num_hidden_layers=layers, **width)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=_torch_dtype(dtype))
    return model.eval()


class _Timer:
    """Times lmc's decode loop (the one every engine serves through) on an in-memory model."""

    def __init__(self, model, device: str):
        import torch

        from lmc.runtime.engines.generate import DecodeLoop

        tokenizer, eos = _tokenizer()
        self.loop = DecodeLoop(model, tokenizer, max_sequence_length=4096, device=torch.device(device),
                               eos_token_ids=eos)
        self.sync = _sync(device)

    def seconds(self, prompt_tokens: int, new_tokens: int, batch: int = 1) -> float:
        from lmc.runtime.engines.base import GenerationParams, GenerationRequest

        prompt = " the" * (prompt_tokens - 1)  # one token each, after the BOS the tokenizer adds
        params = GenerationParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, ignore_eos=True)
        requests = [GenerationRequest(id=str(i), prompt=prompt, params=params) for i in range(batch)]
        begin = time.perf_counter()
        self.loop.generate(requests)
        self.sync()
        return time.perf_counter() - begin

    def step_ms(self, new_tokens: int, prompt_tokens: int = 8, reps: int = 3, batch: int = 1) -> float:
        """One decode step: the median time between the starts of consecutive decode forwards (each
        interval one step: the forward, sampling, the loop) over `reps` runs of `new_tokens`. A median
        of many steps, like the bench's p50, shrugs off what another process does to a few of them."""
        starts: list[float] = []
        hook = self.loop.model.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))
        steps: list[float] = []
        try:
            self.seconds(prompt_tokens, 2, batch)  # warm-up
            for _ in range(reps):
                starts.clear()
                self.seconds(prompt_tokens, new_tokens, batch)
                steps += [later - earlier for earlier, later in zip(starts[1:], starts[2:])]  # [0] is the prefill
        finally:
            hook.remove()
        return statistics.median(steps) * 1e3


def engine_overheads(device: str) -> tuple[float, float]:
    """(step overhead ms, per-layer overhead ms): decode steps of two tiny models, a line through them."""
    times = []
    for layers in _OVERHEAD_LAYERS:
        times.append(_Timer(_llama(layers, "fp32", device), device).step_ms(new_tokens=24, reps=5))
    (l1, t1), (l2, t2) = zip(_OVERHEAD_LAYERS, times)
    per_layer = max((t2 - t1) / (l2 - l1), 0.0)
    return max(t1 - per_layer * l1, 0.0), per_layer


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


def _calibration_hardware(dtype: str, figures: EngineFigures, step_ms: float, layer_ms: float):
    """A CPU whose hf engine achieves `figures` (peaks far above them: only the achieved rates matter)."""
    from lmc.planner.facts import HardwareFacts, InterconnectFacts, MeasuredEngineFacts

    measured = MeasuredEngineFacts(decode_bandwidth_bytes_per_s={dtype: figures.decode_bandwidth},
                                   prefill_tflops={dtype: figures.prefill_tflops},
                                   decode_tflops={dtype: figures.decode_tflops},
                                   step_overhead_ms=step_ms, layer_overhead_ms=layer_ms)
    return HardwareFacts(name="local", accelerator="cpu", kind="cpu", devices=1, device_memory_bytes=2**40,
                         memory_bandwidth_bytes_per_s=1e18, tflops={dtype: 1e9}, dtypes=[dtype],
                         interconnect=InterconnectFacts(name="none", bandwidth_bytes_per_s=1e9, latency_us=0),
                         source="lmc calibrate (solving)", measured={"hf": measured})


def solve_figures(model_facts, dtype: str, step_ms: float, layer_ms: float, tpot_1: float, tpot_n: float,
                  ttft: float, guess: EngineFigures, peak_tflops: float = math.inf) -> EngineFigures | None:
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
        hardware = _calibration_hardware(dtype, f, step_ms, layer_ms)
        return latency.tpot_ms(model_facts, hardware, engine, dtype, 1, batch, _DECODE_PROMPT, _DECODE_TOKENS)

    def prefill(f: EngineFigures) -> float:
        hardware = _calibration_hardware(dtype, f, step_ms, layer_ms)
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


def decode_and_prefill(device: str, dtype: str, step_overhead_ms: float, layer_overhead_ms: float,
                       guess: EngineFigures, peak_tflops: float) -> EngineFigures | None:
    """A ~256 MB random Llama in `dtype` through lmc's decode loop: batch-1 and batch-8 decode steps and
    a 128-token prefill, turned into achieved rates by `solve_figures`."""
    from lmc.planner.checkpoint_facts import facts_from_config
    from lmc.planner.facts import DTYPE_BYTES
    from lmc.testing.checkpoints import config_for

    size = DTYPE_BYTES[dtype]
    per_layer = (4 * 1024 * 1024 * 0.625 + 3 * 1024 * 2816) * size  # q,o full; k,v a quarter each
    layers = max(2, round(_DECODE_BYTES / per_layer))
    model = _llama(layers, dtype, device, **_DECODE_WIDTH)
    facts = facts_from_config(config_for("llama", num_hidden_layers=layers, **_DECODE_WIDTH).to_dict(), "calibration",
                              source="lmc calibrate")
    facts = facts.model_copy(update={"parameters": sum(p.numel() for p in model.parameters()),
                                     "torch_dtype": dtype})
    timer = _Timer(model, device)
    timer.seconds(_PREFILL_TOKENS, 1)  # warm-up
    ttft_ms = min(timer.seconds(_PREFILL_TOKENS, 1) for _ in range(3)) * 1e3
    tpot_1 = timer.step_ms(new_tokens=_DECODE_TOKENS, prompt_tokens=_DECODE_PROMPT)
    tpot_n = timer.step_ms(new_tokens=_DECODE_TOKENS, prompt_tokens=_DECODE_PROMPT, batch=_DECODE_BATCH, reps=2)
    return solve_figures(facts, dtype, step_overhead_ms, layer_overhead_ms, tpot_1, tpot_n, ttft_ms, guess, peak_tflops)


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


def allreduce(device: str, timeout_s: float = 60.0) -> tuple[float, float, str]:
    """(latency µs of a 4-byte all-reduce, bus bandwidth bytes/s of a 16 MiB one, backend) between two
    local processes: gloo on CPU, NCCL on two GPUs."""
    backend = "nccl" if device == "cuda" else "gloo"
    code = f"from lmc.measure.calibrate import _allreduce_rank; _allreduce_rank({backend!r})"
    port = _free_port()
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
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gpu_runtime_overhead_bytes() -> int:
    """On a GPU: device memory in use beyond the tensors once the engine served a tiny model (CUDA
    context, allocator), from a fresh process."""
    code = ("import torch; from lmc.measure.calibrate import _Timer, _llama; "
            "_Timer(_llama(2, 'fp32', 'cuda'), 'cuda').seconds(8, 4); "
            "free, total = torch.cuda.mem_get_info(); print(total - free)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if result.returncode:
        raise MissingDependencyError("the hf engine could not run a tiny model on the GPU: "
                                     + (result.stderr.strip().splitlines() or ["no message"])[-1])
    return int(result.stdout.strip().splitlines()[-1])


_SERVED_SPEC = """\
[model]
id = "lmc/calibration-tiny-llama"
path = "checkpoint"
[target]
instance = "local"
[workload]
max_input_tokens = 16
max_output_tokens = 32
concurrency = 1
[pin]
engine = "hf"
dtype = "fp32"
tensor_parallel_degree = 1
"""


def served_engine(scratch: Path) -> tuple[float, float, int]:
    """(ms per token, ms before the first token, peak worker bytes less its weights) of a tiny 2-layer
    model served by `lmc runtime` at batch 1: what serving adds per token (the decode loop, the pipe to
    the front end, HTTP streaming), what a request pays before its prefill (HTTP, tokenizing, the
    queue), and what a worker process holds besides the model. Per token = (end-to-end of 32 tokens −
    of 2 tokens) / 30, each the fastest of 5: with sub-millisecond steps, streamed chunks arrive in
    bursts, so the time between them says nothing; the end of a request does. The request's own cost
    is the 2-token end-to-end less two tokens' worth."""
    import asyncio

    from lmc.emitters.build import build_artifact
    from lmc.measure.bench import BenchSetup, open_target
    from lmc.measure.loadgen import _completion_body, build_prompt, make_client, run_level, served_model
    from lmc.measure.procmem import PeakMemory
    from lmc.schema import load_spec
    from lmc.testing.checkpoints import make_checkpoint

    with tempfile.TemporaryDirectory(prefix="lmc-calibrate-", dir=scratch) as tmp:
        root = Path(tmp)
        make_checkpoint("llama", root / "checkpoint")
        (root / "spec.toml").write_text(_SERVED_SPEC, encoding="utf-8")
        build_artifact(load_spec(root / "spec.toml"), root / "model", fmt="dir")
        weights = sum(f.stat().st_size for f in (root / "model" / "shards").rglob("*.safetensors"))
        setup = BenchSetup(str(root / "model"), False, 16, 32, [1], 5, None, None, None, 120.0, 300.0)

        async def measure(url: str) -> dict[int, float]:
            async with make_client(120.0, 1) as client:
                model = await served_model(client, url)
                prompt = await build_prompt(client, url, model, 16)
                fastest = {}
                for tokens in (32, 2):
                    samples, _ = await run_level(client, url, _completion_body(prompt, tokens, model, stream=True), 1, 5)
                    done = [s.e2e_s for s in samples if s.error is None and s.completion_tokens == tokens]
                    if not done:
                        raise MissingDependencyError("the tiny calibration model served no complete answer: "
                                                     f"{samples[0].error if samples else 'no samples'}")
                    fastest[tokens] = min(done)
                return fastest

        with open_target(setup, quiet=True) as served:
            with PeakMemory(served.pid) as sampler:
                fastest = asyncio.run(measure(served.url))
            peak = max(sampler.overall().values(), default=0)
    per_token = (fastest[32] - fastest[2]) / 30 * 1e3
    return per_token, max(fastest[2] * 1e3 - 2 * per_token, 0.0), max(peak - weights, 0)


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
              progress: bool | None = None) -> Calibration:
    """Measure this machine (see the module docstring); `progress` None shows a bar on a terminal."""
    from tqdm import tqdm

    stages = ["stream bandwidth", "matmul", "engine overheads", "decode & prefill", "all-reduce",
              "served engine", "storage read"]
    bar = tqdm(total=len(stages), desc="lmc calibrate", unit="stage", disable=None if progress is None else not progress,
               file=sys.stderr, bar_format="{desc}: {n_fmt}/{total_fmt} {bar} {elapsed} {postfix}")

    def stage(name: str) -> None:
        bar.set_postfix_str(name)

    def done(line: str) -> None:
        bar.update(1)
        bar.write(f"  {line}", file=sys.stderr)

    with bar:
        torch = _import_torch(device)
        dtypes = dtypes or (("fp32", "bf16") if device == "cpu" else ("fp16", "bf16"))
        stage(stages[0])
        stream = stream_bandwidth(device)
        done(f"stream bandwidth {stream / 1e9:.2f} GB/s")
        stage(stages[1])
        matmul = {dtype: matmul_tflops(device, dtype) for dtype in dtypes}
        done("matmul " + ", ".join(f"{dtype} {value:.3f} TFLOPS" for dtype, value in matmul.items()))
        notes = []
        if device == "cpu":
            # The engine is measured as a served rank runs; the matmul peak is the better of every core
            # and the rank's threads (another process on one core slows a 2-thread matmul the most).
            torch.set_num_threads(worker_threads())
            matmul = {dtype: max(value, matmul_tflops(device, dtype)) for dtype, value in matmul.items()}
            notes.append(f"the engine was measured with {worker_threads()} thread(s), as `lmc runtime` runs a CPU rank "
                         "(OMP_NUM_THREADS, default 1); calibrate with the same OMP_NUM_THREADS the server gets")
        for attempt in range(_ATTEMPTS):
            stage(stages[2] if attempt == 0 else f"{stages[2]} (again)")
            step, layer = engine_overheads(device)
            stage(stages[3])
            figures = {dtype: decode_and_prefill(device, dtype, step, layer,
                                                 EngineFigures(stream / 2, matmul[dtype] / 2, matmul[dtype] / 2),
                                                 matmul[dtype])
                       for dtype in dtypes}
            doubt = implausible(stream, matmul, figures)
            if doubt is None:
                break
            bar.write(f"  disturbed ({doubt}); measuring again", file=sys.stderr)
        else:
            notes.append(f"the engine figures looked disturbed in {_ATTEMPTS} tries ({doubt}): calibrate again "
                         "when the machine is quiet")
        done(f"engine hf: {step:.2f} ms per step + {layer:.3f} ms per layer")
        figures = {dtype: f for dtype, f in figures.items() if f is not None}
        decode = {dtype: f.decode_bandwidth for dtype, f in figures.items()}
        prefill = {dtype: f.prefill_tflops for dtype, f in figures.items()}
        decode_tflops = {dtype: f.decode_tflops for dtype, f in figures.items()}
        if not figures:
            raise MissingDependencyError("every engine measurement came out below the fixed costs (the machine "
                                         "was too busy): calibrate again when it is quieter")
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
        if device == "cpu":
            served_tpot, request_ms, overhead = served_engine(scratch or Path(tempfile.gettempdir()))
            # What serving adds per step: the served tiny model's TPOT less its layers' share.
            step = max(served_tpot - _OVERHEAD_LAYERS[0] * layer, step)
            done(f"served by lmc runtime: {served_tpot:.2f} ms per token (step overhead {step:.2f} ms), "
                 f"{request_ms:.1f} ms per request; worker {overhead / 2**20:.0f} MiB besides the weights")
        else:
            request_ms = 0.0
            overhead = gpu_runtime_overhead_bytes()
            done(f"engine context and allocator: {overhead / 2**20:.0f} MiB of device memory")
        stage(stages[6])
        load = storage_read_bandwidth(scratch or Path(tempfile.gettempdir()))
        done(f"storage read {load / 1e9:.2f} GB/s")
    return Calibration(
        device=device, accelerator=_accelerator_name(device), devices=devices,
        device_memory_bytes=_device_memory(device), host_memory_bytes=_ram_bytes(),
        stream_bandwidth=stream, matmul_tflops=matmul, decode_bandwidth=decode, prefill_tflops=prefill,
        decode_tflops=decode_tflops, prefill_overhead_ms=request_ms,
        step_overhead_ms=step, layer_overhead_ms=layer, runtime_overhead_bytes=overhead,
        allreduce_latency_us=latency_us, allreduce_bandwidth=bandwidth, allreduce_backend=backend,
        load_bandwidth=load, host=_host_line(), notes=notes)


def worker_threads() -> int:
    """The threads one CPU rank computes with: `lmc runtime` gives each rank OMP_NUM_THREADS, default 1
    (lmc/runtime/workers.py, device_env), so the engine is measured with as many."""
    value = os.environ.get("OMP_NUM_THREADS", "1")
    return max(1, int(value)) if value.isdigit() else 1


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


def _host_line() -> str:
    """The CPU model, its cores and the load when measured: figures on a shared host move with it."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return f"{model or 'unknown CPU'}, {os.cpu_count()} cores, load average {load}"
