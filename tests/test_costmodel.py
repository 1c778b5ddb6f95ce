import math

import numpy as np
import pytest
import torch

from drafttree.costmodel import (
    ConvexCost,
    VerifyCostModel,
    fit_convex_cost,
    fit_convex_cost_reference,
    profile_grid,
)
from drafttree.policies import build_best_first_tree, build_caddtree, caddtree_select, caddtree_select_reference
from drafttree.tree import best_first_nodes

# ---- convex fit --------------------------------------------------------------------------


def _is_monotone_convex(c: ConvexCost, tol=1e-9):
    s = np.array(c.slopes)
    return (s >= -tol).all() and (np.diff(s) >= -tol).all()


def test_convex_cost_evaluation_fast_matches_vectorised():
    c = ConvexCost((1, 4, 10, 20), (2.0, 2.0, 5.0, 12.0))
    xs = np.array([0, 0.5, 1, 2, 4, 7, 10, 15, 20, 25, 100])
    assert np.allclose([c(x) for x in xs], c.evaluate(xs))
    assert c(0) == 2.0  # constant below the first knot
    assert c(30) == pytest.approx(12.0 + 0.7 * 10)  # last slope continues
    assert ConvexCost((3,), (4.0,))(100) == 4.0


def test_convex_cost_rejects_bad_shapes():
    with pytest.raises(ValueError, match="convex"):
        ConvexCost((0, 1, 2), (0.0, 2.0, 3.0))
    with pytest.raises(ValueError, match="non-decreasing"):
        ConvexCost((0, 1), (1.0, 0.0))
    with pytest.raises(ValueError, match="increasing"):
        ConvexCost((0, 0), (1.0, 1.0))


def test_fit_reproduces_convex_data_exactly():
    n = np.array([1, 2, 4, 8, 16, 32, 64, 128])
    ms = 10 + np.maximum(0, n - 16) * 0.2
    fit = fit_convex_cost(n, ms)
    assert np.allclose(fit.evaluate(n), ms, atol=1e-8)


@pytest.mark.parametrize("seed", range(6))
def test_fit_matches_slsqp_reference_on_noisy_data(seed):
    rng = np.random.default_rng(seed)
    n = np.repeat([1, 2, 3, 5, 8, 13, 21, 34, 55, 89], 3)
    truth = 20 + 0.02 * n + 0.001 * n ** 2 + 3 * (n > 30)  # a step: not convex
    ms = truth + rng.normal(0, 0.5, n.size)
    fast, ref = fit_convex_cost(n, ms), fit_convex_cost_reference(n, ms)
    assert _is_monotone_convex(fast) and _is_monotone_convex(ref)
    sse = lambda c: float(np.sum((c.evaluate(n) - ms) ** 2))
    assert sse(fast) <= sse(ref) + 1e-6  # NNLS is the exact optimum; SLSQP can only tie it
    assert np.allclose(fast.values, ref.values, atol=0.05)


def test_fit_clamps_decreasing_data_and_validates():
    fit = fit_convex_cost([1, 2, 3, 4], [5.0, 4.0, 3.0, 2.0])
    assert _is_monotone_convex(fit)
    assert np.allclose(fit.values, 3.5)  # the best non-decreasing convex fit is the mean
    assert fit_convex_cost([8, 8, 8], [1.0, 2.0, 3.0])(100) == 2.0
    with pytest.raises(ValueError, match="as many"):
        fit_convex_cost([1, 2], [1.0])
    with pytest.raises(ValueError, match="finite"):
        fit_convex_cost([1, 2], [1.0, math.nan])
    with pytest.raises(ValueError, match=">= 0"):
        fit_convex_cost([-1, 2], [1.0, 2.0])


# ---- cost model -------------------------------------------------------------------------


def _model(draft_ms=2.0, slope=0.0):
    short = ConvexCost((1, 64, 256), (10.0, 10.0, 30.0))
    long = ConvexCost((1, 16, 128, 512), (20.0, 20.0, 40.0, 140.0))
    return VerifyCostModel([0, 1000], [short, long], draft_ms, slope)


def test_verify_ms_counts_the_root():
    m = _model()
    for nodes in [0, 5, 63, 64, 100, 300]:
        assert m.verify_ms(nodes, 0) == m.verify_curve(0)(nodes + 1)
        assert m.verify_ms(nodes, 0) == m.verify_ms_for_tokens(nodes + 1, 0)
    assert m.verify_ms(63, 0) == 10.0 and m.verify_ms(64, 0) > 10.0  # knee at 64 tokens = 63 nodes
    with pytest.raises(ValueError, match="num_nodes"):
        m.verify_ms(-1, 0)


def test_context_interpolation_is_linear_clamped_and_exact():
    m = _model(draft_ms=2.0, slope=0.01)
    for n in [1, 10, 50, 200, 700]:
        lo, hi = m.verify_ms_for_tokens(n, 0), m.verify_ms_for_tokens(n, 1000)
        assert m.verify_ms_for_tokens(n, 250) == pytest.approx(0.75 * lo + 0.25 * hi)
        assert m.verify_ms_for_tokens(n, -5) == lo and m.verify_ms_for_tokens(n, 5000) == hi
    assert _is_monotone_convex(m.verify_curve(400))
    assert m.draft_cost_ms(100) == pytest.approx(3.0)
    assert m.round_ms(10, 100) == pytest.approx(3.0 + m.verify_ms(10, 100))


def test_json_roundtrip_and_plot(tmp_path):
    m = _model(slope=0.001)
    m.measurements = {"token_counts": [1, 64, 256], "median_ms": {"0": [10, 10.5, 30], "1000": [20, 22, 61]}}
    m.save(tmp_path / "cost.json")
    again = VerifyCostModel.load(tmp_path / "cost.json")
    assert again.to_dict() == m.to_dict()
    m.plot(tmp_path / "cost.png")
    assert (tmp_path / "cost.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="format"):
        VerifyCostModel.from_dict({"format": "other"})


def test_profile_grid_takes_medians_and_fits():
    calls = []
    rng = np.random.default_rng(0)

    def measure(n_tokens, ctx):
        calls.append((n_tokens, ctx))
        noise = 50.0 if rng.random() < 0.1 else 0.0  # occasional outlier: medians should ignore it
        return 5 + ctx * 0.001 + 0.05 * max(0, n_tokens - 32) + noise

    m = profile_grid(measure, [1, 8, 32, 64, 128], [0, 2000], repeats=7, warmup=1,
                     draft_measure_fn=lambda ctx: 1.0 + ctx * 0.0005, progress=False)
    assert len(calls) == 2 * 5 * 8
    assert calls[0] == (1, 0) and calls[-1] == (128, 2000)  # context is the outer loop
    assert m.verify_ms_for_tokens(128, 2000) == pytest.approx(5 + 2 + 0.05 * 96, abs=0.05)
    assert m.verify_ms(31, 0) == pytest.approx(5, abs=0.05)
    assert m.draft_cost_ms(1000) == pytest.approx(1.5, abs=1e-6)
    with pytest.raises(ValueError, match="token_counts"):
        profile_grid(measure, [0, 4], [0], progress=False)


# ---- CaDDTree selection ----------------------------------------------------------------------


def _random_convex_model(rng, dense):
    # Geometric grids put the optimum on a knot (a kink); dense grids let it fall anywhere.
    n = np.arange(1, 513, 5) if dense else np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    curves = []
    for ctx_scale in (1.0, 2.0):
        knee = rng.integers(1, 200)
        ms = ctx_scale * (rng.uniform(5, 30) + rng.uniform(0.01, 0.3) * np.maximum(0, n - knee)
                          + rng.uniform(0, 1e-3) * n ** 2)
        curves.append(fit_convex_cost(n, ms))
    return VerifyCostModel([0, 4000], curves, float(rng.uniform(0.5, 10)), float(rng.uniform(0, 1e-3)))


@pytest.mark.parametrize("seed", range(12))
def test_greedy_stop_equals_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    scale = [0.5, 2.0, 5.0, 10.0][seed % 4]  # from flat to confident drafters
    marg = (torch.randn(15, 500, generator=g) * scale).log_softmax(-1)
    model = _random_convex_model(rng, dense=seed >= 6)
    ctx = int(rng.integers(0, 6000))
    all_nodes = list(best_first_nodes(marg, 400))
    sel = caddtree_select(iter(all_nodes), model, ctx, 400)
    best_n = caddtree_select_reference([math.exp(x.path_logprob) for x in all_nodes], model, ctx, 400)
    assert len(sel.nodes) == best_n
    assert sel.nodes == all_nodes[:best_n]  # the chosen tree is DDTree's tree at that budget
    assert sel.round_ms == pytest.approx(model.round_ms(best_n, ctx))
    phi = sum(math.exp(x.path_logprob) for x in sel.nodes)
    assert sel.expected_tokens == pytest.approx(1 + phi)


def test_flat_cost_adds_every_node_and_steep_cost_adds_none():
    marg = (torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3).log_softmax(-1)
    flat = VerifyCostModel([0], [ConvexCost((1,), (10.0,))], 1.0)
    assert len(caddtree_select(best_first_nodes(marg, 100), flat, 0, 100).nodes) == 100
    steep = VerifyCostModel([0], [ConvexCost((1, 2), (10.0, 1e6))], 1.0)
    sel = caddtree_select(best_first_nodes(marg, 100), steep, 0, 100)
    assert sel.nodes == [] and sel.expected_tokens == 1.0 and sel.round_ms == 11.0


def test_build_caddtree_and_errors():
    marg = (torch.randn(15, 300, generator=torch.Generator().manual_seed(2)) * 4).log_softmax(-1)
    model = VerifyCostModel([0], [ConvexCost((1, 32, 256), (10.0, 10.0, 40.0))], 3.0)
    tree, sel = build_caddtree(7, marg, model, 0, max_nodes=200)
    assert tree.num_draft_nodes == len(sel.nodes) > 0
    ref = build_best_first_tree(7, marg, len(sel.nodes))
    assert torch.equal(tree.tokens, ref.tokens) and torch.equal(tree.parents, ref.parents)
    root_only, _ = build_caddtree(7, marg, model, 0, max_nodes=0)
    assert root_only.num_nodes == 1
    with pytest.raises(ValueError, match="max_nodes"):
        caddtree_select(iter(()), model, 0, -1)
