"""The ``prune`` verb: unstructured pruning with one allocation and one repair, emitted
with a sidecar."""

from __future__ import annotations

import numpy as np

from ..errors import OnnxDiagError
from ..report import SCHEMA_VERSION, build_metadata, render_table
from .base import CommandResult, check_out, finish_old, render_header
from .pruning import (
    DEFAULTS,
    LATENCY_NOTE,
    check_model_output,
    compute_curves,
    make_pruner,
    parse_positions_arg,
    pruning_setup,
    say,
)


def prune_report_sparse(model, *, output, sparsity, allocation="rr", repair="cr+bn", data,
                        labels=None, eval_data=None, eval_labels=None, keep_dense=(),
                        rr_images=64, rr_positions=16, rr_prior="erk", rr_gamma=1.0, rr_cap=0.99,
                        force_projection=False, alpha_cap=100.0, recalibrate="affected",
                        sparse_initializers=False, limit=None, seed=0, batch_size=64,
                        providers=None, head=None, features=None, out=None, overwrite=False,
                        write=True, progress=True) -> CommandResult:
    """Prune to a global sparsity, repair, emit the model (``onnxdiag prune``, SPEC C5).

    The emitted file passes the full ONNX checker (the dense-stored form), is reloaded
    from its bytes in ONNX Runtime and compared with the in-memory model, and gets a
    sidecar ``<output>.json``: per-layer sparsity, allocation, repair parameters, the
    dense model's hash, agreement with the dense model, accuracies, sizes, latency.
    ``sparse_initializers``: store pruned weights as ``sparse_initializer`` when smaller.
    """
    from ..model.finalize import finalize_model
    from ..model.io import model_hash
    from ..sparsity import METHODS, RULES
    from ..sparsity.budget import exact_fraction

    if allocation not in RULES:
        raise OnnxDiagError(f"Unknown allocation {allocation!r}; choose from {', '.join(RULES)}.")
    if repair not in METHODS:
        raise OnnxDiagError(f"Unknown repair {repair!r}; choose from {', '.join(METHODS)}.")
    exact_fraction(sparsity)
    protect = [model, data, eval_data, labels, eval_labels]
    folder = check_out(out, "prune", overwrite, write)
    check_model_output(output, protect, overwrite)
    m, structure, specs, calib, feeds, evaluation, layers = pruning_setup(
        model, data=data, labels=labels, limit=limit, seed=seed, batch_size=batch_size,
        head=head, features=features, eval_data=eval_data, eval_labels=eval_labels,
        keep_dense=keep_dense)
    curves = None if not allocation.startswith("rr") else compute_curves(
        m, layers, feeds, n_images=rr_images, positions=rr_positions, seed=seed,
        providers=providers, progress=progress)
    pruner = make_pruner(m, structure, feeds, keep_dense=keep_dense, curves=curves,
                     rr_prior=rr_prior, rr_gamma=rr_gamma, rr_cap=rr_cap,
                     force_projection=force_projection, alpha_cap=alpha_cap,
                     recalibrate=recalibrate, providers=providers)
    alloc = pruner.allocate(allocation, sparsity)
    say(progress, f"Pruning {alloc.n_pruned} of {alloc.n_weights} weights ({allocation}), "
                   f"repair {repair} on {pruner.n_images} calibration images")
    pruned, record = pruner.prune(alloc, repair)
    pruned = finalize_model(pruned)
    info = _emit_pruned(m, pruned, pruner, alloc, record, output=output, model=model,
                        evaluation=evaluation, feeds=feeds, calib=calib,
                        specs=specs, sparse=sparse_initializers, protect=protect,
                        dense_hash=model_hash(m))
    params = dict(output=str(output), sparsity=sparsity, allocation=allocation, repair=repair,
                  data=data, labels=labels, eval_data=eval_data, eval_labels=eval_labels,
                  keep_dense=list(keep_dense), rr_images=rr_images,
                  rr_positions=parse_positions_arg(rr_positions), rr_prior=rr_prior,
                  rr_gamma=rr_gamma, rr_cap=rr_cap, force_projection=force_projection,
                  alpha_cap=alpha_cap, recalibrate=recalibrate,
                  sparse_initializers=sparse_initializers, limit=limit, seed=seed,
                  batch_size=batch_size, providers=providers, head=head, features=features,
                  defaults=DEFAULTS)
    meta = build_metadata(command="prune", parameters=params, model_path=model,
                          model_hash=info["dense_model_sha256"],
                          data={"calibration": calib.describe(),
                                "eval": evaluation.describe() if evaluation else None})
    report = {"schema": SCHEMA_VERSION, "metadata": meta, "prune": info}
    text = render_header(meta) + render_prune_sparse(info)
    from ..report.text import rows_to_csv

    alloc_d = info["allocation"]
    table = rows_to_csv([{"layer": k, "n_weights": alloc_d["n_params"][k],
                          "n_kept": alloc_d["n_kept"][k], "sparsity": info["layer_sparsity"][k]}
                         for k in alloc_d["layers"]])
    return finish_old("prune", report, text, text, folder, overwrite, csv=table,
                   csv_name="layers.csv")


def _emit_pruned(m, pruned, pruner, alloc, record, *, output, model, evaluation, feeds, calib,
                 specs, sparse, protect, dense_hash) -> dict:
    """Checks, comparison, storage choice, latency; writes the model and its sidecar."""
    from .. import __version__
    from ..evaluate import compare_models, make_head_runner
    from ..model.finalize import emit_model
    from ..runtime.latency import measure_latency
    from .base import example_input

    head = pruner.head
    agreement, ev_pruned = pruner.measure(pruned, evaluation)
    _, ev_dense = pruner.measure(m, evaluation) if evaluation is not None else (None, None)
    comparison = compare_models(make_head_runner(m, head), make_head_runner(pruned, head),
                                calib, head)
    checks = {"full_checker": "passed", "reload": _reload_check(pruned, feeds[0])}
    final, storage = pruned, {"format": "dense", "sparse_initializers": []}
    if sparse:
        final, storage = _sparse_storage(pruned, pruner, feeds[0])
    x = example_input(specs, calib)
    latency = {"dense_ms": measure_latency(m, {1: x[:1], 32: x}),
               "pruned_ms": measure_latency(final, {1: x[:1], 32: x})}
    sidecar = {
        "tool": "onnxdiag prune", "tool_version": __version__,
        "dense_model_path": str(model), "dense_model_sha256": dense_hash,
        "sparsity_target": alloc.target, "sparsity_achieved": alloc.n_pruned / alloc.n_weights,
        "n_weights": alloc.n_weights, "n_pruned": alloc.n_pruned,
        "layer_sparsity": dict(alloc.sparsity), "keep_dense": list(pruner.keep_dense),
        "allocation": alloc.to_dict(), "repair": record.to_dict(arrays=True),
        "agreement_with_dense": {"top1_agreement": agreement, "n_images": pruner.n_images,
                                 "data": "calibration"},
        "comparison_with_dense": comparison, "accuracy_dense": ev_dense,
        "accuracy_pruned": ev_pruned, "checks": checks, "storage": storage,
        "sizes": {"dense_bytes": m.ByteSize(), "pruned_dense_storage_bytes": pruned.ByteSize(),
                  "emitted_bytes": final.ByteSize()},
        "latency_cpu": latency, "notes": [LATENCY_NOTE]}
    return emit_model(final, output, source_path=model, sidecar=sidecar, protect=protect)


def _reload_check(model, feeds: dict) -> dict:
    """Serialize, parse back, full checker, ORT session; outputs equal the in-memory model's."""
    import onnx

    from ..runtime.runner import OrtRunner

    again = onnx.load_from_string(model.SerializeToString())
    onnx.checker.check_model(again, full_check=True)
    a = OrtRunner(model, providers="cpu").run(feeds)
    b = OrtRunner(again, providers="cpu").run(feeds)
    return {"onnxruntime_load": "passed",
            "max_abs_output_diff": max(float(np.max(np.abs(a[k] - b[k]))) for k in a)}


def _sparse_storage(pruned, pruner, feeds) -> tuple:
    from ..graph import GraphIndex
    from ..model.finalize import check_sparse_copy, store_sparse

    index = GraphIndex(pruned)
    names = [index.get_node(la.node_name).input[1] for la in pruner.layers]
    sparse, converted = store_sparse(pruned, names)
    info = {"format": "dense", "sparse_initializers": converted,
            "sparse_bytes": sparse.ByteSize(), "dense_bytes": pruned.ByteSize()}
    if not converted or sparse.ByteSize() >= pruned.ByteSize():
        info["note"] = "sparse_initializer storage would not be smaller; kept dense storage"
        return pruned, info
    info.update(format="sparse_initializer", check=check_sparse_copy(sparse, pruned, feeds),
                note="full checker run on the dense-stored form: ONNX shape inference does not "
                     "type a sparse_initializer read by Conv; this file passed the structural "
                     "checker, loads in ONNX Runtime and equals the dense form")
    return sparse, info


def render_prune_sparse(info: dict) -> str:
    alloc = info["allocation"]
    rows = [{"layer": name, "weights": alloc["n_params"][name], "kept": alloc["n_kept"][name],
             "sparsity": info["layer_sparsity"][name]} for name in alloc["layers"]]
    lat, sizes = info["latency_cpu"], info["sizes"]
    cmp_ = info["agreement_with_dense"]
    lines = [f"== Unstructured pruning (SPEC C): {alloc['rule']} at S = {alloc['target']}, "
             f"repair {info['repair']['method']} ==", render_table(rows).rstrip(),
             f"pruned {info['n_pruned']} of {info['n_weights']} prunable weights "
             f"({100 * info['sparsity_achieved']:.3f} %) -> {info['emitted']['path']} "
             f"(+ sidecar .json)",
             f"top-1 agreement with the dense model: {100 * cmp_['top1_agreement']:.2f} % on "
             f"{cmp_['n_images']} calibration images; max |logit diff| "
             f"{info['comparison_with_dense']['max_abs_logit_diff']:.4g}"]
    if info.get("accuracy_pruned"):
        lines.append(f"top-1 on eval data: dense {100 * info['accuracy_dense']['accuracy']:.2f} "
                     f"%, pruned {100 * info['accuracy_pruned']['accuracy']:.2f} %")
    st = info["storage"]
    lines += [f"checks: full ONNX checker {info['checks']['full_checker']}, reload in ONNX "
              f"Runtime {info['checks']['reload']['onnxruntime_load']}",
              f"size: dense {sizes['dense_bytes']:,} B, emitted {info['emitted']['file_bytes']:,}"
              f" B on disk ({st['format']} storage"
              + (f", {len(st['sparse_initializers'])} sparse initializers" if
                 st["format"] != "dense" else "") + ")",
              f"CPU latency ms: dense b=1 {lat['dense_ms']['1']:.3f}, b=32 "
              f"{lat['dense_ms']['32']:.3f}; pruned b=1 {lat['pruned_ms']['1']:.3f}, b=32 "
              f"{lat['pruned_ms']['32']:.3f}", f"note: {LATENCY_NOTE}"]
    if st.get("note"):
        lines.append(f"note: {st['note']}")
    return "\n".join(lines) + "\n"
