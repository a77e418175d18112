"""`lmc bench ARTIFACT_OR_URL [--json OUT] [--plot PNG]`: drive a served model with a load generator.

An artifact (model.tar.gz or a built directory) is served here with `lmc runtime` on a free port for
the run, and its worker processes' memory is sampled; a URL is benchmarked as it is (its memory only
with --pid). Prompt and output lengths come from the flags, else --spec's workload, else the
artifact's own spec; the concurrency sweep is 1, 2, 4, ... up to the workload's concurrency.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="ARTIFACT_OR_URL", help="a model.tar.gz or artifact directory to serve, "
                        "or the base URL of a running server (http://host:port)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the report as JSON here")
    parser.add_argument("--plot", type=Path, metavar="PNG",
                        help="write latency and throughput against concurrency, with the plan's predictions")
    parser.add_argument("--spec", type=Path, help="the spec: its workload sets the lengths, and --plot draws its plan's predictions")
    parser.add_argument("--input-tokens", type=int, help="prompt tokens per request (default: the workload's max_input_tokens)")
    parser.add_argument("--output-tokens", type=int, help="output tokens per request (default: the workload's max_output_tokens)")
    parser.add_argument("--concurrency", help="comma-separated levels (default: 1, 2, 4, ... up to the workload's concurrency)")
    parser.add_argument("--requests", type=int, help="timed requests per level (default: max(4, 2 × concurrency))")
    parser.add_argument("--pid", type=int, help="with a URL: the server's process id, to sample its workers' memory")
    parser.add_argument("--device", choices=("cpu", "gpu"),
                        help="whose memory is the workers': RSS (cpu) or nvidia-smi's device memory (gpu); "
                             "default: the artifact's plan, else cpu")
    parser.add_argument("--tokenizer", type=Path, help="with a URL: the model's tokenizer.json, so that every token "
                        "streams as it is made (an artifact's own is used otherwise)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for an artifact's /ping (default 600)")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import datetime

    from lmc import __version__
    from lmc.measure.bench import BenchSetup, open_target, run_bench
    from lmc.measure.loadgen import BenchError
    from lmc.measure.report import bench_failure, render_table

    setup = BenchSetup.from_args(args)
    with open_target(setup) as served:
        report = asyncio.run(run_bench(setup, served, lmc_version=__version__,
                                       measured_at=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")))
    sys.stdout.write(render_table(report))
    if args.json is not None:
        import json

        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot is not None:
        from lmc.measure.plot import plot_report

        predictions = setup.predictions(report)
        plot_report(report, predictions, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    failure = bench_failure(report)
    if failure is not None:  # the figures are written (they show what failed), but the run is no measurement
        raise BenchError(f"{args.target}: {failure}")
    return 0
