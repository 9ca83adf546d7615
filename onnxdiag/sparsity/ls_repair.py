"""The reconstruction repair ``ls`` / ``ls+bn`` of a pruned model (docs/METHODS.md §E1).

Every masked layer that pruning reached (its own weights pruned, or its input downstream of
a pruned weight; the head included: reconstructing its logits is no rescale) is refitted
in topological order, each on its input in the partially repaired model: two
:class:`~onnxdiag.sparsity.segments.SegmentedPass` runs advance side by side, the dense
model (x_d) and the model being edited (x_p). At a layer's input both passes stop, the
layer's columns (im2col patches for a conv, rows for a linear layer: every leading axis a
position) and the dense layer's outputs at the same positions (read off the dense pass,
its bias removed) feed
:class:`~onnxdiag.sparsity.lsq.TargetMoments`, the rows are solved
(:func:`~onnxdiag.sparsity.lsq.reconstruct_rows`), and the new weight and bias are written
before the layer runs. With ``+bn`` each BatchNormalization downstream of a pruned weight
is then recalibrated at its input, as in §C1. Cost: one dense and one sequential pass
(each node once per image), plus the Gram products (P·K² per layer, and P·K·C_out for
the cross term) and the solves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import OnnxDiagError
from ..graph import GraphIndex
from ..graph.index import get_attr
from ..model.edit import ModelEditor
from ..runtime.progress import progress
from ..runtime.runner import single_threaded_blas
from ..stats import draw_positions
from .fold import bias_state
from .lsq import EXACT_MAX, PRIORS, RIDGE, TargetMoments, output_errors, reconstruct_rows
from .offline import layer_op, sampled_columns, sampled_rows
from .recal import recalibrate_bn
from .segments import SegmentedPass

#: Whose inputs each layer is fitted on (docs/METHODS.md §E1): the repaired or the dense model.
INPUTS = ("sequential", "dense")


@dataclass(frozen=True)
class LSSettings:
    """``ridge`` (λ = ridge · mean diag H_pp), ``prior`` ("weights": ridge toward the kept
    weights, identity when nothing is pruned; "zero"), ``exact_max`` (Σ|S_i|³ above which
    the SparseGPT sweep replaces the exact solves), ``solver`` ("auto", "exact",
    "sparsegpt"), ``positions``: conv output positions per image (linear layers: tokens
    per input) whose columns enter the moments, drawn with ``seed`` (the same for x_p and
    x_d); None: every position (exact, **our default**). ``inputs``: "sequential" (each
    layer fitted on its input in the partially repaired model, x_p, against the dense
    x_d: a dense and a sequential pass, **our default**) or "dense" (every layer fitted on
    the dense model's inputs, x_p = x_d: one pass of the dense model,
    :mod:`~onnxdiag.sparsity.ls_dense`)."""

    ridge: float = RIDGE
    prior: str = "weights"
    exact_max: float = EXACT_MAX
    solver: str = "auto"
    positions: int | None = None
    seed: int = 0
    inputs: str = "sequential"

    def check(self) -> None:
        if self.prior not in PRIORS:
            raise OnnxDiagError(f"LS prior must be one of {', '.join(PRIORS)}.")
        if not self.ridge > 0:
            raise OnnxDiagError(f"LS ridge must be positive, got {self.ridge!r}.")
        if self.solver not in ("auto", "exact", "sparsegpt"):
            raise OnnxDiagError("LS solver must be one of auto, exact, sparsegpt.")
        if self.inputs not in INPUTS:
            raise OnnxDiagError(f"LS inputs must be one of {', '.join(INPUTS)}.")
        if self.positions is not None and not (isinstance(self.positions, int)
                                               and self.positions >= 1):
            raise OnnxDiagError(f"LS positions must be a positive integer or all, got "
                                f"{self.positions!r}.")

    def to_dict(self) -> dict:
        return {"ridge": self.ridge, "prior": self.prior, "exact_max": self.exact_max,
                "solver": self.solver, "positions": self.positions or "all",
                "seed": self.seed, "inputs": self.inputs}


@dataclass(frozen=True, eq=False)
class LSRepair:
    """One reconstructed layer: the solver used, λ (per group), the columns it saw, and
    its relative output error ‖Y − Y_dense‖ / ‖Y_dense‖ on the calibration data before
    (masked weights, same upstream-repaired input) and after the refit."""

    layer: str
    solver: str
    lam: tuple[float, ...]
    n_columns: int
    n_kept: int
    n_weights: int
    error_before: float
    error_after: float
    kind: str = "ls"

    def to_dict(self, *, arrays: bool = False) -> dict:
        return {"layer": self.layer, "kind": self.kind, "solver": self.solver,
                "lambda": list(self.lam), "n_columns": self.n_columns, "n_kept": self.n_kept,
                "n_weights": self.n_weights, "error_before": self.error_before,
                "error_after": self.error_after}


def ls_sequential(editor: ModelEditor, dense_model, batches: list[dict], layers, masks: dict,
                  bns, affected: set, settings: LSSettings, providers=None,
                  threads: int | None = None, label: str | None = None
                  ) -> tuple[dict, dict, int]:
    """Refit ``layers`` (records as the edited model names them) and recalibrate ``bns``
    in topological order; returns (LSRepair per layer, BNRepair per BN, sessions run).
    ``label``: a progress bar with an ETA over the layers and BNs (stderr, a terminal).
    BLAS stays on one thread: its per-batch products alternate with ONNX Runtime runs on
    the same cores (measured 20x faster on a loaded 2-core machine, benchmarks/RESULTS.md)."""
    with single_threaded_blas():
        return _ls_pass(editor, dense_model, batches, layers, masks, bns, affected, settings,
                        providers, threads, label)


def _ls_pass(editor, dense_model, batches, layers, masks, bns, affected, settings, providers,
             threads, label) -> tuple[dict, dict, int]:
    # ORT threads sleep between runs: the Gram updates run between them on the same cores
    # (19 vs 25 x a dense pass at all positions, benchmarks/RESULTS.md)
    seg_p = SegmentedPass(editor.model, batches, providers=providers, threads=threads,
                          spinning=False)
    seg_d = SegmentedPass(dense_model, batches, providers=providers, threads=threads,
                          spinning=False)
    dense_index = GraphIndex(dense_model)
    items = sorted([(seg_p.position(la.input), 0, i) for i, la in enumerate(layers)]
                   + [(seg_p.position(b.input[0]), 1, i) for i, b in enumerate(bns)])
    # the dense layers' outputs y_d = W x_d (+ bias) stay in the dense frontier until used:
    # a later layer's output may be produced in an earlier layer's segment
    pending = {la.node_name: dense_index.get_node(la.node_name).output[0]
               for la in layers if la.input in affected}
    done_layers, done_bns = {}, {}
    for pos, kind, i in progress(items, len(items), label) if label else items:
        if kind == 1:
            seg_p.run_to(pos, keep=[bns[i].input[0]])
            done_bns[bns[i].name] = recalibrate_bn(seg_p.frontier, editor, bns[i])
            continue
        la = layers[i]
        seg_p.run_to(pos, keep=[la.input])
        ys_d = None
        if la.node_name in pending:
            out = pending.pop(la.node_name)
            seg_d.run_to(max(seg_d.done, seg_d.position(out)), keep=[out, *pending.values()])
            ys_d = [dense_output(dense_index, la, y) for y in seg_d.frontier[out]]
        w = np.asarray(dense_index.get_constant(la.weight))
        done_layers[la.node_name] = refit_layer(
            editor, la, w, np.asarray(masks[la.node_name], bool), seg_p.frontier[la.input],
            ys_d, settings)
    return done_layers, done_bns, seg_p.n_segments + seg_d.n_segments


def dense_output(dense_index: GraphIndex, layer, y: np.ndarray) -> np.ndarray:
    """The dense layer's output ``y`` (its node's first output) less its own bias:
    y_d = W x_d with W as :func:`weight_rows` holds it (a Gemm's α included, β·C
    removed); a MatMul's output has no bias to remove."""
    node = dense_index.get_node(layer.node_name)
    if layer.op_type == "MatMul" or len(node.input) < 3 or not node.input[2]:
        return y
    b = np.asarray(dense_index.get_constant(node.input[2]), np.float32)
    if layer.op_type == "Conv":
        return y - b.reshape(1, -1, *([1] * (y.ndim - 2)))
    return y - np.float32(get_attr(node, "beta", 1.0)) * b


def output_rows(op, y: np.ndarray, groups: int, positions: int | None, *, seed: int,
                sample_indices) -> np.ndarray:
    """``y`` (a conv's (n, C_out, *spatial), a linear layer's (..., n_out)) at the
    positions :func:`~onnxdiag.sparsity.offline.sampled_columns` takes, as (m, groups,
    C_out / groups): row r is the output of column r."""
    if op.kind == "conv":
        n, c = y.shape[:2]
        flat = np.ascontiguousarray(np.moveaxis(y.reshape(n, c, -1), 1, -1))  # (n, HW, C)
        if positions is not None and flat.shape[1] > positions:
            at = draw_positions(flat.shape[1], positions, seed=seed,
                                sample_indices=sample_indices)
            flat = flat[np.arange(n)[:, None], at]
        return flat.reshape(-1, groups, c // groups)
    rows = y.reshape(-1, y.shape[-1]) if positions is None else sampled_rows(
        y, positions, seed=seed, sample_indices=sample_indices)[:, 0]
    return rows.reshape(-1, 1, y.shape[-1])


def refit_layer(editor: ModelEditor, layer, w: np.ndarray, mask: np.ndarray, xs_p, ys_d,
                settings: LSSettings) -> LSRepair:
    """Stream the layer's columns against the dense outputs ``ys_d`` (per batch, as
    :func:`dense_output` gives them; None: its input is the dense one), solve its rows
    per group, write weight and bias into ``editor``; returns the record."""
    index = editor.index  # rebuilt after each edit: read it once per layer
    op = layer_op(index, layer)
    rows = weight_rows(layer, op, w)
    kernel = tuple(w.shape[2:]) if layer.op_type == "Conv" else ()
    g = op.groups if op.kind == "conv" else 1
    per = rows.shape[0] // g
    acc = TargetMoments(g, rows.shape[1], per)
    start = 0
    for j, xp in enumerate(xs_p):
        images = np.arange(start, start + len(xp))
        start += len(xp)
        draw = dict(seed=settings.seed, sample_indices=images)
        cols_p = sampled_columns(op, xp, kernel, settings.positions, **draw)
        acc.update(cols_p, None if ys_d is None else output_rows(  # None: from H_pp
            op, ys_d[j], g, settings.positions, **draw))
    yd_sq = np.concatenate([acc.output_sq(k, rows[k * per:(k + 1) * per]) for k in range(g)])
    return fit_layer(editor, layer, op, w, mask, acc, yd_sq, settings)


def fit_layer(editor: ModelEditor, layer, op, w: np.ndarray, mask: np.ndarray,
              acc, yd_sq: np.ndarray, settings: LSSettings) -> LSRepair:
    """Solve ``layer``'s rows per group from its moments ``acc`` (a
    :class:`~onnxdiag.sparsity.lsq.TargetMoments`; ``yd_sq``:
    E[(w_iᵀx_d)²] per row), write weight and bias into ``editor``; returns the record."""
    index = editor.index
    rows, rmask, alpha = weight_rows(layer, op, w), weight_rows(layer, op, mask), op.alpha
    g = acc.pp.shape[0]
    per = rows.shape[0] // g
    holder, slot, b, beta, _ = bias_state(editor, index, layer, index.get_node(layer.node_name))
    bias = np.zeros(rows.shape[0]) if b is None else np.broadcast_to(
        beta * np.asarray(b, np.float64).reshape(-1), (rows.shape[0],)).copy()
    new_w, new_b = np.zeros_like(rows), np.zeros_like(bias)
    errs, solvers, lams = np.zeros((3, rows.shape[0])), [], []
    for k in range(g):
        part = slice(k * per, (k + 1) * per)
        mom = acc.row_moments(k, rows[part])
        new_w[part], solver, lam = reconstruct_rows(
            rows[part], rmask[part], mom, ridge=settings.ridge, prior=settings.prior,
            exact_max=settings.exact_max, method=settings.solver)
        new_b[part], *e = output_errors(rows[part], new_w[part], np.where(
            rmask[part], rows[part], 0.0), bias[part], mom, yd_sq[part])
        errs[:, part] = e
        solvers.append(solver)
        lams.append(lam)
    _write(editor, layer, op, w, new_w / alpha, holder, slot, b, beta, new_b)
    total = max(float(errs[2].sum()), 1e-300)
    return LSRepair(layer.node_name, "+".join(sorted(set(solvers))), tuple(lams), acc.n,
                    int(mask.sum()), int(mask.size), float(np.sqrt(errs[1].sum() / total)),
                    float(np.sqrt(errs[0].sum() / total)))


def weight_rows(layer, op, w: np.ndarray) -> np.ndarray:
    """The stored weight as (rows = output channels, K) float64 — a conv's (C_out,
    C_in/g·k·k), a linear layer's α·W in (out, in) — or a mask the same way (bool)."""
    if layer.op_type == "Conv":
        return np.asarray(w).reshape(w.shape[0], -1) if w.dtype == bool else np.asarray(
            w, np.float64).reshape(w.shape[0], -1)
    m = np.asarray(w) if layer.weight_layout == "oi" else np.asarray(w).T
    return m if m.dtype == bool else op.alpha * m.astype(np.float64)


def _write(editor, layer, op, w, new_rows, holder, slot, b, beta, new_b) -> None:
    """Write the refitted rows (÷ Gemm's α already) and the bias (÷ β) into ``editor``."""
    if layer.op_type == "Conv":
        new_w = new_rows.reshape(w.shape)
    else:
        new_w = new_rows if layer.weight_layout == "oi" else new_rows.T
    node = editor.node(layer.node_name)
    editor.set_input(node.name, 1, new_w.astype(w.dtype))
    if beta == 0.0:  # Gemm ignores C: the refitted bias is written with beta = 1
        editor.set_attribute(node.name, "beta", 1.0)
        b, beta = None, 1.0
    shape = b.shape if b is not None and np.size(b) == new_b.size else new_b.shape
    dtype = b.dtype if b is not None else w.dtype
    editor.set_input(holder.name, 2 if slot is None else slot,
                     (new_b / beta).reshape(shape).astype(dtype))
