"""The ``prune`` verb: unstructured pruning with one allocation and one repair, emitted
with a sidecar (docs/METHODS.md §C1, §C3, §C5)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import OnnxDiagError
from ..report import SCHEMA_VERSION, render_table, rows_to_csv
from ..runtime.latency import LATENCY_BUDGET_S, check_latency_budget
from .base import (
    CommandResult,
    HeadChoice,
    ReportTarget,
    Runtime,
    finish,
    first_samples,
    render_header,
)
from .pruning import (
    LATENCY_NOTE,
    Inputs,
    PrunerOptions,
    check_model_output,
    compute_curves,
    make_pruner,
    open_inputs,
    protected_inputs,
    pruning_metadata,
    say,
)


@dataclass(frozen=True)
class PruneOptions:
    """Options of ``onnxdiag prune``.

    ``sparsity``: the global sparsity S, a fraction of every conv / linear weight of the
    model (required; 0 is a reported no-op). ``allocation``: how S is spread over the
    layers (docs/METHODS.md §C3); ``repair``: the label-free repair (§C1).
    ``sparse_initializers``: store pruned weights as ``sparse_initializer`` when smaller.
    ``seed``: the RR position draw. ``latency_budget``: seconds of timed latency rounds
    per batch size (:func:`~onnxdiag.runtime.latency.compare_latency`). ``pruner``: the
    options shared with rr and sweep.
    """

    sparsity: float | None = None
    allocation: str = "rr"
    repair: str = "cr+bn"
    sparse_initializers: bool = False
    seed: int = 0
    latency_budget: float = LATENCY_BUDGET_S
    pruner: PrunerOptions = PrunerOptions()

    def check(self) -> None:
        """Raise OnnxDiagError for an option prune cannot use (before any work)."""
        from ..sparsity import METHODS, RULES
        from ..sparsity.budget import exact_fraction

        if self.sparsity is None:
            raise OnnxDiagError("prune needs a global sparsity: give --sparsity S (e.g. 0.9 "
                                "for 90 % of the model's conv/linear weights removed).")
        if self.allocation not in RULES:
            raise OnnxDiagError(f"Unknown allocation {self.allocation!r}; choose from "
                                f"{', '.join(RULES)}.")
        if self.repair not in METHODS:
            raise OnnxDiagError(f"Unknown repair {self.repair!r}; choose from "
                                f"{', '.join(METHODS)}.")
        exact_fraction(self.sparsity)
        check_latency_budget(self.latency_budget)
        self.pruner.check()


def prune_report_sparse(model, *, output, data, eval_data=None,
                        options: PruneOptions = PruneOptions(),
                        head: HeadChoice = HeadChoice(),  # noqa: B008 - frozen records
                        runtime: Runtime = Runtime(),  # noqa: B008
                        report: ReportTarget = ReportTarget(),  # noqa: B008
                        ) -> CommandResult:
    """Prune to a global sparsity, repair, emit the model (``onnxdiag prune``).

    S counts every conv / linear weight of the model (every Conv, Gemm and MatMul with a
    constant weight is prunable, docs/METHODS.md §C1, §D); a model without such a layer,
    or a budget the prunable layers cannot hold, is refused (OnnxDiagError) before any
    work. A budget of 0 weights emits
    the source model unchanged and says why (``no_op``). The emitted file goes through
    :func:`~onnxdiag.model.finalize.emit_model` (full checker, ONNX Runtime reload,
    outputs against the in-memory model) and gets a sidecar ``<output>.json`` with the
    same section as the report: ``source``, ``emitted``, ``checks``, ``comparison``,
    ``latency_ms``, ``accuracy``, ``notes`` and the per-layer sparsity, allocation and
    repair.
    """
    from ..sparsity.budget import plan_model_budget

    options.check()
    protect = protected_inputs(model, data, eval_data)
    folder = report.folder("prune")
    check_model_output(output, protect, report.overwrite)
    inputs = open_inputs(model, data, eval_data, head=head,
                         keep_dense=options.pruner.keep_dense)
    budget = plan_model_budget(options.sparsity, inputs.structure.layers, inputs.layers,
                               options.pruner.keep_dense)
    pruned, pruner, alloc, record = prune_inputs(inputs, options, budget, runtime)
    info = _emit(inputs, pruned, pruner, alloc, record, budget=budget, output=output,
                 options=options, protect=protect)
    meta = pruning_metadata("prune", inputs, options, runtime=runtime, head=head, data=data,
                            eval_data=eval_data, output=str(output))
    doc = {"schema": SCHEMA_VERSION, "metadata": meta, "prune": info}
    text = render_header(meta) + render_prune_sparse(info)
    a = info["allocation"]
    table = rows_to_csv([{"layer": k, "n_weights": a["n_params"][k], "n_kept": a["n_kept"][k],
                          "sparsity": info["layer_sparsity"][k]} for k in a["layers"]])
    return finish("prune", doc, text, folder, report.overwrite, csv=table,
                  csv_name="layers.csv")


def no_op_reason(budget) -> str | None:
    """Why a budget removes nothing (None when it removes something)."""
    if budget.n_pruned:
        return None
    if budget.target == 0:
        return "sparsity 0 removes no weight"
    return (f"sparsity {budget.target:g} of {budget.n_model:,} conv/linear weights rounds "
            f"down to 0 weights (⌊S·N⌋ = 0)")


def prune_inputs(inputs: Inputs, options: PruneOptions, budget, runtime) -> tuple:
    """(finalized pruned model, pruner, allocation, repair record or None for a no-op)."""
    from ..model.finalize import finalize_model

    rule, opts = options.allocation, options.pruner
    curves = None
    if rule.startswith("rr") and budget.n_pruned:
        curves = compute_curves(inputs, opts, seed=options.seed, providers=runtime.providers,
                                progress=runtime.progress, methods=(options.repair,))
    pruner = make_pruner(inputs, opts, curves, runtime.providers, seed=options.seed,
                         progress=runtime.progress)
    if not budget.n_pruned:  # nothing to remove: no allocation rule or repair runs
        alloc = pruner.allocate("uniform", 0.0)
        say(runtime.progress, f"Pruning nothing: {no_op_reason(budget)}; emitting the source "
                              "model unchanged")
        return finalize_model(inputs.model), pruner, alloc, None
    alloc = pruner.allocate(rule, budget.sparsity_supported)
    say(runtime.progress, f"Pruning {alloc.n_pruned} of {alloc.n_weights} weights ({rule}), "
                          f"repair {options.repair} on {pruner.n_images} calibration images")
    pruned, record = pruner.prune(alloc, options.repair)
    return finalize_model(pruned), pruner, alloc, record


def _emit(inputs: Inputs, pruned, pruner, alloc, record, *, budget, output, options,
          protect) -> dict:
    """Storage choice, measurements; writes the model and its sidecar (the section)."""
    from .. import __version__
    from ..model.finalize import emit_model

    final, storage = pruned, {"format": "dense", "sparse_initializers": []}
    if options.sparse_initializers:
        final, storage = _sparse_storage(pruned, pruner, inputs.feeds[0])
    reason = no_op_reason(budget)
    notes = ([f"no-op: {reason}; the emitted model is the source model (no repair ran)"]
             if reason else []) + ([] if record is None else list(record.notes)) + [
        LATENCY_NOTE] + ([storage["note"]] if storage.get("note") else [])
    sidecar = {
        "tool": "onnxdiag prune", "tool_version": __version__,
        "source": _model_facts(inputs.model, inputs.structure, inputs.path),
        **_measure(inputs, pruned, final, pruner, options.latency_budget),
        "sparsity_target": budget.target, "n_weights": budget.n_model,
        "n_pruned": alloc.n_pruned, "sparsity_achieved": alloc.n_pruned / budget.n_model,
        "no_op": reason, "budget": budget.to_dict(), "layer_sparsity": dict(alloc.sparsity),
        "keep_dense": list(pruner.keep_dense), "allocation": alloc.to_dict(),
        "repair": None if record is None else record.to_dict(arrays=True),
        "storage": storage, "notes": notes}
    sidecar["emitted"] = _model_facts(pruned, inputs.structure)
    info = emit_model(final, output, source_path=inputs.path, sidecar=sidecar,
                      protect=protect, verify_feeds=first_samples(inputs.feeds[0]))
    return info


def _measure(inputs: Inputs, pruned, final, pruner, latency_budget) -> dict:
    """``agreement`` (all calibration images, docs/METHODS.md §C4), ``comparison`` (on the
    evaluation data, else the calibration data), ``accuracy`` and ``latency_ms`` (source
    and emitted interleaved, ``latency_budget`` seconds per batch size)."""
    from ..evaluate import compare_logits, compare_models, evaluate_pair, make_head_runner
    from ..runtime.latency import compare_latency
    from .base import example_input

    head, m = pruner.head, inputs.model
    logits = pruner.logits(pruned)  # the pruned model's, on every calibration image
    evaluations = (None, None)
    if inputs.evaluation is not None:  # each model run once: evaluated and compared
        *evaluations, comparison = evaluate_pair(
            make_head_runner(m, head, providers=pruner.providers),
            make_head_runner(pruned, head, providers=pruner.providers), head,
            inputs.evaluation)
    elif head.features_reduce != "positions":
        # on the calibration data: the logits both models have had computed already
        comparison = compare_logits(pruner.dense_logits, logits)
    else:
        comparison = compare_models(make_head_runner(m, head), make_head_runner(pruned, head),
                                    inputs.calib, head)
    comparison["data"] = "evaluation" if inputs.evaluation is not None else "calibration"
    accuracy = {role: None if ev is None else ev.to_dict()
                for role, ev in zip(("source", "emitted"), evaluations)}
    x = example_input(inputs.specs, inputs.calib)
    latency = compare_latency(m, final, {1: x[:1], 32: x}, budget_s=latency_budget)
    return {"agreement": {"top1_agreement": pruner.agreement(pruned, logits=logits),
                          "n_images": pruner.n_images, "data": "calibration"},
            "comparison": comparison, "accuracy": {**accuracy, "before_recovery": None},
            "latency_ms": {**latency, "providers": "cpu"}}


def _model_facts(model, structure, path=None) -> dict:
    """path, sha256, file_bytes, params, flops of a model (``nonzero_params`` too: the
    unstructured zeros stay stored, so ``params`` does not fall)."""
    import numpy as np
    from onnx import numpy_helper

    from ..model.io import model_hash

    floats = [numpy_helper.to_array(t) for t in model.graph.initializer
              if t.data_type in (1, 10, 11, 16)]  # float, float16, double, bfloat16
    facts = {"path": None if path is None else str(path), "sha256": model_hash(model),
             "file_bytes": model.ByteSize(), "params": structure.n_params,
             "flops": structure.flops,
             "nonzero_params": int(sum(np.count_nonzero(w) for w in floats))}
    if path is not None and os.path.isfile(str(path)):
        facts["file_bytes"] = os.path.getsize(str(path))
    return facts


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
    """The text section of ``prune``."""
    alloc = info["allocation"]
    rows = [{"layer": name, "weights": alloc["n_params"][name], "kept": alloc["n_kept"][name],
             "sparsity": info["layer_sparsity"][name]} for name in alloc["layers"]]
    title = (f"{alloc['rule']} at S = {info['sparsity_target']:g}, repair "
             f"{info['repair']['method']}" if not info.get("no_op") else
             f"S = {info['sparsity_target']:g}: NO-OP")
    lines = [f"== Unstructured pruning (docs/METHODS.md §C), {title} ==",
             render_table(rows).rstrip()]
    if info.get("no_op"):
        lines.append(f"NO-OP: {info['no_op']}; the emitted model is the source model "
                     "(nothing pruned, no repair ran)")
    lines += _budget_lines(info) + _ls_lines(info.get("repair")) + _measure_lines(info)
    return "\n".join(lines + [f"note: {n}" for n in info["notes"] if not n.startswith("no-op")]
                     ) + "\n"


def _ls_lines(repair: dict | None) -> list[str]:
    """Per refitted layer of an ls repair: the relative output error on the calibration
    data before (masked weights) and after the refit (docs/METHODS.md §E1)."""
    if not repair or not repair.get("ls"):
        return []
    rows = [{"layer": k, "solver": v["solver"], "err_before": v["error_before"],
             "err_after": v["error_after"]} for k, v in repair["layers"].items()]
    title = ("LS reconstruction: relative output error |Y - Y_dense| / |Y_dense| per layer "
             "(calibration data, upstream already repaired)")
    return [render_table(rows, title=title).rstrip()]


def _budget_lines(info: dict) -> list[str]:
    b = info["budget"]
    line = (f"pruned {info['n_pruned']:,} of the model's {info['n_weights']:,} conv/linear "
            f"weights ({100 * info['sparsity_achieved']:.3f} %) -> {info['emitted']['path']} "
            "(+ sidecar .json)")
    if not b["unsupported"]:
        return [line]
    return [line, f"  {b['n_supported']:,} of them in the prunable layers (sparsity "
                  f"{100 * info['n_pruned'] / b['n_supported']:.3f} % there); not prunable: "
                  + ", ".join(f"{u['layer']} ({u['n_weights']:,})"
                              for u in b["unsupported"][:5])]


def _measure_lines(info: dict) -> list[str]:
    from .prune_channels_text import latency_setting

    agr, cmp_, acc = info["agreement"], info["comparison"], info["accuracy"]
    lat, st, src, em = info["latency_ms"], info["storage"], info["source"], info["emitted"]
    lines = [f"top-1 agreement with the dense model: {100 * agr['top1_agreement']:.2f} % on "
             f"{agr['n_images']} calibration images; max |logit diff| "
             f"{cmp_['max_abs_logit_diff']:.4g} on {cmp_['n_samples']} {cmp_['data']} samples"]
    if acc.get("emitted"):
        lines.append(f"top-1 on eval data: source {100 * acc['source']['accuracy']:.2f} %, "
                     f"pruned {100 * acc['emitted']['accuracy']:.2f} %")
    checks = info["checks"]
    checker = "full" if "full_checker" in checks else "structural"
    stored = f"{st['format']} storage" + (f", {len(st['sparse_initializers'])} sparse "
                                          "initializers" if st["format"] != "dense" else "")
    lines += [f"checks: {checker} ONNX checker passed, reload in ONNX Runtime "
              f"{checks['onnxruntime_load']}, max |output diff| after reload "
              f"{checks['max_abs_output_diff']:.3g}",
              f"size: source {src['file_bytes']:,} B, emitted {em['file_bytes']:,} B on disk "
              f"({stored}); nonzero parameters {src['nonzero_params']:,} -> "
              f"{em['nonzero_params']:,}",
              f"CPU latency ms: source b=1 {lat['source']['1']:.3f}, b=32 "
              f"{lat['source']['32']:.3f}; pruned b=1 {lat['emitted']['1']:.3f}, b=32 "
              f"{lat['emitted']['32']:.3f}{latency_setting(lat)}"]
    return lines
