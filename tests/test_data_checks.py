"""Data checks against the model: dtype kinds (integers into a float input need ``cast``,
and then warn with the value range) and labels against the model's class count."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from PIL import Image

from onnxdiag.data.labels import check_label_range
from onnxdiag.data.source import DataWarning, InputSpec, open_data
from onnxdiag.errors import DataError

F32 = np.dtype("float32")
SPEC = [InputSpec("input", (None, 3, 4, 4), F32)]


def _pixels(n=6, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 3, 4, 4)).astype(np.uint8)


def _error(*args, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        list(open_data(*args, **kwargs).batches())
    assert "\n" not in str(info.value)
    return str(info.value)


def _sources(x, tmp_path):
    """The same samples as arrays, an .npy file, an .npz file, a list and a stream."""
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "x.npz", input=x)
    return {"arrays": {"input": x}, "npy": tmp_path / "x.npy", "npz": tmp_path / "x.npz",
            "list": [{"input": x[:3]}, {"input": x[3:]}],
            "stream": iter([{"input": x[:3]}, {"input": x[3:]}])}


@pytest.mark.parametrize("kind", ["arrays", "npy", "npz", "list", "stream"])
def test_integers_into_a_float_input_are_refused_without_cast(tmp_path, kind):
    message = _error(_sources(_pixels(), tmp_path)[kind], SPEC)
    assert "Data input 'input'" in message and "has dtype uint8" in message
    assert "expects 'input' (float32 [N,3,4,4])" in message
    assert "x.astype('float32') / 255" in message and "--cast" in message


@pytest.mark.parametrize("kind", ["arrays", "npy", "npz", "list", "stream"])
def test_cast_gives_the_values_as_they_are_and_warns_with_their_range(tmp_path, kind):
    x = _pixels()
    x[2, 0, 0, 0], x[4, 1, 1, 1] = 3, 250  # whatever the draw: the range is min..max
    with pytest.warns(DataWarning) as caught:
        source = open_data(_sources(x, tmp_path)[kind], SPEC, cast=True, batch_size=4)
    got = np.concatenate([b.feeds["input"] for b in source.batches()])
    assert got.dtype == F32
    np.testing.assert_array_equal(got, x.astype(F32))
    lo, hi = (int(x[:3].min()), int(x[:3].max())) if kind == "stream" else \
        (int(x.min()), int(x.max()))
    text = f"holds uint8 values {lo}..{hi}, cast to float32 as they are"
    assert len(caught) == 1 and text in str(caught[0].message)
    meta = source.describe()
    assert meta["cast"] is True and len(meta["notes"]) == 1 and text in meta["notes"][0]


def test_cast_range_covers_only_the_selected_samples():
    x = np.zeros((10, 3, 4, 4), np.int32)
    x[3], x[8] = 7, 900
    with pytest.warns(DataWarning, match=r"int32 values 0\.\.7,"):
        source = open_data({"input": x}, SPEC, cast=True, limit=5)
    assert source.indices.tolist() == [0, 1, 2, 3, 4]


def test_what_needs_no_cast_and_what_cast_cannot_fix():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float64 into float32: cast silently, as before
        source = open_data({"input": _pixels().astype(np.float64) / 255}, SPEC)
    assert source.describe()["notes"] == [] and source.describe()["cast"] is False
    assert "has dtype bool" in _error({"input": np.ones((2, 3, 4, 4), bool)}, SPEC)
    ids = [InputSpec("ids", (None, 3), np.dtype("int64"))]
    assert "or pass --cast" in _error({"ids": np.zeros((2, 3))}, ids)
    whole = open_data({"ids": np.array([[0.0, 1, 2], [3, 4, 5]])}, ids, cast=True)
    assert next(whole.batches()).feeds["ids"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert "value 1.5 at sample 1, which does not fit int64" in _error(
        {"ids": np.array([[0, 1, 2], [3, 1.5, 5]])}, ids, cast=True)
    assert "has dtype <U1" in _error({"input": np.full((2, 3, 4, 4), "a")}, SPEC, cast=True)


# -- labels against the model's class count ---------------------------------------------------

def _labelled(labels):
    return {"input": _pixels(len(labels)).astype(F32), "labels": np.asarray(labels)}


def test_label_range_in_memory_is_checked_at_once():
    source = open_data(_labelled([0, 1, 4, 2, 9, 5]), SPEC)
    with pytest.raises(DataError) as info:
        check_label_range(source, 5)
    message = str(info.value)
    assert message == ("Label 9 at sample 4 of the arrays data is outside the model's classes "
                       "0..4 (5 outputs); give labels that index this model's outputs (are "
                       "they, or the class sub-folders, for another model?).")
    assert check_label_range(open_data(_labelled([0, 4, 3]), SPEC), 5).n_classes == 5


def test_label_range_names_the_source_position_of_a_subset():
    picked = open_data(_labelled(np.zeros(20)), SPEC, limit=8, seed=1).indices.tolist()
    skipped = next(i for i in range(20) if i not in picked)
    labels = np.zeros(20, np.int64)
    labels[[skipped, picked[5]]] = [7, 6]  # only the selected samples count
    source = open_data(_labelled(labels), SPEC, limit=8, seed=1)
    with pytest.raises(DataError, match=f"Label 6 at sample {picked[5]} of "):
        check_label_range(source, 5)
    assert check_label_range(source, 7) is source  # label 7 is not among the selected


def test_label_range_of_a_stream_is_checked_as_it_is_read():
    items = [{"input": _pixels(3, s).astype(F32), "labels": y}
             for s, y in enumerate(([0, 1, 2], [3, 5, 0]))]
    source = check_label_range(open_data(iter(items), SPEC, batch_size=2), 5)
    batches = source.batches()
    assert next(batches).labels.tolist() == [0, 1]
    assert next(batches).labels.tolist() == [2, 3]
    with pytest.raises(DataError, match=r"Label 5 at sample 4 of the iterable data is outside "
                                        r"the model's classes 0\.\.4"):
        next(batches)


def test_label_range_of_class_folders_and_of_plain_labels(tmp_path):
    for k, name in enumerate(("ant", "bee", "cat")):
        (tmp_path / name).mkdir()
        Image.fromarray(np.full((4, 4, 3), 40 * k, np.uint8)).save(tmp_path / name / "a.png")
    source = open_data(tmp_path, SPEC)
    assert check_label_range(source, 3) is source
    with pytest.raises(DataError, match=rf"Label 2 at sample 2 of '{tmp_path}' is outside the "
                                        r"model's classes 0\.\.1 \(2 outputs\)"):
        check_label_range(source, 2)
    assert check_label_range([0, 2, 1], 3).dtype == np.int64
    with pytest.raises(DataError, match="Label 3 at sample 1 of the labels is outside"):
        check_label_range([0, 3], 3)
    with pytest.raises(DataError, match="Label -1 at sample 0 from y.txt is negative"):
        check_label_range(np.array([-1, 0]), 3, where="y.txt")
    unlabelled = open_data({"input": _pixels(2).astype(F32)}, SPEC)
    assert check_label_range(unlabelled, 3) is unlabelled
