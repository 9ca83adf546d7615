"""METHODS §C3 allocations: the ERK table oracle, exact budgets, brute-force global / LAMP,
RR rules."""

from __future__ import annotations

import json

import numpy as np
import pytest

from onnxdiag.errors import OnnxDiagError
from onnxdiag.sparsity import (
    RULES,
    LayerInfo,
    RRCurves,
    allocate_sparsity,
    make_masks,
    prune_count,
)


def resnet18_cifar100() -> list[LayerInfo]:
    """CIFAR ResNet-18 of the METHODS §C3 table: 3×3 stem 3→64, 20 convs + fc 512→100."""
    c = LayerInfo.conv
    infos = [c("stem", 3, 64)] + [c(f"layer1.{i}", 64, 64) for i in range(4)]
    for stage, (cin, cout) in enumerate([(64, 128), (128, 256), (256, 512)], start=2):
        infos += [c(f"layer{stage}.0", cin, cout)]
        infos += [c(f"layer{stage}.{i}", cout, cout) for i in (1, 2, 3)]
        infos += [c(f"layer{stage}.proj", cin, cout, 1, is_projection=True)]
    return infos + [LayerInfo.linear("fc", 512, 100)]


# name: (density at S=0.90, density at S=0.95) from METHODS §C3
ERK_TABLE = {
    "stem": (1, 1), "layer1.0": (0.4611, 0.2200), "layer2.0": (0.3406, 0.1626),
    "layer2.1": (0.2254, 0.1076), "layer2.proj": (1, 1), "layer3.0": (0.1677, 0.0800),
    "layer3.1": (0.1114, 0.0532), "layer3.proj": (1, 0.7131), "layer4.0": (0.0832, 0.0397),
    "layer4.1": (0.0554, 0.0264), "layer4.proj": (0.7451, 0.3556), "fc": (1, 0.7235),
}


@pytest.mark.parametrize("col, S, eps", [(0, 0.90, 126.84), (1, 0.95, 60.53)])
def test_erk_reproduces_the_spec_table(col, S, eps):
    infos = resnet18_cifar100()
    assert len(infos) == 21 and sum(i.n_weights for i in infos) == 11_210_432
    alloc = allocate_sparsity("erk", infos, S)
    assert round(alloc.params["epsilon"], 2) == eps
    for name, dens in ERK_TABLE.items():
        assert round(alloc.params["density"][name], 4) == dens[col], name
        achieved = alloc.n_kept[name] / alloc.n_params[name]
        assert abs(achieved - alloc.params["density"][name]) <= 1 / alloc.n_params[name]
    assert alloc.n_pruned == prune_count(11_210_432, S)


def _random_layers(seed):
    rng = np.random.default_rng(seed)
    infos = [LayerInfo.conv("c0", 3, 8), LayerInfo.conv("c1", 8, 16),
             LayerInfo.conv("sc", 8, 16, 1, is_projection=True), LayerInfo.conv("c2", 16, 16),
             LayerInfo.linear("fc", 16, 5)]
    weights = {i.name: rng.normal(size=i.shape).astype(np.float32) for i in infos}
    return infos, weights


def _curves(infos, rr_fn=lambda i, s: 1 - 0.3 * s * (1 + i % 3)):
    grid = np.array([0, 0.25, 0.5, 0.75, 0.9, 0.99])
    rr = np.array([[rr_fn(i, s) for s in grid] for i in range(len(infos))])
    d_rep = np.cumsum(np.tile(grid, (len(infos), 1)), axis=1) * (1 + np.arange(len(infos)))[:, None]
    return RRCurves(tuple(i.name for i in infos), grid, d_rep / rr, d_rep, rr,
                    tuple(i.n_weights for i in infos), 8, (64,) * len(infos))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("S", [0.0, 0.5, 0.9, 0.95])
@pytest.mark.parametrize("keep", [(), ("fc",)])
def test_every_rule_meets_the_budget_to_the_weight(rule, S, keep):
    infos, weights = _random_layers(1)
    alloc = allocate_sparsity(rule, infos, S, weights=weights, rr_curves=_curves(infos),
                              keep_dense=keep)
    total = sum(i.n_weights for i in infos)
    assert alloc.n_weights == total and alloc.n_pruned == prune_count(total, S)
    assert sum(alloc.n_params[k] - alloc.n_kept[k] for k in alloc.layers) == alloc.n_pruned
    assert all(0 <= alloc.n_kept[k] <= alloc.n_params[k] for k in alloc.layers)
    assert all(alloc.sparsity[k] == 0 for k in keep)
    if rule.startswith("rr"):
        assert max(alloc.sparsity.values()) <= 0.99 + 1e-12
    json.dumps(alloc.to_dict())


def test_global_equals_one_threshold_with_the_tie_rule():
    infos, _ = _random_layers(2)
    rng = np.random.default_rng(3)
    weights = {i.name: rng.integers(-4, 5, size=i.shape).astype(np.float32) for i in infos}
    for S in (0.3, 0.77):
        masks = make_masks(allocate_sparsity("global", infos, S, weights=weights), weights)
        # brute force: order all weights by (|w|, later (layer, index) first), prune the first P
        mags = np.concatenate([np.abs(weights[i.name]).ravel() for i in infos])
        position = np.arange(mags.size)
        prune = np.lexsort((-position, mags))[:prune_count(mags.size, S)]
        expected = np.ones(mags.size, bool)
        expected[prune] = False
        got = np.concatenate([masks[i.name].ravel() for i in infos])
        np.testing.assert_array_equal(got, expected)


def test_lamp_equals_the_literal_definition():
    infos, weights = _random_layers(4)
    S = 0.8
    scores, owner = [], []
    for k, info in enumerate(infos):
        w2 = np.sort(weights[info.name].ravel().astype(np.float64) ** 2)
        for u in range(w2.size):
            scores.append(w2[u] / w2[u:].sum())
            owner.append(k)
    lowest = np.argsort(scores, kind="stable")[:prune_count(len(scores), S)]
    alloc = allocate_sparsity("lamp", infos, S, weights=weights)
    for k, info in enumerate(infos):
        assert alloc.n_params[info.name] - alloc.n_kept[info.name] == \
            int(np.sum(np.asarray(owner)[lowest] == k))
        assert alloc.n_kept[info.name] >= 1


def test_uniform_is_rebalanced_over_the_layers_not_kept_dense():
    infos, _ = _random_layers(0)
    alloc = allocate_sparsity("uniform", infos, 0.5, keep_dense=["c0"])
    n = {i.name: i.n_weights for i in infos}
    s_free = 0.5 * sum(n.values()) / (sum(n.values()) - n["c0"])
    for name in ("c1", "sc", "c2", "fc"):
        assert abs(alloc.sparsity[name] - s_free) <= 1 / n[name]


def test_erk_force_projection_fixes_shortcuts_at_S():
    infos = resnet18_cifar100()
    alloc = allocate_sparsity("erk", infos, 0.9, force_projection=True)
    for name in ("layer2.proj", "layer3.proj", "layer4.proj"):
        assert abs(alloc.sparsity[name] - 0.9) <= 1 / alloc.n_params[name]
    assert alloc.params["epsilon"] != pytest.approx(126.84, abs=0.01)


def test_rr_with_gamma_zero_gives_the_prior_back():
    infos, weights = _random_layers(5)
    for prior in ("erk", "lamp"):
        alloc = allocate_sparsity("rr", infos, 0.9, rr_curves=_curves(infos), weights=weights,
                                  prior=prior, gamma=0.0)
        assert alloc.prior.rule == prior
        for name in alloc.layers:
            assert abs(alloc.n_kept[name] - alloc.prior.n_kept[name]) <= 1


def test_rr_moves_sparsity_to_the_more_repairable_layers():
    infos, _ = _random_layers(6)
    curves = _curves(infos, lambda i, s: 0.2 if i == 1 else 1.0)  # c1 very repairable
    alloc = allocate_sparsity("rr", infos, 0.7, rr_curves=curves)
    prior = alloc.prior.sparsity
    assert alloc.sparsity["c1"] > prior["c1"]
    others = [n for n in alloc.layers if n != "c1" and prior[n] > 0]
    assert all(alloc.sparsity[n] <= prior[n] + 1e-9 for n in others)
    assert alloc.sparsity["c1"] <= 0.99
    m = alloc.params["m"]
    assert m["c1"] > 1 > m["c2"]


def test_rr_greedy_fills_the_lowest_rr_layer_to_the_cap_first():
    infos, _ = _random_layers(7)
    curves = _curves(infos, lambda i, s: 0.1 if i == 3 else 1.0 - 0.1 * s)
    alloc = allocate_sparsity("rr-greedy", infos, 0.7, rr_curves=curves)
    assert alloc.sparsity["c2"] == pytest.approx(0.99, abs=1 / alloc.n_params["c2"])
    alloc = allocate_sparsity("rr-marginal", infos, 0.5, rr_curves=curves, cap=0.8)
    assert max(alloc.sparsity.values()) <= 0.8


def test_allocation_user_errors():
    infos, weights = _random_layers(0)
    with pytest.raises(OnnxDiagError, match="Unknown allocation rule"):
        allocate_sparsity("random", infos, 0.5)
    with pytest.raises(OnnxDiagError, match="needs weights"):
        allocate_sparsity("lamp", infos, 0.5)
    with pytest.raises(OnnxDiagError, match="needs rr_curves"):
        allocate_sparsity("rr", infos, 0.5)
    with pytest.raises(OnnxDiagError, match="lack layer"):
        allocate_sparsity("rr", infos, 0.5, rr_curves=_curves(infos[:2]))
    with pytest.raises(OnnxDiagError, match="not prunable"):
        allocate_sparsity("erk", infos, 0.5, keep_dense=["nope"])
    with pytest.raises(OnnxDiagError, match="kept dense hold only"):
        allocate_sparsity("uniform", infos, 0.9, keep_dense=["c1", "c2", "sc"])
    with pytest.raises(OnnxDiagError, match="cap"):
        allocate_sparsity("rr", infos, 0.995, rr_curves=_curves(infos))


def test_lamp_at_its_limit_keeps_exactly_each_layers_largest_weight():
    infos, weights = _random_layers(7)
    n = sum(i.n_weights for i in infos)
    S = (n - len(infos)) / n  # the largest budget LAMP accepts: one weight left per layer
    S = float(f"{S + 1e-12:.12f}")  # a printable decimal just above (n - L) / n
    alloc = allocate_sparsity("lamp", infos, S, weights=weights)
    assert prune_count(n, S) == n - len(infos)
    masks = make_masks(alloc, weights)
    for info in infos:
        w = np.abs(weights[info.name])
        assert masks[info.name].sum() == 1 and masks[info.name].ravel()[w.argmax()]
