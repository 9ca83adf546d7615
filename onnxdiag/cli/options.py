"""Option groups shared by the commands, each defined once, and the output of a result."""

from __future__ import annotations

import json

import click

from ..errors import OnnxDiagError


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


def emit_result(result, fmt: str) -> None:
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
            from ..report.html import HTML_EXTRA_HINT

            click.echo(f"note: {HTML_EXTRA_HINT}.", err=True)


def library_kwargs(kwargs: dict) -> dict:
    """Drop CLI-only keys before calling the library."""
    return {k: v for k, v in kwargs.items() if k not in ("fmt",)}


