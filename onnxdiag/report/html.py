"""A self-contained ``report.html`` beside ``report.json`` (plots embedded as PNG data URIs).

Plotting needs matplotlib, the optional ``[report]`` extra. Without it
:func:`render_html` returns None and the JSON and text reports are written as usual.
The page needs no network access and runs no script other than a four-line check that
marks ``<body data-images-ok>`` once every plot has decoded (used by the browser test).

Each plot is drawn from the report dict alone, so a report written earlier can be
re-rendered: ``python -m onnxdiag.report.html report.json``.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

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

def _figure(ncols: int = 1, nrows: int = 1, *, width: float = 10.0, height: float = 3.6):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height * nrows), dpi=90)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _finite(values) -> list[float]:
    return [float("nan") if v is None else float(v) for v in values]


def _grid(n: int, ncols: int = 3):
    ncols = max(1, min(ncols, n))
    return ncols, math.ceil(n / ncols)


# Each plotter takes the report dict and returns [(title, caption, base64 png)].

def _plot_selection(report: dict) -> list:
    sel = report.get("selection")
    if not sel or not sel.get("checkpoints"):
        return []
    ok = [c for c in sel["checkpoints"] if c.get("error") is None and c.get("result")]
    if not ok:
        return []
    values = {}
    for c in ok:
        for name, v in c["result"]["readouts"]["values"].items():
            values.setdefault(name, []).append(v)
    names = [n for n, v in values.items() if n != "n_params" and len(set(map(str, v))) > 1]
    if not names:
        return []
    x = list(range(len(ok)))
    ev = sel.get("evaluation") or {}
    ncols, nrows = _grid(len(names))
    fig, axes = _figure(ncols, nrows, height=2.8)
    acc = sel.get("accuracy")
    for ax, name in zip(axes, names):
        ax.plot(x, _finite(values[name]), "o-", ms=3, color="C0")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("checkpoint", fontsize=8)
        ax.tick_params(labelsize=7)
        if acc:
            ax2 = ax.twinx()
            ax2.plot(x, [100 * a for a in acc], "-", color="0.6", lw=1)
            ax2.tick_params(labelsize=7, colors="0.5")
        pick = ((ev.get("readouts") or {}).get(name) or {}).get("selected")
        if pick and pick.get("index") is not None:
            ax.axvline(pick["index"], color="C3", ls="--", lw=1.2, label="selected")
        elif name == sel.get("select_by") and sel.get("selected") is not None:
            ax.axvline(sel["selected"], color="C3", ls="--", lw=1.2, label="selected")
        oracle = (ev.get("oracle_overall") or {}).get("index")
        if oracle is not None:
            ax.axvline(oracle, color="C2", ls=":", lw=1.2, label="oracle")
        for i in sel.get("flagged", []):
            ax.axvspan(i - 0.4, i + 0.4, color="0.85")
    for ax in axes[len(names):]:
        ax.set_visible(False)
    axes[0].legend(fontsize=7, loc="best")
    cap = ("Readouts (blue) per checkpoint; grey line: test accuracy (%) when evaluation "
           "data was given; red dashed: the readout's selected checkpoint; green dotted: "
           "the oracle; grey band: flagged (degenerate) checkpoints.")
    out = [("Readouts vs checkpoint", cap, _png(fig))]
    if sel.get("screening"):
        out += _plot_screening(sel, ok)
    return out


def _plot_screening(sel: dict, ok: list) -> list:
    acc = sel.get("accuracy")
    if not acc:
        return []
    fig, axes = _figure(2, 1, height=3.4)
    n_params = [c.get("n_params") for c in ok]
    name = sel.get("select_by")
    vals = [c["result"]["readouts"]["values"].get(name) for c in ok]
    axes[0].scatter(_finite(vals), [100 * a for a in acc], s=14)
    axes[0].set_xlabel(name)
    axes[0].set_ylabel("accuracy %")
    axes[1].scatter(_finite(n_params), [100 * a for a in acc], s=14, color="C1")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("parameters (baseline)")
    return [("Screening: readout and parameter count vs accuracy", "One point per model.",
             _png(fig))]


def _plot_channels(report: dict) -> list:
    ch = report.get("channels")
    if not ch or not ch.get("layers"):
        return []
    layers = [L for L in ch["layers"] if (L.get("scores") or {}).get("scores")]
    if not layers:
        return []
    ncols, nrows = _grid(len(layers), 4)
    fig, axes = _figure(ncols, nrows, height=2.6)
    for ax, L in zip(axes, layers):
        s = L["scores"]["scores"]
        ax.scatter(_finite(s["input_capture"]), _finite(s["task_info"]), s=8, alpha=0.7)
        floor = (L.get("noise_floor") or {}).get("floor")
        if floor is not None:
            ax.axhline(floor, color="C3", lw=0.8, ls="--")
        rho = L.get("input_capture_vs_task_info")
        rho_txt = "n/a" if rho is None else f"{rho:+.2f}"
        ax.set_title(f"{L['layer']}\nρ = {rho_txt}", fontsize=8)
        ax.set_xlabel("I_X (input capture)", fontsize=7)
        ax.set_ylabel("I(T;Y)", fontsize=7)
        ax.tick_params(labelsize=6)
    for ax in axes[len(layers):]:
        ax.set_visible(False)
    cap = ("Per layer, one point per channel: local axis I_X against task information "
           "I(T;Y); ρ is the Spearman correlation; dashed: the permutation noise floor.")
    return [("Channel axes: I_X vs I(T;Y)", cap, _png(fig))]


def _rr_curves(section) -> tuple[list, list]:
    """(grid, [(layer, RR values)]) from a ``curves`` dict (layers, grid, rr matrix)."""
    if not isinstance(section, dict):
        return [], []
    grid, layers, rr = section.get("grid"), section.get("layers"), section.get("rr")
    if not grid or not layers or not rr:
        return [], []
    return grid, list(zip(layers, rr))


def _band_span(ax, band, color, label):
    if isinstance(band, dict) and band.get("start") is not None and band.get("end") is not None:
        ax.axvspan(band["start"], band["end"], color=color, alpha=0.12, label=label)


def _plot_repairability(report: dict) -> list:
    sec = report.get("repairability")
    if not isinstance(sec, dict):
        return []
    grid, curves = _rr_curves(sec.get("curves"))
    out = []
    if curves:
        fig, axes = _figure(1, 1, width=8, height=4.2)
        ax = axes[0]
        for name, vals in curves:
            ax.plot(grid, _finite(vals), lw=1.2, label=name)
        ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
        ax.set_xlabel("layer sparsity s")
        ax.set_ylabel("RR(ℓ, s)")
        ax.legend(fontsize=6, ncol=2)
        out.append(("Relative repairability per layer",
                    "RR(ℓ, s) = (D_repair + ε)/(D_raw + ε) with only layer ℓ pruned (SPEC C2); "
                    "below 1: CR+BN repairs part of the damage.", _png(fig)))
    tr = sec.get("transition")
    if isinstance(tr, dict) and tr.get("cells"):
        cells = sorted(tr["cells"], key=lambda c: c.get("sparsity", 0))
        keys = sorted({c.get("repair") for c in cells if c.get("repair")})
        fig, axes = _figure(1, 1, width=8, height=3.6)
        ax = axes[0]
        for rep in keys or [None]:
            pts = [c for c in cells if c.get("repair") == rep]
            ax.plot([c["sparsity"] for c in pts], _finite(c.get("agreement") for c in pts),
                    "o-", ms=3, label=f"agreement ({rep})" if rep else "agreement")
        _band_span(ax, tr.get("band"), "C1", "agreement band")
        _band_span(ax, tr.get("cts_band"), "C4", "CTS band")
        ax.set_xlabel("global sparsity S")
        ax.set_ylabel("top-1 agreement with dense")
        ax.legend(fontsize=7)
        out.append(("Label-free transition scan",
                    f"Allocation {tr.get('allocation')}; shaded: the predicted band (SPEC C4).",
                    _png(fig)))
    return out


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


PLOTTERS: list[Callable[[dict], list]] = [_plot_selection, _plot_channels,
                                           _plot_repairability, _plot_sweep, _plot_prune_sweep]


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
