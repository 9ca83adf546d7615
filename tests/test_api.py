"""The Python API mirrors the CLI: every command has a documented function."""

import subprocess
import sys

import onnxdiag
from onnxdiag.cli import load_all


def test_every_cli_command_has_a_python_verb():
    cli = load_all()
    assert set(cli.commands) == set(onnxdiag.CLI_VERBS)
    for command, name in onnxdiag.CLI_VERBS.items():
        fn = getattr(onnxdiag, name)
        assert callable(fn) and fn.__doc__, command
        assert name in onnxdiag.__all__ and name in dir(onnxdiag)


def test_unknown_attribute_is_an_attribute_error():
    try:
        onnxdiag.no_such_verb  # noqa: B018
    except AttributeError as exc:
        assert "no_such_verb" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_import_is_cheap_and_does_not_load_onnxruntime():
    code = "import sys, onnxdiag; print('onnxruntime' in sys.modules, 'onnx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"]


def test_readme_example_runs_on_the_sample():
    from onnxdiag.data.sample import get_sample

    s = get_sample()
    result = onnxdiag.analyze(str(s.model), data=onnxdiag.DataRequest(str(s.calibration), limit=64),
                              report=onnxdiag.ReportTarget(write=False))
    assert result.folder is None
    value = result.report["readouts"]["readouts"]["values"]["head_grad_feature"]
    assert value > 0 and f"{value:.4g}"[:4] in result.summary.replace(" ", "")


def test_the_readme_python_block_runs_verbatim(monkeypatch, tmp_path):
    """README.md's Python API block, executed as written from the repository root (its one
    output file goes to this test's folder instead of /tmp)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    section = text[text.index("## Python API"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert block.count("/tmp/onnxdiag-small.onnx") == 1
    block = block.replace("/tmp/onnxdiag-small.onnx", str(tmp_path / "small.onnx"))
    monkeypatch.chdir(root)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102 - the documented example
    assert scope["result"].folder is None and scope["sel"].report["selection"]["selected_path"]
    assert scope["small"].report["prune_channels"]["emitted"]["file_bytes"] > 0


def test_every_options_record_is_exported():
    import dataclasses

    for name in ("ReadoutOptions", "SelectOptions", "ChannelsOptions", "LesionOptions",
                 "RROptions", "PruneOptions", "SweepOptions", "PrunerOptions",
                 "ChannelPruneOptions", "PruneSweepOptions", "Recovery"):
        record = getattr(onnxdiag, name)
        assert dataclasses.is_dataclass(record) and name in onnxdiag.__all__
