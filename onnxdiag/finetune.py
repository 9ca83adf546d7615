"""Recovery fine-tuning on the ONNX graph itself (SPEC B6, "Recovery"), no original framework.

Training artifacts are built from a copy of the model whose only output is the head's logits
flattened to ``(n_samples, n_classes)``, with cross-entropy against a labels input and an
AdamW/SGD optimizer graph.  After training on labelled batches of any DataSource,
``export_model_for_inferencing`` exports the graph under the model's own output names (a
Softmax after the logits stays) and the trained initializers are copied into a copy of the
input model, so inputs, outputs, node names and metadata are the input's (never modified).

Trained: the float initializers behind the weights and biases of the Conv / ConvTranspose /
Gemm / MatMul nodes feeding the logits (a bias may be a following Add's constant) and the
scale and bias of the BatchNormalizations there.  BN runs in inference mode: the training
graph has each BN replaced by its affine (x − mean)/√(var+ε)·scale + bias with the running
statistics as constants (neither updated nor trained; ORT's own BN gradient would run BN in
training mode, on batch statistics that never reach the exported model).
``onnxruntime-training`` replaces ``onnxruntime``, so it lives in its own environment (the
``[training]`` extra; constants here are the pinned 1.19.2's).
"""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import DataError, MissingExtraError, OnnxDiagError
from .graph import GraphIndex, analyze_structure
from .model.io import ensure_writable_dir, load_model

INSTALL_HINT = (
    "Fine-tuning needs onnxruntime-training, which replaces the onnxruntime package, so "
    "install it in a separate environment: python -m venv .venv-train && "
    ".venv-train/bin/pip install -e '.[training]'"
)
#: Highest IR version / default-domain opset that onnxruntime(-training) 1.19 loads.
MAX_IR_VERSION, MAX_OPSET = 10, 21
OPTIMIZERS = ("adamw", "adam", "sgd")
_TRAINED_OPS = {"Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (0, 1, 2), "MatMul": (0, 1),
                "BatchNormalization": (1, 2)}
_LOGITS, _LABELS = "onnxdiag_finetune_logits", "onnxdiag_finetune_labels"
_OP_NOTES = {"BatchNormalization": "BatchNormalization ran in inference mode: running "
                                   "statistics fixed, scale/bias trained.",
             "Dropout": "Dropout ran in inference mode (identity), as exported."}


@dataclass(frozen=True)
class FinetuneRecord:
    """What :func:`finetune_model` did.

    ``epochs``/``steps``: epochs run and optimizer steps (one per batch); ``lr``,
    ``optimizer``, ``weight_decay``, ``max_batches``, ``seed``: the settings; ``losses``:
    batch-mean training cross-entropy per step; ``epoch_losses``: their per-epoch means;
    ``accuracy_*`` / ``eval_loss_*``: top-1 accuracy and cross-entropy on ``eval_source``
    before/after (None without it); ``logits``: the tensor trained on; ``outputs``: the
    model's outputs; ``trainable``: trained initializer names; ``export_max_abs_diff``: max
    |output difference| of ORT's exported model and the returned one on one batch (0 up to
    rounding); ``notes``: what was assumed.
    """

    epochs: int
    steps: int
    lr: float
    optimizer: str
    weight_decay: float
    max_batches: int
    seed: int
    losses: tuple[float, ...]
    epoch_losses: tuple[float, ...]
    first_loss: float
    last_loss: float
    accuracy_before: float | None
    accuracy_after: float | None
    eval_loss_before: float | None
    eval_loss_after: float | None
    seconds: float
    ort_training_version: str
    logits: str
    outputs: tuple[str, ...]
    trainable: tuple[str, ...]
    n_trainable_params: int
    export_max_abs_diff: float
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """JSON-able dict of every field (tuples as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}


def finetune_model(model, train_source, *, epochs: int = 5, max_batches: int = 200,
                   lr: float = 1e-4, optimizer: str = "adamw", weight_decay: float = 0.0,
                   seed: int = 0, eval_source=None, workdir=None, progress: bool = False,
                   device: str = "cpu", keep_zeros: bool = False
                   ) -> tuple[onnx.ModelProto, FinetuneRecord]:
    """Fine-tune ``model``'s weights on labelled data with ONNX Runtime training (SPEC B6).

    Args:
        model: anything :func:`~onnxdiag.model_io.load_model` accepts (never modified).
        train_source: labelled DataSource, read in its order.  An epoch is ≤ max_batches
            batches and ends early at the end of a pass; the next one continues where it
            stopped (restarting the data), so a large source is covered, not repeated.
        epochs, max_batches, lr: the schedule (original protocol: 5 × ≤ 200, lr 1e-4).
        optimizer: "adamw" (with ``weight_decay=0``, the default, it is the original
            protocol's Adam: β = (0.9, 0.999), ε = 1e-8), "adam" (no decay) or "sgd".
        seed: seeds ONNX Runtime's random generator (only random ops use it).
        eval_source: labelled DataSource; accuracy and loss are measured before and after.
        workdir: folder for the training artifacts (kept); default a temporary folder.
        progress: progress bar over the steps on a terminal.
        device: ORT training device, "cpu" or "cuda[:id]".
        keep_zeros: re-zero exactly-zero weights after every step (unstructured sparsity).

    Returns ``(fine-tuned model loaded with load_model, record)``.

    Raises:
        MissingExtraError: onnxruntime-training is not installed (message: INSTALL_HINT).
        DataError: data without labels, labels outside ``[0, n_classes)``, empty data.
        OnnxDiagError: bad settings, an opset ORT 1.19 cannot train, nothing trainable,
            or a non-finite loss (lower ``lr``).
        HeadNotFoundError: no classifier head (its logits define the loss).
    """
    start = time.perf_counter()
    ort = import_training()
    if not train_source.has_labels:
        raise DataError("The fine-tuning data has no labels; give an npz with a 'labels' key, "
                        "a labels file, or class sub-folders.")
    model = load_model(model)  # our copy; ORT 1.19 loads IR ≤ 10, enough for opset ≤ 21
    ir_version, model.ir_version = model.ir_version, min(model.ir_version, MAX_IR_VERSION)
    _check_settings(model, epochs, max_batches, lr, optimizer, weight_decay)
    head = analyze_structure(model).head
    trainable = _trainable_names(model, head.logits)
    if not trainable:
        raise OnnxDiagError(f"No float initializer feeding the logits '{head.logits}' can be "
                            "trained (weights computed by nodes cannot); nothing to fine-tune.")
    providers = ["cpu"] if device == "cpu" else None
    before = _evaluate(model, head, eval_source, providers)
    ort.set_seed(int(seed))
    outputs = [o.name for o in model.graph.output]
    inits = {t.name: t for t in model.graph.initializer}
    holder = (tempfile.TemporaryDirectory(prefix="onnxdiag-finetune-") if workdir is None
              else nullcontext(ensure_writable_dir(workdir)))
    with holder as folder:
        folder = Path(folder)
        _generate(_training_base(model, head), trainable, optimizer, weight_decay, folder)
        zeros = {n: numpy_helper.to_array(inits[n]) == 0 for n in trainable if keep_zeros}
        masks = {n: m for n, m in zeros.items() if m.any()}
        losses, epoch_losses, export, first = _train(
            folder, train_source, head.n_classes, (epochs, max_batches, lr), outputs, device,
            progress, masks)
    tuned = load_model(_splice(model, export, trainable))
    diff = _compare(export, tuned, first.feeds)
    after = _evaluate(tuned, head, eval_source, providers)
    return tuned, FinetuneRecord(
        epochs=len(epoch_losses), steps=len(losses), lr=float(lr), optimizer=optimizer,
        weight_decay=float(weight_decay), max_batches=int(max_batches), seed=int(seed),
        losses=tuple(losses), epoch_losses=tuple(epoch_losses), first_loss=losses[0],
        last_loss=losses[-1],
        accuracy_before=getattr(before, "accuracy", None),
        accuracy_after=getattr(after, "accuracy", None),
        eval_loss_before=getattr(before, "loss", None),
        eval_loss_after=getattr(after, "loss", None),
        seconds=time.perf_counter() - start, ort_training_version=ort.__version__,
        logits=head.logits, outputs=tuple(outputs), trainable=tuple(trainable),
        n_trainable_params=sum(int(np.prod(inits[n].dims)) for n in trainable),
        export_max_abs_diff=diff, notes=_notes(model, ir_version, masks))


def _notes(model: onnx.ModelProto, ir_version: int, masks: dict) -> tuple[str, ...]:
    ops = {n.op_type for n in model.graph.node}
    notes = [text for op, text in _OP_NOTES.items() if op in ops]
    if ir_version > MAX_IR_VERSION:
        notes.append(f"IR version lowered from {ir_version} to {MAX_IR_VERSION} for "
                     "onnxruntime-training 1.19.")
    if masks:
        notes.append(f"Zero weights kept at zero in {len(masks)} initializer(s).")
    return tuple(notes)


# -- setup ----------------------------------------------------------------------------------
def import_training():
    """onnxruntime with its training API imported, or MissingExtraError with the hint."""
    try:
        import onnxruntime
        from onnxruntime.training import api, artifacts, onnxblock  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError(f"onnxruntime.training is not installed ({exc}). "
                                f"{INSTALL_HINT}") from exc
    return onnxruntime


def _check_settings(model, epochs, max_batches, lr, optimizer, weight_decay) -> None:
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
                default=0)
    checks = [
        (opset > MAX_OPSET, f"the model uses opset {opset}, but onnxruntime-training 1.19 "
                            f"trains opset ≤ {MAX_OPSET}; re-export it with opset {MAX_OPSET}"),
        (epochs < 1 or max_batches < 1, f"epochs and max_batches must be at least 1, got "
                                        f"{epochs} and {max_batches}"),
        (not (lr > 0 and np.isfinite(lr)), f"lr must be a positive number, got {lr}"),
        (optimizer not in OPTIMIZERS, f"optimizer must be one of {', '.join(OPTIMIZERS)}, "
                                      f"got {optimizer!r}"),
        (bool(weight_decay) and optimizer != "adamw", f"weight_decay={weight_decay} needs "
                                                      "optimizer 'adamw'"),
    ]
    for failed, message in checks:
        if failed:
            raise OnnxDiagError(f"Cannot fine-tune: {message}.")


def _trainable_names(model: onnx.ModelProto, logits: str) -> list[str]:
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
        positions = _TRAINED_OPS.get(node.op_type, ())
        if node.op_type == "Add" and any(
                (p := index.producer.get(t)) is not None and p.op_type in _TRAINED_OPS
                for t in node.input):
            positions = (0, 1)  # the bias Add of a MatMul / bias-less Conv
        for i in positions:
            if i < len(node.input) and node.input[i]:
                source = index.source_initializer(node.input[i])
                if source in floats:
                    names.add(source)
    return [t.name for t in model.graph.initializer if t.name in names]


def _training_base(model: onnx.ModelProto, head) -> onnx.ModelProto:
    """A copy whose only output is the logits flattened to (batch, n_classes); the rest of
    the graph stays (unused by the loss) so ORT can export under the original outputs.

    BatchNormalization nodes become their inference-mode affine (x − mean)·(1/√(var+ε))
    ·scale + bias with the running statistics as constants: ORT's training graph would
    otherwise run BN in training mode (batch statistics), train against statistics the
    exported model never uses, and the exported model's accuracy would collapse."""
    base = onnx.ModelProto()
    base.CopyFrom(model)
    _bn_as_affine(base)
    base.graph.node.append(helper.make_node("Flatten", [head.logits], [_LOGITS],
                                            name=_LOGITS, axis=1))
    del base.graph.output[:]
    base.graph.output.append(helper.make_tensor_value_info(
        _LOGITS, onnx.TensorProto.FLOAT, ["batch", head.n_classes]))
    return base


def _bn_as_affine(model: onnx.ModelProto) -> None:
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
        rank = ranks.get(node.input[0])
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


@contextmanager
def _quiet_stderr():
    """Hold back ORT's native log lines (written to fd 2 whatever the logger severity)
    while artifacts are generated; print their tail if that fails."""
    saved = os.dup(2)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            log.seek(0)
            os.write(2, log.read()[-4000:])
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _generate(base, trainable, optimizer, weight_decay, folder: Path) -> None:
    """Training / eval / optimizer models and checkpoint in ``folder`` (IR capped for ORT)."""
    from onnxruntime.training import artifacts, onnxblock

    class _Loss(onnxblock.Block):  # cross-entropy against a labels input of our own name
        def __init__(self):
            super().__init__()
            self._ce = onnxblock.loss.CrossEntropyLoss()

        def build(self, scores: str):
            return self._ce(scores, _LABELS)

    if optimizer == "sgd":
        optim = onnxblock.optim.SGD()
    else:
        optim = onnxblock.optim.AdamW(betas=(0.9, 0.999), eps=1e-8,
                                      weight_decay=float(weight_decay))
    with _quiet_stderr():
        artifacts.generate_artifacts(base, requires_grad=list(trainable), loss=_Loss(),
                                     optimizer=optim, artifact_directory=folder)
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        path = folder / name
        proto = onnx.load(path)
        if proto.ir_version > MAX_IR_VERSION:  # onnx stamps its own newest IR version
            proto.ir_version = MAX_IR_VERSION
            onnx.save(proto, path)


# -- training -------------------------------------------------------------------------------
def _schedule(source, epochs: int, max_batches: int):
    """``(epoch, batch)``: ≤ max_batches per epoch, ending early at the end of a data pass;
    the next epoch continues the data where this one stopped."""
    it = iter(())
    for epoch in range(epochs):
        for n in range(max_batches):
            batch = next(it, None)
            if batch is None and n > 0:  # end of a pass: end the epoch early
                it = iter(())
                break
            if batch is None:
                it = iter(source.batches())
                batch = next(it, None)
            if batch is None:
                raise DataError("The fine-tuning data is empty; give labelled samples.")
            yield epoch, batch


def _train(folder, source, n_classes, schedule, outputs, device, show_progress, masks):
    """Run ``schedule`` = (epochs, max_batches, lr); returns (losses, epoch means, ORT's
    exported inference model, first batch)."""
    epochs, max_batches, lr = schedule
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    from .runtime.progress import progress

    state = CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = Module(str(folder / "training_model.onnx"), state,
                    str(folder / "eval_model.onnx"), device=device)
    optim = Optimizer(str(folder / "optimizer_model.onnx"), module)
    optim.set_learning_rate(float(lr))
    names = module.input_names()
    steps = _schedule(source, epochs, max_batches)
    if show_progress:
        steps = progress(steps, None, "Fine-tuning")
    losses, per_epoch, first = [], {}, None
    module.train()
    for epoch, batch in steps:
        first = batch if first is None else first
        inputs = _train_inputs(names, batch, n_classes)
        loss = float(np.asarray(module(*inputs)).reshape(-1)[0])
        if not np.isfinite(loss):
            raise OnnxDiagError(f"The training loss became {loss} at step {len(losses) + 1}; "
                                f"lower the learning rate (lr={lr}).")
        optim.step()
        module.lazy_reset_grad()
        for name, mask in masks.items():
            param = state.parameters[name]
            data = param.data
            data[mask] = 0
            param.data = data
        losses.append(loss)
        per_epoch.setdefault(epoch, []).append(loss)
    module.eval()
    path = folder / "inference_model.onnx"
    module.export_model_for_inferencing(str(path), outputs)
    means = [float(np.mean(per_epoch[e])) for e in sorted(per_epoch)]
    return losses, means, onnx.load(path), first


def _train_inputs(names, batch, n_classes: int) -> list[np.ndarray]:
    labels = np.asarray(batch.labels).reshape(-1).astype(np.int64)
    bad = labels[(labels < 0) | (labels >= n_classes)]
    if bad.size:
        raise DataError(f"Label {int(bad[0])} is outside the model's {n_classes} classes "
                        f"(0 … {n_classes - 1}); check the labels match the model.")
    # open_data checked the feeds against the model's inputs; the graph adds the labels
    return [labels if name == _LABELS else batch.feeds[name] for name in names]


# -- result ---------------------------------------------------------------------------------
def _splice(model: onnx.ModelProto, export: onnx.ModelProto, names) -> onnx.ModelProto:
    """A copy of ``model`` with the trained initializers taken from ORT's export."""
    trained = {t.name: t for t in export.graph.initializer if t.name in set(names)}
    assert len(trained) == len(set(names)), f"ORT's export lacks {set(names) - set(trained)}"
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for init in out.graph.initializer:
        if init.name in trained:
            init.CopyFrom(trained[init.name])
    return out


def _compare(export: onnx.ModelProto, tuned: onnx.ModelProto, feeds: dict) -> float:
    """Max |difference| of every output of ORT's export and ``tuned`` in plain ORT."""
    from .runtime.runner import OrtRunner, compare_outputs

    names = [o.name for o in tuned.graph.output]
    a = OrtRunner(export, providers="cpu").run(feeds, names)
    b = OrtRunner(tuned, providers="cpu").run(feeds, names)
    return max((d["max_abs_diff"] for d in compare_outputs(a, b).values()), default=0.0)


def _evaluate(model, head, source, providers):
    if source is None:
        return None
    from .evaluate import evaluate_model, make_head_runner

    return evaluate_model(make_head_runner(model, head, providers=providers), head, source)
