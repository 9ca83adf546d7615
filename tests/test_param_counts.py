"""Parameter counts per use and as stored: an initializer read by two layers counts twice
in ``n_params`` (what the graph computes with) and once in ``n_stored``; ``select``'s
``n_params`` baseline uses the per-use count, so a series whose first checkpoint's
exporter shared the weights of equal cloned layers has one count throughout."""

import copy
import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdiag import ReportTarget, SelectOptions, select_report
from onnxdiag.graph import analyze_structure

C, K, CLASSES = 4, 3, 5
CONV = C * C * K * K + C  # one conv's weight + bias
HEAD = CLASSES * C + CLASSES


def two_convs(shared: bool, identity: bool = False, seed: int = 0) -> onnx.ModelProto:
    """x (N, 4, 6, 6) → Conv → Relu → Conv → GAP → Gemm. ``shared``: both convs read one
    weight and one bias initializer (``identity``: the second through Identity nodes, as
    torch's exporter writes it); else each conv has its own (other values)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.5, (C, C, K, K)).astype(np.float32)
    b = rng.normal(0, 0.1, C).astype(np.float32)
    inits = {"c1.w": w, "c1.b": b, "fc.w": rng.normal(size=(CLASSES, C)).astype(np.float32),
             "fc.b": rng.normal(size=CLASSES).astype(np.float32)}
    nodes = []
    if not shared:
        inits.update({"c2.w": w + rng.normal(0, 0.05, w.shape).astype(np.float32),
                      "c2.b": b + 0.01})
        second = ["c2.w", "c2.b"]
    elif identity:
        nodes += [helper.make_node("Identity", ["c1.w"], ["c2.w"], name="copy_w"),
                  helper.make_node("Identity", ["c1.b"], ["c2.b"], name="copy_b")]
        second = ["c2.w", "c2.b"]
    else:
        second = ["c1.w", "c1.b"]
    conv = dict(kernel_shape=[K, K], pads=[1, 1, 1, 1])
    nodes += [helper.make_node("Conv", ["x", "c1.w", "c1.b"], ["y1"], name="c1", **conv),
              helper.make_node("Relu", ["y1"], ["r1"], name="r1"),
              helper.make_node("Conv", ["r1", *second], ["y2"], name="c2", **conv),
              helper.make_node("Relu", ["y2"], ["r2"], name="r2"),
              helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="gap"),
              helper.make_node("Flatten", ["g"], ["z"], name="flatten"),
              helper.make_node("Gemm", ["z", "fc.w", "fc.b"], ["logits"], transB=1,
                               name="fc")]
    graph = helper.make_graph(
        nodes, "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                        ["N", C, 6, 6])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("identity", [False, True])
def test_a_shared_initializer_counts_once_per_layer_reading_it(identity):
    s = analyze_structure(two_convs(shared=True, identity=identity))
    assert s.n_stored == CONV + HEAD
    assert s.n_params == 2 * CONV + HEAD  # per use: 2x the shared conv's weights
    assert s.n_params == s.n_params_layers  # the layers' own counts agree
    d = s.to_dict()
    assert (d["n_params"], d["n_stored"]) == (2 * CONV + HEAD, CONV + HEAD)


def test_distinct_initializers_count_the_same_both_ways():
    shared, distinct = analyze_structure(two_convs(True)), analyze_structure(two_convs(False))
    assert distinct.n_params == distinct.n_stored == shared.n_params


def test_an_unread_initializer_is_stored_but_not_used():
    model = two_convs(shared=False)
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(7, np.float32), "dead"))
    s = analyze_structure(model)
    assert s.n_stored == s.n_params + 7


def _data(path, n=24, seed=0):
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.2, 3.0, (n, 1, 1, 1))  # features that depend on the input
    x = (rng.normal(size=(n, C, 6, 6)) * scale).astype(np.float32)
    np.savez(path, x=x, labels=rng.integers(0, CLASSES, n))
    return path


def test_select_counts_a_series_whose_first_checkpoint_shares_weights_per_use(tmp_path):
    """The issue's series: checkpoint 0 (cloned layers, equal weights, one shared
    initializer) stored 38,282 parameters and the others 139,018; per use they are equal,
    so the n_params baseline is one constant, not a 'correlation' with accuracy."""
    paths = []
    for i in range(4):
        model = two_convs(shared=(i == 0), identity=True, seed=i)
        paths.append(tmp_path / f"ckpt_{i}.onnx")
        onnx.save(model, paths[-1])
    data = _data(tmp_path / "d.npz")
    result = select_report(paths, data=data, eval_data=data,
                           options=SelectOptions(window="all"),
                           report=ReportTarget(write=False))
    rows = result.report["selection"]["checkpoints"]
    assert [r["n_params"] for r in rows] == [2 * CONV + HEAD] * 4
    assert [r["n_stored"] for r in rows] == [CONV + HEAD] + [2 * CONV + HEAD] * 3
    values = [r["result"]["readouts"]["values"]["n_params"] for r in rows]
    assert values == [2 * CONV + HEAD] * 4
    pearson = result.report["selection"]["evaluation"]["readouts"]["n_params"]
    assert pearson["vs_accuracy"]["pearson"] is None  # a constant has no correlation
    assert f"#0 {CONV + HEAD:,} stored / {2 * CONV + HEAD:,} used" in result.text
    assert "n_stored" in result.csv.splitlines()[0]


def test_a_torch_export_of_cloned_layers_shares_and_is_counted_per_use(tmp_path):
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            block = nn.Sequential(nn.Conv2d(C, C, K, padding=1), nn.ReLU())
            self.blocks = nn.Sequential(*[copy.deepcopy(block) for _ in range(3)])
            self.fc = nn.Linear(C, CLASSES)

        def forward(self, x):
            return self.fc(self.blocks(x).mean((2, 3)))

    net = Net().eval()

    def export() -> onnx.ModelProto:
        buf = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(net, (torch.randn(2, C, 6, 6),), buf, dynamo=False,
                              input_names=["x"], output_names=["logits"],
                              dynamic_axes={"x": {0: "N"}}, opset_version=17)
        return onnx.load_from_string(buf.getvalue())

    first = export()  # equal clones: the exporter keeps one initializer per tensor
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.01 * torch.randn_like(p))
    later = export()
    a, b = analyze_structure(first), analyze_structure(later)
    assert a.n_stored == CONV + HEAD and b.n_stored == 3 * CONV + HEAD
    assert a.n_params == b.n_params == 3 * CONV + HEAD
