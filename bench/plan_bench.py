"""Plan bench: wall time of `lmc plan SPEC` per example spec, start-up included (target < 0.5 s).

Also times a bare `python -c pass` in the same run, so a slow machine shows as a slow baseline rather
than as a slow planner. Prints one line per spec and a JSON summary; exit 1 when a spec takes 0.5 s
or more (best of --runs).
Usage: python bench/plan_bench.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET_S = 0.5


def best_wall(argv: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    python = best_wall([sys.executable, "-c", "pass"], args.runs)
    walls = {}
    for spec in sorted((REPO / "specs").glob("*.toml")):
        if spec.stem == "tiny-llama-cpu" and not (REPO / "specs" / "models" / "tiny-llama").is_dir():
            continue  # its checkpoint is made by the tests (python -m lmc.testing llama specs/models/tiny-llama)
        walls[spec.stem] = best_wall([sys.executable, "-m", "lmc", "plan", str(spec)], args.runs)
        print(f"{walls[spec.stem]:6.3f} s  {spec.stem}")
    worst = max(walls.values())
    print(json.dumps({"specs": len(walls), "python_startup_s": round(python, 3), "max_s": round(worst, 3),
                      "median_s": round(sorted(walls.values())[len(walls) // 2], 3),
                      "max_over_python_startup": round(worst / python, 1), "target_s": TARGET_S,
                      "verdict": "ok" if worst < TARGET_S else "MISSED"}))
    return 0 if worst < TARGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
