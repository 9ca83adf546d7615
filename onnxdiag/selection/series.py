"""METHODS §A3: checkpoint selection, early stopping, correlations, gaps.  Pure NumPy.

Series are in training order, one value per checkpoint (index 0 = first).  Our conventions:
- tail window: the last K checkpoints (K = 5, ``"all"`` for every one); flagged (degenerate)
  and non-finite checkpoints inside it are skipped, the window is not widened;
- ties: the later checkpoint wins (selection, oracle, early stopping's kept checkpoint);
- early stopping counts checkpoints since the last *strict* improvement, so a flat readout stops;
- accuracy is a fraction in [0, 1]; gaps are percentage points, oracle minus chosen;
- correlations use the unflagged checkpoints (those a readout may select);
- the oracle ignores flags (it is the best the labels allow); the random baseline is the mean
  accuracy over the unflagged checkpoints of the window;
- ``wrong_sign``: the Pearson r with accuracy (Spearman rho when r is undefined) has the sign
  opposite to the direction ("lower" needs r < 0, "higher" r > 0); context readouts never.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

from ..errors import DataError, OnnxDiagError
from .readouts import get_readout

DEFAULT_WINDOW = 5
DEFAULT_PATIENCE = 3
_SIGN = {"lower": -1.0, "higher": 1.0}


def _json_safe(obj):
    """asdict output with non-finite floats as None and NumPy scalars as builtins."""
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    return int(obj) if isinstance(obj, np.integer) else obj


def natural_sort_key(name) -> tuple:
    """Sort key where digit runs compare as numbers: ckpt_2 < ckpt_10; case-insensitive,
    the exact name breaks ties."""
    parts = re.split(r"(\d+)", str(name))
    return tuple((0, int(p)) if p.isdigit() else (1, p.lower()) for p in parts), str(name)


def _series(values, what: str, n: int | None = None) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64).reshape(-1)
    if n is not None and a.shape[0] != n:
        raise DataError(f"{what} has {a.shape[0]} values for {n} checkpoints; give one each.")
    return a


def _flag_mask(flagged, n: int) -> np.ndarray:
    """Boolean mask (n,) from None, a boolean sequence of length n, or checkpoint indices."""
    if flagged is None:
        return np.zeros(n, dtype=bool)
    f = np.asarray(list(flagged))
    if f.dtype == bool:
        if f.shape != (n,):
            raise DataError(f"flagged mask has {f.size} entries for {n} checkpoints.")
        return f
    mask = np.zeros(n, dtype=bool)
    if f.size:
        f = f.astype(np.int64)
        if f.min() < 0 or f.max() >= n:
            raise DataError(f"flagged indices must lie in [0, {n}); got {f.min()}..{f.max()}.")
        mask[f] = True
    return mask


def window_indices(n_checkpoints: int, window: int | str = DEFAULT_WINDOW) -> np.ndarray:
    """Indices of the tail window: the last ``window`` checkpoints, or all with "all"."""
    if window == "all":
        return np.arange(n_checkpoints)
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise OnnxDiagError(f"Invalid window {window!r}; give a positive integer or 'all'.")
    return np.arange(max(0, n_checkpoints - int(window)), n_checkpoints)


def _check_direction(direction: str) -> float:
    if direction not in _SIGN:
        raise OnnxDiagError(f"Cannot select by a {direction!r} readout; choose a readout whose "
                            "direction is 'lower' or 'higher'.")
    return _SIGN[direction]


def _best(scores: np.ndarray, candidates: np.ndarray) -> int | None:
    """Index in ``candidates`` of the highest finite score, the later one on ties."""
    ok = candidates[np.isfinite(scores[candidates])]
    if ok.size == 0:
        return None
    top = scores[ok].max()
    return int(ok[scores[ok] == top][-1])


def select_checkpoint(values: Sequence[float], direction: str, *,
                      window: int | str = DEFAULT_WINDOW, flagged=None) -> int:
    """k* = argmin ("lower") / argmax ("higher") over the tail window (METHODS §A3).

    ``flagged``: indices or a boolean mask of checkpoints never selected (degenerate).
    Ties go to the later checkpoint.  Raises OnnxDiagError when the window holds no
    finite, unflagged value.
    """
    sign = _check_direction(direction)
    v = _series(values, "values")
    idx = window_indices(v.size, window)
    best = _best(sign * v, idx[~_flag_mask(flagged, v.size)[idx]])
    if best is None:
        fix = ("Widen the window (--window all)." if idx.size < v.size else
               "Every checkpoint is: select needs trained ones (`onnxdiag readouts CKPT` "
               "shows why one is flagged, e.g. untrained or collapsed).")
        raise OnnxDiagError(f"No checkpoint to select among the last {idx.size}: all are flagged "
                            f"degenerate or not finite. {fix}")
    return best


@dataclass(frozen=True)
class EarlyStop:
    """Early stopping on a readout (METHODS §A3): where training would stop, what to keep.

    ``stopped_at`` is None when patience never ran out; ``best`` is None when no
    checkpoint was eligible.
    """

    stopped_at: int | None
    best: int | None
    patience: int


def early_stop(values: Sequence[float], direction: str, patience: int = DEFAULT_PATIENCE, *,
               flagged=None) -> EarlyStop:
    """Stop at the first checkpoint that ends ``patience`` consecutive checkpoints without a
    strict improvement; keep the best seen so far (later one on ties).  Flagged and
    non-finite checkpoints never improve and can never be kept."""
    sign = _check_direction(direction)
    if isinstance(patience, bool) or not isinstance(patience, (int, np.integer)) or patience < 1:
        raise OnnxDiagError(f"Invalid patience {patience!r}; give a positive integer.")
    scores = sign * _series(values, "values")
    eligible = np.isfinite(scores) & ~_flag_mask(flagged, scores.size)
    best, top, waited = None, -math.inf, 0
    for i, s in enumerate(scores):
        improved = bool(eligible[i]) and s > top
        if eligible[i] and s >= top:
            best, top = i, s
        waited = 0 if improved or best is None else waited + 1  # counts from the first eligible
        if waited >= patience:
            return EarlyStop(stopped_at=i, best=best, patience=int(patience))
    return EarlyStop(stopped_at=None, best=best, patience=int(patience))


@dataclass(frozen=True)
class Correlation:
    """Pearson r and Spearman rho over the finite pairs; nan with ``reason`` when undefined."""

    pearson: float
    pearson_p: float
    spearman: float
    spearman_p: float
    n: int
    reason: str = ""


def correlate_series(x: Sequence[float], y: Sequence[float]) -> Correlation:
    """Pearson r and Spearman rho (scipy) of two equally long series, non-finite pairs dropped.

    Fewer than 3 pairs or a constant series gives nan with a reason, never a warning.
    """
    x, y = _series(x, "x"), _series(y, "y", np.size(x))
    ok = np.isfinite(x) & np.isfinite(y)
    x, y, n = x[ok], y[ok], int(ok.sum())
    reason = ("fewer than 3 finite pairs" if n < 3 else "constant readout" if np.ptp(x) == 0
              else "constant reference" if np.ptp(y) == 0 else "")
    if reason:
        return Correlation(math.nan, math.nan, math.nan, math.nan, n, reason)
    r, rp = stats.pearsonr(x, y)
    rho, rhop = stats.spearmanr(x, y)
    return Correlation(float(r), float(rp), float(rho), float(rhop), n)


def _wrong_sign(corr: Correlation, direction: str) -> bool:
    value = corr.pearson if math.isfinite(corr.pearson) else corr.spearman
    return direction in _SIGN and math.isfinite(value) and value * _SIGN[direction] < 0


@dataclass(frozen=True)
class Pick:
    """A chosen checkpoint (None for the random baseline) with its accuracy and its gaps in
    percentage points to the oracle in the window and overall (negative when a pick outside
    the window, e.g. early stopping's, beats the window's oracle)."""

    index: int | None
    accuracy: float
    gap_window_pp: float
    gap_overall_pp: float


@dataclass(frozen=True)
class ReadoutSelection:
    """One readout over the checkpoints: its pick, early stop, correlations, sign check."""

    name: str
    direction: str
    selected: Pick | None
    early_stop: EarlyStop | None
    early_stop_pick: Pick | None
    vs_accuracy: Correlation
    vs_loss: Correlation | None
    wrong_sign: bool
    note: str = ""


@dataclass(frozen=True)
class SelectionReport:
    """METHODS §A3 evaluation against labelled data, with oracle and baselines."""

    n_checkpoints: int
    window: int | str
    patience: int
    window_indices: tuple[int, ...]
    flagged: tuple[int, ...]
    oracle_window: Pick
    oracle_overall: Pick
    last: Pick
    random: Pick
    readouts: dict[str, ReadoutSelection]

    @property
    def wrong_sign(self) -> list[str]:
        """Names of readouts whose correlation with accuracy has the wrong sign."""
        return [name for name, r in self.readouts.items() if r.wrong_sign]

    def to_dict(self) -> dict:
        """Builtins only; nan becomes None (JSON-safe)."""
        return _json_safe(asdict(self))


class _Scorer:
    """Accuracy-side context shared by every readout of one evaluation."""

    def __init__(self, accuracy: np.ndarray, idx: np.ndarray, flags: np.ndarray):
        self.acc, self.idx, self.flags = accuracy, idx, flags
        self.best_window = float(accuracy[idx].max())
        self.best_overall = float(accuracy.max())

    def pick(self, index: int | None, accuracy: float | None = None) -> Pick:
        a = float(self.acc[index]) if accuracy is None else float(accuracy)
        return Pick(index, a, 100.0 * (self.best_window - a), 100.0 * (self.best_overall - a))


def _accuracy(accuracy) -> np.ndarray:
    acc = _series(accuracy, "accuracy")
    if acc.size == 0 or not np.isfinite(acc).all() or acc.min() < 0 or acc.max() > 1:
        raise DataError(f"accuracy must be finite fractions in [0, 1] for every checkpoint; got "
                        f"{acc[:5].tolist()} (first 5). Divide percentages by 100.")
    return acc


def _evaluate_one(name: str, direction: str, values: np.ndarray, scorer: _Scorer,
                  loss: np.ndarray | None, window, patience: int) -> ReadoutSelection:
    values_ok = np.where(scorer.flags, np.nan, values)  # correlate what may be selected
    vs_acc = correlate_series(values_ok, scorer.acc)
    vs_loss = None if loss is None else correlate_series(values_ok, loss)
    if direction not in _SIGN:
        return ReadoutSelection(name, direction, None, None, None, vs_acc, vs_loss, False,
                                "context readout: reported, never used to select")
    flags = np.flatnonzero(scorer.flags)
    try:
        chosen, note = scorer.pick(select_checkpoint(values, direction, window=window,
                                                     flagged=flags)), ""
    except OnnxDiagError as err:
        chosen, note = None, str(err)
    stop = early_stop(values, direction, patience, flagged=flags)
    stop_pick = None if stop.best is None else scorer.pick(stop.best)
    return ReadoutSelection(name, direction, chosen, stop, stop_pick, vs_acc, vs_loss,
                            _wrong_sign(vs_acc, direction), note)


def evaluate_selection(readout_series: Mapping[str, Sequence[float]], accuracy: Sequence[float],
                       loss: Sequence[float] | None = None, *,
                       window: int | str = DEFAULT_WINDOW, patience: int = DEFAULT_PATIENCE,
                       flagged=None, directions: Mapping[str, str] | None = None
                       ) -> SelectionReport:
    """Score every readout's checkpoint choice against labelled accuracy (METHODS §A3).

    ``readout_series``: name -> one value per checkpoint; directions come from READOUTS,
    ``directions`` overrides or adds names.  ``accuracy`` fractions, ``loss`` optional.
    Baselines: ``last`` checkpoint and ``random`` (expected accuracy of a uniform draw among
    the window's unflagged checkpoints; the whole window when all are flagged).
    """
    acc = _accuracy(accuracy)
    T = acc.size
    loss_arr = None if loss is None else _series(loss, "loss", T)
    idx, flags = window_indices(T, window), _flag_mask(flagged, T)
    scorer = _Scorer(acc, idx, flags)
    pool = idx[~flags[idx]] if (~flags[idx]).any() else idx
    results = {}
    for name, values in readout_series.items():
        direction = (directions or {}).get(name) or get_readout(name).direction
        results[name] = _evaluate_one(name, direction, _series(values, name, T), scorer,
                                      loss_arr, window, patience)
    return SelectionReport(
        n_checkpoints=T, window=window, patience=int(patience),
        window_indices=tuple(int(i) for i in idx),
        flagged=tuple(int(i) for i in np.flatnonzero(flags)),
        oracle_window=scorer.pick(_best(acc, idx)),
        oracle_overall=scorer.pick(_best(acc, np.arange(T))),
        last=scorer.pick(T - 1), random=scorer.pick(None, acc[pool].mean()), readouts=results)


@dataclass(frozen=True)
class ModelRanking:
    """Screening a zoo: rank agreement of a readout with accuracy across models, next to the
    parameter-count baseline.  ``wrong_sign`` uses Spearman rho."""

    direction: str
    n_models: int
    spearman: float
    kendall: float
    pearson: float
    wrong_sign: bool
    baseline_spearman: float
    baseline_kendall: float
    reason: str = ""

    def to_dict(self) -> dict:
        """Builtins only; nan becomes None (JSON-safe)."""
        return _json_safe(asdict(self))


def _rank_stats(x: np.ndarray, y: np.ndarray) -> tuple[float, float, str]:
    corr = correlate_series(x, y)
    if corr.reason:
        return math.nan, math.nan, corr.reason
    ok = np.isfinite(x) & np.isfinite(y)
    return corr.spearman, float(stats.kendalltau(x[ok], y[ok]).statistic), ""


def rank_models(values: Sequence[float], accuracy: Sequence[float], direction: str, *,
                n_params: Iterable[float] | None = None) -> ModelRanking:
    """Spearman rho / Kendall tau of a readout vs accuracy across models (one value each),
    with the same for the parameter count when ``n_params`` is given (else nan).

    ``n_params``: what each model computes with, per use (Structure.n_params), not the
    stored initializers: a model whose exporter shared one initializer between equal
    layers is as large as the same model with distinct weights."""
    acc = _accuracy(accuracy)
    v = _series(values, "values", acc.size)
    rho, tau, reason = _rank_stats(v, acc)
    pearson = correlate_series(v, acc).pearson
    base = (math.nan, math.nan, "") if n_params is None else \
        _rank_stats(_series(list(n_params), "n_params", acc.size), acc)
    wrong = direction in _SIGN and math.isfinite(rho) and rho * _SIGN[direction] < 0
    return ModelRanking(direction, int(acc.size), rho, tau, pearson, wrong, base[0], base[1],
                        reason)
