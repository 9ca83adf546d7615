"""CLI verbs for structured channel pruning (SPEC B6): prune-channels, prune-sweep.

Imported by onnxdiag.cli; each command registers itself on the ``cli`` group.
"""

from __future__ import annotations

import click

from ..structured.choice import DEFAULT_ALPHA, DEFAULT_BETA, SCORES
from . import cli
from .options import (
    data_options,
    emit_result,
    executor_option,
    library_kwargs,
    output_options,
    sampling_and_providers,
)


def _head_options(f):
    for opt in reversed([
        click.option("--head", default=None, metavar="NODE",
                     help="Name of the head node (the last linear layer)."),
        click.option("--features", default=None, metavar="TENSOR",
                     help="Name of the penultimate features tensor (the head's input)."),
        click.option("--targets", type=click.Choice(["auto", "labels", "pseudo"]),
                     default="auto", show_default=True,
                     help="Target T of the channel statistics (relevance, two_axis)."),
        click.option("--alpha", type=float, default=DEFAULT_ALPHA, show_default=True,
                     help="two_axis = alpha*norm(I_X) - beta*norm(I(T;Y))."),
        click.option("--beta", type=float, default=DEFAULT_BETA, show_default=True,
                     help="two_axis weight of the task relevance (SPEC grid 0, .1, .25, .5, 1)."),
    ]):
        f = opt(f)
    return f


def _finetune_options(f):
    for opt in reversed([
        click.option("--round-to", default=None, metavar="N|auto",
                     help="Keep a multiple of N channels in every narrowed group (kept "
                          "count rounded up): ONNX Runtime's blocked CPU convs run other "
                          "widths at the cost of the next multiple of 16 (AVX-512) / 8 "
                          "(AVX2) or slower; auto = this CPU's block."),
        click.option("--recalibrate-bn", is_flag=True,
                     help="Label-free recovery on --data: every BatchNormalization's "
                          "running statistics re-estimated in the pruned model; convs "
                          "without BN (folded, or none) are re-standardised to the dense "
                          "statistics of the channels they keep. Holds the --data samples "
                          "in memory (use --limit for large sets); runs before --finetune."),
        click.option("--finetune", is_flag=True,
                     help="Recover accuracy by fine-tuning the pruned ONNX graph "
                          "(needs the [training] extra in its own environment)."),
        click.option("--train-data", default=None,
                     help="Labelled training data for --finetune (same formats as --data)."),
        click.option("--train-labels", default=None, help="Labels file for --train-data."),
        click.option("--epochs", type=click.IntRange(min=1), default=5, show_default=True,
                     help="Fine-tuning epochs."),
        click.option("--max-batches", type=click.IntRange(min=1), default=200,
                     show_default=True, help="Most batches per fine-tuning epoch."),
        click.option("--lr", type=float, default=1e-4, show_default=True,
                     help="Adam learning rate of the fine-tuning."),
    ]):
        f = opt(f)
    return f


def _split(value: str, what: str, convert=str) -> list:
    try:
        items = [convert(v.strip()) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"give comma-separated {what}", param_hint=f"--{what}") from None
    if not items:
        raise click.BadParameter(f"give at least one of the {what}", param_hint=f"--{what}")
    return items


@cli.command("prune-channels")
@click.argument("model")
@click.option("-o", "--output", required=True, help="Where to write the smaller model (.onnx); "
              "a sidecar <output>.json is written beside it.")
@click.option("--ratio", type=click.FloatRange(0, 1, max_open=True), default=0.5,
              show_default=True, help="Fraction of each group's channels to remove.")
@click.option("--score", type=click.Choice(SCORES), default="two_axis", show_default=True,
              help="Channel score (higher = keep); ix, relevance, two_axis and peer need --data.")
@click.option("--budget", type=click.Choice(["uniform", "global", "reference"]),
              default="uniform", show_default=True,
              help="uniform: the ratio in every group (FLOPs-matched across scores); global: "
                   "one threshold over normalised scores, at most 90 %% per group; reference: "
                   "the per-group counts of --reference (FLOPs-matched with it).")
@click.option("--reference", default=None, metavar="PLAN.json",
              help="Allocation for --budget reference: a plan JSON whose per-group counts are "
                   "reused (default: a global-threshold magnitude plan at --ratio).")
@click.option("--plan", "plan", default=None,
              help="Replay this plan JSON (hash-checked against MODEL) instead of scoring.")
@click.option("--plan-out", default=None, help="Also write the plan as JSON.")
@data_options()
@data_options("eval-")
@sampling_and_providers
@_head_options
@_finetune_options
@output_options
def prune_channels_cmd(model, fmt, **kwargs):
    """Remove channels physically and write a smaller, faster ONNX model (SPEC B6).

    Reports parameters, FLOPs, file size and ONNX Runtime CPU latency (batch 1 and 32)
    before and after, and top-1 accuracy with --eval-data. Never overwrites MODEL; an
    existing -o (or --plan-out) file is replaced only with --overwrite.
    """
    from ..commands.prune_channels import prune_channels_report

    emit_result(prune_channels_report(model, **library_kwargs(kwargs)), fmt)


@cli.command("prune-sweep")
@click.argument("model")
@click.option("--ratios", default="0.1,0.25,0.5,0.75", show_default=True,
              help="Comma-separated fractions of channels removed.")
@click.option("--scores", default=",".join(SCORES), show_default=True,
              help="Comma-separated channel scores to compare.")
@click.option("--budget", type=click.Choice(["uniform", "reference", "global"]),
              default="uniform", show_default=True,
              help="uniform and reference (a global-magnitude allocation shared by every "
                   "score) are FLOPs-matched; global (per-score threshold) is not.")
@data_options()
@data_options("eval-", required=True)
@sampling_and_providers
@_head_options
@_finetune_options
@click.option("--jobs", type=click.IntRange(min=1), default=None,
              help="Worker processes for the statistics shards and the (score, ratio) cells "
                   "(default: 1, everything in this process; with ray, CPUs of the local "
                   "instance).")
@executor_option
@output_options
def prune_sweep_cmd(model, fmt, ratios, scores, **kwargs):
    """Accuracy vs kept-channel fraction per score, before and after recovery (SPEC B6).

    Channel statistics are computed once. Prints a table of top-1 accuracy per
    (score, fraction), the normalised AUC per score and the best local-axis (ix, peer)
    minus best target-axis (relevance) AUC; writes report.json, report.txt, sweep.csv.
    """
    from ..commands.prune_sweep import prune_sweep_report

    emit_result(prune_sweep_report(model, ratios=_split(ratios, "ratios", float),
                             scores=_split(scores, "scores"), **library_kwargs(kwargs)), fmt)
