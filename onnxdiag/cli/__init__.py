"""Command-line interface: the ``onnxdiag`` click group and its entry point.

``cli/`` is the only package that imports click. Each verb family has a module that
registers its commands on :data:`cli` (``readouts``, ``channels``, ``sparse``,
``structured``); every option group is defined once in :mod:`.options`. A command parses
its options into records and calls one library function of :mod:`onnxdiag.commands`.
"""

from __future__ import annotations

import os

import click

from .. import __version__
from ..errors import OnnxDiagError


class _Group(click.Group):
    """A click group that turns OnnxDiagError into a one-line message and exit 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except OnnxDiagError as exc:
            if (ctx.obj or {}).get("debug") or os.environ.get("ONNXDIAG_DEBUG"):
                raise
            click.echo(f"error: {exc}", err=True)
            ctx.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="onnxdiag")
@click.option("--debug", is_flag=True, help="Show the full traceback of errors.")
@click.pass_context
def cli(ctx, debug):
    """Read what a trained ONNX classifier's internals say about it.

    Run `onnxdiag analyze` with no arguments to analyse the bundled sample.
    """
    ctx.obj = {"debug": debug}


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="onnxdiag")




# The verb modules register their commands on ``cli`` when imported.
from . import channels, readouts, sparse, structured  # noqa: E402,F401
