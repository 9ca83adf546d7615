"""Where a statistics pass takes each layer's samples from: the layer's output or its input.

Exposing a tensor costs the pass a copy out of ONNX Runtime's blocked layout, and
exposing a conv's output keeps its BatchNormalization from being fused; both costs
scale with the values exposed. Where a conv's input is far smaller than its output (a
first conv on a grey or RGB image) the pass exposes the input instead and evaluates the
conv in float64 at the sampled positions only (:class:`InputTap`), giving the same
samples (``docs/METHODS.md §B1``) to float32 rounding.  A linear layer (Gemm / MatMul,
``docs/METHODS.md §D``) is tapped the same way at its sampled tokens
(:class:`LinearInputTap`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import OnnxDiagError

TAPS = ("auto", "output", "input")


@dataclass(frozen=True)
class InputTap:
    """A conv evaluated at the sampled positions from its input, in float64 (the y of
    ``docs/METHODS.md §B1``).

    ``matrix`` (groups, K, C_out/groups) and ``bias`` (the node's own bias input, or
    None; a separate bias Add comes after ``Layer.output`` and is left out, as there).
    """

    op: object
    kernel: tuple
    matrix: np.ndarray
    bias: np.ndarray | None

    def samples(self, x_last: np.ndarray, indices, n_positions: int, seed: int) -> np.ndarray:
        """Rows (n·k, C_out) at the positions :func:`draw_positions` gives the output."""
        from ..sparsity.offline import apply_columns, sampled_columns

        cols = sampled_columns(self.op, np.moveaxis(x_last, -1, 1), self.kernel, n_positions,
                               seed=seed, sample_indices=indices, x_last=x_last)
        y = apply_columns(cols.astype(np.float64), self.matrix)
        if self.bias is not None:
            y += self.bias
        return y


@dataclass(frozen=True)
class LinearInputTap(InputTap):
    """A Gemm / MatMul evaluated in float64 at the sampled tokens of its input:
    y = x W + b, ``matrix`` (n_in, n_out) with Gemm's alpha, ``bias`` its own C input
    times beta (a separate bias Add is left out, as in ``Layer.output``)."""

    def samples(self, x_last: np.ndarray, indices, n_positions: int, seed: int) -> np.ndarray:
        """Rows (n·k, C_out) at the tokens :func:`draw_positions` gives each input."""
        from ..stats import draw_positions

        n = len(indices)
        x = token_rows(x_last, n, "input")
        pos = draw_positions(x.shape[1], n_positions, seed=seed, sample_indices=indices)
        rows = x[np.arange(n)[:, None], pos].reshape(-1, x.shape[2]).astype(np.float64)
        y = rows @ self.matrix
        if self.bias is not None:
            y += self.bias
        return y


def token_rows(x: np.ndarray, n: int, what: str = "output") -> np.ndarray:
    """A linear layer's (…, C) tensor for ``n`` inputs as (n, positions, C): its leading
    axes are the inputs × their tokens (GPT-2's Gemm runs on N·T rows)."""
    c = x.shape[-1]
    rows = int(np.prod(x.shape[:-1]))
    if n == 0 or rows % n:
        raise OnnxDiagError(f"A linear layer's {what} has {rows} rows for a batch of {n} "
                            "inputs, so its rows cannot be assigned to inputs; analyse "
                            "other layers (--layer NODE).")
    return x.reshape(n, rows // n, c)


def choose_taps(model, chosen, tap: str = "auto", task_samples: str = "match",
                n_positions: int = 16) -> dict:
    """Per analysed layer: "output" or an :class:`InputTap`.

    Every exposed tensor costs the pass a copy out of ONNX Runtime's fused, blocked
    layout, and exposing a conv's output also keeps its BatchNormalization from being
    fused into it. "auto" taps a conv's input instead when that exposes at most a
    quarter as many values per image as its output and the float64 work at the sampled
    positions (k·C_in/groups·Πkernel·C_out multiply-adds) is at most one pass over the
    output: typically a first conv on a 1- or 3-channel image (never when the shapes are
    not static). Input taps need a 1-D or 2-D conv with constant weights or a linear
    layer, and ``task_samples="match"`` ("gap" needs every output position).
    """
    if tap not in TAPS:
        raise OnnxDiagError(f"tap must be one of {', '.join(TAPS)}; got {tap!r}.")
    if tap == "input" and task_samples != "match":
        raise OnnxDiagError("Input taps sample the conv at positions; --task-samples gap "
                            "needs the whole output: use tap 'output' or 'auto'.")
    index = None
    taps: dict = {}
    for la in chosen:
        why = _input_tap_obstacle(la, task_samples)
        if tap == "input" and why:
            raise OnnxDiagError(f"Layer {la.node_name!r} cannot be tapped at its input "
                                f"({why}); use tap 'auto' or 'output'.")
        if tap == "output" or why or (tap == "auto" and not _input_is_cheaper(la, n_positions)):
            taps[la.node_name] = "output"
            continue
        if index is None:
            from ..graph import GraphIndex

            index = GraphIndex(model)
        try:
            taps[la.node_name] = _input_tap(index, la)
        except OnnxDiagError:
            if tap == "input":
                raise
            taps[la.node_name] = "output"
    return taps


def tap_names(taps: dict) -> dict[str, str]:
    """Layer → "input" / "output", for reports."""
    return {name: "input" if isinstance(t, InputTap) else "output" for name, t in taps.items()}


def _input_tap_obstacle(la, task_samples: str) -> str | None:
    if task_samples != "match":
        return "--task-samples gap"
    if la.op_type in ("Gemm", "MatMul"):
        return "Gemm with transA=1" if "transA=1" in la.note else None
    if la.op_type != "Conv" or len(la.kernel) not in (1, 2):
        return "only 1-D and 2-D convs and linear layers"
    if la.weight_initializer is None:
        return "its weights are computed, not constant"
    return None


def _input_is_cheaper(la, n_positions: int) -> bool:
    if not la.input_shape or not la.output_shape or not all(
            isinstance(d, int) for d in (*la.input_shape[1:], *la.output_shape[1:])):
        return False  # unknown sizes: keep the output
    in_values = int(np.prod(la.input_shape[1:]))
    linear = la.op_type in ("Gemm", "MatMul")
    out_spatial = int(np.prod(la.output_shape[1:-1] if linear else la.output_shape[2:]))
    out_values = la.n_out * out_spatial
    macs = min(n_positions, out_spatial) * (la.n_in // la.groups) * int(np.prod(la.kernel)) \
        * la.n_out
    return 4 * in_values <= out_values and macs <= out_values


def _input_tap(index, la) -> InputTap:
    if la.op_type in ("Gemm", "MatMul"):
        from ..graph.linear import linear_weight

        found = linear_weight(index, index.get_node(la.node_name))
        if isinstance(found, str):
            raise OnnxDiagError(f"Layer {la.node_name!r} cannot be tapped at its input "
                                f"({found}); use tap 'auto' or 'output'.")
        w, b = found
        return LinearInputTap(None, (), np.ascontiguousarray(w.T), b if b.any() else None)
    from ..sparsity.offline import layer_op, weight_matrix

    op = layer_op(index, la)
    w = np.asarray(index.get_constant(la.weight), dtype=np.float64)
    node = index.get_node(la.node_name)
    bias = index.get_constant(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    return InputTap(op, tuple(la.kernel), weight_matrix(op, w),
                    None if bias is None else np.asarray(bias, np.float64).reshape(-1))

