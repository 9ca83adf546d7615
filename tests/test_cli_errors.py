"""CLI error paths: a user error is one line and exit 1, a bug one line and exit 3
(``--debug`` / ONNXDIAG_DEBUG show the traceback, a worker's too), Ctrl-C exit 130 with
nothing left behind."""

import os
import signal
import subprocess
import sys
import time

import pytest
from cli_helpers import run

import onnxdiag.commands.analyze as analyze_module
import onnxdiag.selection.checkpoints as checkpoints_module
import onnxdiag.selection.probe as probe_module
from onnxdiag.data.sample import get_sample

SAMPLE = get_sample()
INTERNAL = ("internal error: ValueError: boom in two lines (please report it; rerun with "
            "--debug for the traceback)")


def _boom(*args, **kwargs):
    raise ValueError("boom in\ntwo lines")


def _stderr_lines(result) -> list[str]:
    return result.stderr.strip().splitlines()


def test_a_bug_is_one_line_and_exit_3(monkeypatch):
    monkeypatch.delenv("ONNXDIAG_DEBUG", raising=False)
    monkeypatch.setattr(analyze_module, "inspect_model", _boom)
    result = run("inspect")
    assert result.exit_code == 3
    assert _stderr_lines(result) == [INTERNAL]
    assert result.stdout == ""


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback_of_a_bug(monkeypatch, how):
    monkeypatch.setattr(analyze_module, "inspect_model", _boom)
    if how == "env":
        monkeypatch.setenv("ONNXDIAG_DEBUG", "1")
    result = run(*(["--debug"] if how == "flag" else []), "inspect")
    assert result.exit_code == 3
    lines = _stderr_lines(result)
    assert lines[0] == "Traceback (most recent call last):"
    assert any("in _boom" in line for line in lines)
    assert lines[-1] == INTERNAL


def test_onnxdiag_debug_0_is_off(monkeypatch):
    monkeypatch.setattr(analyze_module, "inspect_model", _boom)
    monkeypatch.setenv("ONNXDIAG_DEBUG", "0")
    assert _stderr_lines(run("inspect")) == [INTERNAL]


def test_user_error_with_debug_keeps_exit_1_and_adds_the_traceback(tmp_path):
    result = run("--debug", "inspect", tmp_path / "nope.onnx")
    assert result.exit_code == 1
    lines = _stderr_lines(result)
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1].startswith("error: ") and "does not exist" in lines[-1]


def test_a_bug_in_every_worker_is_an_internal_error_with_the_workers_traceback(monkeypatch,
                                                                            tmp_path):
    """select: when a bug (not a user error) stops every checkpoint, the command fails
    with exit 3; --debug prints the unit's own traceback."""
    def broken_scoring(checkpoint, probe, evaluation, options):
        return {}["no such key"]

    monkeypatch.setattr(checkpoints_module, "score_checkpoint", broken_scoring)
    ckpt = SAMPLE.checkpoints / "ckpt_015.onnx"
    args = ["select", ckpt, ckpt, "--data", SAMPLE.calibration, "--limit", 16, "--jobs", 1]
    plain = run(*args, "--out", tmp_path / "a")
    assert plain.exit_code == 3
    assert _stderr_lines(plain) == [
        "internal error: UnitFailure: No checkpoint could be scored; the first error was: "
        "KeyError: 'no such key' (please report it; rerun with --debug for the traceback)"]
    assert not (tmp_path / "a").exists()
    debug = run("--debug", *args, "--out", tmp_path / "b")
    assert debug.exit_code == 3
    worker = debug.stderr.split("The failed unit of work's own traceback (worker):")[1]
    assert "in broken_scoring" in worker and "KeyError: 'no such key'" in worker
    assert not (tmp_path / "b").exists()


def test_keyboard_interrupt_exits_130_and_leaves_no_report(monkeypatch, tmp_path):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(probe_module, "probe_model", interrupted)
    out = tmp_path / "deep" / "rep"
    result = run("analyze", SAMPLE.model, "--data", SAMPLE.calibration, "--limit", 16,
                 "--out", out)
    assert result.exit_code == 130
    assert _stderr_lines(result)[-1] == "interrupted"
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []  # the claimed folder and its new parent: gone


def test_sigint_exits_130_and_releases_the_claimed_folder(tmp_path):
    """A real Ctrl-C (SIGINT) while a verb works: exit 130, one line, nothing left. The data
    come from a loader script that yields one batch, says so, then waits, so the signal
    always lands in the middle of the work."""
    out, marker = tmp_path / "rep", tmp_path / "reading"
    script = tmp_path / "slow.py"
    script.write_text(
        "import time\nimport numpy as np\nfrom pathlib import Path\n\n"
        "def load_data():\n"
        f"    z = np.load({str(SAMPLE.calibration)!r})\n"
        "    yield {'input': z['input'][:32], 'labels': z['labels'][:32]}\n"
        f"    Path({str(marker)!r}).touch()\n"
        "    time.sleep(60)\n"
        "    yield {'input': z['input'][32:64], 'labels': z['labels'][32:64]}\n")
    # SIGINT as a terminal delivers it: a shell's background job (how CI may run) starts
    # with it ignored, which the child would inherit, and Python then never sees it
    proc = subprocess.Popen([sys.executable, "-m", "onnxdiag", "readouts", str(SAMPLE.model),
                             "--data", f"{script}:load_data", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    assert (out / ".onnxdiag-claim").exists()  # the folder was claimed before the work
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "interrupted"
    assert "Traceback" not in stderr and stdout == ""
    marker.unlink()
    assert sorted(os.listdir(tmp_path)) == ["slow.py"]


def test_the_api_refuses_a_readout_verb_without_probe_data():
    import onnxdiag
    from onnxdiag.errors import OnnxDiagError

    for verb, model in ((onnxdiag.readouts_report, SAMPLE.model),
                        (onnxdiag.select_report, [SAMPLE.model])):
        with pytest.raises(OnnxDiagError, match="need.? a probe batch: pass --data"):
            verb(model, data=None, report=onnxdiag.ReportTarget(write=False))
