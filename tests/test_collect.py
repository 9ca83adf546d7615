"""The channel-statistics pass (SPEC B1): streamed moments equal NumPy on the concatenated
spatial samples for any batch split; targets; gap mode; the channels verb end to end."""

import corpus
import numpy as np
import pytest

from onnxdiag import model_io
from onnxdiag.collect import collect_channel_moments, find_analysed_layers, target_margin
from onnxdiag.data import open_data
from onnxdiag.graph import analyze_structure
from onnxdiag.stats import draw_positions

N = 23


@pytest.fixture(scope="module")
def setup():
    model = model_io.load_model(corpus.residual_block())
    structure = analyze_structure(model)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((N, 3, 8, 8)).astype(np.float32)
    y = rng.integers(0, 5, N)
    return model, structure, x, y


def _collect(setup, batch_size, **kw):
    model, structure, x, y = setup
    source = open_data({"x": x, "labels": y}, model_io.get_input_specs(model),
                       batch_size=batch_size)
    return collect_channel_moments(model, structure, source, seed=3, **kw)


def _reference(setup, layer, positions_seed=3, k=16):
    """All tensors from one ORT run, sampled with the same positions, then np.cov."""
    model, structure, x, y = setup
    head = structure.head
    out = corpus.run_ort(model, {"x": x}, [layer.output, head.logits])
    feat = out[layer.output].reshape(N, layer.n_out, -1)
    pos = draw_positions(feat.shape[2], k, seed=positions_seed, sample_indices=np.arange(N))
    samples = feat[np.arange(N)[:, None], :, pos].reshape(-1, layer.n_out).astype(np.float64)
    t = target_margin(out[head.logits].astype(np.float64), y)
    return samples, np.repeat(t, pos.shape[1]), t


def test_analysed_layers_are_convs_with_4_or_more_channels(setup):
    _, structure, _, _ = setup
    names = [la.node_name for la in find_analysed_layers(structure)]
    assert names and all(structure.get_layer(n).op_type == "Conv" for n in names)
    assert structure.head.node_name not in names


@pytest.mark.parametrize("batch_size", [1, 4, 23])
def test_streamed_moments_equal_numpy_on_concatenated_samples(setup, batch_size):
    """The reference runs ORT unoptimised in one batch, so tensors agree to float32
    rounding (1e-5); the accumulators' own split-exactness is tested in test_stats."""
    stats = _collect(setup, batch_size)
    _, structure, _, _ = setup
    assert stats.n_images == N and stats.targets == "labels"
    for name, lm in stats.layers.items():
        samples, t_rep, _ = _reference(setup, structure.get_layer(name))
        ref = np.cov(np.column_stack([samples, t_rep]), rowvar=False)
        c = lm.n_channels
        mean, cov = lm.local_moments()
        np.testing.assert_allclose(mean, samples.mean(axis=0), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(cov, ref[:c, :c], rtol=1e-5, atol=1e-7)
        cov_yy, cov_yt, var_t = lm.target_moments()
        np.testing.assert_allclose(cov_yt, ref[:c, c], rtol=1e-5, atol=1e-7)
        assert var_t == pytest.approx(ref[c, c], rel=1e-5)


def test_target_margin_brute_force():
    U = np.array([[1.0, 3.0, 2.0], [5.0, -1.0, 0.0]])
    np.testing.assert_allclose(target_margin(U, np.array([2, 1])), [2 - 3, -1 - 5])
    np.testing.assert_allclose(target_margin(U, None), [1.0, 5.0])


def test_gap_mode_uses_spatial_means_for_the_target_axis(setup):
    stats = _collect(setup, 5, task_samples="gap")
    model, structure, x, y = setup
    name = next(iter(stats.layers))
    layer = structure.get_layer(name)
    out = corpus.run_ort(model, {"x": x}, [layer.output, structure.head.logits])
    means = out[layer.output].reshape(N, layer.n_out, -1).mean(axis=2)
    t = target_margin(out[structure.head.logits].astype(np.float64), y)
    ref = np.cov(np.column_stack([means, t]), rowvar=False)
    cov_yy, cov_yt, var_t = stats.layers[name].target_moments()
    np.testing.assert_allclose(cov_yy, ref[:-1, :-1], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(cov_yt, ref[:-1, -1], rtol=1e-6, atol=1e-9)


def test_permutation_control_shuffles_targets_only(setup):
    lm = next(iter(_collect(setup, 8).layers.values()))
    _, cov_yt, var_t = lm.target_moments()
    _, cov_null, var_null = lm.target_moments(null=True)
    assert var_null == pytest.approx(var_t, rel=1e-9)  # same values, permuted
    assert not np.allclose(cov_null, cov_yt)


def test_channels_verb_writes_csv_and_flags_pseudo_targets(setup, tmp_path):
    import onnx

    from onnxdiag.channel_report import channels_report

    model, _, x, _ = setup
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    np.save(tmp_path / "x.npy", x)
    result = channels_report(str(path), data=str(tmp_path / "x.npy"), out=tmp_path / "rep",
                             progress=False)
    section = result.report["channels"]
    assert section["targets"] == "pseudo" and "pseudo" in section["targets_flag"]
    csv_lines = (tmp_path / "rep" / "channels.csv").read_text().splitlines()
    n_channels = sum(la["n_channels"] for la in section["layers"])
    assert len(csv_lines) == 1 + n_channels
    assert csv_lines[0].startswith("layer,channel,")
