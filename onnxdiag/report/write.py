"""Write a report folder atomically: all files appear together or none do."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..errors import OutputError
from ..model.io import ensure_writable_dir


def check_report_folder(folder, *, overwrite: bool = False) -> Path:
    """Raise OutputError unless ``folder`` can receive a report (checked before any work)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"Report path '{folder}' is a file; give a folder name with --out.")
    if folder.is_dir() and any(folder.iterdir()) and not overwrite:
        raise OutputError(
            f"Report folder '{folder}' already exists and is not empty; choose another --out "
            "or pass --overwrite."
        )
    ensure_writable_dir(folder.parent)
    return folder


def write_report(folder, files: dict[str, str | bytes], *, overwrite: bool = False) -> Path:
    """Write ``files`` ({name: content}) into ``folder``, atomically.

    When ``files`` holds ``report.json`` and matplotlib is installed, ``report.html`` is
    added beside it (plots embedded; see :mod:`.html`).
    The files are written to a temporary sibling folder which is then renamed into
    place. An existing non-empty ``folder`` is replaced only with ``overwrite``
    (its old contents are removed only after the new report is complete).

    Raises:
        OutputError: the folder exists (without ``overwrite``) or is not writable.
    """
    folder = check_report_folder(folder, overwrite=overwrite)
    files = _with_html(files)
    parent = ensure_writable_dir(folder.parent)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{folder.name}.tmp-"))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; a new folder is 0777 & ~umask
        for name, content in files.items():
            mode = "wb" if isinstance(content, bytes) else "w"
            with open(tmp / name, mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as f:
                f.write(content)
        old = None
        if folder.exists():
            old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
            os.replace(folder, old)
        os.replace(tmp, folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
