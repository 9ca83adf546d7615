"""The training graph of recovery fine-tuning (docs/METHODS.md §B6, "Recovery"): which
initializers train, a copy of the model whose only output is the logits with BN in
inference mode, and the trained initializers spliced back into a copy of the input."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..graph import GraphIndex

TRAINED_OPS = {"Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (0, 1, 2), "MatMul": (0, 1),
               "BatchNormalization": (1, 2)}
#: The training graph's logits output and labels input (names of our own).
LOGITS, LABELS = "onnxdiag_finetune_logits", "onnxdiag_finetune_labels"


def trainable_names(model: onnx.ModelProto, logits: str) -> list[str]:
    """Float initializers of weighted ops (and their bias Adds) and BN scale/bias that
    feed ``logits``, in initializer order; BN running statistics are excluded."""
    index = GraphIndex(model)
    floats = {n for n, t in index.initializers.items() if t.data_type == onnx.TensorProto.FLOAT}
    cone, stack, names = set(), [logits], set()
    while stack:
        node = index.producer.get(stack.pop())
        if node is None or id(node) in cone:
            continue
        cone.add(id(node))
        stack.extend(t for t in node.input if t)
        positions = TRAINED_OPS.get(node.op_type, ())
        if node.op_type == "Add" and any(
                (p := index.producer.get(t)) is not None and p.op_type in TRAINED_OPS
                for t in node.input):
            positions = (0, 1)  # the bias Add of a MatMul / bias-less Conv
        for i in positions:
            if i < len(node.input) and node.input[i]:
                source = index.source_initializer(node.input[i])
                if source in floats:
                    names.add(source)
    return [t.name for t in model.graph.initializer if t.name in names]


def training_base(model: onnx.ModelProto, head) -> onnx.ModelProto:
    """A copy whose only output is the logits flattened to (batch, n_classes); the rest of
    the graph stays (unused by the loss) so ORT can export under the original outputs.

    BatchNormalization nodes become their inference-mode affine (x − mean)·(1/√(var+ε))
    ·scale + bias with the running statistics as constants: ORT's training graph would
    otherwise run BN in training mode (batch statistics), train against statistics the
    exported model never uses, and the exported model's accuracy would collapse."""
    base = onnx.ModelProto()
    base.CopyFrom(model)
    bn_as_affine(base)
    saved_statistics(base)
    base.graph.node.append(helper.make_node("Flatten", [head.logits], [LOGITS],
                                            name=LOGITS, axis=1))
    del base.graph.output[:]
    base.graph.output.append(helper.make_tensor_value_info(
        LOGITS, onnx.TensorProto.FLOAT, ["batch", head.n_classes]))
    return base


#: Ops whose ORT gradient reads optional outputs an inference export leaves out (the
#: statistics LayerNormalization saves for its backward pass): op → number of outputs.
SAVED_OUTPUTS = {"LayerNormalization": 3}


def saved_statistics(model: onnx.ModelProto) -> None:
    """Give (in place) each LayerNormalization its optional Mean and InvStdDev outputs:
    onnxruntime-training 1.19's LayerNormalization gradient reads them and fails on a
    one-output node (``gradient_builder_base.h:123 … i < node_->OutputDefs().size()``),
    as every torch.onnx export of a transformer has. Y is unchanged."""
    for k, node in enumerate(model.graph.node):
        wanted = SAVED_OUTPUTS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if wanted and len(node.output) < wanted:
            stem = node.name or f"{node.op_type}_{k}"
            node.output.extend(f"{stem}/onnxdiag_saved_{i}"
                               for i in range(len(node.output), wanted))


def bn_as_affine(model: onnx.ModelProto) -> None:
    """Replace (in place) every inference-mode BatchNormalization whose parameters are
    initializers by Sub/Mul/Mul/Add; scale and bias keep their initializer names (reshaped
    for broadcasting) so they stay trainable and splice back into the BN."""
    index = GraphIndex(model)
    ranks = {v.name: len(v.type.tensor_type.shape.dim)
             for v in list(model.graph.value_info) + list(model.graph.input)
             if v.type.tensor_type.HasField("shape")}
    nodes = []
    for node in model.graph.node:
        sources = [index.source_initializer(t) if t else None for t in node.input[1:5]]
        training = any(a.name == "training_mode" and a.i for a in node.attribute)
        rank = ranks.get(node.input[0]) if node.input else None  # Constant: no inputs
        if (node.op_type != "BatchNormalization" or len(node.output) != 1 or training
                or None in sources or len(sources) != 4 or rank is None or rank < 2):
            nodes.append(node)
            continue
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        mean, var = (numpy_helper.to_array(index.initializers[n]) for n in sources[2:])
        shape = [-1] + [1] * (rank - 2)
        stem = f"{node.name or node.output[0]}/onnxdiag_bn"
        consts = {f"{stem}/mean": mean.reshape(shape).astype(np.float32),
                  f"{stem}/inv_std": (1.0 / np.sqrt(var.astype(np.float64) + eps))
                  .reshape(shape).astype(np.float32),
                  f"{stem}/shape": np.array(shape, dtype=np.int64)}
        model.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items())
        scale, bias = node.input[1], node.input[2]
        nodes += [
            helper.make_node("Reshape", [scale, f"{stem}/shape"], [f"{stem}/scale"],
                             name=f"{stem}/scale"),
            helper.make_node("Reshape", [bias, f"{stem}/shape"], [f"{stem}/bias"],
                             name=f"{stem}/bias"),
            helper.make_node("Sub", [node.input[0], f"{stem}/mean"], [f"{stem}/centred"],
                             name=f"{stem}/centred"),
            helper.make_node("Mul", [f"{stem}/centred", f"{stem}/inv_std"], [f"{stem}/norm"],
                             name=f"{stem}/norm"),
            helper.make_node("Mul", [f"{stem}/norm", f"{stem}/scale"], [f"{stem}/scaled"],
                             name=f"{stem}/scaled"),
            helper.make_node("Add", [f"{stem}/scaled", f"{stem}/bias"], list(node.output),
                             name=node.name),
        ]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {t for n in model.graph.node for t in n.input}
    keep = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)  # the replaced BNs' running statistics


def splice(model: onnx.ModelProto, export: onnx.ModelProto, names) -> onnx.ModelProto:
    """A copy of ``model`` with the trained initializers taken from ORT's export."""
    trained = {t.name: t for t in export.graph.initializer if t.name in set(names)}
    assert len(trained) == len(set(names)), f"ORT's export lacks {set(names) - set(trained)}"
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for init in out.graph.initializer:
        if init.name in trained:
            init.CopyFrom(trained[init.name])
    return out
