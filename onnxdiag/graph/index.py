"""Producer/consumer maps, topological order, shapes and constant folding.

:class:`GraphIndex` is a read-only view of one ``onnx.ModelProto`` (typically the
output of :func:`onnxdiag.model_io.load_model`).  It never modifies the model.
Everything downstream in :mod:`onnxdiag.graph` refers to nodes and tensors by
their ONNX names.
"""

from __future__ import annotations

from collections import defaultdict, deque

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import OnnxDiagError

_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                onnx.TensorProto.BFLOAT16}


def get_attr(node: onnx.NodeProto, name: str, default=None):
    """The value of attribute ``name`` of ``node`` (ints/floats/lists/tensors), or ``default``."""
    for attr in node.attribute:
        if attr.name == name:
            return onnx.helper.get_attribute_value(attr)
    return default


def default_opset(model: onnx.ModelProto) -> int:
    """The version of the default ("" / ai.onnx) opset the model imports."""
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return 1


class GraphIndex:
    """Read-only index of a model's main graph (subgraphs are not descended into).

    Attributes:
        model: the indexed ModelProto (never modified).
        nodes: nodes in topological order (stable w.r.t. the file order).
        producer: tensor name -> node producing it.
        consumers: tensor name -> list of ``(node, input_index)``.
        initializers: initializer name -> TensorProto.
        inputs: names of graph inputs that are not initializers.
        outputs: names of graph outputs.
        opset: default-domain opset version.
    """

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        graph = model.graph
        self.initializers = {t.name: t for t in graph.initializer}
        self.inputs = [v.name for v in graph.input if v.name not in self.initializers]
        self.outputs = [v.name for v in graph.output]
        self.opset = default_opset(model)
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
        for node in graph.node:
            for name in node.output:
                if name:
                    self.producer[name] = node
            for i, name in enumerate(node.input):
                if name:
                    self.consumers[name].append((node, i))
        self.nodes = _topological(list(graph.node), self.producer)
        self.node_by_name = {n.name: n for n in self.nodes if n.name}
        self.position = {id(n): i for i, n in enumerate(self.nodes)}
        self._types = {v.name: v.type for v in (*graph.input, *graph.value_info, *graph.output)}
        self._const_cache: dict[str, np.ndarray | None] = {}

    # -- lookups ---------------------------------------------------------------------------
    def get_node(self, node_name: str) -> onnx.NodeProto:
        """The node called ``node_name``; raises OnnxDiagError listing a few names otherwise."""
        node = self.node_by_name.get(node_name)
        if node is None:
            names = [n.name for n in self.nodes]
            raise OnnxDiagError(
                f"Node {node_name!r} is not in the model (first 5 of {len(names)} nodes: "
                f"{', '.join(names[:5])}); `onnxdiag inspect MODEL` lists the layers."
            )
        return node

    def consumers_of(self, tensor_name: str) -> list[tuple[onnx.NodeProto, int]]:
        """``(node, input_index)`` pairs reading ``tensor_name`` (empty list if none)."""
        return list(self.consumers.get(tensor_name, ()))

    def sole_consumer(self, tensor_name: str) -> onnx.NodeProto | None:
        """The single node reading ``tensor_name``, or None when zero or several do."""
        users = self.consumers.get(tensor_name, ())
        return users[0][0] if len(users) == 1 and tensor_name not in self.outputs else None

    def is_tensor(self, tensor_name: str) -> bool:
        """Whether ``tensor_name`` is a graph input, initializer or node output."""
        return (tensor_name in self.producer or tensor_name in self.initializers
                or tensor_name in self.inputs)

    def source_initializer(self, tensor_name: str) -> str | None:
        """The initializer (or Constant node output) behind ``tensor_name`` through Identity
        nodes; None when the value is computed otherwise (or not constant)."""
        tensor = tensor_name
        while tensor not in self.initializers:
            node = self.producer.get(tensor)
            if node is None or node.op_type not in ("Identity", "Constant"):
                return None
            if node.op_type == "Constant":
                return tensor
            tensor = node.input[0]
        return tensor

    # -- shapes and types --------------------------------------------------------------------
    def shape(self, tensor_name: str) -> tuple | None:
        """Inferred shape: a tuple of int (static) / str (symbolic) / None, or None if unknown."""
        if tensor_name in self.initializers:
            return tuple(int(d) for d in self.initializers[tensor_name].dims)
        value = self.get_constant(tensor_name) if tensor_name not in self._types else None
        if value is not None:
            return tuple(value.shape)
        ttype = self._types.get(tensor_name)
        if ttype is None or ttype.WhichOneof("value") != "tensor_type":
            return None
        if not ttype.tensor_type.HasField("shape"):
            return None
        return tuple(_dim(d) for d in ttype.tensor_type.shape.dim)

    def rank(self, tensor_name: str) -> int | None:
        """Number of dimensions of ``tensor_name`` if known."""
        shape = self.shape(tensor_name)
        return None if shape is None else len(shape)

    def elem_type(self, tensor_name: str) -> int | None:
        """ONNX element type (``onnx.TensorProto.FLOAT`` …) or None (unknown / not a tensor)."""
        if tensor_name in self.initializers:
            return self.initializers[tensor_name].data_type
        ttype = self._types.get(tensor_name)
        if ttype is None or ttype.WhichOneof("value") != "tensor_type":
            return None
        return ttype.tensor_type.elem_type or None

    def is_float(self, tensor_name: str) -> bool | None:
        """Whether the tensor holds floating-point values (None when its type is unknown)."""
        et = self.elem_type(tensor_name)
        return None if et is None else et in _FLOAT_TYPES

    def type_kind(self, tensor_name: str) -> str | None:
        """``"tensor_type"``, ``"sequence_type"``, ``"map_type"``… for typed values, else None."""
        ttype = self._types.get(tensor_name)
        return None if ttype is None else ttype.WhichOneof("value")

    # -- constants ---------------------------------------------------------------------------
    def forget_constants(self) -> None:
        """Drop the values :meth:`get_constant` has cached: after an initializer's value
        was overwritten in place (the graph's structure, which the index holds, is the same)."""
        self._const_cache.clear()

    def get_constant(self, tensor_name: str) -> np.ndarray | None:
        """The value of ``tensor_name`` if it is computable without inputs, else None.

        Resolves initializers, Constant nodes, ConstantOfShape and Identity / Transpose /
        Reshape / Cast / Squeeze / Unsqueeze / Flatten / DequantizeLinear of constants,
        recursively.  Returns a read-only array; never modifies the model.
        """
        if tensor_name in self._const_cache:
            return self._const_cache[tensor_name]
        self._const_cache[tensor_name] = None  # guards against cycles
        value = self._compute_constant(tensor_name)
        if value is not None:
            value = np.array(value)
            value.setflags(write=False)
        self._const_cache[tensor_name] = value
        return value

    def _compute_constant(self, tensor_name: str) -> np.ndarray | None:
        if tensor_name in self.initializers:
            return numpy_helper.to_array(self.initializers[tensor_name])
        node = self.producer.get(tensor_name)
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type == "Constant":
            return _constant_node_value(node)
        folder = _FOLDERS.get(node.op_type)
        if folder is None:
            return None
        args = [self.get_constant(n) if n else None for n in node.input]
        if node.op_type != "ConstantOfShape" and (not args or args[0] is None):
            return None
        try:
            return folder(self, node, args)
        except (ValueError, IndexError, TypeError):
            return None


def _dim(d) -> int | str | None:
    if d.HasField("dim_value"):
        return int(d.dim_value)
    if d.HasField("dim_param") and d.dim_param:
        return d.dim_param
    return None


def _topological(nodes: list[onnx.NodeProto], producer: dict) -> list[onnx.NodeProto]:
    """Kahn's algorithm, keeping the file order among ready nodes."""
    index = {id(n): i for i, n in enumerate(nodes)}
    deps = {id(n): {id(producer[t]) for t in n.input if t in producer} - {id(n)} for n in nodes}
    users: dict[int, list[int]] = defaultdict(list)
    for n in nodes:
        for d in deps[id(n)]:
            users[d].append(id(n))
    remaining = {k: len(v) for k, v in deps.items()}
    ready = deque(sorted((index[k] for k, v in remaining.items() if v == 0)))
    order = []
    while ready:
        i = ready.popleft()
        order.append(nodes[i])
        for u in sorted(index[x] for x in users[id(nodes[i])]):
            remaining[id(nodes[u])] -= 1
            if remaining[id(nodes[u])] == 0:
                ready.append(u)
    if len(order) < len(nodes):  # cycle: keep the rest in file order rather than fail
        seen = {id(n) for n in order}
        order += [n for n in nodes if id(n) not in seen]
    return order


def _constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    for attr in node.attribute:
        if attr.name == "value":
            return numpy_helper.to_array(attr.t)
        if attr.name == "value_float":
            return np.array(attr.f, dtype=np.float32)
        if attr.name == "value_floats":
            return np.array(list(attr.floats), dtype=np.float32)
        if attr.name == "value_int":
            return np.array(attr.i, dtype=np.int64)
        if attr.name == "value_ints":
            return np.array(list(attr.ints), dtype=np.int64)
        if attr.name == "sparse_value":
            return numpy_helper.to_array(onnx.helper.make_tensor(
                "v", attr.sparse_tensor.values.data_type, list(attr.sparse_tensor.dims),
                _densify(attr.sparse_tensor)))
    return None


def _densify(sparse) -> list:
    values = numpy_helper.to_array(sparse.values)
    idx = numpy_helper.to_array(sparse.indices)
    dense = np.zeros(int(np.prod(sparse.dims)), dtype=values.dtype)
    flat = idx if idx.ndim == 1 else np.ravel_multi_index(idx.T, tuple(sparse.dims))
    dense[flat] = values
    return dense.tolist()


def _axes(index: GraphIndex, node: onnx.NodeProto, args) -> list[int] | None:
    """Axes of Squeeze/Unsqueeze: an attribute before opset 13, the 2nd input after.

    Raises ValueError when the axes input exists but is not constant.
    """
    axes = get_attr(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1]:
        if args[1] is None:
            raise ValueError("dynamic axes")
        axes = args[1].tolist()
    return None if axes is None else [int(a) for a in np.ravel(axes)]


def _fold_reshape(index, node, args):
    if len(args) < 2 or args[1] is None:
        return None
    shape = [int(s) for s in args[1]]
    if not get_attr(node, "allowzero", 0):
        shape = [args[0].shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return args[0].reshape(shape)


def _fold_squeeze(index, node, args):
    axes = _axes(index, node, args)
    return np.squeeze(args[0]) if axes is None else np.squeeze(args[0], axis=tuple(axes))


def _fold_unsqueeze(index, node, args):
    axes = _axes(index, node, args)
    if axes is None:
        return None
    out_rank = args[0].ndim + len(axes)
    return np.expand_dims(args[0], tuple(a % out_rank for a in axes))


def _fold_cast(index, node, args):
    return args[0].astype(onnx.helper.tensor_dtype_to_np_dtype(get_attr(node, "to")))


def _fold_constant_of_shape(index, node, args):
    if not args or args[0] is None:
        return None
    value = get_attr(node, "value")
    fill = numpy_helper.to_array(value).ravel() if value is not None else np.zeros(1, np.float32)
    return np.full([int(s) for s in args[0]], fill[0], dtype=fill.dtype)


def _fold_flatten(index, node, args):
    axis = get_attr(node, "axis", 1) % max(args[0].ndim, 1)
    x = args[0]
    return x.reshape(int(np.prod(x.shape[:axis])), -1)


def _fold_dequantize(index, node, args):
    """(x − zero_point) · scale, per tensor or per ``axis`` (block quantization: None)."""
    if len(args) < 2 or args[1] is None or get_attr(node, "block_size", 0):
        return None
    has_zero = len(args) > 2 and bool(node.input[2])
    if has_zero and args[2] is None:
        return None
    x, scale = args[0].astype(np.float64), args[1].astype(np.float64)
    zero = args[2].astype(np.float64) if has_zero else np.zeros_like(scale)
    if scale.size > 1:
        shape = [1] * x.ndim
        shape[get_attr(node, "axis", 1) % x.ndim] = scale.size
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    return ((x - zero) * scale).astype(args[1].dtype if args[1].dtype.kind == "f"
                                       else np.float32)


_FOLDERS = {
    "Identity": lambda index, node, args: args[0],
    "Transpose": lambda index, node, args: np.transpose(args[0], get_attr(node, "perm")),
    "Reshape": _fold_reshape,
    "Cast": _fold_cast,
    "Squeeze": _fold_squeeze,
    "Unsqueeze": _fold_unsqueeze,
    "ConstantOfShape": _fold_constant_of_shape,
    "Flatten": _fold_flatten,
    "DequantizeLinear": _fold_dequantize,
}
