"""Physical channel removal over dependency groups (METHODS §B6).

For each channel group (see :func:`onnxdiag.graph.find_channel_groups`) the removed
channels disappear from every tensor that indexes them: the members' weight output
rows and biases, the group's per-channel constants (BN statistics, per-channel
Mul/Add, PRelu slopes), every consumer's weight input columns (a Flatten consumer
loses whole blocks of ``block_size`` features; a Concat consumer reads each group at
its offset), and the ``group`` attribute of depthwise members.  A removed channel
thus contributes exactly nothing downstream: the result equals the original model
with those channels zeroed at their source (BN scale and shift included).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np
import onnx

from ..errors import OnnxDiagError
from ..graph import ChannelGroup, GraphIndex, Layer, Structure, analyze_structure
from ..graph._records import jsonable
from ..graph.index import get_attr
from ..model.edit import ModelEditor
from ..model.finalize import EditError
from ..model.io import PROTOBUF_LIMIT
from .counts import request_counts
from .edit import ConstantEditor

_OUT_AXIS = {"oihw": 0, "oi": 0, "io": 1}
_IN_AXIS = {"oihw": 1, "oi": 1, "io": 0}


@dataclass(frozen=True)
class GroupCut:
    """One group's channels: ``kept`` and ``removed`` (group channel indices, ascending)."""

    group_id: int
    members: tuple[str, ...]
    n_before: int
    kept: tuple[int, ...]
    removed: tuple[int, ...]

    @property
    def n_after(self) -> int:
        return len(self.kept)

    def to_dict(self) -> dict:
        """JSON-able dict of every field plus ``n_after``."""
        return {**{f.name: jsonable(getattr(self, f.name)) for f in fields(self)},
                "n_after": self.n_after}


@dataclass(frozen=True)
class PruneRecord:
    """What :func:`prune_channels` did.

    Fields:
        groups: one :class:`GroupCut` per group that lost channels.
        widths: layer name -> (n_out before, n_out after) for layers that changed.
        params_before / params_after: floating-point initializer elements (Structure.n_params).
        flops_before / flops_after: Structure.flops (None when some layer's is unknown).
        copied: shared constants that were copied before slicing ("old -> new").
        reshapes: Reshape (and Split) nodes whose constant sizes were rewritten: the
            counts the groups record, then the Reshapes that followed a narrowed input.
    """

    groups: tuple[GroupCut, ...]
    widths: dict[str, tuple[int, int]]
    params_before: int
    params_after: int
    flops_before: int | None
    flops_after: int | None
    copied: tuple[str, ...] = ()
    reshapes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """JSON-able dict of every field."""
        return {f.name: jsonable(getattr(self, f.name)) for f in fields(self)}


def prune_channels(model: onnx.ModelProto, structure: Structure,
                   plan) -> tuple[onnx.ModelProto, PruneRecord]:
    """Remove channels physically (METHODS §B6); returns ``(pruned model, record)``.

    Args:
        model: the model ``structure`` was computed from (:func:`analyze_structure`).
        structure: its structure; group ids index ``structure.groups``.
        plan: ``{group_id: channels to remove}`` (group channel indices), or a
            :class:`~onnxdiag.structured.plan.Plan` (its ``removed``).

    The result comes back through ``ModelEditor.finish``: stale shapes cleared, shapes
    re-inferred, ``onnx.checker.check_model(full_check=True)`` passed, and every sliced
    constant verified to have lost the removed channels.  Never modifies ``model``.

    Raises:
        OnnxDiagError: unknown group, a group that is not prunable (the head's classes,
            a graph output, an op not understood), a channel out of range or listed
            twice, all channels of a group removed, a structure not of this model, or a
            model of 2 GiB or more.
        EditError: the pruned model fails the checker or the postcondition (a bug: a
            graph pattern channel removal does not handle; please report the model).
    """
    removed = normalize_removed(structure, getattr(plan, "removed", plan))
    if model.ByteSize() >= PROTOBUF_LIMIT:
        raise OnnxDiagError("Structured pruning of models of 2 GiB or more is not supported "
                            "yet; prune a smaller export.")
    model_editor = ModelEditor(model)
    editor = ConstantEditor(model_editor)
    layers = {layer.node_name: layer for layer in structure.layers}
    _check_structure(editor.index, structure, removed, layers)
    depthwise: dict[str, int] = defaultdict(int)
    for gid, channels in removed.items():
        _request_group(editor, structure.groups[gid], layers, channels, depthwise)
    counted = request_counts(editor, structure.groups, removed)
    literal = {k: v for k, v in _literal_reshapes(editor.index).items() if k not in counted}
    copied = editor.apply()
    _shrink_group_attr(model_editor, depthwise)
    reshapes = counted + _fix_reshapes(model_editor, literal)
    try:
        pruned = model_editor.finish(check=editor.verify)
    except EditError as exc:
        raise EditError(f"{exc} (pruning groups {', '.join(map(str, removed))}; leaving them "
                        "out of the plan one at a time finds the pattern)") from exc
    return pruned, _record(structure, pruned, removed, copied, reshapes)


def normalize_removed(structure: Structure, removed: Mapping) -> dict[int, tuple[int, ...]]:
    """Validated ``{group_id: sorted channels}`` without empty entries (see prune_channels)."""
    out = {}
    for key, channels in removed.items():
        gid = _group_id(structure, key)
        group = structure.groups[gid]
        idx = [int(c) for c in np.asarray(channels, dtype=np.int64).ravel()]
        if not idx:
            continue
        if not group.prunable:
            raise OnnxDiagError(
                f"Channel group {gid} ({_describe(group)}) cannot be pruned: {group.reason}. "
                f"Prunable groups: {_prunable_list(structure)}.")
        bad = [c for c in idx if not 0 <= c < group.n_channels]
        if bad or len(set(idx)) != len(idx):
            what = f"channel {bad[0]} is out of range" if bad else "a channel is listed twice"
            raise OnnxDiagError(f"Plan for channel group {gid} ({_describe(group)}): {what}; "
                                f"channels are 0..{group.n_channels - 1}, each at most once.")
        if len(idx) >= group.n_channels:
            raise OnnxDiagError(f"Plan removes all {group.n_channels} channels of group {gid} "
                                f"({_describe(group)}); keep at least one.")
        out[gid] = tuple(sorted(idx))
    return dict(sorted(out.items()))


def kept_output_channels(structure: Structure, removed: Mapping) -> dict[str, list[int]]:
    """Member layer → the original index of each output channel it keeps, in order, for
    the layers ``removed`` (as for :func:`prune_channels`) narrows: channel j of the
    pruned layer is channel ``kept[j]`` of the original (e.g. to compare statistics)."""
    gone: dict[str, set[int]] = defaultdict(set)
    for gid, channels in normalize_removed(structure, removed).items():
        group = structure.groups[gid]
        for member, offset in zip(group.members, group.member_offsets):
            gone[member].update(_entries(channels, offset, group.block_size))
    return {name: [i for i in range(structure.get_layer(name).n_out) if i not in lost]
            for name, lost in gone.items()}


def _group_id(structure: Structure, key) -> int:
    try:
        gid = int(key)
    except (TypeError, ValueError):
        gid = -1
    if not 0 <= gid < len(structure.groups):
        raise OnnxDiagError(f"No channel group {key!r}: the model has groups 0.."
                            f"{len(structure.groups) - 1}; prunable: {_prunable_list(structure)}.")
    return gid


def _describe(group: ChannelGroup) -> str:
    return f"members {', '.join(group.members[:3])}" + ("…" if len(group.members) > 3 else "")


def _prunable_list(structure: Structure) -> str:
    ids = [str(g.group_id) for g in structure.groups if g.prunable]
    return ", ".join(ids[:10]) + (f" (first 10 of {len(ids)})" if len(ids) > 10 else "") \
        if ids else "none"


def _check_structure(index: GraphIndex, structure: Structure, removed, layers) -> None:
    """The layers touched must exist in ``index`` with the weight shapes of ``structure``."""
    for gid in removed:
        group = structure.groups[gid]
        for name in (*group.members, *(c.node_name for c in group.consumers)):
            node, layer = index.node_by_name.get(name), layers.get(name)
            weight = None if node is None or layer is None else index.get_constant(node.input[1])
            if weight is None or tuple(weight.shape) != layer.weight_shape:
                raise OnnxDiagError(
                    f"The structure does not match the model at layer {name!r}; run "
                    "analyze_structure on this model (node names and weights must agree).")


def _request_group(editor: ConstantEditor, group: ChannelGroup, layers: dict[str, Layer],
                   channels: Sequence[int], depthwise: dict[str, int]) -> None:
    """Ask ``editor`` for every slice that removes ``channels`` of ``group``."""
    for member, offset in zip(group.members, group.member_offsets):
        layer = layers[member]
        rows = _entries(channels, offset, group.block_size)
        editor.remove(member, 1, _OUT_AXIS[layer.weight_layout], rows)
        if layer.bias is not None and layer.bias_node is None:
            axis = _bias_axis(editor.index, layer)
            if axis is not None:
                editor.remove(member, 2, axis, rows)
        if layer.groups > 1:  # a depthwise member: one group per channel
            depthwise[member] += len(channels)
    for param in group.params:
        editor.remove(param.node_name, param.input_index, param.axis,
                      _entries(channels, param.channel_offset, group.block_size))
    for consumer in group.consumers:
        layer = layers[consumer.node_name]
        cols = _entries(channels, consumer.channel_offset, consumer.block_size)
        editor.remove(consumer.node_name, 1, _IN_AXIS[layer.weight_layout], cols)


def _entries(channels: Sequence[int], offset: int, block: int) -> list[int]:
    """The features of group ``channels`` at ``offset`` (in channels), ``block`` each
    (head_dim for attention heads, the spatial size behind a Flatten)."""
    return [(offset + c) * block + j for c in channels for j in range(block)]


def _bias_axis(index: GraphIndex, layer: Layer) -> int | None:
    """Axis of a bias input holding one value per output channel; None when it broadcasts."""
    value = index.get_constant(layer.bias)
    shape = value.shape if value is not None else index.shape(layer.bias)
    if not shape or shape[-1] != layer.n_out:
        return None
    return len(shape) - 1 if layer.op_type == "Gemm" else 0


def _shrink_group_attr(editor: ModelEditor, depthwise: dict[str, int]) -> None:
    for name, n in depthwise.items():
        editor.set_attribute(name, "group", get_attr(editor.node(name), "group", 1) - n)


def _literal_reshapes(index: GraphIndex) -> dict[str, tuple[tuple, np.ndarray]]:
    """Reshapes with a constant target holding a literal 2nd dimension (it may count
    channels): node name -> (input shape, target), in topological order."""
    out = {}
    for node in index.nodes:
        if node.op_type != "Reshape" or len(node.input) < 2 or not node.name:
            continue
        target, src = index.get_constant(node.input[1]), index.shape(node.input[0])
        if (target is not None and target.ndim == 1 and target.size >= 2 and target[1] > 0
                and src is not None and len(src) >= 2
                and all(isinstance(d, int) for d in src[1:])):
            out[node.name] = (tuple(src), np.array(target))
    return out


def _fix_reshapes(model_editor: ModelEditor, literal: dict) -> tuple:
    """Re-infer shapes; rewrite the first Reshape whose input lost channels, repeat."""
    fixed = []
    for _ in range(len(literal) + 1):
        index = GraphIndex(model_editor.infer_shapes())
        todo = next(((name, new) for name, (src, target) in literal.items()
                     if (new := _new_target(index, name, src, target)) is not None), None)
        if todo is None:
            return tuple(fixed)
        editor = ConstantEditor(model_editor)
        editor.replace(todo[0], 1, todo[1])
        editor.apply()
        fixed.append(todo[0])
        del literal[todo[0]]
    raise AssertionError("unreachable: each pass fixes one Reshape")


def _new_target(index: GraphIndex, name: str, src: tuple, target: np.ndarray):
    node = index.node_by_name.get(name)
    new = None if node is None else index.shape(node.input[0])
    if new is None or len(new) != len(src) or not all(isinstance(d, int) for d in new[1:]) \
            or tuple(new[1:]) == tuple(src[1:]):
        return None
    inner = int(np.prod(src[2:], dtype=np.int64))
    out = target.copy()
    if tuple(new[2:]) == tuple(src[2:]) and target[1] == src[1]:
        out[1] = new[1]
    elif tuple(new[2:]) == tuple(src[2:]) and target[1] == src[1] * inner:
        out[1] = new[1] * inner
    else:
        raise OnnxDiagError(f"Reshape {name!r} has a constant target {target.tolist()} that "
                            f"does not follow its input from {list(src)} to {list(new)}; "
                            "leave the channel group feeding it out of the plan.")
    return out


def _record(before: Structure, pruned: onnx.ModelProto, removed: dict, copied, reshapes):
    head = before.head.node_name if before.head is not None else None
    after = analyze_structure(pruned, head=head, require_head=head is not None)
    widths_after = {layer.node_name: layer.n_out for layer in after.layers}
    widths = {la.node_name: (la.n_out, widths_after.get(la.node_name, la.n_out))
              for la in before.layers if widths_after.get(la.node_name, la.n_out) != la.n_out}
    cuts = tuple(GroupCut(gid, before.groups[gid].members, before.groups[gid].n_channels,
                          tuple(sorted(set(range(before.groups[gid].n_channels)) - set(chs))),
                          chs)
                 for gid, chs in removed.items())
    return PruneRecord(groups=cuts, widths=widths, params_before=before.n_params,
                       params_after=after.n_params, flops_before=before.flops,
                       flops_after=after.flops, copied=tuple(copied), reshapes=reshapes)
