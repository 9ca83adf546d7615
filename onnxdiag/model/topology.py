"""The topology hash: a fingerprint of a model's architecture without its weights
(docs/METHODS.md §A5).

Two checkpoints of one training run have the same topology hash; two architectures (or
one architecture at two widths) have different ones. What it covers:

- the opset imports, and the graph inputs and outputs (element type and shape, in order);
- every node in graph order: its op type, domain, attributes (a tensor attribute by its
  type and shape, integer tensors also by value; a subgraph attribute by its own hash)
  and which tensors it reads and writes;
- every initializer (and sparse initializer): element type and shape, and the values of
  small integer tensors (shapes, axes, indices: they are architecture, not weights).

Tensors enter by *position*, not by name: a graph input is ``i0, i1, …``, a node output
``n<node>:<k>``, an initializer is named by its first use ``c<node>.<slot>`` (exporters
list initializers in an order that varies between checkpoints of one run; unused ones
enter as a sorted list). Renaming nodes or tensors, or reordering the initializer list,
therefore leaves the hash unchanged; reordering the nodes changes it. Floating-point
values, node names, doc strings, metadata and inferred ``value_info`` are not hashed.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
from onnx import numpy_helper

#: Integer initializers and tensor attributes up to this many elements are hashed by
#: value (a Reshape's target shape, a Slice's axes); larger ones by type and shape only.
SMALL_INT = 64

_INT_TYPES = {onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.INT8,
              onnx.TensorProto.INT16, onnx.TensorProto.UINT8, onnx.TensorProto.BOOL}


def topology_hash(model: onnx.ModelProto) -> str:
    """SHA-256 (hex) of the model's topology (module docstring). Never modifies it."""
    h = hashlib.sha256(b"onnxdiag.topology/1")
    for op in sorted((o.domain, o.version) for o in model.opset_import):
        h.update(repr(op).encode())
    h.update(_graph_digest(model.graph, {}).encode())
    return h.hexdigest()


def _graph_digest(graph: onnx.GraphProto, outer: dict) -> str:
    """The hash of one graph; ``outer``: positional names of the enclosing graphs'
    tensors (a subgraph may read them)."""
    names = dict(outer)
    h = hashlib.sha256()
    for i, vi in enumerate(graph.input):
        names.setdefault(vi.name, f"i{i}")
        h.update(f"in {names[vi.name]} {_value_type(vi)}".encode())
    consts = {t.name: _tensor_key(t) for t in graph.initializer}
    consts.update({s.values.name: f"sparse{list(s.dims)}{_tensor_key(s.values)}"
                   for s in graph.sparse_initializer})
    for k, node in enumerate(graph.node):
        reads = []
        for j, x in enumerate(node.input):
            if x in consts and x not in names:  # a constant is named by its first use
                names[x] = f"c{k}.{j}"
                h.update(f"const {names[x]} {consts[x]}".encode())
            reads.append(names.get(x, "?") if x else "")
        for j, y in enumerate(node.output):
            if y:
                names[y] = f"n{k}:{j}"
        attrs = sorted((a.name, _attr_key(a, names)) for a in node.attribute)
        h.update(f"node {node.domain}:{node.op_type} {reads} -> {len(node.output)} "
                 f"{attrs}".encode())
    unused = sorted(v for n, v in consts.items() if n not in names)
    h.update(f"unused {unused}".encode())
    for vi in graph.output:
        h.update(f"out {names.get(vi.name, '?')} {_value_type(vi)}".encode())
    return h.hexdigest()


def _value_type(vi: onnx.ValueInfoProto) -> str:
    t = vi.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else "?" for d in t.shape.dim]
    return f"{t.elem_type}{dims}"


def _tensor_key(t: onnx.TensorProto) -> str:
    key = f"{t.data_type}{list(t.dims)}"
    if t.data_type in _INT_TYPES and int(np.prod(t.dims, dtype=np.int64)) <= SMALL_INT:
        key += f"={numpy_helper.to_array(t).ravel().tolist()}"
    return key


def _attr_key(a: onnx.AttributeProto, names: dict) -> str:
    """An attribute's value as hashed: tensors by _tensor_key, graphs by their digest."""
    if a.type == onnx.AttributeProto.TENSOR:
        return _tensor_key(a.t)
    if a.type == onnx.AttributeProto.TENSORS:
        return str([_tensor_key(t) for t in a.tensors])
    if a.type == onnx.AttributeProto.SPARSE_TENSOR:
        return f"{list(a.sparse_tensor.dims)}{_tensor_key(a.sparse_tensor.values)}"
    if a.type == onnx.AttributeProto.GRAPH:
        return _graph_digest(a.g, names)
    if a.type == onnx.AttributeProto.GRAPHS:
        return str([_graph_digest(g, names) for g in a.graphs])
    value = onnx.helper.get_attribute_value(a)
    return repr(value.decode() if isinstance(value, bytes) else value)
