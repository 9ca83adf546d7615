"""Dense prediction (docs/METHODS.md §A4): a per-position head's batch as readout rows.

With a head applied at every position p, U(p) = W z(p) + b, positions are extra rows:
N = n_samples · positions rows, G_W = (1/N) Σ_rows (P_row − Y_row) z_rowᵀ, and every
§A1/§A2 readout is its usual formula over rows.  Rows whose label is the ignore index
(255 by default) are dropped whenever the data have label maps, for every readout and
every target kind (so labels, pseudo and expected targets see the same rows).

Label maps (n, *grid) are read on the logits' grid: when their grid differs from the
logits' (e.g. masks at the input resolution, logits at a stride), each logits position
takes the label at the nearest source position of its centre, index
⌊(i + ½) · H_label / H_logits⌋ per axis (*our default*).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..data.labels import IGNORE_INDEX, is_label_map
from ..errors import DataError
from ..graph.dense import class_axis, position_grid, position_rows


@dataclass(frozen=True)
class DenseBatch:
    """One batch of a per-position head as rows: Z (rows, D), U (rows, C), labels (rows,)
    or None; ``n_ignored``: rows dropped for the ignore index."""

    Z: np.ndarray
    U: np.ndarray
    labels: np.ndarray | None
    n_images: int
    n_ignored: int


def labels_on_grid(labels: np.ndarray, grid: tuple[int, ...], where: str = "the labels"
                   ) -> np.ndarray:
    """Label maps (n, *source grid) read at the positions of ``grid`` (nearest centre).

    Raises DataError for labels with one class per sample or maps of another rank."""
    labels = np.asarray(labels)
    if not is_label_map(labels):
        raise DataError(f"{where.capitalize()} hold one class per sample (shape "
                        f"{labels.shape}), but the head is applied at every position "
                        f"(grid {grid}); give label maps of shape (n, {', '.join(map(str, grid))})"
                        " (an npz 'labels' key, or an images/ + masks/ folder).")
    source = labels.shape[1:]
    if len(source) != len(grid):
        raise DataError(f"Label maps of {where} have grid {source}, the head's logits {grid}; "
                        "give maps with one value per logits position.")
    if source == tuple(grid):
        return labels
    index = np.ix_(*[np.minimum(((np.arange(g) + 0.5) * s / g).astype(np.int64), s - 1)
                     for s, g in zip(source, grid)])
    return labels[(slice(None), *index)]


def dense_batch(features, logits, head, labels=None, *, ignore_index: int = IGNORE_INDEX,
                where: str = "the labels") -> DenseBatch:
    """Rows of one batch of a per-position ``head`` (its exposed ``features`` and
    ``logits`` values), with the ignore-index rows dropped when ``labels`` are given."""
    axis = class_axis(head.op_type)
    Z, U = position_rows(features, axis), position_rows(logits, axis)
    n = int(np.shape(logits)[0])
    if Z.shape[0] != U.shape[0]:
        raise DataError(f"Head {head.node_name!r}: features give {Z.shape[0]} rows, logits "
                        f"{U.shape[0]}; name features with the logits' positions "
                        "(--features TENSOR).")
    if labels is None:
        return DenseBatch(Z, U, None, n, 0)
    y = labels_on_grid(labels, position_grid(logits, axis), where).reshape(-1)
    keep = y != ignore_index
    return DenseBatch(Z[keep], U[keep], y[keep].astype(np.int64), n, int((~keep).sum()))


class DenseCounts:
    """Rows, images and ignored rows over a stream (what a dense report states)."""

    def __init__(self, ignore_index: int):
        self.ignore_index, self.n_images, self.n_rows, self.n_ignored = ignore_index, 0, 0, 0
        self.grid: tuple | None = None

    def add(self, batch: DenseBatch, grid: tuple) -> None:
        self.n_images += batch.n_images
        self.n_rows += batch.U.shape[0]
        self.n_ignored += batch.n_ignored
        self.grid = tuple(grid)

    def to_dict(self) -> dict:
        return {"rows": "positions", "n_images": self.n_images, "n_rows": self.n_rows,
                "n_ignored": self.n_ignored, "ignore_index": self.ignore_index,
                "grid": None if self.grid is None else list(self.grid)}


def render_dense(result: dict) -> str:
    """Text lines for a dense probe result (ProbeResult dict): rows and mean IoU."""
    dense = result.get("dense")
    if not dense:
        return ""
    lines = [f"dense head (docs/METHODS.md §A4): rows = positions; {dense['n_rows']} rows "
             f"from {dense['n_images']} samples on a {dense['grid']} grid, "
             f"{dense['n_ignored']} ignored (label {dense['ignore_index']})"]
    ev = result.get("evaluation") or {}
    if ev.get("miou") is not None:
        lines.append(f"evaluation: mean IoU {100 * ev['miou']:.2f} % over "
                     f"{sum(v is not None for v in ev['iou'])} classes, pixel accuracy "
                     f"{100 * ev['accuracy']:.2f} %, loss {ev['loss']:.4f} on "
                     f"{ev['n_rows']} labelled positions")
    return "\n".join(lines) + "\n"
