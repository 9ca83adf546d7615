"""Shared helpers of the zoo studies (tools/study_*.py): finding the runs of a zoo made by
tools/train_zoo.py, the per-run raw results under docs/studies/ (small CSV/JSON, committed),
the statistics every table uses (mean ± sd over training seeds, bootstrap intervals,
permutation p-values) and printing Markdown tables.

Every study has two phases: *measure* (needs the zoo's ONNX checkpoints; writes one raw
result file per run under ``--results``, skipping runs already there) and *tables* (reads
only the raw results). ``--from-results`` runs the second phase alone, so every table of
docs/STUDIES.md is regenerated from the committed files without models."""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from pathlib import Path

ARCH_ORDER = ("resnet18", "resnet34", "vgg16_bn", "mobilenetv2", "vit")
RESULTS = Path(__file__).resolve().parents[1] / "docs" / "studies"
BOOT = 2000  # bootstrap resamples of every interval


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


# ---------------------------------------------------------------------------- raw results

def write_rows(path: Path, rows: list[dict]) -> None:
    """One raw result table (CSV, onnxdiag's writer); the folder is created."""
    from onnxdiag.report.text import rows_to_csv

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(rows_to_csv(rows))
    tmp.replace(path)


def read_rows(path: Path) -> list[dict]:
    """A raw result table back, numbers as floats (empty cells: None)."""
    import csv

    with path.open(newline="") as f:
        return [{k: _num(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _num(v: str):
    if v in ("", None):
        return None
    if v in ("True", "False"):
        return v == "True"
    try:
        return float(v)
    except ValueError:
        return v


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


def read_json(path: Path, default=None):
    return json.loads(path.read_text()) if path.is_file() else default


def run_meta(m: dict) -> dict:
    """What the tables need to know about a run (kept next to its raw results)."""
    return {"arch": m["arch"], "schedule": m["schedule"], "seed": m["seed"],
            "width": m.get("width", 1.0), "batchnorm": m.get("batchnorm", True),
            "n_parameters": m["n_parameters"], "n_checkpoints": len(m["checkpoints"]),
            "noise": m["data"]["label_noise_fraction"], "n_train": m["data"]["n_train"],
            "best": m["results"]["best"], "last": m["results"]["last"]}


def results_arg(p) -> None:
    """The --results / --from-results options every study shares."""
    p.add_argument("--results", type=Path, default=RESULTS,
                   help="folder of the raw results (default: docs/studies of the repository)")
    p.add_argument("--from-results", action="store_true",
                   help="only print the tables from the raw results (no zoo, no models)")
    p.add_argument("--tables", default=None,
                   help="with --from-results: only these tables (comma list of the study's "
                        "table keys, see its tables())")


# ------------------------------------------------------------------------------ statistics

def mean_sd(values) -> tuple[float, float, int]:
    """Mean, sample sd (0 for one value) and n of the finite values."""
    import numpy as np

    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    if v.size == 0:
        return float("nan"), float("nan"), 0
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0, int(v.size)


def pm(values, digits: int = 2, n: bool = True) -> str:
    """'mean ± sd (n)' of values; '–' without any."""
    m, sd, k = mean_sd(values)
    if k == 0:
        return "–"
    return f"{m:.{digits}f} ± {sd:.{digits}f}" + (f" ({k})" if n else "")


def bootstrap_ci(n_items: int, stat, *, reps: int = BOOT, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of ``stat(indices)`` over resamples of ``range(n_items)`` with
    replacement (non-finite resample values dropped)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    vals = np.array([stat(rng.integers(0, n_items, n_items)) for _ in range(reps)], float)
    vals = vals[np.isfinite(vals)]
    if vals.size == 0:
        return float("nan"), float("nan")
    a = (1 - level) / 2
    return float(np.quantile(vals, a)), float(np.quantile(vals, 1 - a))


def spearman(x, y) -> float:
    import numpy as np
    from scipy.stats import spearmanr

    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.ptp(x[ok]) == 0 or np.ptp(y[ok]) == 0:
        return float("nan")
    return float(spearmanr(x[ok], y[ok])[0])


def pearson(x, y) -> float:
    import numpy as np

    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.ptp(x[ok]) == 0 or np.ptp(y[ok]) == 0:
        return float("nan")
    return float(np.corrcoef(x[ok], y[ok])[0, 1])


def ci_text(est: float, lo: float, hi: float, digits: int = 2) -> str:
    if not math.isfinite(est):
        return "–"
    return f"{est:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _version() -> str:
    import onnxdiag

    return onnxdiag.__version__
