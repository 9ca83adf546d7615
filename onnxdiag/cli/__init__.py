"""Command-line interface: the ``onnxdiag`` click group and its entry point.

``cli/`` is the only package that imports click. Each verb family has a module that
registers its commands on :data:`cli` when imported (``readouts``, ``channels``,
``sparse``, ``structured``); :data:`COMMANDS` says which module holds which command, so
``onnxdiag CMD`` imports only its own family (and ``--help`` no numerical library).
Every option group is defined once in :mod:`.options`. A command parses its options
into records and calls one library function of :mod:`onnxdiag.commands`.

Exit status: 0 done; 1 a user error (``error: …``, one line); 2 a usage error (click);
3 an internal error, i.e. a bug (``internal error: …``, one line; ``--debug`` or
``ONNXDIAG_DEBUG=1`` prints the traceback); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import traceback
import warnings

import click

from .. import __version__
from ..errors import OnnxDiagError

#: command -> the module of this package that defines it.
COMMANDS = {
    "analyze": "readouts", "inspect": "readouts", "readouts": "readouts", "select": "readouts",
    "channels": "channels", "lesion": "channels", "orthogonality": "channels",
    "rr": "sparse", "prune": "sparse", "sweep": "sparse",
    "prune-channels": "structured", "prune-sweep": "structured",
}

EXIT_USER, EXIT_INTERNAL, EXIT_INTERRUPTED = 1, 3, 130
_CLICK_EXITS = (click.exceptions.Exit, click.exceptions.Abort, click.ClickException)


def debug_wanted(ctx) -> bool:
    """``--debug`` on the command line or ONNXDIAG_DEBUG set (not "0")."""
    return bool((ctx.obj or {}).get("debug")) or os.environ.get("ONNXDIAG_DEBUG", "0") not in (
        "", "0")


def _one_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return " ".join(lines)


def _show_traceback(exc: BaseException) -> None:
    click.echo("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip(),
               err=True)
    remote = getattr(exc, "remote_traceback", None)
    if remote:
        click.echo("The failed unit of work's own traceback (worker):\n" + remote.rstrip(),
                   err=True)


class _Group(click.Group):
    """Loads each command's module on first use; turns errors into one line and an exit
    status (see the module docstring)."""

    def list_commands(self, ctx):
        return sorted(set(COMMANDS) | set(self.commands))

    def get_command(self, ctx, name):
        if name not in self.commands:
            if name in COMMANDS:
                importlib.import_module(f"{__name__}.{COMMANDS[name]}")
            else:  # a command missing from COMMANDS still works, only slower
                load_all()
        return super().get_command(ctx, name)

    def invoke(self, ctx):
        try:
            with _warnings_as_lines(), _ort_verbosity(ctx.params.get("verbose") or 0):
                return super().invoke(ctx)
        except _CLICK_EXITS:
            raise
        except OnnxDiagError as exc:
            self._fail(ctx, exc, f"error: {_one_line(exc)}", EXIT_USER)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except Exception as exc:  # noqa: BLE001 - a bug: one line, exit 3, --debug shows it
            self._fail(ctx, exc, f"internal error: {type(exc).__name__}: {_one_line(exc)} "
                                 "(please report it; rerun with --debug for the traceback)",
                       EXIT_INTERNAL)

    @staticmethod
    def _fail(ctx, exc: Exception, line: str, status: int) -> None:
        if debug_wanted(ctx):
            _show_traceback(exc)
        click.echo(line, err=True)
        ctx.exit(status)


@contextlib.contextmanager
def _warnings_as_lines():
    """Warnings meant for the user (data.source.DataWarning) print as one ``warning: …``
    line on stderr; other warnings keep Python's handling."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if category.__name__ == "DataWarning":
            click.echo(f"warning: {_one_line(message)}", err=True)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


#: The environment variable onnxdiag.runtime.runner reads for ONNX Runtime's log level
#: (set here, not imported: ``onnxdiag --help`` imports no numerical library).
VERBOSITY_VARIABLE = "ONNXDIAG_VERBOSE"


@contextlib.contextmanager
def _ort_verbosity(verbose: int):
    """``-v`` / ``-vv`` for the duration of the command: ONNX Runtime's own log lines
    (silent by default) reach stderr; worker processes inherit the variable."""
    if not verbose:
        yield
        return
    before = os.environ.get(VERBOSITY_VARIABLE)
    os.environ[VERBOSITY_VARIABLE] = str(verbose)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(VERBOSITY_VARIABLE, None)
        else:
            os.environ[VERBOSITY_VARIABLE] = before


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="onnxdiag")
@click.option("--debug", is_flag=True,
              help="Show the full traceback of errors (also: ONNXDIAG_DEBUG=1).")
@click.option("-v", "--verbose", count=True,
              help="Show ONNX Runtime's own log: -v its warnings and errors, -vv everything "
                   "(silent by default; also: ONNXDIAG_VERBOSE=1).")
@click.pass_context
def cli(ctx, debug, verbose):
    """Read what a trained ONNX classifier's internals say about it.

    Run `onnxdiag analyze` with no arguments to analyse the bundled sample.
    """
    ctx.obj = {"debug": debug, "verbose": verbose}


def load_all() -> click.Group:
    """Import every command module (all commands registered on :data:`cli`)."""
    for module in dict.fromkeys(COMMANDS.values()):
        importlib.import_module(f"{__name__}.{module}")
    return cli


def main() -> None:
    """Console-script entry point."""
    try:
        cli(prog_name="onnxdiag")
    except KeyboardInterrupt:  # outside a command (while exiting): the same status
        click.echo("interrupted", err=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
