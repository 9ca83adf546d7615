"""CLI verbs of the readouts family: inspect, analyze, readouts, select.

Imported by :mod:`onnxdiag.cli` when one of these commands is used; each registers
itself on the ``cli`` group. Only click is imported here: the verb modules are imported
inside the command bodies (``--help`` stays fast).
"""

from __future__ import annotations

import click

from . import cli
from .options import (
    data_options,
    emit_result,
    head_options,
    output_options,
    runtime_options,
    sampling_options,
    stack_options,
    take_records,
)


def readout_options(f):
    """--targets / --norm / --include-bias of the readout verbs (docs/METHODS.md §A1)."""
    return stack_options(f, [
        click.option("--targets", type=click.Choice(["auto", "labels", "pseudo", "expected"]),
                     default="auto", show_default=True,
                     help="Head-gradient targets: labels, pseudo (argmax) or expected "
                          "(label-free); auto = labels when the data has them."),
        click.option("--norm", type=click.Choice(["raw", "feature", "head"]), default="feature",
                     show_default=True, help="Head-gradient normalisation used to select."),
        click.option("--include-bias", is_flag=True, help="Add the bias gradient to the norm."),
        click.option("--ignore-index", type=click.IntRange(min=0), default=255,
                     show_default=True,
                     help="Label-map value of ignored positions, for a head applied at every "
                          "position (segmentation; docs/METHODS.md §A4)."),
    ])


def _window(ctx, param, value):
    """``--window``: a number of checkpoints or 'all'."""
    if value == "all":
        return value
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter("give a number of checkpoints or 'all'") from None


@cli.command()
@click.argument("model", required=False)
@head_options
@click.option("--json", "as_json", is_flag=True, help="Print the structure as JSON.")
def inspect(model, as_json, **kw):
    """Show a model's head, layers (geometry, FLOPs, BatchNorm) and channel groups.

    MODEL defaults to the bundled sample.
    """
    from ..commands.analyze import inspect_model
    from ..report import to_json

    structure, text = inspect_model(model, head=take_records(kw, roles=()).head)
    click.echo(to_json(structure.to_dict()) if as_json else text, nl=False)


@cli.command()
@click.argument("model", required=False)
@data_options()
@data_options("eval-")
@sampling_options
@runtime_options()
@head_options
@readout_options
@output_options
def analyze(model, **kw):
    """The main job: structure, readouts, channel axes and repairability of one model.

    With no arguments it runs on the bundled sample (models/sample). Writes report.json,
    report.txt and (with the [report] extra) report.html with a plot per section into
    the report folder and prints a summary. Without --out a rerun replaces the previous
    default report.
    """
    from ..commands.analyze import ReadoutOptions
    from ..commands.analyze import analyze as run

    rec = take_records(kw, roles=("", "eval-"), sourceless=True)
    emit_result(run(model, **rec.library(), options=ReadoutOptions(**kw)), rec.fmt)


@cli.command()
@click.argument("model")
@data_options(required=True)
@data_options("eval-")
@sampling_options
@runtime_options()
@head_options
@readout_options
@output_options
def readouts(model, **kw):
    """Validation-free readouts (docs/METHODS.md §A2) of one model on a probe batch."""
    from ..commands.analyze import ReadoutOptions, readouts_report

    rec = take_records(kw, roles=("", "eval-"))
    emit_result(readouts_report(model, **rec.library(), options=ReadoutOptions(**kw)), rec.fmt)


@cli.command()
@click.argument("checkpoints", nargs=-1, required=True)
@data_options(required=True)
@data_options("eval-")
@sampling_options
@runtime_options(fan_out=True, executor_default="local", units="checkpoint")
@head_options
@readout_options
@click.option("--window", default="5", show_default=True, callback=_window,
              help="Select within the last K checkpoints, or 'all'.")
@click.option("--patience", type=click.IntRange(min=1), default=3, show_default=True,
              help="Early stopping: checkpoints without improvement before stopping.")
@click.option("--select-by", default=None,
              help="Readout used for the headline choice (default: the head gradient, --norm).")
@output_options
def select(checkpoints, **kw):
    """Pick a checkpoint without validation data (docs/METHODS.md §A3).

    CHECKPOINTS are .onnx files in training order, a folder (natural sort order), or a
    JSON/CSV listing with paths and steps. With --eval-data, also reports how good
    each readout's choice was (accuracy, correlations, selection gap).
    """
    from ..commands.select import SelectOptions, select_report

    rec = take_records(kw, roles=("", "eval-"))
    emit_result(select_report(list(checkpoints), **rec.library(), options=SelectOptions(**kw)),
                rec.fmt)
