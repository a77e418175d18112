"""Cold-start bench: process start -> /ping 200 for `lmc runtime` on a built artifact, against loading
the same checkpoint with `from_pretrained` and partitioning it at start (what a container does
without lmc), both at TP=2 on this CPU.

Builds a ~1 GB random Llama stored in fp32 (--size; GPT-J's and FLAN-T5's published weights are fp32
too), and for each serving dtype (--dtype: fp32, bf16 or both, the default) `lmc build`s it (hf
engine, that dtype, TP=2, --format dir), then times, from a warm page cache, alternately --runs
times each:

  lmc       `python -m lmc runtime --model-dir ARTIFACT`: verify every file's sha256, start 2 worker
            processes (gloo), each reading only its own pre-partitioned shard, already in the serving
            dtype; until GET /ping is 200.
  baseline  what a container without lmc does: 2 rank processes (gloo), each
            `AutoModelForCausalLM.from_pretrained(checkpoint, dtype=<serving dtype>)` of the whole
            model (converting fp32 -> bf16 at start when serving bf16), then slicing its part with
            lmc.layouts (the same split the build makes); until both ranks hold their part. No HTTP
            server: the baseline is flattered, not lmc.

Reports, per configuration (fp32->fp32, fp32->bf16), the best time of each and lmc / baseline, and
beside them the import floor: a process importing only what lmc's fork server imports, timed in the
same run, so the part neither side can move is visible (lmc_above_floor_s, baseline_above_floor_s),
and floor_ratio: floor / baseline, the ratio of a runtime that spent nothing beyond those imports.
Target <= 0.5. The exit status (1 when missed) follows the fp32->bf16 configuration when it is run:
it is the one lmc exists for (a checkpoint published in fp32, served in half precision, where the
conversion and partitioning lmc moves to build time are paid at every start without it); the fp32
configuration is reported beside it, its ratio shown as it is. With --dtype fp32 alone the status
follows fp32.

Where lmc's seconds went when this was last tuned (2-core host, 1 GB fp32): ~0.2-0.4 s from process
start to the fork server's first import; ~2.7-4.6 s (two sessions' hosts) the fork server importing
torch + transformers + the family's module once (collector off) while the sha256 check (~1 s/GB, one
thread) runs beside it; then ~0.1-0.3 s per rank after the fork (gloo 0.02, config + tokenizer 0.02,
mapping the shard 0.01, the meta skeleton 0.04 with weight initialisation off, attaching the mapped
tensors 0.02). The import is the floor (~85 % of lmc's time): the baseline pays it in each rank.
Usage: python bench/cold_start_bench.py [--size 1.0] [--runs 2] [--dtype fp32|bf16|both]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET_RATIO = 0.5
DIMS = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8)

SPEC = """\
[model]
id = "bench/llama-1gb"
path = "{path}"

[target]
instance = "local"
profile = "cpu2.toml"

[workload]
max_input_tokens = 64
max_output_tokens = 32
concurrency = 4

[pin]
engine = "hf"
dtype = "{dtype}"
tensor_parallel_degree = 2
replicas = 1
"""
CPU_PROFILE = 'base = "local"\ndevices = 2\ndevice_memory_bytes = "16GiB"\n'

_BASELINE_RANK = r"""
import os, sys
import torch, torch.distributed as dist, transformers
from lmc.layouts import rank_split
torch.set_num_threads(1)
checkpoint, family, rank, tp, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
dist.init_process_group("gloo", rank=rank, world_size=tp)
model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype))
config = model.config
head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
shard = {}
for name, tensor in model.state_dict().items():
    split = rank_split(family, name, tuple(tensor.shape), rank, tp, head_dim=head_dim, kv_heads=kv_heads)
    shard[name] = tensor if split.dim is None else tensor.narrow(split.dim, split.start, split.stop - split.start).clone()
del model
dist.barrier()
print("ready", flush=True)
dist.destroy_process_group()
"""


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def make_checkpoint(root: Path, size_gb: float) -> Path:
    import torch

    from lmc.testing.checkpoints import make_checkpoint

    torch.set_num_threads(2)
    (root / "cpu2.toml").write_text(CPU_PROFILE)
    return make_checkpoint("llama", root / "ckpt", size_bytes=int(size_gb * 1e9), **DIMS)


def build(root: Path, checkpoint: Path, dtype: str) -> Path:
    """`lmc build` the checkpoint for serving in `dtype`; returns the artifact directory."""
    from lmc.cli.main import main

    spec = root / f"spec-{dtype}.toml"
    spec.write_text(SPEC.format(path=checkpoint.as_posix(), dtype=dtype))
    out = root / f"artifact-{dtype}"
    if main(["build", str(spec), "--format", "dir", "-o", str(out)]) != 0:
        raise SystemExit("lmc build failed")
    return out


_IMPORT_FLOOR = r"""
import importlib, os, sys
from lmc.runtime.workers import preload_modules
for name in preload_modules({"engine": "hf", "model": {"family": sys.argv[1]}}):
    importlib.import_module(name)  # lmc.runtime.preload, first, turns the collector off as in the fork server
print("imported", flush=True)
os._exit(0)  # not a normal exit: tearing down torch and transformers takes a second, and is no one's start-up
"""


def time_import_floor(family: str = "llama") -> float:
    """A process that only imports what lmc's fork server imports (torch, transformers, the family's
    module, lmc's worker code), exactly as it does: the part of both sides' time no artifact layout
    changes. lmc pays it once; each baseline rank pays it too (with the collector on)."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", _IMPORT_FLOOR, family], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline()
    seconds = time.monotonic() - start
    if proc.wait(60) != 0 or line.strip() != "imported":
        raise SystemExit("the import-floor process failed")
    return seconds


def _ping(port: int) -> int | None:
    """GET /ping's status, None while nothing listens. http.client, not httpx: an httpx.get builds a
    client and an SSL context each call, ~30 ms of CPU, and 20 polls a second took a third of a core
    from the process being timed on a 2-core host (the baseline is timed with no poller at all)."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        connection.request("GET", "/ping")
        return connection.getresponse().status
    except OSError:
        return None
    finally:
        connection.close()


def time_lmc(artifact: Path) -> float:
    port = _free_port()
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "lmc", "runtime", "--model-dir", str(artifact), "--port", str(port),
                             "--host", "127.0.0.1"], cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"lmc runtime exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            if _ping(port) == 200:
                return time.monotonic() - start
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def time_baseline(checkpoint: Path, dtype: str, tp: int = 2) -> float:
    port = _free_port()
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", _BASELINE_RANK, str(checkpoint), "llama", str(rank), str(tp),
                               TORCH_DTYPES[dtype]],
                              env=dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(tp)]
    for proc in procs:
        line = proc.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"baseline rank failed: {proc.stderr.read()[-2000:]}")
    seconds = time.monotonic() - start
    for proc in procs:
        proc.wait(60)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=1.0, help="checkpoint size in GB (1e9 bytes)")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="both",
                        help="serving dtype: the plan's dtype, and the dtype the baseline loads the fp32 checkpoint in")
    parser.add_argument("--tmp", type=Path, default=None)
    args = parser.parse_args()
    dtypes = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]
    results = []
    with tempfile.TemporaryDirectory(prefix="lmc-cold-start-", dir=args.tmp) as tmp:
        checkpoint = make_checkpoint(Path(tmp), args.size)
        weights = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
        artifacts = {dtype: build(Path(tmp), checkpoint, dtype) for dtype in dtypes}
        os.sync()
        for dtype in dtypes:
            lmc_times, base_times, floors = [], [], []
            for _ in range(args.runs):
                base_times.append(time_baseline(checkpoint, dtype))
                lmc_times.append(time_lmc(artifacts[dtype]))
                floors.append(time_import_floor())
                print(f"fp32->{dtype}: baseline {base_times[-1]:.2f} s   lmc runtime {lmc_times[-1]:.2f} s   "
                      f"(import floor {floors[-1]:.2f} s)", flush=True)
            ratio = min(lmc_times) / min(base_times)
            floor = min(floors)
            # Above the floor: what each side spends beyond importing the libraries (lmc: process
            # start, the fork, the ranks' load, /ping; the baseline: from_pretrained and partitioning).
            results.append({"config": f"fp32->{dtype}", "checkpoint_bytes": weights, "tp": 2,
                            "lmc_runtime_s": round(min(lmc_times), 2),
                            "from_pretrained_and_partition_s": round(min(base_times), 2), "ratio": round(ratio, 3),
                            "import_floor_s": round(floor, 2),
                            "lmc_above_floor_s": round(min(lmc_times) - floor, 2),
                            "baseline_above_floor_s": round(min(base_times) - floor, 2),
                            # What a runtime that spent nothing beyond importing these libraries would score.
                            "floor_ratio": round(floor / min(base_times), 3),
                            "target": TARGET_RATIO, "verdict": "ok" if ratio <= TARGET_RATIO else "MISSED"})
    for result in results:
        print(json.dumps(result))
    # The status follows fp32->bf16 when it ran (see the module docstring for why), else fp32.
    deciding = results[-1]
    return 0 if deciding["ratio"] <= TARGET_RATIO else 1


if __name__ == "__main__":
    raise SystemExit(main())
