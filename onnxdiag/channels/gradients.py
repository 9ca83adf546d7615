"""Closed-form gradients of a layer's total channel information in its weights (§B4).

A layer computes y = W x (+ b) on input patches x (a conv's im2col patch, a linear
layer's input vector), W (n_channels, n_in).  From the streamed moments of the patches and
the target T (Σ_X = Cov(x), c = Cov(x, T), Var T; :mod:`onnxdiag.channels.inputs`) both
information axes of §B2–§B3 are functions of W alone:

    J_i = w_iᵀ Σ_X w_i                           (= Var y_i; the bias does not enter)
    F_X(W) = Σ_i I_X(i) = Σ_i ½ ln(1 + J_i / σ0²),  σ0² = max(median_j J_j, 1e-12)
    ρ_i = w_iᵀ c / (s_i s_T),  s_i = √max(J_i, 1e-12),  ρ_i clipped to ±0.999
    F_T(W) = Σ_i I(T;Y_i) = Σ_i −½ ln(1 − ρ_i²)

and their gradients follow without autograd:

    ∂F_X/∂w_i = 2 Σ_X w_i · (½ / (σ0² + J_i) + [i is a median channel] · ∂F_X/∂σ0² · μ_i)
    ∂F_X/∂σ0² = −½ Σ_j J_j / (σ0² (σ0² + J_j))      (μ_i: 1, or ½ each for an even count;
                                                       0 when the floor holds σ0²)
    ∂F_T/∂w_i = ρ_i / (1 − ρ_i²) · (c / (s_i s_T) − (w_iᵀ c) Σ_X w_i / (s_i³ s_T))
                                                      (0 where the clip holds ρ_i)

Both are exact derivatives of the quantities the channel scores report (the median's
index is fixed almost everywhere).  Pure NumPy; never modifies its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GUARD = 1e-12
SIGMA0_FLOOR = 1e-12
RHO_CLIP = 0.999


@dataclass(frozen=True, eq=False)
class InformationGradients:
    """F_X, F_T and their gradients (n_channels, n_in) at one W (module docstring);
    ``task`` values are None without target moments."""

    input_capture: float
    input_capture_grad: np.ndarray
    task_info: float | None
    task_info_grad: np.ndarray | None


def _sigma0(power: np.ndarray, floor: float) -> tuple[float, np.ndarray]:
    """σ0² = max(median J, floor) and ∂σ0²/∂J (n,)."""
    n = power.size
    order = np.argsort(power, kind="stable")
    weight = np.zeros(n)
    if n % 2:
        weight[order[n // 2]] = 1.0
    else:
        weight[order[n // 2 - 1:n // 2 + 1]] = 0.5
    median = float(np.median(power))
    return (median, weight) if median > floor else (floor, np.zeros(n))


def input_capture_total(W, cov_x, floor: float = SIGMA0_FLOOR) -> tuple[float, np.ndarray]:
    """(F_X, ∂F_X/∂W): Σ_i I_X(i) of the layer y = W x and its gradient (n_channels, n_in)."""
    W, cov_x = np.asarray(W, np.float64), np.asarray(cov_x, np.float64)
    sw = W @ cov_x  # rows: Σ_X w_i
    power = np.maximum(np.einsum("ij,ij->i", sw, W), 0.0)
    s0, d_s0 = _sigma0(power, floor)
    total = float(0.5 * np.log1p(power / s0).sum())
    d_s0_total = -0.5 * float(np.sum(power / (s0 * (s0 + power))))
    d_power = 0.5 / (s0 + power) + d_s0_total * d_s0
    return total, 2.0 * d_power[:, None] * sw


def task_info_total(W, cov_x, cov_xt, var_t: float, *, guard: float = GUARD,
                    rho_clip: float = RHO_CLIP) -> tuple[float, np.ndarray]:
    """(F_T, ∂F_T/∂W): Σ_i I(T;Y_i) of the layer y = W x and its gradient (n_channels, n_in)."""
    W, cov_x = np.asarray(W, np.float64), np.asarray(cov_x, np.float64)
    c = np.asarray(cov_xt, np.float64).reshape(-1)
    sw = W @ cov_x
    power = np.einsum("ij,ij->i", sw, W)
    live = power > guard
    s = np.sqrt(np.maximum(power, guard))
    s_t = float(np.sqrt(var_t))
    u = W @ c
    rho_raw = u / (s * s_t)
    rho = np.clip(rho_raw, -rho_clip, rho_clip)
    total = float(np.maximum(0.0, -0.5 * np.log1p(-rho ** 2)).sum())
    d_rho = c[None, :] / (s * s_t)[:, None] \
        - np.where(live, u / (s ** 3 * s_t), 0.0)[:, None] * sw
    scale = np.where(np.abs(rho_raw) < rho_clip, rho / (1.0 - rho ** 2), 0.0)
    return total, scale[:, None] * d_rho


def information_gradients(W, cov_x, cov_xt=None, var_t: float | None = None
                          ) -> InformationGradients:
    """Both totals and gradients at ``W`` (n_channels, n_in) from the input moments:
    ``cov_x`` (n_in, n_in), ``cov_xt`` (n_in,) and ``var_t`` (None: input capture only)."""
    fx, gx = input_capture_total(W, cov_x)
    if cov_xt is None:
        return InformationGradients(fx, gx, None, None)
    ft, gt = task_info_total(W, cov_x, cov_xt, var_t)
    return InformationGradients(fx, gx, ft, gt)


def cosine(a, b) -> float | None:
    """⟨a, b⟩ / (‖a‖ ‖b‖) of two equally shaped arrays; None when either is zero."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return None if na == 0 or nb == 0 else float(a @ b / (na * nb))
