"""CLI verbs of the readouts family: inspect, analyze, readouts, select."""

from __future__ import annotations

import click

from . import cli
from .options import (
    data_options,
    emit_result,
    executor_option,
    head_options,
    library_kwargs,
    output_options,
    readout_options,
    sampling_and_providers,
)


@cli.command()
@click.argument("model", required=False)
@head_options
@click.option("--json", "as_json", is_flag=True, help="Print the structure as JSON.")
def inspect(model, head, features, as_json):
    """Show a model's head, layers (geometry, FLOPs, BatchNorm) and channel groups.

    MODEL defaults to the bundled sample.
    """
    from ..commands.analyze import inspect_model
    from ..report import to_json

    structure, text = inspect_model(model, head=head, features=features)
    click.echo(to_json(structure.to_dict()) if as_json else text, nl=False)


@cli.command()
@click.argument("model", required=False)
@data_options()
@data_options("eval-")
@sampling_and_providers
@head_options
@readout_options
@output_options
def analyze(model, fmt, **kwargs):
    """The main job: structure, readouts and evaluation of one model.

    With no arguments it runs on the bundled sample (models/sample). Writes
    report.json and report.txt into the report folder and prints a summary.
    """
    from ..commands.analyze import analyze as run

    emit_result(run(model, **library_kwargs(kwargs)), fmt)


@cli.command()
@click.argument("model")
@data_options(required=True)
@data_options("eval-")
@sampling_and_providers
@head_options
@readout_options
@output_options
def readouts(model, fmt, **kwargs):
    """Validation-free readouts (SPEC A) of one model on a probe batch."""
    from ..commands.analyze import readouts_report

    emit_result(readouts_report(model, **library_kwargs(kwargs)), fmt)


@cli.command()
@click.argument("checkpoints", nargs=-1, required=True)
@data_options(required=True)
@data_options("eval-")
@sampling_and_providers
@head_options
@readout_options
@click.option("--window", default="5", show_default=True,
              help="Select within the last K checkpoints, or 'all'.")
@click.option("--patience", type=click.IntRange(min=1), default=3, show_default=True,
              help="Early stopping: checkpoints without improvement before stopping.")
@click.option("--select-by", default=None,
              help="Readout used for the headline choice (default: the head gradient, --norm).")
@click.option("--jobs", type=click.IntRange(min=1), default=None,
              help="Worker processes (default: one per core; with ray, CPUs of the local "
                   "instance).")
@executor_option
@output_options
def select(checkpoints, fmt, **kwargs):
    """Pick a checkpoint without validation data (SPEC A3).

    CHECKPOINTS are .onnx files in training order, a folder (natural sort order), or a
    JSON/CSV listing with paths and steps. With --eval-data, also reports how good
    each readout's choice was (accuracy, correlations, selection gap).
    """
    from ..commands.select import select_report

    window = kwargs.pop("window")
    if window != "all":
        try:
            window = int(window)
        except ValueError:
            raise click.BadParameter("give a number of checkpoints or 'all'",
                                     param_hint="--window") from None
    emit_result(select_report(list(checkpoints), window=window, **library_kwargs(kwargs)), fmt)


