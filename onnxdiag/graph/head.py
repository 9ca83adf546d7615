"""Find the linear classifier head (SPEC A1, "Head discovery").

The head is the last linear map U = Z Wᵀ + b whose output reaches a scores output
through ops that do not change the class scores' identity (Softmax, LogSoftmax,
Identity, Reshape, Flatten, Squeeze, Unsqueeze, Cast, Dropout, ZipMap, or a
softmax written out as Exp → ReduceSum → Div).  Numerical verification of
U ≈ Z Wᵀ + b on data happens at run time elsewhere; here the head is only found.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import onnx

from ..errors import HeadNotFoundError
from ._records import array_summary, frozen_array
from .index import GraphIndex
from .linear import GLOBAL_POOLS, Linear, linear_at, linear_weight

#: Ops between the logits and a scores output that keep one value per class.
PASS_OPS = frozenset({"Softmax", "LogSoftmax", "Identity", "Reshape", "Flatten", "Squeeze",
                      "Unsqueeze", "Cast", "Dropout", "ZipMap"})
#: Ops that turn scores into labels; outputs reached through them are label outputs.
LABEL_OPS = frozenset({"ArgMax", "ArgMin", "ArrayFeatureExtractor", "TopK", "LabelEncoder"})
FIX = "Name the head with --head NODE; `onnxdiag inspect MODEL` lists candidate linear nodes."


@dataclass(frozen=True, eq=False)
class Head:
    """The classifier head U = Z Wᵀ + b, keyed by ONNX names.

    Fields:
        node_name, op_type: the linear node (Gemm, MatMul or 1×1 Conv).
        features: tensor holding Z's source.
        features_reduce: "flatten" (reshape to (n_samples, n_features)) or
            "spatial_mean" (mean over all axes after the 2nd: a 1×1 conv before pooling).
        logits: tensor holding U (after the bias Add of MatMul+Add; after the pooling of a
            conv-before-pool head); flatten it to (n_samples, n_classes).
        output: the graph output reached (None when a named head reaches none).
        scores: the dense (n_samples, n_classes) tensor nearest to ``output`` (the output
            itself, or the input of a final ZipMap); None when no output is reached.
        output_kind: "logits" | "probabilities" | "log_probabilities" (what ``output`` holds).
        outputs_softmax: ``output_kind == "probabilities"``.
        weight: float64 (n_classes, n_features); bias: float64 (n_classes,), zeros if absent.
        path: op types from ``logits`` to ``output``.
        bias_node: the separate Add node that adds the bias (MatMul + Add), else None.
        note: how it was found (or overridden).
    """

    node_name: str
    op_type: str
    features: str
    features_reduce: str
    logits: str
    output: str | None
    scores: str | None
    output_kind: str
    weight: np.ndarray
    bias: np.ndarray
    path: tuple[str, ...] = ()
    bias_node: str | None = None
    note: str = ""

    @property
    def n_classes(self) -> int:
        return int(self.weight.shape[0])

    @property
    def n_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def outputs_softmax(self) -> bool:
        return self.output_kind == "probabilities"

    def to_dict(self, *, arrays: bool = False) -> dict:
        """JSON-able dict; weight/bias as lists when ``arrays`` else as a shape/norm summary."""
        d = {k: getattr(self, k) for k in (
            "node_name", "op_type", "features", "features_reduce", "logits", "output", "scores",
            "output_kind", "outputs_softmax", "n_classes", "n_features", "bias_node", "note")}
        d["path"] = list(self.path)
        conv = (lambda a: a.tolist()) if arrays else array_summary
        d["weight"], d["bias"] = conv(self.weight), conv(self.bias)
        return d


@dataclass(frozen=True)
class _Trace:
    """A backward walk from a graph output through PASS_OPS / primitive softmax."""

    output: str
    tensor: str
    path: tuple[str, ...]
    kind: str
    scores: str | None


# -- from outputs back to the logits --------------------------------------------------------
def _primitive_softmax(index: GraphIndex, node: onnx.NodeProto) -> str | None:
    """Input x of a written-out softmax (Exp → ReduceSum → Div, optional ReduceMax + Sub)."""
    if node.op_type == "Div":
        num, den = node.input[0], node.input[1]
    elif node.op_type == "Mul":
        recip = [index.producer.get(t) for t in node.input]
        k = next((i for i, r in enumerate(recip) if r is not None and r.op_type == "Reciprocal"),
                 None)
        if k is None:
            return None
        num, den = node.input[1 - k], recip[k].input[0]
    else:
        return None
    exp, total = index.producer.get(num), index.producer.get(den)
    if (exp is None or total is None or exp.op_type != "Exp" or total.op_type != "ReduceSum"
            or total.input[0] != num):
        return None
    x = exp.input[0]
    sub = index.producer.get(x)
    if sub is not None and sub.op_type == "Sub":
        peak = index.producer.get(sub.input[1])
        if peak is not None and peak.op_type == "ReduceMax" and peak.input[0] == sub.input[0]:
            return sub.input[0]
    return x


def _trace(index: GraphIndex, output: str) -> _Trace:
    """Walk back from ``output`` through score-preserving ops to the logits candidate."""
    tensor, path, kind = output, [], None
    scores = output if index.type_kind(output) in (None, "tensor_type") else None
    while (node := index.producer.get(tensor)) is not None:
        if node.op_type in PASS_OPS:
            if node.op_type in ("Softmax", "LogSoftmax") and kind is None:
                kind = "probabilities" if node.op_type == "Softmax" else "log_probabilities"
            if node.op_type == "ZipMap" and scores is None:
                scores = node.input[0]
            path.append(node.op_type)
            tensor = node.input[0]
            continue
        x = _primitive_softmax(index, node)
        if x is None:
            break
        kind = kind or "probabilities"
        path.append("Softmax(Exp/ReduceSum/Div)")
        tensor = x
    return _Trace(output, tensor, tuple(reversed(path)), kind or "logits", scores)


def _is_label_output(index: GraphIndex, trace: _Trace) -> bool:
    if index.is_float(trace.output) is False:
        return True
    node = index.producer.get(trace.tensor)
    return node is not None and node.op_type in LABEL_OPS


# -- public API -----------------------------------------------------------------------------
def find_head(model: onnx.ModelProto | GraphIndex, *, head: str | None = None,
              features: str | None = None) -> Head:
    """Find the classifier head of ``model`` (SPEC A1); never modifies ``model``.

    Args:
        model: a loaded model (see :func:`onnxdiag.model_io.load_model`; shapes inferred).
        head: node name to use as the head instead of searching.
        features: tensor to use as Z's source instead of the head's input.

    Raises:
        HeadNotFoundError: no output is reached from a linear map, or the named head /
            features are unusable; the message names the last node(s) and the fix.
    """
    index = model if isinstance(model, GraphIndex) else GraphIndex(model)
    if head is not None:
        found = _named_head(index, head, features)
    else:
        found = _search_head(index)
    return found if features is None else _with_features(index, found, features)


def find_head_candidates(model: onnx.ModelProto | GraphIndex) -> list[str]:
    """Names of nodes that could be a head (Gemm, MatMul with constant 2-D weight, 1×1
    Conv with group 1), in topological order; may be empty."""
    index = model if isinstance(model, GraphIndex) else GraphIndex(model)
    return [n.name for n in index.nodes if n.op_type in ("Gemm", "MatMul", "Conv")
            and not isinstance(linear_weight(index, n), str)]


def _make_head(lin: Linear, trace: _Trace | None, note: str) -> Head:
    return Head(
        node_name=lin.node.name, op_type=lin.node.op_type, features=lin.features,
        features_reduce=lin.reduce, logits=lin.logits,
        output=trace.output if trace else None, scores=trace.scores if trace else None,
        output_kind=trace.kind if trace else "logits",
        weight=frozen_array(lin.weight), bias=frozen_array(lin.bias),
        path=trace.path if trace else (), bias_node=lin.bias_node, note=note)


def _search_head(index: GraphIndex) -> Head:
    traces = [_trace(index, out) for out in index.outputs]
    scores = [t for t in traces if not _is_label_output(index, t)]
    reasons = []
    for trace in scores:
        lin = linear_at(index, trace.tensor)
        if isinstance(lin, Linear):
            ignored = [t.output for t in traces if t not in scores]
            note = f"found from output {trace.output!r}"
            note += f"; label outputs ignored: {', '.join(ignored)}" if ignored else ""
            return _make_head(lin, trace, note)
        reasons.append(_describe_stop(index, trace, lin))
    if not scores:
        reasons = [f"every output ({', '.join(index.outputs)}) is a label output"]
    raise HeadNotFoundError(f"No linear classifier head found: {'; '.join(reasons)}. {FIX}")


def _describe_stop(index: GraphIndex, trace: _Trace, reason: str) -> str:
    node = index.producer.get(trace.tensor)
    if node is None:
        return f"output {trace.output!r} comes from graph input {trace.tensor!r}"
    return (f"the last node before output {trace.output!r} is {node.op_type!r} "
            f"(node {node.name!r}: {reason})")


def _candidates_hint(index: GraphIndex) -> str:
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
            f"Head node {head!r} is not in the model ({_candidates_hint(index)}).")
    wb = linear_weight(index, node)
    if isinstance(wb, str):
        raise HeadNotFoundError(
            f"Node {head!r} ({node.op_type}) cannot be the head: {wb} ({_candidates_hint(index)}).")
    lin = None
    for user, _ in index.consumers_of(node.output[0]):
        if user.op_type == "Add" or user.op_type in GLOBAL_POOLS:
            found = linear_at(index, user.output[0])
            lin = found if isinstance(found, Linear) and found.node is node else lin
    if lin is None:
        found = linear_at(index, node.output[0])
        lin = found if isinstance(found, Linear) else Linear(node, *wb, node.input[0],
                                                               node.output[0])
        if isinstance(found, str) and features is None:
            raise HeadNotFoundError(f"Node {head!r} cannot be the head: {found}; name the "
                                    "features tensor with --features TENSOR.")
    trace = next((t for t in map(lambda o: _trace(index, o), index.outputs)
                  if t.tensor == lin.logits), None)
    return _make_head(lin, trace, "named with --head")


def _with_features(index: GraphIndex, head: Head, features: str) -> Head:
    """``head`` with Z read from ``features`` (reduce mode from its shape)."""
    if not index.is_tensor(features):
        raise HeadNotFoundError(
            f"Features tensor {features!r} is not in the model; name a node output "
            f"(the head {head.node_name!r} reads {head.features!r}).")
    shape = index.shape(features)
    spatial = shape is not None and len(shape) > 2 and any(d != 1 for d in shape[2:])
    reduce = "spatial_mean" if spatial else "flatten"
    dims = shape[1:2] if spatial else (shape[1:] if shape else ())
    if shape is not None and all(isinstance(d, int) for d in dims):
        width = int(np.prod(dims))
        if width != head.n_features:
            raise HeadNotFoundError(
                f"Features tensor {features!r} has {width} features per sample but head "
                f"{head.node_name!r} expects {head.n_features}; name the head's input instead.")
    note = f"{head.note}; features named with --features".lstrip("; ")
    return replace(head, features=features, features_reduce=reduce, note=note)
