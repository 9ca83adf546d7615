"""Recovery fine-tuning on the ONNX graph itself (docs/METHODS.md §B6, "Recovery"), without
the original framework.

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

Modules: this one (the API), :mod:`.graph` (the training graph), :mod:`.loop` (the run).
"""

from __future__ import annotations

import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import DataError, MissingExtraError, OnnxDiagError
from ..evaluate import evaluate
from ..graph import analyze_structure
from ..model.io import ensure_writable_dir, load_model
from .graph import splice, trainable_names, training_base
from .loop import MAX_IR_VERSION, MAX_OPSET, generate_artifacts, train

INSTALL_HINT = (
    "Fine-tuning needs onnxruntime-training, which replaces the onnxruntime package, so "
    "install it in a separate environment: python -m venv .venv-train && "
    ".venv-train/bin/pip install -e '.[training]'"
)
OPTIMIZERS = ("adamw", "adam", "sgd")
_OP_NOTES = {"BatchNormalization": "BatchNormalization ran in inference mode: running "
                                   "statistics fixed, scale/bias trained.",
             "Dropout": "Dropout ran in inference mode (identity), as exported."}


@dataclass(frozen=True)
class FinetuneSettings:
    """The schedule and optimizer of :func:`finetune_model` (defaults: the original
    protocol, 5 epochs of ≤ 200 batches at lr 1e-4).

    An epoch is ≤ ``max_batches`` batches and ends early at the end of a pass over the
    data; the next one continues where it stopped (restarting the data), so a large
    source is covered, not repeated. ``optimizer``: "adamw" (with ``weight_decay=0``, the
    default, it is the original protocol's Adam: β = (0.9, 0.999), ε = 1e-8), "adam" (no
    decay) or "sgd". ``seed`` seeds ONNX Runtime's random generator (only random ops use
    it). ``keep_zeros``: re-zero exactly-zero weights after every step (unstructured
    sparsity).
    """

    epochs: int = 5
    max_batches: int = 200
    lr: float = 1e-4
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    seed: int = 0
    keep_zeros: bool = False

    def check(self, model: onnx.ModelProto) -> None:
        """OnnxDiagError("Cannot fine-tune: …") for bad settings or an opset ORT 1.19
        cannot train."""
        opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
                    default=0)
        lr, decay = self.lr, self.weight_decay
        checks = [
            (opset > MAX_OPSET, f"the model uses opset {opset}, but onnxruntime-training "
                                f"1.19 trains opset ≤ {MAX_OPSET}; re-export it with opset "
                                f"{MAX_OPSET}"),
            (self.epochs < 1 or self.max_batches < 1, "epochs and max_batches must be at "
                                                      f"least 1, got {self.epochs} and "
                                                      f"{self.max_batches}"),
            (not (lr > 0 and np.isfinite(lr)), f"lr must be a positive number, got {lr}"),
            (self.optimizer not in OPTIMIZERS, "optimizer must be one of "
                                               f"{', '.join(OPTIMIZERS)}, got "
                                               f"{self.optimizer!r}"),
            (bool(decay) and self.optimizer != "adamw", f"weight_decay={decay} needs "
                                                        "optimizer 'adamw'"),
        ]
        for failed, message in checks:
            if failed:
                raise OnnxDiagError(f"Cannot fine-tune: {message}.")


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


def finetune_model(model, train_source, settings: FinetuneSettings = FinetuneSettings(), *,
                   head: str | None = None, features: str | None = None, eval_source=None,
                   workdir=None, progress: bool = False, device: str = "cpu"
                   ) -> tuple[onnx.ModelProto, FinetuneRecord]:
    """Fine-tune ``model``'s weights on labelled data with ONNX Runtime training
    (docs/METHODS.md §B6, "Recovery").

    Args:
        model: anything :func:`~onnxdiag.model.io.load_model` accepts (never modified).
        train_source: labelled DataSource, read in its order (see FinetuneSettings).
        settings: the schedule and optimizer (:class:`FinetuneSettings`).
        head, features: the head node and its features tensor when the head cannot be
            found alone (``--head`` / ``--features``); its logits define the loss.
        eval_source: labelled DataSource; accuracy and loss are measured before and after.
        workdir: folder for the training artifacts (kept); default a temporary folder.
        progress: progress bar over the steps on a terminal.
        device: ORT training device, "cpu" or "cuda[:id]".

    Returns ``(fine-tuned model loaded with load_model, record)``.

    Raises:
        MissingExtraError: onnxruntime-training is not installed (message: INSTALL_HINT).
        DataError: data without labels, labels outside ``[0, n_classes)``, empty data.
        OnnxDiagError: bad settings, an opset ORT 1.19 cannot train, nothing trainable,
            or a non-finite loss (lower ``lr``).
        HeadNotFoundError: no classifier head.
    """
    start = time.perf_counter()
    ort = import_training()
    model, ir_version, found, trainable = _prepare(model, train_source, settings, head,
                                                   features)
    providers = ["cpu"] if device == "cpu" else None
    before = evaluate(model, found, eval_source, providers=providers)
    ort.set_seed(int(settings.seed))
    tuned, run = _run(model, found, trainable, train_source, settings,
                      (workdir, progress, device))
    after = evaluate(tuned, found, eval_source, providers=providers)
    inits = {t.name: t for t in model.graph.initializer}
    losses, epoch_losses, diff, masks = run
    return tuned, FinetuneRecord(
        epochs=len(epoch_losses), steps=len(losses), lr=float(settings.lr),
        optimizer=settings.optimizer, weight_decay=float(settings.weight_decay),
        max_batches=int(settings.max_batches), seed=int(settings.seed),
        losses=tuple(losses), epoch_losses=tuple(epoch_losses), first_loss=losses[0],
        last_loss=losses[-1],
        accuracy_before=getattr(before, "accuracy", None),
        accuracy_after=getattr(after, "accuracy", None),
        eval_loss_before=getattr(before, "loss", None),
        eval_loss_after=getattr(after, "loss", None),
        seconds=time.perf_counter() - start, ort_training_version=ort.__version__,
        logits=found.logits, outputs=tuple(o.name for o in model.graph.output),
        trainable=tuple(trainable),
        n_trainable_params=sum(int(np.prod(inits[n].dims)) for n in trainable),
        export_max_abs_diff=diff, notes=_notes(model, ir_version, masks))


def _prepare(model, train_source, settings, head, features) -> tuple:
    """(our copy of the model, its IR version, its head, trainable initializers), checked."""
    if not train_source.has_labels:
        raise DataError("The fine-tuning data has no labels; give an npz with a 'labels' key, "
                        "a labels file, or class sub-folders.")
    model = load_model(model)  # our copy; ORT 1.19 loads IR ≤ 10, enough for opset ≤ 21
    ir_version, model.ir_version = model.ir_version, min(model.ir_version, MAX_IR_VERSION)
    settings.check(model)
    found = analyze_structure(model, head=head, features=features).head
    trainable = trainable_names(model, found.logits)
    if not trainable:
        raise OnnxDiagError(f"No float initializer feeding the logits '{found.logits}' can be "
                            "trained (weights computed by nodes cannot); nothing to fine-tune.")
    return model, ir_version, found, trainable


def _run(model, head, trainable, source, settings: FinetuneSettings, where) -> tuple:
    """Generate the artifacts, train, splice: (tuned model, (losses, epoch means, export
    difference, zero masks)); ``where`` = (workdir, progress, device)."""
    workdir, progress, device = where
    outputs = [o.name for o in model.graph.output]
    inits = {t.name: t for t in model.graph.initializer}
    holder = (tempfile.TemporaryDirectory(prefix="onnxdiag-finetune-") if workdir is None
              else nullcontext(ensure_writable_dir(workdir)))
    with holder as folder:
        folder = Path(folder)
        generate_artifacts(training_base(model, head), trainable, settings.optimizer,
                           settings.weight_decay, folder)
        zeros = {n: numpy_helper.to_array(inits[n]) == 0 for n in trainable
                 if settings.keep_zeros}
        masks = {n: m for n, m in zeros.items() if m.any()}
        losses, epoch_losses, export, first = train(
            folder, source, head.n_classes, settings, outputs, device, progress, masks)
    tuned = load_model(splice(model, export, trainable))
    return tuned, (losses, epoch_losses, _compare(export, tuned, first.feeds), masks)


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


def _compare(export: onnx.ModelProto, tuned: onnx.ModelProto, feeds: dict) -> float:
    """Max |difference| of every output of ORT's export and ``tuned`` in plain ORT."""
    from ..runtime.runner import OrtRunner, compare_outputs

    names = [o.name for o in tuned.graph.output]
    a = OrtRunner(export, providers="cpu").run(feeds, names)
    b = OrtRunner(tuned, providers="cpu").run(feeds, names)
    return max((d["max_abs_diff"] for d in compare_outputs(a, b).values()), default=0.0)
