"""Real converter exports with random weights, built in a temporary folder.

Each builder writes ``<name>.onnx`` into ``folder`` and returns an :class:`Export`: the
path, one batch of feeds, the head node the converter wrote, and an independent reference
(features Z and logits U computed by the source framework, not by ONNX).  Builders skip
(``pytest.importorskip``) when their converter is missing: torch, transformers, skl2onnx,
onnxruntime.quantization.  Tiny on purpose (hidden 32, 2 layers, a few samples).

- ``torch_resnet``: torchvision-style ResNet basic blocks → AdaptiveAvgPool → Linear "fc".
- ``torch_vit``: timm-style ViT in plain torch (patch conv, cls token, 2 blocks, fused
  qkv) → "head"; ``torch_vit_opset14``: the same at opset 14, where torch writes
  LayerNorm out (ReduceMean, Sub, Pow, Sqrt, Div, Mul, Add).
- ``hf_bert``: ``BertForSequenceClassification`` from a config → "classifier".
- ``hf_gpt2``: ``GPT2ForSequenceClassification`` (head "score" on every token, then the
  last non-pad token picked; Conv1D as Gemm on N·T rows, fused c_attn cut by a Split,
  GELU in its tanh form).
- ``hf_llama``: ``LlamaForSequenceClassification`` (RMSNorm written out, SwiGLU MLP,
  rotary embeddings; decoder-style head).
- ``sklearn_mlp``: skl2onnx ``MLPClassifier`` on load_digits (ZipMap on).
- ``tf_softmax_constants``: tf/jax style written with onnx.helper: weights in Constant
  nodes, MatMul + Add, the softmax written out (ReduceMax … Div).
- ``qdq_int8``: ``onnxruntime.quantization.quantize_static`` (QDQ, int8) of ``torch_resnet``.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

BATCH = 4


@dataclass
class Export:
    """One exported model: where it is, a batch, and what its head must be.

    ``head_node``: the node the converter wrote for the classifier (``head_op`` its op);
    ``features`` / ``logits``: Z (BATCH, D) and U (BATCH, C) from the source framework;
    ``relation``: what the output is of U; ``atol``: tolerance of those references.
    """

    name: str
    path: Path
    feeds: dict
    head_node: str
    head_op: str
    relation: str
    features: np.ndarray | None = None
    logits: np.ndarray | None = None
    atol: float = 1e-4
    notes: dict = field(default_factory=dict)


# -- torch ----------------------------------------------------------------------------------
def _torch():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    return torch


def _export(torch, net, args, path: Path, input_names, dynamic, opset: int = 17) -> None:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, args, buf, dynamo=False, input_names=input_names,
                          output_names=["logits"], dynamic_axes=dynamic, opset_version=opset)
    path.write_bytes(buf.getvalue())


def _hooked(torch, net, module, args):
    """(features into ``module``, net output) of one forward pass."""
    seen = {}
    handle = module.register_forward_hook(lambda m, i, o: seen.update(z=i[0], u=o))
    with torch.no_grad():
        out = net(*args)
    handle.remove()
    return seen["z"].numpy().astype(np.float64), out.numpy().astype(np.float64)


def _resnet(torch):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, c_in, c_out, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(c_out)
            self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(c_out)
            self.down = None if stride == 1 and c_in == c_out else nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            return torch.relu(y + (x if self.down is None else self.down(x)))

    class ResNet(nn.Module):
        def __init__(self, classes=5):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8),
                                      nn.ReLU())
            self.layer1, self.layer2 = Block(8, 8, 1), Block(8, 16, 2)
            self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(16, classes)

        def forward(self, x):
            return self.fc(torch.flatten(self.pool(self.layer2(self.layer1(self.stem(x)))), 1))

    net = ResNet()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.5, 2.0)
    return net.eval()


def torch_resnet(folder: Path) -> Export:
    torch = _torch()
    net = _resnet(torch)
    x = torch.randn(BATCH, 3, 16, 16)
    path = folder / "torch_resnet.onnx"
    _export(torch, net, (x,), path, ["x"], {"x": {0: "N"}, "logits": {0: "N"}})
    z, u = _hooked(torch, net, net.fc, (x,))
    return Export("torch_resnet", path, {"x": x.numpy()}, "/fc/Gemm", "Gemm", "identity", z, u)


def _vit(torch, dim=32, depth=2, heads=2, classes=5, patch=4, size=16):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

        def forward(self, x):
            b, t, _ = x.shape
            qkv = self.qkv(self.norm1(x)).reshape(b, t, 3, heads, dim // heads)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            att = (q @ k.transpose(-2, -1)) * (dim // heads) ** -0.5
            y = (att.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, dim)
            x = x + self.proj(y)
            return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))

    class ViT(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch_embed = nn.Conv2d(3, dim, patch, patch)
            self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
            self.pos_embed = nn.Parameter(torch.randn(1, 1 + (size // patch) ** 2, dim) * 0.02)
            self.blocks = nn.Sequential(*[Block() for _ in range(depth)])
            self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

        def forward(self, x):
            x = self.patch_embed(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
            x = self.norm(self.blocks(x + self.pos_embed))
            return self.head(x[:, 0])

    return ViT().eval()


def torch_vit(folder: Path, opset: int = 17) -> Export:
    torch = _torch()
    net = _vit(torch)
    x = torch.randn(BATCH, 3, 16, 16)
    name = "torch_vit" if opset == 17 else f"torch_vit_opset{opset}"
    path = folder / f"{name}.onnx"
    _export(torch, net, (x,), path, ["x"], {"x": {0: "N"}, "logits": {0: "N"}}, opset)
    z, u = _hooked(torch, net, net.head, (x,))
    return Export(name, path, {"x": x.numpy()}, "/head/Gemm", "Gemm", "identity", z, u)


def torch_vit_opset14(folder: Path) -> Export:
    return torch_vit(folder, opset=14)


# -- transformers -----------------------------------------------------------------------------
def _logits_only(torch, model):
    class LogitsOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              use_cache=False).logits

    return LogitsOnly().eval()


def _token_batch(torch, vocab=64, tokens=8):
    ids = torch.randint(1, vocab, (BATCH, tokens))
    lengths = torch.tensor([tokens, tokens - 3, tokens - 1, 2])
    mask = (torch.arange(tokens)[None, :] < lengths[:, None]).long()
    return ids * mask, mask  # right padding with pad id 0


def _hf_export(torch, name, model, module, folder):
    net = _logits_only(torch, model)
    ids, mask = _token_batch(torch)
    path = folder / f"{name}.onnx"
    axes = {"input_ids": {0: "N", 1: "T"}, "attention_mask": {0: "N", 1: "T"},
            "logits": {0: "N"}}
    _export(torch, net, (ids, mask), path, ["input_ids", "attention_mask"], axes)
    z, u = _hooked(torch, net, module, (ids, mask))
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    return path, feeds, z, u, mask.numpy()


def hf_bert(folder: Path) -> Export:
    torch = _torch()
    tf = pytest.importorskip("transformers")
    config = tf.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=64,
                           max_position_embeddings=32, num_labels=3,
                           attn_implementation="eager")
    model = tf.BertForSequenceClassification(config).eval()
    path, feeds, z, u, _ = _hf_export(torch, "hf_bert", model, model.classifier, folder)
    return Export("hf_bert", path, feeds, "/model/classifier/Gemm", "Gemm", "identity", z, u)


def hf_gpt2(folder: Path) -> Export:
    torch = _torch()
    tf = pytest.importorskip("transformers")
    config = tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                           num_labels=3, pad_token_id=0, bos_token_id=1, eos_token_id=1,
                           use_cache=False, attn_implementation="eager")
    model = tf.GPT2ForSequenceClassification(config).eval()
    path, feeds, hidden, u, mask = _hf_export(torch, "hf_gpt2", model, model.score, folder)
    last = mask.sum(axis=1) - 1  # the last non-pad token (right padding)
    z = hidden[np.arange(BATCH), last]
    return Export("hf_gpt2", path, feeds, "/model/score/MatMul", "MatMul", "identity", z, u)


def hf_llama(folder: Path) -> Export:
    torch = _torch()
    tf = pytest.importorskip("transformers")
    config = tf.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=2, intermediate_size=48,
                            max_position_embeddings=32, num_labels=3, pad_token_id=0,
                            use_cache=False, attn_implementation="eager")
    model = tf.LlamaForSequenceClassification(config).eval()
    path, feeds, hidden, u, mask = _hf_export(torch, "hf_llama", model, model.score, folder)
    z = hidden[np.arange(BATCH), mask.sum(axis=1) - 1]  # the last non-pad token
    return Export("hf_llama", path, feeds, "/model/score/MatMul", "MatMul", "identity", z, u)


# -- skl2onnx, onnx.helper, quantization ------------------------------------------------------
def sklearn_mlp(folder: Path) -> Export:
    pytest.importorskip("skl2onnx")
    from skl2onnx import to_onnx
    from sklearn.datasets import load_digits
    from sklearn.neural_network import MLPClassifier

    x, y = load_digits(return_X_y=True)
    x = x.astype(np.float32)
    clf = MLPClassifier(hidden_layer_sizes=(16,), max_iter=30, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ConvergenceWarning: 30 iterations keep it fast
        clf.fit(x[:400], y[:400])
    path = folder / "sklearn_mlp.onnx"
    path.write_bytes(to_onnx(clf, x[:1], target_opset=17).SerializeToString())
    batch = x[400:400 + BATCH]
    z = np.maximum(batch.astype(np.float64) @ clf.coefs_[0] + clf.intercepts_[0], 0)
    u = z @ clf.coefs_[1] + clf.intercepts_[1]
    return Export("sklearn_mlp", path, {"X": batch}, "", "MatMul", "softmax", z, u)


def _tf_style_model(rng) -> onnx.ModelProto:
    nodes, inits = [], []

    def const(name, value):
        nodes.append(helper.make_node("Constant", [], [name], name=name,
                                      value=numpy_helper.from_array(value, name)))
        return name

    def node(op, inputs, name, **attrs):
        nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    f32 = np.float32
    h = node("Relu", [node("Add", [node("MatMul", ["x", const("dense/kernel", rng.normal(
        0, 0.3, (12, 16)).astype(f32))], "dense/MatMul"), const("dense/bias", rng.normal(
            0, 0.1, 16).astype(f32))], "dense/BiasAdd")], "dense/Relu")
    w = const("logits/kernel", rng.normal(0, 0.4, (16, 5)).astype(f32))
    w = node("Identity", [w], "logits/kernel/read")
    u = node("Add", [node("MatMul", [h, w], "logits/MatMul"),
                     const("logits/bias", rng.normal(0, 0.2, 5).astype(f32))], "logits/BiasAdd")
    shape, col = node("Shape", [u], "softmax/Shape"), const("col", np.array([-1, 1], np.int64))
    axes = const("axes", np.array([1], np.int64))
    peak = node("Max", [node("ReduceMax", [u], "softmax/ReduceMax", axes=[1], keepdims=0),
                        const("neg_inf", np.array(-np.inf, f32))], "softmax/Max")
    peak = node("Expand", [node("Reshape", [peak, col], "softmax/Reshape"), shape],
                "softmax/Expand")
    e = node("Exp", [node("Sub", [u, peak], "softmax/Sub")], "softmax/Exp")
    total = node("ReduceSum", [e, axes], "softmax/ReduceSum", keepdims=0)
    total = node("Expand", [node("Reshape", [total, col], "softmax/Reshape_1"), shape],
                 "softmax/Expand_1")
    nodes.append(helper.make_node("Div", [e, total], ["probabilities"], name="softmax/Div"))
    graph = helper.make_graph(
        nodes, "tf_style", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 12])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["N", 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="tf2onnx-style")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def tf_softmax_constants(folder: Path) -> Export:
    rng = np.random.default_rng(0)
    model = _tf_style_model(rng)
    path = folder / "tf_softmax_constants.onnx"
    onnx.save(model, path)
    x = rng.normal(size=(BATCH, 12)).astype(np.float32)
    consts = {n.output[0]: numpy_helper.to_array(n.attribute[0].t).astype(np.float64)
              for n in model.graph.node if n.op_type == "Constant"}
    z = np.maximum(x @ consts["dense/kernel"] + consts["dense/bias"], 0)
    u = z @ consts["logits/kernel"] + consts["logits/bias"]
    return Export("tf_softmax_constants", path, {"x": x}, "logits/MatMul", "MatMul",
                  "softmax", z, u)


def qdq_int8(folder: Path) -> Export:
    pytest.importorskip("onnxruntime.quantization")
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    source = torch_resnet(folder)
    rng = np.random.default_rng(1)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"x": rng.normal(size=(BATCH, 3, 16, 16)).astype(np.float32)}
                                 for _ in range(4)])

        def get_next(self):
            return next(self.batches, None)

    path = folder / "qdq_int8.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_static(str(source.path), str(path), Reader(), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    return Export("qdq_int8", path, source.feeds, "/fc/Gemm", "Gemm", "identity",
                  notes={"float": source})


BUILDERS = {"torch_resnet": torch_resnet, "torch_vit": torch_vit,
            "torch_vit_opset14": torch_vit_opset14, "hf_bert": hf_bert, "hf_gpt2": hf_gpt2,
            "hf_llama": hf_llama, "sklearn_mlp": sklearn_mlp,
            "tf_softmax_constants": tf_softmax_constants, "qdq_int8": qdq_int8}


# -- for the pruning tests --------------------------------------------------------------------
def digits_mlp(d):
    """A real skl2onnx export: MLPClassifier (64 → 16 → 10) on sklearn's digits, with its
    calibration data; MatMul 'MatMul' (1,024 weights) is hidden, 'MatMul1' (160) the head."""
    pytest.importorskip("skl2onnx")
    from skl2onnx import to_onnx
    from sklearn.datasets import load_digits
    from sklearn.neural_network import MLPClassifier

    x, y = load_digits(return_X_y=True)
    x = x.astype(np.float32) / 16
    clf = MLPClassifier(hidden_layer_sizes=(16,), max_iter=30, random_state=0)
    with pytest.warns(Warning):  # ConvergenceWarning: 30 iterations keep the test fast
        clf.fit(x[:400], y[:400])
    onnx.save(to_onnx(clf, x[:1], options={id(clf): {"zipmap": False}}, target_opset=17),
              d / "mlp.onnx")
    np.savez(d / "digits.npz", X=x[400:464], labels=y[400:464])
    return d / "mlp.onnx", d / "digits.npz"
