"""Expose intermediate tensors as graph outputs, on a copy (ONNX Runtime's calibrator pattern).

A tensor that is a graph output cannot be fused away by ONNX Runtime (e.g. a Conv
output feeding a BatchNormalization stays the pre-BN tensor), so measurement sees
the tensor as the graph defines it (ARCHITECTURE invariant 6; tested against
ORT_DISABLE_ALL).
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.logger import G_LOGGER

from ..errors import OnnxDiagError

# graphsurgeon's own warnings (e.g. an output type it cannot map to NumPy, which
# _restore_output_types repairs) are not the user's business: errors only.
G_LOGGER.severity = G_LOGGER.ERROR


def expose_tensors(model: onnx.ModelProto, tensor_names: Sequence[str]) -> onnx.ModelProto:
    """Return a copy of ``model`` whose outputs also include ``tensor_names``.

    The original outputs keep their names and order and come first; exposed tensors
    follow in the order given (duplicates and existing outputs are skipped). Never
    modifies ``model``.

    Raises:
        OnnxDiagError: a name is not a tensor of the graph (the message lists a few).
    """
    fast = _appended(model, tensor_names)
    if fast is not None:
        return fast
    # graphsurgeon's import writes into the proto it reads (e.g. names Constant-node
    # tensors), so it reads a copy: the caller's model and its hash stay as they were.
    source = onnx.ModelProto()
    source.CopyFrom(model)
    graph = gs.import_onnx(source)
    tensors = graph.tensors()
    missing = [n for n in tensor_names if n not in tensors]
    if missing:
        known = sorted(n for n, t in tensors.items() if isinstance(t, gs.Variable))
        raise OnnxDiagError(
            f"Tensor {missing[0]!r} is not in the model (first 5 of {len(known)} tensors: "
            f"{', '.join(known[:5])}); `onnxdiag inspect MODEL` lists layer outputs."
        )
    present = {t.name for t in graph.outputs}
    for name in dict.fromkeys(tensor_names):
        tensor = tensors[name]
        if name in present:
            continue
        if isinstance(tensor, gs.Constant):
            raise OnnxDiagError(
                f"Tensor {name!r} is a constant (initializer), not a computed tensor; name a "
                "node output instead."
            )
        graph.outputs.append(tensor)
        present.add(name)
    exported = gs.export_onnx(graph, do_type_check=False)
    # graphsurgeon rebuilds the ModelProto; keep the original's metadata and versions.
    exported.ir_version = model.ir_version
    del exported.opset_import[:]
    exported.opset_import.extend(model.opset_import)
    exported.producer_name = model.producer_name
    exported.producer_version = model.producer_version
    _restore_output_types(exported, model)
    _fill_missing_output_types(exported)
    return exported


def _appended(model: onnx.ModelProto, tensor_names: Sequence[str]) -> onnx.ModelProto | None:
    """The copy of :func:`expose_tensors` made by appending the outputs to the proto when
    every name is a main-graph node output or graph input (typed as shape inference typed
    it, else float32, as the graphsurgeon path does): a round trip through graphsurgeon
    costs seconds on a 100 MB model. None for any other name (that path decides)."""
    computed = {t for n in model.graph.node for t in n.output if t}
    computed |= {i.name for i in model.graph.input} - {t.name for t in model.graph.initializer}
    if not all(t in computed for t in tensor_names):
        return None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    types = {v.name: v for v in (*out.graph.input, *out.graph.value_info)}
    present = {o.name for o in out.graph.output}
    for name in dict.fromkeys(tensor_names):
        if name not in present:
            info = out.graph.output.add()
            if name in types:
                info.CopyFrom(types[name])
            info.name = name
    _fill_missing_output_types(out)
    return out


def _restore_output_types(exported: onnx.ModelProto, model: onnx.ModelProto) -> None:
    """The original outputs keep their declared types (graphsurgeon turns a type it cannot
    map to NumPy, such as a ZipMap's sequence of maps, into an undefined tensor)."""
    original = {o.name: o for o in model.graph.output}
    for out in exported.graph.output:
        if out.name in original:
            out.CopyFrom(original[out.name])


def expose_channels_last(model: onnx.ModelProto, tensors: dict[str, int], *,
                         tag: str = "channels_last") -> tuple[onnx.ModelProto, dict[str, str]]:
    """A copy of ``model`` exposing a channels-last Transpose of each tensor in ``tensors``.

    ``tensors`` maps a tensor name to its rank (NC…, channels on axis 1); the exposed
    output ``{name}__onnxdiag_{tag}`` holds it as (N, …, C). Returns (model, name map).
    On CPU, ONNX Runtime folds the Transpose into the reorder out of its blocked (NCHWc)
    conv layout, so the channels-last copy costs what exposing the tensor itself costs,
    and C-vectors at sampled positions are then contiguous rows. The tensor itself is not
    exposed; as the Transpose's input it still cannot be fused away (e.g. into a following
    BatchNormalization). Never modifies ``model``; returns it unchanged for an empty map.
    """
    from onnx import helper

    if not tensors:
        return model, {}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = {}
    types = {v.name: v.type.tensor_type.elem_type
             for v in (*out.graph.input, *out.graph.output, *out.graph.value_info)}
    for i, (name, rank) in enumerate(tensors.items()):
        names[name] = channels_last_name(name, tag)
        out.graph.node.append(helper.make_node(
            "Transpose", [name], [names[name]], name=f"onnxdiag_{tag}_{i}",
            perm=[0, *range(2, rank), 1]))
        out.graph.output.append(helper.make_tensor_value_info(
            names[name], types.get(name) or onnx.TensorProto.FLOAT, None))
    return out, names


def channels_last_name(name: str, tag: str = "channels_last") -> str:
    """The output name :func:`expose_channels_last` gives tensor ``name``'s copy."""
    return f"{name}__onnxdiag_{tag}"


def _fill_missing_output_types(model: onnx.ModelProto) -> None:
    """Tensor outputs exposed without an inferred element type get float32 (ORT needs one);
    outputs of another kind (a ZipMap's sequence of maps) keep their type."""
    for out in model.graph.output:
        kind = out.type.WhichOneof("value")
        if kind in (None, "tensor_type") and not out.type.tensor_type.elem_type:
            out.type.tensor_type.elem_type = onnx.TensorProto.FLOAT


#: Readers of a BatchNormalization output before which :func:`bn_as_depthwise_conv`
#: rewrites it: activations ONNX Runtime's CPU optimiser fuses into a Conv ahead of its
#: blocked (NCHWc) layout pass, but not into the Conv it makes of a BatchNormalization
#: during that pass (ReLU6 as Clip: MobileNet-class nets). A Relu stays in the layout
#: either way (ResNets: no change measured, benchmarks/RESULTS.md).
UNFUSED_AFTER_BN = ("Clip",)


def bn_as_depthwise_conv(model: onnx.ModelProto, tensors) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of ``model`` in which every inference BatchNormalization reading one of
    ``tensors`` (exposed conv outputs, NC… of rank ≥ 3) whose output's sole reader is an
    :data:`UNFUSED_AFTER_BN` activation is a 1×1 depthwise Conv computing the same affine
    map (weight s_c = γ_c/√(σ²_c + ε), bias β_c − μ_c·s_c, from float32 parameters in
    float64, stored in float32), with the BN's name and output; and the names rewritten.

    Why: exposing a conv output keeps ONNX Runtime from folding its BatchNormalization
    into the conv. On CPU it then makes that BN a depthwise Conv of its blocked layout
    only after its activation fusions, so a following Clip leaves the layout and every
    such tensor is reordered out and back in (on a 224×224 MobileNetV2: 29 Clips, 28
    extra reorders in and 29 out; the exposed session 2.0× plain instead of 1.6×). As a
    Conv from the start, Conv + Clip fuse and stay in the layout. The model's outputs
    change by float32 rounding only; the exposed tensors themselves are the convs'
    outputs, unchanged. Returns ``model`` itself (and []) when there is nothing to
    rewrite; never modifies ``model``."""
    from onnx import helper, numpy_helper

    from .optimize import bn_affine

    graph = model.graph
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    inits = {i.name: i for i in graph.initializer}

    def float32_initializer(name):
        init = inits.get(name)
        return None if init is None or init.data_type != onnx.TensorProto.FLOAT \
            else numpy_helper.to_array(init)

    plan = {}
    for i, node in enumerate(graph.node):
        if node.op_type != "BatchNormalization" or tensors.get(node.input[0], 0) < 3:
            continue
        after = readers.get(node.output[0], [])
        if len(after) != 1 or after[0].op_type not in UNFUSED_AFTER_BN:
            continue
        affine = bn_affine(node, float32_initializer)
        if affine is not None:
            plan[i] = affine
    if not plan:
        return model, []
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = list(out.graph.node)
    for i, (s, b) in plan.items():
        bn, rank = nodes[i], tensors[nodes[i].input[0]]
        w, bias = f"onnxdiag_bn_conv_{i}_weight", f"onnxdiag_bn_conv_{i}_bias"
        out.graph.initializer.extend([
            numpy_helper.from_array(s.astype("float32").reshape(len(s), *[1] * (rank - 1)), w),
            numpy_helper.from_array(b.astype("float32"), bias)])
        nodes[i] = helper.make_node("Conv", [bn.input[0], w, bias], [bn.output[0]],
                                    name=bn.name, group=len(s), kernel_shape=[1] * (rank - 2))
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out, [nodes[i].name for i in plan]
