"""What the structured verbs ``prune-channels`` and ``prune-sweep`` share
(docs/METHODS.md §B6): the :class:`Recovery` record and its steps, the head of a pruned
model, and why a plan removes nothing."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import OnnxDiagError

# Only the standard library at import time: the CLI builds Recovery before any work.


@dataclass(frozen=True)
class Recovery:
    """How a pruned model recovers, in this order (docs/METHODS.md §B6 "Recovery", §E2).

    ``reconstruct``: label-free, every consumer of the removed channels has them
    regressed on its kept inputs from the dense model's statistics on the calibration
    data and folded into its weights and bias (ridge ``recon_ridge`` · mean variance);
    None = auto: on when the model has no BatchNormalization (folded, LayerNorm, none)
    and calibration data is given, off otherwise (:meth:`resolve`). ``recalibrate_bn``:
    label-free, every BatchNormalization's running statistics re-estimated in the pruned
    model on the calibration data (convs without BN are re-standardised to the dense
    statistics of the channels they keep). ``finetune``: fine-tuning of the pruned ONNX
    graph on the training data (the [training] extra), ``epochs`` of at most
    ``max_batches`` batches, Adam learning rate ``lr``.
    """

    recalibrate_bn: bool = False
    finetune: bool = False
    epochs: int = 5
    lr: float = 1e-4
    max_batches: int = 200
    reconstruct: bool | None = None
    recon_ridge: float = 0.01

    @property
    def steps(self) -> str | None:
        """"reconstruction", "BN recalibration", "fine-tuning" (those that run) joined by
        " + ", or None."""
        names = [name for name, on in (("reconstruction", self.reconstruct is True),
                                       ("BN recalibration", self.recalibrate_bn),
                                       ("fine-tuning", self.finetune)) if on]
        return " + ".join(names) or None

    def resolve(self, model, has_data: bool) -> tuple[Recovery, str | None]:
        """(this record with ``reconstruct`` decided, a note saying what auto chose and
        why, or None when it was given)."""
        import dataclasses

        if self.reconstruct is not None:
            return self, None
        has_bn = any(n.op_type == "BatchNormalization" for n in model.graph.node)
        on = has_data and not has_bn
        why = ("the model has BatchNormalization (use --recalibrate-bn, or --reconstruct)"
               if has_bn else "no calibration data (--data)" if not has_data else
               "the model has no BatchNormalization to recalibrate")
        return dataclasses.replace(self, reconstruct=on), \
            f"recovery auto: reconstruction {'on' if on else 'off'}: {why}"

    def check(self, data, train_data) -> None:
        """The inputs of the steps asked for, checked before any work (one-line user
        errors; without the training extra, its install hint)."""
        if self.recalibrate_bn and data is None:
            raise OnnxDiagError("--recalibrate-bn needs calibration images for the new BN "
                                "statistics; pass --data FILE (labels are not needed).")
        if self.reconstruct and data is None:
            raise OnnxDiagError("--reconstruct needs calibration data for the consumers' input "
                                "statistics; pass --data FILE (labels are not needed).")
        if not self.recon_ridge >= 0:
            raise OnnxDiagError(f"--recon-ridge {self.recon_ridge!r} must be >= 0 (a fraction "
                                "of the mean input variance), e.g. 0.01.")
        if self.finetune:
            if train_data is None:
                raise OnnxDiagError("--finetune needs labelled training data; pass "
                                    "--train-data FILE.")
            from ..finetune import import_training

            import_training()

    def settings(self, seed: int):
        """The :class:`~onnxdiag.finetune.FinetuneSettings` of the fine-tuning step."""
        from ..finetune import FinetuneSettings

        return FinetuneSettings(epochs=self.epochs, max_batches=self.max_batches,
                                lr=self.lr, seed=seed)


def resolve_round_to(round_to) -> int | None:
    """``round_to`` as an int ≥ 1 or None; "auto" = this CPU's ONNX Runtime channel block
    (16 with AVX-512F, 8 with AVX2; None when unknown)."""
    if round_to is None:
        return None
    if isinstance(round_to, str) and round_to.strip().lower() == "auto":
        from ..runtime.latency import cpu_conv_block

        return cpu_conv_block()
    from ..sparsity.repairability import positive_int

    return positive_int(round_to, f"--round-to must be a positive integer or 'auto'; got "
                                  f"{round_to!r}.")


def check_labels(structure, *sources) -> None:
    """Every labelled source's labels lie in the model's classes (one-line DataError)."""
    from ..data.labels import check_label_range

    for source in sources:
        if source is not None and source.has_labels and structure.head is not None:
            check_label_range(source, structure.head.n_classes)


def open_request(request, specs):
    """The DataSource of a DataRequest for a model's inputs ``specs`` (None stays None)."""
    return None if request is None else request.open(specs)


def pruned_structure(pruned, structure, head):
    """The structure of ``pruned``, analysed with the source's head node and the features
    tensor the user named (``head``: the HeadChoice), as the source was."""
    from ..graph import analyze_structure

    name = structure.head.node_name if structure.head is not None else None
    return analyze_structure(pruned, head=name, features=head.features,
                             require_head=name is not None)


def recalibrate_pruned(model, calib, providers, dense, structure, removed, *, threads=None,
                       cache: dict | None = None, features: str | None = None) -> tuple:
    """(model with every BN recalibrated on ``calib``, the record as a dict); convs without
    BN are re-standardised to the ``dense`` model's statistics of the channels they keep
    (``structure`` of the dense model, the plan's ``removed`` channels). ``cache``: a dict
    kept across calls on the same dense model and data (a sweep's cells), holding the
    calibration batches and the dense statistics once. ``features``: the features tensor
    the head was named with (``--features``), if any."""
    from ..model.finalize import finalize_model
    from ..sparsity.repair import conv_output_moments, recalibrate_batchnorm
    from ..sparsity.segments import collect_batches
    from ..structured import kept_output_channels

    cache = {} if cache is None else cache
    head = structure.head.node_name if structure.head is not None else None
    if features is not None and structure.head.op_type != "Conv":
        # The repair finds the head again from its node name alone, which fails when the
        # features had to be named; it only needs the head to leave a Conv head alone.
        head = None
    if "batches" not in cache:
        cache["batches"] = collect_batches(calib, None)
        cache["dense"] = conv_output_moments(dense, cache["batches"], head=head,
                                             providers=providers, threads=threads)
    out, record = recalibrate_batchnorm(
        model, cache["batches"], dense_model=dense,
        kept_channels=kept_output_channels(structure, removed), head=head,
        dense_moments=cache["dense"], providers=providers, threads=threads)
    return finalize_model(out), record.to_dict()


def finetune_pruned(model, train, recovery: Recovery, *, seed: int, head, evaluation=None):
    """(fine-tuned ``model``, FinetuneRecord) on the DataSource ``train``; ``head``: the
    pruned model's HeadChoice (node and named features)."""
    from ..finetune import finetune_model

    return finetune_model(model, train, recovery.settings(seed), head=head.head,
                          features=head.features, eval_source=evaluation)


def removal_reason(structure, *, budget: str, ratio, plan=None) -> str | None:
    """Why nothing is (``plan`` None: can be) removed from ``structure``'s model, or None.

    Without a plan: no prunable group, or a ``ratio`` that removes ⌊ratio·n⌋ = 0 channels
    of every group (uniform) or of all channels (global). With the plan made: also a
    ``round_to`` that kept every group whole and a reference that removes none.
    """
    groups, prunable = structure.groups, [g for g in structure.groups if g.prunable]
    if not groups:
        return ("the model has no Conv, Gemm or MatMul layer whose output channels could "
                "be removed")
    if not prunable:
        shown = "; ".join(f"group {g.group_id} ({', '.join(g.members[:2])}): {g.reason}"
                          for g in groups[:3])
        more = f" (first 3 of {len(groups)})" if len(groups) > 3 else ""
        return f"no channel group can be pruned{more}: {shown}"
    reason = _ratio_reason(prunable, budget, ratio)
    if reason or plan is None or plan.n_removed:
        return reason
    round_to = (plan.settings or {}).get("round_to")
    if round_to:
        return (f"--round-to {round_to} rounds the kept count of every narrowed group up "
                "to its full width; use a larger ratio or a smaller --round-to")
    if plan.budget == "reference":
        return "the reference allocation removes no channel"
    return "the plan removes no channel"


def _ratio_reason(prunable, budget: str, ratio) -> str | None:
    if ratio is None or budget not in ("uniform", "global"):
        return None
    sizes = [g.n_channels for g in prunable]
    n = max(sizes) if budget == "uniform" else sum(sizes)
    if math.floor(ratio * n + 1e-9) > 0:
        return None
    what = (f"every prunable group is too narrow: the widest has {n} channels"
            if budget == "uniform" else f"the {len(sizes)} prunable groups have {n} "
                                         "channels in all")
    return (f"ratio {ratio:g} removes ⌊ratio·n⌋ = 0 channels ({what}); a ratio of at "
            f"least {1 / n:.3g} removes one")


def reconstruct_pruned(dense, structure, removed, moments, recovery: Recovery, *,
                       features: str | None = None) -> tuple:
    """(the ``dense`` model pruned of ``removed`` with its consumers reconstructed
    (docs/METHODS.md §E2), finalized; the ReconstructionRecord as a dict); ``moments``:
    the dense model's consumer-input moments (structured.choice.consumer_moments)."""
    from ..model.finalize import finalize_model
    from ..structured.reconstruct import prune_reconstructed

    pruned, _, record = prune_reconstructed(dense, structure, removed, moments,
                                            ridge=recovery.recon_ridge, features=features)
    return finalize_model(pruned), record.to_dict()


def needs_moments(recovery: Recovery, scores) -> bool:
    """Whether the consumers' input moments are needed: reconstruction, or a score in
    ``scores`` computed from them."""
    from ..structured.choice import CONSUMER_SCORES

    return bool(recovery.reconstruct) or any(s in CONSUMER_SCORES for s in scores)
