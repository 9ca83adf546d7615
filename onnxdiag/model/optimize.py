"""Export-time graph optimisation of an emitted model (docs/METHODS.md §B6).

:func:`optimize_for_inference` returns a copy of a model with

- every Conv + BatchNormalization pair folded into the Conv (``fold_bn``): the BN reads
  the Conv's output, that output has no other reader and is no graph output, the Conv's
  weight is stored (an initializer, not computed) and the BN's parameters are constants:
  W'[c] = W[c]·s_c, b'_c = (b_c − μ_c)·s_c + β_c, s_c = γ_c/√(σ²_c + ε), computed in
  float64 and stored in the weights' type, so the outputs change by float rounding only;
- redundant nodes removed (``simplify``): Identity, inference Dropout, Cast to the
  input's own type, Transpose with the identity permutation, Reshape / Flatten whose
  output shape is its input shape, a Transpose after a Transpose (composed into one, or
  both removed when they cancel) and a Reshape after a Reshape (the first one skipped).

Every removal is exact. Tensors named in ``keep`` (e.g. the head's features and logits)
keep their name and their value. The copy comes back through ``ModelEditor.finish``
(shapes re-inferred, full checker); the input model is never modified.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import onnx

from ..graph.index import GraphIndex, get_attr
from .edit import ModelEditor

_DEFAULT_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True)
class OptimizeRecord:
    """What :func:`optimize_for_inference` did.

    Fields:
        folded: (Conv node, BatchNormalization node) pairs folded, in graph order.
        removed: (node, reason) for every node removed or merged by the simplification.
    """

    folded: tuple[tuple[str, str], ...] = ()
    removed: tuple[tuple[str, str], ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.folded or self.removed)

    def to_dict(self) -> dict:
        """JSON-able dict of every field (pairs as lists)."""
        return {f.name: [list(p) for p in getattr(self, f.name)] for f in fields(self)}


def optimize_for_inference(model: onnx.ModelProto, *, fold_bn: bool = True,
                           simplify: bool = True, keep=()) -> tuple[onnx.ModelProto,
                                                                    OptimizeRecord]:
    """``(optimised copy, record)`` of ``model`` (see the module docstring); with nothing
    to do (or both passes off) the copy is ``model`` finalized unchanged."""
    editor = ModelEditor(model)
    keep = set(keep)
    folded = fold_conv_bn(editor, keep) if fold_bn else []
    removed = remove_redundant(editor, keep) if simplify else []
    return editor.finish(), OptimizeRecord(tuple(folded), tuple(removed))


# -- Conv + BatchNormalization ----------------------------------------------------------------
def fold_conv_bn(editor: ModelEditor, keep: set) -> list[tuple[str, str]]:
    """Fold every foldable Conv + BatchNormalization pair in ``editor``; returns the pairs."""
    done = []
    for bn_name in [n.name for n in editor.index.nodes if n.op_type == "BatchNormalization"]:
        pair = _foldable(editor.index, editor.index.node_by_name.get(bn_name), keep)
        if pair is None:
            continue
        conv, bn, (weight, bias) = pair
        params = [editor.value(bn.input[i]).astype(np.float64) for i in range(1, 5)]
        w, b = fold_bn_into(weight, bias, *params, epsilon=get_attr(bn, "epsilon", 1e-5))
        editor.set_input(conv.name, 1, w.astype(weight.dtype))
        editor.set_input(conv.name, 2, b.astype(weight.dtype), stem=f"{conv.name}.bias")
        out = bn.output[0]
        editor.remove_node(bn.name)
        editor.set_output(conv.name, 0, out)
        done.append((conv.name, bn.name))
    return done


def fold_bn_into(weight: np.ndarray, bias: np.ndarray | None, scale, shift, mean, var, *,
                 epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """Float64 (weight, bias) of a Conv followed by an inference BatchNormalization."""
    s = np.asarray(scale, np.float64) / np.sqrt(np.asarray(var, np.float64) + epsilon)
    w = np.asarray(weight, np.float64) * s.reshape((-1,) + (1,) * (weight.ndim - 1))
    b = np.zeros(len(s)) if bias is None else np.asarray(bias, np.float64)
    return w, (b - mean) * s + shift


def is_inference_bn(node) -> bool:
    """``node`` is a default-domain BatchNormalization in inference form: its five inputs,
    one output, not training, per-channel (``spatial`` 1)."""
    return node.op_type == "BatchNormalization" and node.domain in _DEFAULT_DOMAINS \
        and len(node.input) == 5 and not any(node.output[1:]) \
        and not get_attr(node, "training_mode", 0) and get_attr(node, "spatial", 1) == 1


def bn_affine(bn, constant) -> tuple[np.ndarray, np.ndarray] | None:
    """(s, b), float64 per channel, with bn(y) = s·y + b (s = γ/√(σ² + ε), b = β − μ·s),
    for an inference BatchNormalization (:func:`is_inference_bn`) whose four parameters
    ``constant(name)`` gives as 1-D arrays; None otherwise (or for ``constant``'s None)."""
    if not is_inference_bn(bn):
        return None
    params = [constant(name) for name in bn.input[1:]]
    if any(p is None or np.ndim(p) != 1 for p in params):
        return None
    gamma, beta, mean, var = (np.asarray(p, np.float64) for p in params)
    s = gamma / np.sqrt(var + get_attr(bn, "epsilon", 1e-5))
    return s, beta - mean * s


def _foldable(index: GraphIndex, bn, keep: set):
    """(conv, bn, (weight, bias or None)) when ``bn`` folds into its producer, else None."""
    if bn is None or not bn.name or not is_inference_bn(bn):
        return None
    conv = index.producer.get(bn.input[0])
    if conv is None or conv.op_type != "Conv" or conv.domain not in _DEFAULT_DOMAINS \
            or not conv.name or _sole_reader(index, bn.input[0]) != bn.name \
            or bn.input[0] in keep or conv.output[0] in index.outputs:
        return None
    if index.source_initializer(conv.input[1]) is None:
        return None  # a computed weight (e.g. dequantized): folding would store it in float
    weight = index.get_constant(conv.input[1])
    bias = index.get_constant(conv.input[2]) if len(conv.input) > 2 and conv.input[2] else None
    params = [index.get_constant(name) for name in bn.input[1:]]
    if weight is None or weight.dtype.kind != "f" or weight.ndim < 3 \
            or (len(conv.input) > 2 and conv.input[2] and bias is None) \
            or any(p is None or p.shape != (weight.shape[0],) for p in params):
        return None
    return conv, bn, (weight, bias)


# -- redundant nodes --------------------------------------------------------------------------
def remove_redundant(editor: ModelEditor, keep: set) -> list[tuple[str, str]]:
    """Remove (or merge) redundant nodes until none is left; returns (node, reason)."""
    shapes = GraphIndex(editor.infer_shapes())  # shapes of the tensors that stay
    removed: list[tuple[str, str]] = []
    stuck: set[str] = set()  # nodes that must stay to keep a tensor's name
    while True:
        index = editor.index
        step = next((s for node in index.nodes if node.name not in stuck
                     and (s := _redundancy(index, shapes, node, keep)) is not None), None)
        if step is None:
            return removed
        if _apply(editor, index, step, keep):
            removed.append((step[0].name, step[1]))
        else:
            stuck.add(step[0].name)


def _redundancy(index: GraphIndex, shapes: GraphIndex, node, keep: set):
    """(node, reason, kind) when ``node`` can go: kind "bypass" (its output = its first
    input), "merge" (it joins the next node), or None when it must stay."""
    if not node.name or node.domain not in _DEFAULT_DOMAINS or not node.output \
            or node.output[0] in keep:
        return None
    op = node.op_type
    if op == "Identity" or (op == "Dropout" and _inference_dropout(index, node)):
        return node, op.lower(), "bypass"
    if op == "Cast" and shapes.elem_type(node.input[0]) == get_attr(node, "to"):
        return node, "cast to its own type", "bypass"
    if op == "Transpose" and _identity_perm(shapes, node):
        return node, "identity permutation", "bypass"
    if op in ("Reshape", "Flatten") and (_same_shape(shapes, node.input[0], node.output[0])
                                         or _noop_reshape(index, shapes, node)):
        return node, "output shape = input shape", "bypass"
    nxt = index.sole_consumer(node.output[0])
    if nxt is not None and nxt.name and nxt.op_type == op and op in ("Transpose", "Reshape") \
            and nxt.domain in _DEFAULT_DOMAINS and _mergeable(index, node, nxt):
        return node, f"{op} followed by {op} {nxt.name!r}", "merge"
    return None


def _inference_dropout(index: GraphIndex, node) -> bool:
    if any(node.output[1:]):
        return False  # its mask is read
    if len(node.input) < 3 or not node.input[2]:
        return True
    mode = index.get_constant(node.input[2])
    return mode is not None and not bool(np.asarray(mode).any())


def _identity_perm(shapes: GraphIndex, node) -> bool:
    perm = get_attr(node, "perm")
    if perm is None:  # default: reverse the axes, identity only for rank ≤ 1
        return shapes.rank(node.input[0]) in (0, 1)
    return list(perm) == list(range(len(perm)))


def _same_shape(shapes: GraphIndex, a: str, b: str) -> bool:
    sa, sb = shapes.shape(a), shapes.shape(b)
    return sa is not None and sa == sb and all(d is not None for d in sa) \
        and all(isinstance(d, int) or d for d in sa)


def _noop_reshape(index: GraphIndex, shapes: GraphIndex, node) -> bool:
    """A Reshape whose constant target repeats its input's dims after the first, the first
    being that dim, -1 or 0 (it then resolves to the input's own first dim)."""
    src = shapes.shape(node.input[0])
    target = index.get_constant(node.input[1]) if node.op_type == "Reshape" else None
    if src is None or target is None or np.ndim(target) != 1 or len(target) != len(src) \
            or not src or not all(isinstance(d, int) for d in src[1:]):
        return False
    rest = [int(t) for t in target[1:]]
    first_ok = int(target[0]) == -1 or (int(target[0]) == 0 and not get_attr(
        node, "allowzero", 0)) or (isinstance(src[0], int) and int(target[0]) == src[0])
    return first_ok and rest == list(src[1:])


def _mergeable(index: GraphIndex, first, second) -> bool:
    if first.op_type == "Transpose":
        return get_attr(first, "perm") is not None and get_attr(second, "perm") is not None
    target = index.get_constant(second.input[1])
    return target is not None and not get_attr(second, "allowzero", 0) \
        and not (np.asarray(target) == 0).any()  # a 0 would copy a dim of the skipped input


def _sole_reader(index: GraphIndex, tensor: str) -> str | None:
    """The name of the one node reading ``tensor`` (None: several, none, or an output)."""
    node = index.sole_consumer(tensor)
    return None if node is None else node.name


def _apply(editor: ModelEditor, index: GraphIndex, step, keep: set) -> bool:
    """Carry out ``step``; False when it cannot be done without renaming a kept tensor."""
    node, _, kind = step
    if kind == "bypass":
        return _bypass(editor, index, node, keep)
    second = index.sole_consumer(node.output[0])
    if node.op_type == "Transpose":
        p1, p2 = list(get_attr(node, "perm")), list(get_attr(second, "perm"))
        composed = [p1[i] for i in p2]
        editor.set_attribute(second.name, "perm", composed)
    editor.rewire(second.name, 0, node.input[0])
    editor.remove_node(node.name)
    return True


def _bypass(editor: ModelEditor, index: GraphIndex, node, keep: set) -> bool:
    """Readers of ``node``'s output read its first input instead; a graph output keeps its
    name by being renamed at the producer (when that producer's output has no other use)."""
    src, dst = node.input[0], node.output[0]
    if editor.uses(dst) != len(index.consumers_of(dst)) + (dst in index.outputs):
        return False  # read inside a subgraph
    if dst not in index.outputs:
        editor.replace_uses(dst, src)
        editor.remove_node(node.name)
        return True
    producer = index.producer.get(src)
    if producer is None or not producer.name or editor.uses(src) != 1 \
            or src in index.outputs or src in keep:
        return False
    editor.remove_node(node.name)
    editor.set_output(producer.name, list(producer.output).index(src), dst)
    return True


def check_equivalent(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict, *,
                     rtol: float = 1e-4) -> dict:
    """Every output of ``after`` against ``before`` on ``feeds`` (ONNX Runtime CPU):
    {"max_abs_output_diff", "max_rel_output_diff"} (relative to the largest |output| of
    ``before``). Raises EditError beyond ``rtol``: an optimisation that changes outputs by
    more than float rounding is a bug."""
    from ..runtime.runner import OrtRunner
    from .finalize import EditError, output_diff

    a, b = OrtRunner(before, providers="cpu").run(feeds), OrtRunner(after, providers="cpu").run(
        feeds)
    diff = max((output_diff(a[k], b[k]) for k in a), default=0.0)
    scale = max((_magnitude(v) for v in a.values()), default=0.0)
    rel = diff / max(scale, 1e-30)
    if not rel <= rtol:
        raise EditError(f"the optimised model's outputs differ from the unoptimised one's by "
                        f"{diff:.3g} ({rel:.3g} relative); emit it without the optimisation "
                        "(--no-fold-bn) and please report the model")
    return {"max_abs_output_diff": diff, "max_rel_output_diff": rel}


def _magnitude(value) -> float:
    """Largest |entry| of an output: a tensor, or a sequence of maps (ZipMap)."""
    if isinstance(value, list):
        return max((_magnitude(v) for v in value), default=0.0)
    if isinstance(value, dict):
        return max((abs(float(v)) for v in value.values()), default=0.0)
    return float(np.max(np.abs(np.asarray(value, np.float64)), initial=0.0))
