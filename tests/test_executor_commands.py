"""`channels` and `prune-sweep` on an executor (issue 9): sharded statistics and
per-cell units give the single-machine results; failures stay per unit."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

import onnxdiag.channels.moments as moments
from onnxdiag.channels.collect import collect_channel_moments, collect_channel_moments_sharded
from onnxdiag.cli import cli
from onnxdiag.commands.base import DataRequest, ReportTarget, Runtime
from onnxdiag.commands.channel_pruning import Recovery
from onnxdiag.commands.channels import ChannelsOptions, channels_report
from onnxdiag.commands.prune_sweep import PruneSweepOptions, prune_sweep_report
from onnxdiag.data.sample import get_sample
from onnxdiag.data.source import open_data
from onnxdiag.errors import OnnxDiagError
from onnxdiag.graph import analyze_structure
from onnxdiag.model.io import get_input_specs, load_model
from onnxdiag.runtime.executor import LocalExecutor, UnitFailure

SAMPLE = get_sample()
CALIB = str(SAMPLE.calibration)
LIMIT, BATCH = 300, 64  # 5 batches, the last one short: shards of 2/2/1 or 3/2 batches
REQUEST = DataRequest(CALIB, limit=LIMIT, seed=3, batch_size=BATCH)


@pytest.fixture(scope="module")
def model():
    m = load_model(SAMPLE.model)
    return m, analyze_structure(m)


@pytest.fixture(scope="module")
def single_pass(model):
    m, structure = model
    source = open_data(CALIB, get_input_specs(m), limit=LIMIT, seed=3, batch_size=BATCH)
    return collect_channel_moments(m, structure, source, seed=3, task_samples="match")


def _assert_same_moments(a, b, tol=1e-9):
    assert a.layers.keys() == b.layers.keys() and a.n_images == b.n_images == LIMIT
    assert (a.targets, a.seed, a.n_positions) == (b.targets, b.seed, b.n_positions)
    for name in a.layers:
        la, lb = a.layers[name], b.layers[name]
        assert la.n_images == lb.n_images and la.task.n == lb.task.n
        np.testing.assert_allclose(lb.task.mean, la.task.mean, rtol=tol, atol=tol)
        ca, cb = la.task.cov(), lb.task.cov()
        np.testing.assert_allclose(cb, ca, rtol=tol, atol=tol * np.abs(ca).max())


@pytest.mark.parametrize("n_shards, ship", [(3, False), (2, True)])
def test_sharded_moments_equal_single_pass_locally(model, single_pass, n_shards, ship):
    m, structure = model
    stats = collect_channel_moments_sharded(m, structure, REQUEST, executor=LocalExecutor(1),
                                            seed=3, n_shards=n_shards, ship=ship)
    assert stats.data["shards"] == n_shards and stats.data["indices"] == \
        single_pass.data["indices"]  # the same seeded subset of the calibration set
    _assert_same_moments(single_pass, stats)


def test_sharded_gap_moments_equal_single_pass(model):
    """task_samples="gap" keeps a second accumulator (the local axis): merged too."""
    m, structure = model
    source = open_data(CALIB, get_input_specs(m), limit=LIMIT, seed=3, batch_size=BATCH)
    one = collect_channel_moments(m, structure, source, seed=3, task_samples="gap")
    stats = collect_channel_moments_sharded(m, structure, REQUEST, executor=LocalExecutor(1),
                                            seed=3, task_samples="gap", n_shards=4)
    _assert_same_moments(one, stats)
    for name, lm in one.layers.items():
        for x, y in zip(lm.local_moments(), stats.layers[name].local_moments()):
            np.testing.assert_allclose(y, x, rtol=1e-9, atol=1e-9 * np.abs(x).max())


def test_sharded_moments_on_ray_equal_single_pass(ray_executor, model, single_pass):
    m, structure = model
    # Ray workers read their own batch range from the data path (README: the path must exist
    # on every node); with ship=True the driver ships each shard's batches instead.
    for ship, where in ((False, "read by workers from the path"), (True, "shipped by the driver")):
        stats = collect_channel_moments_sharded(m, structure, REQUEST, executor=ray_executor,
                                                seed=3, ship=ship)
        assert stats.data["shards"] == 2
        assert stats.data["shard_data"] == where
        _assert_same_moments(single_pass, stats)


@pytest.mark.parametrize("jobs, in_memory, where", [
    (1, False, "read in this process"), (2, False, "read by workers from the path"),
    (2, True, "shipped by the driver")])
def test_shard_data_follow_the_executor(model, single_pass, jobs, in_memory, where):
    """Units in this process read their batch range from the opened data; worker processes
    reopen a data file from its path; in-memory data are read by the driver and each
    shard's batches shipped with its unit. Every way gives the single pass."""
    m, structure = model
    request = REQUEST
    if in_memory:
        with np.load(CALIB) as z:
            request = DataRequest({k: z[k] for k in z.files}, limit=LIMIT, seed=3,
                                  batch_size=BATCH)
    stats = collect_channel_moments_sharded(m, structure, request, executor=LocalExecutor(jobs),
                                            seed=3, n_shards=2)
    assert stats.data["shard_data"] == where and stats.data["shards"] == 2
    _assert_same_moments(single_pass, stats)


def test_failed_shard_is_named_not_merged(model, monkeypatch):
    m, structure = model
    fold = moments._fold
    selected = open_data(CALIB, get_input_specs(m), limit=LIMIT, seed=0).indices
    # 5 batches in 3 shards: batches 0-1, 2, 3-4; break the one holding sample 128
    bad = selected[128]

    def broken(acc, x, t, t_null, indices, *args):
        if bad in indices:
            raise RuntimeError("disk read error")
        return fold(acc, x, t, t_null, indices, *args)

    monkeypatch.setattr(moments, "_fold", broken)
    # A RuntimeError in a worker is a bug, not a user error: it stops the command as a
    # UnitFailure that keeps the worker's exception type and traceback (for --debug).
    with pytest.raises(UnitFailure, match=r"1 of 3 statistics shards failed.*shard 1 "
                                          r"\(batch 2, selected samples 128-191\).*disk read") as e:
        collect_channel_moments_sharded(m, structure, DataRequest(CALIB, limit=LIMIT,
                                                                  batch_size=BATCH),
                                        executor=LocalExecutor(1), n_shards=3)
    assert e.value.error.type_name == "RuntimeError"
    assert "raise RuntimeError(\"disk read error\")" in e.value.remote_traceback


def _close(a, b, tol=1e-9, where="") -> None:
    """Recursive equality of JSON-like reports, floats within ``tol`` (relative)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _close(a[k], b[k], tol, f"{where}.{k}")
    elif isinstance(a, (list, tuple)) or isinstance(a, np.ndarray):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, tol, f"{where}[{i}]")
    elif isinstance(a, (float, np.floating)) and not isinstance(a, bool):
        if np.isnan(a):
            assert np.isnan(b), where
        else:
            assert abs(a - b) <= tol * max(1.0, abs(a)), (where, a, b)
    else:
        assert a == b, where


def test_channels_report_on_ray_equals_local(ray_executor):
    args = dict(data=REQUEST, options=ChannelsOptions(seed=3), report=ReportTarget(write=False))
    local = channels_report(str(SAMPLE.model), runtime=Runtime(progress=False), **args).report
    on_ray = channels_report(str(SAMPLE.model), runtime=Runtime(executor=ray_executor,
                                                                progress=False), **args).report
    assert local["metadata"]["executor"] == {"kind": "local", "jobs": 1}
    assert on_ray["metadata"]["executor"]["kind"] == "ray"
    a, b = local["channels"], on_ray["channels"]
    assert a["n_images"] == b["n_images"] == LIMIT
    _close(*(json.loads(json.dumps(x, default=_jsonable)) for x in (a, b)))


def _jsonable(x):
    return x.tolist() if isinstance(x, np.ndarray) else float(x)


def test_cli_channels_jobs_and_ray(ray_executor, tmp_path):
    base = ["channels", str(SAMPLE.model), "--data", CALIB, "--limit", "128",
            "--format", "json"]
    res = CliRunner().invoke(cli, base + ["--jobs", "2", "--out", str(tmp_path / "l")])
    assert res.exit_code == 0, res.output
    local = json.loads(res.stdout[:res.stdout.rindex("}") + 1])
    assert local["metadata"]["executor"] == {"kind": "local", "jobs": 2}
    res = CliRunner().invoke(cli, base + ["--executor", "ray", "--out", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    on_ray = json.loads(res.stdout[:res.stdout.rindex("}") + 1])
    assert on_ray["metadata"]["executor"]["kind"] == "ray"
    assert on_ray["channels"]["median"] == pytest.approx(local["channels"]["median"],
                                                         rel=1e-9, abs=1e-12)
    res = CliRunner().invoke(cli, base + ["--executor", "dask"])
    assert res.exit_code == 1 and "use local, ray, or ray=HOST:PORT" in res.stderr


@pytest.fixture(scope="module")
def small_eval(tmp_path_factory):
    with np.load(SAMPLE.evaluation) as z:
        arrays = {k: z[k][:400] for k in z.files}
    path = tmp_path_factory.mktemp("eval") / "eval400.npz"
    np.savez(path, **arrays)
    return str(path)


SWEEP = dict(data=DataRequest(CALIB, limit=192),
             options=PruneSweepOptions(ratios=(0.25, 0.5), scores=("magnitude", "two_axis")),
             report=ReportTarget(write=False))


def _on(executor=None, jobs=None) -> Runtime:
    return Runtime(executor=executor, jobs=jobs, progress=False)


def test_prune_sweep_on_ray_equals_local(ray_executor, small_eval):
    local = prune_sweep_report(str(SAMPLE.model), eval_data=small_eval, runtime=_on(),
                               **SWEEP).report
    on_ray = prune_sweep_report(str(SAMPLE.model), eval_data=small_eval,
                                runtime=_on(ray_executor), **SWEEP).report
    a, b = local["prune_sweep"], on_ray["prune_sweep"]
    assert len(a["rows"]) == 4 and a["failed"] == b["failed"] == []
    assert json.dumps(a["rows"], sort_keys=True) == json.dumps(b["rows"], sort_keys=True)
    assert a["auc"] == b["auc"] and a["dense_accuracy"] == b["dense_accuracy"]
    assert on_ray["metadata"]["executor"]["kind"] == "ray"


def test_prune_sweep_failed_cell_is_reported_others_kept(small_eval, monkeypatch):
    import onnxdiag.structured as structured

    plan = structured.plan_pruning

    def broken(model, structure, scores, ratio, **kw):
        if kw.get("score_name") == "two_axis" and ratio == 0.5:
            raise OnnxDiagError("no memory left for this cell")
        return plan(model, structure, scores, ratio, **kw)

    good = prune_sweep_report(str(SAMPLE.model), eval_data=small_eval, runtime=_on(jobs=1),
                              **SWEEP)
    monkeypatch.setattr(structured, "plan_pruning", broken)
    res = prune_sweep_report(str(SAMPLE.model), eval_data=small_eval, runtime=_on(jobs=1),
                             **SWEEP)
    sec, ref = res.report["prune_sweep"], good.report["prune_sweep"]
    assert sec["failed"] == [{"score": "two_axis", "ratio": 0.5,
                              "error": "no memory left for this cell"}]
    assert sec["rows"][:3] == ref["rows"][:3]  # the other cells are kept, unchanged
    assert sec["rows"][3]["error"] and sec["rows"][3]["accuracy_before"] is None
    assert sec["auc"]["magnitude"] == ref["auc"]["magnitude"]
    assert sec["auc"]["two_axis"]["before"] is None  # an incomplete curve has no AUC
    assert "FAILED cell two_axis ratio 0.5: no memory left" in res.text


def test_prune_sweep_recalibrated_cells_equal_on_local_workers_and_ray(ray_executor,
                                                                      small_eval):
    """--recalibrate-bn on 2 local worker processes (each reads the calibration file
    itself) and on Ray (shipped once) gives the cells of the in-process sweep."""
    args = dict(SWEEP, options=PruneSweepOptions(ratios=(0.25, 0.5), scores=("magnitude",)),
                recovery=Recovery(recalibrate_bn=True))
    here = prune_sweep_report(str(SAMPLE.model), eval_data=small_eval, runtime=_on(),
                              **args).report
    workers = prune_sweep_report(str(SAMPLE.model), eval_data=small_eval, runtime=_on(jobs=2),
                                 **args).report
    on_ray = prune_sweep_report(str(SAMPLE.model), eval_data=small_eval,
                                runtime=_on(ray_executor), **args).report
    rows = here["prune_sweep"]["rows"]
    assert all(r["accuracy_after"] is not None for r in rows)
    for other in (workers, on_ray):
        assert json.dumps(other["prune_sweep"]["rows"], sort_keys=True) == \
            json.dumps(rows, sort_keys=True)
        assert other["prune_sweep"]["dense_accuracy_after_recovery"] == \
            here["prune_sweep"]["dense_accuracy_after_recovery"]
