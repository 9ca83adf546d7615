"""The reconstruction's conv input rows gathered inside the graph (onnxdiag/structured/rows.py,
docs/METHODS.md §E2's moments pass).

Oracles: the in-graph rows equal :func:`onnxdiag.stats.sample_positions` (the NumPy draw of
docs/METHODS.md §B1) on the whole exposed tensor, bit for bit, batch after batch (global
indices), also in a graph with a baked batch size that the runner splits into pieces; the
moments pass gives bit-identical moments either way; a tensor whose spatial size is not
static or not larger than the positions stays on the NumPy route.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdiag.graph import GraphIndex, analyze_structure
from onnxdiag.model.expose import expose_tensors
from onnxdiag.model.io import load_model
from onnxdiag.runtime.runner import OrtRunner
from onnxdiag.stats import sample_positions
from onnxdiag.structured.reconstruct import collect_input_moments, consumer_sites
from onnxdiag.structured.rows import expose_sampled_rows, gatherable, position_feeds

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def _net(batch="N", size=(9, 7)):
    """x (batch, 3, H, W) → conv (3→8, 3×3, pad 1) → Relu r1 → conv (8→5) → Relu →
    GlobalAveragePool → Flatten → Gemm (5→4)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, .5, (8, 3, 3, 3)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.normal(0, .5, (5, 8, 3, 3)).astype(np.float32), "w2"),
             numpy_helper.from_array(rng.normal(0, .5, (4, 5)).astype(np.float32), "wf")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["y1"], name="c1", pads=[1] * 4),
             helper.make_node("Relu", ["y1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["y2"], name="c2", pads=[1] * 4),
             helper.make_node("Relu", ["y2"], ["r2"], name="relu2"),
             helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "wf"], ["logits"], name="fc", transB=1)]
    graph = helper.make_graph(
        nodes, "net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, *size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 4])], inits)
    return load_model(helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())


def _batches(n=3, batch=12, size=(9, 7)):
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((batch, 3, *size)).astype(np.float32)} for _ in range(n)]


@pytest.mark.parametrize("baked", [None, 4])
def test_in_graph_rows_equal_the_numpy_sampled_rows_exactly(baked):
    model = _net(batch="N" if baked is None else baked)
    size = gatherable(GraphIndex(model), "r1", 8, 16)
    assert size == 63
    graph, names, inputs = expose_sampled_rows(model, {"r1": (4, size, 8)}, tag="t")
    assert list(inputs.values()) == [63]
    onnx.checker.check_model(graph)
    gathered, whole = OrtRunner(graph), OrtRunner(expose_tensors(model, ["r1"]))
    seen = 0
    for feeds in _batches():
        indices = np.arange(seen, seen + 12) + 100  # global indices, not batch-local
        rows = gathered.run({**feeds, **position_feeds(inputs, 16, 5, indices)}, [names["r1"]])
        expected = sample_positions(whole.run(feeds, ["r1"])["r1"], 16, seed=5,
                                    sample_indices=indices)
        assert rows[names["r1"]].shape == (12, 16, 8)
        assert np.array_equal(rows[names["r1"]].reshape(-1, 8), expected)
        seen += 12
    if baked:
        assert gathered.fixed_batch == 4  # the runner split each batch of 12 into pieces


@pytest.mark.parametrize("positions", [16, 3])
def test_moments_pass_is_bit_identical_either_way(positions):
    model, batches = _net(), _batches()
    sites = consumer_sites(analyze_structure(model))
    a = collect_input_moments(model, sites, batches, positions=positions, seed=2)
    b = collect_input_moments(model, sites, batches, positions=positions, seed=2,
                              in_graph=False)
    assert set(a) == set(b) == {"r1", "f"}
    for t in a:
        assert a[t].n == b[t].n == (36 if t == "f" else 36 * positions)
        assert np.array_equal(a[t].mean, b[t].mean) and np.array_equal(a[t].cov(), b[t].cov())


def test_unknown_or_small_spatial_sizes_stay_on_the_numpy_route():
    index = GraphIndex(_net(size=("H", "W")))
    assert gatherable(index, "r1", 8, 16) is None  # not static
    small = GraphIndex(_net(size=(4, 4)))
    assert gatherable(small, "r1", 8, 16) is None  # 16 positions: every one is taken
    assert gatherable(small, "r1", 8, 15) == 16
    assert gatherable(small, "r1", 8, None) is None  # every position wanted
    model, batches = _net(size=("H", "W")), _batches()
    sites = consumer_sites(analyze_structure(model))
    a = collect_input_moments(model, sites, batches)
    b = collect_input_moments(model, sites, batches, in_graph=False)
    assert np.array_equal(a["r1"].cov(), b["r1"].cov())
