"""CLI verbs for structured channel pruning (docs/METHODS.md §B6): prune-channels,
prune-sweep.

Imported by onnxdiag.cli; each command registers itself on the ``cli`` group. Only click
and the records at import time: the choices below are literal copies of the library's
(a test keeps them equal), so ``--help`` imports neither numpy nor onnx.
"""

from __future__ import annotations

import click

from . import cli
from .options import (
    data_options,
    emit_result,
    head_options,
    latency_option,
    output_options,
    runtime_options,
    sampling_options,
    take_records,
)

#: = onnxdiag.structured.choice.SCORES / TARGETS / DEFAULT_ALPHA, DEFAULT_BETA
SCORES = ("magnitude", "bn_scale", "random", "ix", "relevance", "two_axis", "peer",
          "synergy", "redundancy", "recon", "wanda")
TARGETS = ("auto", "labels", "pseudo")
DEFAULT_ALPHA, DEFAULT_BETA = 1.0, 0.25
#: = onnxdiag.structured.plan.BUDGETS; onnxdiag.commands.prune_sweep.DEFAULT_RATIOS
BUDGETS = ("uniform", "reference", "global")
DEFAULT_RATIOS = (0.1, 0.25, 0.5, 0.75)
#: The keywords of onnxdiag.commands.channel_pruning.Recovery.
RECOVERY = ("recalibrate_bn", "finetune", "epochs", "lr", "max_batches", "reconstruct",
            "recon_ridge")
ROLES = ("", "eval-", "train-")


def _stack(f, opts):
    for opt in reversed(opts):
        f = opt(f)
    return f


def score_options(f):
    """--targets, --alpha, --beta: how the statistics-based scores are computed."""
    return _stack(f, [
        click.option("--targets", type=click.Choice(TARGETS), default="auto",
                     show_default=True,
                     help="Target T of the channel statistics (relevance, two_axis)."),
        click.option("--alpha", type=float, default=DEFAULT_ALPHA, show_default=True,
                     help="two_axis = alpha*norm(I_X) - beta*norm(I(T;Y))."),
        click.option("--beta", type=float, default=DEFAULT_BETA, show_default=True,
                     help="two_axis weight of the task relevance (docs/METHODS.md §B6: "
                          "grid 0, .1, .25, .5, 1)."),
    ])


def recovery_options(f):
    """--round-to and the recovery steps (--reconstruct, --recalibrate-bn, --finetune and
    its schedule)."""
    return _stack(f, [
        click.option("--round-to", default=None, metavar="N|auto",
                     help="Keep a multiple of N channels in every narrowed group (kept "
                          "count rounded up): ONNX Runtime's blocked CPU convs run other "
                          "widths at the cost of the next multiple of 16 (AVX-512) / 8 "
                          "(AVX2) or slower; auto = this CPU's block."),
        click.option("--reconstruct/--no-reconstruct", default=None,
                     help="Label-free recovery on --data (docs/METHODS.md §E2): each "
                          "consumer of the removed channels gets them regressed on its "
                          "kept inputs (dense-model statistics, one pass) folded into its "
                          "weights and bias. Default: on when the model has no "
                          "BatchNormalization (BN folded, LayerNorm, none) and --data is "
                          "given; the report says what ran. Runs before --recalibrate-bn."),
        click.option("--recon-ridge", type=click.FloatRange(min=0), default=0.01,
                     show_default=True,
                     help="Ridge of the reconstruction (and of --score recon), as a "
                          "fraction of the mean kept-input variance."),
        click.option("--recalibrate-bn", is_flag=True,
                     help="Label-free recovery on --data: every BatchNormalization's "
                          "running statistics re-estimated in the pruned model; convs "
                          "without BN (folded, or none) are re-standardised to the dense "
                          "statistics of the channels they keep. Holds the --data samples "
                          "in memory (use --limit for large sets); runs before --finetune."),
        click.option("--finetune", is_flag=True,
                     help="Recover accuracy by fine-tuning the pruned ONNX graph on "
                          "--train-data (needs the [training] extra in its own "
                          "environment)."),
        click.option("--epochs", type=click.IntRange(min=1), default=5, show_default=True,
                     help="Fine-tuning epochs."),
        click.option("--max-batches", type=click.IntRange(min=1), default=200,
                     show_default=True, help="Most batches per fine-tuning epoch."),
        click.option("--lr", type=float, default=1e-4, show_default=True,
                     help="Adam learning rate of the fine-tuning."),
    ])


def data_roles(*, eval_required: bool = False):
    """--data, --eval-data, --train-data (and their --labels)."""
    def decorate(f):
        return _stack(f, [
            data_options(),
            data_options("eval-", required=eval_required),
            data_options("train-", help="Labelled training data for --finetune (same "
                                        "formats as --data)."),
        ])
    return decorate


def _split(value: str, what: str, convert=str) -> tuple:
    try:
        items = [convert(v.strip()) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"give comma-separated {what}", param_hint=f"--{what}") from None
    if not items:
        raise click.BadParameter(f"give at least one of the {what}", param_hint=f"--{what}")
    return tuple(items)


def _records(kw: dict):
    """(the shared records, the Recovery record); the rest of ``kw`` is the verb's options."""
    from ..commands.channel_pruning import Recovery

    rec = take_records(kw, roles=ROLES)
    return rec, Recovery(**{k: kw.pop(k) for k in RECOVERY})


@cli.command("prune-channels")
@click.argument("model")
@click.option("-o", "--output", required=True, help="Where to write the smaller model (.onnx); "
              "a sidecar <output>.json is written beside it.")
@click.option("--ratio", type=click.FloatRange(0, 1, max_open=True), default=0.5,
              show_default=True, help="Fraction of each group's channels to remove, in (0, 1).")
@click.option("--score", type=click.Choice(SCORES), default="two_axis", show_default=True,
              help="Channel score (higher = keep); ix, relevance, two_axis, peer, synergy, "
                   "redundancy, recon (repair-aware greedy choice) and wanda need --data.")
@click.option("--budget", type=click.Choice(BUDGETS), default="uniform", show_default=True,
              help="uniform: the ratio in every group (FLOPs-matched across scores); global: "
                   "one threshold over normalised scores, at most 90 % per group; reference: "
                   "the per-group counts of --reference (FLOPs-matched with it).")
@click.option("--reference", default=None, metavar="PLAN.json",
              help="Allocation for --budget reference: a plan JSON whose per-group counts are "
                   "reused (default: a global-threshold magnitude plan at --ratio).")
@click.option("--plan", "plan", default=None,
              help="Replay this plan JSON (hash-checked against MODEL) instead of scoring.")
@click.option("--plan-out", default=None, help="Also write the plan as JSON.")
@click.option("--fold-bn/--no-fold-bn", default=True, show_default=True,
              help="Fold every Conv+BatchNormalization pair into the Conv and drop redundant "
                   "Reshape/Transpose/identity nodes in the emitted model (outputs change by "
                   "float rounding only, checked); --no-fold-bn emits the pruned graph as it "
                   "is, BatchNormalization kept.")
@latency_option
@data_roles()
@sampling_options
@runtime_options()
@head_options
@score_options
@recovery_options
@output_options
def prune_channels_cmd(model, output, **kw):
    """Remove channels physically and write a smaller, faster ONNX model
    (docs/METHODS.md §B6).

    Reports parameters, FLOPs, file size and ONNX Runtime CPU latency (batch 1 and 32)
    before and after, and top-1 accuracy with --eval-data; says why when no channel can
    be removed. Never overwrites MODEL; an existing -o (or --plan-out) file is replaced
    only with --overwrite.
    """
    from ..commands.prune_channels import ChannelPruneOptions, prune_channels_report

    rec, recovery = _records(kw)
    emit_result(prune_channels_report(model, output=output, **rec.library(),
                                      options=ChannelPruneOptions(**kw), recovery=recovery),
                rec.fmt)


@cli.command("prune-sweep")
@click.argument("model")
@click.option("--ratios", default=",".join(map(str, DEFAULT_RATIOS)), show_default=True,
              help="Comma-separated fractions of channels removed.")
@click.option("--scores", default=",".join(SCORES), show_default=True,
              help="Comma-separated channel scores to compare.")
@click.option("--budget", type=click.Choice(BUDGETS), default="uniform", show_default=True,
              help="uniform and reference (a global-magnitude allocation shared by every "
                   "score) are FLOPs-matched; global (per-score threshold) is not.")
@data_roles(eval_required=True)
@sampling_options
@runtime_options(fan_out=True, units="(score, ratio) cell")
@head_options
@score_options
@recovery_options
@output_options
def prune_sweep_cmd(model, ratios, scores, **kw):
    """Accuracy vs kept-channel fraction per score, before and after recovery
    (docs/METHODS.md §B6).

    Needs labelled --eval-data. Channel statistics are computed once. Prints a table of
    top-1 accuracy per (score, fraction), the normalised AUC per score and the best
    local-axis (ix, peer) minus best target-axis (relevance) AUC; writes report.json,
    report.txt, sweep.csv.
    """
    from ..commands.prune_sweep import PruneSweepOptions, prune_sweep_report

    rec, recovery = _records(kw)
    options = PruneSweepOptions(ratios=_split(ratios, "ratios", float),
                                scores=_split(scores, "scores"), **kw)
    emit_result(prune_sweep_report(model, **rec.library(), options=options, recovery=recovery),
                rec.fmt)
