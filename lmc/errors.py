"""Exit codes and the errors that carry them. Every user-facing error is one line."""

from __future__ import annotations

EXIT_OK = 0
EXIT_INVALID_INPUT = 1  # spec, checkpoint, artifact, request
EXIT_USAGE = 2
EXIT_NO_PLAN = 3
EXIT_GOAL_MISSED = 4  # a plan fits but misses its goal: `lmc plan` prints it and exits 4; build and deploy refuse it
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it: Ctrl-C (twice, for `lmc runtime` draining)


def short_repr(value: object, width: int = 40) -> str:
    """`value` for a one-line message: at most `width` characters, a huge integer by its size."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**18:
        return f"an integer of {len(str(abs(value)))} digits"
    text = f"{value:g}" if isinstance(value, float) else repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


class LmcError(Exception):
    """An error meant for the user: one line, and the exit code it maps to."""

    exit_code = EXIT_INVALID_INPUT

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class SpecError(LmcError):
    """The spec is invalid: the message names the file, the key path and, where known, the line."""


class CheckpointError(LmcError):
    """The checkpoint is missing, corrupt or disagrees with its config."""


class ArtifactError(LmcError):
    """The artifact is missing a file, or a file was altered."""


class MissingDependencyError(LmcError):
    """An optional dependency (the Neuron SDK, deepspeed, CUDA) is absent: says what to install."""


class UsageError(LmcError):
    exit_code = EXIT_USAGE


class NoFeasiblePlanError(LmcError):
    """Nothing fits: the message has the numbers and the nearest feasible options."""

    exit_code = EXIT_NO_PLAN

    def __init__(self, message: str, details: list[str] | None = None):
        super().__init__(message)
        self.details = details or []


class GoalMissedError(LmcError):
    """`lmc build`/`lmc deploy` of a plan that misses its goal, without --accept-missed-goal."""

    exit_code = EXIT_GOAL_MISSED


class InternalError(LmcError):
    """A broken invariant inside lmc, not the user's fault."""

    exit_code = EXIT_INTERNAL

    def __init__(self, message: str):
        super().__init__(f"INTERNAL ERROR: {message} (this is a bug in lmc; please report it)")


class SpecValueError(LmcError):
    """A spec value that is well-formed but wrong against the facts (unknown instance, bad pin).

    Raised by the planner and catalogs, which do not know the file; the CLI adds the file and line.
    """

    def __init__(self, key_path: str, value: object, message: str):
        super().__init__(f"{key_path} = {value!r}: {message}")
        self.key_path = key_path
        self.value = value
        self.detail = message
