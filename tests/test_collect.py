"""The channel-statistics pass (METHODS §B1): streamed moments equal NumPy on the concatenated
spatial samples for any batch split; targets; gap mode; the channels verb end to end."""

import corpus
import numpy as np
import pytest

from onnxdiag.channels.collect import collect_channel_moments, find_analysed_layers
from onnxdiag.channels.moments import target_margin
from onnxdiag.commands.base import DataRequest, ReportTarget, Runtime
from onnxdiag.data.source import open_data
from onnxdiag.errors import OnnxDiagError
from onnxdiag.graph import analyze_structure
from onnxdiag.model import io as model_io
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
        both = np.column_stack([samples, t_rep])
        c = lm.n_channels
        mean, cov = lm.local_moments()
        _, cov_yt, var_t = lm.target_moments()
        full = np.block([[cov, cov_yt[:, None]], [cov_yt[None, :], np.array([[var_t]])]])
        # float32 products (≤ 1.3e-4 σ_i σ_j) on tensors that agree to float32 rounding
        _assert_within_float32_bound(np.r_[mean, lm.task.mean[c]], full, both)
        assert var_t == pytest.approx(np.var(t_rep, ddof=1), rel=1e-5)


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

    from onnxdiag.commands.channels import channels_report

    model, _, x, _ = setup
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    np.save(tmp_path / "x.npy", x)
    result = channels_report(str(path), data=str(tmp_path / "x.npy"),
                             report=ReportTarget(tmp_path / "rep"),
                             runtime=Runtime(progress=False))
    section = result.report["channels"]
    assert section["targets"] == "pseudo" and "pseudo" in section["targets_flag"]
    csv_lines = (tmp_path / "rep" / "channels.csv").read_text().splitlines()
    n_channels = sum(la["n_channels"] for la in section["layers"])
    assert len(csv_lines) == 1 + n_channels
    assert csv_lines[0].startswith("layer,channel,")


def _assert_within_float32_bound(mean, cov, ref):
    """``mean``/``cov`` of the float32-product fold vs the float64 moments of ``ref``: within
    the proven bound, in units of the columns' standard deviations. Per batch the Gram errs
    by ≤ gram_error_bound (≈ 6.1e-5 of Σ|z_i||z_j| ≤ √(G_ii G_jj), Cauchy–Schwarz); summed
    over batches centred on their own means that is ≤ 6.1e-5 √(M2_ii M2_jj); the sums
    (ones column) err by ≤ the same fraction of Σ|z_i|, which moves the mean by ≤ 6.1e-5 σ
    and M2 by its square. So 1.3e-4 of σ_i σ_j (and 6.2e-5 σ for the mean) is a bound,
    not a fitted tolerance; float64 folding met 1e-12."""
    ref_cov = np.cov(ref, rowvar=False)
    sd = np.sqrt(np.diag(ref_cov))
    assert np.all(np.abs(mean - ref.mean(axis=0)) <= 6.2e-5 * sd + 1e-12)
    assert np.all(np.abs(cov - ref_cov) <= 1.3e-4 * np.outer(sd, sd) + 1e-12)


@pytest.mark.parametrize("block,width", [(7, 40), (1024, 40), (1024, 512), (1024, 600)])
def test_float32_block_gram_within_its_error_bound_vs_float64(block, width):
    """blocked_gram (a float32 syrk per block of rows into a scratch with padded rows,
    merged in float64) vs the float64 Gram of the same centred values: every entry within
    gram_error_bound, and the bound is a relative error
    ≤ 6.2e-5 of √(G_ii G_jj) (here the error itself is far below it); added to ``out`` in
    place when given."""
    from onnxdiag.channels.moments import blocked_gram, gram_error_bound

    rng = np.random.default_rng(4)
    x = (rng.normal(size=(4096, width)) * rng.uniform(0.01, 100, width) + 30).astype(
        np.float32)
    x[:, 3] = x[:, 2] * 1.5 + 0.001 * x[:, 5]  # nearly collinear columns
    centre32 = x.mean(axis=0, dtype=np.float64).astype(np.float32)
    exact = x.astype(np.float64) - centre32  # float32 − float32 is exact in float64
    ref = exact.T @ exact
    z = np.empty_like(x)
    np.subtract(x, centre32, out=z)
    got = blocked_gram(z, block)
    bound = gram_error_bound(np.abs(exact).T @ np.abs(exact), block)
    assert np.all(np.abs(got - ref) <= bound)
    np.testing.assert_array_equal(got, got.T)  # syrk: exactly symmetric
    base = rng.normal(size=(width, width))
    added = blocked_gram(z, block, out=base.copy())
    np.testing.assert_allclose(added - base, got, rtol=0, atol=1e-9 * np.abs(got).max())
    scale = np.sqrt(np.outer(np.diag(ref), np.diag(ref)))
    assert (bound / scale).max() <= (6.2e-5 if block == 1024 else 1e-6)
    assert (np.abs(got - ref) / scale).max() < 1e-5  # and the error is far smaller


def test_gram_moments_equal_update_sums_and_settle_before_every_read(monkeypatch):
    """GramMoments.fold_sums (the batch's Gram added in place, its rank-one terms kept
    aside) gives the moments of Moments.update_sums on the same batches to float64
    rounding, whether the terms are added when PENDING fill up or at a read; merge,
    select and a plain update after it see every batch."""
    from onnxdiag.channels.moments import GramMoments
    from onnxdiag.stats import Moments

    monkeypatch.setattr(GramMoments, "PENDING", 4)  # settles twice within the batches
    rng = np.random.default_rng(9)
    d = 6
    batches = [rng.normal(size=(int(m), d)) * [1, 10, 0.1, 3, 1, 1] + 50
               for m in rng.integers(1, 30, size=9)]

    def fold(acc, parts):
        for x in parts:
            centre = x.mean(axis=0) + 0.01  # any centre: sums and Gram around it
            z = x - centre
            if isinstance(acc, GramMoments):
                acc.fold_sums(len(x), centre, z.sum(axis=0))[...] += z.T @ z
            else:
                acc.update_sums(len(x), centre, z.sum(axis=0), z.T @ z)
        return acc

    ref, got = fold(Moments(d), batches), fold(GramMoments(d), batches)
    allx = np.concatenate(batches)
    assert got.n == len(allx)
    np.testing.assert_allclose(got.cov(), ref.cov(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got.cov(), np.cov(allx, rowvar=False), rtol=1e-10)
    np.testing.assert_allclose(got.mean, allx.mean(axis=0), rtol=1e-13)
    # reads that do not go through cov(): merge (both sides pending), select, update
    a, b = fold(GramMoments(d), batches[:4]), fold(GramMoments(d), batches[4:])
    np.testing.assert_allclose(a.merge(b).cov(), ref.cov(), rtol=1e-12, atol=1e-12)
    plain = Moments(d).merge(fold(GramMoments(d), batches[:5]).settle())
    np.testing.assert_allclose(plain.merge(fold(Moments(d), batches[5:])).cov(), ref.cov(),
                               rtol=1e-12, atol=1e-12)
    part = fold(GramMoments(d), batches).select([4, 1])
    np.testing.assert_allclose(part.cov(), ref.cov()[np.ix_([4, 1], [4, 1])], rtol=1e-12)
    extra = rng.normal(size=(5, d))
    both = fold(GramMoments(d), batches).update(extra)
    np.testing.assert_allclose(both.cov(), np.cov(np.concatenate([allx, extra]),
                                                  rowvar=False), rtol=1e-10)


@pytest.mark.parametrize("spatial", [(6, 5), (1, 1)])  # 16 of 30 positions; one (k = 1)
@pytest.mark.parametrize("cuts", [[], [1, 2, 3, 4, 5, 6], [7, 19]])
def test_fast_fold_equals_moments_on_concatenated_rows(cuts, spatial):
    """The hot loop (row gather from the channels-last output, float32 Gram blocks around
    each batch's mean) equals Moments.update on the explicitly gathered float64 rows of the
    NCHW tensor with T repeated per position, within the float32-product bound, for any
    split, also on a 1×1 map (one row an image); the targets' own moments (float64 block)
    to 1e-12."""
    from onnxdiag.channels.moments import GramMoments, LayerMoments, _fold

    rng = np.random.default_rng(9)
    n, c = 23, 5
    x = (rng.normal(size=(n, c, *spatial)) * 3 + 40).astype(np.float32)  # |mean| >> std
    last = np.ascontiguousarray(np.moveaxis(x, 1, -1))  # what the stats session returns
    t, t_null = rng.normal(size=n), rng.normal(size=n)
    idx = np.arange(n) + 1000
    acc = LayerMoments("l", c, GramMoments(c + 2))
    buffers: dict = {}
    for part in np.split(np.arange(n), cuts):
        _fold(acc, last[part], t[part], t_null[part], idx[part], {}, 16, 3, "match", buffers)
    pos = draw_positions(spatial[0] * spatial[1], 16, seed=3, sample_indices=idx)
    k = pos.shape[1]
    rows = x.reshape(n, c, -1)[np.arange(n)[:, None], :, pos].reshape(-1, c)
    ref = np.column_stack([rows.astype(np.float64), np.repeat(t, k), np.repeat(t_null, k)])
    assert acc.task.n == n * k and acc.n_images == n
    _assert_within_float32_bound(acc.task.mean, acc.task.cov(), ref)
    np.testing.assert_allclose(acc.task.cov()[c:, c:], np.cov(ref, rowvar=False)[c:, c:],
                               rtol=1e-12)
    gap = LayerMoments("l", c, GramMoments(c + 2), GramMoments(c))  # gap: local from the samples
    for part in np.split(np.arange(n), cuts):
        _fold(gap, last[part], t[part], t_null[part], idx[part], {}, 16, 3, "gap", {})
    mean, cov = gap.local_moments()
    _assert_within_float32_bound(mean, cov, ref[:, :c])
    per_image = np.column_stack([x.astype(np.float64).mean(axis=(2, 3)), t, t_null])
    np.testing.assert_allclose(gap.task.cov(), np.cov(per_image, rowvar=False), rtol=1e-10,
                               atol=1e-12 * np.abs(gap.task.cov()).max())


def test_reused_runner_and_serial_folding_give_identical_moments(setup):
    from onnxdiag.channels.collect import make_stats_runner

    model, structure, x, y = setup
    runner = make_stats_runner(model, structure)
    first, again = _collect(setup, 8, runner=runner), _collect(setup, 8)
    serial = _collect(setup, 8, runner=runner, overlap=False)  # no worker thread
    for name, lm in first.layers.items():
        np.testing.assert_array_equal(lm.task.cov(), again.layers[name].task.cov())
        np.testing.assert_array_equal(lm.task.cov(), serial.layers[name].task.cov())
        assert lm.n_images == serial.layers[name].n_images == N
    assert len(first.layers) > 1
    one_layer = make_stats_runner(model, structure, layers=[next(iter(first.layers))])
    with pytest.raises(OnnxDiagError, match="make_stats_runner"):
        _collect(setup, 8, runner=one_layer)


def test_layers_folded_on_every_core_give_identical_moments(setup, monkeypatch):
    """Where the session keeps every core and each batch's fold is large, the pass folds a
    batch after its run with its layers split over the cores (channels.threads
    .fold_workers): the moments equal the serial fold's bit for bit."""
    from onnxdiag.channels import moments, threads
    from onnxdiag.channels.collect import make_stats_runner

    model, structure, x, y = setup
    runner = make_stats_runner(model, structure, threads=0)
    splits = []
    split = moments.split_layers
    monkeypatch.setattr(moments, "split_layers",
                        lambda layers, w: splits.append(w) or split(layers, w))
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.setattr(threads, "PARALLEL_FOLD_FLOPS", 0.0)
    par = _collect(setup, 8, runner=runner)
    assert splits == [3]  # three cores: the layers in three groups, split once
    serial = _collect(setup, 8, runner=runner, overlap=False)
    for name, lm in serial.layers.items():
        np.testing.assert_array_equal(lm.task.cov(), par.layers[name].task.cov())
        np.testing.assert_array_equal(lm.task.mean, par.layers[name].task.mean)
        assert lm.n_images == par.layers[name].n_images == N
    monkeypatch.setattr(threads, "PARALLEL_FOLD_FLOPS", float("inf"))
    _collect(setup, 8, runner=runner)
    assert splits == [3]  # a small fold: beside the next run, one worker
    two = _collect(setup, 8, runner=runner, fold_threads=2)  # asked for: two threads
    assert splits == [3, 2]
    for name, lm in serial.layers.items():
        np.testing.assert_array_equal(lm.task.cov(), two.layers[name].task.cov())


def test_fold_workers_and_split_layers():
    from types import SimpleNamespace

    from onnxdiag.channels.moments import split_layers
    from onnxdiag.channels.threads import fold_flops, fold_workers

    cnn = model_io.load_model("models/sample/model.onnx")
    chosen = find_analysed_layers(analyze_structure(cnn))
    per_batch = fold_flops(chosen, 16) * 32
    assert fold_workers(chosen, 16, 32, None, cores=2, min_flops=per_batch) == 2
    assert fold_workers(chosen, 16, 32, 0, cores=4, min_flops=per_batch) == 4
    assert fold_workers(chosen, 16, 31, None, cores=2, min_flops=per_batch) == 1
    assert fold_workers(chosen, 16, 32, 1, cores=2, min_flops=0) == 1  # a core left to it
    assert fold_workers(chosen, 16, 32, None, cpu=False, cores=2, min_flops=0) == 1
    assert fold_workers(chosen, 16, None, None, cores=2, min_flops=0) == 1
    assert fold_workers(chosen, 16, 32, None, cores=1, min_flops=0) == 1
    widths = [2048, 64, 1024, 1024, 512, 8]
    layers = [SimpleNamespace(n_out=c, name=i) for i, c in enumerate(widths)]
    groups = split_layers(layers, 2)
    assert sorted(la.name for g in groups for la in g) == list(range(6))
    assert [la.name for la in groups[0]] == [0]  # the largest alone
    assert [la.name for la in groups[1]] == [1, 2, 3, 4, 5]  # the rest, in the pass order
    assert len(split_layers(layers[:1], 3)) == 1  # no empty group


def test_channel_section_summarises_each_layer(setup, tmp_path):
    """The analyze summary: per layer axis correlations, ARI and the peer-R² extremes,
    equal to the channels verb's on the same data."""
    import onnx

    from onnxdiag.commands.channels import channel_section, channels_report

    model, structure, x, y = setup
    source = open_data({"x": x, "labels": y}, model_io.get_input_specs(model), batch_size=8)
    section, text = channel_section(model, source, structure, model_name="m")
    assert section["targets"] == "labels" and section["n_images"] == N
    assert "== Channels" in text and "ARI" in text
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=x, labels=y)
    full = channels_report(str(tmp_path / "m.onnx"),
                           data=DataRequest(str(tmp_path / "d.npz"), batch_size=8),
                           report=ReportTarget(write=False),
                           runtime=Runtime(progress=False)).report["channels"]
    assert [r["layer"] for r in section["layers"]] == [r["layer"] for r in full["layers"]]
    for row, ref in zip(section["layers"], full["layers"]):
        assert "scores" not in row
        for key in ("ari", "input_capture_vs_task_info", "peer_overlap_vs_synergy",
                    "most_substitutable", "least_substitutable", "n_above_floor"):
            assert row[key] == ref[key], key
        r2 = np.asarray(ref["scores"]["scores"]["peer_r2"])
        np.testing.assert_allclose(row["most_substitutable_r2"], r2[row["most_substitutable"]])
        assert min(row["most_substitutable_r2"]) >= max(row["least_substitutable_r2"])


def test_channel_section_skips_models_without_analysable_layers():
    """Only the head (no conv or linear layer with >= 4 channels besides it): skipped."""
    from onnxdiag.commands.channels import channel_section

    model = model_io.load_model(corpus.gemm_head())
    structure = analyze_structure(model)
    source = open_data(corpus.random_feeds(model, batch=4), model_io.get_input_specs(model))
    section, text = channel_section(model, source, structure, targets="expected")
    assert section["layers"] == [] and "no conv or linear layer" in section["skipped"]
    assert "skipped" in text


@pytest.mark.parametrize("build", [corpus.residual_block, corpus.depthwise_pointwise,
                                   corpus.conv_bn_folded, corpus.conv_bias_add,
                                   corpus.conv_geometry_head, corpus.conv1d_head,
                                   corpus.dynamic_spatial])
def test_input_taps_equal_output_taps(build):
    """A conv evaluated in float64 at the sampled positions from its exposed input (bias
    input included, a separate bias Add not; strides, dilations, asymmetric and SAME pads,
    groups, 1-D) has the moments of sampling ONNX Runtime's conv output, to float32
    rounding, for every analysed layer and a batch split."""
    model = model_io.load_model(build())
    structure = analyze_structure(model)
    feeds = corpus.random_feeds(model, batch=N, seed=2, size=9)
    y = np.random.default_rng(0).integers(0, 5, N)

    def stats(tap):
        source = open_data({**feeds, "labels": y}, model_io.get_input_specs(model),
                           batch_size=7)
        return collect_channel_moments(model, structure, source, seed=1, n_positions=5,
                                       tap=tap)

    by_output, by_input = stats("output"), stats("input")
    assert set(by_output.taps.values()) == {"output"}
    assert set(by_input.taps.values()) == {"input"}
    assert by_input.layers.keys() == by_output.layers.keys()
    for name, lm in by_output.layers.items():
        other = by_input.layers[name]
        assert other.task.n == lm.task.n and other.n_images == lm.n_images == N
        scale = np.sqrt(np.diag(lm.task.cov()))  # per-column std: float32 rounding ~1e-7
        mean_err = np.abs(other.task.mean - lm.task.mean) / scale
        cov_err = np.abs(other.task.cov() - lm.task.cov()) / np.outer(scale, scale)
        assert mean_err.max() < 1e-5 and cov_err.max() < 1e-5, (name, mean_err, cov_err)


def test_auto_taps_the_input_only_where_it_is_far_smaller():
    """The bundled model's first conv reads a 1-channel 28×28 image and writes 16 channels:
    auto taps its input; every later conv keeps its output. Forced choices and their
    errors name the fix."""
    from pathlib import Path

    from onnxdiag.channels.taps import choose_taps, tap_names

    model = model_io.load_model(str(Path(__file__).parent.parent / "models" / "sample"
                                     / "model.onnx"))
    chosen = find_analysed_layers(analyze_structure(model))
    taps = tap_names(choose_taps(model, chosen))
    assert taps[chosen[0].node_name] == "input"
    assert set(taps[la.node_name] for la in chosen[1:]) == {"output"}
    gap = tap_names(choose_taps(model, chosen, "auto", "gap"))
    assert set(gap.values()) == {"output"}  # gap needs every output position
    with pytest.raises(OnnxDiagError, match="--task-samples gap.*tap 'output'"):
        choose_taps(model, chosen, "input", "gap")
    with pytest.raises(OnnxDiagError, match="tap must be one of auto, output, input"):
        choose_taps(model, chosen, "inputs")


def test_channels_cli_rejects_an_input_tap_with_gap_samples(tmp_path):
    import onnx
    from cli_helpers import assert_user_error, run

    path = tmp_path / "m.onnx"
    onnx.save(corpus.residual_block(), path)
    np.save(tmp_path / "x.npy", np.zeros((4, 3, 8, 8), np.float32))
    for jobs in (1, 2):  # one pass here, or shards on worker processes: the same error
        result = run("channels", path, "--data", tmp_path / "x.npy", "--tap", "input",
                     "--task-samples", "gap", "--jobs", jobs, "--out", tmp_path / "rep")
        assert_user_error(result, "tap 'output' or 'auto'", out=tmp_path / "rep")
        assert "shards failed" not in result.stderr


def _conv_then_conv_head():
    """c0 (3→8, no activation) feeds a 1×1 conv head directly: c0's output is the head's
    features tensor."""
    g = corpus._G(0)
    h = g.conv(g.conv("x", "c0", 3, 8), "head", 8, corpus.N_CLASSES, k=1)
    g.node("Flatten", [g.node("GlobalAveragePool", [h], "pool")], "flatten", "logits")
    return g.model([corpus._image()], [corpus._logits()])


@pytest.mark.parametrize("build, layers", [(corpus.residual_block, ["head"]),
                                           (corpus.conv1x1_before_gap, ["head"]),
                                           (_conv_then_conv_head, None)])
def test_a_layer_tensor_that_is_also_a_head_tensor(build, layers):
    """An analysed layer whose output is the head's features or logits: the pass still
    reads the head tensors as they are and the layer channels-last (same moments as the
    features / logits themselves)."""
    model = model_io.load_model(build())
    structure = analyze_structure(model)
    feeds = corpus.random_feeds(model, batch=6, seed=2)
    source = open_data(feeds, model_io.get_input_specs(model), batch_size=4)
    stats = collect_channel_moments(model, structure, source, layers=layers, targets="pseudo",
                                    n_positions=3)
    name = layers[0] if layers else "c0"
    lm = stats.layers[name]
    layer = structure.get_layer(name)
    assert lm.n_images == 6 and lm.task.n == 6 * min(3, int(np.prod(
        corpus.run_ort(model, feeds, [layer.output])[layer.output].shape[2:]) or 1))


def test_settings_record_equals_its_fields_as_keywords(setup):
    """collect_channel_moments(settings=StatsSettings(...)) is the pass of the same fields
    given as keywords; keywords replace the record's fields; an unknown one is refused."""
    from onnxdiag.channels.collect import StatsSettings

    model, structure, x, y = setup
    source = open_data({"x": x, "labels": y}, model_io.get_input_specs(model), batch_size=8)
    name = find_analysed_layers(structure)[0].node_name
    record = StatsSettings(layers=[name], n_positions=5, seed=3, targets="pseudo")
    by_record = collect_channel_moments(model, structure, source, record)
    by_keywords = collect_channel_moments(model, structure, source, layers=[name],
                                          n_positions=5, seed=3, targets="pseudo")
    replaced = collect_channel_moments(model, structure, source, record, targets="labels")
    assert list(by_record.layers) == [name] and record.layers == (name,)
    assert (by_record.targets, replaced.targets) == ("pseudo", "labels")
    np.testing.assert_array_equal(by_record.layers[name].task.cov(),
                                  by_keywords.layers[name].task.cov())
    with pytest.raises(TypeError):
        collect_channel_moments(model, structure, source, positions=5)


def test_unknown_layer_is_a_user_error(setup):
    model, structure, x, y = setup
    source = open_data({"x": x}, model_io.get_input_specs(model))
    with pytest.raises(OnnxDiagError, match="Layer 'nope' is not in the model.*inspect"):
        collect_channel_moments(model, structure, source, layers=["nope"])
