"""METHODS Part A: validation-free readouts from (Z, U, W, b, targets).  Pure NumPy.

Shapes: features Z (n_samples, n_features), logits U (n_samples, n_classes), head weight
W (n_classes, n_features), bias b (n_classes,).  Inputs are promoted to float64; trailing
singleton dims (a 1x1 Conv head's (n, D, 1, 1)) are flattened.  Streamed: one pass,
memory O(n_classes * n_features), never O(n_samples).

Our conventions where METHODS §A1 leaves them open:
- ``include_bias``: the norm of the whole head gradient sqrt(|G_W|^2 + |G_b|^2) (Z augmented
  with a column of ones); normalisers stay RMS |z_i| (``feature``) and |W|_F (``head``).
- ``expected`` targets: raw = sqrt(mean_i |z_i|^2 (1 - |P_i|^2)), the RMS per-sample gradient
  norm under y ~ P_i, normalised by the same RMS |z_i| / |W|_F.  Curvature (A2) equals
  raw_expected^2 without bias, so the two rank checkpoints identically.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import DataError, HeadNotFoundError, OnnxDiagError

EPS = 1e-12
VERIFY_RTOL = 1e-4
TARGETS = ("labels", "pseudo", "expected")
NORMS = ("raw", "feature", "head")
HEAD_GRAD_NAMES = {"raw": "head_grad", "feature": "head_grad_feature", "head": "head_grad_head"}
_NAME_HEAD = "Name the head with --head NODE or the features with --features TENSOR."


@dataclass(frozen=True)
class ReadoutSpec:
    """One row of the METHODS §A2 table: direction is "lower", "higher" or "context"."""

    name: str
    direction: str
    needs_labels: bool
    definition: str


READOUTS: dict[str, ReadoutSpec] = {s.name: s for s in (
    ReadoutSpec("head_grad", "lower", False, "|G_W|_F (A1 raw; labels targets need labels)"),
    ReadoutSpec("head_grad_feature", "lower", False, "|G_W|_F / (RMS |z_i| + eps)"),
    ReadoutSpec("head_grad_head", "lower", False, "|G_W|_F / (|W|_F + eps)"),
    ReadoutSpec("loss", "lower", True, "-mean_i log P_{i,y_i}"),
    ReadoutSpec("confidence", "higher", False, "mean_i max_k P_ik"),
    ReadoutSpec("entropy", "lower", False, "mean_i -sum_k P_ik log P_ik"),
    ReadoutSpec("prob_margin", "higher", False, "mean_i (P_(1) - P_(2))"),
    ReadoutSpec("logit_margin", "higher", True, "mean_i (U_{i,y_i} - max_{k!=y_i} U_ik)"),
    ReadoutSpec("curvature", "lower", False, "mean_i |z_i|^2 sum_k P_ik (1 - P_ik)"),
    ReadoutSpec("n_params", "context", False, "parameter count (given by the caller)"),
    ReadoutSpec("weight_norm", "context", False, "|W|_F"),
)}


def get_readout(name: str) -> ReadoutSpec:
    """Return the A2 table row for ``name``; raise OnnxDiagError listing the known names."""
    if name not in READOUTS:
        raise OnnxDiagError(f"Unknown readout {name!r}; known: {', '.join(READOUTS)}.")
    return READOUTS[name]


@dataclass(frozen=True)
class DegenerateRule:
    """When a checkpoint is degenerate and must never be selected (our default thresholds).

    The trap at initialisation: features barely depend on the input, so the head
    gradient is tiny and an argmin would pick an untrained model.  A checkpoint is
    degenerate when any of these holds (diagnostics from the same pass):
    - ``feature_spread`` = total variance of Z over samples / mean |z_i|^2 (in [0, 1])
      is below ``min_feature_spread``: features hardly depend on the input;
    - ``modal_fraction`` (share of samples predicted as the most frequent class) is at
      least ``max_modal_fraction`` while the labels, when known, are not that
      concentrated (without labels only when n_samples >= ``min_samples``): collapse;
    - ``confidence_excess`` = (confidence - 1/C) / (1 - 1/C) is below
      ``min_confidence_excess``: predictions are indistinguishable from uniform.
    """

    min_feature_spread: float = 1e-2
    max_modal_fraction: float = 0.95
    min_confidence_excess: float = 1e-2
    min_samples: int = 20

    def find_reasons(self, diagnostics: dict[str, float], n_samples: int) -> tuple[str, ...]:
        """Return one short reason per rule that fires (empty when not degenerate)."""
        d = diagnostics
        label_mf = d.get("label_modal_fraction")
        collapse = (d["modal_fraction"] >= self.max_modal_fraction
                    and (n_samples >= self.min_samples if label_mf is None
                         else label_mf < self.max_modal_fraction))
        checks = (("feature_spread", "<", self.min_feature_spread,
                   d["feature_spread"] < self.min_feature_spread),
                  ("modal_fraction", ">=", self.max_modal_fraction, collapse),
                  ("confidence_excess", "<", self.min_confidence_excess,
                   d["confidence_excess"] < self.min_confidence_excess))
        return tuple(f"{key} {d[key]:.3g} {op} {limit:g}" for key, op, limit, fires in checks
                     if fires)


@dataclass(frozen=True)
class Readouts:
    """All A2 readouts of one checkpoint on one probe batch.

    ``values`` maps readout names (keys of READOUTS) to floats; label-only readouts are
    absent without labels, ``n_params`` without a count.  ``norm`` names the head-gradient
    variant used to select (``head_grad`` property).
    """

    values: dict[str, float]
    n_samples: int
    n_classes: int
    n_features: int
    targets: str
    norm: str
    include_bias: bool
    degenerate: bool
    degenerate_reasons: tuple[str, ...] = ()
    diagnostics: dict[str, float] = field(default_factory=dict)

    @property
    def head_grad(self) -> float:
        """The head-gradient value of the selected ``norm`` variant."""
        return self.values[HEAD_GRAD_NAMES[self.norm]]

    def to_dict(self) -> dict:
        """Builtins only (all values are finite floats): JSON-safe."""
        return asdict(self)


def log_softmax(U: np.ndarray) -> np.ndarray:
    """Row-wise stable log-softmax of logits (n_samples, n_classes), float64."""
    U = np.asarray(U, dtype=np.float64)
    shifted = U - U.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def softmax(U: np.ndarray) -> np.ndarray:
    """Row-wise stable softmax of logits (n_samples, n_classes), float64."""
    return np.exp(log_softmax(U))


def _flat(x) -> np.ndarray:
    """float64 array with trailing dims flattened: (n, D, 1, 1) -> (n, D)."""
    a = np.asarray(x, dtype=np.float64)
    return a.reshape(a.shape[0], -1) if a.ndim > 2 else a


def _as_rows(x, what: str, n_cols: int | None = None) -> np.ndarray:
    """float64 (n, n_cols) view of ``x``, finite values only; DataError otherwise."""
    a = _flat(x)
    if a.ndim != 2 or (n_cols is not None and a.shape[1] != n_cols):
        raise DataError(f"{what} has shape {np.shape(x)}, expected (n_samples, "
                        f"{n_cols or 'n'}). {_NAME_HEAD}")
    if not np.isfinite(a).all():
        raise DataError(f"{what} contains NaN or inf ({int((~np.isfinite(a)).sum())} values); "
                        "check the model and the input preprocessing.")
    return a


def _check_labels(labels, n_samples: int, n_classes: int) -> np.ndarray:
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    bad = y[~np.isin(y, np.arange(n_classes))]
    if y.shape[0] != n_samples or bad.size:
        raise DataError(f"labels must be {n_samples} integer classes in [0, {n_classes}); got "
                        f"{y.shape[0]} labels, {bad.size} invalid (first: {bad[:3].tolist()}).")
    return y.astype(np.int64)


def _residual(U: np.ndarray, targets: str, labels) -> np.ndarray:
    """E = softmax(U) - Y (n_samples, n_classes), Y one-hot of ``labels`` | ``pseudo`` (A1)."""
    E = softmax(U)
    n, C = E.shape
    if targets == "labels":
        if labels is None:
            raise DataError("targets='labels' needs labels for the probe batch; "
                            "give labels or use --targets pseudo|expected.")
        idx = _check_labels(labels, n, C)
    elif targets == "pseudo":
        idx = np.asarray(U).argmax(axis=1)
    else:
        raise OnnxDiagError(f"targets {targets!r} has no one-hot Y; use one of labels, pseudo.")
    E[np.arange(n), idx] -= 1.0
    return E


def _check_choice(value: str, choices: tuple[str, ...], what: str) -> None:
    if value not in choices:
        raise OnnxDiagError(f"Unknown {what} {value!r}; use one of {', '.join(choices)}.")


def _spread_factor(logp: np.ndarray) -> np.ndarray:
    """1 - |P_i|^2 = sum_k P_ik (1 - P_ik), with 1 - P = -expm1(log P) (no cancellation)."""
    return (np.exp(logp) * -np.expm1(logp)).sum(axis=1)


def head_gradient_matrices(Z, U, targets: str, *, labels=None) -> tuple[np.ndarray, np.ndarray]:
    """Closed-form G_W = (1/B) E^T Z (n_classes, n_features) and G_b = mean_i E_i (METHODS §A1).

    E = softmax(U) - Y with Y from ``labels`` or ``pseudo`` targets; features detached.
    """
    Z, U = _as_rows(Z, "features Z"), _as_rows(U, "logits U")
    E = _residual(U, targets, labels)
    return E.T @ Z / Z.shape[0], E.mean(axis=0)


def use_gram(n_samples: int, n_classes: int, n_features: int) -> bool:
    """Gram rule: use the B x B form when its flop count B^2 (C + D) is below B C D,
    i.e. B (C + D) < C D.  Then B < min(C, D), so its B^2 memory never exceeds C D."""
    return n_samples * (n_classes + n_features) < n_classes * n_features


def _normalised(raw: float, feature_rms: float, weight_norm: float) -> dict[str, float]:
    return {HEAD_GRAD_NAMES["raw"]: raw,
            HEAD_GRAD_NAMES["feature"]: raw / (feature_rms + EPS),
            HEAD_GRAD_NAMES["head"]: raw / (weight_norm + EPS)}


def head_gradient(Z, U, W, targets: str, *, labels=None, include_bias: bool = False,
                  gram: bool | None = None) -> dict[str, float]:
    """Head-gradient norms of METHODS §A1 on one batch, without autograd.

    Args: Z (n_samples, n_features), U (n_samples, n_classes), W (n_classes, n_features),
    ``targets`` in labels | pseudo | expected, ``labels`` (n_samples,) ints.
    ``gram``: None applies :func:`use_gram`; True/False forces
    |G_W|^2 = (1/B^2) sum((E E^T) * (Z Z^T)) or the direct (1/B) E^T Z.
    Returns {"head_grad", "head_grad_feature", "head_grad_head"} (module docstring
    for ``expected`` and ``include_bias``).  Raises DataError, OnnxDiagError.
    """
    _check_choice(targets, TARGETS, "targets")
    W = np.asarray(W, dtype=np.float64)
    Z, U = _as_rows(Z, "features Z", W.shape[1]), _as_rows(U, "logits U", W.shape[0])
    n = Z.shape[0]
    if n == 0 or U.shape[0] != n:
        raise DataError(f"features have {n} rows and logits {U.shape[0]}; need the same n > 0.")
    sq_norms = np.einsum("ij,ij->i", Z, Z)
    if targets == "expected":
        raw_sq = np.mean((sq_norms + include_bias) * _spread_factor(log_softmax(U)))
    else:
        E = _residual(U, targets, labels)
        if use_gram(n, *W.shape) if gram is None else gram:
            raw_sq = np.sum((E @ E.T) * (Z @ Z.T + include_bias)) / n**2
        else:
            raw_sq = np.sum((E.T @ Z / n) ** 2) + include_bias * np.sum(E.mean(axis=0) ** 2)
    rms = math.sqrt(sq_norms.mean())
    return _normalised(math.sqrt(max(raw_sq, 0.0)), rms, float(np.linalg.norm(W)))


def verify_head(Z, U, W, b=None, *, rtol: float = VERIFY_RTOL, node_name: str | None = None
                ) -> float:
    """Relative error |Z W^T + b - U|_F / (|U|_F + eps) of the recomputed logits (METHODS §A1).

    Returns the error; raises HeadNotFoundError naming ``node_name`` when it exceeds
    ``rtol`` or the shapes do not fit.
    """
    head = f"Head {node_name!r}" if node_name else "The head"
    W, Zr, Ur = np.asarray(W, dtype=np.float64), _flat(Z), _flat(U)
    if W.ndim != 2 or Zr.ndim != 2 or Ur.ndim != 2 or Zr.shape[1] != W.shape[1] \
            or Ur.shape != (Zr.shape[0], W.shape[0]):
        raise HeadNotFoundError(f"{head} does not fit: features {np.shape(Z)}, weight {W.shape}, "
                                f"logits {np.shape(U)}. {_NAME_HEAD}")
    recomputed = Zr @ W.T + (0.0 if b is None else np.asarray(b, dtype=np.float64).reshape(-1))
    err = float(np.linalg.norm(recomputed - Ur) / (np.linalg.norm(Ur) + EPS))
    if not err <= rtol:
        raise HeadNotFoundError(f"{head} does not reproduce the model's logits: relative error "
                                f"{err:.3g} > {rtol:g}. {_NAME_HEAD}")
    return err


def _per_sample(Z: np.ndarray, U: np.ndarray, y: np.ndarray | None) -> dict[str, np.ndarray]:
    """Per-sample quantities whose batch means are the A2 readouts."""
    logp = log_softmax(U)
    P = np.exp(logp)  # P log P -> 0 where P underflows: log P stays finite
    top2 = np.partition(P, P.shape[1] - 2, axis=1)[:, -2:]
    sq_norm = np.einsum("ij,ij->i", Z, Z)
    spread = _spread_factor(logp)
    out = {"sq_norm": sq_norm, "spread": spread, "curvature": sq_norm * spread,
           "confidence": top2[:, 1], "entropy": -(P * logp).sum(axis=1),
           "prob_margin": top2[:, 1] - top2[:, 0]}
    if y is not None:
        rows, others = np.arange(U.shape[0]), U.copy()
        others[rows, y] = -np.inf
        out["loss"] = -logp[rows, y]
        out["logit_margin"] = U[rows, y] - others.max(axis=1)
    return out


class ReadoutAccumulator:
    """Streams ORT batches into every A2 readout; exact for any batch split (ARCHITECTURE
    invariant 5).

    Accumulates E^T Z (n_classes, n_features), sum_i E_i, sums of per-sample
    quantities, sum_i z_i, sum_i |z_i|^2, prediction/label counts and n: memory
    O(n_classes * n_features), independent of n_samples.  ``W`` (n_classes, n_features),
    ``b`` (n_classes,) or None; ``n_params`` (the model's count) is reported when given.
    """

    def __init__(self, W, b=None, *, targets: str, include_bias: bool = False,
                 n_classes: int | None = None, norm: str = "feature",
                 n_params: int | None = None, rule: DegenerateRule | None = None):
        _check_choice(targets, TARGETS, "targets")
        _check_choice(norm, NORMS, "norm")
        self.W = np.asarray(W, dtype=np.float64)
        if self.W.ndim != 2 or self.W.shape[0] < 2:
            raise HeadNotFoundError(f"Head weight has shape {self.W.shape}; need (n_classes >= 2,"
                                    f" n_features). {_NAME_HEAD}")
        C, D = self.W.shape
        if n_classes is not None and n_classes != C:
            raise HeadNotFoundError(f"Head weight has {C} rows but the model has {n_classes} "
                                    f"classes. {_NAME_HEAD}")
        self.b = None if b is None else np.asarray(b, dtype=np.float64).reshape(-1)
        self.targets, self.include_bias, self.norm = targets, bool(include_bias), norm
        self.n_params, self.rule = n_params, rule or DegenerateRule()
        self._gz, self._ge = (None if targets == "expected" else np.zeros((C, D))), np.zeros(C)
        self._sums: dict[str, float] = {}  # per-sample quantity -> running sum
        self._sum_z = np.zeros(D)
        self._pred_counts, self._label_counts = np.zeros((2, C), dtype=np.int64)
        self._has_labels: bool | None = None  # None until the first batch
        self.n_samples = 0

    def update(self, Z, U, labels=None) -> None:
        """Fold one batch: Z (n, n_features), U (n, n_classes) logits, labels (n,) or None
        (given for every batch or for none; DataError otherwise)."""
        C, D = self.W.shape
        Z, U = _as_rows(Z, "features Z", D), _as_rows(U, "logits U", C)
        if Z.shape[0] != U.shape[0]:
            raise DataError(f"features have {Z.shape[0]} rows but logits {U.shape[0]}; "
                            "both must come from the same batch.")
        if self._has_labels is not None and self._has_labels != (labels is not None):
            raise DataError("labels were given for some batches but not others; "
                            "give labels for every batch or for none.")
        y = None if labels is None else _check_labels(labels, Z.shape[0], C)
        if self._gz is not None:  # validate targets before any state changes
            E = _residual(U, self.targets, y)
            self._gz += E.T @ Z
            self._ge += E.sum(axis=0)
        self._has_labels = labels is not None
        for key, arr in _per_sample(Z, U, y).items():
            self._sums[key] = self._sums.get(key, 0.0) + float(arr.sum())
        self._sum_z += Z.sum(axis=0)
        self._pred_counts += np.bincount(U.argmax(axis=1), minlength=C)
        if y is not None:
            self._label_counts += np.bincount(y, minlength=C)
        self.n_samples += Z.shape[0]

    def _raw_head_grad(self) -> float:
        n, s = self.n_samples, self._sums
        if self._gz is None:  # expected targets: E_y |g_i|^2 = (|z_i|^2 + bias) (1 - |P_i|^2)
            return math.sqrt((s["curvature"] + self.include_bias * s["spread"]) / n)
        sq = np.sum((self._gz / n) ** 2) + self.include_bias * np.sum((self._ge / n) ** 2)
        return math.sqrt(float(sq))

    def _diagnostics(self) -> dict[str, float]:
        n, C = self.n_samples, self.W.shape[0]
        mean_sq = self._sums["sq_norm"] / n
        centre_sq = float(np.sum((self._sum_z / n) ** 2))
        spread = (mean_sq - centre_sq) / mean_sq if mean_sq > 0 else 0.0
        excess = (self._sums["confidence"] / n - 1.0 / C) / (1.0 - 1.0 / C)
        diag = {"feature_spread": min(max(spread, 0.0), 1.0),
                "feature_rms": math.sqrt(mean_sq),
                "modal_fraction": float(self._pred_counts.max() / n),
                "confidence_excess": excess}
        if self._has_labels:
            diag["label_modal_fraction"] = float(self._label_counts.max() / n)
        return diag

    def result(self) -> Readouts:
        """Finalise every readout (as on the concatenated batches); state is kept."""
        n = self.n_samples
        if n == 0:
            raise DataError("No samples reached the readouts; check the probe data.")
        mean = {k: v / n for k, v in self._sums.items()}
        diag = self._diagnostics()
        weight_norm = float(np.linalg.norm(self.W))
        values = _normalised(self._raw_head_grad(), diag["feature_rms"], weight_norm)
        names = ["confidence", "entropy", "prob_margin", "curvature"]
        names += ["loss", "logit_margin"] if self._has_labels else []
        values.update({k: mean[k] for k in names})
        values["weight_norm"] = weight_norm
        if self.n_params is not None:
            values["n_params"] = float(self.n_params)
        reasons = self.rule.find_reasons(diag, n)
        C, D = self.W.shape
        return Readouts(values=values, n_samples=n, n_classes=C, n_features=D,
                        targets=self.targets, norm=self.norm, include_bias=self.include_bias,
                        degenerate=bool(reasons), degenerate_reasons=reasons, diagnostics=diag)


def compute_readouts(Z, U, W, b=None, *, targets: str, labels=None, include_bias: bool = False,
                     norm: str = "feature", n_params: int | None = None,
                     rule: DegenerateRule | None = None) -> Readouts:
    """All A2 readouts of one in-memory batch: a ReadoutAccumulator fed once."""
    acc = ReadoutAccumulator(W, b, targets=targets, include_bias=include_bias, norm=norm,
                             n_params=n_params, rule=rule)
    acc.update(Z, U, labels)
    return acc.result()
