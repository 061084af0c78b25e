"""CLI plumbing: consoles, the error boundary, and shared output helpers.

Results go to stdout; logs and progress to stderr. Library errors become one line (plus a
hint) and an exit code; a traceback only with QUANTKIT_DEBUG=1.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import signal
import sys
import threading
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

import click
import typer
from rich.console import Console
from typer.core import TyperCommand

from quantkit.units import human_bytes  # noqa: F401  (the CLI modules import it from here)

# Option panels of every command's --help, in this order (typer's rich_help_panel= on each option);
# options without one are listed last under "Other options".
MODEL = "Model and output"
CALIBRATION = "Calibration"
MEASURED = "What is measured"
METHOD = "Method"
GATE = "Gate"
RESOURCES = "Resources"
REPORTS = "Reports and CI"
PANELS = (MODEL, CALIBRATION, MEASURED, METHOD, GATE, RESOURCES, REPORTS)


# Help paragraphs that are commands to copy: printed as written, never re-wrapped.
EXAMPLE_STARTS = ("quantkit ", "torchrun ", "scripts/", "mlx_lm", "vllm ", "ollama ")


class PanelledCommand(TyperCommand):
    """A command whose plain-text --help (the app's rich_markup_mode=None) prints its example commands as
    written (one line each, never re-wrapped), then lists the arguments and the options in their panels
    (MODEL ... REPORTS), each a section of its own, in declaration order."""

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        import inspect

        text = inspect.cleandoc(self.help or "").partition("\f")[0]
        if not text:
            return
        paragraphs = text.split("\n\n")
        text = "\n\n".join("\b\n" + p if p.lstrip().startswith(EXAMPLE_STARTS) else p for p in paragraphs)
        formatter.write_paragraph()
        with formatter.indentation():
            formatter.write_text(text)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                name = "Arguments"
            else:
                name = getattr(param, "rich_help_panel", None) or "Other options"
            sections.setdefault(name, []).append(record)
        order = ["Arguments", *PANELS, "Other options"]
        for name in sorted(sections, key=lambda n: order.index(n) if n in order else len(order)):
            with formatter.section(name):
                formatter.write_dl(sections[name])


# Pipes and files get a fixed, generous width so tables do not fold at 80 columns.
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 140)
err = Console(stderr=True, soft_wrap=True, width=None if sys.stderr.isatty() else 140)
EXIT_INTERRUPTED = 130
# Signals handled like Ctrl-C: staging removed, one line on stderr, exit 128 + signal number.
TERMINATING_SIGNALS = ("SIGTERM", "SIGHUP")


# Library settings while a command runs (a value the user already set wins): llm-compressor reads
# its log level when first imported; the others quiet transformers, the hub and tokenizers.
def quiet_environment(tty: bool) -> dict[str, str]:
    env = {"LLM_COMPRESSOR_LOG_LEVEL": "DEBUG" if debug() else "ERROR"}
    if not tty:
        env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if not debug():
        env.update(TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    return env


@contextmanager
def quiet_libraries() -> Iterator[None]:
    """Progress bars only on a TTY, library warnings only when debugging; all restored on exit."""
    import warnings

    from quantkit.io.offline import restore_env

    tty = sys.stderr.isatty()
    wanted = quiet_environment(tty)
    saved_env = {name: os.environ.get(name) for name in wanted}
    os.environ.update({name: os.environ.get(name, value) for name, value in wanted.items()})
    bnb_logger = logging.getLogger("bitsandbytes")
    saved_level = bnb_logger.level
    try:
        with warnings.catch_warnings(), (nullcontext() if tty else tqdm_disabled()):
            if not debug():
                warnings.filterwarnings("ignore")
                bnb_logger.setLevel(logging.ERROR)
            yield
    finally:
        bnb_logger.setLevel(saved_level)
        restore_env(saved_env)


def tqdm_disabled():
    """Libraries pass disable=False explicitly, which beats TQDM_DISABLE; force it off while inside
    (quantkit.engines.patches "tqdm.init")."""
    from quantkit.engines.patches import patched

    return patched("tqdm.init")


def debug() -> bool:
    return os.environ.get("QUANTKIT_DEBUG", "") not in ("", "0")


def handle_errors(fn):
    """Turn QuantkitError / KeyboardInterrupt / anything else into a message and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from quantkit.errors import QuantkitError, Terminated

        try:
            with signals_as_exceptions(), quiet_libraries():
                return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except Terminated as exc:
            err.print(f"terminated ({exc.name}); nothing was written", style="yellow", highlight=False)
            raise typer.Exit(exc.exit_code) from None
        except QuantkitError as exc:
            if debug():
                err.print_exception()
            _print_error(exc.message, exc.hint)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err.print("interrupted; nothing was written", style="yellow", highlight=False)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except MemoryError:  # the machine's memory ran out where no smaller path was left (the preflight's: exit 2)
            if debug():
                err.print_exception()
            _print_error("out of memory: the memory free on this machine ran out during the run; nothing was written",
                         "bound the run with --max-memory (what does not fit under it streams, and a bound too "
                         "small is refused before work), or free memory")
            raise typer.Exit(2) from None
        except Exception as exc:  # noqa: BLE001 - the boundary for unexpected failures
            if debug():
                err.print_exception()
            _print_error(f"internal error: {type(exc).__name__}: {exc}".splitlines()[0],
                         "re-run with QUANTKIT_DEBUG=1 for the traceback, and please report it")
            raise typer.Exit(1) from None

    return wrapper


def lean_transformers(fn):
    """A command that loads models runs with transformers told scikit-learn is absent (quantkit.engines.patches
    "transformers.sklearn": ~150 MiB of scikit-learn, scipy and pandas never imported)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from quantkit.engines.patches import patched_on_import

        with patched_on_import("transformers.sklearn", "transformers.generation.candidate_generator"):
            return fn(*args, **kwargs)

    return wrapper


@contextmanager
def signals_as_exceptions():
    """For the duration of one command, SIGTERM/SIGHUP raise quantkit.errors.Terminated in the
    main thread, so the run's cleanup (the same path as Ctrl-C) removes its staging directory.
    Later signals of those kinds are ignored while that cleanup runs; the previous handlers are
    restored on exit. Outside the main thread (where Python cannot install handlers) a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signums = [getattr(signal, name) for name in TERMINATING_SIGNALS if hasattr(signal, name)]
    previous = {signum: signal.getsignal(signum) for signum in signums}
    for signum in signums:
        signal.signal(signum, _raise_terminated)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _raise_terminated(signum, _frame):
    from quantkit.errors import Terminated

    for other in (getattr(signal, name) for name in TERMINATING_SIGNALS if hasattr(signal, name)):
        signal.signal(other, signal.SIG_IGN)  # one clean shutdown; restored when the command ends
    raise Terminated(signum, signal.Signals(signum).name)


def _print_error(message: str, hint: str | None) -> None:
    err.print(f"error: {message}", style="bold red", highlight=False, markup=False)
    if hint:
        err.print(f"hint: {hint}", style="dim", highlight=False, markup=False)


def progress(message: str) -> None:
    """Log lines on stderr (plain when not a TTY)."""
    err.print(f"· {message}", highlight=False, markup=False)


STEP = re.compile(r"\s*\((\d+)/(\d+)\)$")


class ProgressLog:
    """The run's progress on stderr. A message is a phase line, printed; one that ends in a step count
    `(i/n)` is a step of a long loop: on a terminal it drives a transient progress bar (one per series of
    steps), elsewhere it is left out, so logs keep one line per phase."""

    def __init__(self, console: Console):
        self.console, self.bar, self.series = console, None, None

    def __call__(self, message: str) -> None:
        step = STEP.search(message)
        if step is None:
            self.close()
            self.console.print(f"· {message}", highlight=False, markup=False)
        elif self.console.is_terminal:
            self.advance(message[:step.start()], int(step.group(1)), int(step.group(2)))

    def advance(self, text: str, done: int, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        series = (text.split(":")[0], total)
        if series != self.series:
            self.close()
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=self.console, transient=True)
            self.bar.add_task(text, total=total)
            self.bar.start()
            self.series = series
        self.bar.update(self.bar.task_ids[0], completed=done - 1, description=text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        self.bar, self.series = None, None


def results_console(json_path: str | None) -> Console:
    """Where tables and result lines go: stdout, unless `--json -` has stdout for the JSON alone."""
    return err if json_path == "-" else out


def write_json(path: str | None, data: dict) -> None:
    if not path:
        return
    text = json.dumps(data, indent=2, default=str) + "\n"
    if path == "-":
        sys.stdout.write(text)
    else:
        Path(path).write_text(text)


def human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
