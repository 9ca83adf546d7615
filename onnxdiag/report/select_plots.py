"""Figures of ``select --prune`` / ``--prune-channels`` (docs/METHODS.md §A5): dense vs
pruned accuracy and readout per checkpoint, and the agreement with the dense model.

Drawn from the report dict alone (:mod:`.html`); returns ``[(title, caption, base64 png)]``.
"""

from __future__ import annotations

from .plots import figure, finite, png


def plot_pruned_selection(report: dict) -> list:
    """Two panels over the checkpoints: top-1 (dense, pruned) when labelled, else the
    headline readout dense and pruned; and the agreement, with the picks marked."""
    sec = report.get("pruned_selection")
    if not isinstance(sec, dict) or not sec.get("criteria"):
        return []
    crit = sec["criteria"]
    n = len(crit["agreement"]["values"])
    x = list(range(n))
    fig, axes = figure(2, 1, height=3.4)
    if sec.get("pruned_accuracy"):
        axes[0].plot(x, [100 * a for a in sec["dense_accuracy"]], "o-", ms=3, label="dense")
        axes[0].plot(x, [100 * a for a in sec["pruned_accuracy"]], "s-", ms=3, label="pruned")
        axes[0].set_ylabel("top-1 %")
        what = "top-1 on the evaluation data"
    else:
        sb = sec["select_by"]
        for prefix, marker in (("dense", "o-"), ("pruned", "s-")):
            key = f"{prefix}:{sb}"
            if key in crit:
                axes[0].plot(x, finite(crit[key]["values"]), marker, ms=3, label=prefix)
        axes[0].set_ylabel(sb)
        what = f"the readout {sb}"
    axes[1].plot(x, [100 * a for a in crit["agreement"]["values"]], "o-", ms=3, color="C2")
    axes[1].set_ylabel("agreement with own dense %")
    oracle = ((sec.get("evaluation") or {}).get("oracle_window") or {}).get("index")
    for ax in axes:
        ax.axvline(sec["selected"], color="C3", ls="--", lw=1.2, label="selected")
        if oracle is not None:
            ax.axvline(oracle, color="C2", ls=":", lw=1.2, label="oracle pruned")
        ax.set_xlabel("checkpoint", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=7, loc="best")
    cap = (f"Left: {what}, dense (circles) and pruned + repaired (squares) per checkpoint. "
           "Right: top-1 agreement of each pruned model with its own dense model on the "
           f"calibration data. Red dashed: the label-free choice ({sec['headline']}); green "
           "dotted: the oracle pruned checkpoint (with labels).")
    return [("Dense vs pruned per checkpoint", cap, png(fig))]
