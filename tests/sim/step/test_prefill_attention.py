"""Prefill attention from measured tables (``attention_prefill``): lookup, the step, the
transfer across head widths, the roofline without a table, and the shipped tables."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from epsim.model import Batch, build_step_graph, load_model, make_plan
from epsim.sim.hardware.kernel_sets import lookup, parse_kernels
from epsim.sim.hardware.profile import load_profile, profile_from_dict
from epsim.sim.step.cost import attention, timing
from epsim.sim.step.simulate import simulate_step

R1 = load_model("deepseek-r1")
RAW = {k: v for k, v in load_profile("mi300x").raw.items() if k != "kernels"}
MI = profile_from_dict(RAW, "mi300x")  # the roofline alone
SRC = {"s": {"repository": "epsim/tests", "path": "synthetic", "commit": "abcdef0",
             "note": "SYNTHETIC planted prefill table"}}
FEATS = ["qk_dim", "v_dim", "heads", "context", "batch", "tokens"]


def _profile(points: list[list], kind: str = "attention_prefill") -> object:
    """The mi300x roofline profile with one planted bf16 table (us)."""
    table = {"op": kind, "dtype": "bf16", "unit": "us", "source": "s", "points": points,
             "features": FEATS if kind == "attention_prefill" else ["m", "n", "k"]}
    kernels = {"default": "t", "sources": SRC, "sets": {"t": {"tables": [table]}}}
    return profile_from_dict({**RAW, "kernels": kernels}, "planted")


def _prefill_op(prompt: int = 1024, tp: int = 8):
    plan = make_plan(R1, tp=tp)
    graph = build_step_graph(R1, plan, Batch.prefill(1, prompt))
    return next(op for op in graph if op.kind == "attention_prefill")


# the planted table at DeepSeek's MHA widths (192 / 128), 16 local heads (TP8), one sequence
PLANTED = [[192, 128, 16, 1024, 1, 1024, 500.0], [192, 128, 16, 4096, 1, 4096, 5000.0],
           [192, 128, 16, 1024, 2, 1024, 900.0]]


def test_lookup_of_a_planted_prefill_table():
    sets = parse_kernels({"default": "t", "sources": SRC, "sets": {"t": {"tables": [
        {"op": "attention_prefill", "dtype": "bf16", "unit": "us", "source": "s",
         "features": FEATS, "points": PLANTED}]}}})
    table = sets.sets["t"].table("attention_prefill", "bf16")
    feats = {"qk_dim": 192, "v_dim": 128, "heads": 16, "batch": 1}
    secs, how = lookup(table, {**feats, "context": 1024, "tokens": 1024})
    assert secs == 500e-6 and how.method == "table-exact" and how.points == (0,)
    # between batch 1 and 2 at 1024 tokens: log-log, halfway in log(batch) at sqrt(2)
    secs, how = lookup(table, {**feats, "batch": math.sqrt(2), "context": 1024,
                               "tokens": 1024})
    assert how.method == "table-interpolated"
    assert secs == pytest.approx(math.sqrt(500e-6 * 900e-6), rel=1e-12)


def test_the_prefill_op_and_step_use_the_table():
    prof = _profile(PLANTED)
    op = _prefill_op(1024)
    assert (op.dims["heads"], op.dims["seqs"], op.dims["new_tokens"]) == (16, 1, 1024)
    assert timing.op_time(op, prof) == 500e-6
    how = timing.describe(op, prof)
    assert how["method"] == "table-exact" and how["points"] == (0,)
    # the step: 61 layers, one prefill attention each, 0.5 ms apiece
    step = simulate_step(R1, make_plan(R1, tp=8), Batch.prefill(1, 1024), prof, explain=True)
    assert step.op_kinds_ms["attention_prefill"] == pytest.approx(61 * 0.5, rel=1e-12)
    ks = step.to_json()["kernel_sources"]["attention_prefill"]
    assert ks["method"] == "table-exact" and ks["sources"]["s"]["path"] == "synthetic"


def test_a_table_at_other_head_widths_is_transferred_by_the_flop_ratio():
    # measured at the absorbed-MLA widths 576 / 512 (aiconfigurator's Hopper kernel): both
    # roofline terms of the MHA op (192 / 128) scale with the head widths, so the ratio is
    # (192 + 128) / (576 + 512) whichever binds
    prof = _profile([[576, 512, 16, 1024, 1, 1024, 500.0]])
    op = _prefill_op(1024)
    flops = 2.0 * 16 * 1024 * 1025 / 2 * 320
    rope = 6.0 * 1024 * (16 * 64 + 64)  # the fused RoPE's FLOPs the graph adds to the op
    assert op.flops == flops + rope
    assert timing.op_time(op, prof) == pytest.approx(500e-6 * 320 / 1088, rel=1e-12)
    how = timing.describe(op, prof)
    assert how["method"] == "table-extrapolated"
    assert how["ratio"] == pytest.approx(320 / 1088, rel=1e-12)


def test_without_a_prefill_table_the_roofline_as_before():
    op = _prefill_op(4096)
    want = attention.attention_prefill_time(op, MI)
    # hand-computed: compute-bound at the achievable FP8 rate, 1273 TFLOP/s (the roofline's math
    # dtype follows the FP8 KV cache), attention and the fused RoPE's FLOPs
    flops = 2.0 * 16 * 4096 * 4097 / 2 * 320 + 6.0 * 4096 * (16 * 64 + 64)
    assert want == pytest.approx(flops / 1273e12, rel=1e-12) and op.bytes / 4.2e12 < want
    assert timing.op_time(op, MI) == want
    # a kernel set with tables, none of them for prefill attention: the same roofline
    other = _profile([[4096, 7168, 2048, 100.0]], kind="gemm")
    assert timing.op_time(op, other) == want
    assert timing.describe(op, other)["method"] == "roofline"


def test_shipped_prefill_tables():
    h200 = load_profile("h200")
    table = h200.kernels.sets["sglang"].table("attention_prefill", "bf16")
    # aiconfigurator's h200 context MLA row: 128 heads, 1 x 4096 tokens, 3.917931 ms
    secs, how = lookup(table, {"qk_dim": 576, "v_dim": 512, "heads": 128, "context": 4096,
                               "batch": 1, "tokens": 4096})
    assert how.method == "table-exact" and secs == pytest.approx(3.917931365966796e-3, rel=1e-9)
    plan = make_plan(load_model("deepseek-v3"), dp=8)
    graph = build_step_graph(load_model("deepseek-v3"), plan, Batch.prefill(1, 4096))
    op = next(o for o in graph if o.kind == "attention_prefill")
    assert (op.dims["heads"], op.dims["seqs"], op.dims["new_tokens"]) == (128, 1, 4096)
    assert timing.op_time(op, h200) == pytest.approx(3.917931365966796e-3 * 320 / 1088,
                                                      rel=1e-9)
    mi = load_profile("mi300x").kernels.sets["aiter"].table("attention_prefill", "bf16")
    assert mi.sources[0] == "aiter-mha-fwd-mi300x" and len(mi) == 31
    # a MI300X point is the README's TFLOP/s turned into time by the benchmark's FLOP count:
    # b 1, 64 heads, 4096 causal at 474.385 TFLOP/s
    secs, _ = lookup(mi, {"qk_dim": 128, "v_dim": 128, "heads": 64, "context": 4096,
                          "batch": 1, "tokens": 4096})
    assert secs == pytest.approx(64 * 2 * 4096 * 4097 / 2 * 256 / 474.385e12, rel=1e-5)


def test_the_builder_derives_aiter_times_from_tflops():
    spec = importlib.util.spec_from_file_location(
        "build_kernel_tables", Path(__file__).parents[3] / "tools" / "build_kernel_tables.py")
    bkt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bkt)

    sources, table = bkt.aiter_mha_prefill("MI325X")
    assert table["op"] == "attention_prefill" and table["features"] == FEATS
    assert "applied unchanged to MI325X" in sources["aiter-mha-fwd-mi300x"]["note"]
    # the first row: b 1, 32 heads, 1024 causal at 130.62 TFLOP/s
    first = table["points"][0]
    assert first[:6] == [128, 128, 32, 1024, 1, 1024]
    assert first[6] == round(32 * 2 * 1024 * 1025 / 2 * 256 / 130.62e12 * 1e6, 4)
