"""Head discovery by verification on a batch (docs/METHODS.md §A1, §D).

From each graph output, :func:`find_verified_head` walks back through *any* ops to the last
linear map(s) with constant weights (:func:`onnxdiag.graph.trace.walk_back`), exposes each
candidate's features and logits, runs the first batch once, and keeps the first candidate
for which both hold, each as a relative error ‖a − b‖_F / (‖b‖_F + 1e-12) ≤ ``TOLERANCE``
(1e-4):

1. the linear map: U = Z Wᵀ + b reproduces the logits tensor (``Head.rel_error``);
2. the relation: the output equals identity(U), softmax(U), log_softmax(U) or sigmoid(U)
   (``Head.relation_error``), or, for a label output, argmax(U) for every sample.

A per-token head (a MatMul over (n_samples, n_tokens, n_features), then a Gather /
GatherND / Slice of one token) is matched against every float tensor between the head and
the output: its logits tensor is the one whose rows are each some token's head output, and
Z is the head's input at that token.  No candidate verified: HeadNotFoundError with the
measured mismatch of each.  Never modifies the model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import onnx

from ..errors import HeadNotFoundError
from .dense import check_dense, dense_linear
from .head import (
    Head,
    candidates_hint,
    feature_matrix,
    find_head,
    head_from_trace,
    make_head,
    with_features,
)
from .index import GraphIndex
from .linear import Linear, linear_of
from .trace import Trace, trace_output, walk_back

#: Largest relative error accepted for the linear map and for the relation (§A1).
TOLERANCE = 1e-4
EPS = 1e-12
_ADVICE = ("Name the head with --head NODE or the features with --features TENSOR; "
           "`onnxdiag inspect MODEL` lists candidate linear nodes.")


@dataclass(frozen=True)
class Candidate:
    """An unverified head and the tensors that may hold its logits U (n_samples, n_classes)."""

    head: Head
    logits_options: tuple[str, ...]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + EPS))


def _log_softmax(u: np.ndarray) -> np.ndarray:
    shifted = u - u.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


RELATIONS = {
    "identity": lambda u: u,
    "softmax": lambda u: np.exp(_log_softmax(u)),
    "log_softmax": _log_softmax,
    "sigmoid": lambda u: 1.0 / (1.0 + np.exp(-u)),
}


# -- candidates ------------------------------------------------------------------------------
def head_candidates(index: GraphIndex, *, head: str | None = None,
                    features: str | None = None) -> tuple[list[Candidate], list[str]]:
    """Candidates to verify, most likely first, and why other last linear nodes are none.

    The named head alone; else for each output (score outputs before label outputs) the
    head found without data, then every last linear map on the output's float paths.
    Raises HeadNotFoundError only for a bad named head.
    """
    if head is not None:
        found = find_head(index, head=head, features=features)
        return [Candidate(_reached_output(index, found), (found.logits,))], []
    traces = sorted((trace_output(index, out) for out in index.outputs), key=lambda t: t.label)
    out: list[Candidate] = []
    reasons: list[str] = []
    for trace in traces:
        static = None if trace.label else head_from_trace(
            index, trace, f"found from output {trace.output!r}")
        if isinstance(static, Head):
            out.append(_candidate(index, static, features, (static.logits,)))
        nodes, tensors = walk_back(index, trace.scores or trace.output)
        for node in nodes:
            lin = linear_of(index, node)
            dense = dense_linear(index, node)
            if isinstance(dense, Linear) and (isinstance(lin, str) or (
                    lin.reduce == "token" and not trace.picked)):
                lin = dense  # applied at every position, nothing pooled or picked (§A4)
            if isinstance(lin, str):
                reasons.append(static if isinstance(static, str) else
                               f"node {node.name!r} ({node.op_type}): {lin}")
                continue
            try:
                out.append(_loose_candidate(index, lin, trace, tensors, features))
            except HeadNotFoundError:  # --features does not fit this node: not a candidate
                continue
    return _unique(out), list(dict.fromkeys(reasons))


def _reached_output(index: GraphIndex, head: Head) -> Head:
    """``head`` with the output it is a last linear map of (through any ops) when it was
    named and no known op leads to an output: the relation is then checked there too."""
    if head.output is not None:
        return head
    for out in index.outputs:
        trace = trace_output(index, out)
        nodes, _ = walk_back(index, trace.scores or out)
        if any(n.name == head.node_name for n in nodes) and not trace.label:
            return replace(head, output=out, scores=trace.scores)
    return head


def _candidate(index, head: Head, features, options) -> Candidate:
    return Candidate(head if features is None else with_features(index, head, features),
                     tuple(options))


def _loose_candidate(index, lin: Linear, trace: Trace, tensors, features) -> Candidate:
    """A candidate reached through any ops; its relation is found on data."""
    loose = Trace(trace.output, trace.scores, lin.logits, (), "identity", lin.logits,
                  lin.reduce == "token", False, trace.label)
    note = f"verified from output {trace.output!r} through any ops"
    head = make_head(lin, loose, note)
    if lin.reduce != "token":  # also a per-position head: its logits are its own output
        return _candidate(index, head, features, (lin.logits,))
    options = [t for t in tensors if t in index.producer and t != lin.logits
               and index.is_float(t) is not False]
    return _candidate(index, head, features, options)


def _unique(candidates: list[Candidate]) -> list[Candidate]:
    seen, out = set(), []
    for c in candidates:
        key = (c.head.node_name, c.head.output, c.head.features, c.logits_options)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _exposed(candidates: list[Candidate]) -> list[str]:
    names = []
    for c in candidates:
        names += [c.head.features, *c.logits_options]
        names += [n for n in (c.head.scores, c.head.output) if n]
    return list(dict.fromkeys(names))


# -- checks ------------------------------------------------------------------------------------
def _linear_fit(head: Head, values: dict, options) -> tuple[float, str, np.ndarray] | str:
    """(error, logits tensor, U) of the best-fitting logits option, or why none fits."""
    feats = values[head.features]
    n, best = np.shape(feats)[0], None
    for name in options:
        u = np.asarray(values[name], dtype=np.float64)
        if u.size != n * head.n_classes or np.size(feats) % (n * head.n_features):
            continue
        u = u.reshape(n, head.n_classes)
        z = feature_matrix(feats, head, u)
        if z.shape[1] != head.n_features:
            continue
        err = _rel(z @ head.weight.T + head.bias, u)
        if best is None or err < best[0]:
            best = (err, name, u)
        if err <= TOLERANCE:
            break
    if best is None:
        return (f"node {head.node_name!r} ({head.op_type}): no tensor fits features "
                f"{head.features!r} {tuple(np.shape(feats))} and {head.n_classes} classes")
    return best


def _relation(u: np.ndarray, target: np.ndarray, label: bool,
              rounding=None) -> dict[str, float] | str:
    """Error of each relation output = relation(U) (argmax: fraction of differing labels);
    ``rounding``: a QuantizeLinear → DequantizeLinear on the way, applied after (or before)
    the relation, whichever fits better."""
    n = u.shape[0]
    if label:
        if np.size(target) != n:
            return f"label output has {np.size(target) // max(n, 1)} values per sample"
        return {"argmax": float(np.mean(np.asarray(target).reshape(n) != u.argmax(axis=1)))}
    y = np.asarray(target, dtype=np.float64)
    if y.size != u.size:
        return f"output has {y.size // max(n, 1)} values per sample, the head {u.shape[1]}"
    y = y.reshape(u.shape)
    with np.errstate(over="ignore"):
        if rounding is None:
            return {name: _rel(f(u), y) for name, f in RELATIONS.items()}
        return {name: min(_rel(rounding(f(u)), y), _rel(f(rounding(u)), y))
                for name, f in RELATIONS.items()}


def _rounding(index: GraphIndex, nodes) -> object | None:
    """y ↦ DequantizeLinear(QuantizeLinear(y)) of the first per-tensor QuantizeLinear among
    ``nodes`` (ONNX rounding: half to even, saturating), or None."""
    for node in nodes:
        if node.op_type != "QuantizeLinear" or len(node.input) < 2:
            continue
        scale = index.get_constant(node.input[1])
        zero = index.get_constant(node.input[2]) if len(node.input) > 2 and node.input[2] \
            else np.zeros((), np.uint8)
        if scale is None or zero is None or scale.size != 1 or zero.size != 1:
            continue
        info = np.iinfo(zero.dtype)
        s, z = np.float32(scale.ravel()[0]), float(zero.ravel()[0])

        def rounding(y, s=s, z=z, lo=info.min, hi=info.max):
            q = np.clip(np.rint(y.astype(np.float32) / s) + z, lo, hi)
            return (q - z) * np.float64(s)

        return rounding
    return None


def check_candidate(candidate: Candidate, values: dict, index: GraphIndex) -> Head | str:
    """The verified Head of ``candidate`` on the batch ``values``, or the measured mismatch."""
    head = candidate.head
    if head.dense:
        return check_dense(head, values, index)
    fit = _linear_fit(head, values, candidate.logits_options)
    if isinstance(fit, str):
        return fit
    err, logits, u = fit
    what = f"node {head.node_name!r} ({head.op_type})"
    if err > TOLERANCE:
        return f"{what}: Z Wᵀ + b differs from {logits!r} by relative error {err:.3g}"
    if head.output is None:
        return replace(head, logits=logits, rel_error=err,
                       note=f"{head.note}; linear map verified (reaches no output)".lstrip("; "))
    label = index.is_float(head.output) is False
    between = _nodes_between(index, logits, head.scores or head.output)
    errors = _relation(u, values[head.output if label else head.scores or head.output], label,
                       _rounding(index, between))
    if isinstance(errors, str):
        return f"{what}: {errors}"
    relation = min(errors, key=errors.get)
    if errors[relation] > TOLERANCE:
        measured = ", ".join(f"{k} {v:.3g}" for k, v in errors.items())
        return f"{what}: no relation maps {logits!r} to output {head.output!r} ({measured})"
    path = head.path if logits == head.logits and head.path else tuple(
        n.op_type for n in between)
    note = f"{head.note}; verified on a batch of {u.shape[0]}".lstrip("; ")
    return replace(head, logits=logits, relation=relation, rel_error=err, path=path,
                   relation_error=errors[relation], note=note)


def _nodes_between(index: GraphIndex, start: str, end: str) -> list:
    """The nodes on paths from tensor ``start`` to tensor ``end``, in topological order."""
    ahead, stack = set(), [start]
    while stack:
        for node, _ in index.consumers_of(stack.pop()):
            if id(node) not in ahead:
                ahead.add(id(node))
                stack.extend(node.output)
    behind, stack = set(), [end]
    while stack:
        node = index.producer.get(stack.pop())
        if node is not None and id(node) in ahead and id(node) not in behind:
            behind.add(id(node))
            stack.extend(node.input)
    return [n for n in index.nodes if id(n) in behind]


# -- entry points ------------------------------------------------------------------------------
def _tensor_outputs_only(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without its non-tensor outputs (skl2onnx's ZipMap maps) and the nodes that
    only make them: the check reads the tensor before them.  A copy when anything goes."""
    graph = model.graph
    dropped = {o.name for o in graph.output if o.type.WhichOneof("value") not in
               (None, "tensor_type")}
    if not dropped:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    read = {t for n in graph.node for t in n.input}
    keep = [n for n in copy.graph.node if not set(n.output) <= dropped - read]
    del copy.graph.node[:]
    copy.graph.node.extend(keep)
    outputs = [o for o in copy.graph.output if o.name not in dropped]
    del copy.graph.output[:]
    copy.graph.output.extend(outputs)
    return copy


def run_exposed(model, feeds: dict, names: list[str], *, providers=None) -> dict:
    """Run ``feeds`` once on a copy of ``model`` exposing ``names``; {name: array}."""
    from ..model.expose import expose_tensors
    from ..runtime.runner import OrtRunner

    model = _tensor_outputs_only(model)
    made = {t for n in model.graph.node for t in n.output}
    runner = OrtRunner(expose_tensors(model, [n for n in names if n in made]),
                       providers=providers)
    values = runner.run(feeds, [n for n in names if n in runner.output_names])
    return {**{n: np.asarray(feeds[n]) for n in names if n in feeds}, **values}


def choose_head(candidates: list[Candidate], values: dict, index: GraphIndex,
                rejected: list[str] = ()) -> Head:
    """The first candidate that verifies on ``values``; HeadNotFoundError (naming each
    candidate's measured mismatch, then the ``rejected`` nodes' reasons) otherwise."""
    reasons = []
    for candidate in candidates:
        found = check_candidate(candidate, values, index)
        if isinstance(found, Head):
            return found
        reasons.append(found)
    if not reasons and not rejected:
        raise HeadNotFoundError(
            f"No linear classifier head found: no output is reached from a linear map with "
            f"constant weights ({candidates_hint(index)}). {_ADVICE}")
    reasons += list(rejected)
    shown = "; ".join(reasons[:4]) + (f"; … ({len(reasons)} in all)" if len(reasons) > 4
                                      else "")
    raise HeadNotFoundError(
        f"No candidate head reproduces the model's output on the first batch (relative error "
        f"≤ {TOLERANCE:g}): {shown}. {_ADVICE}")


def find_verified_head(model, feeds: dict, *, head: str | None = None,
                       features: str | None = None, providers=None) -> Head:
    """The head of ``model`` verified on one batch ``feeds`` ({input name: array}).

    ``head`` / ``features``: as for :func:`onnxdiag.graph.find_head` (a named head is only
    verified, not searched for).  Returns a Head with ``relation``, ``rel_error`` and
    ``relation_error`` measured.  Raises HeadNotFoundError naming each candidate's mismatch.
    """
    index = model if isinstance(model, GraphIndex) else GraphIndex(model)
    candidates, rejected = head_candidates(index, head=head, features=features)
    values = run_exposed(index.model, feeds, _exposed(candidates), providers=providers) \
        if candidates else {}
    return choose_head(candidates, values, index, rejected)


def verify_head_on(model, head: Head, feeds: dict, *, providers=None,
                   values: dict | None = None) -> Head:
    """``head`` with its relation and errors measured on ``feeds`` (or on already computed
    ``values`` holding its features, logits and output); HeadNotFoundError when it fails."""
    index = model if isinstance(model, GraphIndex) else GraphIndex(model)
    candidate = Candidate(_reached_output(index, head), (head.logits,))
    if values is None or not set(_exposed([candidate])) <= set(values):
        values = run_exposed(index.model, feeds, _exposed([candidate]), providers=providers)
    return choose_head([candidate], values, index)
