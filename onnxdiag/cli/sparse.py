"""CLI verbs for unstructured pruning (docs/METHODS.md §C): rr, prune, sweep.

Imported by onnxdiag.cli; each command registers itself on the ``cli`` group. Imports only
click and the option groups: each command imports its verb module when it runs.
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

# Literal copies of onnxdiag.sparsity.RULES / METHODS (a test checks they are equal), so
# that `onnxdiag --help` imports neither numpy nor onnx.
RULE_CHOICES = ("global", "uniform", "erk", "lamp", "rr", "rr-greedy", "rr-marginal")
REPAIR_CHOICES = ("none", "bn", "cr", "cr+bn", "layer-cr", "layer-cr+bn", "shrunk-cr",
                  "shrunk-cr+bn", "ls", "ls+bn")
FAN_OUT_UNITS = "RR layer / sweep cell"


def _positions_option(ctx, param, value):
    """``--rr-positions``: a positive integer or 'all' (returned as None)."""
    if value is None or str(value).strip().lower() == "all":
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise click.BadParameter(f"expected a positive integer or 'all', got {value!r}.")
    return n


def rr_options(f):
    """Options shared by the verbs that allocate: dense layers, the rr rule, the repair
    (the fields of :class:`onnxdiag.commands.pruning.PrunerOptions`)."""
    for opt in reversed([
        click.option("--keep-dense", "keep_dense", multiple=True, metavar="NODE",
                     help="Leave this layer dense (repeatable), e.g. the stem or the head."),
        click.option("--rr-images", type=click.IntRange(min=1), default=64, show_default=True,
                     help="Calibration images for the RR curves (docs/METHODS.md §C2)."),
        click.option("--rr-positions", default="16", show_default=True, metavar="N|all",
                     callback=_positions_option,
                     help="Conv output positions per image, or linear-layer tokens per "
                          "input (seeded by --seed), entering the RR moments; 'all' = every "
                          "position (exact, slower)."),
        click.option("--rr-prior", type=click.Choice(["erk", "lamp"]), default="erk",
                     show_default=True, help="Prior allocation the rr rule modulates."),
        click.option("--rr-gamma", type=float, default=1.0, show_default=True,
                     help="Exponent of the RR modulation (0 gives the prior back)."),
        click.option("--rr-cap", type=click.FloatRange(0, 1, max_open=True), default=0.99,
                     show_default=True, help="Per-layer sparsity cap of the rr rules."),
        click.option("--force-projection", is_flag=True,
                     help="ERK: set 1x1 shortcut convs to s = S and re-solve."),
        click.option("--alpha-cap", type=click.FloatRange(min=0, min_open=True), default=100.0,
                     show_default=True, help="Cap on CR's per-channel scale alpha."),
        click.option("--recalibrate", type=click.Choice(["affected", "all"]),
                     default="affected", show_default=True,
                     help="Recalibrate the BNs downstream of a pruned weight, or all BNs."),
    ]):
        f = opt(f)
    return f


def ls_options(f):
    """Options of the reconstruction repairs ls / ls+bn (docs/METHODS.md §E1)."""
    for opt in reversed([
        click.option("--ls-ridge", type=click.FloatRange(min=0, min_open=True), default=0.01,
                     show_default=True,
                     help="LS ridge: lambda = this x mean diag of the input Gram."),
        click.option("--ls-prior", type=click.Choice(["weights", "zero"]), default="weights",
                     show_default=True,
                     help="What the LS ridge pulls toward: the kept weights (identity when "
                          "nothing is pruned) or zero."),
        click.option("--ls-exact-max", type=click.FloatRange(min=0), default=1e9,
                     show_default=True,
                     help="Per layer, exact row solves up to this sum of |S_i|^3; above it "
                          "the SparseGPT one-sweep approximation."),
        click.option("--ls-positions", default="all", show_default=True, metavar="N|all",
                     callback=_positions_option,
                     help="Conv output positions per image (linear-layer tokens per input), "
                          "seeded by --seed, entering the LS moments; 'all' = exact."),
        click.option("--ls-inputs", type=click.Choice(["sequential", "dense"]),
                     default="sequential", show_default=True,
                     help="Fit each layer on its input in the repaired model (a dense and a "
                          "sequential pass) or in the dense model (one dense pass for all "
                          "layers, docs/METHODS.md §E1)."),
    ]):
        f = opt(f)
    return f


def take_pruner(kwargs: dict):
    """The :class:`~onnxdiag.commands.pruning.PrunerOptions` of ``rr_options``, removed
    from ``kwargs``."""
    from ..commands.pruning import PrunerOptions

    return PrunerOptions.take(kwargs)


def _verb_options(cls, kwargs: dict):
    """The verb's options record from what ``take_records`` left: the shared pruner
    options nested as ``pruner``, the rest as the verb's own fields."""
    from ..commands.pruning import PrunerOptions

    pruner = PrunerOptions.take(kwargs)
    return cls(pruner=pruner, **kwargs)


@cli.command()
@click.argument("model")
@data_options(required=True)
@sampling_options
@runtime_options(fan_out=True, units=FAN_OUT_UNITS)
@head_options
@click.option("--grid", default=None,
              help="RR sparsities, e.g. 0:0.9:0.05,0.91:0.99:0.01 (default: the 28 points of "
                   "docs/METHODS.md §C2).")
@click.option("--band-sparsity", default="0.1:0.9:0.1,0.91:0.99:0.01", show_default=True,
              help="Global sparsities of the label-free transition scan, or 'none'.")
@click.option("--allocation", type=click.Choice(RULE_CHOICES), default="rr",
              show_default=True, help="Allocation used by the transition scan.")
@rr_options
@output_options
def rr(model, **kwargs):
    """Relative repairability curves per layer and the predicted transition band.

    RR(layer, s) from one capture pass over --data (docs/METHODS.md §C2), then a
    label-free scan of global sparsities (CR+BN vs BN-only agreement with the dense
    model, CTS; §C4). Writes report.json, report.txt, rr_curves.csv and transition.csv.
    """
    from ..commands.rr import RROptions, rr_report

    rec = take_records(kwargs)
    emit_result(rr_report(model, **rec.library(), options=_verb_options(RROptions, kwargs)),
                rec.fmt)


@cli.command()
@click.argument("model")
@click.option("-o", "--output", required=True, help="Pruned model file to write (.onnx).")
@click.option("--sparsity", type=click.FloatRange(0, 1), required=True,
              help="Global sparsity S: fraction of the model's conv/linear weights removed, "
                   "e.g. 0.95 (0 writes the model unchanged and says so).")
@click.option("--allocation", type=click.Choice(RULE_CHOICES), default="rr",
              show_default=True, help="How S is spread over the layers (docs/METHODS.md §C3).")
@click.option("--repair", type=click.Choice(REPAIR_CHOICES), default="cr+bn",
              show_default=True,
              help="Label-free repair: CR / BN (docs/METHODS.md §C1) or the least-squares "
                   "reconstruction ls / ls+bn (§E1).")
@click.option("--sparse-initializers", is_flag=True,
              help="Store pruned weights as sparse_initializer where that is smaller.")
@latency_option
@data_options(required=True)
@data_options("eval-")
@sampling_options
@runtime_options()
@head_options
@rr_options
@ls_options
@output_options
def prune(model, output, **kwargs):
    """Prune to a global sparsity, repair, and write the model (docs/METHODS.md §C5).

    Writes OUTPUT and OUTPUT.json (source and emitted model facts, checks, comparison with
    the source, accuracy with --eval-data, CPU latency, per-layer sparsity, allocation,
    repair parameters). Every Conv, Gemm and MatMul with a constant weight is prunable
    (an MLP's hidden layers, a transformer's attention and MLP projections, the head).
    Refuses to overwrite the input, and an existing OUTPUT without --overwrite.
    """
    from ..commands.prune import PruneOptions, prune_report_sparse

    rec = take_records(kwargs, roles=("", "eval-"))
    emit_result(prune_report_sparse(model, output=output, **rec.library(),
                                    options=_verb_options(PruneOptions, kwargs)), rec.fmt)


@cli.command()
@click.argument("model")
@click.option("--sparsity", required=True,
              help="Sparsity grid: start:stop:step (stop included) and/or values, e.g. "
                   "0.90:0.97:0.005 or 0.5,0.9,0.95.")
@click.option("--allocations", default="all", show_default=True,
              help="Comma-separated allocations, or 'all' ("
                   + ", ".join(RULE_CHOICES) + ").")
@click.option("--repairs", default="cr+bn,bn,none", show_default=True,
              help="Comma-separated repairs (" + ", ".join(REPAIR_CHOICES) + ").")
@data_options(required=True)
@data_options("eval-")
@sampling_options
@runtime_options(fan_out=True, units=FAN_OUT_UNITS)
@head_options
@rr_options
@ls_options
@output_options
def sweep(model, **kwargs):
    """Accuracy table over sparsity x allocation x repair, with the transition bands.

    Per cell: agreement with the dense model on --data (label-free) and, with
    --eval-data, top-1 accuracy and loss. RR curves are computed once. Writes
    report.json, report.txt and sweep.csv.
    """
    from ..commands.sweep import SweepOptions, sweep_report

    rec = take_records(kwargs, roles=("", "eval-"))
    emit_result(sweep_report(model, **rec.library(),
                             options=_verb_options(SweepOptions, kwargs)), rec.fmt)
