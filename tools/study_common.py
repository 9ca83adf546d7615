"""Shared helpers of the zoo studies (tools/study_*.py): finding the runs of a zoo made by
tools/train_zoo.py and printing Markdown tables."""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from pathlib import Path

ARCH_ORDER = ("resnet18", "resnet34", "vgg16_bn", "mobilenetv2")


def load_runs(zoo: Path, names: list[str] | None = None) -> dict[str, dict]:
    """run name -> manifest for every COMPLETE run in `zoo` (in ARCH_ORDER, cosine first)."""
    runs = {}
    for m_path in sorted(zoo.glob("*/manifest.json")):
        m = json.loads(m_path.read_text())
        if not m.get("complete") or (names and m["run"] not in names):
            continue
        m["dir"] = m_path.parent
        runs[m["run"]] = m

    def key(name):
        m = runs[name]
        arch = ARCH_ORDER.index(m["arch"]) if m["arch"] in ARCH_ORDER else 99
        return (m["schedule"] != "cosine", arch, m["seed"])

    return {n: runs[n] for n in sorted(runs, key=key)}


def missing_runs(zoo: Path, runs: dict) -> list[str]:
    """Run folders in `zoo` that are not complete (still training or interrupted)."""
    return sorted(p.name for p in zoo.iterdir()
                  if p.is_dir() and (p / "checkpoints").is_dir() and p.name not in runs)


def ckpt_paths(m: dict) -> list[Path]:
    return [m["dir"] / "checkpoints" / r["path"] for r in m["checkpoints"]]


def fmt(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def table(header: list[str], rows: list[list]) -> str:
    """A Markdown table; floats are printed with fmt()."""
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    for r in rows:
        out.append("| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in r) + " |")
    return "\n".join(out)


def preamble(title: str, command: str, zoo: Path) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return (f"## {title}\n\n`{command}`\n\nzoo `{zoo}`; {when}; {platform.machine()}, "
            f"{_cores()} CPU cores; onnxdiag {_version()}\n")


def schedule_runs(zoo: Path, runs: dict, schedule: str, archs: str | None = None) -> dict:
    """The seed-0 runs of ``schedule`` among ``runs`` (optionally only the comma-separated
    ``archs``); exits with a one-line error when there is none."""
    chosen = {n: m for n, m in runs.items() if m["schedule"] == schedule and m["seed"] == 0
              and (not archs or m["arch"] in archs.split(","))}
    if not chosen:
        raise SystemExit(f"error: no complete {schedule} run in {zoo}")
    return chosen


def study_start(script: str, title: str, zoo: Path, argv, complete: dict,
                only: str | None = None) -> list[str]:
    """The opening parts of a study: its preamble with the command that reproduces it, and
    a note naming the zoo's unfinished runs (``complete``: load_runs(zoo); ``only``: a
    substring the names of the runs that matter contain)."""
    cmd = f"python tools/{script} " + " ".join(sys.argv[1:] if argv is None else argv)
    parts = [preamble(title, cmd, zoo)]
    missing = [n for n in missing_runs(zoo, complete) if only is None or only in n]
    if missing:
        parts.append(f"NOT included (not finished when this ran): {', '.join(missing)}")
    return parts


def emit(parts: list[str], out: Path | None) -> int:
    """Print the study's sections (and write them to ``out`` when given); exit status 0."""
    text = "\n\n".join(parts) + "\n"
    sys.stdout.write(text)
    if out:
        out.write_text(text)
    return 0


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _version() -> str:
    import onnxdiag

    return onnxdiag.__version__
