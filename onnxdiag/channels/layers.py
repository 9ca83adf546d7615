"""Channel scores of every layer a statistics pass collected, with their permutation floor."""

from __future__ import annotations

from dataclasses import replace

import numpy as np


def score_collected(model, stats, structure, *, k_peers=10, ridge=1e-3, null_quantile=0.95):
    """(Layer, ChannelScores, PermutationFloor) per layer from collected moments."""
    from ..graph import GraphIndex
    from .scores import permutation_floor, score_layer

    index = GraphIndex(model)
    results = {}
    for name, lm in stats.layers.items():
        layer = structure.get_layer(name)
        weight = output_rows(layer, index.get_constant(layer.weight))
        mean_l, cov_l = lm.local_moments()
        cov_yy, cov_yt, var_t = lm.target_moments()
        params = dict(layer=name, weight=weight, n_images=lm.n_images, k_peers=k_peers,
                      ridge=ridge)
        if stats.task_samples == "match":
            scores = score_layer(cov_yy, cov_yt, var_t, mean_y=mean_l, **params)
        else:  # local axis from spatial samples, target axis from per-image means
            local = score_layer(cov_l, mean_y=mean_l, **params)
            target = score_layer(cov_yy, cov_yt, var_t, **params)
            scores = replace(local, scores={**target.scores, **local.scores})
        null_cov_yy, null_cov_yt, null_var = lm.target_moments(null=True)
        floor = permutation_floor(null_cov_yy, null_cov_yt, null_var, n_images=lm.n_images,
                                  quantile=null_quantile)
        results[name] = (layer, scores, floor)
    return results


def output_rows(layer, w) -> np.ndarray | None:
    """The weight as one row per output channel (a conv's flattened filter; a MatMul's
    or Gemm transB=0's column), float64; None when it is not a constant."""
    if w is None:
        return None
    w = np.asarray(w, np.float64)
    if layer.weight_layout == "io":
        return w.T.copy()
    return w.reshape(w.shape[0], -1)
