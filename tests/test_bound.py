"""runtime/bound: outputs written into reused buffers equal the plain runs of the same
pieces bit for bit; a batch larger than the buffers, a changed trailing shape and a graph
baked to one batch size all still give the plain outputs."""

from __future__ import annotations

import numpy as np
import pytest
from corpus import dynamic_spatial, random_feeds, residual_block
from test_fixed_batch import concat_model

from onnxdiag.data.source import DataWarning
from onnxdiag.model.expose import expose_tensors
from onnxdiag.runtime.bound import BoundRunner
from onnxdiag.runtime.runner import OrtRunner


def _exposed(build):
    model = build()
    names = [n.output[0] for n in model.graph.node if n.op_type in ("Conv", "Relu")]
    return expose_tensors(model, names), names


def test_bound_outputs_are_the_plain_ones_and_reuse_their_buffers():
    model, names = _exposed(residual_block)
    runner = OrtRunner(model)
    bound = BoundRunner(runner, names, rows=3)
    assert bound.enabled
    first = None
    for seed, n in enumerate((7, 5, 7)):  # pieces of 3, 3, 1; then a smaller batch
        feeds = random_feeds(model, batch=n, seed=seed)
        out = bound.run(feeds)
        pieces = [runner.run({k: v[i:i + 3] for k, v in feeds.items()}, names)
                  for i in range(0, n, 3)]
        for t in names:
            assert out[t].shape[0] == n
            np.testing.assert_array_equal(out[t], np.concatenate([p[t] for p in pieces]))
        if first is None:
            first = {t: out[t].__array_interface__["data"][0] for t in names}
        else:  # the same memory, run after run
            assert {t: out[t].__array_interface__["data"][0] for t in names} == first
    larger = random_feeds(model, batch=9, seed=5)  # new buffers, then the same outputs
    np.testing.assert_array_equal(bound.run(larger)[names[0]],
                                  runner.run(larger, names)[names[0]])


def test_a_one_piece_batch_keeps_its_own_outputs_as_the_buffers():
    """Batches of at most ``rows`` samples: the first run's arrays become the buffers (no
    copy); later batches are written into them and equal their plain runs."""
    model, names = _exposed(residual_block)
    runner = OrtRunner(model)
    bound = BoundRunner(runner, names, rows=4)
    first = bound.run(random_feeds(model, batch=4, seed=0))
    address = {t: first[t].__array_interface__["data"][0] for t in names}
    for seed, n in ((1, 4), (2, 3)):
        feeds = random_feeds(model, batch=n, seed=seed)
        out = bound.run(feeds)
        plain = runner.run(feeds, names)
        for t in names:
            np.testing.assert_array_equal(out[t], plain[t])
            assert out[t].__array_interface__["data"][0] == address[t]


def test_a_changed_shape_and_a_baked_batch_fall_back_to_the_plain_run():
    model, names = _exposed(dynamic_spatial)
    runner = OrtRunner(model)
    bound = BoundRunner(runner, names, rows=2)
    bound.run(random_feeds(model, batch=4, size=8))
    other = random_feeds(model, batch=4, size=6, seed=1)  # other H, W: the binding fails
    np.testing.assert_array_equal(bound.run(other)[names[0]], runner.run(other)[names[0]])
    assert not bound.enabled
    baked = OrtRunner(concat_model(fixed=2))
    x = {"x": np.random.default_rng(0).standard_normal((6, 6)).astype(np.float32)}
    with pytest.warns(DataWarning, match="batch size 2"):
        out = BoundRunner(baked, ["logits"], rows=4).run(x)["logits"]
    np.testing.assert_array_equal(out, baked.run(x, ["logits"])["logits"])
