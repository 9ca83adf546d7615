"""A self-contained ``report.html`` beside ``report.json`` (plots embedded as PNG data URIs).

Plotting needs matplotlib, the optional ``[report]`` extra. Without it
:func:`render_html` returns None and the JSON and text reports are written as usual.
The page needs no network access and runs no script other than a four-line check that
marks ``<body data-images-ok>`` once every plot has decoded (used by the browser test).

Each plot is drawn from the report dict alone, so a report written earlier can be
re-rendered: ``python -m onnxdiag.report.html report.json``.
"""

from __future__ import annotations

import html
import json
import sys
from collections.abc import Callable
from pathlib import Path

from .plots import band_span as _band_span
from .plots import figure as _figure
from .plots import finite as _finite
from .plots import plot_channels, plot_readouts, plot_repairability, plot_selection
from .plots import png as _png
from .select_plots import plot_pruned_selection
from .structure_plots import plot_depth, plot_orthogonality

HTML_EXTRA_HINT = "pip install 'onnxdiag[report]' (matplotlib) to also get report.html"

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;
max-width:1100px;color:#222;padding:0 1rem}
h1{font-size:1.5rem}h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #ddd}
table.meta{border-collapse:collapse;font-size:.9rem}
table.meta td{border-bottom:1px solid #eee;padding:.2rem .8rem .2rem 0;vertical-align:top}
figure{margin:1rem 0}figcaption{font-size:.85rem;color:#555}
img{max-width:100%;height:auto;border:1px solid #eee}
pre{background:#f7f7f7;padding:1rem;overflow-x:auto;font-size:.8rem}
"""

_CHECK = """<script>
window.addEventListener('load',function(){var i=document.images,ok=true;
for(var k=0;k<i.length;k++){if(!i[k].complete||i[k].naturalWidth===0){ok=false;}}
document.body.setAttribute('data-images-ok',ok?String(i.length):'false');});
</script>"""


def have_plotting() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------- figures
# Those of the readouts family and analyze are in .plots; the pruning verbs' are here.

def _plot_sweep(report: dict) -> list:
    sw = report.get("sweep")
    if not isinstance(sw, dict) or not sw.get("cells"):
        return []
    cells = [c for c in sw["cells"] if not c.get("error")]
    metric = sw.get("metric") or "agreement"
    if not any(c.get(metric) is not None for c in cells):
        metric = "agreement"
    repairs = sw.get("repairs") or sorted({c["repair"] for c in cells})
    rules = sw.get("allocations") or sorted({c["allocation"] for c in cells})
    fig, axes = _figure(len(repairs), 1, width=5 * max(1, min(len(repairs), 3)), height=4.2)
    for ax, rep in zip(axes, repairs):
        for k, rule in enumerate(rules):
            pts = sorted((c["sparsity"], c.get(metric)) for c in cells
                         if c["allocation"] == rule and c["repair"] == rep)
            ax.plot([q[0] for q in pts], _finite(q[1] for q in pts), "o-", ms=3,
                    color=f"C{k}", label=rule)
        tr = (sw.get("transitions") or {}).get("rr") or {}
        if tr.get("repair", rep) == rep:
            _band_span(ax, tr.get("band"), "C1", "agreement band (rr)")
        ax.set_title(f"repair: {rep}", fontsize=9)
        ax.set_xlabel("global sparsity S")
        ax.set_ylabel(metric)
        ax.legend(fontsize=6)
    out = [(f"{metric.capitalize()} vs sparsity per allocation",
            "One line per allocation rule; shaded: the label-free transition band of rr "
            "(agreement 0.9 → 0.5).", _png(fig))]
    out += _plot_allocation_bars(cells, repairs[0] if repairs else None)
    return out


def _plot_allocation_bars(cells: list, repair) -> list:
    """Per-layer sparsity of every rule at the middle sparsity of the sweep."""
    cells = [c for c in cells if c.get("layer_sparsity") and c["repair"] == repair]
    if not cells:
        return []
    grid = sorted({c["sparsity"] for c in cells})
    S = grid[len(grid) // 2]
    at = {c["allocation"]: c["layer_sparsity"] for c in cells if c["sparsity"] == S}
    rules = list(at)
    layers = list(at[rules[0]])
    fig, axes = _figure(1, 1, width=10, height=4.2)
    ax = axes[0]
    w = 0.8 / len(rules)
    for k, rule in enumerate(rules):
        ax.bar([i + k * w for i in range(len(layers))],
               _finite(at[rule].get(L) for L in layers), width=w, label=rule)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(layers))])
    ax.set_xticklabels(layers, rotation=60, ha="right", fontsize=6)
    ax.set_ylabel("layer sparsity")
    ax.legend(fontsize=7)
    return [(f"Per-layer sparsity by allocation at S = {S:g}", "", _png(fig))]


def _plot_prune_sweep(report: dict) -> list:
    ps = report.get("prune_sweep")
    if not isinstance(ps, dict) or not ps.get("rows"):
        return []
    rows = [r for r in ps["rows"] if r.get("kept_fraction") is not None]
    scores = list(dict.fromkeys(r["score"] for r in rows))
    auc = ps.get("auc") or {}
    fig, axes = _figure(1, 1, width=9, height=4.4)
    ax = axes[0]
    dense = ps.get("dense_accuracy")
    after_dense = ps.get("dense_accuracy_after_recovery")
    for k, score in enumerate(scores):
        pts = sorted((r["kept_fraction"], r.get("accuracy_before"), r.get("accuracy_after"))
                     for r in rows if r["score"] == score)
        xs = [1.0] + [p[0] for p in pts] if dense is not None else [p[0] for p in pts]
        before = ([dense] if dense is not None else []) + [p[1] for p in pts]
        a = (auc.get(score) or {}).get("before")
        ax.plot(xs, _finite(before), "o-", ms=3, color=f"C{k}",
                label=score + ("" if a is None else f" (AUC {a:.3f})"))
        if any(p[2] is not None for p in pts):
            after = ([after_dense] if dense is not None else []) + [p[2] for p in pts]
            ax.plot(xs, _finite(after), "s--", ms=3, color=f"C{k}")
    ax.set_xlabel("kept channel fraction")
    ax.set_ylabel("top-1 accuracy")
    ax.invert_xaxis()
    ax.legend(fontsize=7)
    return [("Accuracy vs kept channels per score",
             "Solid: right after pruning; dashed: after recovery fine-tuning; the first point "
             "is the dense model. AUC: normalised area under the solid curve.", _png(fig))]


PLOTTERS: list[Callable[[dict], list]] = [plot_readouts, plot_selection, plot_pruned_selection,
                                           plot_channels,
                                           plot_depth, plot_orthogonality, plot_repairability,
                                           _plot_sweep, _plot_prune_sweep]


# --------------------------------------------------------------------------- page

def _meta_rows(meta: dict) -> list[tuple[str, str]]:
    rows = [(k, meta.get(k)) for k in ("command", "created", "tool_version", "model_path",
                                        "model_sha256", "python", "platform", "onnx_version")]
    data = meta.get("data") or {}
    for role, d in data.items():
        if isinstance(d, dict):
            rows.append((f"data ({role})", f"{d.get('path')} — {d.get('n_samples')} samples"))
    params = {k: v for k, v in (meta.get("parameters") or {}).items() if v is not None}
    rows.append(("parameters", json.dumps(params, default=str)[:600]))
    return [(k, str(v)) for k, v in rows if v is not None]


def render_html(report: dict, text: str | None = None) -> str | None:
    """The report as one self-contained HTML page, or None without matplotlib."""
    if not have_plotting():
        return None
    meta = report.get("metadata") or {}
    command = meta.get("command", "report")
    figures = []
    for plot in PLOTTERS:
        figures += plot(report)
    parts = [
        "<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
        f"<title>onnxdiag {html.escape(command)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>onnxdiag {html.escape(command)}</h1>",
        "<h2>Run</h2><table class='meta'>",
        *(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>"
          for k, v in _meta_rows(meta)),
        "</table>",
    ]
    if figures:
        parts.append("<h2>Plots</h2>")
    for title, caption, png in figures:
        parts.append(f"<figure><img alt='{html.escape(title)}' "
                     f"src='data:image/png;base64,{png}'>"
                     f"<figcaption><b>{html.escape(title)}.</b> {html.escape(caption)}"
                     "</figcaption></figure>")
    if text:
        parts += ["<h2>Summary tables</h2>", f"<pre>{html.escape(text)}</pre>"]
    parts += [_CHECK, "</body></html>"]
    return "\n".join(parts)


def main(argv=None) -> int:
    """Re-render report.html from a report.json: ``python -m onnxdiag.report.html FILE``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m onnxdiag.report.html REPORT.json", file=sys.stderr)
        return 1
    src = Path(args[0])
    txt = src.with_name("report.txt")
    page = render_html(json.loads(src.read_text()),
                       txt.read_text() if txt.is_file() else None)
    if page is None:
        print(f"error: {HTML_EXTRA_HINT}", file=sys.stderr)
        return 1
    dest = src.with_name("report.html")
    dest.write_text(page, encoding="utf-8")
    print(dest)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
