"""`lmc plan SPEC [--json] [--explain] [--compare BENCH.json]`: decide how to serve, and say why."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="the deployment spec (TOML)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the plan object (docs/plan.md) as JSON")
    output.add_argument("--explain", action="store_true", help="print every decision and alternative with its reason")
    parser.add_argument("--compare", type=Path, metavar="BENCH.json",
                        help="put the plan's predictions beside a bench report's measurements (with --json: as JSON)")
    parser.epilog = ("exit status: 0 the plan meets its goal, 1 invalid input, 2 usage, 3 no feasible plan, "
                     "4 the plan fits but misses its goal (printed all the same), 70 internal error")


def run(args: argparse.Namespace) -> int:
    from lmc.pipeline import plan_from_spec
    from lmc.schema import load_spec

    if args.compare is not None and args.explain:
        from lmc.errors import UsageError

        raise UsageError("--compare and --explain: choose one")
    loaded = load_spec(args.spec)
    result = plan_from_spec(loaded)
    if args.compare is not None:
        from lmc.measure.bench import load_report
        from lmc.measure.compare import compare, render_comparison
        from lmc.planner.engines import engine_facts

        report = load_report(args.compare)
        comparison = compare(result.plan, result.model, result.hardware, engine_facts()[result.plan.engine], report)
        if args.json:
            sys.stdout.write(json.dumps(comparison, indent=2) + "\n")
        else:
            sys.stdout.write(render_comparison(comparison, args.spec, str(args.compare)))
        return _goal_status(result.plan)
    if args.json:
        sys.stdout.write(result.plan.to_json())
    else:
        from lmc.planner.report import render_plan

        sys.stdout.write(render_plan(result.plan, loaded.spec, explain=args.explain))
    return _goal_status(result.plan)


def _goal_status(plan) -> int:
    """0 when the plan meets its goal; else one line on stderr and EXIT_GOAL_MISSED, so scripts can tell."""
    if plan.goal_met:
        return 0
    from lmc.errors import EXIT_GOAL_MISSED
    from lmc.planner.goals import goal_missed_line

    print(f"lmc: {goal_missed_line(plan)} (exit {EXIT_GOAL_MISSED})", file=sys.stderr)
    return EXIT_GOAL_MISSED
