"""The measuring loop on one CUDA GPU (issue 17): a 7B-class random-weight Llama in fp16, planned, built,
served and benched with each engine, against the plan and the bandwidth roofline.

    python bench/gpu/gpu_loop.py [--work DIR] [--engines hf,deepspeed,vllm] [--accelerator NAME] [--layers N]

1. `lmc calibrate --device cuda --base ACCELERATOR` → profile.toml (the GPU measured).
   A profile already under the work directory is reused (a second run with other engines).
2. A random Llama-2-7B-shaped checkpoint (hidden 4096, 32 layers, MLP 11008; the tiny tokenizer's
   384-token vocabulary: 6.5 B parameters), weights drawn on the GPU and written in fp16. `--layers`
   keeps the width and takes fewer layers (8: 1.6 B parameters), for a short lease.
3. Per engine (hf; deepspeed, AutoTP without kernel injection; vllm): a spec pinned to it on the measured
   profile, `lmc plan`, `lmc build --format dir`, `lmc runtime` on a free port; the `openai` client's
   completion and chat calls (plain and streamed) must answer; `lmc bench URL --pid` at concurrency
   1, 8 and 32 (peak device memory per process from nvidia-smi); `lmc plan --compare`.
4. Per engine, in-process: the hf engine's load of the same artifact and a batch at the planned size,
   for torch.cuda.max_memory_allocated beside nvidia-smi's figure and the plan's memory.
5. One table: per engine, TPOT at batch 1 beside the roofline (decode weight bytes / the catalog's HBM
   bandwidth), throughput at 1, 8 and 32, peak device memory (nvidia-smi, max_memory_allocated) beside
   the plan's, the flags `lmc plan --compare` raised; every figure with the device name and the date.
   Written to results.json and results.txt under the work directory.

Without CUDA it stops at once with one line (exit 1). Budget: about 10 minutes on an H100 (the
checkpoint and builds are ~13 GB each; vLLM's start-up dominates a run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ("hf", "deepspeed", "vllm")
LLAMA_7B = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                num_hidden_layers=32)
# torch.cuda.get_device_name() substrings → catalog accelerators (lmc/planner/data/hardware/accelerators.toml).
_GPU_NAMES = (("H200", "h200"), ("H100", "h100-80gb"), ("A100-SXM4-80GB", "a100-80gb"), ("A100 80GB", "a100-80gb"),
              ("A100", "a100-40gb"), ("A10G", "a10g"), ("L40S", "l40s"), ("L4", "l4"), ("T4", "t4"),
              ("V100", "v100-16gb"))


class LoopError(Exception):
    """One line for the user."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_loop.py", description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/lmc-gpu-loop"), help="where everything is written")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, from hf, deepspeed, vllm")
    parser.add_argument("--accelerator", help="the catalog accelerator (default: from the GPU's name)")
    parser.add_argument("--concurrency", default="1,8,32", help="bench levels (default 1,8,32)")
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--calibrate-timeout", type=float, default=900,
                        help="seconds `lmc calibrate` may take; past them the catalog's figures stand (default 900)")
    parser.add_argument("--layers", type=int, default=LLAMA_7B["num_hidden_layers"],
                        help="decoder layers of the 7B-wide model (default 32, Llama-2-7B's)")
    args = parser.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if not engines or unknown:
        parser.error(f"--engines {args.engines!r}: choose from {', '.join(ENGINES)}")
    try:
        levels = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    except ValueError:
        parser.error(f"--concurrency {args.concurrency!r}: comma-separated whole numbers")
    if not levels or levels[0] < 1:
        parser.error(f"--concurrency {args.concurrency!r}: levels of at least 1")
    if args.layers < 1:
        parser.error(f"--layers {args.layers}: at least 1")
    if args.input_tokens < 1 or args.output_tokens < 2:
        parser.error("--input-tokens must be at least 1 and --output-tokens at least 2")
    args.engines, args.levels = engines, levels
    return args


def require_cuda() -> str:
    """The GPU's name, or LoopError when there is none (before anything heavy starts)."""
    try:
        import torch
    except ImportError:
        raise LoopError("gpu_loop: torch is not installed; run on a GPU host with lmc[engines]") from None
    if not torch.cuda.is_available():
        raise LoopError("gpu_loop: no CUDA GPU here (torch.cuda.is_available() is False); run it on a GPU host")
    return torch.cuda.get_device_name(0)


def accelerator_for(device_name: str) -> str:
    for fragment, accelerator in _GPU_NAMES:
        if fragment.lower() in device_name.lower():
            return accelerator
    raise LoopError(f"gpu_loop: {device_name!r} is not a catalog GPU; pass --accelerator (a name in "
                    "lmc/planner/data/hardware/accelerators.toml)")


def checkpoint_name(layers: int) -> str:
    return "llama-7b" if layers == LLAMA_7B["num_hidden_layers"] else f"llama-7b-{layers}-layers"


def spec_text(engine: str, accelerator: str, input_tokens: int, output_tokens: int, concurrency: int,
              layers: int = LLAMA_7B["num_hidden_layers"], profile: bool = True) -> str:
    """The pinned spec; `profile` False plans on the catalog's figures (no measured profile)."""
    profile_line = 'profile = "profile.toml"\n' if profile else ""
    return (f'[model]\nid = "lmc/random-{checkpoint_name(layers)}"\npath = "{checkpoint_name(layers)}"\n\n'
            f'[target]\naccelerator = "{accelerator}"\ndevices = 1\n{profile_line}\n'
            f"[workload]\nmax_input_tokens = {input_tokens}\nmax_output_tokens = {output_tokens}\n"
            f"concurrency = {concurrency}\n\n"
            f'[pin]\nengine = "{engine}"\ndtype = "fp16"\ntensor_parallel_degree = 1\n')


def roofline_ms(decode_weight_bytes: float, bandwidth_bytes_per_s: float) -> float:
    """The least a batch-1 decode step can take: every weight read once at the HBM bandwidth."""
    return decode_weight_bytes / bandwidth_bytes_per_s * 1e3


def engine_row(engine: str, device: str, date: str, plan: dict[str, Any] | None, bench: dict[str, Any] | None,
               comparison: dict[str, Any] | None, allocated: int | None, roofline: float | None,
               openai_ok: bool | None, error: str | None) -> dict[str, Any]:
    """One engine's figures, each carrying the device and the date it was measured on."""
    levels = {level["concurrency"]: level for level in (bench or {}).get("levels", [])}
    tpot_1 = (levels.get(1, {}).get("tpot_ms") or {}).get("p50")
    return {
        "engine": engine, "device": device, "date": date, "error": error, "openai_client": openai_ok,
        "tpot_batch1_ms": tpot_1, "roofline_ms": roofline,
        "tpot_over_roofline": None if tpot_1 is None or not roofline else round(tpot_1 / roofline, 3),
        "throughput_tokens_per_s": {str(c): level.get("output_tokens_per_s") for c, level in sorted(levels.items())},
        "peak_device_memory_nvidia_smi": (bench or {}).get("peak_worker_memory_bytes"),
        "max_memory_allocated": allocated,
        "predicted_memory": (plan or {}).get("memory_per_device", {}).get("total"),
        "predicted_tpot_ms": (plan or {}).get("predicted", {}).get("tpot_ms"),
        "compare_flags": None if comparison is None else comparison.get("flagged"),
    }


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def render_table(rows: list[dict[str, Any]], levels: list[int]) -> str:
    """The engines side by side (fixed width); the device and date head the table and end every row."""
    columns = (["engine", "openai", "TPOT b1 ms", "roofline ms", "×roofline"] + [f"tok/s c{c}" for c in levels]
               + ["peak GiB smi", "alloc GiB", "plan GiB", "flags", "device, date"])
    table = []
    for row in rows:
        if row["error"]:
            table.append([row["engine"], "-", f"not run: {row['error']}"] + [""] * (len(columns) - 4)
                         + [f"{row['device']}, {row['date']}"])
            continue
        throughput = row["throughput_tokens_per_s"]
        table.append([row["engine"], {True: "ok", False: "FAILED", None: "-"}[row["openai_client"]],
                      _ms(row["tpot_batch1_ms"]), _ms(row["roofline_ms"]),
                      "-" if row["tpot_over_roofline"] is None else f"{row['tpot_over_roofline']:.2f}"]
                     + [_ms(throughput.get(str(c))) for c in levels]
                     + [_gib(row["peak_device_memory_nvidia_smi"]), _gib(row["max_memory_allocated"]),
                        _gib(row["predicted_memory"]), "-" if row["compare_flags"] is None else str(row["compare_flags"]),
                        f"{row['device']}, {row['date']}"])
    widths = [max([len(c)] + [len(r[i]) for r in table if i < len(r)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    for row in table:
        if row[2].startswith("not run:"):
            lines.append(f"{row[0].ljust(widths[0])}  {row[2]}  ({row[-1]})")
        else:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines) + "\n"


# --- the run (GPU only) ---------------------------------------------------------------------------

def _env() -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH (what was there stays)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


_STARTED = time.monotonic()


def progress(step: str) -> None:
    """One line per step on stderr, with the seconds since the loop started (a short lease needs to
    know where its time went)."""
    print(f"[{time.monotonic() - _STARTED:6.0f} s] {step}", file=sys.stderr, flush=True)


def measure_profile(work: Path, accelerator: str, timeout: float) -> str | None:
    """`lmc calibrate` into work/profile.toml (its log beside it); None when it is there, else why the
    catalog's figures stand instead (it failed or ran past `timeout`)."""
    profile = work / "profile.toml"
    if profile.is_file():
        progress(f"reusing the measured profile {profile}")
        return None
    progress("lmc calibrate --device cuda")
    with (work / "calibrate.log").open("w") as log:
        try:
            result = subprocess.run([sys.executable, "-m", "lmc", "calibrate", "--device", "cuda", "--base", accelerator,
                                     "--out", str(profile)], env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                    timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"lmc calibrate ran past {timeout:.0f} s"
    if result.returncode:
        lines = (work / "calibrate.log").read_text(errors="replace").strip().splitlines() or ["no message"]
        return f"lmc calibrate exited {result.returncode}: {lines[-1]}"
    return None


def _lmc(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = _env()
    result = subprocess.run([sys.executable, "-m", "lmc", *args], env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode:
        raise LoopError(f"lmc {args[0]} exited {result.returncode}: "
                        + (result.stderr.strip().splitlines() or ["no message"])[-1])
    return result


def write_checkpoint(out: Path, layers: int = LLAMA_7B["num_hidden_layers"]) -> None:
    """A Llama-2-7B-shaped checkpoint in fp16: the tiny checkpoint's files (tokenizer, config) widened,
    its weights drawn on the GPU (initialising 6.5 B parameters on a CPU takes minutes)."""
    if (out / "model.safetensors.index.json").is_file():
        return
    import torch
    import transformers
    from safetensors.torch import save_file

    from lmc.testing.checkpoints import config_for, make_checkpoint

    make_checkpoint("llama", out, dtype="float16", num_hidden_layers=1)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    config = config_for("llama", torch_dtype="float16", **dict(LLAMA_7B, num_hidden_layers=layers))
    config.save_pretrained(out)
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in transformers.AutoModelForCausalLM.from_config(config).state_dict().items()}
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight_map, shard, shard_bytes, index = {}, {}, 0, 1

    def flush() -> None:
        nonlocal shard, shard_bytes, index
        name = f"model-{index:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
        shard, shard_bytes, index = {}, 0, index + 1

    for name, shape in sorted(shapes.items()):
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=torch.float16)
        else:
            tensor = (torch.randn(shape, generator=generator, device="cuda", dtype=torch.float16) * 0.02).cpu()
        shard[name] = tensor
        shard_bytes += tensor.numel() * 2
        if shard_bytes > 4 * 2**30:
            flush()
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


def openai_answers(url: str) -> bool:
    """The openai client's completion and chat calls, plain and streamed, each with some text."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    model = client.models.list().data[0].id  # the served name: any other is a 404, as in vLLM
    done = client.completions.create(model=model, prompt="the quick brown fox", max_tokens=8)
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=model, prompt="the quick brown fox", max_tokens=8, stream=True) if chunk.choices)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    return bool(done.choices[0].text) and bool(streamed) and chat.choices[0].message.content is not None


_ALLOCATED = """\
import json, sys, torch
from pathlib import Path
from lmc.runtime.engines import create_engine
from lmc.runtime.engines.base import GenerationParams, GenerationRequest
model_dir, input_tokens, output_tokens = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
plan = json.loads((model_dir / "lmc.json").read_text())["plan"]
engine = create_engine("hf", family=plan["model"]["family"], task="text-generation", dtype=plan["dtype"],
                       tensor_parallel_degree=1, max_sequence_length=plan["max_sequence_length"],
                       batch_size=plan["batch_size"], device="cuda")
engine.load(model_dir, 0, 1)
params = GenerationParams(max_new_tokens=output_tokens, min_new_tokens=output_tokens, ignore_eos=True)
engine.generate([GenerationRequest(id=str(i), prompt=" the" * (input_tokens - 1), params=params)
                 for i in range(plan["batch_size"])])
print(torch.cuda.max_memory_allocated())
"""


def max_memory_allocated(model_dir: Path, input_tokens: int, output_tokens: int) -> int:
    """torch.cuda.max_memory_allocated of the hf engine loading `model_dir` (an hf artifact) and
    decoding a batch of the planned size, in a process of its own."""
    env = _env()
    result = subprocess.run([sys.executable, "-c", _ALLOCATED, str(model_dir), str(input_tokens), str(output_tokens)],
                            env=env, capture_output=True, text=True, timeout=600)
    if result.returncode:
        raise LoopError("max_memory_allocated: " + (result.stderr.strip().splitlines() or ["no message"])[-1])
    return int(result.stdout.strip().splitlines()[-1])


def _serve(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    from lmc.runtime.workers import free_port

    port = free_port()
    env = _env()
    server = subprocess.Popen([sys.executable, "-m", "lmc", "runtime", "serve", str(model_dir), "--port", str(port),
                               "--host", "127.0.0.1"], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise LoopError(f"lmc runtime exited {server.returncode} (log: {log})")
        try:
            if httpx.get(f"{url}/ping", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.kill()
    raise LoopError(f"lmc runtime not ready in 600 s (log: {log})")


def run_engine(engine: str, args: argparse.Namespace, accelerator: str, device: str, date: str) -> dict[str, Any]:
    from lmc.planner.catalog import accelerator_facts
    from lmc.planner.engines import engine_facts
    from lmc.planner.memory import decode_weight_bytes

    work = args.work
    spec = work / f"spec-{engine}.toml"
    spec.write_text(spec_text(engine, accelerator, args.input_tokens, args.output_tokens, max(args.levels),
                              args.layers, profile=(work / "profile.toml").is_file()))
    plan = bench = comparison = allocated = roofline = openai_ok = None
    try:
        progress(f"{engine}: lmc plan")
        plan = json.loads(_lmc("plan", str(spec), "--json").stdout)
        from lmc.pipeline import plan_from_spec
        from lmc.schema import load_spec

        planned = plan_from_spec(load_spec(spec))
        hardware = accelerator_facts(accelerator, 1)
        roofline = roofline_ms(decode_weight_bytes(planned.model, engine_facts()[engine], "fp16", 1, hardware),
                               hardware.memory_bandwidth_bytes_per_s)
        model_dir = work / f"model-{engine}"
        progress(f"{engine}: lmc build")
        _lmc("build", str(spec), "--format", "dir", "-o", str(model_dir), timeout=1800)
        progress(f"{engine}: lmc runtime")
        server, url = _serve(model_dir, work / f"runtime-{engine}.log")
        try:
            progress(f"{engine}: the openai client")
            try:
                openai_ok = openai_answers(url)
            except ImportError as exc:  # the openai client (or a package it needs) is not installed here
                progress(f"{engine}: the openai client not checked ({exc})")
            progress(f"{engine}: lmc bench")
            levels = ",".join(str(c) for c in args.levels)
            _lmc("bench", url, "--pid", str(server.pid), "--device", "gpu", "--input-tokens", str(args.input_tokens), "--output-tokens",
                 str(args.output_tokens), "--concurrency", levels, "--json", str(work / f"bench-{engine}.json"),
                 "--plot", str(work / f"bench-{engine}.png"))
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=120)
        bench = json.loads((work / f"bench-{engine}.json").read_text())
        comparison = json.loads(_lmc("plan", str(spec), "--compare", str(work / f"bench-{engine}.json"), "--json").stdout)
        if engine == "hf":
            progress(f"{engine}: max_memory_allocated")
            allocated = max_memory_allocated(model_dir, args.input_tokens, args.output_tokens)
        error = None
    except (LoopError, OSError, subprocess.TimeoutExpired) as exc:
        error = str(exc)
    return engine_row(engine, device, date, plan, bench, comparison, allocated, roofline, openai_ok, error)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        device = require_cuda()
        accelerator = args.accelerator or accelerator_for(device)
        args.work.mkdir(parents=True, exist_ok=True)
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        started = time.monotonic()
        catalog_because = measure_profile(args.work, accelerator, args.calibrate_timeout)
        if catalog_because:
            progress(f"{catalog_because}: planning on the catalog's figures")
        progress("the checkpoint")
        write_checkpoint(args.work / checkpoint_name(args.layers), args.layers)
        rows = [run_engine(engine, args, accelerator, device, date) for engine in args.engines]
    except LoopError as exc:
        print(exc, file=sys.stderr)
        return 1
    text = render_table(rows, args.levels)
    minutes = (time.monotonic() - started) / 60
    (args.work / "results.json").write_text(json.dumps({"device": device, "date": date, "minutes": minutes,
                                                        "layers": args.layers, "profile": catalog_because or "measured",
                                                        "rows": rows}, indent=2) + "\n")
    (args.work / "results.txt").write_text(text)
    print(text + f"{minutes:.1f} minutes in all")
    return 0 if all(row["error"] is None and row["openai_client"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
