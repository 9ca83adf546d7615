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


#: The structured repairs that the unstructured REPAIR_CHOICES lack (bn and none are there).
CHANNEL_REPAIR_CHOICES = ("reconstruct", "reconstruct+bn")


def select_prune_options(f):
    """--prune / --prune-channels and their settings (docs/METHODS.md §A5)."""
    from .sparse import REPAIR_CHOICES, RULE_CHOICES, rr_options

    return stack_options(rr_options(f), [
        click.option("--prune", "prune_sparsity", type=click.FloatRange(0, 1), default=None,
                     help="Also prune every checkpoint to this global sparsity S (as "
                          "`onnxdiag prune`) and rank for the pruned model."),
        click.option("--allocation", type=click.Choice(RULE_CHOICES), default="rr",
                     show_default=True, help="With --prune: how S is spread over layers."),
        click.option("--repair", type=click.Choice(REPAIR_CHOICES + CHANNEL_REPAIR_CHOICES),
                     default=None,
                     help="Label-free repair: with --prune default cr+bn; with "
                          "--prune-channels bn (BN recalibration, default), reconstruct "
                          "(docs/METHODS.md §E2), reconstruct+bn or none."),
        click.option("--prune-channels", "prune_channels", type=float, default=None,
                     metavar="R", help="Also remove this fraction of each channel group "
                                       "(as `onnxdiag prune-channels`) and rank."),
        click.option("--score", default="two_axis", show_default=True,
                     help="With --prune-channels: the channel score."),
        click.option("--budget", type=click.Choice(["uniform", "global"]), default="uniform",
                     show_default=True, help="With --prune-channels: the channel budget."),
        click.option("--plan", default=None, metavar="PLAN.json",
                     help="Apply this channel plan to every checkpoint of its architecture "
                          "(same topology hash) instead of a plan per checkpoint."),
        click.option("--write-pruned", default=None, metavar="DIR",
                     help="Also write each pruned model (+ sidecar) into DIR."),
        click.option("--rank-by", default="agreement", show_default=True,
                     help="With pruning: the criterion of the choice and ranking (combined, "
                          "agreement, dense:READOUT or pruned:READOUT)."),
    ])


def take_prune(kw: dict, overwrite: bool):
    """The PruneSelectOptions of the command line (None without --prune / --prune-channels
    / --plan); removes its options from ``kw``."""
    from .sparse import take_pruner

    names = ("prune_sparsity", "allocation", "repair", "prune_channels", "score", "budget",
             "plan", "write_pruned", "rank_by")
    values = {n: kw.pop(n) for n in names}
    pruner = take_pruner(kw)
    if values["prune_sparsity"] is None and values["prune_channels"] is None \
            and values["plan"] is None:
        return None
    from ..commands.select_prune_unit import PruneSelectOptions

    return PruneSelectOptions(
        sparsity=values["prune_sparsity"], allocation=values["allocation"],
        repair=values["repair"], channels=values["prune_channels"], score=values["score"],
        budget=values["budget"], plan=values["plan"], seed=kw.get("seed", 0),
        write_pruned=values["write_pruned"], overwrite=overwrite, rank_by=values["rank_by"],
        pruner=pruner)


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
    from ..commands.analyze import inspect_model, topology_of
    from ..report import to_json

    structure, text = inspect_model(model, head=take_records(kw, roles=()).head)
    click.echo(to_json({**structure.to_dict(), "topology_hash": topology_of(model)})
               if as_json else text, nl=False)


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
@select_prune_options
@output_options
def select(checkpoints, **kw):
    """Pick a checkpoint without validation data (docs/METHODS.md §A3).

    CHECKPOINTS are .onnx files in training order, a folder (natural sort order), or a
    JSON/CSV listing with paths and steps. With --eval-data, also reports how good
    each readout's choice was (accuracy, correlations, selection gap).

    With --prune S (unstructured, as `onnxdiag prune`) or --prune-channels R / --plan
    (channels, as `onnxdiag prune-channels`), every checkpoint is also pruned and
    repaired, and the series is ranked for the pruned deployment (docs/METHODS.md §A5).
    """
    from ..commands.select import SelectOptions, select_report

    rec = take_records(kw, roles=("", "eval-"))
    prune = take_prune(kw, rec.report.overwrite)
    emit_result(select_report(list(checkpoints), **rec.library(), options=SelectOptions(**kw),
                              prune=prune), rec.fmt)
