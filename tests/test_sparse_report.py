"""METHODS §C verbs as a library: grids, RR report, emitted pruned models, sweeps, bands."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from corpus import conv_bn_folded, residual_block, run_ort
from exports import digits_mlp

from onnxdiag.commands.base import ReportTarget, Runtime
from onnxdiag.commands.prune import PruneOptions, prune_report_sparse
from onnxdiag.commands.pruning import PrunerOptions
from onnxdiag.commands.rr import RROptions, repairability_section, rr_report
from onnxdiag.commands.sweep import SweepOptions, sweep_report
from onnxdiag.errors import OnnxDiagError
from onnxdiag.graph import analyze_structure
from onnxdiag.model.io import file_hash, load_model, model_hash
from onnxdiag.sparsity import (
    METHODS,
    RULES,
    allocate_sparsity,
    describe_layers,
    find_prunable,
    make_masks,
    read_weights,
    repair_model,
)
from onnxdiag.sparsity.grid import parse_choices, parse_sparsity_grid
from onnxdiag.sparsity.sweep import (
    SweepCell,
    ranges,
    transition_summary,
    winners,
)

QUIET = dict(report=ReportTarget(write=False), runtime=Runtime(progress=False))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A residual corpus model on disk with 48 calibration and 40 labelled eval images."""
    d = tmp_path_factory.mktemp("sparse")
    rng = np.random.default_rng(0)
    paths = {}
    for name, build in (("res", residual_block), ("folded", conv_bn_folded)):
        paths[name] = d / f"{name}.onnx"
        onnx.save(build(), paths[name])
    np.savez(d / "calib.npz", x=rng.standard_normal((48, 3, 8, 8)).astype(np.float32))
    np.savez(d / "eval.npz", x=rng.standard_normal((40, 3, 8, 8)).astype(np.float32),
             labels=rng.integers(0, 5, 40))
    paths.update(calib=d / "calib.npz", eval=d / "eval.npz", dir=d)
    return paths


def _logits(model, path):
    x = np.load(path)["x"]
    return run_ort(model, {"x": x})["logits"]


# -- grids and choices ----------------------------------------------------------------------
def test_sparsity_grid_is_exact_decimal_and_inclusive():
    grid = parse_sparsity_grid("0.90:0.97:0.005")
    assert len(grid) == 15 and grid[0] == 0.9 and grid[-1] == 0.97
    assert grid[7] == 0.935  # no float drift: 0.90 + 7 * 0.005 prints as 0.935
    assert parse_sparsity_grid("0.95,0.5:0.7:0.1,0.5") == (0.5, 0.6, 0.7, 0.95)
    assert parse_sparsity_grid(0.9) == (0.9,)


@pytest.mark.parametrize("spec, fragment", [
    ("0.9:0.97", "start:stop:step"), ("0.97:0.9:0.01", "stop >= start"),
    ("0.9,abc", "not a number"), ("1.0", "outside [0, 1)"), ("0:0.9:0.00001", "at most"),
    ("0.9:0.95:0", "step > 0"),
])
def test_sparsity_grid_errors(spec, fragment):
    with pytest.raises(OnnxDiagError, match=re.escape(fragment)):
        parse_sparsity_grid(spec)


def test_choices_all_and_unknown():
    assert parse_choices("all", RULES, "allocation") == list(RULES)
    assert parse_choices("cr+bn, bn", METHODS, "repair") == ["cr+bn", "bn"]
    with pytest.raises(OnnxDiagError, match="Unknown repair 'crbn'"):
        parse_choices("cr+bn,crbn", METHODS, "repair")


def test_ranges_and_winners():
    grid = [0.1, 0.2, 0.3, 0.4, 0.5]
    assert ranges([0.1, 0.2, 0.4], grid) == [(0.1, 0.2), (0.4, 0.4)]
    cells = [SweepCell(0.1, "erk", "bn", accuracy=0.5), SweepCell(0.1, "rr", "bn", accuracy=0.6),
             SweepCell(0.2, "erk", "bn", accuracy=0.4), SweepCell(0.2, "rr", "bn", accuracy=0.4),
             SweepCell(0.3, "rr", "bn", error="cannot")]
    assert winners(cells, "bn", "accuracy") == {0.1: ["rr"], 0.2: ["erk", "rr"]}


def test_transition_summary_cts_only_with_both_repairs():
    cells = [SweepCell(S, "rr", m, agreement=a)
             for S, a_crbn, a_bn in [(0.1, 1.0, 1.0), (0.2, 0.8, 0.6), (0.3, 0.4, 0.4)]
             for m, a in (("cr+bn", a_crbn), ("bn", a_bn))]
    both = transition_summary(cells, "rr", ["cr+bn", "bn"])
    assert both["band"]["start"] == pytest.approx(0.15) and both["band"]["end"] == \
        pytest.approx(0.275)
    np.testing.assert_allclose(both["cts"]["values"], [0.0, 0.5, 0.0], atol=1e-7)
    assert both["cts_band"]["start"] == both["cts_band"]["end"] == 0.2
    only = transition_summary(cells, "rr", ["bn"])
    assert only["repair"] == "bn" and only["cts"] is None


# -- rr ---------------------------------------------------------------------------------------
def test_rr_report_curves_table_csv_and_band(files, tmp_path):
    out = tmp_path / "rr"
    res = rr_report(str(files["res"]), data=str(files["calib"]),
                    options=RROptions(band_sparsity="0.3,0.6,0.9",
                                      pruner=PrunerOptions(rr_images=16)),
                    report=ReportTarget(out), runtime=Runtime(progress=False))
    sec = res.report["repairability"]
    model = load_model(files["res"])
    names = [la.node_name for la in find_prunable(analyze_structure(model))]
    assert sec["curves"]["layers"] == tuple(names) or list(sec["curves"]["layers"]) == names
    rr = np.array(sec["curves"]["rr"])
    assert rr.shape == (len(names), 28) and np.allclose(rr[:, 0], 1.0)  # RR(l, 0) = 1
    assert np.allclose(np.array(sec["curves"]["d_raw"])[:, 0], 0.0)
    params = res.report["metadata"]["parameters"]
    assert sec["curves"]["positions"] == 16 == params["pruner"]["rr_positions"]
    csv_lines = (out / "rr_curves.csv").read_text().strip().splitlines()
    assert csv_lines[0] == "layer,sparsity,d_raw,d_repair,rr" and len(csv_lines) == 1 + rr.size
    tr = sec["transition"]
    assert [c["sparsity"] for c in tr["cells"]] == [0.3, 0.3, 0.6, 0.6, 0.9, 0.9]
    assert tr["cts"] is not None and "predicted transition band" in res.text
    assert {"report.json", "report.txt", "transition.csv"} <= {p.name for p in out.iterdir()}


def test_rr_report_validates_before_work(files, tmp_path):
    with pytest.raises(OnnxDiagError, match="keep_dense|--keep-dense"):
        rr_report(str(files["res"]), data=str(files["calib"]),
                  options=RROptions(pruner=PrunerOptions(keep_dense=("nope",))), **QUIET)
    with pytest.raises(OnnxDiagError, match="outside"):
        rr_report(str(files["res"]), data=str(files["calib"]),
                  options=RROptions(band_sparsity="2"), **QUIET)
    with pytest.raises(OnnxDiagError, match="positive integer or 'all'"):
        rr_report(str(files["res"]), data=str(files["calib"]),
                  options=RROptions(band_sparsity="none",
                                    pruner=PrunerOptions(rr_positions=-2)), **QUIET)


# -- prune ------------------------------------------------------------------------------------
def test_prune_emits_a_checked_reloadable_model_with_sidecar(files, tmp_path):
    before = file_hash(files["res"])
    out = tmp_path / "pruned.onnx"
    res = prune_report_sparse(
        str(files["res"]), output=out, data=str(files["calib"]), eval_data=str(files["eval"]),
        options=PruneOptions(sparsity=0.8, allocation="rr", repair="cr+bn",
                             pruner=PrunerOptions(keep_dense=("head",), rr_images=16)),
        **QUIET)
    assert file_hash(files["res"]) == before  # the input is never modified
    emitted = onnx.load(out)
    onnx.checker.check_model(emitted, full_check=True)
    side = json.loads((out.parent / "pruned.onnx.json").read_text())
    assert side["source"]["sha256"] == model_hash(load_model(files["res"]))
    assert side["emitted"]["sha256"] == model_hash(emitted)
    assert side["n_pruned"] == int(0.8 * side["n_weights"])
    assert side["layer_sparsity"]["head"] == 0.0 and side["keep_dense"] == ["head"]
    assert side["repair"]["method"] == "cr+bn" and side["repair"]["bns"]
    assert side["allocation"]["prior"]["rule"] == "erk"
    assert 0 <= side["agreement"]["top1_agreement"] <= 1
    assert side["accuracy"]["emitted"]["n_samples"] == 40 and side["latency_ms"]["emitted"]["1"] > 0
    # the file's weights are zero exactly where the allocation says, per layer
    init = {t.name: onnx.numpy_helper.to_array(t) for t in emitted.graph.initializer}
    w = init[[n for n in emitted.graph.node if n.name == "c4"][0].input[1]]
    assert np.mean(w == 0) == pytest.approx(side["layer_sparsity"]["c4"])
    # the sidecar's agreement is the file's, recomputed with a plain ORT session
    agr = np.mean(_logits(emitted, files["calib"]).argmax(1) ==
                  _logits(load_model(files["res"]), files["calib"]).argmax(1))
    assert side["agreement"]["top1_agreement"] == pytest.approx(agr)
    assert "agreement with the dense model" in res.text


def test_prune_comparison_on_calibration_data_is_that_of_the_two_files(files, tmp_path):
    """Without evaluation data the comparison is read off the logits the pruner has at hand
    (the dense model's, and the pruned model's of the agreement): it equals a plain ONNX
    Runtime run of the source and of the emitted file over every calibration image, and
    compare_models streaming the same images batch by batch."""
    from onnxdiag.data.source import open_data
    from onnxdiag.evaluate import compare_logits, compare_models, make_head_runner
    from onnxdiag.model.io import get_input_specs

    out = tmp_path / "p.onnx"
    side = prune_report_sparse(str(files["res"]), output=out, data=str(files["calib"]),
                               options=PruneOptions(sparsity=0.8, allocation="uniform"),
                               **QUIET).report["prune"]
    cmp_ = side["comparison"]
    ua, ub = _logits(load_model(files["res"]), files["calib"]), _logits(onnx.load(out),
                                                                       files["calib"])
    assert cmp_["data"] == "calibration" and cmp_["n_samples"] == len(ua)
    assert cmp_["max_abs_logit_diff"] == pytest.approx(np.abs(ua - ub).max(), abs=1e-6)
    assert cmp_["max_abs_logit_diff"] > 0.01  # 80 % pruned: the logits did move
    assert cmp_["top1_agreement"] == pytest.approx(np.mean(ua.argmax(1) == ub.argmax(1)))
    assert cmp_["top1_agreement"] == side["agreement"]["top1_agreement"]
    # the streaming comparison over batches of 5 gives the same record as the whole arrays
    source = load_model(files["res"])
    head = analyze_structure(source).head
    x = np.load(files["calib"])["x"]
    batches = open_data({"x": x}, get_input_specs(source), batch_size=5)
    streamed = compare_models(make_head_runner(source, head),
                              make_head_runner(onnx.load(out), head), batches, head,
                              max_batches=len(x))
    whole = compare_logits(ua, ub)
    assert streamed["n_samples"] == whole["n_samples"] == len(x)
    for key in ("max_abs_logit_diff", "max_rel_logit_diff", "top1_agreement"):
        assert streamed[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key


def test_evaluate_pair_is_both_evaluations_and_the_comparison(files, tmp_path):
    """evaluate_pair runs each model once over labelled data: its evaluations equal
    evaluate_model's and its comparison compare_models' over the first max_batches
    batches (here 3 of 8); the prune sidecar with --eval-data holds what it gives."""
    from onnxdiag.data.source import open_data
    from onnxdiag.evaluate import compare_models, evaluate_model, evaluate_pair, make_head_runner
    from onnxdiag.model.io import get_input_specs

    out = tmp_path / "p.onnx"
    side = prune_report_sparse(str(files["res"]), output=out, data=str(files["calib"]),
                               eval_data=str(files["eval"]),
                               options=PruneOptions(sparsity=0.8, allocation="uniform"),
                               **QUIET).report["prune"]
    source, emitted = load_model(files["res"]), onnx.load(out)
    head = analyze_structure(source).head
    ev = np.load(files["eval"])
    data = open_data({"x": ev["x"], "labels": ev["labels"]}, get_input_specs(source),
                     batch_size=5)
    runners = [make_head_runner(m, head) for m in (source, emitted)]
    pair = evaluate_pair(*runners, head, data, max_batches=3)
    for got, runner in zip(pair[:2], runners):
        want = evaluate_model(runner, head, data)
        assert (got.n_samples, got.accuracy) == (want.n_samples, want.accuracy) == (
            len(ev["x"]), want.accuracy)
        assert got.loss == pytest.approx(want.loss, rel=1e-12)
    assert pair[2] == compare_models(*runners, data, head, max_batches=3)
    assert pair[2]["n_samples"] == 15
    full = evaluate_pair(*runners, head, open_data(
        {"x": ev["x"], "labels": ev["labels"]}, get_input_specs(source), batch_size=64))
    assert side["accuracy"]["source"] == full[0].to_dict()
    assert side["accuracy"]["emitted"] == full[1].to_dict()
    for key in ("n_samples", "max_abs_logit_diff", "top1_agreement"):
        assert side["comparison"][key] == pytest.approx(full[2][key], abs=1e-6), key
    assert side["comparison"]["data"] == "evaluation"


@pytest.mark.parametrize("method", METHODS)
def test_sparsity_zero_with_any_repair_emits_the_dense_outputs(files, tmp_path, method):
    out = tmp_path / f"{method}.onnx"
    prune_report_sparse(str(files["res"]), output=out, data=str(files["calib"]),
                        options=PruneOptions(sparsity=0.0, allocation="erk", repair=method),
                        **QUIET)
    dense = _logits(load_model(files["res"]), files["calib"])
    np.testing.assert_allclose(_logits(onnx.load(out), files["calib"]), dense, atol=1e-5)
    assert json.loads((tmp_path / f"{method}.onnx.json").read_text())[
        "agreement"]["top1_agreement"] == 1.0


def test_sparse_initializers_are_smaller_and_equal(files, tmp_path):
    common = dict(sparsity=0.9, allocation="uniform", repair="cr+bn")
    prune_report_sparse(str(files["folded"]), output=tmp_path / "d.onnx",
                        data=str(files["calib"]), options=PruneOptions(**common), **QUIET)
    prune_report_sparse(str(files["folded"]), output=tmp_path / "s.onnx",
                        data=str(files["calib"]),
                        options=PruneOptions(sparse_initializers=True, **common), **QUIET)
    dense, sparse = onnx.load(tmp_path / "d.onnx"), onnx.load(tmp_path / "s.onnx")
    assert len(sparse.graph.sparse_initializer) >= 1 and not dense.graph.sparse_initializer
    assert (tmp_path / "s.onnx").stat().st_size < (tmp_path / "d.onnx").stat().st_size
    onnx.checker.check_model(sparse)
    x = {"x": np.load(files["calib"])["x"]}
    import onnxruntime as ort

    runs = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
            .run(None, x)[0] for m in (dense, sparse)]
    np.testing.assert_allclose(runs[0], runs[1], atol=1e-5)
    side = json.loads((tmp_path / "s.onnx.json").read_text())
    assert side["storage"]["format"] == "sparse_initializer"


def test_prune_refuses_bad_outputs_before_any_work(files, tmp_path):
    with pytest.raises(OnnxDiagError, match="never overwrites an input"):
        prune_report_sparse(str(files["res"]), output=files["res"], data=str(files["calib"]),
                            options=PruneOptions(sparsity=0.5), **QUIET)
    existing = tmp_path / "x.onnx"
    existing.write_bytes(b"keep")
    with pytest.raises(OnnxDiagError, match="already exists.*--overwrite"):
        prune_report_sparse(str(files["res"]), output=existing, data=str(files["calib"]),
                            options=PruneOptions(sparsity=0.5), **QUIET)
    assert existing.read_bytes() == b"keep"
    with pytest.raises(OnnxDiagError, match="Unknown allocation"):
        prune_report_sparse(str(files["res"]), output=tmp_path / "y.onnx",
                            data=str(files["calib"]),
                            options=PruneOptions(sparsity=0.5, allocation="magic"),
                            report=ReportTarget(write=False))
    assert not (tmp_path / "y.onnx").exists()


# -- sweep ------------------------------------------------------------------------------------
def test_sweep_cells_agree_with_an_independent_prune_and_run(files, tmp_path):
    res = sweep_report(str(files["res"]), data=str(files["calib"]), eval_data=str(files["eval"]),
                       options=SweepOptions(sparsity="0,0.5,0.85", allocations="erk,lamp,rr",
                                            repairs="cr+bn,bn,none",
                                            pruner=PrunerOptions(rr_images=16)),
                       report=ReportTarget(tmp_path / "sw"), runtime=Runtime(progress=False))
    sec = res.report["sweep"]
    assert len(sec["cells"]) == 3 * 3 * 3 and sec["metric"] == "accuracy"
    at0 = [c for c in sec["cells"] if c["sparsity"] == 0.0]
    assert all(c["agreement"] == 1.0 and c["accuracy"] == sec["dense"]["accuracy"] for c in at0)
    # oracle: the LAMP / bn cell at 0.85 recomputed from the library pieces and plain ORT
    m = load_model(files["res"])
    st = analyze_structure(m)
    layers = find_prunable(st)
    w = read_weights(m, layers)
    alloc = allocate_sparsity("lamp", describe_layers(m, layers), 0.85, weights=w)
    x = np.load(files["calib"])["x"]
    repaired, _ = repair_model(m, st, make_masks(alloc, w), [{"x": x}], method="bn")
    agr = np.mean(_logits(repaired, files["calib"]).argmax(1) ==
                  _logits(m, files["calib"]).argmax(1))
    cell = [c for c in sec["cells"] if (c["sparsity"], c["allocation"], c["repair"]) ==
            (0.85, "lamp", "bn")][0]
    assert cell["agreement"] == pytest.approx(agr)
    ev = np.load(files["eval"])
    acc = np.mean(run_ort(repaired, {"x": ev["x"]})["logits"].argmax(1) == ev["labels"])
    assert cell["accuracy"] == pytest.approx(acc)
    assert set(sec["transitions"]) == {"erk", "lamp", "rr"} and "rr-erk" in sec["rr_versus"]
    assert "== top-1 % after repair cr+bn" in res.text and "Where each allocation wins" in res.text
    assert (tmp_path / "sw" / "sweep.csv").read_text().count("\n") == 28


def test_sweep_reports_a_rule_that_cannot_meet_S_and_goes_on(files):
    res = sweep_report(str(files["res"]), data=str(files["calib"]),
                       options=SweepOptions(sparsity="0.5,0.999", allocations="lamp,uniform",
                                            repairs="none"), **QUIET)
    cells = res.report["sweep"]["cells"]
    assert [c["error"] is None for c in cells] == [True, True, False, True]
    assert "skipped cells" in res.text and res.report["sweep"]["metric"] == "agreement"


# -- analyze section --------------------------------------------------------------------------
def test_repairability_section_rows_and_suggested_allocation(files):
    from onnxdiag.data.source import open_data
    from onnxdiag.model.io import get_input_specs

    m = load_model(files["res"])
    src = open_data(str(files["calib"]), get_input_specs(m))
    section, text = repairability_section(m, src, n_images=16, transition_grid=(0.5, 0.9))
    names = [la.node_name for la in find_prunable(analyze_structure(m))]
    assert [r["layer"] for r in section["rows"]] == names
    alloc = section["allocation"]
    assert alloc["rule"] == "rr" and alloc["n_pruned"] == int(0.9 * alloc["n_weights"])
    assert section["transition"]["band"] is not None and "rr s@0.9" in text
    assert section["n_images"] == 16


# -- the whole model's budget (issue 15: linear layers other than the head) ------------------
@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    return digits_mlp(tmp_path_factory.mktemp("mlp"))


def test_prune_of_the_mlp_removes_half_of_all_its_weights(mlp, tmp_path):
    """Issue 16: the hidden MatMul is prunable now, so S = 0.5 of the model's 1,184
    weights (MatMul 1,024 + head 160) is 592 zeros over both, counted in the file."""
    model, data = mlp
    out = tmp_path / "p.onnx"
    info = prune_report_sparse(str(model), output=out, data=str(data),
                               options=PruneOptions(sparsity=0.5, allocation="erk"),
                               **QUIET).report["prune"]
    assert (info["n_weights"], info["n_pruned"]) == (1184, 592)
    assert info["budget"]["n_supported"] == 1184 and info["budget"]["unsupported"] == []
    source = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(model).graph.initializer}
    emitted = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer}
    zeros = {k: int(((emitted[k] == 0) & (source[k] != 0)).sum())
             for k in ("coefficient", "coefficient1")}
    assert sum(zeros.values()) == 592 and min(zeros.values()) > 0
    assert set(info["layer_sparsity"]) == {"MatMul", "MatMul1"}


def test_prune_sparsity_zero_on_the_mlp_is_a_reported_no_op(mlp, tmp_path):
    model, data = mlp
    out = tmp_path / "p.onnx"
    res = prune_report_sparse(str(model), output=out, data=str(data), eval_data=str(data),
                              options=PruneOptions(sparsity=0.0), **QUIET)
    info = res.report["prune"]
    assert info["no_op"] == "sparsity 0 removes no weight" and info["repair"] is None
    assert info["n_pruned"] == 0 and info["n_weights"] == 1184
    assert info["budget"]["n_supported"] == 1184  # the hidden MatMul too (issue 16)
    assert info["budget"]["unsupported"] == []
    assert "NO-OP: sparsity 0 removes no weight" in res.text
    x = np.load(data)["X"]
    emitted = run_ort(onnx.load(out), {"X": x})["probabilities"]
    np.testing.assert_allclose(emitted, run_ort(onnx.load(model), {"X": x})["probabilities"],
                               atol=1e-6)
    assert info["accuracy"]["emitted"] == info["accuracy"]["source"]


def test_prune_a_rounded_down_budget_says_why_nothing_was_removed(files, tmp_path):
    res = prune_report_sparse(str(files["res"]), output=tmp_path / "p.onnx",
                              data=str(files["calib"]),
                              options=PruneOptions(sparsity=0.0001, allocation="erk"), **QUIET)
    info = res.report["prune"]
    assert info["n_pruned"] == 0 and "rounds down to 0 weights" in info["no_op"]
    assert "NO-OP" in res.text


def test_prune_counts_every_layer_and_reaches_s_on_the_supported_ones(tmp_path):
    """Conv c0 (216) + ConvTranspose 'up' (128, not prunable) + head (20): S = 0.5 of all
    364 weights is 182, placed on c0 and the head; 'up' is untouched."""
    from corpus import conv_transpose

    src = tmp_path / "ct.onnx"
    onnx.save(conv_transpose(), src)
    calib = tmp_path / "c.npz"
    np.savez(calib, x=np.random.default_rng(0).standard_normal((16, 3, 8, 8)).astype(np.float32))
    out = tmp_path / "p.onnx"
    info = prune_report_sparse(str(src), output=out, data=str(calib),
                               options=PruneOptions(sparsity=0.5, allocation="uniform"),
                               **QUIET).report["prune"]
    assert (info["n_weights"], info["n_pruned"], info["sparsity_achieved"]) == (364, 182, 0.5)
    assert info["budget"]["n_supported"] == 236 and info["allocation"]["n_pruned"] == 182
    assert info["budget"]["unsupported"][0]["layer"] == "up"
    init = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer}
    assert int((init["c0.weight"] == 0).sum() + (init["head.weight"] == 0).sum()) == 182
    np.testing.assert_array_equal(init["up.weight"], onnx.numpy_helper.to_array(
        [t for t in conv_transpose().graph.initializer if t.name == "up.weight"][0]))
    with pytest.raises(OnnxDiagError, match=r"hold 236.*at most 0\.648"):
        prune_report_sparse(str(src), output=tmp_path / "q.onnx", data=str(calib),
                            options=PruneOptions(sparsity=0.7, allocation="uniform"), **QUIET)


def test_a_cnn_counts_only_its_own_layers(files, tmp_path):
    info = prune_report_sparse(str(files["res"]), output=tmp_path / "p.onnx",
                               data=str(files["calib"]),
                               options=PruneOptions(sparsity=0.5, allocation="erk"),
                               **QUIET).report["prune"]
    m = load_model(files["res"])
    every = sum(int(np.prod(la.weight_shape)) for la in analyze_structure(m).layers)
    assert info["n_weights"] == every == info["budget"]["n_supported"]
    assert info["budget"]["unsupported"] == [] and info["sparsity_achieved"] == \
        pytest.approx(0.5, abs=1 / every)
    assert info["allocation"]["target"] == 0.5  # S itself: no rescaling without others


def test_count_sparsity_is_the_shortest_exact_decimal():
    from fractions import Fraction

    from onnxdiag.sparsity.budget import count_sparsity, prune_count

    for n in range(1, 80):
        for k in range(n + 1):
            s = count_sparsity(k, n)
            assert prune_count(n, s) == k
            digits = len(str(Fraction(str(s)).denominator)) - 1
            for shorter in range(digits):  # no decimal with fewer digits prunes k of n
                scale = 10 ** shorter
                assert not any(prune_count(n, i / scale) == k for i in range(scale + 1))


def test_prune_report_and_sidecar_share_the_vocabulary(files, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")  # noqa: F841
    from onnxdiag.report.schema import validate_report

    out = tmp_path / "p.onnx"
    res = prune_report_sparse(str(files["res"]), output=out, data=str(files["calib"]),
                              eval_data=str(files["eval"]),
                              options=PruneOptions(sparsity=0.6, allocation="lamp"),
                              report=ReportTarget(tmp_path / "rep"),
                              runtime=Runtime(progress=False))
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    validate_report(report)
    broken = json.loads(json.dumps(report))
    del broken["prune"]["latency_ms"]
    with pytest.raises(OnnxDiagError, match="latency_ms"):
        validate_report(broken)
    side = json.loads((tmp_path / "p.onnx.json").read_text())
    for key in ("source", "emitted", "checks", "comparison", "latency_ms", "accuracy", "notes"):
        assert side[key] == report["prune"][key], key
    assert side["emitted"]["path"] == str(out) and side["emitted"]["file_bytes"] == \
        out.stat().st_size
    assert side["source"]["file_bytes"] == files["res"].stat().st_size
    assert side["emitted"]["params"] == side["source"]["params"]  # zeros stay stored
    assert side["emitted"]["nonzero_params"] == side["source"]["nonzero_params"] - \
        side["n_pruned"]
    assert side["comparison"]["data"] == "evaluation" and side["comparison"]["n_samples"] == 40
    assert side["checks"]["full_checker"] == "passed"
    assert side["checks"]["max_abs_output_diff"] == 0.0
    lat = side["latency_ms"]  # source and emitted interleaved, rounds within the budget
    assert set(lat) == {"source", "emitted", "speedup", "speedup_iqr", "rounds", "rounds_run",
                        "budget_s", "threads", "providers"}
    assert lat["budget_s"] == 10.0 and lat["rounds"] == 21 and lat["threads"] is None
    assert set(lat["rounds_run"]) == {"1", "32"} and all(5 <= n <= 21 for n in
                                                         lat["rounds_run"].values())
    assert "interleaved rounds)" in res.text.split("CPU latency ms:")[1].splitlines()[0]
    assert side["accuracy"]["before_recovery"] is None
    assert report["metadata"]["data"].keys() == {"calibration", "evaluation"}
    assert report["metadata"]["parameters"]["pruner"]["rr_positions"] == 16
    assert "checks: full ONNX checker passed" in res.text
