"""Data sources → validated batches (onnxdiag.data, feeds, sources, images)."""

from __future__ import annotations

import io
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image

from onnxdiag.data.source import Batch, ImageOptions, InputSpec, load_labels, open_data
from onnxdiag.errors import DataError, OnnxDiagError
from onnxdiag.runtime.progress import progress

F32 = np.dtype("float32")
SPEC = [InputSpec("input", (None, 1, 4, 4), F32)]


def make_x(n: int = 10, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 1, 4, 4))


def collect(source) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, list[int]]:
    """(x, labels, indices, batch sizes) of all batches."""
    batches = list(source.batches())
    assert all(isinstance(b, Batch) for b in batches)
    x = np.concatenate([b.feeds["input"] for b in batches])
    labels = None if batches[0].labels is None else np.concatenate([b.labels for b in batches])
    return x, labels, np.concatenate([b.indices for b in batches]), [len(b) for b in batches]


# --- every source kind --------------------------------------------------------------------------


def test_npy_is_cast_rebatched_and_reiterable(tmp_path):
    x = make_x(10)
    np.save(tmp_path / "x.npy", x)
    source = open_data(tmp_path / "x.npy", SPEC, batch_size=4)
    assert (source.kind, source.n_samples, source.has_labels) == ("npy", 10, False)
    for _ in range(2):
        got, labels, indices, sizes = collect(source)
        assert sizes == [4, 4, 2] and labels is None
        assert got.dtype == F32 and got.flags.c_contiguous
        np.testing.assert_array_equal(got, x.astype(F32))
        np.testing.assert_array_equal(indices, np.arange(10))


def test_npz_with_labels_key(tmp_path):
    x, y = make_x(6), np.array([0, 1, 2, 0, 1, 2])
    np.savez(tmp_path / "d.npz", input=x, labels=y)
    source = open_data(str(tmp_path / "d.npz"), SPEC, batch_size=5)
    _, labels, _, sizes = collect(source)
    assert source.has_labels and sizes == [5, 1]
    np.testing.assert_array_equal(labels, y)
    assert labels.dtype == np.int64


@pytest.mark.parametrize("name,text", [
    ("y.txt", "0\n1\n2\n1\n"),
    ("y.csv", "label\n0\n1\n2\n1\n"),
    ("y.npy", None),
])
def test_labels_file(tmp_path, name, text):
    path = tmp_path / name
    if text is None:
        np.save(path, np.array([0.0, 1.0, 2.0, 1.0]))
    else:
        path.write_text(text)
    np.testing.assert_array_equal(load_labels(path), [0, 1, 2, 1])
    source = open_data({"input": make_x(4)}, SPEC, labels=path)
    np.testing.assert_array_equal(collect(source)[1], [0, 1, 2, 1])


def write_images(folder, sizes, mode="RGB"):
    folder.mkdir(parents=True, exist_ok=True)
    for k, (h, w) in enumerate(sizes):
        pixels = (np.arange(h * w * 3).reshape(h, w, 3) * (k + 1)) % 256
        Image.fromarray(pixels.astype(np.uint8), "RGB").convert(mode).save(folder / f"im{k}.png")


def test_image_folder_with_classes_nchw_gray(tmp_path):
    write_images(tmp_path / "imgs" / "dog", [(4, 4), (4, 4)])
    write_images(tmp_path / "imgs" / "cat", [(4, 4)])
    source = open_data(tmp_path / "imgs", SPEC, batch_size=2)
    x, labels, indices, sizes = collect(source)
    assert source.class_names == ("cat", "dog") and source.kind == "image_folder"
    np.testing.assert_array_equal(labels, [0, 1, 1])
    assert x.shape == (3, 1, 4, 4) and x.dtype == F32 and sizes == [2, 1]
    assert 0 <= x.min() and x.max() <= 1
    expected = np.asarray(Image.open(tmp_path / "imgs" / "cat" / "im0.png").convert("L")) / 255
    np.testing.assert_allclose(x[0, 0], expected, rtol=1e-6)
    meta = source.describe()
    assert meta["class_names"] == ["cat", "dog"] and meta["image_options"]["layout"] == "NCHW"


def test_image_folder_flat_nhwc_resize_crop_normalise(tmp_path):
    write_images(tmp_path / "flat", [(10, 12), (12, 10), (8, 8)])
    spec = [InputSpec("img", (None, 8, 8, 3), F32)]
    options = ImageOptions(mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25])
    source = open_data(tmp_path / "flat", spec, image_options=options)
    batch = next(source.batches())
    assert not source.has_labels and batch.labels is None
    assert batch.feeds["img"].shape == (3, 8, 8, 3)
    raw = np.asarray(Image.open(tmp_path / "flat" / "im2.png").convert("RGB")) / 255
    np.testing.assert_allclose(batch.feeds["img"][2], (raw - 0.5) / 0.25, rtol=1e-5)


def test_loader_script_generator_is_reiterable(tmp_path):
    script = tmp_path / "load.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        CALLS = []
        def load_data():
            CALLS.append(1)
            for i in range(3):
                yield {"input": np.full((3, 1, 4, 4), i, dtype=np.float64),
                       "labels": np.array([i, i, i])}
        def one():
            return {"input": np.zeros((2, 1, 4, 4))}
    """))
    source = open_data(str(script), SPEC, batch_size=4)
    assert source.has_labels and source.n_samples is None
    for _ in range(2):
        x, labels, indices, sizes = collect(source)
        assert sizes == [4, 4, 1]
        np.testing.assert_array_equal(labels, [0, 0, 0, 1, 1, 1, 2, 2, 2])
        np.testing.assert_array_equal(indices, np.arange(9))
    assert source.n_samples == 9 and source.describe()["n_source"] == 9
    single = open_data(f"{script}:one", SPEC)
    assert single.n_samples == 2 and single.kind == "loader_script"


class Reader:
    """ONNX Runtime CalibrationDataReader duck type."""

    def __init__(self, n_items=3):
        self.items = [{"input": make_x(2, seed=i).astype(F32)} for i in range(n_items)]
        self.position = 0

    def get_next(self):
        if self.position == len(self.items):
            return None
        self.position += 1
        return self.items[self.position - 1]


class RewindReader(Reader):
    def rewind(self):
        self.position = 0


def test_calibration_reader_is_one_shot():
    source = open_data(Reader(), SPEC, batch_size=4)
    assert source.kind == "reader"
    assert collect(source)[3] == [4, 2]
    with pytest.raises(DataError, match="one-shot stream and was already read"):
        source.batches()


def test_calibration_reader_with_rewind_is_reiterable():
    source = open_data(RewindReader(), SPEC, batch_size=5)
    first, second = collect(source), collect(source)
    np.testing.assert_array_equal(first[0], second[0])
    assert first[3] == [5, 1]


def test_iterable_of_dicts_list_and_generator():
    x = make_x(7)
    items = [{"input": x[i:i + 2]} for i in range(0, 7, 2)]
    listed = open_data(items, SPEC, batch_size=3)
    assert listed.n_samples == 7 and collect(listed)[3] == [3, 3, 1]
    streamed = open_data(iter(items), SPEC, batch_size=3)
    got, _, indices, sizes = collect(streamed)
    np.testing.assert_array_equal(got, x.astype(F32))
    assert sizes == [3, 3, 1] and indices.tolist() == list(range(7))


# --- subsets ------------------------------------------------------------------------------------


def test_limit_seed_subset_is_reproducible_sorted_and_source_independent():
    x = make_x(50)
    a = open_data({"input": x}, SPEC, limit=12, seed=3)
    b = open_data({"input": x}, SPEC, limit=12, seed=3)
    c = open_data({"input": x}, SPEC, limit=12, seed=4)
    assert a.indices.tolist() == b.indices.tolist() == sorted(set(a.indices.tolist()))
    assert a.indices.size == 12 and a.indices.tolist() != c.indices.tolist()
    stream = open_data(({"input": x[i:i + 7]} for i in range(0, 50, 7)), SPEC, limit=12, seed=3)
    got, _, indices, _ = collect(stream)
    np.testing.assert_array_equal(indices, a.indices)
    np.testing.assert_array_equal(got, x[a.indices].astype(F32))
    assert stream.describe()["indices"] == a.indices.tolist()


def test_limit_without_seed_takes_first_and_stops_pulling():
    pulled = []

    def endless():
        i = 0
        while True:
            pulled.append(i)
            yield {"input": make_x(3, seed=i)}
            i += 1

    source = open_data(endless(), SPEC, limit=5, batch_size=2)
    assert collect(source)[2].tolist() == [0, 1, 2, 3, 4]
    assert len(pulled) == 2
    assert open_data({"input": make_x(9)}, SPEC, limit=5).indices.tolist() == [0, 1, 2, 3, 4]


def test_int_inputs_are_cast_within_range():
    spec = [InputSpec("ids", (None, 3), np.dtype("int32"))]
    source = open_data({"ids": np.arange(6, dtype=np.int64).reshape(2, 3)}, spec)
    assert next(source.batches()).feeds["ids"].dtype == np.int32
    with pytest.raises(DataError, match="value 4294967296 at sample 1, which does not fit int32"):
        open_data({"ids": np.array([[0, 1, 2], [0, 1, 2**32]])}, spec)


def test_progress_is_silent_off_terminal(capsys):
    assert list(progress(range(3), 3, "x")) == [0, 1, 2]
    assert capsys.readouterr().err == ""


def test_progress_on_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    assert list(progress(iter(range(3)), None, "stream")) == [0, 1, 2]
    source = open_data({"input": make_x(5)}, SPEC, batch_size=2, progress=True)
    assert [len(b) for b in source.batches()] == [2, 2, 1]
    assert "stream" in sys.stderr.getvalue()


# --- errors -------------------------------------------------------------------------------------


def error_of(*args, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        source = open_data(*args, **kwargs)
        list(source.batches())
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, OnnxDiagError)
    return message


@pytest.mark.parametrize("data,expected", [
    ({"images": make_x(2)}, "Data input 'images' is not an input of the model; the model's "
                            "inputs are: 'input' (float32 [N,1,4,4])."),
    ({}, "Model input 'input' (float32 [N,1,4,4]) is missing from the data"),
    ({"input": make_x(2)[:, 0]}, "has shape (2, 4, 4) (rank 3), but the model expects rank 4"),
    ({"input": np.zeros((2, 3, 4, 4))}, "axis 1 is 3, but the model expects 1"),
    ({"input": np.zeros((0, 1, 4, 4))}, "empty (0 samples)"),
    ({"input": np.full((2, 1, 4, 4), "a")}, "has dtype <U1, but the model expects"),
    ({"input": make_x(3), "labels": [0, 1]}, "There are 2 labels for 3 samples"),
    ({"input": make_x(3), "labels": [0, 1.5, 2]}, "Label 1.5 at sample 1"),
    ({"input": make_x(2), "labels": [0, -1]}, "Label -1 at sample 1"),
    ({"input": make_x(2), "labels": ["a", "b"]}, "give integer class indices"),
])
def test_array_errors(data, expected):
    assert expected in error_of(data, SPEC)


def test_float_to_int_is_refused():
    spec = [InputSpec("ids", (None, 3), np.dtype("int64"))]
    assert "has dtype float64, but the model expects 'ids' (int64 [N,3])" in error_of(
        {"ids": np.zeros((2, 3))}, spec)


def test_nan_names_first_bad_sample_in_arrays_and_streams():
    x = make_x(10)
    x[7, 0, 1, 1], x[8, 0, 0, 0] = np.nan, np.inf
    assert "has NaN at sample 7" in error_of({"input": x}, SPEC)
    chunks = ({"input": x[i:i + 3]} for i in range(0, 10, 3))
    assert "has NaN at sample 7 (the first bad sample)" in error_of(chunks, SPEC)
    # only the selected samples are checked
    assert open_data({"input": x}, SPEC, limit=5).n_samples == 5


@pytest.mark.parametrize("chunk_bytes", [64 << 20, 100])
def test_value_check_flags_exactly_the_samples_a_full_cast_flags(monkeypatch, chunk_bytes):
    """The value check decides from each chunk's extremes; against a brute-force cast of
    every selected value: float64 data with NaN, ±inf or a value beyond float32 at random
    places, contiguous, reversed and shuffled row selections, chunks of 100 bytes (one
    row each) or many rows. It fails exactly when a selected value is not finite as
    float32, naming the first such sample of the selection."""
    from onnxdiag.data import feeds

    monkeypatch.setattr(feeds, "_CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(5)
    spec = [InputSpec("input", (None, 1, 4, 4), F32)]
    for trial in range(60):
        x = rng.normal(size=(12, 1, 4, 4)) * 1e3
        for _ in range(trial % 3):
            x.flat[rng.integers(x.size)] = rng.choice([np.nan, np.inf, -np.inf, 1e39, -4e38])
        rows = [np.arange(12), np.arange(3, 9), np.arange(12)[::-1],
                rng.permutation(12)[:7]][trial % 4]
        with np.errstate(over="ignore"):
            bad = ~np.isfinite(x[rows].astype(np.float32)).reshape(len(rows), -1).all(axis=1)
        if not bad.any():
            feeds.check_values({"input": x}, spec, rows)
            continue
        with pytest.raises(DataError, match=f"at sample {rows[np.argmax(bad)]} "):
            feeds.check_values({"input": x}, spec, rows)


def test_file_errors(tmp_path):
    assert "Data path" in error_of(tmp_path / "missing.npz", SPEC)
    assert "does not exist" in error_of(tmp_path / "missing.npz", SPEC)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    assert "Cannot read" in error_of(tmp_path / "bad.npz", SPEC)
    (tmp_path / "d.csv").write_text("1\n")
    assert "unsupported type '.csv'" in error_of(tmp_path / "d.csv", SPEC)
    np.save(tmp_path / "x.npy", make_x(2))
    two = SPEC + [InputSpec("mask", (None, 4), F32)]
    assert "holds one array, but the model's inputs are" in error_of(tmp_path / "x.npy", two)
    assert "Labels file" in error_of({"input": make_x(2)}, SPEC, labels=tmp_path / "no.txt")
    (tmp_path / "y.txt").write_text("0\ncat\n")
    assert "Label 'cat' on line 2" in error_of({"input": make_x(2)}, SPEC,
                                               labels=tmp_path / "y.txt")


def test_labels_given_twice(tmp_path):
    np.savez(tmp_path / "d.npz", input=make_x(2), labels=[0, 1])
    assert "Labels are given twice" in error_of(tmp_path / "d.npz", SPEC, labels=[0, 1])


def test_fixed_batch_dimension():
    spec = [InputSpec("input", (4, 1, 4, 4), F32)]
    source = open_data({"input": make_x(8)}, spec, batch_size=64)
    assert source.batch_size == 4 and collect(source)[3] == [4, 4]
    assert "fixed batch size of 4, but 6 samples" in error_of({"input": make_x(6)}, spec)
    assert "pass --limit 4" in error_of({"input": make_x(6)}, spec)
    stream = ({"input": make_x(3)} for _ in range(2))
    assert "fixed batch size of 4, but a batch of 2" in error_of(stream, spec)


@pytest.mark.parametrize("body,expected", [
    ("raise RuntimeError('no disk')", "failed to import (RuntimeError: no disk)"),
    ("def load_data():\n    raise ValueError('boom')", "raised ValueError: boom"),
    ("def load_data():\n    return 3", "returned a int, not a dict of arrays"),
    ("def other():\n    return {}", "has no function 'load_data'; it defines: 'other'"),
    ("def load_data():\n    yield [1, 2]", "Item 0 of the loader script"),
    ("def load_data():\n    yield {'input': __import__('numpy').zeros((1, 1, 4, 4))}\n"
     "    raise KeyError('x')", "raised KeyError: 'x' while producing item 1"),
])
def test_loader_script_errors(tmp_path, body, expected):
    script = tmp_path / "loader.py"
    script.write_text(body + "\n")
    assert expected in error_of(str(script), SPEC)


def test_stream_item_errors():
    good = {"input": make_x(2)}
    assert "Item 1 of the data iterable" in error_of(iter([good, 5]), SPEC)
    labelled = {"input": make_x(2), "labels": [0, 1]}
    assert "lacks a 'labels' key, unlike item 0" in error_of(iter([labelled, good]), SPEC)
    assert "There are 5 labels for the 4 samples" in error_of(
        iter([good, good]), SPEC, labels=[0, 1, 2, 3, 4])
    assert "only 3 labels, but the data iterable (list_iterator) has sample 3" in error_of(
        iter([good, good]), SPEC, labels=[0, 1, 2])
    assert "yielded no samples" in error_of(iter([]), SPEC)
    assert "is not supported" in error_of(42, SPEC)


def test_image_folder_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    assert "holds no images" in error_of(tmp_path / "empty", SPEC)
    write_images(tmp_path / "mixed", [(4, 4)])
    write_images(tmp_path / "mixed" / "a", [(4, 4)])
    assert "mixes 1 top-level images" in error_of(tmp_path / "mixed", SPEC)
    write_images(tmp_path / "broken", [(4, 4)])
    (tmp_path / "broken" / "im1.png").write_bytes(b"garbage")
    assert "Cannot read image" in error_of(tmp_path / "broken", SPEC)
    assert "sample 1" in error_of(tmp_path / "broken", SPEC)
    ambiguous = [InputSpec("x", (None, 8, 8, 8), F32)]
    assert "Cannot tell the image layout" in error_of(tmp_path / "broken", ambiguous)
    write_images(tmp_path / "sizes", [(4, 4), (6, 5)])
    dynamic = [InputSpec("input", (None, 1, None, None), F32)]
    assert "Images differ in size" in error_of(tmp_path / "sizes", dynamic)


def test_bad_options():
    assert "limit must be at least 1" in error_of({"input": make_x(2)}, SPEC, limit=0)
    assert "batch_size must be at least 1" in error_of({"input": make_x(2)}, SPEC, batch_size=0)


def test_loader_script_imports_a_sibling_module(tmp_path):
    (tmp_path / "helper.py").write_text("import numpy as np\nX = np.ones((3, 1, 4, 4))\n")
    script = "import helper\ndef make():\n    return [{'input': helper.X}]\n"
    (tmp_path / "load.py").write_text(script)
    source = open_data(f"{tmp_path / 'load.py'}:make", SPEC)
    assert source.n_samples == 3 and source.kind == "loader_script"


def test_describe_and_plain_array():
    source = open_data(make_x(9), SPEC, limit=4, seed=0, batch_size=3)
    meta = source.describe()
    assert meta["kind"] == "arrays" and meta["n_source"] == 9 and meta["n_samples"] == 4
    assert meta["limit"] == 4 and meta["seed"] == 0 and meta["indices"] == source.indices.tolist()
    assert open_data(make_x(9), SPEC).describe()["indices"] is None


def test_image_folder_for_uint8_input(tmp_path):
    write_images(tmp_path / "u8", [(4, 4)])
    spec = [InputSpec("input", (None, 3, 4, 4), np.dtype("uint8"))]
    assert "pass scale=1 and no mean/std" in error_of(tmp_path / "u8", spec)
    batch = next(open_data(tmp_path / "u8", spec, image_options=ImageOptions(scale=1)).batches())
    assert batch.feeds["input"].dtype == np.uint8 and batch.feeds["input"].max() > 1


def test_batch_range_reads_the_same_batches_by_position():
    """An array source reads batches [start, stop) directly with the members batches()
    gives (the sharded statistics pass relies on it); a stream has no random access."""
    x = make_x(23)
    source = open_data({"input": x, "labels": np.arange(23)}, SPEC, batch_size=5, limit=17,
                       seed=4)
    assert source.random_access
    every = list(source.batches())
    part = list(source.batch_range(1, 3))
    assert [b.indices.tolist() for b in part] == [b.indices.tolist() for b in every[1:3]]
    for a, b in zip(part, every[1:3]):
        np.testing.assert_array_equal(a.feeds["input"], b.feeds["input"])
        np.testing.assert_array_equal(a.labels, b.labels)
    streamed = open_data(iter([{"input": x[:4]}]), SPEC, batch_size=2)
    assert not streamed.random_access
    with pytest.raises(DataError, match="cannot be read by batch position"):
        list(streamed.batch_range(0, 1))


def test_bundled_sample_is_found_from_any_working_folder(tmp_path, monkeypatch):
    """get_sample() finds models/sample beside the package, not only in the working folder."""
    from onnxdiag.data.sample import get_sample

    monkeypatch.chdir(tmp_path)
    sample = get_sample()
    assert sample.model.is_file() and sample.model.parent.name == "sample"
