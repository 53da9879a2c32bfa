"""Per-step routing: sampling, placement, token de-duplication (the synthetic load statistics
are tested with the other loads, tests/model/test_loads_and_placement_basics.py)."""

import numpy as np
import pytest

from epsim.model import load_model
from epsim.model.eplb import balance_placement
from epsim.model.graph_builder import prob_rank_hit
from epsim.model.loads import read_loads, synthetic_loads
from epsim.model.placement import Placement, contiguous_placement
from epsim.sim.step.routing import sample_routing, slot_frequencies

R1 = load_model("deepseek-r1")


def test_sample_conserves_pairs_and_groups_by_gpu():
    loads = synthetic_loads(R1)
    placement = balance_placement(loads, 8)
    rng = np.random.default_rng(3)
    s = sample_routing(R1, loads, placement, (256, 256), 8, rng)
    assert s.pairs.shape == (58, 2, 8, 8) and s.slot_pairs.shape == (58, 2, 256)
    # every rank sends exactly tokens * top_k pairs per layer and microbatch
    assert np.all(s.pairs.sum(axis=3) == 256 * 8)
    # a GPU's slots receive what the ranks sent to that GPU
    per_gpu = s.slot_pairs.reshape(58, 2, 8, 32).sum(axis=3)
    np.testing.assert_array_equal(per_gpu, s.gpu_pairs)
    # a token goes at most once to a GPU, and at least once somewhere per expert pair / k
    assert np.all(s.tokens <= 256 + 1e-9) and np.all(s.tokens.sum(axis=3) >= 256 - 1e-9)


def test_uniform_routing_dedup_matches_the_hypergeometric_hit_rate():
    loads = synthetic_loads(R1, "uniform")
    placement = contiguous_placement(61, 256, 8)
    s = sample_routing(R1, loads, placement, (4096,), 8, np.random.default_rng(0))
    expected = prob_rank_hit(256, 32, 8)  # 0.662
    assert s.tokens.mean() / 4096 == pytest.approx(expected, rel=0.02)
    assert s.imbalance().mean() < 1.03


def test_contiguous_placement_on_real_loads_is_about_2x_busier():
    real = read_loads("decode_in2000out100")
    rng = np.random.default_rng(0)
    cont = sample_routing(R1, real, contiguous_placement(61, 256, 8), (512,), 8, rng)
    bal = sample_routing(R1, real, balance_placement(real, 8), (512,), 8, rng)
    assert 1.7 <= cont.imbalance().mean() <= 2.1
    assert bal.imbalance().mean() < 1.1


def test_replicated_expert_shares_its_frequency_through_remap():
    # 1 layer, 3 logical experts on 4 slots (2 GPUs): expert 0 twice, on both GPUs
    placement = Placement(np.array([[0, 1, 0, 2]]), num_gpus=2, num_logical=3)
    freqs = np.array([[0.5, 0.3, 0.2]])
    p = slot_frequencies(freqs, placement, np.array([0]))
    np.testing.assert_allclose(p, [[0.25, 0.3, 0.25, 0.2]])


def _normal_split_by_arrays(total, probs, rng):
    """The normal-law split as whole-array numpy (what sim.step.routing._split_counts computed
    before its rounding moved into a compiled loop)."""
    mean = total[..., None] * probs
    y = np.sqrt(mean) * rng.standard_normal(mean.shape)
    counts = np.maximum(np.rint(mean + y - probs * y.sum(axis=-1, keepdims=True)), 0.0)
    hot = probs.argmax(axis=-1)[..., None]
    diff = total[..., None] - counts.sum(axis=-1, keepdims=True)
    np.put_along_axis(counts, hot, np.maximum(np.take_along_axis(counts, hot, -1) + diff, 0), -1)
    return counts


def test_normal_split_equals_the_array_expression_bit_for_bit():
    from epsim.sim.step.routing import NORMAL_SPLIT_MIN_MEAN, _split_counts

    g = np.random.default_rng(3)
    for trial in range(120):
        layers, gpus, slots = (int(v) for v in g.integers(1, [40, 9, 40]))
        probs = g.dirichlet(np.full(slots, g.uniform(0.05, 3.0)), size=(layers, gpus))
        if trial % 4 == 0 and slots >= 2:  # a tie for the likeliest slot: the first absorbs
            probs[..., 1] = probs[..., 0]
        low = int(NORMAL_SPLIT_MIN_MEAN * slots)
        total = g.integers(low, 50 * low + 1, size=(layers, gpus))
        want = _normal_split_by_arrays(total, probs, np.random.default_rng(trial))
        got = _split_counts(total, probs, np.random.default_rng(trial))
        assert np.array_equal(got, want)
        assert np.array_equal(np.signbit(got), np.signbit(want))  # zeros of the same sign
    # skewed shares clip slots at 0, and the likeliest slot still absorbs the rounding
    probs = np.array([[[0.97] + [0.001] * 30]])
    probs /= probs.sum()
    total = np.array([[496]])
    got = _split_counts(total, probs, np.random.default_rng(0))
    assert np.array_equal(got, _normal_split_by_arrays(total, probs, np.random.default_rng(0)))
    assert got.sum() == 496 and got.min() >= 0
