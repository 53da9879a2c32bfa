"""The table guard (sim/hardware/table_guard.py): each kernel-table point's implied efficiency
against the device's roofline, hand-computed; a point above peak refused with its source named;
one below the floor kept and flagged; tiny shapes exempt; ``--explain`` prints it."""

import copy
import json
from pathlib import Path

import pytest

from epsim.cli import main
from epsim.model.errors import EpsimError
from epsim.sim.hardware import table_guard
from epsim.sim.hardware.kernel_sets import parse_kernels
from epsim.sim.hardware.profile import load_profile, profile_from_dict

PROFILE = Path(__file__).parent / "data" / "mi300x-kernels-test.json"
#: round peaks: FP8 1 PFLOP/s, BF16 0.5, HBM 1 TB/s, fabric 100 GB/s, NIC 10 GB/s
ROOF = table_guard.Roof({"fp8": 1e15, "bf16": 5e14}, 1e12, 100e9, 10e9)
SOURCES = {"bench": {"repository": "example/kernels", "path": "bench.csv", "commit": "abc1234"}}


def kernels(*tables: dict) -> dict:
    return {"default": "s", "sources": SOURCES, "sets": {"s": {"tables": list(tables)}}}


def gemm(*points: list) -> dict:
    return {"op": "gemm", "dtype": "fp8", "unit": "us", "source": "bench",
            "features": ["m", "n", "k"], "points": list(points)}


def test_gemm_implied_efficiency_by_hand():
    # m = n = k = 1000 in FP8: 2e9 FLOPs (2 us at peak); bytes: weights 1e6 + input 1e6 (1 byte
    # each) + BF16 output 2e6 = 4e6 (4 us at 1 TB/s): HBM-bound, 4 us of work
    ks = parse_kernels(kernels(gemm([1000, 1000, 1000, 8.0], [1000, 1000, 2000, 10.0])),
                       roof=ROOF)
    table = ks.sets["s"].tables[("gemm", "fp8", "intra")]
    eff, ideal, bound = table_guard.implied(table, ROOF)
    assert eff[0] == pytest.approx(0.5) and ideal[0] == pytest.approx(4e-6)
    assert bound[0] == "hbm"
    # k = 2000: 4e9 FLOPs = 4 us; bytes 2e6 + 2e6 + 2e6 = 6 us: 6 / 10
    assert eff[1] == pytest.approx(0.6)
    assert ks.flagged == ()


def test_a_point_above_peak_is_refused_naming_table_point_and_source():
    with pytest.raises(EpsimError) as err:
        # m = 2000: 4e9 FLOPs (4 us), bytes 1e6 + 2e6 + 4e6 (7 us) in 5 us
        parse_kernels(kernels(gemm([1000, 1000, 1000, 8.0], [2000, 1000, 1000, 5.0])),
                      "planted.json", ROOF)
    text = str(err.value)
    assert "\n" not in text
    assert "planted.json" in text and "kernels.sets.s.tables[0].points[1]" in text
    assert "140.0% of the hbm roof" in text
    assert "source bench (example/kernels bench.csv abc1234)" in text
    # without a roof (no guard) the same table loads
    assert parse_kernels(kernels(gemm([1000, 1000, 1000, 3.0])))


def test_below_the_floor_is_flagged_and_kept_unless_the_shape_is_tiny():
    # 4 us of work in 500 us: 0.8 % < 1 %, flagged; m = n = k = 10: 1.3e-4 us of work in 50 us
    # (launch cost, not the kernel): exempt
    ks = parse_kernels(kernels(gemm([1000, 1000, 1000, 500.0], [10, 10, 10, 50.0])), roof=ROOF)
    (flag,) = ks.flagged
    assert flag.point == 0 and flag.verdict == table_guard.BELOW_FLOOR
    assert flag.efficiency == pytest.approx(0.008) and flag.source == "bench"
    assert len(ks.sets["s"].tables[("gemm", "fp8", "intra")]) == 2  # kept


def test_grouped_gemm_and_attention_by_hand():
    # fused MoE: 10 tokens x top-1 on 1 expert, hidden 1000, inter 500: 6 x 10 x 1000 x 500 =
    # 3e7 FLOPs (0.03 us); bytes: 3 x 1000 x 500 (FP8 weights) + 10 x 1000 x (1 + 2) = 1.53e6
    # (1.53 us): HBM-bound
    moe = {"op": "grouped_gemm", "dtype": "fp8", "unit": "us", "source": "bench",
           "features": ["tokens", "experts", "top_k", "hidden", "inter"],
           "points": [[10, 1, 1, 1000, 500, 3.06]]}
    # MLA decode, BF16 cache: batch 2, context 1000, heads 16, 576 + 512 wide: FLOPs 2 x 2 x 16
    # x 1000 x 1088 = 6.9632e7 (0.139 us at BF16); bytes 2 x 1000 x 576 x 2 + 2 x 16 x 1088 x 2
    # = 2,373,632 (2.373632 us): HBM-bound
    att = {"op": "attention_decode", "dtype": "bf16", "unit": "us", "source": "bench",
           "features": ["batch", "context", "heads"], "points": [[2, 1000, 16, 4.747264]]}
    ks = parse_kernels(kernels(moe, att), roof=ROOF)
    s = ks.sets["s"].tables
    assert table_guard.implied(s[("grouped_gemm", "fp8", "intra")], ROOF)[0][0] == \
        pytest.approx(0.5)
    eff, _, bound = table_guard.implied(s[("attention_decode", "bf16", "intra")], ROOF)
    assert eff[0] == pytest.approx(0.5) and bound == ["hbm"]


def test_collectives_against_the_fabric():
    # 8 ranks, 8e6 bytes: a full mesh moves 2 x 7/8 x 8e6 = 1.4e7 per GPU (140 us at 100 GB/s);
    # a switch that reduces in flight 7e6 (70 us); inter-node over the 10 GB/s NIC (the first
    # all-reduce costs 1.4e7 / 1e10 = 1400 us)
    ar = {"op": "all_reduce", "dtype": "bf16", "unit": "us", "source": "bench",
          "features": ["ranks", "bytes"], "points": [[8, 8e6, 280.0]]}
    inter = {**ar, "scope": "inter", "points": [[16, 8e6, 2800.0]]}
    ks = parse_kernels(kernels(ar, inter))
    intra_t = ks.sets["s"].tables[("all_reduce", "bf16", "intra")]
    inter_t = ks.sets["s"].tables[("all_reduce", "bf16", "inter")]
    assert table_guard.implied(intra_t, ROOF)[0][0] == pytest.approx(0.5)
    switch = table_guard.Roof(ROOF.peak_flops, 1e12, 100e9, 10e9, switch_reduces=True)
    assert table_guard.implied(intra_t, switch)[0][0] == pytest.approx(0.25)
    eff, _, bound = table_guard.implied(inter_t, ROOF)
    assert eff[0] == pytest.approx(2 * 15 / 16 * 8e6 / 1e10 / 2.8e-3) and bound == ["nic"]
    # an exchange's bytes depend on routing the table does not state: not judged
    disp = {"op": "dispatch", "dtype": "fp8", "unit": "us", "source": "bench",
            "features": ["tokens", "ranks", "hidden"], "points": [[128, 8, 7168, 1e-3]]}
    ks = parse_kernels(kernels(disp), roof=ROOF)
    assert table_guard.implied(ks.sets["s"].tables[("dispatch", "fp8", "intra")], ROOF) is None
    assert table_guard.skipped("dispatch")


def test_a_user_profile_with_an_impossible_point_is_one_line_exit_2(tmp_path, capsys):
    raw = json.loads(PROFILE.read_text())
    planted = copy.deepcopy(raw)
    planted["kernels"]["sources"]["fast"] = {"url": "https://example.com/too-fast"}
    gemm_fp8 = [t for s in planted["kernels"]["sets"].values() for t in s.get("tables", [])
                if t["op"] == "gemm"]
    assert gemm_fp8, "the test profile has a GEMM table"
    table = gemm_fp8[0]
    names = table["features"]
    point = {"m": 4096, "n": 7168, "k": 7168}
    # 4.2e11 FLOPs in 1 us: hundreds of times the MI300X's FP8 peak
    table["points"].append([point.get(n, 1) for n in names] + [1.0, "fast"])
    path = tmp_path / "planted.json"
    path.write_text(json.dumps(planted))
    with pytest.raises(EpsimError, match="https://example.com/too-fast"):
        profile_from_dict(planted, "planted")
    capsys.readouterr()
    assert main(["step", "--model", "deepseek-r1", "--hardware", str(path), "--tp", "8",
                 "--batch", "4", "--context", "1100"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "above the device's peak" in err


def test_shipped_profiles_load_and_h100_moe_rows_are_flagged():
    # aiconfigurator's Triton fused-MoE rows at EP 128 / 256 (2 and 1 local experts) imply
    # under 1 % of the H100's peaks: kept, flagged; no shipped point is above peak
    flags = load_profile("h100").kernels.flagged
    assert flags and {f.table for f in flags} == {"kernels.sets.sglang.tables[2]"}
    assert all(f.source == "aic-moe" and f.efficiency < 0.01 for f in flags)
    assert load_profile("mi300x").kernels.flagged == ()


def test_explain_prints_each_lookups_implied_efficiency(capsys):
    argv = ["step", "--model", "deepseek-r1", "--hardware", "mi300x", "--tp", "8", "--batch",
            "4", "--context", "1100", "--explain"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    points = out["kernel_sources"]["gemm"]["points"]
    assert points and all(0 < p["implied_efficiency"] <= 1 and p["bound"] in
                          table_guard.BOUNDS for p in points)
    assert main(argv) == 0
    assert "% of the hbm roof" in capsys.readouterr().out
