"""`lmc plan SPEC [--json] [--explain]`: decide how to serve, and say why."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="the deployment spec (TOML)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the plan object (DESIGN.md) as JSON")
    output.add_argument("--explain", action="store_true", help="print every decision and alternative with its reason")


def run(args: argparse.Namespace) -> int:
    from lmc.pipeline import plan_from_spec
    from lmc.schema import load_spec

    loaded = load_spec(args.spec)
    result = plan_from_spec(loaded)
    if args.json:
        sys.stdout.write(result.plan.to_json())
    else:
        from lmc.planner.report import render_plan

        sys.stdout.write(render_plan(result.plan, loaded.spec, explain=args.explain))
    return 0
