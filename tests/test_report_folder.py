"""Report folders: claimed with an exclusive create before any work (of two runs exactly
one gets the folder), released on failure and Ctrl-C, written all-or-nothing; without
--out a rerun replaces the default report."""

import json
import os
import subprocess
import sys
import threading

import pytest
from cli_helpers import assert_user_error, run

import onnxdiag.report.write as write_module
from onnxdiag.commands.base import ReportTarget
from onnxdiag.data.sample import get_sample
from onnxdiag.errors import OutputError
from onnxdiag.report.write import (
    CLAIM_NAME,
    check_report_folder,
    claim_report_folder,
    write_report,
)

SAMPLE = get_sample()
FILES = {"report.txt": "new", "table.csv": "a,b\n"}


def _siblings(path):
    return sorted(p.name for p in path.parent.iterdir())


def test_two_threads_claiming_one_folder_exactly_one_wins(tmp_path):
    folder, n = tmp_path / "rep", 8
    barrier, won, lost = threading.Barrier(n), [], []

    def contend():
        barrier.wait()
        try:
            won.append(claim_report_folder(folder))
        except OutputError as exc:
            lost.append(str(exc))

    threads = [threading.Thread(target=contend) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == n - 1
    assert all("being written by another onnxdiag run" in m for m in lost), lost
    won[0].write(FILES)
    assert sorted(os.listdir(folder)) == sorted(FILES)  # the marker is not part of it
    assert _siblings(folder) == ["rep"]  # no temporary folder left


def test_two_processes_with_the_same_out_exactly_one_succeeds(tmp_path):
    out = tmp_path / "rep"
    cmd = [sys.executable, "-m", "onnxdiag", "analyze", str(SAMPLE.model), "--data",
           str(SAMPLE.calibration), "--limit", "32", "--out", str(out)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 1], results
    loser = next(err for code, err in results if code == 1).strip()
    assert loser.startswith("error: Report folder") and "\n" not in loser
    assert ("being written by another onnxdiag run" in loser
            or "already exists and is not empty" in loser), loser
    report = json.loads((out / "report.json").read_text())
    assert report["metadata"]["parameters"]["data"]["limit"] == 32
    assert not (out / CLAIM_NAME).exists() and _siblings(out) == ["rep"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failed_run_releases_the_claim_and_removes_what_it_created(tmp_path, error):
    folder = tmp_path / "a" / "b" / "rep"
    with pytest.raises(error), claim_report_folder(folder):
        assert (folder / CLAIM_NAME).is_file()
        raise error()
    assert list(tmp_path.iterdir()) == []
    existing = tmp_path / "mine"
    existing.mkdir()
    with pytest.raises(error), claim_report_folder(existing):
        raise error()
    assert existing.is_dir() and list(existing.iterdir()) == []  # kept: not ours


def test_a_claimed_folder_is_refused_to_every_other_writer(tmp_path):
    folder = tmp_path / "rep"
    with claim_report_folder(folder) as claim:
        for attempt in (lambda: claim_report_folder(folder, overwrite=True),
                        lambda: check_report_folder(folder, overwrite=True),
                        lambda: write_report(folder, FILES, overwrite=True)):
            with pytest.raises(OutputError, match=rf"pid {os.getpid()} on .*another --out"):
                attempt()
        claim.write(FILES)
    assert sorted(os.listdir(folder)) == sorted(FILES)


def test_a_stale_claim_of_a_dead_process_is_broken(tmp_path):
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = tmp_path / "rep"
    folder.mkdir()
    (folder / CLAIM_NAME).write_text(f"{socket.gethostname()} {dead.pid} 0123abcd")
    with claim_report_folder(folder) as claim:
        claim.write(FILES)
    assert sorted(os.listdir(folder)) == sorted(FILES)
    assert _siblings(folder) == ["rep"]


def test_a_lost_claim_writes_nothing(tmp_path):
    folder = tmp_path / "rep"
    with claim_report_folder(folder) as claim:
        (folder / CLAIM_NAME).unlink()
        with pytest.raises(OutputError, match="no longer claimed by this run"):
            claim.write(FILES)
    assert not folder.exists() and list(tmp_path.iterdir()) == []


def test_overwrite_keeps_the_old_report_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    folder = tmp_path / "rep"
    folder.mkdir()
    (folder / "old.txt").write_text("old")

    def taken(tmp, dest):
        raise OutputError("taken meanwhile")

    with claim_report_folder(folder, overwrite=True) as claim:
        monkeypatch.setattr(write_module, "_rename_onto", taken)
        with pytest.raises(OutputError, match="taken meanwhile"):
            claim.write(FILES)
    assert os.listdir(folder) == ["old.txt"] and _siblings(folder) == ["rep"]
    monkeypatch.undo()
    with claim_report_folder(folder, overwrite=True) as claim:
        claim.write(FILES)
    assert sorted(os.listdir(folder)) == sorted(FILES)
    assert _siblings(folder) == ["rep"]


def test_rerun_without_out_replaces_the_default_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["analyze", SAMPLE.model, "--data", SAMPLE.calibration]
    for limit in (16, 24):
        res = run(*args, "--limit", limit)
        assert res.exit_code == 0, res.output
    default = tmp_path / "onnxdiag-report" / "analyze"
    report = json.loads((default / "report.json").read_text())
    assert report["metadata"]["parameters"]["data"]["limit"] == 24
    assert _siblings(default) == ["analyze"]
    # The same folder named with --out is refused (--overwrite replaces it) ...
    assert_user_error(run(*args, "--limit", 8, "--out", default), "--overwrite")
    assert run(*args, "--limit", 8, "--out", default, "--overwrite").exit_code == 0
    # ... and a default folder holding files that are not a report is never replaced.
    (default / "report.json").unlink()
    assert_user_error(run(*args, "--limit", 8), "already exists and is not empty")
    assert (default / "report.txt").exists()


def test_report_target_without_write_claims_nothing(tmp_path):
    with ReportTarget(tmp_path / "rep", write=False).claim("analyze") as claim:
        assert claim is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", [".", ".."])
def test_the_working_folder_itself_is_never_a_report_folder(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("mine")
    with pytest.raises(OutputError, match="has no name of its own"):
        claim_report_folder(name, overwrite=True)
    assert os.listdir(tmp_path) == ["mine.txt"]
