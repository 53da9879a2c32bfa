"""The shipped profiles' measured kernel tables (sim/hardware/profiles/*.json, ``kernels``).

They are written by tools/build_kernel_tables.py from copies of the published tables; these
tests check what the profiles carry (sources, exact reproduction of published points, the
MI325X -> MI300X transfer rule) and the two acceptance figures: aiter's fused MoE on MI325X
(EP8, 512 and 256 sequences per rank) and DeepGEMM's masked grouped GEMM on H800 (EP128).
``EPSIM_KERNEL_SOURCES=<folder>`` (the copied sources) also checks that the tool reproduces the
committed profiles; without it that test skips (the suite never needs the sources).
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from epsim.model import Batch, load_model, make_plan
from epsim.model.plan import Fusion
from epsim.sim.hardware.kernel_sets import lookup
from epsim.sim.hardware.profile import load_profile, shipped_profiles
from epsim.sim.step.cost import timing
from epsim.sim.step.simulate import simulate_step

REPO = Path(__file__).resolve().parents[3]
PROFILES = REPO / "src" / "epsim" / "sim" / "hardware" / "profiles"
R1 = load_model("deepseek-r1")
SETS = {"mi300x": ("aiter", "no-aiter"), "mi325x": ("aiter",), "mi355x": ("aiter",),
        "h100": ("sglang", "sglang-triton"), "h200": ("sglang", "sglang-triton"),
        "h800": ("deepseek",)}


def _table(profile, kind, dtype, scope="intra", kset=None, mode="", layout=""):
    p = load_profile(profile)
    return p.kernels.sets[kset or p.kernels.default].table(kind, dtype, scope, mode, layout)


def _at(table, **features):
    secs, how = lookup(table, features)
    return secs, how.method


def _step(hardware, *, nodes=1, dp=8, ep=8, batch=512, context=2100):
    profile = load_profile(hardware)
    # the set's plan options, as the commands apply them (with_implied_fusions)
    plan = make_plan(R1, nodes=nodes, dp=dp, ep=ep, microbatches=1,
                     fusion=Fusion(**profile.plan_options))
    return simulate_step(R1, plan, Batch.decode(batch, context), profile, synthetic="uniform",
                         explain=True)


# -- every shipped profile ----------------------------------------------------------------


def test_every_shipped_profile_loads_with_its_kernel_sets():
    assert set(SETS) <= set(shipped_profiles())
    for name, sets in SETS.items():
        p = load_profile(name)
        assert p.kernels is not None and p.kernel_set == sets[0] == p.kernels.default
        assert p.kernel_sets == (*sets, "none")
        # the wheel carries every profile: keep each under half a megabyte
        assert (PROFILES / f"{name}.json").stat().st_size < 512 * 1024
        text = (PROFILES / f"{name}.json").read_text()
        assert "/work/" not in text and "kernel-sources" not in text  # no local paths
    assert load_profile("mi300x").plan_options == {"shared_expert_in_moe": True}
    assert load_profile("mi325x").plan_options == {"shared_expert_in_moe": True}
    assert load_profile("mi300x", "no-aiter").plan_options == {"shared_expert_in_moe": False}
    assert load_profile("h800").plan_options == {"shared_expert_in_moe": False}


def test_every_point_has_a_complete_source():
    for name in SETS:
        p = load_profile(name)
        used = set()
        for kset in p.kernels.sets.values():
            used.update(source for _, source in kset.speedup.values())
            for table in kset.tables.values():
                used.update(table.sources)
        for sid in used:
            s = p.kernels.sources[sid]
            assert s.url or (s.repository and s.path and (s.commit or s.pr)), (name, sid)
            assert s.note, (name, sid)
        derived = [sid for sid in used if "DERIVED" in p.kernels.sources[sid].note]
        # a derived time says so and states how (a formula or a rule)
        for sid in derived:
            assert "=" in p.kernels.sources[sid].note, (name, sid)


def test_every_published_point_is_reproduced_exactly():
    for name in SETS:
        for kset in load_profile(name).kernels.sets.values():
            for table in kset.tables.values():
                for i, row in enumerate(table.x):
                    secs, how = lookup(table, dict(zip(table.features, row, strict=True)))
                    assert secs == table.seconds[i] and how.method == "table-exact", \
                        (name, table.where, i)


# -- MI325X / MI300X (aiter, MORI) ------------------------------------------------------------


def test_mi325x_published_points():
    moe = _table("mi325x", "grouped_gemm", "fp8")
    # the CSV's us column (470.7513, 671.5514, ...): the doubles nearest the published decimals
    for tokens, us in ((256, 470.7513e-6), (512, 671.5514e-6), (1, 99.21e-6),
                       (16384, 13796.9001e-6)):
        assert _at(moe, tokens=tokens, experts=33, top_k=9, hidden=7168, inter=2048) == \
            (us, "table-exact")
    gemm = _table("mi325x", "gemm", "fp8")
    assert len(gemm) == 295 and len(moe) == 15
    # a PR #2881 row (MI300X-measured) and a PR #3951 row (MI325X)
    assert _at(gemm, m=64, n=7168, k=2048) == (11.0504e-6, "table-exact")
    i = next(i for i, row in enumerate(gemm.x) if tuple(row) == (1, 7168, 2048, 64))
    assert gemm.sources[i] == "aiter-gemm-mi300x"
    assert _at(gemm, m=256, n=1536, k=7168) == (26.0228e-6, "table-exact")
    j = next(i for i, row in enumerate(gemm.x) if tuple(row) == (1, 1536, 7168, 256))
    assert gemm.sources[j] == "aiter-gemm-mi325x"
    assert sum(s == "aiter-gemm-mi300x" for s in gemm.sources) == 37
    # MORI-EP: measured on MI300X, applied to MI325X (same xGMI fabric), said in the source
    for profile in ("mi300x", "mi325x"):
        d = _table(profile, "dispatch", "fp8")
        c = _table(profile, "combine", "bf16")
        assert _at(d, tokens=128, ranks=8, hidden=7168) == (35e-6, "table-exact")
        assert _at(c, tokens=128, ranks=8, hidden=7168) == (47e-6, "table-exact")
        # 4096 tokens: derived from 307 / 330 GB/s
        rows = 4096 * 8 * (1 - math.comb(224, 8) / math.comb(256, 8))
        assert _at(d, tokens=4096, ranks=8, hidden=7168)[0] == pytest.approx(
            rows * 7168 / 307e9, rel=1e-5)
        assert _at(c, tokens=4096, ranks=8, hidden=7168)[0] == pytest.approx(
            rows * 7168 * 2 / 330e9, rel=1e-5)
    note = load_profile("mi325x").kernels.sources["mori-mi300x"].note
    assert "MI300X" in note and "applied unchanged to MI325X" in note


def test_mi300x_tables_transfer_the_mi325x_rows_by_hbm_bandwidth():
    r = 6.0 / 5.3
    for kind in ("grouped_gemm", "gemm"):
        a, b = _table("mi325x", kind, "fp8"), _table("mi300x", kind, "fp8")
        assert np.array_equal(a.x, b.x)
        for i in range(len(a)):
            if b.sources[i] == "aiter-gemm-mi300x":  # measured on MI300X: the same on both
                assert b.published[i] == a.published[i] and a.sources[i] == b.sources[i]
                continue
            assert b.sources[i].endswith("-to-mi300x")
            ratio = b.published[i] / a.published[i]
            assert 1.0 <= ratio <= r + 1e-4, (kind, i, ratio)
    # memory-bound fused MoE (few tokens: the 33 experts' weights) slows by most of r
    moe = _table("mi300x", "grouped_gemm", "fp8")
    ref = _table("mi325x", "grouped_gemm", "fp8")
    k = next(i for i, row in enumerate(ref.x) if row[-1] == 32)
    assert moe.published[k] / ref.published[k] > 1.1
    assert "t_300" not in load_profile("mi300x").kernels.sources["aiter-gemm-mi300x"].note
    rule = load_profile("mi300x").kernels.sources["aiter-gemm-mi325x-to-mi300x"].note
    assert "DERIVED" in rule and "6.0 / 5.3" in rule


def test_mi300x_no_aiter_is_aiter_over_the_up_to_speedups():
    aiter, slow = load_profile("mi300x"), load_profile("mi300x", "no-aiter")
    plan = make_plan(R1, dp=8, ep=8, microbatches=1, fusion=Fusion(shared_expert_in_moe=True))
    from epsim.model import build_step_graph
    graph = build_step_graph(R1, plan, Batch.decode(256, 2100))
    for name, factor in (("L3.moe.experts_shared.mb0", 3.0), ("L3.attn.q_a.mb0", 2.0),
                         ("L3.attn.core.mb0", 17.0)):
        op = next(o for o in graph if o.id == name)
        assert timing.op_time(op, slow) == pytest.approx(factor * timing.op_time(op, aiter),
                                                       rel=1e-12)
    desc = slow.kernels.sets["no-aiter"].description
    assert "'up to'" in desc and "bound" in desc


def test_mi325x_acceptance_fused_moe_per_layer():
    for batch, us in ((512, 671.55), (256, 470.75)):
        r = _step("mi325x", batch=batch)
        per_layer = r.op_kinds_ms["grouped_gemm"] / 58 * 1e3
        assert per_layer == pytest.approx(us, rel=0.10), (batch, per_layer)
        assert r.kernel_sources["grouped_gemm"]["methods"] in (
            {"table-interpolated": 58}, {"table-exact": 58},
            {"table-exact": 58 - 1, "table-interpolated": 1})


def test_mi355x_tables():
    p = load_profile("mi355x")
    assert {key[:3] for key in p.kernels.sets["aiter"].tables} == {("gemm", "fp8", "intra"),
                                                  ("dispatch", "fp8", "intra"),
                                                  ("combine", "bf16", "intra"),
                                                  ("dispatch", "fp8", "inter"),
                                                  ("combine", "bf16", "inter"),
                                                  ("all_reduce", "bf16", "intra")}
    gemm = _table("mi355x", "gemm", "fp8")
    assert gemm.x[:, -1].max() <= 32768
    # the DP-attention shapes MI300X lacks: q_b 24576 x 1536, o_proj 7168 x 16384
    assert {(24576, 1536), (7168, 16384)} <= {(int(n), int(k)) for n, k in gemm.x[:, 1:3]}
    assert _at(_table("mi355x", "dispatch", "fp8"), tokens=128, ranks=8, hidden=7168) == \
        (31e-6, "table-exact")
    assert "no EP8" in p.kernels.sets["aiter"].description


# -- H100 / H200 (aiconfigurator, SGLang) ------------------------------------------------------


def test_h100_h200_published_points():
    # figures read independently from the parquet files (docs/hardware.md)
    # the Triton fused MoE's EP rows: set sglang-triton (SGLang's EP without DeepEP)
    h100_moe = _table("h100", "grouped_gemm", "fp8", kset="sglang-triton", layout="ep")
    secs, method = _at(h100_moe, tokens=2048 / 8, experts=32, top_k=8, hidden=7168, inter=2048)
    assert method == "table-exact" and secs == pytest.approx(1746e-6, rel=2e-3)
    secs, _ = _at(_table("h200", "grouped_gemm", "fp8", kset="sglang-triton", layout="ep"),
                  tokens=256 / 8, experts=32, top_k=8, hidden=7168, inter=2048)
    assert secs == pytest.approx(481e-6, rel=2e-3)
    # MLA decode, 128 local heads: batch 128 x context 4096, BF16 KV ~272 us, FP8 KV ~4x slower
    bf16 = _at(_table("h100", "attention_decode", "bf16"), heads=128, batch=128, context=4096)
    fp8 = _at(_table("h100", "attention_decode", "fp8"), heads=128, batch=128, context=4096)
    assert bf16[1] == fp8[1] == "table-exact"
    assert bf16[0] == pytest.approx(272e-6, rel=0.01) and fp8[0] > 3 * bf16[0]
    # all-reduce: bytes = 2 x message_size elements; under 8 MiB SGLang's custom all-reduce
    # (graph rows): 8 GPUs, 2 MiB ~20.1 us, 512 B ~3.3 us; from 8 MiB NCCL: 8 MiB ~78.9 us
    table = _table("h100", "all_reduce", "bf16")
    secs, method = _at(table, ranks=8, bytes=2 * 1024 * 1024)
    assert method == "table-exact" and secs == pytest.approx(20.1e-6, rel=0.01)
    assert _at(table, ranks=8, bytes=512)[0] == pytest.approx(3.32e-6, rel=0.01)
    assert _at(table, ranks=8, bytes=8 * 1024 * 1024)[0] == pytest.approx(78.9e-6, rel=0.01)
    # DeepEP low latency, EP8, 128 tokens per rank: 36.7 / 67.0 us
    assert _at(_table("h100", "dispatch", "fp8"), tokens=128, ranks=8, hidden=7168)[0] == \
        pytest.approx(36.7e-6, rel=0.01)
    assert _at(_table("h100", "combine", "bf16"), tokens=128, ranks=8, hidden=7168)[0] == \
        pytest.approx(67.0e-6, rel=0.01)
    gemm = _table("h100", "gemm", "fp8")
    assert _at(gemm, m=256, n=7168, k=16384)[0] == pytest.approx(61.4e-6, rel=0.01)


def test_h100_h200_deployed_moe_points():
    # figures read independently from the parquet files: tokens = num_tokens / ep (per rank),
    # experts = 256 / ep; the uniform rows. Wide-EP decode, masked: EP64, 8192 tokens 0.110 ms
    moe = dict(top_k=8, hidden=7168)
    masked = _table("h100", "grouped_gemm", "fp8", mode="low_latency", layout="ep")
    secs, method = _at(masked, tokens=8192 / 64, experts=4, inter=2048, **moe)
    assert method == "table-exact" and secs == pytest.approx(0.110e-3, rel=0.01)
    # wide-EP prefill, contiguous: EP32, 131072 tokens 3.647 ms
    contiguous = _table("h100", "grouped_gemm", "fp8", mode="normal", layout="ep")
    secs, method = _at(contiguous, tokens=131072 / 32, experts=8, inter=2048, **moe)
    assert method == "table-exact" and secs == pytest.approx(3.647e-3, rel=0.01)
    # a row faster than reading its experts' weights at the HBM peak is refused at build time:
    # EP2, 32 tokens, 0.415 ms would read 128 x 44 MB at 13.6 TB/s
    assert not ((contiguous.x[:, 2] == 128) & (contiguous.x[:, 4] == 16)).any()
    assert "REFUSED 14 row(s)" in load_profile("h100").kernels.sources[
        "aic-wideep-moe-prefill"].note
    # TP-only: the Triton kernel's TP rows, all 256 experts at inter 2048 / tp; TP8, 32 tokens
    tp = _table("h100", "grouped_gemm", "fp8", layout="tp")
    secs, method = _at(tp, tokens=32, experts=256, inter=256, **moe)
    assert method == "table-exact" and secs == pytest.approx(0.3005e-3, rel=0.01)
    assert _table("h200", "grouped_gemm", "fp8", mode="low_latency", layout="ep") is not None


# -- H800 (DeepGEMM, DeepEP) -------------------------------------------------------------------


def test_h800_profile():
    p = load_profile("h800")
    assert p.peak("fp8") == 1978e12 and p.hbm_bandwidth == 3.35e12
    assert p.fabric.topology == "switch" and p.fabric.gpu_bandwidth == 200e9
    assert p.nic_bandwidth_per_gpu == 50e9 and p.gpus_per_node == 8
    assert p.efficiency.attention_decode_flops == {"fp8": 660e12, "bf16": 660e12}
    for key in ("compute_units", "cache_bytes", "efficiency.a2a_latency_s",
                "efficiency.graph_node_s", "efficiency.comm_compute_slowdown"):
        assert p.sources[key].startswith("borrowed from h100"), key


def test_h800_published_points():
    moe = _table("h800", "grouped_gemm", "fp8")
    # 2 groups x 512 rows: up/gate 1040 TFLOPS (57.8 us) + down 916 TFLOPS (32.8 us)
    up = 2 * 2 * 512 * 4096 * 7168 / 1040e12
    down = 2 * 2 * 512 * 7168 * 2048 / 916e12
    secs, method = _at(moe, tokens=128, experts=2, top_k=8, hidden=7168, inter=2048)
    assert method == "table-exact" and secs == pytest.approx(up + down, abs=1e-9)
    assert len(moe) == 3
    dense = _table("h800", "gemm", "fp8")
    assert _at(dense, m=4096, n=7168, k=16384)[0] == pytest.approx(
        2 * 4096 * 7168 * 16384 / 1520e12, abs=1e-9)
    ll = _table("h800", "dispatch", "fp8", "inter", mode="low_latency")
    assert _at(ll, tokens=128, ranks=128, hidden=7168) == (192e-6, "table-exact")
    assert _at(_table("h800", "combine", "bf16"), tokens=128, ranks=8, hidden=7168) == \
        (114e-6, "table-exact")


def test_h800_acceptance_masked_grouped_gemm_per_layer():
    r = _step("h800", nodes=16, dp=128, ep=128, batch=128, context=4096)
    per_layer = r.op_kinds_ms["grouped_gemm"] / 58 * 1e3
    assert per_layer == pytest.approx(57.8 + 32.8, rel=0.15), per_layer


# -- the tool ----------------------------------------------------------------------------------


def test_the_tool_reproduces_the_committed_profiles():
    sources = os.environ.get("EPSIM_KERNEL_SOURCES")
    if not sources:
        pytest.skip("EPSIM_KERNEL_SOURCES (the copied kernel tables) not set")
    pytest.importorskip("pyarrow")
    r = subprocess.run([sys.executable, str(REPO / "tools" / "build_kernel_tables.py"),
                        "--sources", sources, "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_tool_writes_what_the_profiles_hold():
    # without the sources: the writer's format round-trips each committed profile
    spec = importlib.util.spec_from_file_location("build_kernel_tables",
                                                  REPO / "tools" / "build_kernel_tables.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for name in SETS:
        text = (PROFILES / f"{name}.json").read_text()
        assert tool.dumps(json.loads(text)) + "\n" == text
    assert tool.p_hit(8) == pytest.approx(0.6618, abs=1e-4)
