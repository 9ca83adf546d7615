"""Copy-on-write edits of constant node inputs (SPEC B6 physical channel removal).

An edit is asked for a *use site*: input ``input_index`` of node ``node_name``.  The
constant behind it (an initializer, possibly through Identity nodes, a Constant node,
or a value folded from constants) gets sliced or replaced for that site only.  When
every use of an initializer asks for the same edit, the initializer is edited in
place and keeps its name; otherwise each distinct edit gets its own copy (a new
initializer) and the sites asking for it are rewired, so a shared initializer never
changes under a node that did not ask.  Nodes and initializers left unused by the
rewiring are removed; ones that were already unused are left alone.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import OnnxDiagError
from ..graph import GraphIndex

Site = tuple[str, int]  # (node_name, input_index)


@dataclass
class SiteEdit:
    """What to do to the constant at one site: delete ``removals[axis]`` indices along each
    axis (original indices), or replace it by ``value``."""

    removals: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))
    value: np.ndarray | None = None

    def key(self) -> tuple:
        if self.value is not None:
            return ("value", self.value.shape, self.value.tobytes())
        return tuple(sorted((a, tuple(sorted(ix))) for a, ix in self.removals.items() if ix))

    def apply(self, base: np.ndarray) -> np.ndarray:
        if self.value is not None:
            return self.value.astype(base.dtype)
        out = base
        for axis, ix in sorted(self.removals.items()):
            if ix:
                out = np.delete(out, sorted(ix), axis=axis)
        return np.ascontiguousarray(out)


class ConstantEditor:
    """Collects :class:`SiteEdit` requests on ``model`` (edited in place by :meth:`apply`).

    ``model`` must be a private copy: the editor writes into it.
    """

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.index = GraphIndex(model)
        self.edits: dict[Site, SiteEdit] = {}
        self.copied: list[str] = []

    def remove(self, node_name: str, input_index: int, axis: int, indices) -> None:
        """Delete original ``indices`` along ``axis`` of the constant at the site."""
        indices = [int(i) for i in indices]
        if indices:
            edit = self.edits.setdefault((node_name, input_index), SiteEdit())
            edit.removals[axis].update(indices)

    def replace(self, node_name: str, input_index: int, value: np.ndarray) -> None:
        """Replace the constant at the site by ``value``."""
        self.edits[(node_name, input_index)] = SiteEdit(value=np.asarray(value))

    def apply(self) -> list[str]:
        """Write every requested edit into the model; returns "old -> new" for each copy."""
        dead_before = _unused(self.model)
        by_source: dict[str, list[Site]] = defaultdict(list)
        for site in self.edits:
            tensor = self._tensor(site)
            source = self.index.source_initializer(tensor)
            by_source[source if source in self.index.initializers else f"\0{tensor}"].append(site)
        for source, sites in by_source.items():
            if source.startswith("\0"):
                self._write_copies(source[1:], {s: self.edits[s] for s in sites})
            else:
                self._write_initializer(source)
        _drop_newly_unused(self.model, dead_before)
        self.edits.clear()
        return self.copied

    # -- internals ---------------------------------------------------------------------------
    def _tensor(self, site: Site) -> str:
        node = self.index.node_by_name.get(site[0])
        if node is None or site[1] >= len(node.input) or not node.input[site[1]]:
            raise KeyError(f"no input {site[1]} on node {site[0]!r}")
        return node.input[site[1]]

    def _base(self, tensor: str, site: Site) -> np.ndarray:
        value = self.index.get_constant(tensor)
        if value is None:
            raise OnnxDiagError(
                f"Input {site[1]} ({tensor!r}) of node {site[0]!r} is not a constant, so its "
                "channels cannot be sliced; leave that channel group out of the plan.")
        return value

    def _write_initializer(self, source: str) -> None:
        uses = _terminal_uses(self.index, source)
        edits = {u: self.edits.get(u, SiteEdit()) for u in uses}
        keys = list(dict.fromkeys(e.key() for e in edits.values()))
        if keys == [()]:
            return
        if len(keys) == 1:
            base = numpy_helper.to_array(self.index.initializers[source])
            new = next(iter(edits.values())).apply(base)
            self.index.initializers[source].CopyFrom(numpy_helper.from_array(new, source))
            _update_input_dims(self.model, source, new.shape)
            return
        self._write_copies(source, {s: e for s, e in edits.items() if e.key()})

    def _write_copies(self, tensor: str, edits: dict[Site, SiteEdit]) -> None:
        names: dict[tuple, str] = {}
        for site, edit in edits.items():
            key = edit.key()
            if key not in names:
                new = edit.apply(self._base(self._tensor(site), site))
                names[key] = _unique_name(self.index, self.model, f"{tensor}.pruned")
                self.model.graph.initializer.append(numpy_helper.from_array(new, names[key]))
                if self.model.ir_version < 4:
                    self.model.graph.input.append(onnx.helper.make_tensor_value_info(
                        names[key], self.model.graph.initializer[-1].data_type, new.shape))
                self.copied.append(f"{tensor} -> {names[key]}")
            self.index.node_by_name[site[0]].input[site[1]] = names[key]


def _terminal_uses(index: GraphIndex, source: str) -> list[Site]:
    """Non-Identity sites reading ``source`` (through Identity chains); a graph output or an
    unnamed reader counts as a use that must see the value unchanged."""
    uses, frontier = [], [source]
    while frontier:
        tensor = frontier.pop(0)
        if tensor in index.outputs:
            uses.append(("\0output", len(uses)))
        for node, i in index.consumers_of(tensor):
            if node.op_type == "Identity" and node.domain in ("", "ai.onnx"):
                frontier.append(node.output[0])
            else:
                uses.append((node.name, i) if node.name else ("\0unnamed", len(uses)))
    return uses


def _unique_name(index: GraphIndex, model: onnx.ModelProto, stem: str) -> str:
    taken = {t.name for t in model.graph.initializer} | set(index.producer) | {
        v.name for v in model.graph.input}
    name, k = stem, 1
    while name in taken:
        k += 1
        name = f"{stem}{k}"
    return name


def _update_input_dims(model: onnx.ModelProto, name: str, shape) -> None:
    """Initializers listed as graph inputs (IR < 4) must keep a matching shape."""
    for value in model.graph.input:
        if value.name == name and value.type.tensor_type.HasField("shape"):
            dims = value.type.tensor_type.shape.dim
            del dims[:]
            for d in shape:
                dims.add().dim_value = int(d)


def _unused(model: onnx.ModelProto) -> tuple[set[str], set[str]]:
    """(names of nodes whose outputs nobody reads, unread initializers)."""
    graph = model.graph
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    read |= {name for node in graph.node for attr in node.attribute
             for sub in _subgraphs(attr) for name in _outer_names(sub)}
    nodes = {n.name for n in graph.node if n.output and not any(o in read for o in n.output)}
    inits = {t.name for t in graph.initializer if t.name not in read}
    return nodes, inits


def _subgraphs(attr: onnx.AttributeProto) -> list[onnx.GraphProto]:
    return ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)


def _outer_names(graph: onnx.GraphProto) -> set[str]:
    """Every name a subgraph's nodes read (over-approximates its references to outer values)."""
    names = {name for node in graph.node for name in node.input}
    for node in graph.node:
        for attr in node.attribute:
            for sub in _subgraphs(attr):
                names |= _outer_names(sub)
    return names


def _drop_newly_unused(model: onnx.ModelProto, before: tuple[set[str], set[str]]) -> None:
    """Remove Identity/Constant nodes and initializers that the rewiring left unread."""
    while True:
        nodes, inits = _unused(model)
        drop = [n for n in model.graph.node if n.name and n.name in nodes - before[0]
                and n.op_type in ("Identity", "Constant")]
        if not drop:
            break
        for node in drop:
            model.graph.node.remove(node)
    keep = [t for t in model.graph.initializer if t.name not in inits - before[1]]
    if len(keep) != len(model.graph.initializer):
        gone = {t.name for t in model.graph.initializer} - {t.name for t in keep}
        del model.graph.initializer[:]
        model.graph.initializer.extend(keep)
        kept_inputs = [v for v in model.graph.input if v.name not in gone]
        del model.graph.input[:]
        model.graph.input.extend(kept_inputs)
