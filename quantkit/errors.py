"""One exception hierarchy. Each error carries its exit code and an optional hint.

Library code raises these; only the CLI layer turns them into a message and an exit code.
"""


class QuantkitError(Exception):
    """Base class. `exit_code`: 1 internal error, 2 bad input or usage, 3 quality gate failed (docs/ci.md, exit
    codes). `hint`: the one next command or change that fixes it, in the user's terms (a flag, a file);
    every error a user can meet is raised with one (tests/test_errors.py walks the package for them)."""

    exit_code = 1
    default_hint: str | None = None  # a class whose every instance gets the same next step

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint if hint is not None else self.default_hint


class InternalError(QuantkitError):
    """quantkit broke its own contract (a check of its own output failed): nothing the user's input can fix."""

    exit_code = 1
    default_hint = "re-run with QUANTKIT_DEBUG=1 for the traceback, and please report it"


class InputError(QuantkitError):
    """Bad input or usage: missing model, invalid recipe, unsupported architecture, ..."""

    exit_code = 2


class RecipeError(InputError):
    pass


class ModelError(InputError):
    pass


class CalibrationError(InputError):
    pass


class UnsupportedError(InputError):
    """The model or option is not supported by the chosen method."""


class OutputExistsError(InputError):
    pass


class MissingExtraError(InputError):
    """An optional engine is not installed."""

    def __init__(self, package: str, extra: str, purpose: str):
        super().__init__(
            f"{purpose} needs the '{package}' package, which is not installed",
            hint=f"pip install 'quantkit[{extra}]'",
        )
        self.package = package
        self.extra = extra


class GateFailedError(QuantkitError):
    """The quality gate rejected an artifact; nothing was exported."""

    exit_code = 3

    def __init__(self, message: str, report=None, hint: str | None = None):
        super().__init__(message, hint)
        self.report = report


class RunFailedError(QuantkitError):
    """Some targets of a --partial run raised (and maybe others failed the gate); the targets that
    passed were published. Carries the report; the exit code is the worst target's: 1 internal
    error, then 2 bad input, then 3 gate."""

    def __init__(self, message: str, report, exit_code: int, hint: str | None = None):
        super().__init__(message, hint)
        self.report = report
        self.exit_code = exit_code


class RankStoppedError(QuantkitError):
    """Under torchrun, a collective failed because another rank stopped (it failed or was killed): this rank
    stops too, as torchrun would stop it (SIGTERM's 143); the rank that stopped first says why."""

    exit_code = 143


class Terminated(KeyboardInterrupt):
    """A termination signal (SIGTERM, SIGHUP) turned into an exception by the CLI layer.

    A KeyboardInterrupt, so every cleanup path that handles Ctrl-C handles it the same way;
    the exit code is the shell's 128 + signal number (143 for SIGTERM, 129 for SIGHUP).
    """

    def __init__(self, signum: int, name: str):
        super().__init__(name)
        self.signum = signum
        self.name = name
        self.exit_code = 128 + signum


class OutputBusyError(InputError):
    """Another live quantkit run is writing the same output."""


class ArtifactReloadError(QuantkitError):
    """The written artifact does not load back strictly (missing, unexpected or mis-shaped tensors):
    it fails the run like a failed gate, whatever the gate settings; nothing is exported."""

    exit_code = 3


class TowerChangedError(ArtifactReloadError):
    """A VLM tower or projector tensor of the reloaded artifact differs from the source (or is
    missing), or the reloaded VLM cannot run an image+text forward: exit 3, nothing is exported."""


def require(module: str, extra: str, purpose: str):
    """Import an optional engine or raise MissingExtraError naming the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(module.split(".")[0], extra, purpose) from exc
