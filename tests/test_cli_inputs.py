"""Input errors every verb reports in one line (labels outside the model's classes, integer
images fed to a float model) and the --cast opt-in."""

import numpy as np
import pytest
from cli_helpers import assert_user_error, run

from onnxdiag.data.sample import get_sample

SAMPLE = get_sample()


@pytest.fixture(scope="module")
def bad_labels(tmp_path_factory):
    d = tmp_path_factory.mktemp("labels")
    z = np.load(SAMPLE.calibration)
    y = z["labels"][:128].copy()
    y[5] = 12  # the sample model has 10 classes
    np.savez(d / "bad.npz", input=z["input"][:128], labels=y)
    return d / "bad.npz"


@pytest.mark.parametrize("verb", [
    ["channels", "--data", "{bad}"],
    ["lesion", "--layer", "/stem/stem.0/Conv", "--sample", "1", "--eval-data", "{bad}"],
    ["prune", "--sparsity", "0.5", "--data", "{bad}", "--eval-data", "{bad}", "-o", "{out}.onnx"],
    ["prune-channels", "--score", "magnitude", "--eval-data", "{bad}", "-o", "{out}.onnx"],
    ["readouts", "--data", "{bad}"],
], ids=lambda v: v[0])
def test_a_label_outside_the_classes_is_one_line(verb, bad_labels, tmp_path):
    out = tmp_path / "pruned"
    args = [a.format(bad=bad_labels, out=out) for a in verb]
    result = run(args[0], SAMPLE.model, *args[1:], "--out", tmp_path / "report")
    assert_user_error(result, "12", tmp_path / "report", tmp_path / "pruned.onnx")
    assert "0..9" in result.stderr or "[0, 10)" in result.stderr  # the value and the range


@pytest.fixture(scope="module")
def uint8_images(tmp_path_factory):
    d = tmp_path_factory.mktemp("uint8")
    z = np.load(SAMPLE.calibration)
    np.savez(d / "u8.npz", input=np.round(z["input"][:64] * 255).astype(np.uint8),
             labels=z["labels"][:64])
    return d / "u8.npz"


def test_integer_images_into_a_float_model_are_refused_unless_cast(uint8_images, tmp_path):
    refused = run("readouts", SAMPLE.model, "--data", uint8_images, "--out", tmp_path / "a")
    assert_user_error(refused, "uint8", tmp_path / "a")
    cast = run("readouts", SAMPLE.model, "--data", uint8_images, "--cast", "--out", tmp_path / "b")
    assert cast.exit_code == 0, cast.output
    warning = [line for line in cast.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warning) == 1 and "255" in warning[0], cast.stderr
    assert "Traceback" not in cast.output
