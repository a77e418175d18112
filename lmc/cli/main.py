"""`lmc` entry point: parse the subcommand, run it, map errors to exit codes."""

from __future__ import annotations

import argparse
import importlib
import re
import sys

from lmc import __version__
from lmc.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_INVALID_INPUT, EXIT_USAGE, LmcError, NoFeasiblePlanError

# Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`.
SUBCOMMANDS = {
    "plan": ("lmc.cli.plan", "plan a deployment from a spec"),
    "build": ("lmc.cli.build", "build the deployable artifact (model.tar.gz)"),
    "deploy": ("lmc.cli.deploy", "write the deployment files (SageMaker, Kubernetes, KServe) sized from the plan"),
    "runtime": ("lmc.cli.runtime", "serve an artifact (the container entrypoint)"),
    "calibrate": ("lmc.cli.calibrate", "measure this machine and write a hardware profile"),
    "bench": ("lmc.cli.bench", "load-test a served artifact: TTFT, TPOT, latency, throughput, memory"),
}


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _one_line(text: object) -> str:
    """`text` with control characters escaped as Python writes them ("\\n", "\\x00"): an error is one
    line even when it quotes a file name or an archive member that holds a newline or a terminal escape."""
    return _CONTROL.sub(lambda match: repr(match.group())[1:-1], str(text))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        self.exit(EXIT_USAGE, f"lmc: usage error: {_one_line(message)} (see `lmc --help`)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or where `command` names one, of that one alone: `lmc runtime` must not
    wait on the planner's and the emitters' imports (0.4 s here) before its SIGTERM handler is in place, or a
    container stopped at once dies of the signal (exit -15) instead of stopping cleanly."""
    parser = _Parser(prog="lmc", description="A declarative compiler for large-model deployments.")
    parser.add_argument("--version", action="version", version=f"lmc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if command in SUBCOMMANDS and name != command:
            continue
        module = importlib.import_module(module_name)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args._module.run(args) or 0)
    except NoFeasiblePlanError as exc:
        print(f"lmc: no feasible plan: {_one_line(exc)}", file=sys.stderr)
        for line in exc.details:
            print(f"  {line}", file=sys.stderr)
        return exc.exit_code
    except LmcError as exc:
        print(f"lmc: error: {_one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("lmc: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as exc:  # the system refused a path lmc was given (a name too long, a loop): bad input
        where = f"{exc.filename}: " if exc.filename is not None else ""
        print(f"lmc: error: {_one_line(where)}{_one_line(exc.strerror or exc)}", file=sys.stderr)
        return EXIT_INVALID_INPUT
    except Exception as exc:  # a broken invariant: say so, ask for a report
        print(f"lmc: INTERNAL ERROR: {type(exc).__name__}: {_one_line(exc)} (this is a bug in lmc; please report it)",
              file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    raise SystemExit(main())
