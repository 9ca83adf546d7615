"""Steps shared by the structured verbs ``prune-channels`` and ``prune-sweep``:
recovery, accuracy."""

from __future__ import annotations

from ..errors import OnnxDiagError


def evaluate_accuracy(model, structure, source, providers=None):
    from ..evaluate import evaluate_model, make_head_runner

    if source is None:
        return None
    return evaluate_model(make_head_runner(model, structure.head, providers=providers),
                          structure.head, source).to_dict()


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


def check_recovery(recalibrate_bn: bool, data, finetune: bool, train_data) -> None:
    """The recovery options' inputs, checked before any work (one-line user errors)."""
    if recalibrate_bn and data is None:
        raise OnnxDiagError("--recalibrate-bn needs calibration images for the new BN "
                            "statistics; pass --data FILE (labels are not needed).")
    if finetune:
        if train_data is None:
            raise OnnxDiagError("--finetune needs labelled training data; pass "
                                "--train-data FILE.")
        from ..finetune import import_training

        import_training()  # without the training extra: its install hint, before any work


def recalibrate_pruned(model, calib, providers, dense, structure, removed, *, threads=None,
                 cache: dict | None = None) -> tuple:
    """(model with every BN recalibrated on ``calib``, the record as a dict); convs without
    BN are re-standardised to the ``dense`` model's statistics of the channels they keep
    (``structure`` of the dense model, the plan's ``removed`` channels). ``cache``: a dict
    kept across calls on the same dense model and data (a sweep's cells), holding the
    calibration batches and the dense statistics once."""
    from ..model.finalize import finalize_model
    from ..sparsity.repair import collect_batches, conv_output_moments, recalibrate_batchnorm
    from ..structured import kept_output_channels

    cache = {} if cache is None else cache
    head = structure.head.node_name if structure.head is not None else None
    if "batches" not in cache:
        cache["batches"] = collect_batches(calib, None)
        cache["dense"] = conv_output_moments(dense, cache["batches"], head=head,
                                             providers=providers, threads=threads)
    out, record = recalibrate_batchnorm(
        model, cache["batches"], dense_model=dense,
        kept_channels=kept_output_channels(structure, removed), head=head,
        dense_moments=cache["dense"], providers=providers, threads=threads)
    return finalize_model(out), record.to_dict()
