"""Workloads: vLLM's dataset and arrival definitions, checked by hand and by property."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epsim.model import load_model
from epsim.model.errors import EpsimError
from epsim.sim.workload.sharegpt import SHAREGPT_LIKE
from epsim.sim.workload.spec import (
    DATASETS,
    WorkloadSpec,
    issue_times,
    longest_request,
    random_lengths,
    sample_requests,
)


def test_fixed_lengths_are_exact():
    r = sample_requests(WorkloadSpec(num_prompts=7, isl=2000, osl=100))
    assert r.input_lens.tolist() == [2000] * 7
    assert r.output_lens.tolist() == [100] * 7
    assert r.issue_times_s.tolist() == [0.0] * 7


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 5000), ratio=st.floats(0.0, 0.99), seed=st.integers(0, 2**31))
def test_random_lengths_stay_in_vllm_range(length, ratio, seed):
    x = random_lengths(np.random.default_rng(seed), 200, length, ratio)
    low = max(1, math.floor(length * (1 - ratio)))
    high = max(low, math.ceil(length * (1 + ratio)))
    assert x.min() >= low and x.max() <= high


def test_random_ratio_zero_is_fixed_and_ratio_spreads():
    r0 = sample_requests(WorkloadSpec(dataset="random", num_prompts=50, isl=1000, osl=10))
    assert set(r0.input_lens.tolist()) == {1000}
    r = sample_requests(WorkloadSpec(dataset="random", num_prompts=2000, isl=1000, osl=10,
                                     random_range_ratio=0.5))
    assert r.input_lens.min() >= 500 and r.input_lens.max() <= 1500
    assert abs(r.input_lens.mean() - 1000) < 25  # uniform around the mean
    assert r.output_lens.min() >= 5 and r.output_lens.max() <= 15


def test_sharegpt_like_passes_vllm_filter_and_is_seeded():
    spec = WorkloadSpec(dataset="sharegpt-like", num_prompts=3000, seed=3)
    a, b = sample_requests(spec), sample_requests(spec)
    assert np.array_equal(a.input_lens, b.input_lens)
    p = SHAREGPT_LIKE
    assert a.input_lens.min() >= p.min_len and a.output_lens.min() >= p.min_len
    assert a.input_lens.max() <= p.max_prompt_len
    assert (a.input_lens + a.output_lens).max() <= p.max_total_len
    # the filter trims the tails, so the means land a little under the source's 161 / 338
    assert 100 < a.input_lens.mean() < 170 and 200 < a.output_lens.mean() < 340
    c = sample_requests(WorkloadSpec(dataset="sharegpt-like", num_prompts=3000, seed=4))
    assert not np.array_equal(a.input_lens, c.input_lens)


def test_sharegpt_like_fixed_output_length():
    r = sample_requests(WorkloadSpec(dataset="sharegpt-like", num_prompts=100, osl=64))
    assert set(r.output_lens.tolist()) == {64}


def test_sharegpt_file(tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "x" * 400},
                           {"from": "gpt", "value": "y" * 800}]},
        {"conversations": [{"from": "human", "value": "too short"}]},  # one turn: skipped
        {"conversations": [{"from": "human", "value": "ab"},
                           {"from": "gpt", "value": "y" * 80}]},  # prompt < 4 tokens: filtered
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    r = sample_requests(WorkloadSpec(dataset="sharegpt-like", num_prompts=3,
                                     dataset_path=str(path)))
    assert r.input_lens.tolist() == [100] * 3  # 400 chars / 4, cycled
    assert r.output_lens.tolist() == [200] * 3
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(EpsimError, match="malformed"):
        sample_requests(WorkloadSpec(dataset="sharegpt-like", num_prompts=1,
                                     dataset_path=str(bad)))


def test_poisson_gaps_have_the_rate():
    t = issue_times(np.random.default_rng(0), 20000, rate=50.0, burstiness=1.0)
    gaps = np.diff(t)
    assert t[0] == 0.0
    assert abs(gaps.mean() - 1 / 50) < 0.02 / 50 * 3 + 1e-4
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05  # exponential: cv 1
    assert issue_times(np.random.default_rng(0), 5, math.inf, 1.0).tolist() == [0.0] * 5


@pytest.mark.parametrize("spec, match", [
    (WorkloadSpec(num_prompts=0, isl=1, osl=1), "num-prompts"),
    (WorkloadSpec(num_prompts=1, isl=1), "--osl"),
    (WorkloadSpec(dataset="random", num_prompts=1, isl=5, osl=5, random_range_ratio=1.0),
     "range-ratio"),
    (WorkloadSpec(dataset="nope", num_prompts=1), "dataset"),
    (WorkloadSpec(num_prompts=1, isl=1, osl=1, request_rate=-1.0), "request-rate"),
])
def test_bad_workloads_name_the_value(spec, match):
    with pytest.raises(EpsimError, match=match):
        spec.validate()


def test_the_longest_request_bounds_every_draw():
    fixed = WorkloadSpec(num_prompts=5, isl=2000, osl=100)
    assert longest_request(fixed)[0] == 2100
    rnd = WorkloadSpec(dataset="random", num_prompts=3000, isl=1000, osl=10,
                       random_range_ratio=0.5, seed=1)
    assert longest_request(rnd)[0] == 1500 + 15
    r = sample_requests(rnd)
    assert (r.input_lens + r.output_lens).max() <= 1515
    assert r.input_lens.max() == 1500  # the top of the range is drawn: the bound is tight
    share = WorkloadSpec(dataset="sharegpt-like", num_prompts=100)
    assert longest_request(share)[0] == SHAREGPT_LIKE.max_total_len == 2048


def test_each_dataset_is_one_registered_class():
    assert list(DATASETS) == ["fixed", "random", "sharegpt-like", "trace"]
    assert {name for name, d in DATASETS.items() if d.needs_lengths} == {"fixed", "random"}
    assert {name for name, d in DATASETS.items() if d.takes_path} == {"sharegpt-like", "trace"}
    assert [name for name, d in DATASETS.items() if d.replays] == ["trace"]
    assert WorkloadSpec(dataset="random", isl=5, osl=5).kind is DATASETS["random"]


@pytest.mark.parametrize("spec, longest", [
    (WorkloadSpec(num_prompts=2, isl=4000, osl=97), 4097),
    (WorkloadSpec(dataset="random", num_prompts=2, isl=3000, osl=100, random_range_ratio=0.4),
     4200 + 140),
])
def test_requests_beyond_the_context_are_refused(spec, longest):
    tiny = load_model("tiny-deepseek")  # max_position_embeddings 4096
    with pytest.raises(EpsimError, match=f"{longest} tokens exceed tiny-deepseek's context of "
                       "4096 tokens"):
        sample_requests(spec, tiny)
    assert len(sample_requests(WorkloadSpec(num_prompts=2, isl=4000, osl=96), tiny)) == 2
    # the sharegpt-like filter caps a request at 2048 tokens: it always fits
    assert len(sample_requests(WorkloadSpec(dataset="sharegpt-like", num_prompts=4), tiny)) == 4
