"""The (score, ratio) cells of ``prune-sweep``: the units of work its executor runs
(docs/METHODS.md §B6). Each cell plans, prunes physically, evaluates and recovers; what
the cells share travels once (:class:`SweepCells` and the model bytes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import HeadChoice, safe_ratio
from .channel_pruning import (
    Recovery,
    finetune_pruned,
    pruned_structure,
    recalibrate_pruned,
    reconstruct_pruned,
)

_CELL_CACHE: dict = {}  # per worker process: the sweep's model, structure and data, once


@dataclass(frozen=True)
class SweepCells:
    """What every cell of one sweep shares, shipped once with the model bytes.

    ``token``: the sweep's id (a worker process builds its context once per sweep);
    ``per_score``: {score: per-layer scores}; ``reference``: {ratio: reference Plan};
    ``head``: the source's head node and named features; ``evaluation`` / ``train`` /
    ``calib``: what :meth:`~onnxdiag.runtime.executor.Executor.ship` made of each data
    role (None when the cells do not need it); ``threads``: ORT threads per session;
    ``moments``: the dense model's consumer-input moments (reconstruction), or None.
    """

    token: str
    per_score: dict
    reference: dict
    budget: str
    seed: int
    providers: Any
    head: HeadChoice
    recovery: Recovery
    round_to: int | None
    threads: int | None
    evaluation: Any
    train: Any = None
    calib: Any = None
    moments: Any = None


def _cell_context(model_bytes: bytes, ctx: SweepCells) -> tuple:
    """(model, structure, evaluation, train, calib) of this sweep, built once per process."""
    hit = _CELL_CACHE.get(ctx.token)
    if hit is not None:
        return hit
    import onnx

    from ..graph import analyze_structure
    from ..model.io import get_input_specs
    from ..runtime.executor import receive

    model = onnx.load_from_string(model_bytes)
    structure = analyze_structure(model, head=ctx.head.head, features=ctx.head.features)
    specs = get_input_specs(model)
    opened = [None if s is None else receive(s, specs)
              for s in (ctx.evaluation, ctx.train, ctx.calib)]
    _CELL_CACHE.clear()
    _CELL_CACHE[ctx.token] = hit = (model, structure, *opened)
    return hit


def _sweep_cell(cell, model_bytes: bytes, ctx: SweepCells) -> dict:
    """One (score, ratio) cell: plan, prune physically, evaluate, recover."""
    from ..model.finalize import finalize_model
    from ..structured import plan_pruning
    from ..structured.plan import prune_planned

    sc, r = cell
    m, structure, evaluation, train, calib = _cell_context(model_bytes, ctx)
    reference = ctx.reference.get(r) if ctx.budget == "reference" else None
    plan = plan_pruning(m, structure, ctx.per_score[sc], None if reference is not None else r,
                        budget=ctx.budget, reference=reference, seed=ctx.seed, score_name=sc,
                        round_to=ctx.round_to)
    pruned, record = prune_planned(m, structure, plan.removed)
    pruned = finalize_model(pruned)
    p_struct = pruned_structure(pruned, structure, ctx.head)
    total = sum(plan.n_channels.values())
    row = {"score": sc, "ratio": r,
           "kept_fraction": 1 - plan.n_removed / total if total else 1.0,
           "channels_removed": plan.n_removed,
           "flops_ratio": safe_ratio(record.flops_after, record.flops_before),
           "params_ratio": safe_ratio(record.params_after, record.params_before),
           "accuracy_before": _accuracy(pruned, p_struct, evaluation, ctx),
           "accuracy_after": None}
    if ctx.recovery.reconstruct and plan.n_removed:
        pruned, rec = reconstruct_pruned(m, structure, plan.removed, ctx.moments, ctx.recovery,
                                         features=ctx.head.features)
        row["recon_error_before"] = rec["mean_error_before"]
        row["recon_error_after"] = rec["mean_error_after"]
    if ctx.recovery.recalibrate_bn:
        cache = _CELL_CACHE.setdefault((ctx.token, "recalibration"), {})
        pruned = recalibrate_pruned(pruned, calib, ctx.providers, m, structure, plan.removed,
                                    threads=ctx.threads, cache=cache,
                                    features=ctx.head.features)[0]
    if ctx.recovery.steps is not None and not ctx.recovery.finetune:
        row["accuracy_after"] = _accuracy(pruned, p_struct, evaluation, ctx)
    if ctx.recovery.finetune:
        head = HeadChoice(p_struct.head.node_name, ctx.head.features)
        _, ft = finetune_pruned(pruned, train, ctx.recovery, seed=ctx.seed, head=head,
                                evaluation=evaluation)
        row["accuracy_after"] = ft.accuracy_after
        row["finetune_loss_first_last"] = [ft.first_loss, ft.last_loss]
    return row


def _accuracy(model, structure, evaluation, ctx: SweepCells) -> float:
    from ..evaluate import evaluate

    return evaluate(model, structure.head, evaluation, providers=ctx.providers,
                    threads=ctx.threads).accuracy


def run_cells(ex, m, ctx: SweepCells, cells, *, progress: bool = True) -> tuple[list, list]:
    """(one row per cell, in order; the failed cells): a failed cell keeps the others."""
    from ..runtime.executor import wants_gpu

    rows, failed = [None] * len(cells), []
    for i, row, error in ex.map(_sweep_cell, cells, (m.SerializeToString(), ctx),
                                label="Pruning cells" if progress else None,
                                gpu=wants_gpu(ctx.providers)):
        if row is None:
            sc, r = cells[i]
            row = {"score": sc, "ratio": r, "kept_fraction": None,
                   "channels_removed": None, "flops_ratio": None, "params_ratio": None,
                   "accuracy_before": None, "accuracy_after": None, "error": error}
            failed.append({"score": sc, "ratio": r, "error": error})
        rows[i] = row
    _CELL_CACHE.clear()  # this process's copy of the sweep (single-process cells)
    return rows, failed
