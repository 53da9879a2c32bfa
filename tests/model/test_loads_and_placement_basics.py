import json

import numpy as np
import pytest

from epsim.model import EpsimError, load_model
from epsim.model.eplb import balance_placement
from epsim.model.loads import (
    frequencies,
    hottest_to_mean,
    moe_layer_rows,
    read_loads,
    shipped_loads,
    synthetic_loads,
)
from epsim.model.placement import Placement, contiguous_placement, read_placement, remap

R1 = load_model("deepseek-r1")


def test_shipped_loads_contiguous_imbalance():
    assert shipped_loads() == ["decode_in1000out1000", "decode_in2000out100", "prefill_in2048",
                               "prefill_in4096"]
    for path in shipped_loads():
        loads = read_loads(path)
        assert loads.shape == (61, 256)
        assert list(moe_layer_rows(loads)) == list(range(3, 61))
        imb = contiguous_placement(61, 256, 8).imbalance(loads)[3:]
        # the data README: the busiest of 8 GPUs carries about 1.7-2.1x the mean
        assert 1.6 < np.mean(imb) < 2.2, path.name
        np.testing.assert_allclose(frequencies(loads)[3:].sum(axis=1), 1.0)


def test_synthetic_loads_match_the_real_deepseek_statistics():
    syn = synthetic_loads(R1)
    real = read_loads("decode_in2000out100")
    assert syn.shape == real.shape == (61, 256)
    assert np.all(syn[:3] == 0) and np.all(syn[3:] > 0)
    # hottest / mean expert: real 5.6-8.1 over the four files; synthetic 5.85
    assert 5.0 <= hottest_to_mean(syn) <= 8.0
    assert hottest_to_mean(real) == pytest.approx(6.07, abs=0.01)
    contiguous = contiguous_placement(61, 256, 8)
    syn_imb = np.nanmean(contiguous.imbalance(syn))
    real_imb = np.nanmean(contiguous.imbalance(real))
    assert 1.7 <= syn_imb <= 2.1 and 1.7 <= real_imb <= 2.1
    # balancing removes nearly all of it
    assert np.nanmean(balance_placement(syn, 8).imbalance(syn)) < 1.05
    # uniform: every expert equal
    uni = synthetic_loads(R1, "uniform")
    assert hottest_to_mean(uni) == pytest.approx(1.0)


@pytest.mark.parametrize("content, message", [
    ("{", "malformed JSON"),
    ('{"counts": []}', "logical_count"),
    ('{"logical_count": [1, 2, 3]}', "must be \\[layers\\]\\[experts\\]"),
    ('{"logical_count": [[1, -2]]}', "negative"),
    ('{"logical_count": [[1, 2], [3]]}', "rectangular"),
])
def test_bad_load_files(tmp_path, content, message):
    path = tmp_path / "l.json"
    path.write_text(content)
    with pytest.raises(EpsimError, match=message):
        read_loads(path)


def test_replicas_share_load_and_remap_round_robin():
    # 4 experts on 2 GPUs with 3 slots each: experts 1 and 2 have two replicas
    p = Placement(np.array([[2, 0, 1, 3, 2, 1]]), num_gpus=2, num_logical=4)
    assert p.replica_counts.tolist() == [[1, 2, 2, 1]]
    loads = np.array([[10.0, 20.0, 30.0, 40.0]])
    # GPU 0: 15 (half of 2) + 10 + 10 (half of 1) = 35; GPU 1: 40 + 15 + 10 = 65
    assert p.gpu_loads(loads).tolist() == [[35.0, 65.0]]
    ids = np.array([[2, 1], [2, 3]])
    slots = remap(ids, p.logical_to_physical[0], p.replica_counts[0], np.arange(2)[:, None])
    # vLLM's rule, replica = flattened position t * top_k + j modulo the replicas: positions
    # 0, 1, 2, 3 -> expert 2 replica 0 (slot 0), expert 1 replica 1 (slot 5), expert 2
    # replica 0 (slot 0), expert 3 (one replica, slot 3)
    assert slots.tolist() == [[0, 5], [0, 3]]
    assert (p.physical_to_logical[0][slots] == ids).all()


def test_placement_validation_and_file_round_trip(tmp_path):
    with pytest.raises(EpsimError, match="expert 3 has no physical slot"):
        Placement(np.array([[0, 1, 2, 2]]), num_gpus=2, num_logical=4)
    p = contiguous_placement(2, 8, 4)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(p.to_json()))
    q = read_placement(path, num_layers=2, num_experts=8)
    assert (q.physical_to_logical == p.physical_to_logical).all()
    with pytest.raises(EpsimError, match="the model has 16"):
        read_placement(path, num_experts=16)
