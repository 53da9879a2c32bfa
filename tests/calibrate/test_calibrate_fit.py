"""The fitting in calibrate/fit.py and calibrate/comm_fit.py recovers known parameters from
synthetic tables; a fitted profile drives the simulator's cost model with exactly the fitted
formula; the tables round-trip through CSV; the simulator's optional fitted keys behave as
documented."""

import itertools
import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epsim.calibrate import comm_fit as C
from epsim.calibrate import fit as F
from epsim.calibrate.devices import DEVICES
from epsim.calibrate.micro import gemm_op
from epsim.calibrate.profile import profile_from_tables, read_tables, table_paths, write_csv_atomic
from epsim.model import EpsimError
from epsim.model.opgraph import Op
from epsim.sim.hardware.profile import load_profile, profile_from_dict
from epsim.sim.step.cost import roofline, timing

KINDS_TRUE = {  # kind: (overhead s, flops factor, bytes factor)
    "gemm": (7e-6, 1.0, 1.0),
    "gemm.batched": (3e-5, 2.0, 4.0),
    "attention_decode": (4e-4, 0.5, 150.0),
    "norm": (3.5e-5, 0.0, 20.0),
    "router": (2e-4, 9.0, 50.0),
}
F_TRUE, B_TRUE = 1.2e11, 2.5e10


def synthetic_ops(rng: np.random.Generator, mode: str = "sum", n: int = 40) -> pd.DataFrame:
    """Op rows timed exactly by the model with the true parameters."""
    rows = []
    for kind, (a, sf, sb) in KINDS_TRUE.items():
        for _ in range(n):
            flops = float(10 ** rng.uniform(4, 9))
            nbytes = float(10 ** rng.uniform(3, 7))
            if mode == "sum":
                t = a + sf * flops / F_TRUE + sb * nbytes / B_TRUE
            else:
                t = a + (1.0 if kind == "gemm" else sf) * max(flops / F_TRUE, nbytes / B_TRUE)
            base_kind = "gemm" if kind.startswith("gemm") else kind
            rows.append({"shape": "s", "batch": 1, "context": 1, "dbo": False,
                         "op_id": f"{kind}.{len(rows)}", "kind": base_kind,
                         "gemm_batch": 4 if kind == "gemm.batched" else 1,
                         "flops": flops, "bytes": nbytes, "time_s": t})
    return pd.DataFrame(rows)


def test_sum_fit_recovers_known_parameters():
    fit = F.fit_compute_sum(synthetic_ops(np.random.default_rng(0)))
    assert fit.mode == "sum"
    assert fit.flops == pytest.approx(F_TRUE, rel=1e-6)
    assert fit.bandwidth == pytest.approx(B_TRUE, rel=1e-6)
    for kind, (a, sf, sb) in KINDS_TRUE.items():
        assert fit.overhead_s[kind] == pytest.approx(a, rel=1e-6, abs=1e-12)
        if kind != "gemm":
            assert fit.scale[kind] == pytest.approx(sf, rel=1e-5, abs=1e-9)
            assert fit.bytes_scale[kind] == pytest.approx(sb, rel=1e-5, abs=1e-9)
        assert fit.rel_err[kind] < 1e-6


def test_max_fit_recovers_the_roofline_and_overheads():
    df = synthetic_ops(np.random.default_rng(1), mode="max")
    df = df[df["gemm_batch"] == 1]  # the max-mode fit keys gemm rows on their kind only
    fit = F.fit_compute(df, points=61)
    # the grid is refined to ~1/8 of a 0.1-decade step around the optimum
    assert fit.flops == pytest.approx(F_TRUE, rel=0.05)
    assert fit.bandwidth == pytest.approx(B_TRUE, rel=0.05)
    assert fit.overhead_s["gemm"] == pytest.approx(7e-6, rel=0.05)
    assert fit.overhead_s["norm"] == pytest.approx(3.5e-5, rel=0.1)
    assert max(fit.rel_err.values()) < 0.05


def test_fit_needs_gemm_rows():
    df = synthetic_ops(np.random.default_rng(2))
    with pytest.raises(EpsimError, match="no gemm rows"):
        F.fit_compute_sum(df[df["kind"] != "gemm"])


def test_comm_fit_recovers_latencies_and_bandwidth():
    lat = {("dispatch", 2): 2.5e-3, ("dispatch", 4): 9e-3, ("combine", 2): 8e-4,
           ("combine", 4): 4.6e-3}
    bw = 2e8
    rows = [{"kind": k, "world": w, "peers": w - 1, "tokens": t, "link_bytes": t * 100.0,
             "time_s": lat[(k, w)] + t * 100.0 / bw}
            for (k, w), t in itertools.product(lat, (1, 16, 128, 1024, 3072))]
    fit = C.fit_comm(pd.DataFrame(rows))
    assert fit.bandwidth == pytest.approx(bw, rel=1e-6)
    for (k, w), v in lat.items():
        assert fit.latency_s[k][w] == pytest.approx(v, rel=1e-6)
    assert fit.rel_err < 1e-9


def test_rank_slowdown_is_time_weighted_against_the_op_sweep():
    single, rows = [], []
    for i, t in enumerate((1e-5, 4e-4, 2e-3)):
        single.append({"shape": "s", "batch": 6, "context": 160, "dbo": False,
                       "op_id": f"op{i}", "kind": "norm", "time_s": t})
        single.append({"shape": "s", "batch": 6, "context": 160, "dbo": True,  # ignored
                       "op_id": f"op{i}", "kind": "norm", "time_s": 1.0})
    for world, factor in ((1, 1.05), (2, 1.3), (4, 2.2)):
        for i, t in enumerate((1e-5, 4e-4, 2e-3)):
            # the long op is slowed more: the time-weighted factor follows it
            f = factor if i else 1.0
            rows.append({"shape": "s", "world": world, "batch": 6, "context": 160,
                         "op_id": f"op{i}", "kind": "norm", "time_s": t * f})
        rows.append({"shape": "s", "world": world, "batch": 6, "context": 160,
                     "op_id": "x", "kind": "dispatch", "time_s": 1.0 * world})  # skipped
    got = F.fit_rank_slowdown(pd.DataFrame(single), pd.DataFrame(rows))
    total = 1e-5 + 4e-4 + 2e-3
    assert got == pytest.approx({w: (1e-5 + f * 2.4e-3) / total
                                 for w, f in ((1, 1.05), (2, 1.3), (4, 2.2))})
    with pytest.raises(EpsimError, match="no op was timed"):
        F.fit_rank_slowdown(pd.DataFrame(single), pd.DataFrame(rows).assign(shape="t"))


def test_comm_slowdown_inverts_the_fluid_model():
    # a probe of 3 ms stretched to 5 ms by an exchange in flight all along: s = 1 - 3/5
    assert F.fit_comm_slowdown([3e-3, 3e-3], [5e-3, 5e-3]) == pytest.approx(0.4)
    assert F.fit_comm_slowdown([3e-3], [2e-3]) == 0.01  # faster under comm: clamped


@settings(max_examples=30, deadline=None)
@given(st.integers(min_value=0, max_value=10_000))
def test_nnls_satisfies_the_optimality_conditions(seed):
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(12, 4))
    b = rng.normal(size=12)
    x = F.nnls(A, b)
    grad = A.T @ (A @ x - b)
    assert (x >= 0).all()
    # KKT: zero gradient on free variables, non-negative gradient on the bound ones
    assert np.allclose(grad[x > 1e-12], 0.0, atol=1e-8)
    assert (grad[x <= 1e-12] >= -1e-8).all()


# --------------------------------------------------------------------------------------------
# profile building, the CSV round trip, and the simulator's reading of the fitted keys
# --------------------------------------------------------------------------------------------


def synthetic_tables(rng: np.random.Generator) -> dict[str, pd.DataFrame]:
    ops = synthetic_ops(rng)
    steps = pd.DataFrame({"shape": ["s"] * 3, "batch": [1] * 3, "context": [1] * 3,
                          "dbo": [False] * 3, "gap_s": [2e-6, 3e-6, 2.5e-6]})
    lat = {("dispatch", 2): 2e-3, ("dispatch", 4): 8e-3, ("combine", 2): 1e-3,
           ("combine", 4): 4e-3}
    a2a = pd.DataFrame([{"kind": k, "world": w, "peers": w - 1, "tokens": t,
                         "link_bytes": t * 100.0, "time_s": lat[(k, w)] + t * 100.0 / 3e8}
                        for (k, w), t in itertools.product(lat, (1, 64, 1024))])
    ops.loc[0, ["op_id", "kind", "time_s"]] = ["o", "norm", 1e-4]
    ranks = pd.DataFrame([{"shape": "s", "world": w, "batch": 1, "context": 1, "op_id": "o",
                           "kind": "norm", "time_s": 1e-4 * f}
                          for w, f in ((1, 1.0), (2, 1.25), (4, 2.0))])
    cont = pd.DataFrame({"world": [2, 4], "alone_s": [3e-3, 3e-3], "probe_s": [3e-3, 6e-3],
                         "probe_under_comm_s": [4e-3, 8e-3], "comm_alone_s": [1e-2, 3e-2]})
    return {"ops": ops, "steps": steps, "ranks": ranks, "a2a": a2a, "contention": cont}


def build(tables):
    return profile_from_tables(tables, "fitted-test", "cpu", {"host": "testhost",
                               "processor": "x86_64", "cpu_count": 2, "torch": "test"},
                               {t: f"p.{t}.csv" for t in tables}, [])


def test_profile_from_tables_is_a_valid_profile_that_says_it_was_fitted():
    obj = build(synthetic_tables(np.random.default_rng(3)))
    prof = profile_from_dict(json.loads(json.dumps(obj)))
    e = prof.require_efficiency()
    assert e.roofline == "sum"
    assert e.a2a_latency("dispatch", 2) == pytest.approx(2e-3, rel=1e-6)
    assert e.a2a_latency("combine", 4) == pytest.approx(4e-3, rel=1e-6)
    assert e.core_share(2) == pytest.approx(1.25) and e.core_share(4) == pytest.approx(2.0)
    assert e.graph_node_s == pytest.approx(2.5e-6)
    for key, text in obj["sources"].items():
        if key.startswith("efficiency.op_") or key in ("efficiency.a2a_latency_by_group_s",
                                                       "efficiency.rank_compute_slowdown"):
            assert "fitted by epsim calibrate on testhost" in text and "p." in text


@pytest.mark.parametrize("device", sorted(DEVICES))
def test_every_device_recipe_builds_a_valid_profile(device):
    recipe = DEVICES[device]
    tables = synthetic_tables(np.random.default_rng(3))
    machine_info = {"host": "testhost", "cpu_count": 2, "gpu_memory_bytes": 8e10}
    obj = profile_from_tables(tables, "fitted-test", device, machine_info,
                              {t: f"p.{t}.csv" for t in tables}, [])
    e = profile_from_dict(json.loads(json.dumps(obj))).require_efficiency()
    assert e.roofline == recipe.fit_compute(tables["ops"]).mode
    assert obj["gpus_per_node"] == recipe.gpus_per_node(machine_info)
    assert obj["sources"]["hbm_bytes"] == recipe.hbm_source
    assert (obj["kernel_launch_s"] == 1e-9) == (recipe.kernel_launch_placeholder is not None)
    assert set(recipe.extra_efficiency()) <= set(obj["efficiency"])


def test_an_unknown_device_kind_is_refused():
    tables = synthetic_tables(np.random.default_rng(3))
    with pytest.raises(EpsimError, match="device must be cpu or cuda, got 'tpu'"):
        profile_from_tables(tables, "x", "tpu", {}, {t: t for t in tables}, [])


def test_fitted_profile_drives_the_cost_model_with_the_fitted_formula():
    prof = profile_from_dict(build(synthetic_tables(np.random.default_rng(4))))
    # a plain GEMM: overhead + flops / F + bytes / B (tile 1, no occupancy)
    op = gemm_op(8, 192, 384)
    want = KINDS_TRUE["gemm"][0] + op.flops / F_TRUE + op.bytes / B_TRUE
    assert timing.op_time(op, prof) == pytest.approx(want, rel=1e-6)
    # a batched GEMM is the gemm.batched class
    bop = Op(id="b", kind="gemm", name="attn.q_absorb", layer=0, microbatch=0,
             category="attention", dims={"batch": 4, "m": 8, "n": 32, "k": 16}, dtype="bf16",
             flops=2e4, bytes_read=5e3, bytes_written=1e3)
    a, sf, sb = KINDS_TRUE["gemm.batched"]
    assert roofline.op_class(bop) == "gemm.batched"
    assert timing.op_time(bop, prof) == pytest.approx(a + sf * 2e4 / F_TRUE + sb * 6e3 / B_TRUE,
                                                    rel=1e-5)


def test_tables_round_trip_through_csv(tmp_path):
    tables = synthetic_tables(np.random.default_rng(5))
    out = tmp_path / "p.json"
    for name, path in table_paths(out).items():
        write_csv_atomic(tables[name], path)
    again = read_tables(out)
    for name in tables:
        pd.testing.assert_frame_equal(again[name], tables[name], check_dtype=False)
    a, b = build(tables)["efficiency"], build(again)["efficiency"]
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    with pytest.raises(EpsimError, match="calibration table not found"):
        read_tables(tmp_path / "other.json")


def test_optional_keys_leave_gpu_profiles_alone():
    prof = load_profile("mi300x")
    e = prof.require_efficiency()
    assert e.roofline == "max" and not e.op_overhead_s and not e.rank_compute_slowdown
    assert e.core_share(8) == 1.0
    assert e.a2a_latency("combine", 8) == e.a2a_latency_s
    op = gemm_op(512, 1536, 7168)
    assert timing.op_time(op, prof) == pytest.approx(
        max(op.flops / (prof.peak("bf16") * e.gemm_fraction("bf16")),
            op.bytes / (prof.hbm_bandwidth * e.hbm_fraction)))


def test_latency_table_and_rank_slowdown_interpolate():
    raw = json.loads(json.dumps(load_profile("mi300x").raw))
    raw["efficiency"]["a2a_latency_by_group_s"] = {"dispatch": {"2": 2e-3, "4": 8e-3}}
    raw["efficiency"]["rank_compute_slowdown"] = {"2": 1.5, "4": 2.5}
    raw["sources"]["efficiency.a2a_latency_by_group_s"] = "test"
    raw["sources"]["efficiency.rank_compute_slowdown"] = "test"
    e = profile_from_dict(raw).require_efficiency()
    assert e.a2a_latency("dispatch", 3) == pytest.approx(5e-3)
    assert e.a2a_latency("dispatch", 8) == pytest.approx(8e-3 + 3e-3 * 4)  # last slope
    assert e.a2a_latency("dispatch", 1) == pytest.approx(2e-3)
    assert e.a2a_latency("combine", 4) == e.a2a_latency_s  # not in the table: the formula
    assert [e.core_share(r) for r in (1, 2, 3, 4, 8)] == pytest.approx([1, 1.5, 2, 2.5, 5])


@pytest.mark.parametrize("key, value, message", [
    ("rank_compute_slowdown", {"0": 1.2}, "keys must be positive integers"),
    ("rank_compute_slowdown", {"2": -1}, "must be a positive number"),
    ("a2a_latency_by_group_s", {"gather": {"2": 1e-3}}, "a2a_latency_by_group_s must be"),
    ("op_overhead_s", {"norm": -1e-6}, "must be a non-negative number"),
    ("roofline", "min", "roofline must be max or sum"),
])
def test_bad_optional_keys(key, value, message):
    raw = json.loads(json.dumps(load_profile("mi300x").raw))
    raw["efficiency"][key] = value
    raw["sources"][f"efficiency.{key}"] = "test"
    with pytest.raises(EpsimError, match=message):
        profile_from_dict(raw)


def test_optional_keys_need_a_source():
    raw = json.loads(json.dumps(load_profile("mi300x").raw))
    raw["efficiency"]["op_overhead_s"] = {"norm": 1e-5}
    with pytest.raises(EpsimError, match="efficiency.op_overhead_s"):
        profile_from_dict(raw)


def test_rank_slowdown_by_kind_overrides_the_flat_table():
    raw = json.loads(json.dumps(load_profile("mi300x").raw))
    raw["efficiency"]["rank_compute_slowdown"] = {"2": 1.5, "4": 2.5}
    raw["efficiency"]["rank_compute_slowdown_by_kind"] = {"norm": {"2": 1.2, "4": 1.4},
                                                          "gemm": {"4": 3.0}}
    for key in ("rank_compute_slowdown", "rank_compute_slowdown_by_kind"):
        raw["sources"][f"efficiency.{key}"] = "test"
    e = profile_from_dict(raw).require_efficiency()
    assert e.core_share(4, "norm") == pytest.approx(1.4)
    assert e.core_share(2, "gemm.batched") == pytest.approx(5 / 3)  # -> gemm: (1,1)..(4,3)
    assert e.core_share(4, "attention_decode") == pytest.approx(2.5)  # not listed: flat table
    assert e.core_share(4) == pytest.approx(2.5)


def test_rank_slowdown_by_kind_fit():
    single, ranks = [], []
    for kind, factor in (("norm", 1.3), ("gemm", 1.1)):
        for i in range(3):
            single.append({"shape": "s", "batch": 1, "context": 1, "dbo": False,
                           "op_id": f"{kind}{i}", "kind": kind, "gemm_batch": 1,
                           "time_s": 1e-4 * (i + 1)})
            for w in (1, 2):
                ranks.append({"shape": "s", "world": w, "batch": 1, "context": 1,
                              "op_id": f"{kind}{i}", "kind": kind,
                              "time_s": 1e-4 * (i + 1) * (factor if w == 2 else 1.0)})
    got = F.fit_rank_slowdown_by_kind(pd.DataFrame(single), pd.DataFrame(ranks))
    assert got == {"gemm": pytest.approx({1: 1.0, 2: 1.1}),
                   "norm": pytest.approx({1: 1.0, 2: 1.3})}


def test_ranks_sweep_fits_take_each_ops_share_of_a_median_step_where_the_table_has_it():
    # an op of median 1 ms whose configuration's steps ran 3x their ops' medians (preempted
    # samples): every fit of a step's share reads step_s, and an older table (no step_s, or a
    # row without it) falls back to the median
    rows = pd.DataFrame([
        {"shape": "s", "world": 2, "batch": 6, "context": 160, "op_id": "op0", "kind": "norm",
         "time_s": 1e-3, "step_s": 3e-3},
        {"shape": "s", "world": 2, "batch": 6, "context": 160, "op_id": "op1", "kind": "norm",
         "time_s": 2e-3, "step_s": float("nan")},
    ])
    assert F.step_share_s(rows).tolist() == [3e-3, 2e-3]
    assert F.step_share_s(rows.drop(columns=["step_s"])).tolist() == [1e-3, 2e-3]
    single = pd.DataFrame([{"shape": "s", "batch": 6, "context": 160, "op_id": f"op{i}",
                            "kind": "norm", "time_s": 1e-3} for i in range(2)])
    assert F.fit_rank_slowdown(single, rows) == {2: pytest.approx(5e-3 / 2e-3)}
    assert F.fit_rank_slowdown(single, rows.drop(columns=["step_s"])) == {
        2: pytest.approx(3e-3 / 2e-3)}
    a2a = pd.DataFrame([{"kind": k, "world": 2, "tokens": t, "link_bytes": t * 1e3,
                         "time_s": 1e-3 + t * 1e-6} for k in ("dispatch", "combine")
                        for t in (8, 64, 512)])
    ex = pd.DataFrame([{"shape": "s", "world": 2, "batch": 6, "context": 160,
                        "op_id": f"L{j}.moe.{k}.mb0", "kind": k, "time_s": m,
                        "step_s": 2 * m} for k, m in (("dispatch", 4e-3), ("combine", 1e-3))
                       for j in range(3)])
    fit = C.fit_in_step(a2a, ex)
    assert fit.latency_s["dispatch"][2] == pytest.approx(8e-3)
    assert fit.latency_s["combine"][2] == pytest.approx(2e-3)
    assert C.fit_in_step(a2a, ex.drop(columns=["step_s"])).latency_s["combine"][2] == \
        pytest.approx(1e-3)


def test_step_scales_are_the_median_step_over_the_summed_op_medians():
    from epsim.calibrate.micro import step_scales

    # two compute ops and one exchange on 2 ranks, 3 steps; rank 1 runs op b at 4 ms (rank 0:
    # 2 ms) and was preempted once in op a (9 ms instead of 1): the steps' median drops the
    # one preemption; a steadier one (rank 1 slow in every step) lifts it
    config = ("s", 2, 6, 160)
    a = {0: [1e-3] * 3, 1: [1e-3, 9e-3, 1e-3]}
    b = {0: [2e-3] * 3, 1: [4e-3] * 3}
    x = {0: [5e-3] * 3, 1: [5e-3] * 3}
    samples = {(*config, "a"): ("norm", a[0] + a[1]), (*config, "b"): ("gemm", b[0] + b[1]),
               (*config, "x"): ("dispatch", x[0] + x[1])}
    sums = {}
    for rank in (0, 1):
        for step in range(3):
            sums[(0, step + 1, rank, "compute")] = a[rank][step] + b[rank][step]
            sums[(0, step + 1, rank, "exchange")] = x[rank][step]
    got = step_scales(samples, {config: sums})
    # op medians: a 1 ms, b 3 ms (of 2, 2, 2, 4, 4, 4): 4 ms; steps: (3+5)/2, (3+13)/2, (3+5)/2
    assert got[(config, "compute")] == pytest.approx(4e-3 / 4e-3)
    assert got[(config, "exchange")] == pytest.approx(1.0)
    sums[(0, 1, 1, "compute")] = sums[(0, 3, 1, "compute")] = 9e-3  # rank 1 slower every step
    got = step_scales(samples, {config: sums})
    assert got[(config, "compute")] == pytest.approx(((3 + 9) / 2 * 1e-3) / 4e-3)
