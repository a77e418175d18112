"""`lmc build SPEC [-o OUT] [--format tar.gz|dir] [--plan PLAN_JSON] [--allow-pickle]`: write the deployable artifact."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

FORMATS = ("tar.gz", "dir")
DEFAULT_OUT = {"tar.gz": "model.tar.gz", "dir": "model"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="the deployment spec (TOML)")
    parser.add_argument("-o", "--output", metavar="OUT", default=None,
                        help="where to write the artifact (default: model.tar.gz, or model/ with --format dir)")
    parser.add_argument("--format", choices=FORMATS, default="tar.gz", dest="fmt",
                        help="tar.gz (default) or dir: the same tree uncompressed, for S3-prefix deployments")
    parser.add_argument("--plan", metavar="PLAN_JSON", default=None, dest="plan_json",
                        help="the reviewed plan (lmc plan --json): stop if planning again gives another one "
                             "(e.g. the model's Hub revision moved)")
    parser.add_argument("--accept-missed-goal", action="store_true",
                        help="build a plan that fits but misses its goal (without it such a plan stops the build, exit 4)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="accept pickle checkpoints (*.bin); they can run code when loaded, so only for trusted files")


def run(args: argparse.Namespace) -> int:
    from lmc.emitters.build import build_artifact
    from lmc.schema import format_bytes, load_spec

    loaded = load_spec(args.spec)
    out = Path(args.output) if args.output else Path(DEFAULT_OUT[args.fmt])
    expected = _read_plan(args.plan_json) if args.plan_json else None
    # Stage messages only for a person watching; logs and pipes get the summary (or the one error line).
    progress = (lambda message: print(f"lmc: {message}", file=sys.stderr)) if sys.stderr.isatty() else None
    result = _interruptible(lambda: build_artifact(loaded, out, fmt=args.fmt, allow_pickle=args.allow_pickle,
                                                   progress=progress, expected_plan=expected,
                                                   accept_missed_goal=args.accept_missed_goal))
    plan = result.plan
    print(f"plan: {plan.model.id} on {plan.target.instance}: {plan.engine} {plan.dtype}, "
          f"TP {plan.tensor_parallel_degree} x {plan.replicas} replica(s), batch {plan.batch_size}, "
          f"max sequence {plan.max_sequence_length}")
    width = max(len(name) for name in result.files)
    for name, size in result.files.items():
        print(f"  {name:<{width}}  {format_bytes(size):>10}")
    for note in result.notes:
        print(f"note: {note}")
    if result.archive_sha256 is not None:
        print(f"wrote {result.out} ({format_bytes(result.archive_bytes)}, {len(result.files)} files), "
              f"sha256 {result.archive_sha256}")
    else:
        print(f"wrote {result.out}/ ({format_bytes(result.archive_bytes)}, {len(result.files)} files)")
    return 0


def _read_plan(path: str) -> dict:
    import json

    from lmc.errors import LmcError

    try:
        body = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LmcError(f"{path}: not a plan (lmc plan --json): {exc}") from None
    if not isinstance(body, dict) or "plan_sha256" not in body:
        raise LmcError(f"{path}: not a plan (lmc plan --json): no plan_sha256")
    return body


def _interruptible(work):
    """Run `work` with SIGTERM (docker stop, a CI timeout) handled like Ctrl-C: the build's own cleanup
    runs and nothing half-written stays behind. Main thread only (else the handler is left alone)."""
    if threading.current_thread() is not threading.main_thread():
        return work()

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        return work()
    finally:
        signal.signal(signal.SIGTERM, previous)
