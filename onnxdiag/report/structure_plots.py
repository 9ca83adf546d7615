"""Figures of the §B4 structure analyses: the higher-order structure by depth (``channels``,
``orthogonality``) and the update–information cosines over a series (``orthogonality``).

Each plotter takes the report dict and returns ``[(title, caption, base64 png)]``, drawn
from the dict alone (:mod:`.html`).
"""

from __future__ import annotations

from .plots import figure, finite, png


def _depth_section(report: dict) -> dict | None:
    for key in ("channels", "orthogonality"):
        section = report.get(key)
        if isinstance(section, dict) and (section.get("depth") or {}).get("layers"):
            return section["depth"]
    return None


def plot_depth(report: dict) -> list:
    """Singleton vs distributed peer R² and pair vs triplet synergy, by depth."""
    depth = _depth_section(report)
    if depth is None:
        return []
    rows = depth["layers"]
    x = [r["depth"] for r in rows]
    fig, axes = figure(2, 1, height=3.6)
    k = (rows[0].get("params") or {}).get("k_peers", "k")
    axes[0].plot(x, finite(r["r2_single"] for r in rows), "o-", ms=3, label="R² from 1 peer")
    axes[0].plot(x, finite(r["r2_multi"] for r in rows), "s-", ms=3, label=f"R² from {k} peers")
    axes[0].plot(x, finite(r["single_share"] for r in rows), "^--", ms=3, color="0.4",
                 label="share R²_1 / R²_k")
    axes[0].set_ylim(0, 1.05)
    axes[0].set_title("substitutability: singleton vs distributed", fontsize=9)
    axes[1].plot(x, finite(r["pair_synergy"] for r in rows), "o-", ms=3, label="pair synergy")
    axes[1].plot(x, finite(r["triplet_synergy"] for r in rows), "s-", ms=3,
                 label="triplet synergy")
    axes[1].set_title("target side: pair vs triplet synergy (nats)", fontsize=9)
    for ax in axes:
        ax.set_xlabel("depth (analysed layer, graph order)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7)
    t = depth.get("trends") or {}
    cap = ("Medians over each layer's channels (docs/METHODS.md §B4). Spearman vs depth: "
           f"share {_fmt(t.get('single_share'))}, triplet synergy "
           f"{_fmt(t.get('triplet_synergy'))}. Published: singleton duplicates in early layers, "
           "distributed shells deep (the share falls); triplet synergy rises with depth.")
    return [("Higher-order structure by depth", cap, png(fig))]


def plot_orthogonality(report: dict) -> list:
    """cos(update, ∇ΣI_X) and cos(update, ∇ΣI(T;Y)) per layer over the updates."""
    section = report.get("orthogonality")
    if not isinstance(section, dict) or not section.get("rows"):
        return []
    fig, axes = figure(2, 1, height=3.8)
    layers = section["layers"]
    for ax, key, what in ((axes[0], "cos_input_capture", "cos(Δθ, ∇ Σ I_X)"),
                          (axes[1], "cos_task_info", "cos(Δθ, ∇ Σ I(T;Y))")):
        for d, name in enumerate(layers):
            mine = sorted((r["t"], r[key]) for r in section["rows"] if r["layer"] == name)
            color = _shade(d, len(layers))
            ax.plot([t for t, _ in mine], finite(v for _, v in mine), "-", lw=1, color=color,
                    label=name if d in (0, len(layers) - 1) else None)
        chance = (section.get("overall") or {}).get("chance_abs_cos")
        if chance:
            ax.axhspan(-chance, chance, color="0.88", zorder=0)
        ax.axhline(0.0, color="0.5", lw=0.6)
        ax.set_title(what, fontsize=9)
        ax.set_xlabel("update t → t+1", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    cap = ("One line per layer, light (shallow) to dark (deep); grey band: ± the median "
           "chance |cos| of a random direction, √(2/(π d)). Published: after early training "
           "the update is nearly orthogonal to both gradients.")
    return [("Update–information orthogonality per layer", cap, png(fig))]


def _shade(i: int, n: int) -> str:
    from matplotlib import colormaps

    return colormaps["viridis"](0.9 - 0.8 * i / max(n - 1, 1))


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:+.2f}"
