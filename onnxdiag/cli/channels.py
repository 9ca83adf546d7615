"""CLI verbs of the channel family: channels, lesion."""

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
    sampling_and_providers,
)


@cli.command()
@click.argument("models", nargs=-1, required=True)
@data_options(required=True)
@sampling_and_providers
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
    from ..commands.channels import channels_report

    emit_result(channels_report(list(models), layers=list(layers) or None, **library_kwargs(kwargs)), fmt)


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
@sampling_and_providers
@head_options
@click.option("--targets", type=click.Choice(["auto", "labels", "pseudo"]), default="auto",
              show_default=True, help="Target of the channel scores computed on --data.")
@output_options
def lesion(model, fmt, layers, channels, **kwargs):
    """Lesion channels and measure the damage on labelled data (SPEC B5).

    With --data (calibration images) the channels are scored, --substitute becomes
    possible, and the report tests which score predicts the damage.
    """
    from ..commands.lesion import lesion_report

    chans = None
    if channels:
        try:
            chans = [int(c) for c in channels.split(",") if c.strip()]
        except ValueError:
            raise click.BadParameter("give integers such as 0,3,7",
                                     param_hint="--channels") from None
    emit_result(lesion_report(model, layers=list(layers), channels=chans, **library_kwargs(kwargs)), fmt)
