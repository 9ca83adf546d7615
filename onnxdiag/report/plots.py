"""The figures of the reports (matplotlib, imported only when drawing): the shared
drawing helpers and the plots of the readouts family and of ``analyze``'s sections.

Each plotter takes the report dict and returns ``[(title, caption, base64 png)]``; it
draws from the dict alone, so a report written earlier can be re-rendered
(:mod:`.html`).
"""

from __future__ import annotations

import base64
import io
import math


def figure(ncols: int = 1, nrows: int = 1, *, width: float = 10.0, height: float = 3.6):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height * nrows), dpi=90)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def png(fig) -> str:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def finite(values) -> list[float]:
    return [float("nan") if v is None else float(v) for v in values]


def grid_shape(n: int, ncols: int = 3):
    ncols = max(1, min(ncols, n))
    return ncols, math.ceil(n / ncols)


def plot_selection(report: dict) -> list:
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
    ncols, nrows = grid_shape(len(names))
    fig, axes = figure(ncols, nrows, height=2.8)
    acc = sel.get("accuracy")
    for ax, name in zip(axes, names):
        ax.plot(x, finite(values[name]), "o-", ms=3, color="C0")
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
    if axes[0].get_legend_handles_labels()[0]:  # a selected / oracle line was drawn
        axes[0].legend(fontsize=7, loc="best")
    cap = ("Readouts (blue) per checkpoint; grey line: test accuracy (%) when evaluation "
           "data was given; red dashed: the readout's selected checkpoint; green dotted: "
           "the oracle; grey band: flagged (degenerate) checkpoints.")
    out = [("Readouts vs checkpoint", cap, png(fig))]
    if sel.get("screening"):
        out += _plot_screening(sel, ok)
    return out


def _plot_screening(sel: dict, ok: list) -> list:
    acc = sel.get("accuracy")
    if not acc:
        return []
    fig, axes = figure(2, 1, height=3.4)
    n_params = [c.get("n_params") for c in ok]
    name = sel.get("select_by")
    vals = [c["result"]["readouts"]["values"].get(name) for c in ok]
    axes[0].scatter(finite(vals), [100 * a for a in acc], s=14)
    axes[0].set_xlabel(name)
    axes[0].set_ylabel("accuracy %")
    axes[1].scatter(finite(n_params), [100 * a for a in acc], s=14, color="C1")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("parameters (baseline)")
    return [("Screening: readout and parameter count vs accuracy", "One point per model.",
             png(fig))]


def plot_readouts(report: dict) -> list:
    """One model's readouts (``analyze``, ``readouts``): every value, and the degeneracy
    diagnostics against the thresholds that flag a checkpoint (docs/METHODS.md §A2)."""
    sec = report.get("readouts")
    if not isinstance(sec, dict) or not isinstance(sec.get("readouts"), dict):
        return []
    ro = sec["readouts"]
    fig, axes = figure(2, 1, height=3.8)
    _readout_bars(axes[0], ro.get("values") or {})
    _diagnostic_bars(axes[1], ro.get("diagnostics") or {})
    ev = sec.get("evaluation") or {}
    acc = "" if ev.get("accuracy") is None else f"; top-1 {100 * ev['accuracy']:.2f} % on " \
        f"{ev.get('n_samples')} labelled samples"
    cap = (f"Left: the readouts on {ro.get('n_samples')} probe samples (targets "
           f"{ro.get('targets')}), |value| on a log scale; blue: lower is better, green: "
           "higher is better, grey: context. Right: the diagnostics that flag a degenerate "
           f"checkpoint, with their thresholds (red){acc}.")
    return [("Readouts", cap, png(fig))]


def _readout_bars(ax, values: dict) -> None:
    from ..selection.readouts import READOUTS

    names = list(values)
    colours = {"lower": "C0", "higher": "C2"}
    mags = [abs(float(values[n])) if values[n] is not None else float("nan") for n in names]
    ax.barh(range(len(names)), mags,
            color=[colours.get(getattr(READOUTS.get(n), "direction", ""), "0.6") for n in names])
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([f"{n} = {values[n]:.4g}" if values[n] is not None else n
                        for n in names], fontsize=7)
    ax.invert_yaxis()
    if any(m > 0 for m in mags):
        ax.set_xscale("log")
    ax.set_xlabel("|value|", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)


def _diagnostic_bars(ax, diagnostics: dict) -> None:
    from ..selection.readouts import DegenerateRule

    rule = DegenerateRule()
    limits = {"feature_spread": rule.min_feature_spread,
              "modal_fraction": rule.max_modal_fraction,
              "confidence_excess": rule.min_confidence_excess}
    names = [n for n in limits if diagnostics.get(n) is not None]
    ax.bar(range(len(names)), [diagnostics[n] for n in names], color="C0")
    for i, n in enumerate(names):
        ax.hlines(limits[n], i - 0.4, i + 0.4, color="C3", lw=1.5)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("value (0–1)", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)


def _channel_axes(layer: dict):
    """(I_X, I(T;Y)) per channel of one layer's row, or None: ``scores.scores`` (the
    channels verb) or ``axes`` (a summary section that keeps only the two axes)."""
    axes = (layer.get("scores") or {}).get("scores") or layer.get("axes") or {}
    if axes.get("input_capture") is None or axes.get("task_info") is None:
        return None
    return finite(axes["input_capture"]), finite(axes["task_info"])


def plot_channels(report: dict) -> list:
    ch = report.get("channels")
    if not isinstance(ch, dict) or not ch.get("layers"):
        return []
    layers = [(L, _channel_axes(L)) for L in ch["layers"]]
    layers = [(L, xy) for L, xy in layers if xy is not None]
    if not layers:
        return _plot_channel_summary(ch["layers"])
    ncols, nrows = grid_shape(len(layers), 4)
    fig, axes = figure(ncols, nrows, height=2.6)
    for ax, (L, (ix, it)) in zip(axes, layers):
        ax.scatter(ix, it, s=8, alpha=0.7)
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
    return [("Channel axes: I_X vs I(T;Y)", cap, png(fig))]


def _plot_channel_summary(layers: list) -> list:
    """Per layer: the axis correlations and the ARI, when the section holds no
    per-channel values (``analyze``'s summary)."""
    layers = [L for L in layers if L.get("layer")]
    if not layers:
        return []
    fig, axes = figure(1, 1, width=10, height=4.2)
    ax, w = axes[0], 0.27
    keys = [("input_capture_vs_task_info", "ρ(I_X, I(T;Y))"),
            ("peer_overlap_vs_synergy", "ρ(R_X, Syn)"), ("ari", "ARI")]
    for k, (key, label) in enumerate(keys):
        ax.bar([i + (k - 1) * w for i in range(len(layers))],
               finite(L.get(key) for L in layers), width=w, label=label, color=f"C{k}")
    ax.axhline(0.0, color="0.5", lw=0.8)
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels([L["layer"] for L in layers], rotation=60, ha="right", fontsize=6)
    ax.set_ylim(-1.05, 1.05)
    ax.legend(fontsize=7)
    cap = ("Per layer: Spearman correlation of the local axis I_X with the task information "
           "I(T;Y), of peer overlap R_X with synergy, and the ARI of the two clusterings "
           "(docs/METHODS.md §B4); near 0: the two axes carry different information.")
    return [("Channel axes per layer", cap, png(fig))]


def _rr_curves(section) -> tuple[list, list]:
    """(grid, [(layer, RR values)]) from a ``curves`` dict (layers, grid, rr matrix)."""
    if not isinstance(section, dict):
        return [], []
    grid, layers, rr = section.get("grid"), section.get("layers"), section.get("rr")
    if not grid or not layers or not rr:
        return [], []
    return grid, list(zip(layers, rr))


def band_span(ax, band, color, label):
    if isinstance(band, dict) and band.get("start") is not None and band.get("end") is not None:
        ax.axvspan(band["start"], band["end"], color=color, alpha=0.12, label=label)


def _rr_rows(rows) -> tuple[list, list]:
    """(grid, [(layer, RR values)]) from the rows of ``analyze``'s section ("RR 0.5", …)."""
    if not isinstance(rows, list) or not rows:
        return [], []
    keys = [k for k in rows[0] if str(k).startswith("RR ")]
    keys.sort(key=lambda k: float(k[3:]))
    grid = [float(k[3:]) for k in keys]
    return grid, [(r.get("layer"), [r.get(k) for k in keys]) for r in rows]


def plot_repairability(report: dict) -> list:
    sec = report.get("repairability")
    if not isinstance(sec, dict):
        return []
    grid, curves = _rr_curves(sec.get("curves"))
    if not curves:
        grid, curves = _rr_rows(sec.get("rows"))
    out = []
    if curves and grid:
        out.append(_rr_figure(grid, curves))
    tr = sec.get("transition")
    if isinstance(tr, dict) and tr.get("cells"):
        out.append(_transition_figure(tr))
    return out


def _rr_figure(grid, curves) -> tuple:
    fig, axes = figure(1, 1, width=8, height=4.2)
    ax = axes[0]
    for name, vals in curves:
        ax.plot(grid, finite(vals), "o-" if len(grid) < 6 else "-", ms=3, lw=1.2, label=name)
    ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
    ax.set_xlabel("layer sparsity s")
    ax.set_ylabel("RR(ℓ, s)")
    ax.legend(fontsize=6, ncol=2)
    return ("Relative repairability per layer",
            "RR(ℓ, s) = (D_repair + ε)/(D_raw + ε) with only layer ℓ pruned "
            "(docs/METHODS.md §C2); below 1: CR+BN repairs part of the damage.", png(fig))


def _transition_figure(tr: dict) -> tuple:
    cells = sorted(tr["cells"], key=lambda c: c.get("sparsity", 0))
    keys = sorted({c.get("repair") for c in cells if c.get("repair")})
    fig, axes = figure(1, 1, width=8, height=3.6)
    ax = axes[0]
    for rep in keys or [None]:
        pts = [c for c in cells if c.get("repair") == rep]
        ax.plot([c["sparsity"] for c in pts], finite(c.get("agreement") for c in pts),
                "o-", ms=3, label=f"agreement ({rep})" if rep else "agreement")
    band_span(ax, tr.get("band"), "C1", "agreement band")
    band_span(ax, tr.get("cts_band"), "C4", "CTS band")
    ax.set_xlabel("global sparsity S")
    ax.set_ylabel("top-1 agreement with dense")
    ax.legend(fontsize=7)
    return ("Label-free transition scan",
            f"Allocation {tr.get('allocation')}; shaded: the predicted band "
            "(docs/METHODS.md §C4).", png(fig))
