"""vLLM's custom all-reduce on AMD in the shipped profiles (tools/build_kernel_tables.py,
``amd_all_reduce``): the points transcribed from vLLM PRs #19744 (MI300X, 4 GPUs) and #39080
(MI355X, 8 GPUs), and a TP8 decode step whose all-reduce takes the table's time."""

import pytest

from epsim.model import Batch, build_step_graph, load_model, make_plan
from epsim.model.plan import Fusion
from epsim.sim.hardware.kernel_sets import lookup
from epsim.sim.hardware.profile import load_profile
from epsim.sim.step.cost import timing

R1 = load_model("deepseek-r1")


def _all_reduce(name):
    p = load_profile(name)
    return p, p.kernels.sets[p.kernels.default].table("all_reduce", "bf16", "intra", "", "")


def test_mi355x_table_is_vllm_pr_39080_tp8_column():
    p, table = _all_reduce("mi355x")
    # tokens x 3072 x 2 bytes: 4 tokens (24 KiB) 6.3 us, 256 tokens (1.5 MiB) 24.2 us
    for bytes_, us in ((4 * 3072 * 2, 6.3), (256 * 3072 * 2, 24.2)):
        secs, how = lookup(table, {"ranks": 8, "bytes": bytes_})
        assert how.method == "table-exact" and secs == pytest.approx(us * 1e-6, rel=1e-9)
    assert set(table.sources) == {"vllm-car-mi355x"}
    assert "pull/39080" in p.kernels.sources["vllm-car-mi355x"].url


def test_mi300x_mi325x_tables_are_vllm_pr_19744_tp4_baseline():
    for name in ("mi300x", "mi325x"):
        p, table = _all_reduce(name)
        secs, how = lookup(table, {"ranks": 4, "bytes": 2048})
        assert how.method == "table-exact" and secs == pytest.approx(7.18e-6, rel=1e-9)
        assert lookup(table, {"ranks": 4, "bytes": 4 * 1024 ** 2})[0] == \
            pytest.approx(63.86e-6, rel=1e-9)
        # vLLM's custom all-reduce runs below 8 MiB only: the PR's 8 MB point is left out
        assert table.x[:, 1].max() < 8 * 1024 ** 2
    assert "assumption" in load_profile("mi325x").kernels.sources[
        "vllm-car-mi300x-to-mi325x"].note


def test_tp8_decode_all_reduce_takes_the_table_time():
    p, table = _all_reduce("mi355x")
    plan = make_plan(R1, tp=8, microbatches=1, fusion=Fusion(**p.plan_options))
    graph = build_step_graph(R1, plan, Batch.decode(4, 1100))
    op = next(o for o in graph if o.kind == "all_reduce" and ".attn." in o.id)
    # 4 tokens x hidden 7168 x 2 bytes, between the 48 KiB (6.7 us) and 96 KiB (7.6 us) points
    assert op.dims["group_size"] == 8
    want, how = lookup(table, {"ranks": 8, "bytes": 4 * 7168 * 2})
    assert how.method == "table-interpolated" and 6.7e-6 < want < 7.6e-6
    assert timing.op_time(op, p) == pytest.approx(want, rel=1e-9)
