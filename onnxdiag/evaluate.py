"""Evaluation: a model's head outputs on data, accuracy / loss, and the comparison of two models.

- :func:`make_head_runner` — a runner exposing the head's features and logits.
- :func:`evaluate` — top-1 accuracy and cross-entropy of a model (or a runner) on labelled
  data; None without data. The one evaluation entry point of the commands.  For a
  per-position head (docs/METHODS.md §A4) on label maps: mean IoU, pixel accuracy and
  per-pixel cross-entropy, ignore-index pixels left out.
- :func:`evaluate_model` — the same over a head runner.
- :func:`compare_models` — max logit difference and top-1 agreement of two models
  (:func:`compare_logits` from logits already at hand; :func:`evaluate_pair`: both
  models evaluated and compared in one run of each over the data)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .data.labels import IGNORE_INDEX
from .errors import DataError
from .graph.dense import class_axis, position_rows
from .graph.head import feature_matrix
from .model.expose import expose_tensors
from .runtime.runner import OrtRunner
from .selection.readouts import log_softmax


def compare_models(source_runner, emitted_runner, source, head, *, max_batches: int = 8) -> dict:
    """Compare two models' head logits on verification data (a DataSource).

    Both runners must expose the head's features and logits (``probe.make_head_runner``).

    Returns max |Δlogit|, relative difference and the top-1 agreement, over at most
    ``max_batches`` batches (:func:`compare_logits` of their logits, batch by batch).
    """
    names = [head.features, head.logits]
    diff = scale = 0.0
    agree = n = 0
    for i, batch in enumerate(source.batches()):
        if i >= max_batches:
            break
        _, ua = head_arrays(source_runner.run(batch.feeds, names), head)
        _, ub = head_arrays(emitted_runner.run(batch.feeds, names), head)
        d, s, a, m = _logit_stats(ua, ub)
        diff, scale, agree, n = max(diff, d), max(scale, s), agree + a, n + m
    return _comparison(diff, scale, agree, n)


def compare_logits(ua: np.ndarray, ub: np.ndarray) -> dict:
    """:func:`compare_models`' record from two models' logits already at hand, ``(rows,
    n_classes)`` each (rows = samples, or positions of a per-position head)."""
    return _comparison(*_logit_stats(ua, ub))


def _logit_stats(ua, ub) -> tuple[float, float, int, int]:
    """(max |ua − ub|, max |ua|, rows with the same top-1, rows) of two logit arrays."""
    ua, ub = np.asarray(ua, np.float64), np.asarray(ub, np.float64)
    return (float(np.max(np.abs(ua - ub), initial=0.0)), float(np.max(np.abs(ua), initial=0.0)),
            int(np.sum(ua.argmax(1) == ub.argmax(1))), ua.shape[0])


def _comparison(diff: float, scale: float, agree: int, n: int) -> dict:
    return {"n_samples": n, "max_abs_logit_diff": diff,
            "max_rel_logit_diff": diff / (scale + 1e-12),
            "top1_agreement": agree / n if n else None}


def head_arrays(outputs: dict[str, np.ndarray], head) -> tuple[np.ndarray, np.ndarray]:
    """Z (n_samples, n_features) and U (n_samples, n_classes) from exposed head tensors.

    Z by ``head.features_reduce`` (:func:`onnxdiag.graph.head.feature_matrix`): the
    features flattened, their mean over spatial positions (a 1×1 conv before global
    average pooling: the pooled logits are W · mean(z) + b), or the picked token's row.
    A per-position head gives rows = positions: Z (rows, n_features), U (rows, n_classes).
    """
    n = np.shape(outputs[head.features])[0]
    if head.features_reduce == "positions":
        U = position_rows(outputs[head.logits], class_axis(head.op_type))
        return feature_matrix(outputs[head.features], head, U), U
    U = np.asarray(outputs[head.logits], dtype=np.float64).reshape(n, -1)
    return feature_matrix(outputs[head.features], head, U), U


@dataclass(frozen=True)
class Evaluation:
    """Top-1 accuracy and cross-entropy of a model on labelled data.

    For a per-position head (§A4) ``accuracy`` and ``loss`` are per labelled position
    (pixel accuracy, mean cross-entropy), ``miou`` the mean IoU over the classes with a
    non-empty union (``iou`` per class, None where a class is neither predicted nor
    labelled), ``n_rows`` the labelled positions; ``quality`` names the value that ranks
    checkpoints ("miou", else "accuracy")."""

    n_samples: int
    accuracy: float
    loss: float
    miou: float | None = None
    iou: tuple | None = None
    n_rows: int | None = None
    ignore_index: int | None = None

    @property
    def quality(self) -> str:
        return "accuracy" if self.miou is None else "miou"

    def to_dict(self) -> dict:
        out = {"n_samples": self.n_samples, "accuracy": self.accuracy, "loss": self.loss}
        if self.miou is not None:
            out.update(quality="miou", miou=self.miou, iou=list(self.iou),
                       n_rows=self.n_rows, ignore_index=self.ignore_index)
        return out


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


class DenseEvalAccumulator:
    """Streams per-position logits + label maps into a confusion matrix (exact for any
    split): pixel accuracy, mean cross-entropy and IoU_c = TP / (TP + FP + FN)."""

    def __init__(self, n_classes: int, ignore_index: int = IGNORE_INDEX):
        self.confusion = np.zeros((n_classes, n_classes), dtype=np.int64)
        self.ignore_index, self.n_images, self.loss_sum = ignore_index, 0, 0.0

    def update(self, U_rows: np.ndarray, labels: np.ndarray, n_images: int) -> None:
        """U_rows (rows, C) and labels (rows,), ignored rows already dropped."""
        c = self.confusion.shape[0]
        logp = log_softmax(U_rows)
        self.loss_sum += float(-logp[np.arange(len(labels)), labels].sum())
        pairs = labels * c + U_rows.argmax(axis=1)
        self.confusion += np.bincount(pairs, minlength=c * c).reshape(c, c)
        self.n_images += n_images

    def result(self) -> Evaluation:
        n = int(self.confusion.sum())
        if n == 0:
            raise DataError("The evaluation label maps have no labelled position (all are "
                            f"the ignore index {self.ignore_index}); give labelled maps.")
        tp = np.diag(self.confusion).astype(np.float64)
        union = self.confusion.sum(0) + self.confusion.sum(1) - tp
        iou = tuple(float(t / u) if u > 0 else None for t, u in zip(tp, union))
        present = [v for v in iou if v is not None]
        return Evaluation(self.n_images, float(tp.sum() / n), self.loss_sum / n,
                          miou=float(np.mean(present)), iou=iou, n_rows=n,
                          ignore_index=self.ignore_index)


def make_head_runner(model, head, *, providers=None, threads=None) -> OrtRunner:
    """A session over a copy of ``model`` that also outputs the head's Z and U tensors."""
    return OrtRunner(expose_tensors(model, [head.features, head.logits]), providers=providers,
                     threads=threads)


def evaluate_model(runner: OrtRunner, head, source, *, label: str | None = None,
                   ignore_index: int = IGNORE_INDEX) -> Evaluation:
    """Top-1 accuracy and loss of the head's logits on a labelled DataSource (with a
    per-position head: mean IoU too, ``ignore_index`` pixels left out)."""
    if not source.has_labels:
        raise DataError("--eval-data has no labels; evaluation needs labelled data (an npz "
                        "with a 'labels' key, --eval-labels FILE, or class sub-folders).")
    if head.features_reduce == "positions":
        return _evaluate_dense(runner, head, source, label, ignore_index)
    acc = EvalAccumulator()
    for batch, outputs in runner.stream(source, [head.features, head.logits], label=label):
        acc.update(_labelled_logits(batch, outputs, head, source), batch.labels)
    return acc.result()


def _labelled_logits(batch, outputs, head, source) -> np.ndarray:
    """A batch's logits U (n, n_classes), its labels checked against them."""
    from .data.labels import check_batch_labels, is_label_map, source_name

    _, U = head_arrays(outputs, head)
    if is_label_map(batch.labels):
        raise DataError(f"{source_name(source)} holds label maps {batch.labels.shape[1:]},"
                        f" but head {head.node_name!r} gives one class per sample; give "
                        "one label per sample.")
    check_batch_labels(batch.labels, batch.indices, U.shape[1], source_name(source))
    return U


def evaluate_pair(source_runner: OrtRunner, emitted_runner: OrtRunner, head, source, *,
                  max_batches: int = 8, ignore_index: int = IGNORE_INDEX) -> tuple:
    """(:func:`evaluate_model` of each runner, :func:`compare_models` of the two) on the
    labelled DataSource ``source``, each model run once over it: the comparison (first
    ``max_batches`` batches) comes from the logits the evaluations read. A per-position
    head gets the three calls."""
    if not source.has_labels or head.features_reduce == "positions":
        return (evaluate_model(source_runner, head, source, ignore_index=ignore_index),
                evaluate_model(emitted_runner, head, source, ignore_index=ignore_index),
                compare_models(source_runner, emitted_runner, source, head,
                               max_batches=max_batches))
    names = [head.features, head.logits]
    accs, stats = (EvalAccumulator(), EvalAccumulator()), (0.0, 0.0, 0, 0)
    for i, ((batch, a), (_, b)) in enumerate(zip(source_runner.stream(source, names),
                                                emitted_runner.stream(source, names))):
        ua, ub = (_labelled_logits(batch, o, head, source) for o in (a, b))
        accs[0].update(ua, batch.labels)
        accs[1].update(ub, batch.labels)
        if i < max_batches:
            d, sc, ag, n = _logit_stats(ua, ub)
            stats = (max(stats[0], d), max(stats[1], sc), stats[2] + ag, stats[3] + n)
    return accs[0].result(), accs[1].result(), _comparison(*stats)


def _evaluate_dense(runner, head, source, label, ignore_index) -> Evaluation:
    from .data.labels import check_batch_labels, source_name
    from .selection.dense import dense_batch

    acc = DenseEvalAccumulator(head.n_classes, ignore_index)
    for batch, outputs in runner.stream(source, [head.features, head.logits], label=label):
        check_batch_labels(batch.labels, batch.indices, head.n_classes, source_name(source),
                           ignore_index=ignore_index)
        rows = dense_batch(outputs[head.features], outputs[head.logits], head, batch.labels,
                           ignore_index=ignore_index, where=source_name(source))
        acc.update(rows.U, rows.labels, rows.n_images)
    return acc.result()


def evaluate(model, head, source, *, providers=None, threads=None,
             label: str | None = None, ignore_index: int = IGNORE_INDEX) -> Evaluation | None:
    """Top-1 accuracy and loss of ``model`` on the labelled DataSource ``source``.

    ``model``: a ModelProto (the head's tensors are exposed on a copy), serialized bytes
    of one, or an :class:`OrtRunner` that already outputs ``head.features`` and
    ``head.logits``. Returns None when ``source`` is None; raises DataError on unlabelled
    data. ``ignore_index``: the label-map value of ignored pixels (per-position heads).
    Never modifies ``model``.
    """
    if source is None:
        return None
    if isinstance(model, OrtRunner):
        runner = model
    else:
        import onnx

        proto = model if isinstance(model, onnx.ModelProto) else onnx.load_from_string(model)
        runner = make_head_runner(proto, head, providers=providers, threads=threads)
    return evaluate_model(runner, head, source, label=label, ignore_index=ignore_index)
