"""METHODS §C on linear layers (§D, issue 16) with real converter exports (tests/exports.py):
RR of a linear layer against the explicit definition run in ONNX Runtime, the whole-model
budget counted in the emitted file, CR matching each output feature's variance."""

from __future__ import annotations

import json
import warnings

import exports
import numpy as np
import onnx
import pytest
from corpus import run_ort

from onnxdiag.graph import analyze_structure
from onnxdiag.model.io import load_model
from onnxdiag.sparsity import (
    RULES,
    allocate_sparsity,
    apply_masks,
    compute_rr_curves,
    describe_layers,
    find_prunable,
    magnitude_mask,
    make_masks,
    read_weights,
    repair_model,
)
from onnxdiag.stats import draw_positions

N_CALIB = 24


def _token_data(rng, n=N_CALIB, tokens=8, vocab=64):
    ids = rng.integers(1, vocab, (n, tokens))
    lengths = rng.integers(2, tokens + 1, n)
    mask = (np.arange(tokens)[None, :] < lengths[:, None]).astype(np.int64)
    return {"input_ids": ids * mask, "attention_mask": mask}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{name: (model path, calibration feeds as 3 batches, the feeds as one dict)}."""
    d = tmp_path_factory.mktemp("linear_exports")
    rng = np.random.default_rng(0)
    out = {}
    for name in ("hf_bert", "hf_gpt2", "torch_vit", "sklearn_mlp"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            export = exports.BUILDERS[name](d)
        if name.startswith("hf_"):
            data = _token_data(rng)
        elif name == "torch_vit":
            data = {"x": rng.standard_normal((N_CALIB, 3, 16, 16)).astype(np.float32)}
        else:
            from sklearn.datasets import load_digits

            data = {"X": load_digits(return_X_y=True)[0][:N_CALIB].astype(np.float32)}
        out[name] = (export.path, _split(data), data)
    path, digits = exports.digits_mlp(d)  # ZipMap off: see the prune test
    data = {"X": np.load(digits)["X"][:N_CALIB]}
    out["digits_mlp"] = (path, _split(data), data)
    return out


def _split(data: dict) -> list[dict]:
    return [{k: v[i:i + 8] for k, v in data.items()} for i in range(0, N_CALIB, 8)]


def _model(built, name):
    path, batches, data = built[name]
    model = load_model(path)
    return model, analyze_structure(model), batches, data


def _rows(y):
    y = np.asarray(y, np.float64)
    return y.reshape(-1, y.shape[-1])


def _explicit(yd, yp):
    """METHODS §C2 D_raw, D_repair from dense / pruned rows (population moments)."""
    sd, sp = yd.std(axis=0), yp.std(axis=0)
    keep = sp > 1e-6 * sd
    yhat = np.where(keep, yd.mean(0) + sd / np.where(keep, sp, 1) * (yp - yp.mean(0)),
                    yd.mean(0))
    var = yd.var(0).sum()
    return ((yd - yp) ** 2).mean(0).sum() / var, ((yd - yhat) ** 2).mean(0).sum() / var


def _outputs(model, data, tensor):
    return run_ort(model, data, [tensor])[tensor]


# -- RR (METHODS §C2) ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["hf_bert", "hf_gpt2", "torch_vit", "sklearn_mlp"])
def test_rr_of_linear_layers_equals_the_definition_run_in_onnx_runtime(built, name):
    """Prune one layer only, run the whole model in ONNX Runtime, and compute D_raw /
    D_repair at that layer's output over every token by brute force."""
    model, structure, batches, data = _model(built, name)
    layers = [la for la in find_prunable(structure) if la.op_type != "Conv"]
    grid = (0.0, 0.3, 0.9)
    curves = compute_rr_curves(model, layers, batches, grid=grid, positions="all")
    weights = read_weights(model, layers)
    for la in (layers[0], layers[len(layers) // 2], layers[-1]):
        yd = _rows(_outputs(model, data, la.output))
        i = curves.get_index(la.node_name)
        assert curves.n_samples[i] == yd.shape[0]  # every token of every input
        for j, s in enumerate(grid):
            pruned = apply_masks(model, {la.node_name: magnitude_mask(weights[la.node_name], s)})
            d_raw, d_rep = _explicit(yd, _rows(_outputs(pruned, data, la.output)))
            assert curves.d_raw[i, j] == pytest.approx(d_raw, rel=2e-3, abs=1e-7)
            assert curves.d_repair[i, j] == pytest.approx(d_rep, rel=2e-3, abs=1e-7)


@pytest.mark.parametrize("name, tokens", [("torch_vit", 17), ("hf_gpt2", 8)])
def test_sampled_tokens_rr_equals_the_definition_on_the_drawn_tokens(built, name, tokens):
    """--rr-positions k: each input's k tokens are draw_positions(T, k, seed, [i]); the
    curves equal the definition over exactly those rows (GPT-2's Gemm reads (N·T, D))."""
    model, structure, batches, data = _model(built, name)
    la = [la for la in find_prunable(structure) if la.op_type != "Conv"][0]
    k, seed = 3, 5
    curves = compute_rr_curves(model, [la], batches, grid=(0.5, 0.9), positions=k, seed=seed)
    picks = draw_positions(tokens, k, seed=seed, sample_indices=np.arange(N_CALIB))
    w = read_weights(model, [la])[la.node_name]

    def picked(m):
        y = _outputs(m, data, la.output).reshape(N_CALIB, tokens, -1)
        return _rows(y[np.arange(N_CALIB)[:, None], picks])

    yd = picked(model)
    assert curves.n_samples == (N_CALIB * k,)
    for j, s in enumerate((0.5, 0.9)):
        d_raw, d_rep = _explicit(yd, picked(apply_masks(model, {
            la.node_name: magnitude_mask(w, s)})))
        assert curves.d_raw[0, j] == pytest.approx(d_raw, rel=2e-3)
        assert curves.d_repair[0, j] == pytest.approx(d_rep, rel=2e-3)


# -- allocations (METHODS §C3) ---------------------------------------------------------------
def test_every_allocation_places_the_exact_budget_on_a_transformer(built):
    model, structure, batches, _ = _model(built, "hf_bert")
    layers = find_prunable(structure)
    assert len(layers) == 14 and all(la.op_type in ("MatMul", "Gemm") for la in layers)
    infos = describe_layers(model, layers)
    weights = read_weights(model, layers)
    curves = compute_rr_curves(model, layers, batches)
    n = sum(i.n_weights for i in infos)
    for rule in RULES:
        alloc = allocate_sparsity(rule, infos, 0.7, rr_curves=curves, weights=weights)
        assert alloc.n_pruned == int(0.7 * n) == sum(alloc.n_params[k] - alloc.n_kept[k]
                                                      for k in alloc.layers)
    erk = allocate_sparsity("erk", infos, 0.7)
    eps = erk.params["epsilon"]
    for la in layers:  # the dense-layer form (n_in + n_out) / (n_in · n_out)
        if la.node_name not in erk.params["capped"]:
            assert erk.params["density"][la.node_name] == pytest.approx(
                eps * (la.n_in + la.n_out) / (la.n_in * la.n_out))


# -- the whole-model budget, emitted (METHODS §C3, §C5) ------------------------------------
def _source_weights(path) -> dict:
    """Every Conv / Gemm / MatMul weight initializer of the file, read without onnxdiag."""
    m = onnx.load(path)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    return {n.input[1]: inits[n.input[1]] for n in m.graph.node
            if n.op_type in ("Conv", "Gemm", "MatMul") and len(n.input) > 1
            and n.input[1] in inits}


@pytest.mark.parametrize("name", ["hf_bert", "hf_gpt2", "torch_vit", "digits_mlp"])
def test_prune_half_removes_half_of_every_prunable_weight(built, name, tmp_path):
    """The skl2onnx MLP is exported with ZipMap off here: the emitted file's reload check
    compares tensor outputs (a ZipMap's sequence of maps is not one)."""
    import onnxruntime as ort

    from onnxdiag.commands.base import ReportTarget, Runtime
    from onnxdiag.commands.prune import PruneOptions, prune_report_sparse

    path, batches, data = built[name]
    calib = tmp_path / "calib.npz"
    np.savez(calib, **data)
    out = tmp_path / "p.onnx"
    info = prune_report_sparse(str(path), output=out, data=str(calib),
                               options=PruneOptions(sparsity=0.5, allocation="erk",
                                                    repair="cr"),
                               runtime=Runtime(progress=False),
                               report=ReportTarget(write=False)).report["prune"]
    source = _source_weights(path)
    n = sum(w.size for w in source.values())
    emitted = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer}
    zeros = sum(int(((emitted[k] == 0) & (w != 0)).sum()) for k, w in source.items())
    assert zeros == n // 2 == info["n_pruned"] and info["n_weights"] == n
    assert info["budget"]["unsupported"] == []
    onnx.checker.check_model(str(out), full_check=True)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    outs = session.run(None, batches[0])
    assert all(np.all(np.isfinite(o)) for o in outs if np.asarray(o).dtype.kind == "f")


# -- CR repair of linear layers (METHODS §C1, §D) -----------------------------------------
def _setup(model, structure, S=0.6):
    layers = find_prunable(structure)
    weights = read_weights(model, layers)
    alloc = allocate_sparsity("uniform", describe_layers(model, layers), S, weights=weights)
    return make_masks(alloc, weights)


def _feature_stats(model, data, tensors):
    out = run_ort(model, data, tensors)
    return {t: (_rows(out[t]).mean(0), _rows(out[t]).var(0, ddof=1)) for t in tensors}


@pytest.mark.parametrize("name", ["hf_bert", "torch_vit", "sklearn_mlp"])
def test_cr_matches_each_output_features_variance_on_the_calibration_data(built, name):
    model, structure, batches, data = _model(built, name)
    masks = _setup(model, structure)
    repaired, record = repair_model(model, structure, masks, batches, method="cr")
    linear = [la for la in structure.layers if la.op_type != "Conv" and not la.is_head]
    assert sorted(record.layers) == sorted(la.node_name for la in structure.layers
                                           if not la.is_head)
    tensors = [la.output for la in linear]
    dense, after = _feature_stats(model, data, tensors), _feature_stats(repaired, data, tensors)
    for la in linear:
        assert record.layers[la.node_name].kind == "scale"
        assert record.layers[la.node_name].n_capped == 0
        np.testing.assert_allclose(after[la.output][1], dense[la.output][1], rtol=2e-4,
                                   atol=1e-9)
    # α sits in the weight's output columns (MatMul / Gemm transB=0) and the bias
    la = linear[0]
    alpha = record.layers[la.node_name].alpha
    w = read_weights(model, [la])[la.node_name] * masks[la.node_name]
    np.testing.assert_allclose(read_weights(repaired, [la])[la.node_name], w * alpha[None, :],
                               rtol=1e-6, atol=1e-7)


def test_layer_cr_matches_the_pooled_variance_of_a_linear_layer(built):
    model, structure, batches, data = _model(built, "torch_vit")
    masks = _setup(model, structure, S=0.8)
    repaired, _ = repair_model(model, structure, masks, batches, method="layer-cr")
    tensors = [la.output for la in structure.layers if la.op_type == "MatMul"]
    dense, after = _feature_stats(model, data, tensors), _feature_stats(repaired, data, tensors)
    for t in tensors:
        assert after[t][1].mean() == pytest.approx(dense[t][1].mean(), rel=2e-4)


def test_bn_part_on_a_layernorm_model_says_it_has_nothing_to_act_on(built):
    model, structure, batches, data = _model(built, "hf_bert")
    masks = _setup(model, structure)
    pruned, record = repair_model(model, structure, masks, batches, method="bn")
    assert record.layers == {} and record.bns == {}
    assert "nothing to act on in 13 linear layer(s)" in record.notes[0]
    assert "--repair cr" in record.notes[0]
    bare, _ = repair_model(model, structure, masks, batches, method="none")
    head = structure.head.logits
    np.testing.assert_array_equal(run_ort(pruned, data, [head])[head],
                                  run_ort(bare, data, [head])[head])
    _, record = repair_model(model, structure, masks, batches, method="cr+bn")
    assert len(record.layers) == 13 and "only its CR part acts" in record.notes[0]
    assert all(r.kind == "scale" for r in record.layers.values())


def test_folded_bn_affine_restores_an_mlps_hidden_mean_and_std(built):
    """No BN and no LayerNorm (skl2onnx MLP): a BN part folds y' = (y − μ^p)·α + μ^d into the
    hidden MatMul and its bias Add; the biased output's mean and std equal the dense ones."""
    model, structure, batches, data = _model(built, "sklearn_mlp")
    masks = _setup(model, structure, S=0.7)
    repaired, record = repair_model(model, structure, masks, batches, method="bn")
    hidden = structure.layers[0]
    assert record.layers[hidden.node_name].kind == "affine" and not record.notes
    post = onnx_node_output(model, hidden.bias_node)
    dense, after = _feature_stats(model, data, [post]), _feature_stats(repaired, data, [post])
    np.testing.assert_allclose(after[post][0], dense[post][0], atol=1e-4)
    np.testing.assert_allclose(np.sqrt(after[post][1]), np.sqrt(dense[post][1]), rtol=2e-4)


def onnx_node_output(model, node_name) -> str:
    return next(n.output[0] for n in model.graph.node if n.name == node_name)


# -- the verbs on transformers and MLPs (issue 16) --------------------------------------------
def _labelled(tmp_path, built, name, classes):
    _, _, data = built[name]
    labels = np.arange(N_CALIB) % classes
    path = tmp_path / f"{name}.npz"
    np.savez(path, **data, labels=labels)
    return path


def test_sweep_runs_every_allocation_with_cr_and_none_on_a_vit(built, tmp_path):
    from onnxdiag.commands.base import ReportTarget, Runtime
    from onnxdiag.commands.sweep import SweepOptions, sweep_report

    data = _labelled(tmp_path, built, "torch_vit", 5)
    res = sweep_report(str(built["torch_vit"][0]), data=str(data), eval_data=str(data),
                       options=SweepOptions(sparsity="0.3,0.8", allocations="all",
                                            repairs="cr,none"),
                       runtime=Runtime(progress=False), report=ReportTarget(write=False))
    section = res.report["sweep"]
    assert section["failed"] == [] and len(section["cells"]) == 2 * len(RULES) * 2
    ran = [c for c in section["cells"] if not c["error"]]
    assert {c["allocation"] for c in ran} == set(RULES)
    assert all(c["accuracy"] is not None and len(c["layer_sparsity"]) == 10 for c in ran)
    assert section["notes"] == []  # cr and none have no BN part
    pytest.importorskip("jsonschema")
    from onnxdiag.report.schema import validate_report

    validate_report(json.loads(json.dumps(res.report, default=str)))


def test_rr_and_the_repairability_section_run_on_bert(built, tmp_path):
    from onnxdiag.commands.base import ReportTarget, Runtime
    from onnxdiag.commands.rr import RROptions, repairability_section, rr_report

    path, batches, data = built["hf_bert"]
    calib = tmp_path / "tok.npz"
    np.savez(calib, **data)
    res = rr_report(str(path), data=str(calib), options=RROptions(band_sparsity="0.5"),
                    runtime=Runtime(progress=False), report=ReportTarget(write=False))
    section = res.report["repairability"]
    assert len(section["layers"]) == 14 and section["curves"]["positions"] == 16
    assert any("LayerNorm" in n for n in section["transition"]["notes"])
    assert "linear-layer tokens" in res.text
    model = load_model(path)
    rep, text = repairability_section(model, batches, n_images=16, transition_grid=(0.5,))
    assert len(rep["rows"]) == 14 and any("nothing to act on" in n for n in rep["notes"])
    pytest.importorskip("jsonschema")
    from onnxdiag.report.schema import validate_report

    validate_report(json.loads(json.dumps(res.report, default=str)))
