"""Report folders: claimed before any work, written atomically (all files or none).

A run claims its folder with exclusive creates before it starts working
(:func:`claim_report_folder`): ``os.mkdir`` of the folder when it is new, then an
``O_EXCL`` marker file (:data:`CLAIM_NAME`) inside it, so of two runs given the same
folder exactly one goes on; the other is refused at once. The report is written into a
temporary sibling folder and renamed onto the claimed one at the end
(:meth:`ReportClaim.write`). On any failure before that, Ctrl-C included, the claim is
released and the folders this run created are removed (:meth:`ReportClaim.release`).

A claim left by a process that was killed (same host, process gone) is stale and is
broken by the next run. This module imports only the standard library (and, to render
report.html, :mod:`.html`).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import uuid
from pathlib import Path

from ..errors import OutputError

#: The marker file that holds a report folder for one run: "HOST PID TOKEN".
CLAIM_NAME = ".onnxdiag-claim"


class ReportClaim:
    """One run's hold on its report folder ``path``; a context manager that releases the
    claim on exit unless :meth:`write` completed."""

    def __init__(self, path: Path, token: str, made: list[Path]):
        self.path, self.token, self.made = path, token, made
        self.written = self.released = False

    @property
    def marker(self) -> Path:
        return self.path / CLAIM_NAME

    def write(self, files: dict[str, str | bytes]) -> Path:
        """Write ``files`` ({name: content}) as the folder's whole content, atomically.

        When ``files`` holds ``report.json`` and matplotlib is installed, ``report.html``
        is added (see :mod:`.html`). Whatever the folder held before (an old report being
        replaced) is removed only once the new report is in place.

        Raises:
            OutputError: the claim was lost (another run took the folder meanwhile).
        """
        if self.written or self.released:
            raise RuntimeError(f"the claim on {self.path} is no longer held")
        files = _with_html(files)
        tmp = Path(tempfile.mkdtemp(dir=self.path.parent, prefix=f".{self.path.name}.tmp-"))
        old = None
        try:
            _fill(tmp, files)
            old = _move_contents_aside(self.path)
            self._drop_marker()
            _rename_onto(tmp, self.path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            _restore(old, self.path)
            raise
        self.written = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.path

    def _drop_marker(self) -> None:
        if _read(self.marker) != self.token:
            raise OutputError(f"Report folder '{self.path}' is no longer claimed by this run "
                              f"(its {CLAIM_NAME} file was removed or replaced); nothing was "
                              "written. Do not run two onnxdiag commands into one folder.")
        self.marker.unlink()

    def release(self) -> None:
        """Give the folder up without writing: remove the marker (when still ours) and the
        folders this run created (when still empty). Idempotent."""
        if self.written or self.released:
            return
        self.released = True
        if _read(self.marker) == self.token:
            self.marker.unlink(missing_ok=True)
        for folder in reversed(self.made):
            try:
                folder.rmdir()
            except OSError:
                break  # not empty (or gone): keep it and its parents

    def __enter__(self) -> ReportClaim:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __fspath__(self) -> str:
        return str(self.path)


def claim_report_folder(folder, *, overwrite: bool = False,
                        replace_report: bool = False) -> ReportClaim:
    """Claim ``folder`` for one run, before any work.

    A missing folder (and missing parents) is created; an existing one must be empty,
    unless ``overwrite`` (anything in it is replaced at the end) or ``replace_report``
    (it is replaced when it holds an onnxdiag report: the default folder of a command).

    Raises:
        OutputError: the path is a file, cannot be created or written, is not empty, or
            another run holds it.
    """
    folder = Path(folder)
    if folder.name in ("", ".", ".."):
        raise OutputError(f"Report folder '{folder}' has no name of its own; give a new "
                          "folder name with --out (its contents are replaced as a whole).")
    made = _make_folders(folder)
    token = f"{socket.gethostname()} {os.getpid()} {uuid.uuid4().hex}"
    try:
        _take_marker(folder, token)
    except BaseException:
        for path in reversed(made):
            _rmdir_quiet(path)
        raise
    claim = ReportClaim(folder, token, made)
    try:
        _check_contents(folder, overwrite=overwrite, replace_report=replace_report)
    except BaseException:
        claim.release()
        raise
    return claim


def check_report_folder(folder, *, overwrite: bool = False) -> Path:
    """Raise OutputError unless ``folder`` could receive a report now (check only: nothing
    is created or claimed; :func:`claim_report_folder` holds it for a run)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"Report path '{folder}' is a file; give a folder name with --out.")
    if (folder / CLAIM_NAME).exists() and not _stale(folder / CLAIM_NAME):
        raise _busy(folder)
    if folder.is_dir():
        _check_contents(folder, overwrite=overwrite, replace_report=False)
    parent = _existing_ancestor(folder.parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"Output folder '{parent}' is not writable; choose a writable location.")
    return folder


def write_report(folder, files: dict[str, str | bytes], *, overwrite: bool = False) -> Path:
    """Write ``files`` into ``folder`` atomically: a :class:`ReportClaim` writes into the
    folder it holds; a path is claimed here first (refused when another run holds it or,
    without ``overwrite``, when it is not empty)."""
    if isinstance(folder, ReportClaim):
        return folder.write(files)
    with claim_report_folder(folder, overwrite=overwrite) as claim:
        return claim.write(files)


# --------------------------------------------------------------------------- claiming

def _make_folders(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; return those created, outermost first."""
    missing = []
    for path in (folder, *folder.parents):
        if path.exists():
            break
        missing.append(path)
    made = []
    for path in reversed(missing):
        try:
            os.mkdir(path)
        except FileExistsError:
            continue  # made by someone else meanwhile: not ours to remove
        except OSError as exc:
            for p in reversed(made):
                _rmdir_quiet(p)
            raise OutputError(f"Cannot create output folder '{path}' ({exc.strerror}); "
                              "choose a writable location.") from exc
        made.append(path)
    if not folder.is_dir():
        raise OutputError(f"Report path '{folder}' is a file; give a folder name with --out.")
    return made


def _take_marker(folder: Path, token: str) -> None:
    marker = folder / CLAIM_NAME
    for _ in range(2):
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _read(marker)
            if holder is not None and _stale(marker) and _break_stale(marker, holder):
                continue
            raise _busy(folder) from None
        except OSError as exc:
            raise OutputError(f"Output folder '{folder}' is not writable ({exc.strerror}); "
                              "choose a writable location.") from exc
        with os.fdopen(fd, "w") as f:
            f.write(token)
        return
    raise _busy(folder)


def _check_contents(folder: Path, *, overwrite: bool, replace_report: bool) -> None:
    entries = [p for p in folder.iterdir() if p.name != CLAIM_NAME]
    if not entries or overwrite or (replace_report and (folder / "report.json").is_file()):
        return
    raise OutputError(f"Report folder '{folder}' already exists and is not empty; choose "
                      "another --out or pass --overwrite.")


def _busy(folder: Path) -> OutputError:
    holder = (_read(folder / CLAIM_NAME) or "").split()
    who = f" (pid {holder[1]} on {holder[0]})" if len(holder) == 3 else ""
    return OutputError(f"Report folder '{folder}' is being written by another onnxdiag "
                       f"run{who}; wait for it to finish or choose another --out.")


def _stale(marker: Path) -> bool:
    """Whether the claim in ``marker`` belongs to a process of this host that is gone."""
    parts = (_read(marker) or "").split()
    if len(parts) != 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, another user's
    return False


def _break_stale(marker: Path, seen: str) -> bool:
    """Remove the stale claim ``seen``; False when a live one replaced it meanwhile."""
    grave = marker.with_name(f"{CLAIM_NAME}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(marker, grave)
    except FileNotFoundError:
        return True  # another run broke it first: try to claim again
    if _read(grave) != seen:  # we took a live claim made meanwhile: give it back
        try:
            os.link(grave, marker)
        except OSError:
            pass
        grave.unlink(missing_ok=True)
        return False
    grave.unlink(missing_ok=True)
    return True


# --------------------------------------------------------------------------- writing

def _fill(tmp: Path, files: dict[str, str | bytes]) -> None:
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; a new folder is 0777 & ~umask
    for name, content in files.items():
        if isinstance(content, bytes):
            (tmp / name).write_bytes(content)
        else:
            (tmp / name).write_text(content, encoding="utf-8")


def _rename_onto(tmp: Path, folder: Path) -> None:
    """Rename ``tmp`` onto the empty ``folder``: one atomic step (POSIX rename replaces an
    empty directory). Fails when another run claimed ``folder`` meanwhile."""
    try:
        os.replace(tmp, folder)
    except OSError as exc:
        raise OutputError(f"Could not put the report into '{folder}' ({exc.strerror or exc}); "
                          "another onnxdiag run took the folder meanwhile, so nothing was "
                          "written. Do not run two onnxdiag commands into one folder.") from exc


def _move_contents_aside(folder: Path) -> Path | None:
    """Move everything but the marker into a sibling folder (None when there is nothing)."""
    entries = [p for p in folder.iterdir() if p.name != CLAIM_NAME]
    if not entries:
        return None
    old = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.old-"))
    for p in entries:
        os.rename(p, old / p.name)
    return old


def _restore(old: Path | None, folder: Path) -> None:
    if old is None:
        return
    for p in old.iterdir():
        try:
            os.rename(p, folder / p.name)
        except OSError:
            pass
    _rmdir_quiet(old)


def _with_html(files: dict[str, str | bytes]) -> dict[str, str | bytes]:
    """Add report.html rendered from report.json (and report.txt) when plotting is available."""
    if "report.json" not in files or "report.html" in files:
        return files
    import json

    from .html import render_html

    text = files.get("report.txt")
    page = render_html(json.loads(files["report.json"]),
                       text if isinstance(text, str) else None)
    return files if page is None else {**files, "report.html": page}


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _rmdir_quiet(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


def _existing_ancestor(path: Path) -> Path:
    path = Path(path) if str(path) else Path(".")
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
