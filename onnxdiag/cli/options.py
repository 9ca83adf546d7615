"""Option groups shared by the commands, each defined once, and the records they become.

A command stacks the groups it needs, then turns the parsed values into the records of
:mod:`onnxdiag.commands.base` with :func:`take_records` (which removes those keys) and
passes what is left to its verb's own options record::

    @cli.command()
    @click.argument("model")
    @data_options()                # --data, --labels
    @data_options("eval-")         # --eval-data, --eval-labels
    @sampling_options              # --limit, --seed, --batch-size
    @runtime_options()             # --providers (runtime_options(fan_out=True): --executor, --jobs)
    @head_options                  # --head, --features
    @output_options                # --out, --overwrite, --format
    def verb(model, **kw):
        from ..commands.verb import VerbOptions, verb_report   # lazily: a fast --help

        rec = take_records(kw, roles=("", "eval-"))
        emit_result(verb_report(model, **rec.library(), options=VerbOptions(**kw)), rec.fmt)

This module imports only click and the records (no numpy, onnx or onnxruntime).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import click

from ..commands.base import DataRequest, HeadChoice, ReportTarget, Runtime
from ..errors import OnnxDiagError

#: role prefix -> (Python keyword of the data request, human name)
ROLES = {"": ("data", "calibration / probe data"),
         "eval-": ("eval_data", "labelled evaluation data"),
         "train-": ("train_data", "labelled training data")}


def stack_options(f, opts):
    """Apply click options ``opts`` to ``f`` so that ``--help`` lists them in this order."""
    for opt in reversed(opts):
        f = opt(f)
    return f


def data_options(role: str = "", *, required: bool = False, help: str | None = None):
    """``--{role}data`` and ``--{role}labels`` for one data role ("", "eval-", "train-")."""
    key = role.replace("-", "_")

    def decorate(f):
        return stack_options(f, [
            click.option(f"--{role}data", f"{key}data", required=required,
                         help=help or f"{ROLES[role][1].capitalize()}: .npy/.npz, an image "
                                      "folder, or a loader script file.py[:function]."),
            click.option(f"--{role}labels", f"{key}labels", default=None,
                         help=f"Labels file (.npy/.txt/.csv) for --{role}data when it has "
                              "none."),
        ])
    return decorate


def sampling_options(f):
    """--limit (calibration data only), --seed, --batch-size, --cast."""
    return stack_options(f, [
        click.option("--limit", type=click.IntRange(min=1), default=None,
                     help="Use at most this many --data samples (a seeded random subset)."),
        click.option("--seed", type=int, default=0, show_default=True,
                     help="Seed for the sample subset and any random choice."),
        click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True,
                     help="Samples per ONNX Runtime run."),
        click.option("--cast", is_flag=True,
                     help="Cast data of another numeric dtype (e.g. uint8 images) to the model's "
                          "input dtype as they are, without scaling; a warning names the value "
                          "range. Without it such a mismatch is an error."),
    ])


def runtime_options(*, fan_out: bool = False, executor_default: str | None = None,
                    units: str = "unit of work"):
    """--providers; with ``fan_out``, --executor and --jobs for verbs whose units of work
    (``units``) can run in parallel."""
    def decorate(f):
        opts = [click.option("--providers", default=None,
                             help="Execution providers, e.g. cpu or cuda,cpu (default: CUDA "
                                  "when available, else CPU).")]
        if fan_out:
            opts += [
                click.option("--executor", default=executor_default,
                             show_default=executor_default is not None,
                             metavar="local|ray[=ADDRESS]",
                             help=f"Where each {units} runs: local worker processes, a local "
                                  "Ray instance (ray), or a running Ray cluster "
                                  "(ray=HOST:PORT; needs the [ray] extra). Default: "
                                  + ("local processes." if executor_default else
                                     "everything in this process.")),
                click.option("--jobs", type=click.IntRange(min=1), default=None,
                             help="Worker processes (local) or CPUs (local Ray instance)."),
            ]
        return stack_options(f, opts)
    return decorate


def head_options(f):
    """--head / --features, when the head cannot be found automatically."""
    return stack_options(f, [
        click.option("--head", default=None, metavar="NODE",
                     help="Name of the head node (the last linear layer)."),
        click.option("--features", default=None, metavar="TENSOR",
                     help="Name of the penultimate features tensor (the head's input)."),
    ])


#: runtime.latency's LATENCY_BUDGET_S and MIN_ROUNDS, copied (a test keeps them equal):
#: this module imports no numpy.
LATENCY_BUDGET_S = 10.0
MIN_ROUNDS = 5


def latency_option(f):
    """--latency-budget of the verbs that time the emitted model against the source."""
    return click.option(
        "--latency-budget", "latency_budget", type=click.FloatRange(min=0),
        default=LATENCY_BUDGET_S, show_default=True, metavar="SECONDS",
        help=f"Seconds of timed CPU latency rounds per batch size (source and emitted "
             f"interleaved, at least {MIN_ROUNDS} and at most 21 rounds; the report says "
             f"how many ran).")(f)


def output_options(f):
    """--out, --overwrite, --format."""
    return stack_options(f, [
        click.option("--out", "out", default=None,
                     help="Report folder (default: ./onnxdiag-report/<command>)."),
        click.option("--overwrite", is_flag=True, help="Replace an existing report folder."),
        click.option("--format", "fmt", type=click.Choice(["text", "json", "csv"]),
                     default="text", show_default=True,
                     help="What to print on stdout: the text report, the JSON report, or "
                          "the command's main table as CSV."),
    ])


@dataclass(frozen=True)
class Records:
    """The records one command line gives: data requests by role, head, runtime, report."""

    data: dict
    head: HeadChoice
    runtime: Runtime
    report: ReportTarget
    fmt: str

    def library(self) -> dict:
        """Keyword arguments of the verb function: ``data``/``eval_data``/``train_data``
        (the roles the command has), ``head``, ``runtime``, ``report``."""
        return {**self.data, "head": self.head, "runtime": self.runtime, "report": self.report}


def take_records(kwargs: dict, *, roles=("",), sourceless: bool = False) -> Records:
    """Remove the shared options from ``kwargs`` (what is left is the verb's own) and
    return them as records. ``--limit`` applies to the calibration role "" only; ``--seed``
    and ``--batch-size`` to every role, and ``seed`` stays in ``kwargs`` for the verb's own
    random choices. A role given no data is None, unless ``sourceless``: then it is a
    request without a source that still carries these settings, for a verb with default
    data (``analyze`` on the bundled sample)."""
    seed = kwargs.get("seed", 0)
    limit, batch_size = kwargs.pop("limit", None), kwargs.pop("batch_size", 64)
    cast = kwargs.pop("cast", False)
    data = {}
    for role in roles:
        key = role.replace("-", "_")
        source, labels = kwargs.pop(f"{key}data", None), kwargs.pop(f"{key}labels", None)
        fields = dict(labels=labels, limit=limit if role == "" else None, seed=seed,
                      batch_size=batch_size, cast=cast)
        data[ROLES[role][0]] = (DataRequest(source, **fields) if sourceless
                                else DataRequest.of(source, **fields))
    head = HeadChoice(kwargs.pop("head", None), kwargs.pop("features", None))
    runtime = Runtime(providers=kwargs.pop("providers", None),
                      executor=kwargs.pop("executor", None), jobs=kwargs.pop("jobs", None))
    report = ReportTarget(kwargs.pop("out", None), kwargs.pop("overwrite", False))
    return Records(data, head, runtime, report, kwargs.pop("fmt", "text"))


def emit_result(result, fmt: str) -> None:
    """Print a command's result (text, JSON or its CSV table) and where it was written."""
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


def readout_options(f):
    """--targets / --norm / --include-bias of the readout verbs."""
    return stack_options(f, [
        click.option("--targets", type=click.Choice(["auto", "labels", "pseudo", "expected"]),
                     default="auto", show_default=True,
                     help="Head-gradient targets: labels, pseudo (argmax) or expected "
                          "(label-free); auto = labels when the data has them."),
        click.option("--norm", type=click.Choice(["raw", "feature", "head"]), default="feature",
                     show_default=True, help="Head-gradient normalisation used to select."),
        click.option("--include-bias", is_flag=True, help="Add the bias gradient to the norm."),
    ])
