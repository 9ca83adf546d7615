"""One pass over a probe batch: head check, readouts (SPEC A1–A2) and evaluation.

The head's features and logits are exposed as outputs (on a copy), the data are
streamed through ONNX Runtime once, and every batch is folded into accumulators
and dropped: memory does not grow with the number of samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import DataError
from .instrument import expose_tensors
from .readouts import ReadoutAccumulator, Readouts, log_softmax, verify_head
from .runner import OrtRunner, single_threaded_blas

#: ``--targets auto``: true labels when the probe data has them, else pseudo-labels.
TARGET_CHOICES = ("auto", "labels", "pseudo", "expected")


def head_arrays(outputs: dict[str, np.ndarray], head) -> tuple[np.ndarray, np.ndarray]:
    """Z (n_samples, n_features) and U (n_samples, n_classes) from exposed head tensors."""
    feats = np.asarray(outputs[head.features], dtype=np.float64)
    n = feats.shape[0]
    if head.features_reduce == "spatial_mean" and feats.ndim > 2:
        Z = feats.reshape(n, feats.shape[1], -1).mean(axis=2)
    else:
        Z = feats.reshape(n, -1)
    U = np.asarray(outputs[head.logits], dtype=np.float64).reshape(n, -1)
    return Z, U


def resolve_targets(targets: str, has_labels: bool) -> str:
    """Map ``auto`` to labels/pseudo; refuse ``labels`` on unlabelled data."""
    if targets == "auto":
        return "labels" if has_labels else "pseudo"
    if targets == "labels" and not has_labels:
        raise DataError(
            "--targets labels needs labelled probe data, but the data has no labels; pass "
            "--labels FILE, use an npz with a 'labels' key, or use --targets pseudo/expected."
        )
    return targets


@dataclass(frozen=True)
class Evaluation:
    """Top-1 accuracy and cross-entropy of a model on labelled data."""

    n_samples: int
    accuracy: float
    loss: float

    def to_dict(self) -> dict:
        return {"n_samples": self.n_samples, "accuracy": self.accuracy, "loss": self.loss}


class EvalAccumulator:
    """Streams logits + labels into accuracy and mean cross-entropy (exact for any split)."""

    def __init__(self):
        self.n, self.correct, self.loss_sum = 0, 0, 0.0

    def update(self, U: np.ndarray, labels: np.ndarray) -> None:
        labels = np.asarray(labels).reshape(-1).astype(np.int64)
        logp = log_softmax(np.asarray(U, dtype=np.float64))
        self.correct += int(np.sum(U.argmax(axis=1) == labels))
        self.loss_sum += float(-logp[np.arange(len(labels)), labels].sum())
        self.n += len(labels)

    def result(self) -> Evaluation:
        if self.n == 0:
            raise DataError("The evaluation data is empty; give at least one labelled sample.")
        return Evaluation(self.n, self.correct / self.n, self.loss_sum / self.n)


@dataclass(frozen=True)
class ProbeResult:
    """Readouts of one model on one probe batch, the head check, optional evaluation."""

    readouts: Readouts
    head_node: str
    head_rel_error: float
    evaluation: Evaluation | None = None
    data: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"head_node": self.head_node, "head_rel_error": self.head_rel_error,
                "readouts": self.readouts.to_dict(),
                "evaluation": None if self.evaluation is None else self.evaluation.to_dict(),
                "data": self.data}


def make_head_runner(model, head, *, providers=None, threads=None) -> OrtRunner:
    """A session over a copy of ``model`` that also outputs the head's Z and U tensors."""
    return OrtRunner(expose_tensors(model, [head.features, head.logits]), providers=providers,
                     threads=threads)


def probe_model(model, structure, probe, *, eval_source=None, targets: str = "auto",
                norm: str = "feature", include_bias: bool = False, providers=None,
                threads=None, runner: OrtRunner | None = None, label: str | None = None
                ) -> ProbeResult:
    """Readouts of ``model`` on the DataSource ``probe`` (and accuracy on ``eval_source``).

    The head is verified on the first batch (Z Wᵀ + b ≈ U, rel. error ≤ 1e-4);
    HeadNotFoundError otherwise. Never modifies ``model``.
    """
    head = structure.head
    runner = runner or make_head_runner(model, head, providers=providers, threads=threads)
    targets = resolve_targets(targets, probe.has_labels)
    acc = ReadoutAccumulator(head.weight, head.bias, targets=targets, include_bias=include_bias,
                             norm=norm, n_params=structure.n_params)
    rel_error = None
    names = [head.features, head.logits]
    with single_threaded_blas():  # small per-batch products between ORT runs
        for batch, outputs in runner.stream(probe, names, label=label):
            Z, U = head_arrays(outputs, head)
            if rel_error is None:
                rel_error = verify_head(Z, U, head.weight, head.bias, node_name=head.node_name)
            acc.update(Z, U, batch.labels if targets == "labels" or probe.has_labels else None)
        evaluation = None
        if eval_source is not None:
            evaluation = evaluate_model(runner, head, eval_source)
    return ProbeResult(readouts=acc.result(), head_node=head.node_name,
                       head_rel_error=float(rel_error or 0.0), evaluation=evaluation,
                       data=probe.describe())


def evaluate_model(runner: OrtRunner, head, source, *, label: str | None = None) -> Evaluation:
    """Top-1 accuracy and loss of the head's logits on a labelled DataSource."""
    if not source.has_labels:
        raise DataError("--eval-data has no labels; evaluation needs labelled data (an npz "
                        "with a 'labels' key, --eval-labels FILE, or class sub-folders).")
    acc = EvalAccumulator()
    for batch, outputs in runner.stream(source, [head.features, head.logits], label=label):
        _, U = head_arrays(outputs, head)
        acc.update(U, batch.labels)
    return acc.result()
