"""Find the linear classifier head (docs/METHODS.md §A1, "Head discovery").

The head is the last linear map U = Z Wᵀ + b (Gemm, MatMul (+ Add), 1×1 Conv before or
after global pooling) with constant weights whose output reaches a scores output.
:func:`find_head` finds it without data, walking back through ops known to keep one score
per class (:func:`onnxdiag.graph.trace.trace_output`); the relation it reports is then
what those ops say.  :func:`onnxdiag.graph.verify.find_verified_head` checks on a batch
which relation actually holds, whatever ops lie in between.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import onnx

from ..errors import HeadNotFoundError
from ._records import array_summary, frozen_array
from .dense import (
    DENSE,
    class_axis,
    dense_linear,
    dense_linear_at,
    position_rows,
    static_relation,
)
from .index import GraphIndex, get_attr
from .linear import Linear, linear_at, linear_of, linear_weight
from .trace import Trace, trace_output

FIX = "Name the head with --head NODE; `onnxdiag inspect MODEL` lists candidate linear nodes."
#: What the output holds for each relation output = relation(U).
OUTPUT_KINDS = {"identity": "logits", "softmax": "probabilities",
                "log_softmax": "log_probabilities", "sigmoid": "sigmoid", "argmax": "labels"}


@dataclass(frozen=True, eq=False)
class Head:
    """The classifier head U = Z Wᵀ + b, keyed by ONNX names.

    Fields:
        node_name, op_type: the linear node (Gemm, MatMul or 1×1 Conv).
        features: tensor holding Z's source.
        features_reduce: "flatten" (reshape to (n_samples, n_features)), "spatial_mean"
            (mean over all axes after the 2nd: a 1×1 conv before pooling), "token"
            (features (n_samples, n_tokens, n_features); Z is the row of the token whose
            head output is the logits row: a decoder-style classifier's picked token) or
            "positions" (a per-position head, §A4: every position is a row of Z and U;
            :mod:`onnxdiag.graph.dense`).
        logits: tensor holding U (after the bias Add of MatMul+Add; after the pooling of a
            conv-before-pool head; after the token pick of a per-token head); flatten it
            to (n_samples, n_classes).
        output: the graph output reached (None when a named head reaches none).
        scores: the dense (n_samples, n_classes) tensor nearest to ``output`` (the output
            itself, or the input of a final ZipMap); None when no output is reached.
        relation: output = relation(U): "identity" | "softmax" | "log_softmax" |
            "sigmoid" | "argmax" (see ``output_kind``).
        weight: float64 (n_classes, n_features); bias: float64 (n_classes,), zeros if absent.
        path: op types from ``logits`` to ``output`` (as found without data).
        bias_node: the separate Add node that adds the bias, else None.
        note: how it was found (or overridden).
        rel_error: |Z Wᵀ + b − U|_F / |U|_F measured on a batch (None: not verified).
        relation_error: |relation(U) − output|_F / |output|_F on that batch (for "argmax",
            the fraction of differing labels); None when not verified or no output.
    """

    node_name: str
    op_type: str
    features: str
    features_reduce: str
    logits: str
    output: str | None
    scores: str | None
    relation: str
    weight: np.ndarray
    bias: np.ndarray
    path: tuple[str, ...] = ()
    bias_node: str | None = None
    note: str = ""
    rel_error: float | None = None
    relation_error: float | None = None

    @property
    def n_classes(self) -> int:
        return int(self.weight.shape[0])

    @property
    def n_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def dense(self) -> bool:
        """Whether the head is applied at every position (rows = positions, §A4)."""
        return self.features_reduce == DENSE

    @property
    def output_kind(self) -> str:
        """"logits" | "probabilities" | "log_probabilities" | "sigmoid" | "labels"."""
        return OUTPUT_KINDS[self.relation]

    @property
    def outputs_softmax(self) -> bool:
        return self.output_kind == "probabilities"

    @property
    def verified(self) -> bool:
        """Whether the head was checked numerically on data (``rel_error`` is set)."""
        return self.rel_error is not None

    def to_dict(self, *, arrays: bool = False) -> dict:
        """JSON-able dict; weight/bias as lists when ``arrays`` else as a shape/norm summary."""
        d = {k: getattr(self, k) for k in (
            "node_name", "op_type", "features", "features_reduce", "logits", "output", "scores",
            "relation", "output_kind", "outputs_softmax", "n_classes", "n_features",
            "bias_node", "note", "verified", "rel_error", "relation_error")}
        d["path"] = list(self.path)
        conv = (lambda a: a.tolist()) if arrays else array_summary
        d["weight"], d["bias"] = conv(self.weight), conv(self.bias)
        return d


def token_features(values: np.ndarray, logits: np.ndarray, weight: np.ndarray,
                   bias: np.ndarray) -> np.ndarray:
    """Z (n_samples, n_features): per sample, the token row of ``values`` (n_samples, …,
    n_features) whose head output row Z Wᵀ + b is nearest to that sample's ``logits`` row
    (n_samples, n_classes) — the token a decoder-style classifier picked (§D)."""
    n, d = values.shape[0], weight.shape[1]
    tokens = np.asarray(values, dtype=np.float64).reshape(n, -1, d)
    rows = tokens @ weight.T + bias
    pick = np.argmin(((rows - np.asarray(logits, np.float64)[:, None, :]) ** 2).sum(-1), axis=1)
    return tokens[np.arange(n), pick]


def feature_matrix(values: np.ndarray, head: Head, logits: np.ndarray) -> np.ndarray:
    """Z (n_samples, n_features) from the ``head.features`` values, by ``features_reduce``
    (``logits``: U (n_samples, n_classes), used by "token" to find the picked token); for a
    per-position head Z (n_samples·positions, n_features)."""
    if head.features_reduce == DENSE:
        return position_rows(values, class_axis(head.op_type))
    values = np.asarray(values, dtype=np.float64)
    n = values.shape[0]
    if head.features_reduce == "spatial_mean" and values.ndim > 2:
        return values.reshape(n, values.shape[1], -1).mean(axis=2)
    if head.features_reduce == "token":
        return token_features(values, logits, head.weight, head.bias)
    return values.reshape(n, -1)


# -- public API -----------------------------------------------------------------------------
def find_head(model: onnx.ModelProto | GraphIndex, *, head: str | None = None,
              features: str | None = None) -> Head:
    """Find the classifier head of ``model`` without data (§A1); never modifies ``model``.

    Args:
        model: a loaded model (see :func:`onnxdiag.model.io.load_model`; shapes inferred).
        head: node name to use as the head instead of searching.
        features: tensor to use as Z's source instead of the head's input.

    Raises:
        HeadNotFoundError: no output is reached from a linear map through known ops, or
            the named head / features are unusable; the message names the last node(s)
            and the fix.
    """
    index = model if isinstance(model, GraphIndex) else GraphIndex(model)
    found = _named_head(index, head, features) if head is not None else _search_head(index)
    return found if features is None else with_features(index, found, features)


def find_head_candidates(model: onnx.ModelProto | GraphIndex) -> list[str]:
    """Names of nodes that could be a head (Gemm, MatMul with a constant 2-D weight, 1×1
    Conv with group 1), in topological order; may be empty; never raises on odd graphs.
    Checks shapes only (no weight is copied)."""
    index = model if isinstance(model, GraphIndex) else GraphIndex(model)
    return [node.name for node in index.nodes if _could_be_head(index, node)]


def _could_be_head(index: GraphIndex, node: onnx.NodeProto) -> bool:
    if node.op_type not in ("Gemm", "MatMul", "Conv") or len(node.input) < 2 \
            or node.domain not in ("", "ai.onnx"):
        return False
    w = index.get_constant(node.input[1])
    if w is None:
        return False
    if node.op_type == "Conv":
        return w.ndim >= 3 and all(k == 1 for k in w.shape[2:]) \
            and get_attr(node, "group", 1) == 1
    return w.ndim == 2 and not (node.op_type == "Gemm" and get_attr(node, "transA", 0))


def make_head(lin: Linear, trace: Trace | None, note: str) -> Head:
    """The (unverified) Head record of ``lin`` reached through ``trace`` (None: no output)."""
    token = lin.reduce == "token"
    return Head(
        node_name=lin.node.name, op_type=lin.node.op_type, features=lin.features,
        features_reduce=lin.reduce, logits=trace.logits if token and trace else lin.logits,
        output=trace.output if trace else None, scores=trace.scores if trace else None,
        relation=trace.relation if trace else "identity",
        weight=frozen_array(lin.weight), bias=frozen_array(lin.bias),
        path=trace.path if trace else (), bias_node=lin.bias_node, note=note)


def head_from_trace(index: GraphIndex, trace: Trace, note: str) -> Head | str:
    """The head at the end of ``trace``, or why there is none there."""
    lin = linear_at(index, trace.tensor)
    if isinstance(lin, str):
        return _describe_stop(index, trace, lin)
    if lin.reduce == "token" and not trace.picked:
        return (f"MatMul {lin.node.name!r} is applied to every token of "
                f"{lin.features!r} and no Gather/Slice picks one token before output "
                f"{trace.output!r}")
    if lin.reduce == "token" and trace.relation_per_token:
        return (f"the scores of every token of MatMul {lin.node.name!r} are computed "
                f"before one token is picked for output {trace.output!r}: no tensor holds "
                "the picked token's logits")
    if lin.reduce != "token" and trace.picked:
        return (f"a Gather/Slice between {lin.node.name!r} (features {lin.features!r}, one "
                f"row per sample) and output {trace.output!r} picks classes, not a token")
    return make_head(lin, trace, note)


def _search_head(index: GraphIndex) -> Head:
    traces = [trace_output(index, out) for out in index.outputs]
    scores = [t for t in traces if not t.label]
    ignored = [t.output for t in traces if t.label]
    reasons = []
    for trace in scores:
        note = f"found from output {trace.output!r}"
        note += f"; label outputs ignored: {', '.join(ignored)}" if ignored else ""
        found = head_from_trace(index, trace, note)
        if isinstance(found, Head):
            return found
        reasons.append(found)
    dense = next((h for h in (dense_from_trace(index, t) for t in scores) if h), None)
    if dense is not None:
        return dense
    if not scores:
        reasons = [f"every output ({', '.join(index.outputs)}) is a label output"]
    raise HeadNotFoundError(f"No linear classifier head found: {'; '.join(reasons)}. {FIX}")


def dense_from_trace(index: GraphIndex, trace: Trace) -> Head | None:
    """The per-position head (§A4) that produces ``trace``'s output unchanged or through a
    relation over its class axis, or None."""
    for tensor in dict.fromkeys((trace.logits, trace.tensor, trace.output)):
        lin = dense_linear_at(index, tensor)
        if isinstance(lin, str):
            continue
        relation = static_relation(index, lin, trace.scores or trace.output)
        if relation is not None:
            found = Trace(trace.output, trace.scores, lin.logits, (), relation, lin.logits,
                          False, False, trace.label)
            return make_head(lin, found, f"found from output {trace.output!r}; per-position "
                                         "head (rows = positions)")
    return None


def _describe_stop(index: GraphIndex, trace: Trace, reason: str) -> str:
    node = index.producer.get(trace.tensor)
    if node is None:
        return f"output {trace.output!r} comes from graph input {trace.tensor!r}"
    return (f"the last node before output {trace.output!r} is {node.op_type!r} "
            f"(node {node.name!r}: {reason})")


def candidates_hint(index: GraphIndex) -> str:
    """"candidate linear nodes: …" (the last 5) or that there are none."""
    names = find_head_candidates(index)
    if not names:
        return "the model has no candidate linear nodes"
    shown = names[-5:]
    prefix = f"last 5 of {len(names)} " if len(names) > 5 else ""
    return f"{prefix}candidate linear nodes: {', '.join(shown)}"


def _named_head(index: GraphIndex, head: str, features: str | None) -> Head:
    node = index.node_by_name.get(head)
    if node is None:
        raise HeadNotFoundError(
            f"Head node {head!r} is not in the model ({candidates_hint(index)}).")
    wb = linear_weight(index, node)
    if isinstance(wb, str):
        raise HeadNotFoundError(
            f"Node {head!r} ({node.op_type}) cannot be the head: {wb} ({candidates_hint(index)}).")
    lin = linear_of(index, node)
    dense = dense_linear(index, node)
    if isinstance(lin, str):
        if isinstance(dense, Linear):
            return _named_dense(index, dense)
        if features is None:
            raise HeadNotFoundError(f"Node {head!r} cannot be the head: {lin}; name the "
                                    "features tensor with --features TENSOR.")
        lin = Linear(node, *wb, node.input[0], node.output[0])
    trace = next((t for t in map(lambda o: trace_output(index, o), index.outputs)
                  if t.tensor == lin.logits and not t.label), None)
    if lin.reduce == "token" and (trace is None or not trace.picked):
        if isinstance(dense, Linear):  # every token is used: rows = tokens (§A4)
            return _named_dense(index, dense)
        raise HeadNotFoundError(
            f"Node {head!r} is applied to every token of {lin.features!r} and no output picks "
            "one token from it; name the features tensor with --features TENSOR.")
    return make_head(lin, trace, "named with --head")


def _named_dense(index: GraphIndex, lin: Linear) -> Head:
    """A named per-position head, with the output it reaches (and its relation) if known."""
    for out in index.outputs:
        relation = static_relation(index, lin, out)
        if relation is not None:
            trace = Trace(out, out, lin.logits, (), relation, lin.logits, False, False,
                          index.is_float(out) is False)
            return make_head(lin, trace, "named with --head; per-position head")
    return make_head(lin, None, "named with --head; per-position head")


def with_features(index: GraphIndex, head: Head, features: str) -> Head:
    """``head`` with Z read from ``features`` (reduce mode from its shape)."""
    if not index.is_tensor(features):
        raise HeadNotFoundError(
            f"Features tensor {features!r} is not in the model; name a node output "
            f"(the head {head.node_name!r} reads {head.features!r}).")
    shape = index.shape(features)
    if head.dense:
        return _dense_features(head, features, shape)
    token = head.features_reduce == "token" and shape is not None and len(shape) == 3
    spatial = not token and shape is not None and len(shape) > 2 \
        and any(d != 1 for d in shape[2:])
    reduce = "token" if token else "spatial_mean" if spatial else "flatten"
    dims = shape[2:] if token else shape[1:2] if spatial else (shape[1:] if shape else ())
    if shape is not None and all(isinstance(d, int) for d in dims):
        width = int(np.prod(dims))
        if width != head.n_features:
            raise HeadNotFoundError(
                f"Features tensor {features!r} has {width} features per sample but head "
                f"{head.node_name!r} expects {head.n_features}; name the head's input instead.")
    note = f"{head.note}; features named with --features".lstrip("; ")
    return replace(head, features=features, features_reduce=reduce, note=note)


def _dense_features(head: Head, features: str, shape) -> Head:
    """A per-position ``head`` reading Z from ``features`` (n_samples, …, D per position)."""
    width = None if shape is None else shape[class_axis(head.op_type)]
    if isinstance(width, int) and width != head.n_features:
        raise HeadNotFoundError(
            f"Features tensor {features!r} has {width} features per position but head "
            f"{head.node_name!r} expects {head.n_features}; name the head's input instead.")
    note = f"{head.note}; features named with --features".lstrip("; ")
    return replace(head, features=features, note=note)
