"""The cost model against hand-computed physics (MI300X profile figures)."""

import json
import math

import numpy as np
import pytest

from epsim.model import Batch, EpsimError, build_step_graph, load_model, make_plan
from epsim.model.opgraph import Op
from epsim.sim.hardware.profile import load_profile, profile_from_dict
from epsim.sim.step.cost import attention, comm, gemm, timing

MI = load_profile("mi300x", kernels="none")  # the roofline alone, without its kernel tables
BW = 5.3e12 * (4.2 / 5.3)  # achievable HBM bytes/s
FP8 = 2614.9e12 * (1273 / 2614.9)  # achievable FP8 FLOP/s
BF16 = 1307.4e12 * (708 / 1307.4)
LINK = 48e9


def _op(kind, dims, flops=0.0, read=0.0, written=0.0, weights=0.0, dtype="bf16", peers=None):
    return Op(id="x.mb0", kind=kind, name="x", layer=0, microbatch=0, category="other",
              dims=dims, dtype=dtype, flops=flops, bytes_read=read, bytes_written=written,
              weight_bytes=weights, peer_bytes=peers)


def test_efficiency_tables_carry_design_figures():
    e = MI.efficiency
    assert e.gemm_flops_fraction["bf16"] * 1307.4e12 == pytest.approx(708e12)
    assert e.gemm_flops_fraction["fp8"] * 2614.9e12 == pytest.approx(1273e12)
    assert MI.hbm_bandwidth * e.hbm_fraction == pytest.approx(4.2e12)
    assert e.link_bandwidth_usable == 48e9
    assert e.collective_latency_s == 13e-6 and 6e-6 <= e.collective_latency_graph_s <= 7.6e-6
    assert load_profile("mi325x").efficiency.gemm_flops_fraction["bf16"] * 1307.4e12 == \
        pytest.approx(843e12)


def test_memory_bound_op_takes_bytes_over_achievable_bandwidth():
    norm = _op("norm", {"tokens": 512, "width": 7168}, flops=5 * 512 * 7168,
               read=2 * 512 * 7168, written=2 * 512 * 7168)
    assert timing.op_time(norm, MI) == pytest.approx(4 * 512 * 7168 / 4.2e12)


def test_skinny_gemm_is_weight_bound_and_large_gemm_compute_bound():
    # M = 4: FP8 weights 7168 x 7168 dominate
    k = n = 7168
    skinny = _op("gemm", {"batch": 1, "m": 4, "n": n, "k": k}, flops=2 * 4 * n * k,
                 read=k * n + 4 * k * 2, written=4 * n * 2, weights=k * n, dtype="fp8")
    assert timing.op_time(skinny, MI) == pytest.approx((k * n + 8 * k + 8 * n) / BW)
    big = _op("gemm", {"batch": 1, "m": 8192, "n": n, "k": k}, flops=2 * 8192 * n * k,
              read=k * n + 8192 * k * 2, written=8192 * n * 2, weights=k * n, dtype="fp8")
    assert timing.op_time(big, MI) == pytest.approx(2 * 8192 * n * k / FP8)


def test_gemm_pays_whole_tiles():
    # 17 rows on 16-row tiles compute 32 rows: twice the 16-row GEMM's math
    def t(m):
        return timing.op_time(_op("gemm", {"batch": 1, "m": m, "n": 4096, "k": 4096},
                                flops=2 * m * 4096 * 4096, dtype="bf16"), MI)
    assert t(17) == pytest.approx(2 * t(16))
    assert t(32) == pytest.approx(t(17))


def test_all_to_all_over_full_mesh_is_bytes_per_link_plus_latency():
    x = 3e6
    traffic = np.full((8, 8), x)
    t = comm.collective_time("dispatch", traffic, MI, np.zeros(8, dtype=int), captured=True)
    assert t == pytest.approx(x / LINK + 21.8e-6)
    # one hot link binds the whole collective
    traffic[2, 5] = 2 * x
    t = comm.collective_time("combine", traffic, MI, np.zeros(8, dtype=int), captured=True)
    assert t == pytest.approx(2 * x / LINK + 21.8e-6)


def test_switch_and_nic_bind_per_gpu_port():
    h100 = load_profile("h100")
    x = 3e6
    traffic = np.full((8, 8), x)
    t = comm.collective_time("dispatch", traffic, h100, np.zeros(8, dtype=int), captured=True)
    assert t == pytest.approx(7 * x / h100.efficiency.link_bandwidth_usable + 21.8e-6)
    # two nodes of 8: each GPU sends 8 peers' worth over its NIC
    traffic = np.full((16, 16), x)
    nodes = np.arange(16) // 8
    t = comm.collective_time("dispatch", traffic, MI, nodes, captured=True)
    assert t == pytest.approx(8 * x / 45e9 + 21.8e-6)


def test_small_collectives_are_cheaper_inside_a_graph():
    traffic = np.full((8, 8), 1.0)
    eager = comm.collective_time("all_reduce", traffic, MI, np.zeros(8, dtype=int), False)
    graph = comm.collective_time("all_reduce", traffic, MI, np.zeros(8, dtype=int), True)
    assert eager == pytest.approx(13e-6, rel=1e-3) and graph == pytest.approx(6.8e-6, rel=1e-3)


def test_grouped_gemm_reads_only_the_experts_that_got_tokens():
    m = load_model("deepseek-r1")
    g = build_step_graph(m, make_plan(m, dp=8, ep=8, microbatches=1), Batch.decode(512, 2000))
    op = g.op("L5.moe.experts.mb0")
    per_expert_weights = 3 * 7168 * 2048 * (1 + 4 / 128 ** 2)  # FP8 + block scales
    counts = np.zeros(32)
    counts[:4] = 16  # 4 experts, 16 pairs each: one tile each
    t = gemm.grouped_gemm_time(op, MI, counts)
    act = (op.bytes - op.weight_bytes) / op.dims["pairs"]
    expect = max(op.flops / op.dims["pairs"] * 64 / FP8,
                 (4 * op.weight_bytes / 32 + 64 * act) / BW)
    assert op.weight_bytes / 32 == pytest.approx(per_expert_weights, rel=1e-3)
    assert t == pytest.approx(expect)


def test_attention_decode_occupancy_and_kv_dtype():
    assert attention.attention_occupancy(MI, 304, 512) == 1.0
    assert attention.attention_occupancy(MI, 1, 512) == pytest.approx(1 / 304)
    assert attention.attention_occupancy(MI, 305, 512) == pytest.approx(305 / 608)
    m = load_model("deepseek-r1")
    g8 = build_step_graph(m, make_plan(m, dp=8, ep=8), Batch.decode(512, 2100))
    g16 = build_step_graph(m, make_plan(m, dp=8, ep=8, kv_dtype="bf16"), Batch.decode(512, 2100))
    fp8, bf16 = g8.op("L3.attn.core.mb0"), g16.op("L3.attn.core.mb0")
    occ = 256 * 5 / (5 * 304)  # 256 seqs x ceil(2100 / 512) splits fill 5 waves of 304 CUs
    # the shipped MI300X profile: aiter's FP8 MLA decode kernel peaks at 367 TFLOP/s (PR #3188);
    # the BF16 kernel is taken at the same fraction of the (half as fast) BF16 matrix peak
    kernel_fp8, kernel_bf16 = 367e12, 367e12 * 1307.4 / 2614.9
    assert timing.op_time(fp8, MI) == pytest.approx(max(fp8.flops / kernel_fp8, fp8.bytes / BW) / occ)
    assert timing.op_time(bf16, MI) == pytest.approx(
        max(bf16.flops / kernel_bf16, bf16.bytes / BW) / occ)
    assert timing.op_time(bf16, MI) > timing.op_time(fp8, MI)
    # a profile without a published kernel rate: the GEMM's achievable rate in the cache's dtype
    data = json.loads(json.dumps(MI.raw))
    data["efficiency"].pop("attention_decode_flops")
    data["sources"].pop("efficiency.attention_decode_flops")
    plain = profile_from_dict(data)
    assert timing.op_time(fp8, plain) == pytest.approx(max(fp8.flops / FP8, fp8.bytes / BW) / occ)
    assert timing.op_time(bf16, plain) == pytest.approx(max(bf16.flops / BF16, bf16.bytes / BW) / occ)
    assert timing.op_time(bf16, plain) > timing.op_time(fp8, plain)


def test_profile_without_or_with_bad_efficiency(tmp_path):
    data = json.loads(json.dumps(MI.raw))
    data.pop("efficiency")
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    bare = load_profile(str(path))  # still a valid profile
    with pytest.raises(EpsimError, match="no 'efficiency' tables"):
        bare.require_efficiency()
    for mutate, message in [
        (lambda d: d["efficiency"].pop("hbm_fraction"), "lacks required key 'hbm_fraction'"),
        (lambda d: d["efficiency"].update(hbm_fraction=1.5), "hbm_fraction must be a fraction"),
        (lambda d: d["sources"].pop("efficiency.a2a_latency_s"), "efficiency.a2a_latency_s"),
        (lambda d: d["efficiency"]["gemm_flops_fraction"].pop("fp8"), "gemm_flops_fraction"),
    ]:
        data = json.loads(json.dumps(MI.raw))
        mutate(data)
        path.write_text(json.dumps(data))
        with pytest.raises(EpsimError, match=message):
            load_profile(str(path))


def test_every_efficiency_number_has_a_source():
    from epsim.sim.hardware.efficiency import EFFICIENCY_KEYS
    from epsim.sim.hardware.profile import shipped_profiles
    for name in shipped_profiles():
        p = load_profile(name)
        assert p.efficiency is not None
        for key in EFFICIENCY_KEYS:
            assert p.sources[f"efficiency.{key}"]
    assert math.isclose(MI.efficiency.comm_compute_slowdown, 64 / 304)
