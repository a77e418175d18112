"""Plan bench: wall time of `lmc plan SPEC` per example spec, start-up included (target < 0.5 s).

Also times a bare `python -c pass` in the same run, so a slow machine shows as a slow baseline rather
than as a slow planner. Prints one line per spec and a JSON summary; exit 1 when a spec takes 0.5 s
or more (best of --runs), and when `lmc plan` exits other than as designed (0, or 3 where the spec's
golden is the refusal): a spec that fails fast is not a fast plan.
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


def best_wall(argv: list[str], runs: int, expected_exit: int = 0) -> float:
    """The best wall time of `runs` runs of argv. RuntimeError (its first error line) when a run exits
    other than `expected_exit`."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        times.append(time.perf_counter() - start)
        if done.returncode != expected_exit:
            first = (done.stderr.strip().splitlines() or ["(nothing on stderr)"])[0]
            raise RuntimeError(f"exit {done.returncode}, expected {expected_exit}: {first}")
    return min(times)


def expected_exit(spec: Path) -> int:
    """3 where the spec is infeasible by design (its golden is the refusal, plan.txt), else 0."""
    return 3 if (REPO / "golden" / spec.stem / "plan.txt").is_file() else 0


def make_spec_checkpoints() -> None:
    """The checkpoints the CPU specs name by model.path (specs/models/, which git ignores), as the tests
    make them (tests/conftest.py), where they are missing."""
    sys.path.insert(0, str(REPO))
    from lmc.testing.checkpoints import make_checkpoint

    models = REPO / "specs" / "models"
    for name, overrides in (("tiny-llama", {}), ("tiny-llama-vllm", {"hidden_size": 128, "intermediate_size": 256})):
        if not (models / name / "config.json").is_file():
            make_checkpoint("llama", models / name, seed=0, **overrides)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    python = best_wall([sys.executable, "-c", "pass"], args.runs)
    make_spec_checkpoints()
    walls, failed = {}, []
    for spec in sorted((REPO / "specs").glob("*.toml")):
        try:
            walls[spec.stem] = best_wall([sys.executable, "-m", "lmc", "plan", str(spec)], args.runs, expected_exit(spec))
        except RuntimeError as exc:
            failed.append(spec.stem)
            print(f"FAILED    {spec.stem}: lmc plan {exc}")
            continue
        print(f"{walls[spec.stem]:6.3f} s  {spec.stem}")
    if failed:
        print(f"plan bench FAILED: {len(failed)} spec(s) did not plan as designed: {', '.join(failed)}", file=sys.stderr)
        return 1
    worst = max(walls.values())
    print(json.dumps({"specs": len(walls), "python_startup_s": round(python, 3), "max_s": round(worst, 3),
                      "median_s": round(sorted(walls.values())[len(walls) // 2], 3),
                      "max_over_python_startup": round(worst / python, 1), "target_s": TARGET_S,
                      "verdict": "ok" if worst < TARGET_S else "MISSED"}))
    return 0 if worst < TARGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
