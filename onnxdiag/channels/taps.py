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
#: A derived input tap's work on a grouped (depthwise) conv (k·C_in/groups·Πkernel·C_out
#: per image) at most this share of its output's values (**our default**): the fold then
#: does that work as one small product per group, plus the gather and the BN + activation
#: of the patches, so it pays only where the exposure it saves is far larger
#: (benchmarks/RESULTS.md).
DERIVE_SHARE = 1 / 16
#: The same for an ungrouped conv, whose work at the sampled positions is one BLAS product
#: (**our default**: ResNet-50's 1×1 expansions at 28×28 (work 2.5 times the output's
#: values) are derived, those at 14×14 (21) are not; benchmarks/RESULTS.md).
DERIVE_DENSE_SHARE = 4.0


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

    def reads(self, layer) -> str:
        """The tensor whose channels-last copy the pass exposes for this tap."""
        return layer.input

    def samples(self, x_last: np.ndarray, indices, n_positions: int, seed: int,
                transform=None) -> np.ndarray:
        """Rows (n·k, C_out) at the positions :func:`draw_positions` gives the output."""
        from ..sparsity.offline import apply_columns, sampled_columns, sampled_patches

        x = np.moveaxis(x_last, -1, 1)
        if self.depthwise:
            patches = sampled_patches(self.op, x, self.kernel, n_positions, seed=seed,
                                      sample_indices=indices, x_last=x_last,
                                      transform=transform)
            if patches is not None:
                return self._depthwise_at(patches)
        cols = sampled_columns(self.op, x, self.kernel, n_positions, seed=seed,
                               sample_indices=indices, x_last=x_last, transform=transform)
        y = apply_columns(cols.astype(np.float64), self.matrix)
        if self.bias is not None:
            y += self.bias
        return y

    @property
    def depthwise(self) -> bool:
        """A 2-D conv whose every group reads one input channel (a depthwise conv)."""
        return (len(self.kernel) == 2 and self.matrix.shape[0] > 1
                and self.matrix.shape[1] == int(np.prod(self.kernel)))

    def _depthwise_at(self, patches: np.ndarray) -> np.ndarray:
        """A depthwise conv at channels-last patches (m, kh·kw, C): its kh·kw products per
        output summed in float32, as ONNX Runtime's own kernel sums them (the float64
        columns of the other convs would cost ~15× more here: one small product per
        channel)."""
        m, (g, _, o) = patches.shape[0], self.matrix.shape
        w = self.matrix.astype(np.float32)
        y = (np.einsum("mtg,tg->mg", patches, np.ascontiguousarray(w[:, :, 0].T)) if o == 1
             else np.einsum("mtg,gto->mgo", patches, w).reshape(m, g * o))
        if self.bias is not None:
            y += self.bias.astype(np.float32)
        return y


@dataclass(frozen=True)
class DerivedInputTap(InputTap):
    """An :class:`InputTap` whose input is not exposed but computed at the sampled patches
    from ``source``, another analysed layer's exposed output: the conv's input is
    act(``scale``·source + ``shift``) per channel (an inference BatchNormalization, then a
    Clip to [``lo``, ``hi``], a Relu (0, inf) or nothing), as a MobileNet's depthwise conv
    reads its expansion conv's output. The conv's own output is then not exposed at all
    (its BatchNormalization and activation stay fused in ONNX Runtime). The map runs in
    float32 on the gathered values, the conv in float64: the output tap's samples to
    float32 rounding."""

    source: str = ""
    scale: np.ndarray | None = None
    shift: np.ndarray | None = None
    lo: float = -np.inf
    hi: float = np.inf

    def reads(self, layer) -> str:
        return self.source

    def samples(self, x_last: np.ndarray, indices, n_positions: int, seed: int,
                transform=None) -> np.ndarray:
        return super().samples(x_last, indices, n_positions, seed, transform=self._input)

    def _input(self, y: np.ndarray) -> np.ndarray:
        """act(scale·y + shift) of a fresh float32 ``y``, in place (a new array of the
        patches' size costs its page faults: 3× the map itself)."""
        y *= self.scale.astype(np.float32)
        y += self.shift.astype(np.float32)
        return np.clip(y, self.lo, self.hi, out=y)


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
    if tap == "auto" and task_samples == "match":
        from ..graph import GraphIndex

        _derive_taps(index or GraphIndex(model), chosen, taps, n_positions)
    return taps


def _derive_taps(index, chosen, taps: dict, n_positions: int) -> None:
    """In place: a 2-D conv whose input is act(BN(y)) of another output-tapped 2-D conv's
    output y gets a :class:`DerivedInputTap` where that saves exposing a tensor: an
    output-tapped conv where its float64 work at the sampled positions is at most
    ``DERIVE_SHARE`` (grouped convs; typically a depthwise conv on a large map) or
    ``DERIVE_DENSE_SHARE`` (a BLAS product) of one pass over its output (its output is
    then not exposed), and an input-tapped conv always (it does that
    work already; its input is then not exposed: e.g. a bottleneck's 1×1 expansion reading
    relu(BN(y)) of the conv before it). y's layer then keeps its output tap, so of two
    such layers in a row only one is derived: the input-tapped candidates are taken first,
    then the largest saving first."""
    exposed = {la.output for la in chosen if taps[la.node_name] == "output"
               and la.op_type == "Conv" and len(la.kernel) == 2}
    candidates = []
    for la in chosen:
        tap = taps[la.node_name]
        if la.op_type != "Conv" or len(la.kernel) != 2 or _input_tap_obstacle(la, "match"):
            continue
        if tap == "output":
            share = DERIVE_SHARE if la.groups > 1 else DERIVE_DENSE_SHARE
            if not _float64_is_cheap(la, n_positions, share):
                continue
            saving = int(np.prod(la.output_shape[1:]))
        elif type(tap) is InputTap:
            saving = int(np.prod(la.input_shape[1:]))
        else:
            continue
        chain = _bn_act_chain(index, la.input)
        if chain is not None and chain[0] in exposed and chain[0] != la.output:
            candidates.append((saving, la, chain))
    derived: set[str] = set()  # outputs no longer exposed
    pinned: set[str] = set()  # outputs a derived tap reads
    # input-tapped convs first (their derivation adds no work), then the largest saving
    for _, la, chain in sorted(candidates, key=lambda c: (taps[c[1].node_name] == "output",
                                                          -c[0])):
        if la.output in pinned or chain[0] in derived:
            continue
        base = taps[la.node_name]
        if base == "output":
            base = _input_tap(index, la)
            derived.add(la.output)
        taps[la.node_name] = DerivedInputTap(base.op, base.kernel, base.matrix, base.bias,
                                             *chain)
        pinned.add(chain[0])


def _bn_act_chain(index, tensor: str):
    """(y, scale, shift, lo, hi) when ``tensor`` = act(BN(y)): an inference
    BatchNormalization with constant parameters, then a Clip with constant bounds, a Relu,
    or nothing; else None."""
    from ..graph.index import get_attr
    from ..model.optimize import bn_affine

    node = index.producer.get(tensor)
    lo, hi = -np.inf, np.inf
    if node is not None and node.op_type == "Relu":
        lo, node = 0.0, index.producer.get(node.input[0])
    elif node is not None and node.op_type == "Clip":
        bounds = []
        for i, attr, default in ((1, "min", -np.inf), (2, "max", np.inf)):
            name = node.input[i] if len(node.input) > i else ""
            value = index.get_constant(name) if name else get_attr(node, attr, default)
            if value is None or np.size(value) != 1:
                return None
            bounds.append(float(np.asarray(value).reshape(())))
        (lo, hi), node = bounds, index.producer.get(node.input[0])
    affine = None if node is None else bn_affine(node, index.get_constant)
    return None if affine is None else (node.input[0], *affine, lo, hi)


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
    if not _float64_is_cheap(la, n_positions):
        return False
    linear = la.op_type in ("Gemm", "MatMul")
    out_spatial = int(np.prod(la.output_shape[1:-1] if linear else la.output_shape[2:]))
    return 4 * int(np.prod(la.input_shape[1:])) <= la.n_out * out_spatial


def _float64_is_cheap(la, n_positions: int, share: float = 1.0) -> bool:
    """The layer at its sampled positions from its input (k·C_in/groups·Πkernel·C_out
    multiply-adds per image) costs at most ``share`` of one pass over its output (False:
    sizes unknown)."""
    if not la.input_shape or not la.output_shape or not all(
            isinstance(d, int) for d in (*la.input_shape[1:], *la.output_shape[1:])):
        return False  # unknown sizes: keep the output
    linear = la.op_type in ("Gemm", "MatMul")
    out_spatial = int(np.prod(la.output_shape[1:-1] if linear else la.output_shape[2:]))
    macs = min(n_positions, out_spatial) * (la.n_in // la.groups) * int(np.prod(la.kernel)) \
        * la.n_out
    return macs <= share * la.n_out * out_spatial


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

