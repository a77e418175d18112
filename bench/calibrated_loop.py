"""The measuring loop on this machine: calibrate, plan on the calibrated profile, build, serve, bench,
compare. A random-weight Llama of ~0.8 GB (fp32), served by the hf engine.

    python bench/calibrated_loop.py [--work DIR] [--reuse-profile]

Targets (issue 15): predicted TPOT within ±25 % of the measured p50 at concurrency 1 and 8, predicted
peak worker memory within ±15 % at every level. Prints every figure with the machine's load average
(the machine is shared: figures move with it) and exits 1 when a target is missed: a figure the bench
did not measure is a miss, and a step that fails (`lmc bench` exits 1 when requests fail) stops the
loop with one line. Writes profile.toml, bench.json, bench.png and compare.txt under the work directory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lmc.measure.compare import render_comparison  # noqa: E402
from lmc.measure.host import load_average  # noqa: E402

# ~0.8 GB in fp32: 8 layers of 1536 wide (GQA, 12 heads / 4 kv heads), MLP 4096.
MODEL = ["--set", "hidden_size=1536", "--set", "intermediate_size=4096", "--set", "num_attention_heads=12",
         "--set", "num_key_value_heads=4", "--set", "num_hidden_layers=8"]
SPEC = """\
# The calibrated loop's deployment: a random ~0.8 GB Llama on this machine, planned on its measured profile.
[model]
id = "lmc/random-llama-800m"
path = "llama-800m"

[target]
instance = "local"
profile = "profile.toml"

[workload]
max_input_tokens = 64
max_output_tokens = 64
concurrency = 8

[pin]
engine = "hf"
"""
TPOT_WITHIN = 0.25
MEMORY_WITHIN = 0.15


def lmc(*args: str, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "lmc", *args], env=env, check=True, **kwargs)


def main() -> int:
    try:
        return run_loop()
    except subprocess.CalledProcessError as exc:  # the step's own one-line error is above
        step = " ".join(str(arg) for arg in exc.cmd[2:4])  # [python, -m, lmc, bench, ...]: "lmc bench"
        print(f"calibrated loop FAILED: {step} exited with {exc.returncode}; nothing more was measured", file=sys.stderr)
        return 1


def missed_targets(rows: list[dict]) -> list[str]:
    """The targets a comparison misses. A target figure without a ratio (nothing measured) is a miss."""
    missed = []
    for row in rows:
        if row["figure"] == "tpot_ms" and row["concurrency"] in (1, 8):
            what, within = f"TPOT at concurrency {row['concurrency']}", TPOT_WITHIN
        elif row["figure"] == "peak_worker_memory_bytes":
            what, within = f"peak worker memory at concurrency {row['concurrency']}", MEMORY_WITHIN
        else:
            continue
        if row["ratio"] is None:
            missed.append(f"{what}: not measured")
        elif abs(row["ratio"] - 1) > within:
            missed.append(f"{what}: measured/predicted {row['ratio']:.2f}")
    return missed


def run_loop() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/lmc-calibrated-loop"))
    parser.add_argument("--reuse-profile", action="store_true", help="keep an existing profile.toml")
    parser.add_argument("--requests", default=None, help="timed requests per level (default: lmc bench's)")
    args = parser.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    timings = {}
    print(f"load average at start: {load_average()}")
    if not (args.reuse_profile and (work / "profile.toml").is_file()):
        begin = time.perf_counter()
        lmc("calibrate", "--out", str(work / "profile.toml"))
        timings["calibrate"] = time.perf_counter() - begin
    if not (work / "llama-800m" / "model.safetensors").is_file():
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        subprocess.run([sys.executable, "-m", "lmc.testing", "llama", str(work / "llama-800m"), *MODEL], env=env,
                       check=True, stdout=subprocess.DEVNULL)
    (work / "spec.toml").write_text(SPEC)
    lmc("plan", str(work / "spec.toml"))
    begin = time.perf_counter()
    lmc("build", str(work / "spec.toml"), "--format", "dir", "-o", str(work / "model"), stdout=subprocess.DEVNULL)
    timings["build"] = time.perf_counter() - begin
    bench = ["bench", str(work / "model"), "--spec", str(work / "spec.toml"), "--concurrency", "1,2,4,8",
             "--json", str(work / "bench.json"), "--plot", str(work / "bench.png")]
    if args.requests:
        bench += ["--requests", args.requests]
    begin = time.perf_counter()
    lmc(*bench)
    timings["bench"] = time.perf_counter() - begin
    compared = json.loads(lmc("plan", str(work / "spec.toml"), "--compare", str(work / "bench.json"), "--json",
                              capture_output=True, text=True).stdout)
    # `lmc plan --compare`'s text, rendered from the JSON rather than planning and comparing a second time.
    text = render_comparison(compared, str(work / "spec.toml"), str(work / "bench.json"))
    (work / "compare.txt").write_text(text)
    print(text)
    missed = missed_targets(compared["rows"])
    print("seconds: " + ", ".join(f"{key} {value:.1f}" for key, value in timings.items()))
    print(f"load average at the end: {load_average()}")
    if missed:
        print("MISSED: " + "; ".join(missed))
        return 1
    print(f"met: TPOT within ±{TPOT_WITHIN:.0%} at concurrency 1 and 8, peak worker memory within ±{MEMORY_WITHIN:.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
