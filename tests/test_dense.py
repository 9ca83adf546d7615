"""Dense prediction (docs/METHODS.md §A4): per-position heads, label maps, mean IoU.

Oracles: the per-pixel closed-form head gradient against torch autograd (1×1 conv +
cross-entropy with ignore_index) and against central differences of the loss; readouts
and mean IoU of a real ONNX Runtime pass against the same formulas on explicitly
filtered rows; label maps from an npz and from an images/ + masks/ folder agree.
"""

from __future__ import annotations

import types

import corpus
import corpus_dense
import numpy as np
import pytest

from onnxdiag.data.request import DataRequest
from onnxdiag.errors import DataError, HeadNotFoundError
from onnxdiag.evaluate import evaluate
from onnxdiag.graph import analyze_structure, find_head
from onnxdiag.graph.verify import find_verified_head
from onnxdiag.model.io import get_input_specs, load_model
from onnxdiag.selection.dense import dense_batch, labels_on_grid
from onnxdiag.selection.probe import probe_model
from onnxdiag.selection.readouts import (
    ReadoutAccumulator,
    compute_readouts,
    head_gradient_matrices,
    log_softmax,
)

CONV = types.SimpleNamespace(op_type="Conv", node_name="head")


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((3, 4, 5, 6))
    W, b = rng.standard_normal((5, 4)), rng.standard_normal(5)
    y = rng.integers(0, 5, (3, 5, 6))
    y[rng.random(y.shape) < 0.25] = 255
    u = np.einsum("cd,ndhw->nchw", W, z) + b[None, :, None, None]
    return z, W, b, y, u


def _pixel_loss(W, b, z, y):
    """Mean cross-entropy over the pixels whose label is not 255 (brute force, NCHW)."""
    u = np.einsum("cd,ndhw->nchw", W, z) + b[None, :, None, None]
    logp = log_softmax(np.moveaxis(u, 1, -1).reshape(-1, W.shape[0]))
    t = y.reshape(-1)
    keep = t != 255
    return -logp[np.flatnonzero(keep), t[keep]].mean()


def test_per_pixel_gradient_equals_central_differences():
    z, W, b, y, u = _problem()
    rows = dense_batch(z, u, CONV, y)
    assert rows.n_ignored == int((y == 255).sum()) and rows.Z.shape[0] == int((y != 255).sum())
    G, Gb = head_gradient_matrices(rows.Z, rows.U, "labels", labels=rows.labels)
    h = 1e-6
    fd = np.zeros_like(W)
    for idx in np.ndindex(W.shape):
        e = np.zeros_like(W)
        e[idx] = h
        fd[idx] = (_pixel_loss(W + e, b, z, y) - _pixel_loss(W - e, b, z, y)) / (2 * h)
    np.testing.assert_allclose(G, fd, rtol=1e-6, atol=1e-9)
    fdb = [(_pixel_loss(W, b + h * e, z, y) - _pixel_loss(W, b - h * e, z, y)) / (2 * h)
           for e in np.eye(5)]
    np.testing.assert_allclose(Gb, fdb, rtol=1e-6, atol=1e-9)


def test_per_pixel_gradient_equals_torch_autograd():
    torch = pytest.importorskip("torch")
    z, W, b, y, u = _problem(1)
    rows = dense_batch(z, u, CONV, y)
    G, Gb = head_gradient_matrices(rows.Z, rows.U, "labels", labels=rows.labels)
    wt = torch.tensor(W[:, :, None, None], requires_grad=True)
    bt = torch.tensor(b, requires_grad=True)
    logits = torch.nn.functional.conv2d(torch.tensor(z), wt, bt)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(y), ignore_index=255)
    loss.backward()
    np.testing.assert_allclose(G, wt.grad.numpy()[:, :, 0, 0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(Gb, bt.grad.numpy(), rtol=1e-10, atol=1e-12)
    acc = ReadoutAccumulator(W, b, targets="labels")
    for i in range(3):  # streamed image by image: the same readout as one batch
        part = dense_batch(z[i:i + 1], u[i:i + 1], CONV, y[i:i + 1])
        acc.update(part.Z, part.U, part.labels)
    assert acc.result().values["head_grad"] == pytest.approx(np.linalg.norm(G), rel=1e-12)
    assert acc.result().values["loss"] == pytest.approx(loss.item(), rel=1e-12)


def test_labels_on_grid_nearest_centre():
    labels = np.arange(2 * 16 * 16).reshape(2, 16, 16)
    np.testing.assert_array_equal(labels_on_grid(labels, (8, 8)), labels[:, 1::2, 1::2])
    np.testing.assert_array_equal(labels_on_grid(labels, (16, 16)), labels)
    with pytest.raises(DataError, match="one class per sample"):
        labels_on_grid(np.arange(4), (8, 8))


def _seg(tmp_path, softmax=False):
    model = load_model(corpus_dense.seg_conv_head(softmax=softmax))
    x, y = corpus_dense.seg_data()
    return model, x, y


def _filtered_rows(model, head, x, y):
    """The rows a dense probe must use, computed here: ORT features/logits, 255 dropped."""
    out = corpus.run_ort(model, {"x": x}, [head.features, head.logits])
    Z = np.moveaxis(out[head.features].astype(np.float64), 1, -1).reshape(-1, 8)
    U = np.moveaxis(out[head.logits].astype(np.float64), 1, -1).reshape(-1, 5)
    t = y.reshape(-1)
    keep = t != 255
    return Z[keep], U[keep], t[keep]


@pytest.mark.parametrize("softmax", [False, True])
def test_dense_head_found_and_verified(tmp_path, softmax):
    model, x, _ = _seg(tmp_path, softmax)
    head = find_head(model)
    assert (head.node_name, head.features, head.features_reduce, head.dense) == \
        ("head", "feat", "positions", True)
    assert head.relation == ("softmax" if softmax else "identity")
    verified = find_verified_head(model, {"x": x[:4]})
    assert verified.rel_error <= 1e-4 and verified.relation == head.relation


def test_dense_head_through_unlisted_ops_needs_data():
    model = load_model(corpus_dense.seg_transposed_softmax())
    with pytest.raises(HeadNotFoundError):
        find_head(model)
    x, _ = corpus_dense.seg_data(4)
    head = find_verified_head(model, {"x": x})
    assert head.dense and head.relation == "softmax" and head.relation_error <= 1e-4


def test_probe_drops_ignored_rows_and_reports_miou(tmp_path):
    model, x, y = _seg(tmp_path)
    structure = analyze_structure(model)
    specs = get_input_specs(model)
    probe = DataRequest({"x": x, "labels": y}, batch_size=5).open(specs, classes=5)
    result = probe_model(model, structure, probe, eval_source=probe)
    Z, U, t = _filtered_rows(model, structure.head, x, y)
    expect = compute_readouts(Z, U, structure.head.weight, structure.head.bias,
                              targets="labels", labels=t)
    for name, value in expect.values.items():
        if name != "n_params":
            assert result.readouts.values[name] == pytest.approx(value, rel=1e-6), name
    assert result.readouts.n_samples == t.size
    assert result.dense["n_ignored"] == int((y == 255).sum())
    assert result.dense["n_images"] == len(x) and result.dense["grid"] == [8, 8]
    conf = np.zeros((5, 5), np.int64)
    np.add.at(conf, (t, U.argmax(1)), 1)
    tp = np.diag(conf)
    union = conf.sum(0) + conf.sum(1) - tp
    ev = result.evaluation
    assert ev.miou == pytest.approx(np.mean(tp[union > 0] / union[union > 0]), rel=1e-12)
    assert ev.accuracy == pytest.approx(tp.sum() / t.size) and ev.n_rows == t.size
    assert ev.to_dict()["quality"] == "miou"


def test_changing_ignored_pixels_changes_nothing(tmp_path):
    """Rows with the ignore index are left out: any features there, any custom index."""
    model, x, y = _seg(tmp_path)
    structure = analyze_structure(model)
    specs = get_input_specs(model)
    y7 = np.where(y == 255, 7, y)
    a = probe_model(model, structure, DataRequest({"x": x, "labels": y}).open(specs))
    b = probe_model(model, structure, DataRequest({"x": x, "labels": y7}).open(specs),
                    ignore_index=7)
    assert a.readouts.values == b.readouts.values


def test_label_maps_from_an_image_folder_match_the_npz(tmp_path):
    from PIL import Image

    model = load_model(corpus_dense.seg_conv_head())
    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 256, (6, 8, 8, 3), dtype=np.uint8)
    _, maps = corpus_dense.seg_data(6)
    for sub in ("images", "masks"):
        (tmp_path / "seg" / sub).mkdir(parents=True)
    for i in range(6):
        Image.fromarray(pixels[i]).save(tmp_path / "seg" / "images" / f"im{i}.png")
        Image.fromarray(maps[i].astype(np.uint8), mode="L").save(
            tmp_path / "seg" / "masks" / f"im{i}.png")
    specs = get_input_specs(model)
    folder = DataRequest(str(tmp_path / "seg")).open(specs, classes=5)
    np.testing.assert_array_equal(folder.selected_labels, maps)
    x = (pixels.astype(np.float32) / np.float32(255)).transpose(0, 3, 1, 2)
    np.savez(tmp_path / "seg.npz", x=x, labels=maps.astype(np.uint8))
    arrays = DataRequest(str(tmp_path / "seg.npz")).open(specs, classes=5)
    structure = analyze_structure(model)
    a, b = (probe_model(model, structure, s) for s in (folder, arrays))
    assert a.readouts.values == pytest.approx(b.readouts.values, rel=1e-6)
    Image.fromarray(np.zeros((4, 4), np.uint8), mode="L").save(
        tmp_path / "seg" / "masks" / "im0.png")
    with pytest.raises(DataError, match="size"):
        DataRequest(str(tmp_path / "seg")).open(specs)
    (tmp_path / "seg" / "masks" / "im0.png").unlink()
    with pytest.raises(DataError, match="no mask"):
        DataRequest(str(tmp_path / "seg")).open(specs)


def test_label_maps_outside_the_classes_are_one_line_errors():
    model = load_model(corpus_dense.seg_conv_head())
    x, y = corpus_dense.seg_data(4)
    y[2, 3, 4] = 9
    with pytest.raises(DataError, match=r"Label 9 at sample 2, position \(3, 4\)") as err:
        DataRequest({"x": x, "labels": y}).open(get_input_specs(model), classes=5)
    assert "\n" not in str(err.value)


def test_per_sample_labels_with_a_dense_head_and_maps_with_a_classifier():
    model = load_model(corpus_dense.seg_conv_head())
    x, _ = corpus_dense.seg_data(4)
    structure = analyze_structure(model)
    probe = DataRequest({"x": x, "labels": np.arange(4) % 5}).open(get_input_specs(model))
    with pytest.raises(DataError, match="one class per sample"):
        probe_model(model, structure, probe)
    clf = load_model(corpus.conv1x1_before_gap())
    maps = DataRequest({"x": x, "labels": np.zeros((4, 8, 8), np.int64)}).open(
        get_input_specs(clf))
    with pytest.raises(DataError, match="label maps"):
        evaluate(clf, analyze_structure(clf).head, maps)


def test_query_head_rows_are_queries():
    """Detection branch form: (N, queries, D) → MatMul + Add → (N, queries, C) logits."""
    model = load_model(corpus_dense.query_head())
    head = find_head(model)
    assert (head.features, head.logits, head.features_reduce) == ("feat", "logits", "positions")
    named = find_head(model, head="head", features="feat")
    assert named.dense and named.logits == "logits"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 6, 16)).astype(np.float32)
    y = rng.integers(0, 5, (7, 6))  # 0 = background
    y[:, -1] = 255  # unassigned queries
    specs = get_input_specs(model)
    structure = analyze_structure(model, head="head", features="feat")
    result = probe_model(model, structure, DataRequest({"x": x, "labels": y}).open(specs))
    out = corpus.run_ort(model, {"x": x}, ["feat", "logits"])
    keep = y.reshape(-1) != 255
    expect = compute_readouts(out["feat"].reshape(-1, 16)[keep], out["logits"].reshape(-1, 5)[
        keep], head.weight, head.bias, targets="labels", labels=y.reshape(-1)[keep])
    assert result.readouts.values["head_grad"] == pytest.approx(expect.values["head_grad"],
                                                                rel=1e-9)
    assert result.readouts.n_samples == 7 * 5 and result.dense["grid"] == [6]


def test_cli_readouts_and_select_on_a_dense_series(tmp_path):
    """readouts / select / analyze accept a per-position head with label maps; select ranks
    by mean IoU; a per-sample labels file for a dense head is a one-line user error."""
    import json

    import onnx
    from cli_helpers import assert_user_error, run

    x, y = corpus_dense.seg_data(16)
    np.savez(tmp_path / "seg.npz", x=x, labels=y.astype(np.uint8))
    for i in range(4):
        onnx.save(corpus_dense.seg_conv_head(seed=i), tmp_path / f"ckpt_{i}.onnx")
    res = run("select", *(tmp_path / f"ckpt_{i}.onnx" for i in range(4)), "--data",
              tmp_path / "seg.npz", "--eval-data", tmp_path / "seg.npz", "--window", "all",
              "--jobs", 1, "--out", tmp_path / "sel", "--format", "json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    sel = report["selection"]
    assert sel["quality"] == "miou" and len(sel["miou"]) == 4
    best = max(range(4), key=lambda i: sel["miou"][i])
    assert sel["evaluation"]["oracle_overall"]["index"] == best
    assert "mIoU %" in (tmp_path / "sel" / "report.txt").read_text()
    for verb in ("readouts", "analyze"):
        res = run(verb, tmp_path / "ckpt_0.onnx", "--data", tmp_path / "seg.npz",
                  "--eval-data", tmp_path / "seg.npz", "--out", tmp_path / verb,
                  "--format", "json")
        assert res.exit_code == 0, res.output
        out = json.loads(res.stdout)
        assert out["readouts"]["dense"]["n_ignored"] == int((y == 255).sum())
        assert out["readouts"]["evaluation"]["miou"] == pytest.approx(sel["miou"][0])
    assert "skipped" in out["channels"]
    pytest.importorskip("jsonschema")
    from onnxdiag.report.schema import validate_report

    validate_report(report)
    validate_report(out)
    np.save(tmp_path / "per_sample.npy", np.arange(16) % 5)
    assert_user_error(run("readouts", tmp_path / "ckpt_0.onnx", "--data", tmp_path / "seg.npz",
                          "--labels", tmp_path / "per_sample.npy", "--out", tmp_path / "bad"),
                      "Labels are given twice", out=tmp_path / "bad")
    np.savez(tmp_path / "x.npz", x=x)
    assert_user_error(run("readouts", tmp_path / "ckpt_0.onnx", "--data", tmp_path / "x.npz",
                          "--labels", tmp_path / "per_sample.npy", "--out", tmp_path / "bad"),
                      "one class per sample", out=tmp_path / "bad")


def test_cli_detection_branch_named_with_head_and_features(tmp_path):
    """Rows = queries: per-query labels (n, queries), background class 0, unassigned 255."""
    import json

    import onnx
    from cli_helpers import run

    onnx.save(corpus_dense.query_head(), tmp_path / "det.onnx")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((10, 6, 16)).astype(np.float32)
    y = rng.integers(0, 5, (10, 6))
    y[::2, 0] = 255
    np.savez(tmp_path / "q.npz", x=x, labels=y)
    res = run("readouts", tmp_path / "det.onnx", "--data", tmp_path / "q.npz", "--eval-data",
              tmp_path / "q.npz", "--head", "head", "--features", "feat", "--out",
              tmp_path / "rep", "--format", "json")
    assert res.exit_code == 0, res.output
    ro = json.loads(res.stdout)["readouts"]
    assert ro["dense"]["n_rows"] == 60 - 5 and ro["dense"]["n_ignored"] == 5
    assert ro["readouts"]["n_samples"] == 55 and ro["evaluation"]["n_rows"] == 55


def test_bundled_segmentation_sample(tmp_path):
    """models/seg: the head is found without data as a per-position 1×1 conv, verified on
    the probe, and the readouts run on its label maps (uint8, with ignored fringes)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "models" / "seg"
    model = load_model(root / "model.onnx")
    structure = analyze_structure(model)
    assert (structure.head.node_name, structure.head.dense) == ("/head/Conv", True)
    probe = DataRequest(str(root / "calib.npz"), limit=8).open(get_input_specs(model),
                                                               classes=11)
    result = probe_model(model, structure, probe, eval_source=probe)
    assert result.head_rel_error <= 1e-4 and result.dense["grid"] == [56, 56]
    assert result.dense["n_rows"] + result.dense["n_ignored"] == 8 * 56 * 56
    assert 0 < result.evaluation.miou < 1
