"""Online recalibration of CaDDTree: the time regression, the acceptance scale, and the selection
with both corrections against brute force."""
import math

import numpy as np
import pytest
import torch

from drafttree.costmodel import ConvexCost, VerifyCostModel
from drafttree.policies import caddtree_select, caddtree_select_reference
from drafttree.recalibrate import RoundCalibrator
from drafttree.tree import best_first_nodes


def test_time_fit_recovers_scale_and_overhead():
    rng = np.random.default_rng(0)
    cal = RoundCalibrator()
    for _ in range(300):
        m = float(rng.uniform(15, 60))
        cal.observe_time(m, 1.3 * m + 4.0 + float(rng.normal(0, 0.3)))
    a, d = cal.time_fit
    assert a == pytest.approx(1.3, abs=0.05) and d == pytest.approx(4.0, abs=1.0)
    assert cal.overhead_ms == pytest.approx(d / a)


def test_uniform_slowdown_is_not_mistaken_for_overhead():
    cal = RoundCalibrator()
    for m in np.linspace(15, 60, 200):
        cal.observe_time(float(m), 1.5 * float(m))
    a, d = cal.time_fit
    assert a == pytest.approx(1.5, abs=0.02) and d < 0.5


def test_prior_holds_before_data_and_pauses_are_ignored():
    cal = RoundCalibrator()
    assert cal.time_fit == (1.0, 0.0) and cal.accept_scale == 1.0
    cal.observe_time(20.0, 5000.0)  # a pause, not a round
    assert cal.time_fit == (1.0, 0.0)


def test_acceptance_scale_tracks_overconfidence_and_is_bounded():
    cal = RoundCalibrator()
    for _ in range(200):
        cal.observe_acceptance(expected=3.0, accepted=1)
    assert cal.accept_scale == pytest.approx(1 / 3, rel=0.1)  # the prior (4 rounds at 1) keeps a little weight
    for _ in range(500):
        cal.observe_acceptance(expected=0.1, accepted=5)
    assert cal.accept_scale == 2.0


@pytest.mark.parametrize("seed", range(6))
def test_recalibrated_selection_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    marg = (torch.randn(15, 300, generator=g) * 3).log_softmax(-1)
    model = VerifyCostModel([0, 2000], [ConvexCost((1, 16, 128), (10.0, 13.0, 60.0)),
                                        ConvexCost((1, 16, 128), (14.0, 19.0, 90.0))], 3.0)
    overhead, scale = [0.0, 2.5, 12.0][seed % 3], [0.3, 1.0, 1.7][seed // 2]
    nodes = list(best_first_nodes(marg, 200))
    sel = caddtree_select(iter(nodes), model, 700, 200, overhead, scale)
    best = caddtree_select_reference([math.exp(n.path_logprob) for n in nodes], model, 700, 200, overhead, scale)
    assert len(sel.nodes) == best


def test_overhead_grows_and_distrust_shrinks_the_tree():
    marg = (torch.randn(15, 300, generator=torch.Generator().manual_seed(3)) * 3).log_softmax(-1)
    model = VerifyCostModel([0], [ConvexCost((1, 16, 128), (10.0, 13.0, 60.0))], 3.0)
    size = lambda o, s: len(caddtree_select(best_first_nodes(marg, 200), model, 0, 200, o, s).nodes)
    assert size(20.0, 1.0) >= size(0.0, 1.0) >= size(0.0, 0.3)
    assert size(20.0, 1.0) > size(0.0, 0.3)
