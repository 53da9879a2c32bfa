"""The deployed kernel (kernel_sets' deployment selectors): a fused-MoE table may name the EP
exchange mode and the MoE layout it measured; a step reads the one its deployment runs (wide-EP
decode: the masked grouped GEMM; wide-EP prefill: the contiguous one; TP-only: the TP rows), and
EP prefill pays the routed imbalance as decode does. Every table here is planted (synthetic)."""

import numpy as np
import pytest

from epsim.model import Batch, build_step_graph, load_model, make_plan
from epsim.model.errors import EpsimError
from epsim.sim.hardware.kernel_sets import parse_kernels
from epsim.sim.hardware.profile import load_profile, profile_from_dict
from epsim.sim.step.cost import CostContext, timing
from epsim.sim.step.simulate import simulate_step

R1 = load_model("deepseek-r1")
MOE_LAYERS = len(R1.moe_layers)  # 58
SRC = {"s": {"repository": "epsim/tests", "path": "synthetic", "commit": "abcdef0"}}
FEATS = ["tokens", "experts", "top_k", "hidden", "inter"]


def _moe(us, inter=2048, slope=0.0, **selectors):
    """A fused-MoE table over experts 1-256 and tokens 1-1e6 at ``inter``: ``us`` at 1 token,
    growing as tokens ** slope (0: flat, 1: proportional)."""
    points = [[t, e, 8, 7168, inter, us * t ** slope] for e in (1, 256) for t in (1, 1_000_000)]
    return {"op": "grouped_gemm", "dtype": "fp8", "unit": "us", "source": "s",
            "features": FEATS, "points": points, **selectors}


# listed untagged first: a more specific table wins over the order
TABLES = [_moe(999.0), _moe(100.0, mode="low_latency", layout="ep"),
          _moe(300.0, mode="normal", layout="ep"), _moe(50.0, inter=256, layout="tp")]


def _kernels(tables=TABLES):
    return {"default": "t", "sources": SRC, "sets": {"t": {"tables": tables}}}


def _profile(tables=TABLES):
    raw = {k: v for k, v in load_profile("mi300x").raw.items() if k != "kernels"}
    # the flat planted tables (1e6 tokens in 100 us) are beyond any real device: the table guard
    # (sim/hardware/table_guard.py) would refuse them against the MI300X's peaks, so the planted
    # device has peaks no point reaches (the tables, not the roofline, time the fused MoE here)
    raw["peak_flops"] = {k: v * 1e9 for k, v in raw["peak_flops"].items()}
    raw["hbm_bandwidth"] *= 1e9
    return profile_from_dict({**raw, "kernels": _kernels(tables)}, "planted")


def test_the_most_specific_matching_table_is_chosen():
    ks = parse_kernels(_kernels())
    pick = {(m, lay): ks.resolve("t", "grouped_gemm", "fp8", "intra", m, lay)[0]
            for m in ("", "low_latency", "normal") for lay in ("", "ep", "tp")}
    us = {key: t.seconds[0] * 1e6 for key, t in pick.items()}
    assert us[("low_latency", "ep")] == pytest.approx(100.0)
    assert us[("normal", "ep")] == pytest.approx(300.0)
    assert us[("normal", "tp")] == us[("low_latency", "tp")] == pytest.approx(50.0)
    assert us[("normal", "")] == pytest.approx(300.0)  # a layout not given excludes nothing
    assert us[("", "")] == pytest.approx(999.0)  # nothing given: ties, the first listed
    assert pick[("low_latency", "ep")].deployment == "ep, low_latency"


def test_selectors_are_checked():
    with pytest.raises(EpsimError, match="layout must be one of ep, tp"):
        parse_kernels(_kernels([_moe(1.0, layout="dp")]))
    gemm = {"op": "gemm", "dtype": "fp8", "unit": "us", "source": "s", "layout": "ep",
            "features": ["m", "n", "k"], "points": [[1, 2, 3, 4.0]]}
    with pytest.raises(EpsimError, match=r"layout must be one of ep, tp \(tables of "
                                         r"grouped_gemm only\)"):
        parse_kernels(_kernels([gemm]))
    with pytest.raises(EpsimError, match=r"repeats a grouped_gemm fp8 intra \(ep, normal\)"):
        parse_kernels(_kernels([_moe(1.0, mode="normal", layout="ep"),
                                _moe(2.0, mode="normal", layout="ep")]))


def _ep_step(phase, profile=None, **kw):
    # two nodes: auto runs decode exchanges low-latency, prefill ones normal (SGLang's auto)
    plan = make_plan(R1, nodes=2, dp=16, ep=16, microbatches=1)
    batch = Batch.decode(64, 1000) if phase == "decode" else Batch.prefill(2, 512)
    return simulate_step(R1, plan, batch, profile or _profile(), explain=True, **kw)


def test_wide_ep_decode_reads_the_masked_table_and_prefill_the_contiguous_one():
    decode, prefill = _ep_step("decode"), _ep_step("prefill")
    assert (decode.a2a_mode, prefill.a2a_mode) == ("low_latency", "normal")
    # flat tables: every routed MoE op takes the table's time, whatever its tokens
    assert decode.op_kinds_ms["grouped_gemm"] == pytest.approx(MOE_LAYERS * 0.100, rel=1e-9)
    assert prefill.op_kinds_ms["grouped_gemm"] == pytest.approx(MOE_LAYERS * 0.300, rel=1e-9)
    # --explain names the table chosen
    for step, where, deployment in ((decode, "tables[1]", "ep, low_latency"),
                                    (prefill, "tables[2]", "ep, normal")):
        chosen = step.kernel_sources["grouped_gemm"]["tables"]
        assert [(t["table"], t["deployment"], t["ops"]) for t in chosen] == [
            (f"kernels.sets.t.{where}", deployment, MOE_LAYERS)]


def test_a_tp_only_plan_reads_the_tp_rows():
    plan = make_plan(R1, tp=8, microbatches=1)
    r = simulate_step(R1, plan, Batch.decode(32, 1000), _profile(), explain=True)
    assert r.op_kinds_ms["grouped_gemm"] == pytest.approx(MOE_LAYERS * 0.050, rel=1e-9)
    assert [t["deployment"] for t in r.kernel_sources["grouped_gemm"]["tables"]] == ["tp"]
    # the same op outside a step (no deployment given): the first-listed table, whose inter
    # 2048 rows it borrows (extrapolated), as every TP-only MoE did before layouts
    graph = build_step_graph(R1, plan, Batch.decode(32, 1000))
    moe = next(op for op in graph.ops.values() if op.kind == "grouped_gemm")
    how = timing.describe(moe, _profile())
    assert how["table"].where == "kernels.sets.t.tables[0]"
    assert how["method"] == "table-extrapolated"
    assert timing.op_time(moe, CostContext(_profile(), layout="tp")) == pytest.approx(50e-6)


def test_ep_prefill_pays_the_imbalance_of_its_loads():
    # contiguous table proportional to tokens (1 us per token per rank); contiguous placement
    # (no EPLB): under the skewed loads GPU 0's 16 experts draw 3x the others' pairs, a share
    # 48 / 288 of them against 1 / 16: 2.67x the mean rank's routed tokens
    profile = _profile([_moe(1.0, slope=1.0, mode="normal", layout="ep")])
    uniform = np.ones((R1.num_layers, R1.moe.num_experts))
    skewed = uniform.copy()
    skewed[:, :16] = 3.0
    flat = _ep_step("prefill", profile, loads=uniform, eplb=False)
    hot = _ep_step("prefill", profile, loads=skewed, eplb=False)
    assert flat.expert_imbalance == pytest.approx(1.0, abs=0.05)
    assert hot.expert_imbalance == pytest.approx(48 / 288 * 16, rel=0.05)
    # 1024 tokens per rank: 1.024 ms per MoE layer on a uniformly loaded rank
    assert flat.op_kinds_ms["grouped_gemm"] == pytest.approx(MOE_LAYERS * 1.024, rel=0.05)
    # every rank waits for GPU 0's experts at the combine: the step grows by their extra time
    extra = MOE_LAYERS * 1.024e-3 * (48 / 288 * 16 - 1)
    assert hot.step_s - flat.step_s == pytest.approx(extra, rel=0.15)
