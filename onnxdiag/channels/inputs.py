"""One streaming pass that collects each layer's *input* moments (docs/METHODS.md §B4).

For every analysed layer — a Conv with group 1 (its im2col patch at 16 seeded output
positions per image, the positions of §B1) or a Gemm/MatMul with a constant weight (its
input vector at 16 seeded tokens per input; every row of a 2-D input) — the patches x and
the per-image target T (the logit margin of §B3, repeated per position) are folded into
float64 moments of [x, T]: Σ_X = Cov(x), Cov(x, T) and Var T, O(n_in²) per layer.

From these the layer's output moments are exact functions of its weight W (Cov y =
W Σ_X Wᵀ, Cov(y, T) = W Cov(x, T)), so the channel information and its gradient in W
(:mod:`onnxdiag.channels.gradients`) need no autograd and no second pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import OnnxDiagError
from ..evaluate import head_arrays
from ..graph import GraphIndex
from ..model.expose import expose_tensors
from ..runtime.runner import OrtRunner, single_threaded_blas
from ..sparsity.offline import layer_op, sampled_columns
from ..stats import Moments, draw_positions
from .moments import target_margin
from .taps import token_rows

MIN_CHANNELS = 4


@dataclass(frozen=True)
class InputLayer:
    """An analysed layer: ``W`` (n_channels, n_in) as y = W x (Gemm's alpha folded in),
    and how its input becomes patches (``op``, ``kernel``)."""

    name: str
    op_type: str
    W: np.ndarray
    op: object
    kernel: tuple


@dataclass(frozen=True)
class InputMoments:
    """One layer's input-patch moments: ``cov_x`` (n_in, n_in), ``cov_xt`` (n_in,),
    ``var_t``, ``n_rows`` patches from ``n_images`` inputs, and the layer's ``W``."""

    layer: str
    W: np.ndarray
    cov_x: np.ndarray
    cov_xt: np.ndarray
    var_t: float
    n_rows: int
    n_images: int

    def output_moments(self) -> tuple[np.ndarray, np.ndarray, float]:
        """(Cov y (C, C), Cov(y, T) (C,), Var T) of the layer's output y = W x."""
        return self.W @ self.cov_x @ self.W.T, self.W @ self.cov_xt, self.var_t


def effective_weight(index: GraphIndex, layer) -> np.ndarray | str:
    """W (n_channels, n_in) with y = W x for ``layer``, or why it is not analysed."""
    w = index.get_constant(layer.weight)
    if w is None:
        return "its weight is not a constant"
    w = np.asarray(w, np.float64)
    if layer.op_type == "Conv":
        if layer.groups != 1 or len(layer.kernel) not in (1, 2):
            return "only 1-D / 2-D convs with group 1 are analysed"
        return w.reshape(w.shape[0], -1)
    if layer.op_type not in ("Gemm", "MatMul") or w.ndim != 2:
        return f"{layer.op_type} layers are not analysed"
    op = layer_op(index, layer)
    return op.alpha * (w if layer.weight_layout == "oi" else w.T)


def find_input_layers(model, structure, layers=None) -> list[InputLayer]:
    """The analysed layers: the named ones, or every Conv / Gemm / MatMul with a constant
    weight and ≥ 4 outputs, head excluded; OnnxDiagError for an unusable named layer."""
    index = GraphIndex(model)
    chosen = [structure.get_layer(n) for n in layers] if layers else [
        la for la in structure.layers if not la.is_head and la.n_out >= MIN_CHANNELS]
    out = []
    for la in chosen:
        W = effective_weight(index, la)
        if isinstance(W, str):
            if layers:
                raise OnnxDiagError(f"Layer {la.node_name!r} cannot be analysed: {W}.")
            continue
        out.append(InputLayer(la.node_name, la.op_type, W, layer_op(index, la),
                              tuple(la.kernel)))
    if not out:
        raise OnnxDiagError("No layer to analyse: no Conv (group 1) or Gemm/MatMul with a "
                            "constant weight and at least 4 outputs besides the head.")
    return out


def patch_rows(layer: InputLayer, x: np.ndarray, indices, n_positions: int, seed: int
               ) -> tuple[np.ndarray, int]:
    """(patches (n·k, n_in), k per input) of one batch of the layer's input ``x``."""
    x = np.asarray(x)
    if layer.op_type == "Conv":
        cols = sampled_columns(layer.op, x, layer.kernel, n_positions, seed=seed,
                               sample_indices=indices)
        return cols[:, 0, :], cols.shape[0] // x.shape[0]
    if x.ndim == 2 and x.shape[0] == len(indices):
        return x, 1
    tokens = token_rows(x, len(indices), "input")  # (N, T, D), also from N·T rows (GPT-2)
    pick = draw_positions(tokens.shape[1], n_positions, seed=seed, sample_indices=indices)
    rows = tokens[np.arange(tokens.shape[0])[:, None], pick]
    return rows.reshape(-1, x.shape[-1]), pick.shape[1]


def collect_input_moments(model, structure, source, layers: list[InputLayer], *,
                          targets: str, n_positions: int = 16, seed: int = 0,
                          providers=None, label: str | None = None) -> dict[str, InputMoments]:
    """One pass over ``source``: every layer's [patch, T] moments (module docstring).

    ``targets``: "labels" (the ground-truth logit margin) or "pseudo" (the predicted
    class's).  Never modifies ``model``."""
    index = GraphIndex(model)
    inputs = {la.name: index.get_node(la.name).input[0] for la in layers}
    head = structure.head
    names = list(dict.fromkeys([head.features, head.logits, *inputs.values()]))
    runner = OrtRunner(expose_tensors(model, names), providers=providers)
    acc = {la.name: Moments(la.W.shape[1] + 1) for la in layers}
    n_images = 0
    with single_threaded_blas():
        for batch, out in runner.stream(source, names, label=label):
            _, U = head_arrays(out, head)
            t = target_margin(U, batch.labels if targets == "labels" else None)
            for la in layers:
                rows, k = patch_rows(la, out[inputs[la.name]], batch.indices, n_positions,
                                     seed)
                acc[la.name].update(np.column_stack([rows, np.repeat(t, k)]))
            n_images += len(t)
    return {la.name: _finish(la, acc[la.name], n_images) for la in layers}


def _finish(layer: InputLayer, moments: Moments, n_images: int) -> InputMoments:
    cov = moments.cov()
    k = layer.W.shape[1]
    return InputMoments(layer.name, layer.W, cov[:k, :k], cov[:k, k], float(cov[k, k]),
                        int(moments.n), n_images)
