"""Measured kernel tables (sim/hardware/kernel_sets.py, sim/step/timing.py, op_kinds.py) on a SYNTHETIC test profile.

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

from epsim.model import Batch, EpsimError, build_step_graph, load_model, make_plan
from epsim.model.opgraph import OP_KINDS, Op
from epsim.sim.hardware.kernel_sets import COLLECTIVE_TABLES, FEATURES, lookup, parse_kernels
from epsim.sim.hardware.profile import load_profile, profile_from_dict
from epsim.sim.step.cost import CostContext, gemm, registry, timing
from epsim.sim.step.cost.registry import COST_MODELS, KIND_COSTING, costing
from epsim.sim.step.simulate import simulate_step

DATA = Path(__file__).resolve().parents[2] / "data" / "mi300x-kernels-test.json"
RAW = json.loads(DATA.read_text())
PROF = load_profile(DATA)
# the shipped mi300x profile without its kernels section (the roofline, bit for bit)
MI = profile_from_dict({k: v for k, v in load_profile("mi300x").raw.items() if k != "kernels"},
                       "mi300x")
R1 = load_model("deepseek-r1")
BW = 5.3e12 * (4.2 / 5.3)
FP8 = 2614.9e12 * (1273 / 2614.9)
SRC = {"s": {"repository": "epsim/tests", "path": "synthetic", "commit": "abcdef0"}}


def _op(kind, dims, flops=0.0, read=0.0, written=0.0, weights=0.0, dtype="fp8", peers=None):
    return Op(id="L5.x.mb0", kind=kind, name="x", layer=5, microbatch=0, category="other",
              dims=dims, dtype=dtype, flops=flops, bytes_read=read, bytes_written=written,
              weight_bytes=weights, peer_bytes=peers)


def _gemm(m, n, k):
    return _op("gemm", {"batch": 1, "m": m, "n": n, "k": k}, flops=2.0 * m * n * k,
               read=n * k + 2.0 * m * k, written=2.0 * m * n, weights=float(n * k))


def _table(kind, features, points):
    return {"op": kind, "dtype": "fp8", "unit": "us", "source": "s", "features": features,
            "points": points}


def _sets(*tables):
    return parse_kernels({"default": "t", "sources": SRC, "sets": {"t": {"tables": list(tables)}}})


def _step(profile=PROF, batch=512, dbo=False, **kw):
    plan = make_plan(R1, dp=8, ep=8, microbatches=2 if dbo else 1)
    return simulate_step(R1, plan, Batch.decode(batch, 2100), profile, synthetic="uniform", **kw)


# -- exact, between, outside ------------------------------------------------------------------


def test_every_published_point_is_reproduced_exactly():
    for kset in PROF.kernels.sets.values():
        for table in kset.tables.values():
            for i, row in enumerate(table.x):
                secs, how = lookup(table, dict(zip(table.features, row, strict=True)))
                assert secs == table.seconds[i] and how.method == "table-exact"
                assert how.points == (i,)
    # the seconds are the doubles nearest the published microseconds
    moe = PROF.kernels.sets["synthetic"].table("grouped_gemm", "fp8", "intra")
    assert 671.55e-6 in moe.seconds.tolist() and 470.75e-6 in moe.seconds.tolist()
    # and through the cost model: a GEMM at a measured shape takes the measured time
    assert timing.op_time(_gemm(256, 1536, 7168), PROF) == 60e-6


@settings(max_examples=200, deadline=None)
@given(times=st.lists(st.floats(1.0, 1e4), min_size=6, max_size=6),
       u=st.floats(0.0, 1.0), v=st.floats(0.0, 1.0))
def test_between_neighbours_never_outside_them(times, u, v):
    # a 3 x 2 grid over (m, n) with arbitrary, non-monotone times
    ms, ns = [16.0, 64.0, 512.0], [1024.0, 4096.0]
    pts = [[m, n, 4096, times[3 * j + i]] for j, n in enumerate(ns) for i, m in enumerate(ms)]
    table = _sets(_table("gemm", ["m", "n", "k"], pts)).sets["t"].table("gemm", "fp8",
                                                                        "intra")
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
                  ).sets["t"].table("gemm", "fp8", "intra")
    secs, how = lookup(table, {"m": 64, "n": 512, "k": 512})  # halfway in log m
    assert how.method == "table-interpolated" and secs == pytest.approx(20e-6, rel=1e-12)


def test_outside_the_table_scales_the_nearest_point_by_the_roofline():
    n, k = 1536, 7168

    def roof(m):  # FP8 GEMM roofline, 16-row tiles, 1-byte weights, bf16 activations
        return max(2.0 * math.ceil(m / 16) * 16 * n * k / FP8, (n * k + 2.0 * (m * k + m * n)) / BW)

    big = timing.op_time(_gemm(4096, n, k), PROF)  # table's m ends at 1024 (200 us)
    assert big == pytest.approx(200e-6 * roof(4096) / roof(1024), rel=1e-12)
    small = timing.op_time(_gemm(4, n, k), PROF)  # below 16 (20 us): the nearest is m = 16
    assert small == pytest.approx(20e-6 * roof(4) / roof(16), rel=1e-12)
    how = timing.describe(_gemm(4096, n, k), PROF)
    assert how["method"] == "table-extrapolated"
    assert how["table"].x[how["points"][0]].tolist() == [1.0, n, k, 1024.0]
    # a shape between two tabled (n, k) pairs has no corners: nearest point, scaled
    mid = timing.describe(_gemm(256, 4096, 7168), PROF)
    assert mid["method"] == "table-extrapolated" and 0 < mid["ratio"]
    # a batched GEMM (MLA's absorption) is not what a table without `batch` measured
    batched = _op("gemm", {"batch": 128, "m": 256, "n": 1536, "k": 7168}, flops=1.0, read=1.0,
                  weights=1.0)
    assert timing.describe(batched, PROF)["method"] == "roofline"
    assert timing.op_time(batched, PROF) == timing.op_time(batched, MI)


def test_collective_tables_and_scope():
    sets = {"default": "t", "sources": SRC, "sets": {"t": {"tables": [
        {"op": "all_reduce", "dtype": "bf16", "unit": "us", "source": "s",
         "features": ["bytes", "ranks"], "points": [[1e6, 8, 30.0], [4e6, 8, 60.0]]}]}}}
    prof = profile_from_dict({**RAW, "kernels": sets}, "t")
    ar = _op("all_reduce", {"tokens": 1, "width": 1, "group": "tp", "group_size": 8},
             read=4e6, dtype="bf16", peers=tuple([1e6] * 8))
    fallback = 1.0
    assert timing.op_seconds(ar, CostContext(prof, nodes=(0,) * 8), lambda: fallback) == 60e-6
    far = _op("all_reduce", ar.dims, read=16e6, dtype="bf16", peers=tuple([4e6] * 8))
    grown = timing.op_seconds(far, CostContext(prof, nodes=(0,) * 8), lambda: fallback)
    assert grown > 60e-6 and grown < 4 * 60e-6  # the latency part does not grow
    # an inter-node group finds no intra-node table: the roofline
    assert timing.op_seconds(ar, CostContext(prof, nodes=(0, 0, 0, 0, 1, 1, 1, 1)),
                              lambda: fallback) == 1.0


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
        shared_expert_in_moe="yes"),
    "empty set": lambda k: k["sets"].update(empty={}),
    # JSON values of the wrong type where a name is expected (lists are unhashable)
    "op a list": lambda k: _moe(k).update(op=["gemm"]),
    "unit a list": lambda k: _moe(k).update(unit=["us"]),
    "feature a list": lambda k: _moe(k)["features"].__setitem__(0, ["tokens"]),
    "source id a list": lambda k: _moe(k)["points"][0].append(["synthetic"]),
    "table source a list": lambda k: _moe(k).update(source=["synthetic"]),
    "default a list": lambda k: k.update(default=["synthetic"]),
    "time underflows to 0 s": lambda k: _moe(k)["points"][0].__setitem__(5, 1e-320),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_kernels_section_is_a_one_line_error(case):
    with pytest.raises(EpsimError) as err:
        profile_from_dict(_broken(MALFORMED[case]), "bad.json")
    message = str(err.value)
    assert "\n" not in message and message.startswith("bad.json: kernels")


# -- profiles and kernel sets -----------------------------------------------------------------


def test_a_profile_without_kernels_is_unchanged():
    assert MI.kernels is None and MI.kernel_sets == ("none",) and MI.active_kernels is None
    assert MI.plan_options == {} and MI.with_kernels(None) is MI
    base = _step(MI, dbo=True)
    same = _step(PROF.with_kernels("none"), dbo=True)
    assert same.step_s == base.step_s and same.rank_ms == base.rank_ms
    assert same.op_kinds_ms == base.op_kinds_ms and base.kernels == "none"
    plan = make_plan(R1, dp=8, ep=8)
    accept = simulate_step(R1, plan, Batch.decode(512, 2100), MI)
    assert accept.step_ms == pytest.approx(122.46437395975384, rel=1e-12)
    # the shipped profile with its kernel set "none" is the same roofline
    shipped = simulate_step(R1, plan, Batch.decode(512, 2100), load_profile("mi300x", "none"))
    assert shipped.step_s == accept.step_s and shipped.kernels == "none"


def test_kernel_set_selection():
    assert PROF.kernel_set == "synthetic"
    assert PROF.kernel_sets == ("synthetic", "synthetic-slow-moe", "roofline-fast-attention",
                                "none")
    assert PROF.plan_options == {"shared_expert_in_moe": False}
    fast_attn = load_profile(DATA, kernels="roofline-fast-attention")
    assert fast_attn.plan_options == {"shared_expert_in_moe": True}
    with pytest.raises(EpsimError, match="synthetic, synthetic-slow-moe, .*none") as err:
        PROF.with_kernels("aiter")
    assert "\n" not in str(err.value)
    # a set scaled from the roofline: decode attention at half the roofline's time
    graph = build_step_graph(R1, make_plan(R1, dp=8, ep=8), Batch.decode(64, 3000))
    attn = next(op for op in graph if op.kind == "attention_decode")
    assert timing.op_time(attn, fast_attn) == timing.op_time(attn, MI) / 2.0
    assert timing.op_time(attn, fast_attn.with_kernels("none")) == timing.op_time(attn, MI)


def test_a_set_scaled_from_another_set():
    slow = PROF.with_kernels("synthetic-slow-moe")
    a, b = _step(PROF), _step(slow)
    assert b.op_kinds_ms["grouped_gemm"] == pytest.approx(2 * a.op_kinds_ms["grouped_gemm"],
                                                          rel=1e-12)
    assert b.op_kinds_ms["attention_decode"] == a.op_kinds_ms["attention_decode"]
    ks = _step(slow, explain=True).kernel_sources["grouped_gemm"]
    assert ks["method"] == "scaled-set" and set(ks["base_methods"]) <= {
        "table-exact", "table-interpolated"}
    assert ks["scaled"] == [{"set": "synthetic-slow-moe", "factor": 2.0,
                             "source": "synthetic-blog"}]
    assert ks["sources"]["synthetic-blog"]["url"].startswith("https://")


# -- the step -----------------------------------------------------------------------------------


@pytest.mark.parametrize("batch,want_us", [(512, 671.55), (256, 470.75)])
def test_fused_moe_per_layer_follows_the_table(batch, want_us):
    r = _step(batch=batch)
    per_layer_us = r.op_kinds_ms["grouped_gemm"] / len(R1.moe_layers) * 1e3
    assert per_layer_us == pytest.approx(want_us, rel=0.1)
    assert _step(MI, batch=batch).op_kinds_ms["grouped_gemm"] != r.op_kinds_ms["grouped_gemm"]


def test_dbo_microbatches_are_looked_up_at_their_own_shapes():
    plan = make_plan(R1, dp=8, ep=8, microbatches=2)
    graph = build_step_graph(R1, plan, Batch.decode(512, 2100))
    moe = [op for op in graph if op.kind == "grouped_gemm"]
    assert {registry.op_features(op, 8)["tokens"] for op in moe} == {256.0}
    assert {timing.op_time(op, CostContext(PROF, top_k=8)) for op in moe} == {470.75e-6}
    r = _step(batch=512, dbo=True, explain=True)
    per_op_us = r.op_kinds_ms["grouped_gemm"] / (2 * len(R1.moe_layers)) * 1e3
    assert per_op_us == pytest.approx(470.75, rel=0.1)
    used = {p["features"]["tokens"] for p in r.kernel_sources["grouped_gemm"]["points"]}
    assert used <= {128, 256, 512} and 256 in used


def test_fast_and_exact_agree_with_tables():
    fast = _step(dbo=True)
    exact = _step(dbo=True, mode="exact")
    assert exact.step_ms == pytest.approx(fast.step_ms, rel=1e-9)
    assert exact.critical_rank == fast.critical_rank
    for kind, ms in fast.op_kinds_ms.items():
        assert exact.op_kinds_ms[kind] == pytest.approx(ms, rel=1e-12)


def test_dispatch_and_combine_follow_their_tables():
    r = _step(batch=128)
    layers = len(R1.moe_layers)
    assert r.op_kinds_ms["dispatch"] / layers * 1e3 == pytest.approx(35.0, rel=0.15)
    assert r.op_kinds_ms["combine"] / layers * 1e3 == pytest.approx(47.0, rel=0.15)


def test_step_json_and_explain():
    plain = _step(batch=300, dbo=True).to_json()
    assert "kernel_sources" not in plain and plain["kernels"] == "synthetic"
    assert set(plain["op_kinds_ms"]) >= {"gemm", "grouped_gemm", "attention_decode", "dispatch"}
    r = _step(batch=300, dbo=True, explain=True)
    out = json.loads(json.dumps(r.to_json()))
    ks = out["kernel_sources"]
    graph_ops = build_step_graph(R1, make_plan(R1, dp=8, ep=8), Batch.decode(300, 2100))
    counts = {}
    for op in graph_ops:
        counts[op.kind] = counts.get(op.kind, 0) + 1
    assert {k: sum(v["methods"].values()) for k, v in ks.items()} == counts
    assert ks["norm"]["method"] == "roofline" and ks["attention_decode"]["method"] == (
        "table-interpolated")
    gemm = ks["gemm"]
    assert gemm["method"] == "mixed" and gemm["outside"]
    first = gemm["outside"][0]
    assert first["method"] == "table-extrapolated" and first["ops"] and "nearest" in first
    for kind in ks.values():
        for point in kind["points"]:
            assert point["source"] in kind["sources"]
            assert "SYNTHETIC" in kind["sources"][point["source"]]["note"]


def test_feature_names_are_documented_per_kind():
    assert FEATURES["grouped_gemm"][-1][0] == "tokens" and FEATURES["gemm"][-1][0] == "m"
    doc = (Path(__file__).parents[3] / "docs" / "hardware.md").read_text()
    for kind, feats in FEATURES.items():
        assert kind in doc
        for name, _ in feats:
            assert f"`{name}`" in doc
    # the schema example parses
    example = doc.split("## Measured kernel tables")[1].split("```json")[1].split("```")[0]
    sets = parse_kernels(json.loads("{" + example + "}")["kernels"], "docs")
    assert sets.names == ("aiter", "no-aiter", "none")
    assert sets.sets["aiter"].plan_options == {"shared_expert_in_moe": True}


def test_one_costing_entry_per_op_kind():
    # the registry covers the op kinds as the roofline's does, in OP_KINDS order
    assert tuple(KIND_COSTING) == OP_KINDS and set(KIND_COSTING) == set(COST_MODELS)
    # tables time exactly the kinds with FEATURES, each with its roofline at other features;
    # per scope exactly the collectives; the exchange mode shapes only dispatch and combine
    assert {k for k, c in KIND_COSTING.items() if c.features is not None} == set(FEATURES)
    assert all((c.features is None) == (c.roofline_at is None) for c in KIND_COSTING.values())
    assert {k for k, c in KIND_COSTING.items() if c.scoped} == COLLECTIVE_TABLES
    assert {k for k, c in KIND_COSTING.items() if c.exchange} == {"dispatch", "combine"}
    # kinds costed alike share one entry; an unknown kind is costed as a streaming op
    assert KIND_COSTING["dispatch"] is KIND_COSTING["combine"]
    assert KIND_COSTING["lm_head"] is gemm.COSTING["lm_head"]
    assert KIND_COSTING["norm"] is KIND_COSTING["sample"] is costing("no-such-kind")
    # every source key is a figure of the shipped profile (a KeyError names one that is not),
    # and the profile cites it
    raw = load_profile("mi300x").raw
    for key in {k for c in KIND_COSTING.values() for k in c.sources}:
        value = raw
        for part in key.split("."):
            value = value[part]
        assert key in MI.sources
    assert set(registry.roofline_sources("attention_decode", MI)) == {
        f"profile:{k}" for k in KIND_COSTING["attention_decode"].sources}


def _shipped_tables() -> list:
    out = []
    for name in ("mi300x", "h800", "h100"):
        kernels = load_profile(name).kernels
        if kernels is not None:
            out += [t for s in kernels.sets.values() for t in s.tables.values()]
    return out


def test_one_value_lookup_equals_the_array_lookup_bit_for_bit():
    # an op's own lookup (one value) takes the scalar path; a routed op's many values the array
    # path: at every kind of query (a point, between points, past the ends, a missing corner,
    # zero) the two give the same method, seconds and nearest point
    rng = np.random.default_rng(7)
    tables = _shipped_tables()
    assert len(tables) >= 10
    methods = set()
    for table in tables:
        x = table.x
        col = x[:, -1]
        for trial in range(60):
            i, j = rng.integers(len(x), size=2)
            if trial % 3 == 0:
                fixed = x[i, :-1]
            elif trial % 3 == 1:
                fixed = np.where(rng.random(x.shape[1] - 1) < 0.5, x[i, :-1],
                                 np.sqrt(x[i, :-1] * x[j, :-1]))
            else:
                fixed = x[i, :-1] * np.exp(rng.normal(0.0, 1.0, x.shape[1] - 1))
            value = [col[rng.integers(len(col))],
                     math.exp(rng.uniform(math.log(col.min()) - 1, math.log(col.max()) + 1)),
                     col.min(), col.max() * (1 + 1e-7), 0.0][trial % 5]
            many = table.locate(tuple(fixed), np.array([value, value]))
            one = table.locate(tuple(fixed), np.array([value]))
            for a, b in zip(many, one, strict=True):
                assert a.tolist()[:1] == b.tolist()
            methods.add(int(one[0][0]))
    assert methods == {0, 1, 2}  # exact, interpolated and extrapolated all met


def test_repeated_and_single_swept_values_give_the_array_lookups_results():
    # a routed op's many values (a step's token counts repeat) are looked up once per distinct
    # value: the answers equal the plain array path's (chunks too short to be deduplicated)
    # bit for bit, between points and past the tables' ends (the fused MoE's shipped table
    # holds other shapes: all 80 extrapolated; the dispatch's: 24 interpolated, 56 beyond)
    shipped = load_profile("mi300x")
    g = build_step_graph(R1, make_plan(R1, dp=8, ep=8), Batch.decode(512, 2000))
    rng = np.random.default_rng(3)
    for name, top_k, nodes in (("L5.moe.experts.mb0", 8, None),
                               ("L5.moe.dispatch.mb0", None, (0,) * 8)):
        op = g.op(name)
        values = np.round(np.exp(rng.uniform(np.log(0.5), np.log(3e5), 80)) * 8) / 8
        values = rng.choice(values, size=(20, 31))  # 620 values, at most 80 distinct
        assert len(np.unique(values)) < values.size >= timing._DISTINCT_FROM

        def seconds(v, op=op, top_k=top_k, nodes=nodes):
            ctx = CostContext(shipped, top_k=top_k, captured=True, nodes=nodes)
            return timing.routed_seconds(op, ctx, lambda: v, lambda: np.full(v.shape, -1.0))

        once = seconds(values)
        flat = values.reshape(-1)
        step = timing._DISTINCT_FROM - 1
        plain = np.concatenate([seconds(flat[i:i + step]) for i in range(0, flat.size, step)])
        assert once.shape == values.shape and (once > 0).all()
        assert once.reshape(-1).tobytes() == plain.tobytes()
        # one value (an op's own lookup) takes the scalar path: equal to the array path too
        alone = np.concatenate([seconds(flat[i:i + 1]) for i in range(40)])
        assert alone.tobytes() == plain[:40].tobytes()
