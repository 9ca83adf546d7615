"""Site edits of constant node inputs (METHODS §B6 physical channel removal), written through
:class:`~onnxdiag.model.edit.ModelEditor`.

An edit is asked for a *use site*: input ``input_index`` of node ``node_name``.  The
constant behind it (an initializer, possibly through Identity nodes, a Constant node,
or a value folded from constants) gets sliced or replaced for that site only.  When
every use of an initializer asks for the same edit, the initializer is edited in
place and keeps its name; otherwise each distinct edit gets its own copy (a new
initializer) and the sites asking for it are rewired, so a shared initializer never
changes under a node that did not ask.  Constants left unused by the rewiring are
removed by ``ModelEditor.finish``; ones that were already unused are left alone.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx

from ..errors import OnnxDiagError
from ..graph import GraphIndex
from ..model.edit import ModelEditor
from ..model.finalize import EditError

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
    """Collects :class:`SiteEdit` requests and writes them into ``editor`` (:meth:`apply`).

    Requests refer to the model as it is when the ConstantEditor is made (``index``, a
    snapshot); :meth:`verify` checks a finished model against what was written.
    """

    def __init__(self, editor: ModelEditor):
        self.editor = editor
        snapshot = onnx.ModelProto()
        snapshot.CopyFrom(editor.model)
        self.index = GraphIndex(snapshot)
        self.edits: dict[Site, SiteEdit] = {}
        self.copied: list[str] = []
        self.expected: dict[Site, tuple[int, ...]] = {}

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
        """Write every requested edit into the editor; returns "old -> new" for each copy."""
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
        self.edits.clear()
        return self.copied

    def verify(self, model: onnx.ModelProto) -> None:
        """Postcondition on the finished ``model``: every edited site reads a constant of
        the shape written (removed channels are gone).  Raises EditError otherwise."""
        index = GraphIndex(model)
        for (node_name, slot), want in self.expected.items():
            node = index.node_by_name.get(node_name)
            value = None if node is None else index.get_constant(node.input[slot])
            got = None if value is None else tuple(value.shape)
            if got != want:
                raise EditError(f"input {slot} of node {node_name!r} has shape {got} after "
                                f"the edit, not the {want} written")

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
            new = next(iter(edits.values())).apply(self.index.get_constant(source))
            self.editor.replace_initializer(source, new)
            self.expected.update({u: new.shape for u in uses if u in self.edits})
            return
        self._write_copies(source, {s: e for s, e in edits.items() if e.key()})

    def _write_copies(self, tensor: str, edits: dict[Site, SiteEdit]) -> None:
        names: dict[tuple, tuple[str, tuple[int, ...]]] = {}
        for site, edit in edits.items():
            key = edit.key()
            if key not in names:
                new = edit.apply(self._base(self._tensor(site), site))
                names[key] = self.editor.add_initializer(f"{tensor}.pruned", new), new.shape
                self.copied.append(f"{tensor} -> {names[key][0]}")
            self.editor.rewire(site[0], site[1], names[key][0])
            self.expected[site] = names[key][1]


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
