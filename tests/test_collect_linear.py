"""The statistics pass on linear layers (docs/METHODS.md §B1, §D): positions are tokens.

Oracle: one ONNX Runtime run (optimisations off) over all inputs exposing the layer's
output (the MatMul output before the bias Add, or a Gemm's); its rows regrouped per
input, the same SplitMix64 draw of up to 16 tokens per input (all when T <= 16), the
target repeated per token, then np.cov over the concatenated samples.  The streamed
moments equal it for three batch splits, on a timm-style ViT (17 tokens: sampled) and on
GPT-2 (a Gemm on N·T rows, 8 tokens: all taken); input taps equal output taps.
"""

from __future__ import annotations

import corpus
import exports
import numpy as np
import pytest

from onnxdiag.channels.collect import collect_channel_moments, find_analysed_layers
from onnxdiag.channels.moments import target_margin
from onnxdiag.data.source import open_data
from onnxdiag.graph import analyze_structure
from onnxdiag.model.io import get_input_specs, load_model
from onnxdiag.stats import draw_positions

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")
N = 11


def _vit_data(rng):
    return {"x": rng.standard_normal((N, 3, 16, 16)).astype(np.float32)}


def _gpt2_data(rng):
    ids = rng.integers(1, 64, (N, 8))
    mask = np.ones_like(ids)
    return {"input_ids": ids, "attention_mask": mask}


CASES = {"torch_vit": (_vit_data, ["/blocks/blocks.0/qkv/MatMul", "/blocks/blocks.1/fc1/MatMul"]),
         "hf_gpt2": (_gpt2_data, ["/model/transformer/h.0/attn/c_attn/Gemm",
                                  "/model/transformer/h.1/mlp/c_proj/Gemm"])}


@pytest.fixture(scope="module", params=sorted(CASES))
def setup(request, tmp_path_factory):
    export = exports.BUILDERS[request.param](tmp_path_factory.mktemp("exports"))
    model = load_model(export.path)
    structure = analyze_structure(model, feeds=export.feeds)
    rng = np.random.default_rng(4)
    make, layers = CASES[request.param]
    feeds = make(rng)
    labels = rng.integers(0, structure.head.n_classes, N)
    return model, structure, feeds, labels, layers


def _collect(setup, batch_size, **kw):
    model, structure, feeds, labels, layers = setup
    source = open_data({**feeds, "labels": labels}, get_input_specs(model),
                       batch_size=batch_size)
    return collect_channel_moments(model, structure, source, seed=3, layers=layers, **kw)


def _reference(setup, layer):
    model, structure, feeds, labels, _ = setup
    head = structure.head
    out = corpus.run_ort(model, feeds, [layer.output, head.features, head.logits])
    y = out[layer.output].reshape(N, -1, layer.n_out).astype(np.float64)
    pos = draw_positions(y.shape[1], 16, seed=3, sample_indices=np.arange(N))
    samples = y[np.arange(N)[:, None], pos].reshape(-1, layer.n_out)
    from onnxdiag.evaluate import head_arrays

    _, U = head_arrays(out, head)
    t = target_margin(U.astype(np.float64), labels)
    return samples, np.repeat(t, pos.shape[1]), y.shape[1]


@pytest.mark.parametrize("batch_size", [1, 4, N])
def test_streamed_token_moments_equal_numpy(setup, batch_size):
    stats = _collect(setup, batch_size)
    _, structure, _, _, layers = setup
    assert stats.n_images == N and stats.kinds == {"linear": len(layers)}
    for name in layers:
        lm = stats.layers[name]
        samples, t_rep, tokens = _reference(setup, structure.get_layer(name))
        assert samples.shape[0] == N * min(tokens, 16)
        ref = np.cov(np.column_stack([samples, t_rep]), rowvar=False)
        c = lm.n_channels
        mean, cov = lm.local_moments()
        np.testing.assert_allclose(mean, samples.mean(axis=0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(cov, ref[:c, :c], rtol=1e-4, atol=1e-6)
        cov_yy, cov_yt, var_t = lm.target_moments()
        np.testing.assert_allclose(cov_yt, ref[:c, c], rtol=1e-4, atol=1e-6)
        assert var_t == pytest.approx(ref[c, c], rel=1e-6)
        assert lm.task.n == samples.shape[0]


def test_linear_input_taps_equal_output_taps(setup):
    """y = x W + b evaluated in float64 at the sampled tokens of the exposed input."""
    out = _collect(setup, 4, tap="output")
    inp = _collect(setup, 4, tap="input")
    assert set(inp.taps.values()) == {"input"}
    for name, lm in out.layers.items():
        other = inp.layers[name]
        np.testing.assert_allclose(other.task.mean, lm.task.mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(other.task.cov(), lm.task.cov(), rtol=1e-4, atol=1e-6)


def test_gap_mode_on_tokens(setup):
    """--task-samples gap pairs T with each feature's mean over the input's tokens."""
    model, structure, feeds, labels, layers = setup
    stats = _collect(setup, 4, task_samples="gap")
    layer = structure.get_layer(layers[0])
    out = corpus.run_ort(model, feeds, [layer.output])
    means = out[layer.output].reshape(N, -1, layer.n_out).astype(np.float64).mean(axis=1)
    np.testing.assert_allclose(stats.layers[layers[0]].task.mean[:layer.n_out],
                               means.mean(axis=0), rtol=1e-5, atol=1e-6)


def test_every_linear_layer_is_analysed_but_the_head(setup):
    _, structure, _, _, _ = setup
    chosen = find_analysed_layers(structure)
    linear = [la.node_name for la in structure.layers
              if la.op_type in ("Gemm", "MatMul") and not la.is_head and la.n_out >= 4]
    assert linear and set(linear) <= {la.node_name for la in chosen}
    assert structure.head.node_name not in {la.node_name for la in chosen}


def test_session_threads_leave_the_fold_a_core_where_it_is_large():
    """The statistics session keeps every core where the fold is small next to inference
    (the bundled CNN: wide convs over many positions) and leaves one to the fold where it
    is not (the ViT sample: 19 layers, 16 of 17 tokens); the fold estimate is the Gram
    FLOPs plus a per-layer cost; the moments are the same whatever the session's threads."""
    from onnxdiag.channels.collect import make_stats_runner
    from onnxdiag.channels.threads import (
        FOLD_SHARE,
        LAYER_OVERHEAD_FLOPS,
        fold_flops,
        session_threads,
    )
    from onnxdiag.data.request import DataRequest

    cnn, vit = (load_model(p) for p in ("models/sample/model.onnx", "models/vit/model.onnx"))
    s_cnn, s_vit = analyze_structure(cnn), analyze_structure(vit)
    l_cnn, l_vit = find_analysed_layers(s_cnn), find_analysed_layers(s_vit)
    expected = sum(2.0 * min(16, int(np.prod(la.output_shape[1:-1]))) * (la.n_out + 3) ** 2
                   + LAYER_OVERHEAD_FLOPS for la in l_vit)
    assert fold_flops(l_vit, 16) == pytest.approx(expected)
    assert fold_flops(l_vit, 16) > FOLD_SHARE * s_vit.flops
    assert fold_flops(l_cnn, 16) < FOLD_SHARE * s_cnn.flops
    assert session_threads(s_vit, l_vit, 16, cores=2, share=1.5) is None  # 1.45 of the model
    assert session_threads(s_vit, l_vit, 16, cores=2) == 1
    assert session_threads(s_vit, l_vit, 16, cores=16) == 15
    assert session_threads(s_vit, l_vit, 16, cores=1) is None
    assert session_threads(s_cnn, l_cnn, 16, cores=2) is None
    source = DataRequest.of("models/sample/calib.npz", limit=256).open(get_input_specs(vit))
    one = collect_channel_moments(vit, s_vit, source, runner=make_stats_runner(vit, s_vit,
                                                                               threads=1))
    every = collect_channel_moments(vit, s_vit, source, runner=make_stats_runner(vit, s_vit,
                                                                                 threads=0))
    for name, lm in one.layers.items():
        np.testing.assert_array_equal(lm.task.cov(), every.layers[name].task.cov())
