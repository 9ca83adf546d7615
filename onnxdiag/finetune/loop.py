"""The training run of recovery fine-tuning on ONNX Runtime's training API: artifacts
(training / eval / optimizer models and checkpoint), the batch schedule, the loop and
the inference model ORT exports. onnxruntime.training is imported inside the functions."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx

from ..errors import DataError, OnnxDiagError
from .graph import LABELS

#: Highest IR version / default-domain opset that onnxruntime(-training) 1.19 loads.
MAX_IR_VERSION, MAX_OPSET = 10, 21


@contextmanager
def quiet_stderr():
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


def generate_artifacts(base, trainable, optimizer, weight_decay, folder: Path) -> None:
    """Training / eval / optimizer models and checkpoint in ``folder`` (IR capped for ORT)."""
    from onnxruntime.training import artifacts, onnxblock

    class _Loss(onnxblock.Block):  # cross-entropy against a labels input of our own name
        def __init__(self):
            super().__init__()
            self._ce = onnxblock.loss.CrossEntropyLoss()

        def build(self, scores: str):
            return self._ce(scores, LABELS)

    if optimizer == "sgd":
        optim = onnxblock.optim.SGD()
    else:
        optim = onnxblock.optim.AdamW(betas=(0.9, 0.999), eps=1e-8,
                                      weight_decay=float(weight_decay))
    with quiet_stderr():
        artifacts.generate_artifacts(base, requires_grad=list(trainable), loss=_Loss(),
                                     optimizer=optim, artifact_directory=folder)
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        path = folder / name
        proto = onnx.load(path)
        if proto.ir_version > MAX_IR_VERSION:  # onnx stamps its own newest IR version
            proto.ir_version = MAX_IR_VERSION
            onnx.save(proto, path)


def batch_schedule(source, epochs: int, max_batches: int):
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


def train(folder, source, n_classes, settings, outputs, device, show_progress, masks):
    """Run the schedule of ``settings`` (epochs, max_batches, lr: a FinetuneSettings) on
    the artifacts in ``folder``; ``masks``: {initializer: zero mask} re-zeroed after every
    step. Returns (losses, epoch means, ORT's exported inference model, first batch)."""
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    from ..runtime.progress import progress

    lr = settings.lr

    state = CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = Module(str(folder / "training_model.onnx"), state,
                    str(folder / "eval_model.onnx"), device=device)
    optim = Optimizer(str(folder / "optimizer_model.onnx"), module)
    optim.set_learning_rate(float(lr))
    names = module.input_names()
    steps = batch_schedule(source, settings.epochs, settings.max_batches)
    if show_progress:
        steps = progress(steps, None, "Fine-tuning")
    losses, per_epoch, first = [], {}, None
    module.train()
    for epoch, batch in steps:
        first = batch if first is None else first
        inputs = train_inputs(names, batch, n_classes)
        loss = float(np.asarray(module(*inputs)).reshape(-1)[0])
        if not np.isfinite(loss):
            raise OnnxDiagError(f"The training loss became {loss} at step {len(losses) + 1}; "
                                f"lower the learning rate (lr={lr}).")
        optim.step()
        module.lazy_reset_grad()
        _rezero(state, masks)
        losses.append(loss)
        per_epoch.setdefault(epoch, []).append(loss)
    module.eval()
    path = folder / "inference_model.onnx"
    module.export_model_for_inferencing(str(path), outputs)
    means = [float(np.mean(per_epoch[e])) for e in sorted(per_epoch)]
    return losses, means, onnx.load(path), first


def _rezero(state, masks: dict) -> None:
    for name, mask in masks.items():
        param = state.parameters[name]
        data = param.data
        data[mask] = 0
        param.data = data


def train_inputs(names, batch, n_classes: int) -> list[np.ndarray]:
    """The training graph's inputs for ``batch``, in ``names`` order (labels checked)."""
    labels = np.asarray(batch.labels).reshape(-1).astype(np.int64)
    bad = labels[(labels < 0) | (labels >= n_classes)]
    if bad.size:
        raise DataError(f"Label {int(bad[0])} is outside the model's {n_classes} classes "
                        f"(0 … {n_classes - 1}); check the labels match the model.")
    # open_data checked the feeds against the model's inputs; the graph adds the labels
    return [labels if name == LABELS else batch.feeds[name] for name in names]
