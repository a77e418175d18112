"""Partition bench: memory stays bounded by the largest tensor, and throughput is near a plain copy.

Builds two fp32 checkpoints of one family (default ~0.5 GB and ~2 GB) that differ only in layer
count, so their largest tensor is the same. For each, in a fresh child process, validates and
partitions it to fp16 at TP=2 and reports the child's peak RSS (VmHWM); in the same run it times
a plain `shutil.copyfile` of the same weight files. Both start after `os.sync()`, from a warm page
cache (the checkpoint was just written), so neither pays for the other's write-back; each is run
--repeat times, alternating, and the fastest run of each is kept (peak RSS: the largest). Targets:

  peak RSS (big) / peak RSS (small) <= 1.25      memory follows the largest tensor, not the model
  partition MB/s / copy MB/s        >= 0.5       (source bytes per second, both from a warm cache)

Exit status 1 when a target is missed. Usage: python bench/partition_bench.py [--sizes 0.5,2] [--family llama]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RSS_RATIO_MAX = 1.25
THROUGHPUT_RATIO_MIN = 0.5
# Wide enough that a layer is ~47 MB in fp32, so 2 GB is ~43 layers; the vocabulary stays tiny.
DIMS = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8)

_CHILD = r"""
import json, sys, time
from pathlib import Path
import torch, tqdm  # imported before the clock starts: a fixed cost, not throughput
from lmc.emitters.checkpoint import validate_checkpoint
from lmc.emitters.partition import partition_checkpoint
from lmc.planner.checkpoint_facts import checkpoint_model_facts

path, out = Path(sys.argv[1]), Path(sys.argv[2])
facts = checkpoint_model_facts(path, "bench")
info = validate_checkpoint(path, facts)
start = time.perf_counter()
partition_checkpoint(info, family=facts.family, dtype="fp16", tp=2, head_dim=facts.head_dim,
                     kv_heads=facts.kv_heads, out_dir=out, progress=False)
seconds = time.perf_counter() - start
status = Path("/proc/self/status").read_text()
hwm_kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
print(json.dumps({"seconds": seconds, "peak_rss": hwm_kib * 1024, "source_bytes": info.total_bytes,
                  "largest_tensor": info.largest_tensor_bytes}))
"""


def _build(family: str, directory: Path, size_bytes: int) -> Path:
    import torch

    from lmc.testing import make_checkpoint

    torch.set_num_threads(2)
    return make_checkpoint(family, directory, size_bytes=size_bytes, **(DIMS if family != "gptj" else {}))


def _partition(path: Path, out: Path) -> dict:
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(out)], capture_output=True, text=True, env=env)
    if result.returncode:
        sys.exit(f"partition child failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _copy_seconds(path: Path, dest: Path) -> float:
    dest.mkdir()
    os.sync()  # start from no dirty pages, as the partition does
    start = time.perf_counter()
    for file in sorted(path.glob("*.safetensors")):
        shutil.copyfile(file, dest / file.name)
    seconds = time.perf_counter() - start
    shutil.rmtree(dest)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llama")
    parser.add_argument("--sizes", default="0.5,2", help="checkpoint sizes in GB (1e9 bytes), smallest first")
    parser.add_argument("--repeat", type=int, default=3, help="runs per size; the fastest of each is reported")
    parser.add_argument("--tmp", type=Path, default=None, help="where to build (default: the system temp dir)")
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="lmc-partition-bench-", dir=args.tmp) as tmp:
        for size in sizes:
            root = Path(tmp) / f"{size}GB"
            start = time.perf_counter()
            path = _build(args.family, root / "ckpt", int(size * 1e9))
            built = time.perf_counter() - start
            copies, runs = [], []
            for _ in range(args.repeat):  # alternate, keep the best of each: the build host is shared
                os.sync()  # the build's (and the last run's) writes must not slow what is measured next
                copies.append(_copy_seconds(path, root / "copy"))
                os.sync()
                runs.append(_partition(path, root / "out"))
                shutil.rmtree(root / "out")
            shutil.rmtree(root)
            copy = min(copies)
            measured = min(runs, key=lambda run: run["seconds"])
            measured["peak_rss"] = max(run["peak_rss"] for run in runs)
            source_mb = measured["source_bytes"] / 1e6
            rows.append(dict(size_gb=size, build_s=built, source_mb=source_mb, largest_mb=measured["largest_tensor"] / 1e6,
                             peak_rss_mb=measured["peak_rss"] / 1e6, partition_mb_s=source_mb / measured["seconds"],
                             copy_mb_s=source_mb / copy))
    print(f"{'size':>6} {'weights MB':>11} {'largest MB':>11} {'peak RSS MB':>12} {'partition MB/s':>15} "
          f"{'copy MB/s':>10} {'ratio':>6}")
    ok = True
    for row in rows:
        ratio = row["partition_mb_s"] / row["copy_mb_s"]
        ok &= ratio >= THROUGHPUT_RATIO_MIN
        print(f"{row['size_gb']:>5}G {row['source_mb']:>11.1f} {row['largest_mb']:>11.2f} {row['peak_rss_mb']:>12.1f} "
              f"{row['partition_mb_s']:>15.1f} {row['copy_mb_s']:>10.1f} {ratio:>6.2f}")
    rss_ratio = rows[-1]["peak_rss_mb"] / rows[0]["peak_rss_mb"]
    ok &= rss_ratio <= RSS_RATIO_MAX
    print(f"peak RSS ratio {rows[-1]['size_gb']}G / {rows[0]['size_gb']}G = {rss_ratio:.3f} (target <= {RSS_RATIO_MAX}); "
          f"throughput ratio target >= {THROUGHPUT_RATIO_MIN}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
