"""One pass over a probe batch: head check, readouts and (with labels) evaluation.

A per-position head (docs/METHODS.md §A4) feeds the readouts one row per position
(:mod:`onnxdiag.selection.dense`), ignore-index rows dropped when the probe has label
maps; its evaluation adds mean IoU."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..data.labels import IGNORE_INDEX
from ..errors import DataError
from ..evaluate import Evaluation, evaluate, head_arrays, make_head_runner
from ..graph.dense import class_axis, position_grid
from ..graph.verify import verify_head_on
from ..runtime.runner import OrtRunner, single_threaded_blas
from .dense import DenseCounts, dense_batch
from .readouts import ReadoutAccumulator, Readouts

#: ``--targets auto``: true labels when the probe data has them, else pseudo-labels.
TARGET_CHOICES = ("auto", "labels", "pseudo", "expected")


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
class ProbeResult:
    """Readouts of one model on one probe batch, the head check, optional evaluation.

    ``head_rel_error``: |Z Wᵀ + b − U|_F / |U|_F on the first batch; ``head_relation``:
    the verified output = relation(U) ("identity", "softmax", …; None when the head reaches
    no output) and ``head_relation_error`` its relative error, both ≤ 1e-4 (§A1).
    ``dense``: for a per-position head, its rows (:class:`~onnxdiag.selection.dense.DenseCounts`
    as a dict); None otherwise.
    """

    readouts: Readouts
    head_node: str
    head_rel_error: float
    evaluation: Evaluation | None = None
    data: dict = field(default_factory=dict)
    head_relation: str | None = None
    head_relation_error: float | None = None
    dense: dict | None = None

    def to_dict(self) -> dict:
        """Builtins; ``dense`` only for a per-position head."""
        out = {"head_node": self.head_node, "head_rel_error": self.head_rel_error,
               "head_relation": self.head_relation,
               "head_relation_error": self.head_relation_error,
               "readouts": self.readouts.to_dict(),
               "evaluation": None if self.evaluation is None else self.evaluation.to_dict(),
               "data": self.data}
        return out if self.dense is None else {**out, "dense": self.dense}


def probe_model(model, structure, probe, *, eval_source=None, targets: str = "auto",
                norm: str = "feature", include_bias: bool = False, providers=None,
                threads=None, runner: OrtRunner | None = None, label: str | None = None,
                ignore_index: int = IGNORE_INDEX) -> ProbeResult:
    """Readouts of ``model`` on the DataSource ``probe`` (and accuracy on ``eval_source``).

    The head is verified on the first batch (:func:`onnxdiag.graph.verify.verify_head_on`:
    Z Wᵀ + b ≈ U and output = relation(U), relative errors ≤ 1e-4); HeadNotFoundError with
    the measured mismatch otherwise.  ``ignore_index``: the label-map value of ignored
    positions (per-position heads, §A4).  Never modifies ``model``.
    """
    head = structure.head
    runner = runner or make_head_runner(model, head, providers=providers, threads=threads)
    targets = resolve_targets(targets, probe.has_labels)
    acc = ReadoutAccumulator(head.weight, head.bias, targets=targets, include_bias=include_bias,
                             norm=norm, n_params=structure.n_params)
    counts = DenseCounts(ignore_index) if head.features_reduce == "positions" else None
    checked = None
    names = [head.features, head.logits]
    names += [n for n in (head.scores,) if n and n in runner.output_names and n not in names]
    with single_threaded_blas():  # small per-batch products between ORT runs
        for batch, outputs in runner.stream(probe, names, label=label):
            if checked is None:
                checked = verify_head_on(model, head, batch.feeds, providers=providers,
                                         values=outputs)
            labels = batch.labels if targets == "labels" or probe.has_labels else None
            acc.update(*_rows(outputs, head, labels, counts))
        evaluation = evaluate(runner, head, eval_source, ignore_index=ignore_index)
    return ProbeResult(readouts=acc.result(), head_node=head.node_name,
                       head_rel_error=float(checked.rel_error if checked else 0.0),
                       evaluation=evaluation, data=probe.describe(),
                       head_relation=checked.relation if checked and checked.output else None,
                       head_relation_error=checked.relation_error if checked else None,
                       dense=None if counts is None else counts.to_dict())


def _rows(outputs: dict, head, labels, counts: DenseCounts | None) -> tuple:
    """(Z, U, labels) of one batch for the accumulator: the head's arrays, or one row per
    position (ignore-index rows dropped) for a per-position head."""
    if counts is None:
        return (*head_arrays(outputs, head), labels)
    rows = dense_batch(outputs[head.features], outputs[head.logits], head, labels,
                       ignore_index=counts.ignore_index, where="the probe labels")
    counts.add(rows, position_grid(outputs[head.logits], class_axis(head.op_type)))
    return rows.Z, rows.U, rows.labels
