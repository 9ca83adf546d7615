"""report.json against its published JSON Schema; report.html (plots) and its browser check."""

import json
import re
import shutil
import subprocess

import pytest
from click.testing import CliRunner

from onnxdiag.cli import cli
from onnxdiag.data.sample import get_sample
from onnxdiag.errors import OnnxDiagError
from onnxdiag.report.schema import load_schema, validate_report

jsonschema = pytest.importorskip("jsonschema")
SAMPLE = get_sample()


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Report folders of the verbs, each run once on the bundled sample (small limits)."""
    root = tmp_path_factory.mktemp("reports")
    data = ["--data", SAMPLE.calibration, "--limit", 120]
    series = [SAMPLE.model.parent / "checkpoints" / f"ckpt_{i:03d}.onnx" for i in (0, 5, 10, 15)]
    commands = {
        "analyze": ["analyze"],
        "readouts": ["readouts", SAMPLE.model, *data],
        "select": ["select", *series, *data, "--eval-data", SAMPLE.evaluation, "--jobs", 1],
        "channels": ["channels", SAMPLE.model, *data],
        "rr": ["rr", SAMPLE.model, *data],
        "sweep": ["sweep", SAMPLE.model, *data, "--sparsity", "0.5:0.7:0.1", "--allocations",
                  "erk,rr", "--repairs", "cr+bn"],
        "prune-sweep": ["prune-sweep", SAMPLE.model, "--data", SAMPLE.calibration, "--limit", 120,
                        "--eval-data", SAMPLE.evaluation, "--ratios", "0.25,0.5", "--scores",
                        "magnitude,random"],
    }
    out = {}
    for name, args in commands.items():
        res = run(*args, "--out", root / name)
        assert res.exit_code == 0, res.output
        out[name] = root / name
    return out


def test_schema_is_a_valid_draft_2020_12_schema():
    jsonschema.Draft202012Validator.check_schema(load_schema())


@pytest.mark.parametrize("verb", ["analyze", "readouts", "select", "channels", "rr", "sweep",
                                  "prune-sweep"])
def test_reports_validate_against_the_published_schema(reports, verb):
    report = json.loads((reports[verb] / "report.json").read_text())
    validate_report(report)
    assert report["metadata"]["command"] == verb
    if verb != "select":  # one model: its hash makes the report reproducible
        from onnxdiag.model.io import load_model, model_hash

        assert report["metadata"]["model_sha256"] == model_hash(load_model(SAMPLE.model))
        header = (reports[verb] / "report.txt").read_text().splitlines()[1]
        assert header == f"model sha256 {report['metadata']['model_sha256'][:16]}…"


def test_schema_rejects_a_broken_report(reports):
    report = json.loads((reports["select"] / "report.json").read_text())
    broken = dict(report, metadata={k: v for k, v in report["metadata"].items() if k != "tool"})
    with pytest.raises(OnnxDiagError, match="metadata.*tool"):
        validate_report(broken)
    wrong_type = json.loads(json.dumps(report))
    wrong_type["selection"]["evaluation"]["last"]["index"] = "fifteen"
    with pytest.raises(OnnxDiagError, match="selection/evaluation/last/index"):
        validate_report(wrong_type)


def _images(page: str) -> list[str]:
    return re.findall(r"<img alt='([^']*)' src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)


def test_html_has_one_decodable_plot_per_section(reports):
    pytest.importorskip("matplotlib")
    import base64

    # analyze: readouts, channel axes, RR curves, transition scan; readouts: its readouts;
    # rr: RR curves + scan; sweep: accuracy vs sparsity + per-layer sparsity bars;
    # channels: channel axes + the higher-order structure by depth (§B4).
    expected = {"analyze": 4, "readouts": 1, "select": 1, "channels": 2, "rr": 2, "sweep": 2,
                "prune-sweep": 1}
    for verb, n in expected.items():
        page = (reports[verb] / "report.html").read_text()
        imgs = _images(page)
        assert len(imgs) == n, verb
        for _, b64 in imgs:
            assert base64.b64decode(b64)[:8] == b"\x89PNG\r\n\x1a\n"
        # The summary tables of report.txt are embedded, escaped.
        txt = (reports[verb] / "report.txt").read_text()
        assert txt.splitlines()[0].replace("&", "&amp;").replace("<", "&lt;") in page
        assert "http://" not in page and "https://" not in page  # self-contained


def test_analyze_html_has_a_plot_for_every_section_it_computes(reports):
    pytest.importorskip("matplotlib")
    import base64

    report = json.loads((reports["analyze"] / "report.json").read_text())
    computed = {name for name in ("readouts", "channels", "repairability")
                if isinstance(report.get(name), dict) and not report[name].get("skipped")}
    assert computed == {"readouts", "channels", "repairability"}
    assert report["repairability"]["transition"]["cells"]
    titles = [t for t, _ in _images((reports["analyze"] / "report.html").read_text())]
    assert titles == ["Readouts", "Channel axes: I_X vs I(T;Y)",
                      "Relative repairability per layer", "Label-free transition scan"]
    for _, b64 in _images((reports["analyze"] / "report.html").read_text()):
        png = base64.b64decode(b64)
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000  # a drawn figure


def test_channel_axes_scatter_from_per_channel_axes():
    """A channel section that keeps only the two axes per channel (``axes``) gets the
    I_X vs I(T;Y) scatter, like the channels verb's full scores."""
    pytest.importorskip("matplotlib")
    from onnxdiag.report.html import render_html

    layer = {"layer": "conv", "input_capture_vs_task_info": 0.5, "noise_floor": {"floor": 0.1},
             "axes": {"input_capture": [0.1, 0.5, 0.9], "task_info": [0.2, 0.1, 0.4]}}
    page = render_html({"metadata": {"command": "analyze"}, "channels": {"layers": [layer]}})
    assert [t for t, _ in _images(page)] == ["Channel axes: I_X vs I(T;Y)"]
    del layer["axes"]
    page = render_html({"metadata": {"command": "analyze"}, "channels": {"layers": [layer]}})
    assert [t for t, _ in _images(page)] == ["Channel axes per layer"]


def test_without_matplotlib_the_cli_says_how_to_get_html(tmp_path, monkeypatch):
    import onnxdiag.report.html as html

    monkeypatch.setattr(html, "have_plotting", lambda: False)
    res = CliRunner().invoke(cli, ["readouts", str(SAMPLE.model), "--data",
                                   str(SAMPLE.calibration), "--limit", "50", "--out",
                                   str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "r" / "report.html").exists()
    assert (tmp_path / "r" / "report.json").exists()
    assert "pip install 'onnxdiag[report]'" in res.output


def test_rerender_from_report_json(reports, tmp_path):
    pytest.importorskip("matplotlib")
    from onnxdiag.report.html import main

    folder = tmp_path / "copy"
    shutil.copytree(reports["select"], folder)
    (folder / "report.html").unlink()
    assert main([str(folder / "report.json")]) == 0
    assert len(_images((folder / "report.html").read_text())) == 1


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium")
@pytest.mark.parametrize("verb", ["select", "channels", "sweep"])
def test_html_loads_in_headless_chromium(reports, verb, tmp_path):
    pytest.importorskip("matplotlib")
    page = reports[verb] / "report.html"
    n_images = len(_images(page.read_text()))
    base = ["chromium", "--headless", "--no-sandbox", "--disable-gpu",
            f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*base, "--enable-logging=stderr", "--v=0",
                          "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    # The page's own check: every <img> decoded (complete and non-zero natural width).
    assert f'data-images-ok="{n_images}"' in dom.stdout
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line]
    assert not [c for c in console if "error" in c.lower() or "Uncaught" in c], console
    shot = tmp_path / "shot.png"
    subprocess.run([*base, "--hide-scrollbars", "--window-size=1200,1600",
                    f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120,
                   check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_published_schema_has_no_duplicate_keys():
    """json.load keeps the last of two equal keys silently; the schema must not rely on it."""
    import json
    from importlib import resources

    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
        return dict(pairs)

    text = resources.files("onnxdiag").joinpath("schema/report.schema.json").read_text()
    json.loads(text, object_pairs_hook=no_duplicates)
