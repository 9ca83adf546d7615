"""Linear maps U = Z Wᵀ + b in an ONNX graph: Gemm, MatMul (+ Add), 1×1 Conv (± pooling).

Weights are constants as :meth:`GraphIndex.get_constant` resolves them (initializers,
Constant nodes, Identity/Transpose/Reshape/Cast of those, DequantizeLinear of constant
integers).  A MatMul whose input has token axes, (n_samples, n_tokens, n_features), is a
per-token map (``reduce="token"``): a decoder-style classifier then picks one token.
Used by head discovery (docs/METHODS.md §A1).  Never modifies the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from .index import GraphIndex, get_attr

GLOBAL_POOLS = frozenset({"GlobalAveragePool", "ReduceMean"})


@dataclass(frozen=True)
class Linear:
    """A linear node's map: U = flatten(features or its spatial mean) Wᵀ + b == logits.

    ``reduce``: "flatten", "spatial_mean" (a 1×1 conv before global pooling) or "token"
    (applied to every token; ``logits`` is then the per-token output (N, T, C)).
    """

    node: onnx.NodeProto
    weight: np.ndarray
    bias: np.ndarray
    features: str
    logits: str
    reduce: str = "flatten"
    bias_node: str | None = None


def linear_weight(index: GraphIndex, node: onnx.NodeProto) -> tuple | str:
    """``(W, b)`` as float64 (n_out, n_in), (n_out,) for a head-shaped node, else a reason.

    Accepts Gemm (transA = 0, either transB, alpha/beta), MatMul with a constant 2-D
    right operand (no bias here) and Conv with a constant 1×1 kernel and group 1.
    """
    op = node.op_type
    w = index.get_constant(node.input[1]) if len(node.input) > 1 else None
    if op not in ("Gemm", "MatMul", "Conv") or node.domain not in ("", "ai.onnx"):
        return f"{op} is not a linear map"
    if w is None:
        return f"{op} weight {node.input[1]!r} is not a constant"
    w = w.astype(np.float64)
    if op == "Gemm":
        if get_attr(node, "transA", 0) or w.ndim != 2:
            return "Gemm with transA=1"
        w = get_attr(node, "alpha", 1.0) * (w if get_attr(node, "transB", 0) else w.T)
        c = index.get_constant(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if len(node.input) > 2 and node.input[2] and c is None:
            return "Gemm bias C is not a constant"
        bias = _bias_vector(None if c is None else get_attr(node, "beta", 1.0) * c, w.shape[0])
        return (w, bias) if bias is not None else "Gemm bias C is not per-class"
    if op == "MatMul":
        return (w.T, np.zeros(w.shape[1])) if w.ndim == 2 else "MatMul weight is not 2-D"
    if w.ndim < 3 or any(k != 1 for k in w.shape[2:]) or get_attr(node, "group", 1) != 1:
        return "Conv is not a 1×1 conv with group 1"
    b = index.get_constant(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if len(node.input) > 2 and node.input[2] and b is None:
        return "Conv bias is not a constant"
    return w.reshape(w.shape[0], w.shape[1]), _bias_vector(b, w.shape[0])


def _bias_vector(c, n_classes: int) -> np.ndarray | None:
    if c is None:
        return np.zeros(n_classes)
    c = np.asarray(c, dtype=np.float64)
    if c.size == 1:
        return np.full(n_classes, float(c.ravel()[0]))
    if c.size == n_classes and max(c.shape) == n_classes:
        return c.ravel().copy()
    return None


def reduces_spatial_axes(index: GraphIndex, node: onnx.NodeProto) -> bool:
    """Whether ``node`` is a global average over all axes after the channel axis."""
    if node.op_type == "GlobalAveragePool":
        return True
    if node.op_type != "ReduceMean":
        return False
    axes = get_attr(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1]:
        value = index.get_constant(node.input[1])
        axes = None if value is None else value.tolist()
    rank = index.rank(node.input[0]) or 4
    return axes is not None and sorted(a % rank for a in axes) == list(range(2, rank))


def _is_pointwise_conv(node: onnx.NodeProto) -> bool:
    """1×1 conv whose output mean equals the conv of the input mean (no stride/pads)."""
    return (all(s == 1 for s in get_attr(node, "strides", [1]))
            and not any(get_attr(node, "pads", [0]))
            and get_attr(node, "auto_pad", b"NOTSET") in (b"NOTSET", b"VALID", "NOTSET", "VALID"))


def _flat_features(index: GraphIndex, tensor: str) -> bool:
    """Whether flattening ``tensor`` keeps one row per sample (rank 2, or spatial dims 1)."""
    shape = index.shape(tensor)
    if shape is not None and (len(shape) <= 2 or all(d == 1 for d in shape[2:])):
        return True
    prod = index.producer.get(tensor)
    return prod is not None and (prod.op_type in ("GlobalAveragePool", "GlobalMaxPool")
                                 or reduces_spatial_axes(index, prod))


def linear_at(index: GraphIndex, tensor: str) -> Linear | str:
    """The linear map whose result is ``tensor``, or a reason why there is none."""
    node = index.producer.get(tensor)
    if node is None:
        return f"{tensor!r} is a graph input"
    op = node.op_type
    if op == "Add":
        return _matmul_add(index, node) or f"Add node {node.name!r} is not a MatMul + bias"
    if op in GLOBAL_POOLS and reduces_spatial_axes(index, node):
        return _pooled_conv(index, node, tensor)
    wb = linear_weight(index, node)
    if isinstance(wb, str):
        return wb
    if op == "Conv" and not _flat_features(index, node.input[0]):
        return f"1×1 Conv {node.name!r} is not applied to pooled features"
    reduce = "flatten"
    if op == "MatMul" and not _flat_features(index, node.input[0]):
        rank = index.rank(node.input[0])
        if rank is not None and rank < 3:
            return f"MatMul {node.name!r} input is not (n_samples, n_features)"
        reduce = "flatten" if rank is None else "token"  # unknown rank: verified on data
    return Linear(node, *wb, features=node.input[0], logits=tensor, reduce=reduce)


def _pooled_conv(index: GraphIndex, pool: onnx.NodeProto, tensor: str) -> Linear | str:
    """A 1×1 conv (optionally + a bias Add) right before the global pooling ``pool``."""
    source = index.producer.get(pool.input[0])
    conv = source
    if source is not None and source.op_type == "Add":
        conv = next((index.producer.get(t) for t in source.input
                     if index.get_constant(t) is None), None)
    if conv is None or conv.op_type != "Conv" or not _is_pointwise_conv(conv):
        return _describe_pool_input(index, pool)
    wb = linear_weight(index, conv)
    if isinstance(wb, str):
        return wb
    weight, bias = wb
    if conv is not source:  # the bias Add between conv and pool
        const = next(index.get_constant(t) for t in source.input
                     if index.get_constant(t) is not None)
        extra = _bias_vector(const, len(bias))
        if extra is None:
            return f"Add node {source.name!r} before {pool.op_type} is not a per-class bias"
        bias = bias + extra
    return Linear(conv, weight, bias, features=conv.input[0], logits=tensor,
                  reduce="spatial_mean", bias_node=None if conv is source else source.name)


def _describe_pool_input(index: GraphIndex, pool: onnx.NodeProto) -> str:
    """Why the input of a global pooling is not a 1×1 conv: what is there instead."""
    source = index.producer.get(pool.input[0])
    what = f"{pool.op_type} node {pool.name!r}"
    if source is None:
        return f"{what} reads graph input {pool.input[0]!r}, not a 1×1 conv"
    chain, node = [], source
    while node is not None and node.op_type != "Conv" and len(chain) < 4:
        chain.append(f"{node.op_type} {node.name!r}")
        data = [t for t in node.input if t and index.get_constant(t) is None]
        node = index.producer.get(data[0]) if len(data) == 1 else None
    if node is not None and chain and not isinstance(linear_weight(index, node), str):
        return (f"{what} reads {' ← '.join(chain)} applied to the output of 1×1 Conv "
                f"{node.name!r}: the pooled logits are not a linear map of that conv's input")
    if source.op_type == "Conv":
        return f"{what} reads Conv {source.name!r}, which is not a 1×1 conv with group 1, " \
               "stride 1 and no padding"
    return f"{what} reads {source.op_type} {source.name!r}, not a 1×1 conv"


def linear_of(index: GraphIndex, node: onnx.NodeProto) -> Linear | str:
    """The linear map computed by ``node``, with its bias Add or global pooling when one
    follows; else a reason why ``node`` is not head-shaped."""
    wb = linear_weight(index, node)
    if isinstance(wb, str):
        return wb
    for user, _ in index.consumers_of(node.output[0]):
        if user.op_type == "Add" or user.op_type in GLOBAL_POOLS:
            found = linear_at(index, user.output[0])
            if isinstance(found, Linear) and found.node is node:
                return found
    return linear_at(index, node.output[0])


def _matmul_add(index: GraphIndex, add: onnx.NodeProto) -> Linear | None:
    """MatMul (or bias-less Gemm) followed by an Add of a constant, either operand order."""
    for i in (0, 1):
        other = add.input[1 - i]
        const = index.get_constant(other)
        if const is None or index.get_constant(add.input[i]) is not None:
            continue
        inner = linear_at(index, add.input[i])
        if isinstance(inner, str) or inner.node.op_type not in ("MatMul", "Gemm"):
            continue
        extra = _bias_vector(const, inner.weight.shape[0])
        if extra is None:
            continue
        return Linear(inner.node, inner.weight, inner.bias + extra, inner.features,
                      logits=add.output[0], reduce=inner.reduce, bias_node=add.name)
    return None
