"""CLI verbs of the channel family: channels, lesion, orthogonality."""

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
    take_records,
)


def _targets_option(help: str):
    return click.option("--targets", type=click.Choice(["auto", "labels", "pseudo"]),
                        default="auto", show_default=True, help=help)


@cli.command()
@click.argument("models", nargs=-1, required=True)
@data_options(required=True)
@sampling_options
@runtime_options(fan_out=True, units="statistics shard")
@head_options
@_targets_option("Target T: ground-truth logit margin (labels) or the predicted class's "
                 "(pseudo, flagged in the report); auto = labels when the data has them.")
@click.option("--task-samples", type=click.Choice(["match", "gap"]), default="match",
              show_default=True,
              help="T repeated per sampled position or token (match) or per-input means (gap).")
@click.option("--positions", "n_positions", type=click.IntRange(min=1), default=16,
              show_default=True,
              help="Positions sampled per input: spatial positions of a conv's output, tokens "
                   "of a linear layer's (all of them when there are fewer).")
@click.option("--peers", "k_peers", type=click.IntRange(min=1), default=10, show_default=True,
              help="Peers in the ridge reconstruction R^2.")
@click.option("--ridge", type=float, default=1e-3, show_default=True,
              help="Ridge of the peer reconstruction.")
@click.option("--layer", "layers", multiple=True,
              help="Analyse only this layer (repeatable; default: every conv and linear layer "
                   "with >= 4 output channels, the head excluded).")
@click.option("--tap", type=click.Choice(["auto", "output", "input"]), default="auto",
              show_default=True,
              help="Where a layer's samples come from: its output as ONNX Runtime computes "
                   "it, or the layer evaluated in float64 at the sampled positions from its "
                   "input; auto = input where that copies far fewer values out of the session "
                   "(e.g. a first conv on a grey image), or where the input is BN + "
                   "activation of another analysed layer's output (a MobileNet's depthwise "
                   "conv: computed from that output, its own not exposed).")
@click.option("--triplet-partners", type=click.IntRange(min=2), default=10, show_default=True,
              help="Higher-order structure by depth: triplets among each channel's most "
                   "correlated partners (docs/METHODS.md §B4).")
@output_options
def channels(models, **kw):
    """Two-axis channel information (docs/METHODS.md §B): local substitutability vs task
    relevance.

    MODELS: one model, or a checkpoint series (the §B4 statistics per checkpoint form the
    training trajectory). Writes report.json, report.txt and channels.csv. With --jobs N
    (or --executor ray) the calibration set is cut into shards of whole batches, one
    statistics pass per shard, merged exactly.
    """
    from ..commands.channels import ChannelsOptions, channels_report

    rec = take_records(kw)
    kw["layers"] = tuple(kw["layers"]) or None
    emit_result(channels_report(list(models), **rec.library(), options=ChannelsOptions(**kw)),
                rec.fmt)


@cli.command()
@click.argument("checkpoints", nargs=-1, required=True)
@data_options(required=True)
@sampling_options
@runtime_options()
@head_options
@_targets_option("Target T of the task information: ground-truth logit margin (labels) or "
                 "the predicted class's (pseudo); auto = labels when the data has them.")
@click.option("--positions", "n_positions", type=click.IntRange(min=1), default=16,
              show_default=True, help="Positions (tokens) sampled per input.")
@click.option("--layer", "layers", multiple=True,
              help="Analyse only this layer (repeatable; default: every Conv with group 1 "
                   "and every Gemm/MatMul with a constant weight, >= 4 outputs, no head).")
@click.option("--early", type=click.IntRange(min=0), default=2, show_default=True,
              help="How many first updates the summary counts as early training.")
@output_options
def orthogonality(checkpoints, **kw):
    """Cosine between each layer's weight update and the gradients of its total input
    capture and task information, over a checkpoint series (docs/METHODS.md §B4).

    CHECKPOINTS: .onnx files of one architecture in training order, a folder (natural
    sort order), or a JSON/CSV listing. Writes report.json, report.txt and
    orthogonality.csv.
    """
    from ..commands.orthogonality import OrthogonalityOptions, orthogonality_report

    rec = take_records(kw)
    kw["layers"] = tuple(kw["layers"]) or None
    emit_result(orthogonality_report(list(checkpoints), **rec.library(),
                                     options=OrthogonalityOptions(**kw)), rec.fmt)


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
@runtime_options()
@head_options
@_targets_option("Target of the channel scores computed on --data.")
@output_options
def lesion(model, **kw):
    """Lesion channels and measure the damage on labelled data (docs/METHODS.md §B5).

    With --data (calibration images) the channels are scored, --substitute becomes
    possible, and the report tests which score predicts the damage.
    """
    from ..commands.lesion import LesionOptions, lesion_report

    rec = take_records(kw, roles=("", "eval-"))
    kw["channels"] = _channel_list(kw["channels"])
    emit_result(lesion_report(model, **rec.library(), options=LesionOptions(**kw)), rec.fmt)


def _channel_list(text: str | None) -> tuple[int, ...] | None:
    """``--channels 0,3,7`` as a tuple of ints (None when not given)."""
    if not text:
        return None
    try:
        return tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise click.BadParameter("give integers such as 0,3,7", param_hint="--channels") from None
