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

PROFILE = Path(__file__).resolve().parents[2] / "data" / "mi300x-kernels-test.json"
#: round peaks: FP8 1 PFLOP/s, BF16 0.5, HBM 1 TB/s, fabric 100 GB/s, NIC 10 GB/s
ROOF = table_guard.Roof({"fp8": 1e15, "bf16": 5e14}, 1e12, 100e9, 10e9)
SOURCES = {"bench": {"repository": "example/kernels", "path": "bench.csv", "commit": "abc1234"}}


def kernels(*tables: dict) -> dict:
    return {"default": "s", "sources": SOURCES, "sets": {"s": {"tables": list(tables)}}}


def table(ks, op: str, scope: str = "intra"):
    """The set's one ``op`` table of ``scope``."""
    (found,) = [t for t in ks.sets["s"].tables.values() if t.op == op and t.scope == scope]
    return found


def gemm(*points: list) -> dict:
    return {"op": "gemm", "dtype": "fp8", "unit": "us", "source": "bench",
            "features": ["m", "n", "k"], "points": list(points)}


def test_gemm_implied_efficiency_by_hand():
    # m = n = k = 1000 in FP8: 2e9 FLOPs (2 us at peak); bytes: weights 1e6 + input 1e6 (1 byte
    # each) + BF16 output 2e6 = 4e6 (4 us at 1 TB/s): HBM-bound, 4 us of work
    ks = parse_kernels(kernels(gemm([1000, 1000, 1000, 8.0], [1000, 1000, 2000, 10.0])),
                       roof=ROOF)
    eff, ideal, bound = table_guard.implied(table(ks, "gemm"), ROOF)
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
    assert len(table(ks, "gemm")) == 2  # kept


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
    assert table_guard.implied(table(ks, "grouped_gemm"), ROOF)[0][0] == \
        pytest.approx(0.5)
    eff, _, bound = table_guard.implied(table(ks, "attention_decode"), ROOF)
    assert eff[0] == pytest.approx(0.5) and bound == ["hbm"]
    # causal prefill, BF16, 2 heads of 192 + 128, 100 fresh tokens: 2 x 2 x 5050 x 320 =
    # 6.464e6 FLOPs (0.013 us); bytes (2 x 100 queries/outputs + 100 shared K/V rows) x 320 x 2
    # = 192,000 (0.192 us): HBM-bound
    pre = {"op": "attention_prefill", "dtype": "bf16", "unit": "us", "source": "bench",
           "features": ["qk_dim", "v_dim", "heads", "context", "batch", "tokens"],
           "points": [[192, 128, 2, 100, 1, 100, 0.384]]}
    got = table_guard.implied(table(parse_kernels(kernels(pre), roof=ROOF), "attention_prefill"),
                              ROOF)
    assert got[0][0] == pytest.approx(0.5) and got[1][0] == pytest.approx(0.192e-6)


def test_collectives_against_the_fabric():
    # 8 ranks, 8e6 bytes: a full mesh moves 2 x 7/8 x 8e6 = 1.4e7 per GPU (140 us at 100 GB/s);
    # a switch that reduces in flight 7e6 (70 us); inter-node over the 10 GB/s NIC (the first
    # all-reduce costs 1.4e7 / 1e10 = 1400 us)
    ar = {"op": "all_reduce", "dtype": "bf16", "unit": "us", "source": "bench",
          "features": ["ranks", "bytes"], "points": [[8, 8e6, 280.0]]}
    inter = {**ar, "scope": "inter", "points": [[16, 8e6, 2800.0]]}
    ks = parse_kernels(kernels(ar, inter))
    intra_t, inter_t = table(ks, "all_reduce"), table(ks, "all_reduce", "inter")
    assert table_guard.implied(intra_t, ROOF)[0][0] == pytest.approx(0.5)
    switch = table_guard.Roof(ROOF.peak_flops, 1e12, 100e9, 10e9, switch_reduces=True)
    assert table_guard.implied(intra_t, switch)[0][0] == pytest.approx(0.25)
    eff, _, bound = table_guard.implied(inter_t, ROOF)
    assert eff[0] == pytest.approx(2 * 15 / 16 * 8e6 / 1e10 / 2.8e-3) and bound == ["nic"]
    # an exchange's bytes depend on routing the table does not state: not judged
    disp = {"op": "dispatch", "dtype": "fp8", "unit": "us", "source": "bench",
            "features": ["tokens", "ranks", "hidden"], "points": [[128, 8, 7168, 1e-3]]}
    ks = parse_kernels(kernels(disp), roof=ROOF)
    assert table_guard.implied(table(ks, "dispatch"), ROOF) is None
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


def test_a_moe_point_above_peak_only_as_modelled_is_flagged_not_refused():
    # 4 tokens x top-8 over 256 experts (hidden 1000, inter 500, FP8: 1.5e6 weight bytes per
    # expert). As the cost model counts it the 32 pairs reach 256 (1 - (255/256)^32) = 30.1
    # experts: 4.53e7 bytes (45.3 us at 1 TB/s); at the least (all four tokens on the same 8
    # experts) 8: 1.2096e7 bytes (12.1 us)
    def moe(us):
        return {"op": "grouped_gemm", "dtype": "fp8", "unit": "us", "source": "bench",
                "features": ["tokens", "experts", "top_k", "hidden", "inter"],
                "points": [[4, 256, 8, 1000, 500, us]]}
    active = 256 * (1 - (255 / 256) ** 32)
    modelled = (active * 1.5e6 + 32 * 1000 * 3) / 1e12
    ks = parse_kernels(kernels(moe(20.0)), roof=ROOF)
    (flag,) = ks.flagged
    assert flag.verdict == table_guard.BEYOND_MODEL
    assert flag.efficiency == pytest.approx(modelled / 20e-6)
    with pytest.raises(EpsimError, match="least work"):
        parse_kernels(kernels(moe(10.0)), roof=ROOF)  # 12.1 us of work in 10


def test_shipped_profiles_load_and_suspect_moe_rows_are_flagged():
    # aiconfigurator's Triton fused-MoE EP rows at 64-256-way EP imply under 1 % of the H100's
    # peaks; its TP rows imply more than the HBM bandwidth under uniform (or its own balanced)
    # routing: both kept, flagged. No shipped point is above peak at its least work.
    flags = load_profile("h100").kernels.flagged
    low = [f for f in flags if f.verdict == table_guard.BELOW_FLOOR]
    high = [f for f in flags if f.verdict == table_guard.BEYOND_MODEL]
    assert low and all(f.source == "aic-moe" and f.efficiency < 0.01 for f in low)
    assert high and all(f.source.startswith("aic-") and f.efficiency > 1.0 for f in high)
    assert not [f for f in flags if f.verdict == table_guard.ABOVE_PEAK]
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
