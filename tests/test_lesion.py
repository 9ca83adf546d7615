"""The ``lesion`` verb (docs/METHODS.md §B5) and the channel-family CLI: records in, the
study and its CSV out; help, a happy path and the user-error paths of both commands."""

import csv
import io
import json

import numpy as np
import pytest
from cli_helpers import assert_user_error, run

from onnxdiag.channels.interventions import lesion_study
from onnxdiag.commands.base import DataRequest, ReportTarget, Runtime
from onnxdiag.commands.lesion import LesionOptions, lesion_report
from onnxdiag.data.sample import get_sample
from onnxdiag.errors import OnnxDiagError
from onnxdiag.graph import analyze_structure
from onnxdiag.model.io import get_input_specs, load_model

SAMPLE = get_sample()
LAYER = "/block1/conv1/Conv"  # 16 channels


@pytest.fixture(scope="module")
def small_eval(tmp_path_factory):
    with np.load(SAMPLE.evaluation) as z:
        arrays = {k: z[k][:120] for k in z.files}
    path = tmp_path_factory.mktemp("eval") / "eval120.npz"
    np.savez(path, **arrays)
    return str(path)


def test_lesion_report_takes_records_and_writes_the_rows_as_csv(small_eval, tmp_path):
    """The report's rows are the study's (same damages as lesion_study on the same data),
    lesions.csv holds one row per lesion through the one CSV writer, and the metadata
    name the data roles and echo every option."""
    options = LesionOptions(layers=[LAYER], channels=[0, 3, 7], seed=2)
    res = lesion_report(str(SAMPLE.model), eval_data=DataRequest(small_eval, batch_size=32),
                        data=DataRequest(str(SAMPLE.calibration), limit=96), options=options,
                        runtime=Runtime(progress=False), report=ReportTarget(tmp_path / "r"))
    section = res.report["lesion"]
    assert [(r["layer"], r["channel"]) for r in section["rows"]] == \
        [(LAYER, 0), (LAYER, 3), (LAYER, 7)]
    m = load_model(SAMPLE.model)
    structure = analyze_structure(m)
    evaluation = DataRequest(small_eval, batch_size=32).open(get_input_specs(m))
    ref = lesion_study(m, structure, evaluation, layers=[LAYER], channels={LAYER: [0, 3, 7]})
    for row, r in zip(section["rows"], ref.lesions):
        assert row["damage"] == pytest.approx(r.damage, abs=1e-9)
        assert row["peer_r2"] is not None  # scored on the calibration data
    text = (tmp_path / "r" / "lesions.csv").read_text()
    assert text == res.csv and "\r" not in text
    rows = list(csv.DictReader(io.StringIO(text)))
    assert len(rows) == 3 and list(rows[0])[:3] == ["layer", "channel", "damage"]
    assert float(rows[1]["damage"]) == pytest.approx(section["rows"][1]["damage"], rel=1e-12)
    meta = res.report["metadata"]
    assert set(meta["data"]) == {"calibration", "evaluation"}
    assert meta["data"]["evaluation"]["n_samples"] == 120
    params = meta["parameters"]
    assert list(params["layers"]) == [LAYER] and list(params["channels"]) == [0, 3, 7]
    assert params["k_peers"] == 10 and params["seed"] == 2 and params["data"]["limit"] == 96
    assert params["eval_data"]["batch_size"] == 32


def test_lesion_report_user_errors(small_eval, tmp_path):
    with pytest.raises(OnnxDiagError, match="needs calibration data"):
        lesion_report(str(SAMPLE.model), eval_data=small_eval,
                      options=LesionOptions(layers=[LAYER], substitute=True),
                      report=ReportTarget(write=False))
    with pytest.raises(OnnxDiagError, match="No layer to lesion.*--layer"):
        lesion_report(str(SAMPLE.model), eval_data=small_eval, options=LesionOptions(()),
                      report=ReportTarget(write=False))


@pytest.mark.parametrize("command", [["channels"], ["lesion"]])
def test_help(command):
    res = run(*command, "--help")
    assert res.exit_code == 0 and "Usage:" in res.output
    assert "docs/METHODS.md" in res.output and "SPEC" not in res.output


def test_cli_lesion_happy_path(small_eval, tmp_path):
    out = tmp_path / "rep"
    res = run("lesion", SAMPLE.model, "--layer", LAYER, "--channels", "1,2", "--pairs", 1,
              "--eval-data", small_eval, "--format", "csv", "--out", out)
    assert res.exit_code == 0, res.output
    assert (out / "lesions.csv").read_text() == res.stdout
    report = json.loads((out / "report.json").read_text())
    assert [r["channel"] for r in report["lesion"]["rows"]] == [1, 2]
    assert len(report["lesion"]["study"]["pairs"]) == 1
    assert list(report["metadata"]["data"]) == ["evaluation"]


def test_cli_lesion_user_errors(small_eval, tmp_path):
    out = tmp_path / "rep"
    res = run("lesion", SAMPLE.model, "--layer", "nope", "--eval-data", small_eval, "--out", out)
    assert_user_error(res, "Layer 'nope' is not in the model", out=out)
    res = run("lesion", SAMPLE.model, "--layer", LAYER, "--eval-data", small_eval,
              "--substitute", "--out", out)
    assert_user_error(res, "--substitute needs calibration data", out=out)
    res = run("lesion", SAMPLE.model, "--layer", LAYER, "--eval-data", small_eval,
              "--channels", "1,x", "--out", out)
    assert res.exit_code == 2 and "give integers such as 0,3,7" in res.output
    assert not out.exists()


def test_cli_channels_options_reach_the_report(tmp_path):
    out = tmp_path / "rep"
    res = run("channels", SAMPLE.model, "--data", SAMPLE.calibration, "--limit", 64,
              "--layer", LAYER, "--positions", 5, "--peers", 3, "--seed", 4, "--format", "json",
              "--out", out)
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    params = report["metadata"]["parameters"]
    assert params["layers"] == [LAYER] and params["n_positions"] == 5
    assert params["k_peers"] == 3 and params["seed"] == 4 and params["data"]["limit"] == 64
    assert [la["layer"] for la in report["channels"]["layers"]] == [LAYER]
    assert report["channels"]["n_positions"] == 5
    assert report["metadata"]["data"]["calibration"]["n_samples"] == 64
    assert report["metadata"]["executor"] == {"kind": "local", "jobs": 1}


def test_cli_channels_user_error(tmp_path):
    out = tmp_path / "rep"
    res = run("channels", SAMPLE.model, "--data", SAMPLE.calibration, "--layer", "nope",
              "--out", out)
    assert_user_error(res, "nope", out=out)
