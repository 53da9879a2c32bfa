"""The op graph against hand-computed FLOPs and bytes (DeepSeek-R1 decode, DP8/EP8)."""

from math import comb

import networkx as nx
import pytest

from epsim.model import Batch, Fusion, build_step_graph, load_model, make_plan
from epsim.model.errors import EpsimError
from epsim.model.ids import expert_weight_key, op_id, weight_key
from epsim.model.opgraph import KIND_DIMS, OP_CATEGORIES, OP_KINDS

R1 = load_model("deepseek-r1")
B, T = 512, 2000
H, HID = 128, 7168


@pytest.fixture(scope="module")
def g():
    plan = make_plan(R1, dp=8, ep=8, microbatches=1)
    return build_step_graph(R1, plan, Batch.decode(B, T))


def test_mla_projections(g):
    assert g.op("L5.attn.q_a.mb0").flops == 2 * B * 7168 * 1536
    assert g.op("L5.attn.q_b.mb0").flops == 2 * B * 1536 * H * (128 + 64)
    assert g.op("L5.attn.kv_a.mb0").flops == 2 * B * 7168 * (512 + 64)
    assert g.op("L5.attn.q_absorb.mb0").flops == 2 * H * B * 128 * 512
    assert g.op("L5.attn.v_absorb.mb0").flops == 2 * H * B * 512 * 128
    assert g.op("L5.attn.o_proj.mb0").flops == 2 * B * H * 128 * 7168
    # FP8 weights (1 byte + a fp32 scale per 128x128 block), bf16 activations in and out
    q_a = g.op("L5.attn.q_a.mb0")
    assert q_a.weight_bytes == pytest.approx(7168 * 1536 * (1 + 4 / 16384))
    assert q_a.bytes_read == pytest.approx(q_a.weight_bytes + B * 7168 * 2)
    assert q_a.bytes_written == B * 1536 * 2
    assert q_a.dtype == "fp8"


def test_attention_core(g):
    core = g.op("L5.attn.core.mb0")
    assert core.kind == "attention_decode"
    # scores over the 576-wide latent, values over the 512-wide latent, per head and cached token
    # fused RoPE: rotating q_pe (128 heads x 64) and k_pe (64) costs 6 FLOPs per rotated value
    rope = 6 * B * (H * 64 + 64)
    assert core.flops == 2 * B * H * T * (576 + 512) + rope
    # the FP8 KV cache read dominates: 512 sequences x 2000 tokens x 576 bytes
    assert core.bytes_read == B * T * 576 * 1 + B * H * 576 * 2
    assert core.bytes_written == B * H * 512 * 2 + B * 576 * 1


def test_expert_gemms(g):
    ex = g.op("L5.moe.experts.mb0")
    assert ex.kind == "grouped_gemm"
    pairs = B * 8  # each rank receives, on average, 8 expert copies per token it sends
    assert ex.dims["pairs"] == pairs and ex.dims["experts"] == 32
    assert ex.flops == 6 * pairs * 7168 * 2048 + 4 * pairs * 2048
    # every local expert sees tokens at this batch: all 32 experts' weights are read
    assert ex.weight_bytes == pytest.approx(32 * 3 * 7168 * 2048 * (1 + 4 / 16384))


def test_dispatch_and_combine_bytes(g):
    hit = 1 - comb(256 - 32, 8) / comb(256, 8)  # a token reaches a given rank
    disp, comb_ = g.op("L5.moe.dispatch.mb0"), g.op("L5.moe.combine.mb0")
    # FP8 hidden state with a fp32 scale per 128 values, plus 8 x (int32 id + fp32 weight)
    row = 7168 + 7168 / 128 * 4 + 8 * 8
    assert len(disp.peer_bytes) == 8
    assert disp.peer_bytes[3] == pytest.approx(B * hit * row)
    assert comb_.peer_bytes[3] == pytest.approx(B * hit * 7168 * 2)
    assert disp.dims["group_size"] == 8 and disp.is_collective


def test_dbo_duplicates_ops_and_splits_tokens():
    plan = make_plan(R1, dp=8, ep=8, microbatches=2)
    g2 = build_step_graph(R1, plan, Batch.decode(B, T))
    g1 = build_step_graph(R1, plan.with_(microbatches=1), Batch.decode(B, T))
    assert len(g2) == 2 * len(g1)
    assert g2.microbatch_tokens == (256, 256)
    assert "L12.moe.dispatch.mb1" in g2.ops
    # linear work splits exactly; weights are read once per microbatch
    assert g2.op("L5.attn.core.mb0").flops * 2 == g1.op("L5.attn.core.mb0").flops
    # the schedule interleaves: mb1 attention is issued before mb0's experts
    order = g2.schedule.order()
    assert order.index("L5.attn.core.mb1") < order.index("L5.moe.experts.mb0")
    assert sorted(order) == sorted(g2.ops)


def test_graph_is_a_dag_in_schedule_order(g):
    assert nx.is_directed_acyclic_graph(g.graph)
    pos = {op_id: i for i, op_id in enumerate(g.schedule.order())}
    for u, v in g.graph.edges:
        assert pos[u] < pos[v], (u, v)
    for op in g:
        assert op.kind in OP_KINDS
        assert op.category in OP_CATEGORIES
        assert set(KIND_DIMS[op.kind]) <= set(op.dims)


def test_fusion_flags_change_the_graph():
    base = make_plan(R1, dp=8, ep=8, microbatches=1)
    unfused = base.with_(fusion=Fusion(fused_rope=False, merged_shared_expert=False,
                                       fused_moe=False))
    a = build_step_graph(R1, base, Batch.decode(64, 1000))
    b = build_step_graph(R1, unfused, Batch.decode(64, 1000))
    assert "L5.attn.rope.mb0" in b.ops and "L5.attn.rope.mb0" not in a.ops
    assert "L5.moe.shared.gate.mb0" in b.ops and "L5.moe.shared.gate_up.mb0" in a.ops
    assert "L5.moe.experts.gate_up.mb0" in b.ops and "L5.moe.experts.mb0" in a.ops
    # unfused kernels round-trip their intermediates through HBM
    assert b.bytes > a.bytes


def test_the_shared_expert_fused_into_the_moe_kernel_is_one_more_local_expert():
    """aiter's DeepSeek EP8 kernel: 32 routed + 1 shared local experts, top-8 + 1. One op does
    what the shared GEMMs did beside it, with the same FLOPs and weights."""
    apart = make_plan(R1, dp=8, ep=8, microbatches=1)
    fused = apart.with_(fusion=Fusion(shared_expert_in_moe=True))
    a = build_step_graph(R1, apart, Batch.decode(512, 2100))
    b = build_step_graph(R1, fused, Batch.decode(512, 2100))
    assert not any(op.name.startswith("moe.shared") for op in b)
    op = b.op("L5.moe.experts_shared.mb0")
    assert op.outputs == ("expert_out", "shared_out")
    h, inter = 7168, 2048
    assert op.dims["pairs"] == 512 * 8 and op.dims["shared_pairs"] == 512
    assert op.dims["shared_experts"] == 1 and op.dims["experts"] == 32
    # gate/up (2 x 2 inter x h) + down (inter x h) MACs and the SwiGLU, over 9 pairs per token
    assert op.flops == 6.0 * 512 * 9 * h * inter + 4.0 * 512 * 9 * inter
    shared_ops = [o for o in a if o.name.startswith("moe.shared") and o.layer == 5]
    routed = a.op("L5.moe.experts.mb0")
    # the weights read are the routed experts' plus the shared expert's FP8 gate/up/down
    shared_weights = sum(o.weight_bytes for o in shared_ops)
    assert shared_weights == pytest.approx(3 * h * inter * (1 + 4 / 128**2))  # + block scales
    assert op.weight_bytes == pytest.approx(routed.weight_bytes + shared_weights, rel=1e-12)
    assert op.flops == pytest.approx(routed.flops + sum(o.flops for o in shared_ops), rel=1e-12)
    # the residual add reads shared_out from the fused op, the routed rows via the combine
    assert b.op("L6.attn_norm.mb0") is not None
    with pytest.raises(EpsimError, match="no shared expert"):
        make_plan(load_model("mixtral-8x7b"), fusion=Fusion(shared_expert_in_moe=True))
    with pytest.raises(EpsimError, match="fused_moe"):
        make_plan(R1, fusion=Fusion(fused_moe=False, shared_expert_in_moe=True))


def test_tp_inserts_all_reduce_instead_of_dispatch():
    plan = make_plan(R1, tp=8, microbatches=1)
    g = build_step_graph(R1, plan, Batch.decode(64, 1000))
    assert "L5.moe.dispatch.mb0" not in g.ops
    ar = g.op("L5.attn.all_reduce.mb0")
    assert ar.kind == "all_reduce" and len(ar.peer_bytes) == 8
    # heads and expert widths split eight ways
    assert g.op("L5.attn.core.mb0").dims["heads"] == 16
    assert g.op("L5.moe.experts.mb0").dims["inter"] == 256


def test_prefill_graph():
    plan = make_plan(R1, dp=8, ep=8, microbatches=1)
    g = build_step_graph(R1, plan, Batch.prefill(2, 1024))
    core = g.op("L5.attn.core.mb0")
    assert core.kind == "attention_prefill"
    rope = 6 * 2 * 1024 * (H * 64 + 64)
    assert core.flops == pytest.approx(2 * H * 2 * (1024 * 1025 / 2) * (192 + 128) + rope)
    assert g.op("lm_head.mb0").dims["tokens"] == 2  # only the last token's logits
    assert not g.captured


def test_gqa_sliding_window_caps_context():
    oss = load_model("gpt-oss-120b")
    plan = make_plan(oss, dp=8, ep=8, microbatches=1)
    g = build_step_graph(oss, plan, Batch.decode(16, 4000))
    assert g.op("L0.attn.core.mb0").dims["context"] == 128  # sliding layer
    assert g.op("L1.attn.core.mb0").dims["context"] == 4000  # full layer


def test_stable_ids():
    plan = make_plan(R1, dp=8, ep=8)
    a = build_step_graph(R1, plan, Batch.decode(32, 100))
    b = build_step_graph(R1, plan, Batch.decode(32, 100))
    assert list(a.ops) == list(b.ops)
    assert a.captured


def test_op_ids_and_weight_keys_come_from_model_ids(g):
    assert op_id(12, "moe.dispatch", 1) == "L12.moe.dispatch.mb1"
    assert op_id(-1, "lm_head", 0) == "lm_head.mb0"
    assert weight_key(3, "attn.q_a") == "L3.attn.q_a" and weight_key(-1, "embed") == "embed"
    assert expert_weight_key(3, 7, "gate_up") == "L3.expert7.gate_up"
    for ident, op in g.ops.items():
        assert ident == op.id == op_id(op.layer, op.name, op.microbatch)


def test_routed_flag_marks_the_ops_whose_cost_follows_the_routing():
    dbo = make_plan(R1, dp=8, ep=8, microbatches=2)
    g2 = build_step_graph(R1, dbo, Batch.decode(64, 1000))
    routed = {op.id for op in g2 if op.routed}
    # R1: 3 dense layers, then 58 MoE layers of fused experts, dispatch and combine per microbatch
    assert len(routed) == 58 * 3 * 2
    assert {"L3.moe.experts.mb1", "L3.moe.dispatch.mb0", "L60.moe.combine.mb1"} <= routed
    assert not {"L3.moe.router.mb0", "L3.moe.shared.down.mb0", "L2.mlp.down.mb0"} & routed
    # unfused: gate/up, the activation over the pairs and down all follow the routing
    unfused = dbo.with_(microbatches=1, fusion=Fusion(fused_moe=False))
    names = {op.name for op in build_step_graph(R1, unfused, Batch.decode(64, 1000)) if op.routed}
    assert names == {"moe.dispatch", "moe.experts.gate_up", "moe.experts.act",
                     "moe.experts.down", "moe.combine"}
    # tensor parallel (no EP): the experts still do, and there is no exchange
    tp = build_step_graph(R1, make_plan(R1, tp=8, microbatches=1), Batch.decode(64, 1000))
    assert {op.name for op in tp if op.routed} == {"moe.experts"}


def test_edges_name_the_values_each_op_reads(g):
    for u, v, data in g.graph.edges(data=True):
        assert data["values"] and set(data["values"]) <= set(g.op(u).outputs), (u, v)
    for op in g:
        names = [name for _, name in g.inputs(op.id)]
        assert len(names) == len(set(names)), op.id
    # MLA decode attention: the absorbed queries, the latent and RoPE key it caches, q's RoPE part
    assert g.inputs("L5.attn.core.mb0") == [
        ("L5.attn.q_absorb.mb0", "q_lat"), ("L5.attn.kv_a_norm.mb0", "k_pe"),
        ("L5.attn.kv_a_norm.mb0", "c_kv"), ("L5.attn.q_b.mb0", "q")]
    assert g.inputs("L5.moe.dispatch.mb0") == [("L5.moe.router.mb0", "topk"),
                                                ("L5.ffn_norm.mb0", "h")]
    assert g.inputs("L5.moe.combine.mb0") == [("L5.moe.experts.mb0", "expert_out"),
                                               ("L5.moe.dispatch.mb0", "recv")]
    # the residual stream runs from each fused add+norm to the next
    assert g.inputs("L0.attn_norm.mb0") == [("embed.mb0", "hidden")]
    assert g.inputs("L5.ffn_norm.mb0") == [("L5.attn.o_proj.mb0", "attn_out"),
                                            ("L5.attn_norm.mb0", "residual")]
    assert g.inputs("L6.attn_norm.mb0") == [
        ("L5.moe.combine.mb0", "routed_out"), ("L5.moe.shared.down.mb0", "shared_out"),
        ("L5.ffn_norm.mb0", "residual")]
    assert g.results == ({"hidden": ("final_norm.mb0", "h"), "logits": ("lm_head.mb0", "logits"),
                          "next_tokens": ("sample.mb0", "next_tokens")},)


def test_unfused_graph_routes_rotated_values_and_the_pair_layout():
    plan = make_plan(R1, dp=8, ep=8, microbatches=1,
                     fusion=Fusion(fused_rope=False, merged_shared_expert=False, fused_moe=False))
    g = build_step_graph(R1, plan, Batch.prefill(2, 64))
    assert g.inputs("L5.attn.rope.mb0") == [("L5.attn.q_b.mb0", "q"),
                                             ("L5.attn.kv_a_norm.mb0", "k_pe")]
    # prefill expands the (unrotated) latent; attention caches the rotated RoPE key
    assert g.inputs("L5.attn.kv_b.mb0") == [("L5.attn.kv_a_norm.mb0", "c_kv")]
    assert g.inputs("L5.attn.core.mb0") == [
        ("L5.attn.rope.mb0", "q"), ("L5.attn.rope.mb0", "k_pe"), ("L5.attn.kv_b.mb0", "kv_up"),
        ("L5.attn.kv_a_norm.mb0", "c_kv")]
    assert g.inputs("L5.moe.experts.down.mb0") == [("L5.moe.experts.act.mb0", "act"),
                                                    ("L5.moe.experts.gate_up.mb0", "pairs")]
    assert g.inputs("L5.moe.shared.act.mb0") == [("L5.moe.shared.gate.mb0", "gate"),
                                                  ("L5.moe.shared.up.mb0", "up")]


def test_an_op_cannot_read_two_values_of_one_name():
    from epsim.model.graph_emit import Emitter

    e = Emitter(0)
    e.begin_block()
    dims = {"tokens": 4, "width": 8}
    fields = dict(dtype="bf16", flops=0.0, bytes_read=0.0, bytes_written=0.0)
    a = e.emit(0, "a", "elementwise", "other", deps=[], dims=dims, **fields)
    b = e.emit(0, "b", "elementwise", "other", deps=[], dims=dims, **fields)
    with pytest.raises(AssertionError, match="reads two values of one name"):
        e.emit(0, "c", "elementwise", "other", deps=[a, b], dims=dims, **fields)
