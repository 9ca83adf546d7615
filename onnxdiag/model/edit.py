"""The one copy-on-write graph editor: every edited model of onnxdiag is made with it.

:class:`ModelEditor` opens a private copy of a model (the model it is given is never
touched, ARCHITECTURE invariant 1), reads constants by tensor name, writes initializers
copy-on-write, rewires inputs and outputs, inserts and removes nodes, and counts the uses
of every tensor.  :meth:`ModelEditor.finish` drops the constants the edit left unread and
returns the edited copy through :func:`~onnxdiag.model.finalize.finalize_model` (stale
shapes cleared, shapes re-inferred, full checker): there is no other way to get the
edited model out, so no edit skips the check.  An edit that leaves an invalid model is a
bug and raises :class:`~onnxdiag.model.finalize.EditError`.

Copy-on-write: :meth:`~ModelEditor.set_input` overwrites an initializer in place only
when the edited node input is its one reader; a shared initializer, an Identity or
Constant source, a computed constant or a missing optional input gets a new, uniquely
named initializer and only that node input is rewired to it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..graph.index import GraphIndex
from .finalize import EditError, finalize_model


class ModelEditor:
    """Edits of one model, on a private copy.

    Args:
        model: the model to edit; never modified (the editor works on a copy).

    Nodes are addressed by name (models from :func:`onnxdiag.model.io.load_model` have
    unique node names); tensors and initializers by tensor name.
    """

    def __init__(self, model: onnx.ModelProto):
        self._model: onnx.ModelProto | None = onnx.ModelProto()
        self._model.CopyFrom(model)
        self._uses = count_uses(self._model.graph)
        self._used_before = {name for name, n in self._uses.items() if n > 0}
        self._taken = _all_names(self._model.graph)
        self._index: GraphIndex | None = None

    # -- reading -------------------------------------------------------------------------
    @property
    def model(self) -> onnx.ModelProto:
        """The working copy, to read or run mid-edit (e.g. segment by segment); change it
        only through this editor, and take the result from :meth:`finish`."""
        return self._open()

    @property
    def index(self) -> GraphIndex:
        """A :class:`GraphIndex` of the working copy as it is now (rebuilt after edits)."""
        if self._index is None:
            self._index = GraphIndex(self._open())
        return self._index

    def value(self, tensor_name: str) -> np.ndarray | None:
        """A writable copy of ``tensor_name``'s value when it is a constant (initializer,
        Constant node, or folded from them, see :meth:`GraphIndex.get_constant`), else None."""
        value = self.index.get_constant(tensor_name)
        return None if value is None else np.array(value)

    def uses(self, tensor_name: str) -> int:
        """How many node inputs (subgraphs included) and graph outputs read the tensor."""
        return self._uses[tensor_name]

    def unique(self, stem: str) -> str:
        """A tensor / node name not used anywhere in the model nor handed out before."""
        name, k = stem, 1
        while name in self._taken:
            name, k = f"{stem}_{k}", k + 1
        self._taken.add(name)
        return name

    def infer_shapes(self) -> onnx.ModelProto:
        """A shape-inferred copy of the working state (stale value_info dropped, lenient
        inference with data propagation), for reading shapes in the middle of an edit."""
        copy = onnx.ModelProto()
        copy.CopyFrom(self._open())
        del copy.graph.value_info[:]
        return onnx.shape_inference.infer_shapes(copy, check_type=False, strict_mode=False,
                                                 data_prop=True)

    # -- initializers --------------------------------------------------------------------
    def add_initializer(self, stem: str, value: np.ndarray) -> str:
        """A new initializer holding ``value`` under a unique name made from ``stem``
        (also listed as a graph input when the IR version is below 4); returns its name."""
        graph, name = self._open().graph, self.unique(stem)
        tensor = numpy_helper.from_array(np.ascontiguousarray(value), name)
        graph.initializer.append(tensor)
        if self._model.ir_version < 4:
            graph.input.append(helper.make_tensor_value_info(name, tensor.data_type,
                                                             tensor.dims))
        self._changed()
        return name

    def replace_initializer(self, name: str, value: np.ndarray) -> None:
        """Overwrite initializer ``name`` in place (every reader sees ``value``); a graph
        input of that name (IR < 4) gets the new shape."""
        graph = self._open().graph
        init = next((t for t in graph.initializer if t.name == name), None)
        if init is None:
            raise EditError(f"no initializer {name!r} to replace")
        init.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(value), name))
        for info in graph.input:
            if info.name == name and info.type.tensor_type.HasField("shape"):
                dims = info.type.tensor_type.shape.dim
                del dims[:]
                for d in init.dims:
                    dims.add().dim_value = int(d)
        # the same TensorProto changed value: the index's structure holds, its cached
        # constants do not (rebuilding it after every write was most of a 20-layer LS fit)
        if self._index is not None:
            self._index.forget_constants()

    def set_input(self, node_name: str, slot: int, value: np.ndarray, *,
                  stem: str | None = None) -> str:
        """Make input ``slot`` of node ``node_name`` hold ``value``, copy-on-write (see the
        module docstring); a missing optional input slot is added.  ``stem`` names a new
        initializer (default ``<old name>_<node>``).  Returns the initializer's name."""
        node = self.node(node_name)
        while len(node.input) <= slot:
            node.input.append("")
        name = node.input[slot]
        if name and self._uses[name] == 1 and name in self.index.initializers:
            self.replace_initializer(name, value)
            return name
        new = self.add_initializer(stem or f"{name or f'{node_name}_input{slot}'}_{node_name}",
                                   value)
        self.rewire(node_name, slot, new)
        return new

    # -- wiring and nodes ----------------------------------------------------------------
    def node(self, node_name: str) -> onnx.NodeProto:
        """The working copy's node ``node_name`` (OnnxDiagError listing names when absent)."""
        return self.index.get_node(node_name)

    def rewire(self, node_name: str, slot: int, tensor_name: str) -> None:
        """Input ``slot`` of node ``node_name`` reads ``tensor_name`` instead."""
        node = self.node(node_name)
        if slot >= len(node.input):
            raise EditError(f"node {node_name!r} has no input {slot}")
        self._read(node.input[slot], -1)
        node.input[slot] = tensor_name
        self._read(tensor_name, 1)
        self._changed()

    def replace_uses(self, old: str, new: str) -> int:
        """Every main-graph node input reading ``old`` reads ``new``; returns how many."""
        n = 0
        for node in self._open().graph.node:
            for slot, name in enumerate(node.input):
                if name == old:
                    node.input[slot] = new
                    n += 1
        self._uses[old] -= n
        self._uses[new] += n
        self._changed()
        return n

    def set_output(self, node_name: str, slot: int, tensor_name: str) -> None:
        """Output ``slot`` of node ``node_name`` is called ``tensor_name`` (its readers keep
        reading the old name: give it another producer)."""
        self.node(node_name).output[slot] = tensor_name
        self._taken.add(tensor_name)
        self._changed()

    def set_attribute(self, node_name: str, name: str, value) -> None:
        """Set (or add) attribute ``name`` of node ``node_name`` to ``value``."""
        node = self.node(node_name)
        kept = [a for a in node.attribute if a.name != name]
        del node.attribute[:]
        node.attribute.extend([*kept, helper.make_attribute(name, value)])
        self._changed()

    def insert_after(self, node_name: str, nodes: Sequence[onnx.NodeProto]) -> None:
        """Insert ``nodes`` (named, e.g. with :meth:`unique`) right after ``node_name``, in
        order: the graph stays topologically sorted when they read its outputs."""
        graph = self._open().graph
        self.node(node_name)  # OnnxDiagError listing the names when absent
        at = next(i for i, n in enumerate(graph.node) if n.name == node_name) + 1
        names = {n.name for n in graph.node}
        for k, node in enumerate(nodes):
            if not node.name or node.name in names:
                raise EditError(f"an inserted node needs a new name, not {node.name!r}")
            names.add(node.name)
            graph.node.insert(at + k, node)
            self._taken.update([node.name, *node.output])
            for tensor in _node_reads(node):
                self._read(tensor, 1)
        self._changed()

    def remove_node(self, node_name: str) -> None:
        """Remove node ``node_name``; whoever read its outputs must be rewired first."""
        self._remove(self.node(node_name))

    # -- the result ----------------------------------------------------------------------
    def finish(self, *, check: Callable[[onnx.ModelProto], None] | None = None
               ) -> onnx.ModelProto:
        """The edited model, through :func:`finalize_model`; the editor is closed.

        Constant producers (Constant / Identity / folded nodes) and initializers that were
        read before the edit and are not any more are removed first; what was already
        unread stays.  ``check``: a postcondition run on the finalized model, raising
        :class:`EditError` when the edit did not do what it promised.

        Raises:
            EditError: the edited model fails shape inference or the full checker, or
                ``check`` fails (a bug, not a user error).
        """
        self._drop_unread()
        out = finalize_model(self._open())
        self._model = self._index = None
        if check is not None:
            check(out)
        return out

    # -- internals -----------------------------------------------------------------------
    def _open(self) -> onnx.ModelProto:
        if self._model is None:
            raise EditError("this ModelEditor is finished; open a new one to edit again")
        return self._model

    def _changed(self) -> None:
        self._index = None

    def _read(self, tensor_name: str, n: int) -> None:
        if tensor_name:
            self._uses[tensor_name] += n

    def _remove(self, node: onnx.NodeProto) -> None:
        self._open().graph.node.remove(node)
        for tensor in _node_reads(node):
            self._read(tensor, -1)
        self._changed()

    def _unread(self, tensor_name: str) -> bool:
        return self._uses[tensor_name] <= 0 and tensor_name in self._used_before

    def _drop_unread(self) -> None:
        graph = self._open().graph
        while True:
            index = self.index
            dead = [n for n in graph.node if n.output and all(
                self._unread(t) and index.get_constant(t) is not None for t in n.output)]
            if not dead:
                break
            for node in dead:
                self._remove(node)
        gone = {t.name for t in graph.initializer if self._unread(t.name)}
        if gone:
            _keep(graph.initializer, lambda t: t.name not in gone)
            _keep(graph.input, lambda v: v.name not in gone)
            self._changed()


def count_uses(graph: onnx.GraphProto) -> Counter:
    """How many node inputs (subgraphs included) and graph outputs read each tensor name."""
    uses = Counter(o.name for o in graph.output)
    for node in graph.node:
        uses.update(_node_reads(node))
    return uses


def _node_reads(node: onnx.NodeProto) -> list[str]:
    """``node``'s inputs and every input of its subgraphs' nodes (which over-approximates
    the outer-scope names they read)."""
    reads = [t for t in node.input if t]
    for sub in _subgraphs(node):
        for inner in sub.node:
            reads += _node_reads(inner)
    return reads


def _subgraphs(node: onnx.NodeProto) -> Iterable[onnx.GraphProto]:
    for attr in node.attribute:
        yield from ([attr.g] if attr.HasField("g") else [])
        yield from attr.graphs


def _all_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor and node name of ``graph`` and its subgraphs."""
    names = {v.name for v in (*graph.input, *graph.output, *graph.value_info)}
    names |= {t.name for t in graph.initializer}
    names |= {t.values.name for t in graph.sparse_initializer}
    for node in graph.node:
        names.update([node.name, *node.input, *node.output])
        for sub in _subgraphs(node):
            names |= _all_names(sub)
    return names


def _keep(items, wanted: Callable) -> None:
    kept = [item for item in items if wanted(item)]
    del items[:]
    items.extend(kept)
