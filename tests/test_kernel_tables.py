"""Measured kernel tables (sim/kernels.py, sim/kernel_cost.py) on a SYNTHETIC test profile.

tests/data/mi300x-kernels-test.json is the shipped mi300x profile plus a kernels section of
made-up times (its sources say so): nothing here is a measurement.
"""

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epsim.model import EpsimError, load_model
from epsim.sim.hardware import load_profile, profile_from_dict
from epsim.sim.kernels import lookup, parse_kernels

DATA = Path(__file__).parent / "data" / "mi300x-kernels-test.json"
RAW = json.loads(DATA.read_text())
PROF = load_profile(DATA)
MI = load_profile("mi300x")
R1 = load_model("deepseek-r1")
BW = 5.3e12 * (4.2 / 5.3)
FP8 = 2614.9e12 * (1273 / 2614.9)
SRC = {"s": {"repository": "epsim/tests", "path": "synthetic", "commit": "abcdef0"}}


def _table(kind, features, points):
    return {"op": kind, "dtype": "fp8", "unit": "us", "source": "s", "features": features,
            "points": points}


def _sets(*tables):
    return parse_kernels({"default": "t", "sources": SRC, "sets": {"t": {"tables": list(tables)}}})


# -- exact, between, outside ------------------------------------------------------------------


def test_every_published_point_is_reproduced_exactly():
    for kset in PROF.kernels.sets.values():
        for table in kset.tables.values():
            for i, row in enumerate(table.x):
                secs, how = lookup(table, dict(zip(table.features, row, strict=True)))
                assert secs == table.seconds[i] and how.method == "table-exact"
                assert how.points == (i,)
    # the seconds are the doubles nearest the published microseconds
    moe = PROF.kernels.sets["synthetic"].tables[("grouped_gemm", "fp8", "intra")]
    assert 671.55e-6 in moe.seconds.tolist() and 470.75e-6 in moe.seconds.tolist()


@settings(max_examples=200, deadline=None)
@given(times=st.lists(st.floats(1.0, 1e4), min_size=6, max_size=6),
       u=st.floats(0.0, 1.0), v=st.floats(0.0, 1.0))
def test_between_neighbours_never_outside_them(times, u, v):
    # a 3 x 2 grid over (m, n) with arbitrary, non-monotone times
    ms, ns = [16.0, 64.0, 512.0], [1024.0, 4096.0]
    pts = [[m, n, 4096, times[3 * j + i]] for j, n in enumerate(ns) for i, m in enumerate(ms)]
    table = _sets(_table("gemm", ["m", "n", "k"], pts)).sets["t"].tables[("gemm", "fp8",
                                                                          "intra")]
    m = min(max(math.exp(math.log(16) + u * (math.log(512) - math.log(16))), 16.0), 512.0)
    n = min(max(math.exp(math.log(1024) + v * (math.log(4096) - math.log(1024))), 1024.0), 4096.0)
    secs, how = lookup(table, {"m": m, "n": n, "k": 4096})
    assert how.method in ("table-exact", "table-interpolated")
    i_hi = min(int(np.searchsorted(ms, m)), 2)
    i_lo = i_hi if ms[i_hi] == m else i_hi - 1
    j_hi = min(int(np.searchsorted(ns, n)), 1)
    j_lo = j_hi if ns[j_hi] == n else j_hi - 1
    corners = [table.seconds[3 * j + i] for i in {i_lo, i_hi} for j in {j_lo, j_hi}]
    assert min(corners) <= secs <= max(corners)
    assert {tuple(table.x[p][[3, 1]]) for p in how.points} <= {
        (ms[i], ns[j]) for i in {i_lo, i_hi} for j in {j_lo, j_hi}}


def test_interpolation_is_linear_in_log_log():
    table = _sets(_table("gemm", ["m", "n", "k"], [[16, 512, 512, 10.0], [256, 512, 512, 40.0]])
                  ).sets["t"].tables[("gemm", "fp8", "intra")]
    secs, how = lookup(table, {"m": 64, "n": 512, "k": 512})  # halfway in log m
    assert how.method == "table-interpolated" and secs == pytest.approx(20e-6, rel=1e-12)


# -- malformed tables ---------------------------------------------------------------------------


def _broken(edit):
    raw = copy.deepcopy(RAW)
    edit(raw["kernels"])
    return raw


def _moe(k):
    return k["sets"]["synthetic"]["tables"][0]


MALFORMED = {
    "non-positive time": lambda k: _moe(k)["points"][0].__setitem__(5, 0.0),
    "negative feature": lambda k: _moe(k)["points"][1].__setitem__(0, -4),
    "unknown feature": lambda k: _moe(k)["features"].__setitem__(0, "tokens_per_rank"),
    "missing feature": lambda k: _moe(k).update(features=["tokens", "experts", "top_k", "hidden"]),
    "wrong arity": lambda k: _moe(k)["points"][2].pop(),
    "missing source": lambda k: _moe(k).pop("source"),
    "unknown source id": lambda k: _moe(k)["points"][0].append("nosuch"),
    "duplicate point": lambda k: _moe(k)["points"].append(list(_moe(k)["points"][0])),
    "unknown op": lambda k: _moe(k).update(op="fused_moe"),
    "unknown unit": lambda k: _moe(k).update(unit="cycles"),
    "unknown table key": lambda k: _moe(k).update(tokens=[1]),
    "scope on a GEMM": lambda k: k["sets"]["synthetic"]["tables"][1].update(scope="inter"),
    "duplicate table": lambda k: k["sets"]["synthetic"]["tables"].append(_moe(k)),
    "source without commit": lambda k: k["sources"]["synthetic"].pop("commit"),
    "bad commit": lambda k: k["sources"]["synthetic"].update(commit="main"),
    "unknown default": lambda k: k.update(default="aiter"),
    "reserved set name": lambda k: k["sets"].update(none={"relative_to": "synthetic"}),
    "unknown base set": lambda k: k["sets"]["synthetic-slow-moe"].update(relative_to="nosuch"),
    "cycle": lambda k: k["sets"]["synthetic"].update(relative_to="synthetic-slow-moe"),
    "speedup without base": lambda k: k["sets"]["synthetic"].update(
        speedup={"gemm": {"value": 2, "source": "synthetic"}}),
    "speedup of no kind": lambda k: k["sets"]["synthetic-slow-moe"]["speedup"].update(
        fused={"value": 2, "source": "synthetic"}),
    "speedup not positive": lambda k: k["sets"]["synthetic-slow-moe"]["speedup"][
        "grouped_gemm"].update(value=0),
    "unknown plan option": lambda k: k["sets"]["synthetic"]["plan_options"].update(fuse_all=True),
    "plan option type": lambda k: k["sets"]["synthetic"]["plan_options"].update(
        fuse_shared_expert="yes"),
    "empty set": lambda k: k["sets"].update(empty={}),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_kernels_section_is_a_one_line_error(case):
    with pytest.raises(EpsimError) as err:
        profile_from_dict(_broken(MALFORMED[case]), "bad.json")
    message = str(err.value)
    assert "\n" not in message and message.startswith("bad.json: kernels")


# -- profiles and kernel sets -----------------------------------------------------------------


def test_kernel_set_selection():
    assert PROF.kernel_set == "synthetic"
    assert PROF.kernel_sets == ("synthetic", "synthetic-slow-moe", "roofline-fast-attention",
                                "none")
    assert PROF.plan_options == {"fuse_shared_expert": False}
    fast_attn = load_profile(DATA, kernels="roofline-fast-attention")
    assert fast_attn.plan_options == {"fuse_shared_expert": True}
    with pytest.raises(EpsimError, match="synthetic, synthetic-slow-moe, .*none") as err:
        PROF.with_kernels("aiter")
    assert "\n" not in str(err.value)
    assert MI.kernel_sets == ("none",) and MI.active_kernels is None and MI.plan_options == {}
    assert fast_attn.with_kernels("none").active_kernels is None
