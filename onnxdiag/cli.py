"""Command-line interface: one thin command per verb over a library function.

This is the only module that imports click. A user error (OnnxDiagError) is printed
on one line to stderr with exit status 1 and no traceback (``--debug`` shows it).
"""

from __future__ import annotations

import json
import os
import sys

import click

from . import __version__
from .errors import OnnxDiagError


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


# --------------------------------------------------------------------------- options

def data_options(prefix: str = "", *, required: bool = False):
    """--data/--labels (or --eval-data/--eval-labels) plus sampling options."""
    def decorate(f):
        name = f"--{prefix}data" if prefix else "--data"
        opts = [
            click.option(name, f"{prefix.replace('-', '_')}data", required=required,
                         help="Data: .npy/.npz, an image folder, or a loader script "
                              "file.py[:function]."),
            click.option(f"--{prefix}labels", f"{prefix.replace('-', '_')}labels", default=None,
                         help="Labels file (.npy/.txt/.csv) when the data has none."),
        ]
        for opt in reversed(opts):
            f = opt(f)
        return f
    return decorate


def sampling_options(f):
    for opt in reversed([
        click.option("--limit", type=click.IntRange(min=1), default=None,
                     help="Use at most this many samples (a seeded random subset with --seed)."),
        click.option("--seed", type=int, default=0, show_default=True,
                     help="Seed for the sample subset and any random choice."),
        click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True,
                     help="Samples per ONNX Runtime run."),
        click.option("--providers", default=None,
                     help="Execution providers, e.g. cpu or cuda,cpu (default: CUDA when "
                          "available, else CPU)."),
    ]):
        f = opt(f)
    return f


def head_options(f):
    for opt in reversed([
        click.option("--head", default=None, metavar="NODE",
                     help="Name of the head node (the last linear layer)."),
        click.option("--features", default=None, metavar="TENSOR",
                     help="Name of the penultimate features tensor (the head's input)."),
    ]):
        f = opt(f)
    return f


def readout_options(f):
    for opt in reversed([
        click.option("--targets", type=click.Choice(["auto", "labels", "pseudo", "expected"]),
                     default="auto", show_default=True,
                     help="Head-gradient targets: labels, pseudo (argmax) or expected "
                          "(label-free); auto = labels when the data has them."),
        click.option("--norm", type=click.Choice(["raw", "feature", "head"]), default="feature",
                     show_default=True, help="Head-gradient normalisation used to select."),
        click.option("--include-bias", is_flag=True, help="Add the bias gradient to the norm."),
    ]):
        f = opt(f)
    return f


def output_options(f):
    for opt in reversed([
        click.option("--out", "out", default=None,
                     help="Report folder (default: ./onnxdiag-report/<command>)."),
        click.option("--overwrite", is_flag=True, help="Replace an existing report folder."),
        click.option("--format", "fmt", type=click.Choice(["text", "json", "csv"]),
                     default="text", show_default=True,
                     help="What to print on stdout: the text report, the JSON report, or "
                          "the command's main table as CSV."),
    ]):
        f = opt(f)
    return f


def executor_option(f):
    return click.option(
        "--executor", default="local", show_default=True, metavar="local|ray[=ADDRESS]",
        help="Where the units of work run: local worker processes, a local Ray instance "
             "(ray), or a running Ray cluster (ray=HOST:PORT). Ray needs the [ray] extra.")(f)


def _emit(result, fmt: str) -> None:
    if fmt == "json":
        click.echo(json.dumps(result.report_json_obj(), indent=2))
    elif fmt == "csv":
        if result.csv is None:
            raise OnnxDiagError("This run has no table to print as CSV (e.g. no --data); use "
                                "--format text or json.")
        click.echo(result.csv, nl=False)
    else:
        click.echo(result.summary, nl=False)
    if result.folder is not None:
        click.echo(f"Report written to {result.folder}", err=True)
        if not (result.folder / "report.html").exists():
            from .report.html import HTML_EXTRA_HINT

            click.echo(f"note: {HTML_EXTRA_HINT}.", err=True)


def _common(kwargs: dict) -> dict:
    """Drop CLI-only keys before calling the library."""
    return {k: v for k, v in kwargs.items() if k not in ("fmt",)}


# --------------------------------------------------------------------------- commands

@cli.command()
@click.argument("model", required=False)
@head_options
@click.option("--json", "as_json", is_flag=True, help="Print the structure as JSON.")
def inspect(model, head, features, as_json):
    """Show a model's head, layers (geometry, FLOPs, BatchNorm) and channel groups.

    MODEL defaults to the bundled sample.
    """
    from .analysis import inspect_model
    from .report import to_json

    structure, text = inspect_model(model, head=head, features=features)
    click.echo(to_json(structure.to_dict()) if as_json else text, nl=False)


@cli.command()
@click.argument("model", required=False)
@data_options()
@data_options("eval-")
@sampling_options
@head_options
@readout_options
@output_options
def analyze(model, fmt, **kwargs):
    """The main job: structure, readouts and evaluation of one model.

    With no arguments it runs on the bundled sample (models/sample). Writes
    report.json and report.txt into the report folder and prints a summary.
    """
    from .analysis import analyze as run

    _emit(run(model, **_common(kwargs)), fmt)


@cli.command()
@click.argument("model")
@data_options(required=True)
@data_options("eval-")
@sampling_options
@head_options
@readout_options
@output_options
def readouts(model, fmt, **kwargs):
    """Validation-free readouts (SPEC A) of one model on a probe batch."""
    from .analysis import readouts_report

    _emit(readouts_report(model, **_common(kwargs)), fmt)


@cli.command()
@click.argument("checkpoints", nargs=-1, required=True)
@data_options(required=True)
@data_options("eval-")
@sampling_options
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
    from .analysis import select_report

    window = kwargs.pop("window")
    if window != "all":
        try:
            window = int(window)
        except ValueError:
            raise click.BadParameter("give a number of checkpoints or 'all'",
                                     param_hint="--window") from None
    _emit(select_report(list(checkpoints), window=window, **_common(kwargs)), fmt)


@cli.command()
@click.argument("models", nargs=-1, required=True)
@data_options(required=True)
@sampling_options
@head_options
@click.option("--targets", type=click.Choice(["auto", "labels", "pseudo"]), default="auto",
              show_default=True,
              help="Target T: ground-truth logit margin (labels) or the predicted class's "
                   "(pseudo, flagged in the report); auto = labels when the data has them.")
@click.option("--task-samples", type=click.Choice(["match", "gap"]), default="match",
              show_default=True,
              help="T repeated per sampled position (match) or per-image spatial means (gap).")
@click.option("--positions", "n_positions", type=click.IntRange(min=1), default=16,
              show_default=True, help="Spatial positions sampled per image.")
@click.option("--peers", "k_peers", type=click.IntRange(min=1), default=10, show_default=True,
              help="Peers in the ridge reconstruction R^2.")
@click.option("--ridge", type=float, default=1e-3, show_default=True,
              help="Ridge of the peer reconstruction.")
@click.option("--layer", "layers", multiple=True,
              help="Analyse only this layer (repeatable; default: every conv with >= 4 "
                   "channels).")
@click.option("--tap", type=click.Choice(["auto", "output", "input"]), default="auto",
              show_default=True,
              help="Where a layer's samples come from: its conv output as ONNX Runtime "
                   "computes it, or the conv evaluated in float64 at the sampled positions "
                   "from its input; auto = input where that copies far fewer values out of "
                   "the session (e.g. a first conv on a grey image).")
@click.option("--jobs", type=click.IntRange(min=1), default=None,
              help="Worker processes, each streaming a shard of the data (default: 1, one "
                   "pass in this process; with ray, CPUs of the local instance).")
@executor_option
@output_options
def channels(models, fmt, layers, **kwargs):
    """Two-axis channel information (SPEC B): local substitutability vs task relevance.

    MODELS: one model, or a checkpoint series (the B4 statistics per checkpoint form the
    training trajectory). Writes report.json, report.txt and channels.csv.
    """
    from .channel_report import channels_report

    _emit(channels_report(list(models), layers=list(layers) or None, **_common(kwargs)), fmt)


@cli.command()
@click.argument("model")
@click.option("--layer", "layers", multiple=True, required=True,
              help="Layer (node name) whose channels are lesioned; repeatable.")
@click.option("--channels", default=None,
              help="Comma-separated channel indices (default: all, or --sample N).")
@click.option("--sample", type=click.IntRange(min=1), default=None,
              help="Lesion this many seeded random channels per layer.")
@click.option("--substitute", is_flag=True,
              help="Also replace each channel by its ridge reconstruction from its peers.")
@click.option("--pairs", type=click.IntRange(min=0), default=0, show_default=True,
              help="Random channel pairs per layer for pair lesions (excess damage).")
@data_options("eval-", required=True)
@data_options()
@sampling_options
@head_options
@click.option("--targets", type=click.Choice(["auto", "labels", "pseudo"]), default="auto",
              show_default=True, help="Target of the channel scores computed on --data.")
@output_options
def lesion(model, fmt, layers, channels, **kwargs):
    """Lesion channels and measure the damage on labelled data (SPEC B5).

    With --data (calibration images) the channels are scored, --substitute becomes
    possible, and the report tests which score predicts the damage.
    """
    from .channel_report import lesion_report

    chans = None
    if channels:
        try:
            chans = [int(c) for c in channels.split(",") if c.strip()]
        except ValueError:
            raise click.BadParameter("give integers such as 0,3,7",
                                     param_hint="--channels") from None
    _emit(lesion_report(model, layers=list(layers), channels=chans, **_common(kwargs)), fmt)


# Verbs defined in their own modules register themselves on ``cli`` when imported.
from . import cli_sparse, cli_structured  # noqa: E402,F401  (registers commands)

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
