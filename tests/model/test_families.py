"""The three families of issue 31: DeepSeek-V3.2 (MLA + DSA's lightning indexer), GLM-4.5
(``glm4_moe``) and Llama-4 (``llama4``: interleaved MoE, chunked attention, NoPE layers).

Parameter counts against the model cards, the layer patterns, the attention cost formulas by
hand on small cases, and the tiny models of each family through the CPU runtime against the
dense reference.
"""

import json

import pytest

from epsim.model.accounting import attention_params_per_layer, kv_bytes_per_token, param_counts
from epsim.model.attention_keys import indexer_cost, keys_sum, sum_chunked, sum_min
from epsim.model.config import load_model, model_from_hf_config
from epsim.model.errors import EpsimError
from epsim.model.graph import build_step_graph
from epsim.model.opgraph import Batch
from epsim.model.plan import Fusion, make_plan
from epsim.sim.hardware.profile import load_profile
from epsim.sim.step.cost import CostContext
from epsim.sim.step.cost.registry import op_features
from epsim.sim.step.cost.timing import answered_by_table, op_time

# Model cards (Hugging Face): DeepSeek-V3.2-Exp 671B (685B with the 14B MTP module) / 37B
# activated (the DeepSeek-V3 card's split, which V3.2 keeps); GLM-4.5 355B / 32B, GLM-4.5-Air
# 106B / 12B (zai-org/GLM-4.5 README); Llama-4 Scout 109B / 17B, Maverick 400B / 17B
# (meta-llama model cards). Cards round to whole billions, count Llama-4's vision encoder and
# GLM's MTP layer in the total and the embedding in Llama-4's active figure, none of which
# epsim counts (its convention: epsim.model.accounting), so totals must agree within 2 % and
# activated counts within 10 %.
CARDS = {
    "deepseek-v3.2-exp": (671e9, 37e9),
    "glm-4.5": (355e9, 32e9),
    "glm-4.5-air": (106e9, 12e9),
    "llama-4-scout-17b-16e": (109e9, 17e9),
    "llama-4-maverick-17b-128e": (400e9, 17e9),
}


@pytest.mark.parametrize("name", sorted(CARDS))
def test_parameter_counts_match_the_model_cards(name):
    total, active = CARDS[name]
    counts = param_counts(load_model(name))
    assert counts.total == pytest.approx(total, rel=0.02)
    assert counts.activated_per_token == pytest.approx(active, rel=0.10)


@pytest.mark.parametrize("name", ["deepseek-v3.2-exp", "glm-4.5", "llama-4-maverick-17b-128e"])
def test_describe_reports_the_cards_figures_and_the_layer_pattern(capsys, name):
    from epsim.cli import main
    assert main(["describe", "--model", name, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    total, active = CARDS[name]
    assert d["total_params"] == pytest.approx(total, rel=0.02)
    assert d["activated_params_per_token"] == pytest.approx(active, rel=0.10)
    assert len(d["moe_layer_indices"]) == d["moe_layers"]
    pattern = {"deepseek-v3.2-exp": ({"full": 61}, 2048), "glm-4.5": ({"full": 92}, None),
               "llama-4-maverick-17b-128e": ({"chunked": 36, "full": 12}, None)}[name]
    assert d["attention_layers"] == pattern[0]
    sparse = d["sparse_attention"]
    assert (sparse["index_topk"] if sparse else None) == pattern[1]
    assert main(["describe", "--model", name]) == 0
    assert "attention " in capsys.readouterr().out


def test_glm_attention_has_qkv_biases_and_qk_norm_but_no_output_bias():
    parts = attention_params_per_layer(load_model("glm-4.5"))
    h, q, kv = 5120, 96 * 128, 8 * 128
    assert parts == {"q_proj": h * q + q, "k_proj": h * kv + kv, "v_proj": h * kv + kv,
                     "o_proj": q * h, "qk_norm": 2 * 128}


def test_deepseek_v32_adds_the_indexer_to_v3():
    v3, v32 = load_model("deepseek-v3"), load_model("deepseek-v3.2-exp")
    extra = param_counts(v32).attention - param_counts(v3).attention
    # wq_b 1536 x 64*128, wk 7168 x 128, k_norm weight + bias, weights_proj 7168 x 64
    per_layer = 1536 * 8192 + 7168 * 128 + 2 * 128 + 7168 * 64
    assert extra == 61 * per_layer
    # its cache holds an FP8 index key and its scale (132 bytes) beside the latent, per layer
    assert kv_bytes_per_token(v32, "fp8") - kv_bytes_per_token(v3, "fp8") == 61 * 132


def test_layer_patterns():
    glm, air = load_model("glm-4.5"), load_model("glm-4.5-air")
    assert glm.moe_layers == tuple(range(3, 92)) and air.moe_layers == tuple(range(1, 46))
    assert glm.attention.rotary_fraction == 0.5 and glm.attention.kv_bound("full") is None
    scout, maverick = load_model("llama-4-scout-17b-16e"), load_model("llama-4-maverick-17b-128e")
    assert scout.moe_layers == tuple(range(48))
    assert maverick.moe_layers == tuple(range(1, 48, 2))  # (layer + 1) % 2 == 0
    assert maverick.dense_intermediate_size == 16384 and maverick.moe.intermediate_size == 8192
    for m in (scout, maverick):
        nope = tuple(range(3, 48, 4))
        assert m.attention.nope_layers == nope
        assert [i for i, t in enumerate(m.attention.layer_types) if t == "full"] == list(nope)
        assert m.attention.chunk_size == 8192 and m.moe.top_k == 1 and m.moe.weight_on_input
    v32 = load_model("deepseek-v3.2-exp")
    assert v32.moe_layers == tuple(range(3, 61)) and v32.attention.kind == "mla"
    assert (v32.attention.index_n_heads, v32.attention.index_head_dim,
            v32.attention.index_topk) == (64, 128, 2048)


def test_an_explicit_no_rope_list_and_bad_keys():
    with open(_config_path("tiny-llama4")) as f:
        cfg = json.load(f)
    text = cfg["text_config"]
    m = model_from_hf_config({**cfg, "text_config": {**text, "no_rope_layers": [0, 1, 1, 1]}})
    assert m.attention.nope_layers == (0,) and m.attention.layer_types[0] == "full"
    with pytest.raises(EpsimError, match="no_rope_layers"):
        model_from_hf_config({**cfg, "text_config": {**text, "no_rope_layers": [1, 0]}})
    with pytest.raises(EpsimError, match="interleave_moe_layer_step"):
        model_from_hf_config({**cfg, "text_config": {**text, "interleave_moe_layer_step": -1}})
    v32 = json.loads(open(_config_path("tiny-deepseek-v32")).read())
    with pytest.raises(EpsimError, match="index_topk"):
        model_from_hf_config({**v32, "index_topk": 0})


def _config_path(name):
    from importlib import resources
    return resources.files("epsim.model") / "configs" / f"{name}.json"


# -- the attention cost formulas, by hand -----------------------------------------------------


def test_key_sums_by_hand():
    # chunk 4: queries at contexts 1..10 attend 1,2,3,4,1,2,3,4,1,2 keys
    assert sum_chunked(1, 10, 4) == 23
    assert keys_sum("chunked", 6, 10, chunk=4) == 2 + 3 + 4 + 1 + 2
    # top-4 (DSA): 1,2,3,4,4,4,... over contexts 1..10
    assert sum_min(1, 10, 4) == 34 and keys_sum("full", 1, 10, topk=4) == 34
    assert keys_sum("full", 1, 10) == 55 and keys_sum("sliding", 1, 10, window=3) == 27


def test_indexer_cost_by_hand():
    # 2 sequences, 1 query each at context 10; 2 heads of 4; keep 3; bf16 activations
    cost = indexer_cost(seqs=2, queries=1, first=10, cache_rows=10, heads=2, dim=4, topk=3,
                        act_bytes=2)
    pairs = 2 * 10
    assert cost.flops == pairs * (2 * 2 * 4 + 3 * 2)  # 440
    # keys (4 FP8 + 4 scale bytes) x 10 rows x 2 seqs, FP8 queries + fp32 weights, the new
    # keys in bf16, the logits read by the top-k
    assert cost.bytes_read == 2 * 10 * 8 + 2 * (2 * 4 + 2 * 4) + 2 * 4 * 2 + pairs * 4  # 288
    assert cost.bytes_written == 2 * 8 + pairs * 4 + 2 * 3 * 4  # 120


def _op(model, batch, name, plan=None):
    plan = plan or make_plan(model, nodes=1, gpus_per_node=1).with_(microbatches=1)
    return build_step_graph(model, plan, batch).ops[name]


def test_sparse_decode_attention_reads_topk_keys_and_the_indexer_the_whole_context():
    m = load_model("deepseek-v3.2-exp")
    # dp 8, ep 8, tp 1 (128 heads per rank), one microbatch
    plan = make_plan(m, nodes=1, gpus_per_node=8).with_(microbatches=1)
    core = _op(m, Batch.decode(4, 5000), "L3.attn.core.mb0", plan)
    latent, r = 576, 512
    # attended: 2,048 keys per query (not 5,000); RoPE inside the kernel adds 6 t (128*64+64)
    rope = 6.0 * 4 * (128 * 64 + 64)
    assert core.flops == pytest.approx(2.0 * 4 * 128 * 2048 * (latent + r) + rope)
    assert core.dims["keys"] == 2048 and core.dims["topk"] == 2048
    dense = _op(load_model("deepseek-v3"), Batch.decode(4, 5000), "L3.attn.core.mb0", plan)
    assert dense.flops == pytest.approx(2.0 * 4 * 128 * 5000 * (latent + r) + rope)
    index = _op(m, Batch.decode(4, 5000), "L3.attn.indexer.mb0", plan)
    assert index.kind == "indexer"
    assert index.flops == pytest.approx(4 * 5000 * (2 * 64 * 128 + 3 * 64))
    graph = build_step_graph(m, plan, Batch.decode(4, 5000))
    assert ("L3.attn.indexer.mb0", "topk_idx") in graph.inputs("L3.attn.core.mb0")


def test_chunked_and_nope_layers_in_the_graph():
    m = load_model("tiny-llama4")  # chunk 4, heads 4 of 16 on 2 KV heads, layer 3 NoPE
    prefill = Batch.prefill(1, 10)
    chunked = _op(m, prefill, "L0.attn.core.mb0")
    # 23 keys attended (1,2,3,4,1,2,3,4,1,2); QK and PV: 2 FLOPs x 2 x 16 per key and head;
    # RoPE inside the kernel: 3 FLOPs x 10 tokens x (4 + 2) x 16 rotated values
    assert chunked.flops == 2 * 4 * 23 * 2 * 16 + 3 * 10 * 6 * 16
    nope = _op(m, prefill, "L3.attn.core.mb0")  # the whole prompt, no rotation
    assert nope.flops == 2 * 4 * 55 * 2 * 16
    decode = _op(m, Batch.decode(2, 10), "L0.attn.core.mb0")
    assert decode.dims["context"] == 4 and decode.dims["chunk"] == 4
    assert _op(m, Batch.decode(2, 10), "L3.attn.core.mb0").dims["context"] == 10


def test_glm_partial_rope_and_qk_norm_ops():
    m = load_model("tiny-glm4-moe")
    plan = make_plan(m, nodes=1, gpus_per_node=1).with_(fusion=Fusion(False, False, False))
    graph = build_step_graph(m, plan, Batch.decode(2, 10))
    rope = graph.ops["L0.attn.rope.mb0"]
    assert rope.dims["width"] == (4 + 2) * 16 // 2  # half of each query and key head
    assert graph.ops["L0.attn.qk_norm.mb0"].kind == "norm"


def test_the_sim_costs_sparse_and_chunked_attention_on_the_roofline():
    profile = load_profile("h200")
    m = load_model("deepseek-v3.2-exp")
    plan = make_plan(m, nodes=1, gpus_per_node=8)
    times = {}
    for ctx in (4096, 65536):
        core = _op(m, Batch.decode(8, ctx), "L3.attn.core.mb0", plan)
        index = _op(m, Batch.decode(8, ctx), "L3.attn.indexer.mb0", plan)
        assert op_features(core) is None and not answered_by_table(core, CostContext(profile))
        times[ctx] = (op_time(core, profile), op_time(index, profile))
    # the sparse core reads 2,048 keys at either context; the indexer scores all of them
    assert times[65536][0] == pytest.approx(times[4096][0], rel=0.35)
    assert times[65536][1] > 8 * times[4096][1]
    llama = load_model("llama-4-scout-17b-16e")
    chunked = _op(llama, Batch.prefill(1, 16384), "L0.attn.core.mb0",
                  make_plan(llama, nodes=1, gpus_per_node=8))
    assert op_features(chunked) is None  # a chunk's mask is not the tables' causal one


# -- the tiny models through the runtime ------------------------------------------------------

torch = pytest.importorskip("torch")

from epsim.runtime import RunOptions, launch_local  # noqa: E402
from epsim.runtime import kernels as K  # noqa: E402
from epsim.runtime.gqa import visible  # noqa: E402


def test_indexer_keeps_the_planted_best_keys():
    # one query, one head of weight 1: keys scored 3, -1 (ReLU: 0), 5, 2, 0 at positions 0..4
    q = torch.tensor([[[1.0, 0.0]]])
    keys = torch.tensor([[[3.0, 0.0], [-1.0, 0.0], [5.0, 0.0], [2.0, 0.0], [0.0, 1.0]]])
    keep = K.indexer_keep(q, torch.ones(1, 1), keys, torch.tensor([5]), topk=2)
    assert keep.tolist() == [[True, False, True, False, False]]
    # past the query's length nothing is kept; ties at 0 go to the earlier entry
    keep = K.indexer_keep(q, torch.ones(1, 1), keys, torch.tensor([2]), topk=2)
    assert keep.tolist() == [[True, True, False, False, False]]


def test_the_reference_sees_what_the_runtime_sees():
    from dataclasses import replace
    from types import SimpleNamespace

    from epsim.runtime.reference import _Dense
    for name in ("tiny-llama4", "gpt-oss-120b"):  # chunked and NoPE; sliding and full
        a = load_model(name).attention
        if a.sliding_window:  # a window shorter than the positions checked
            a = replace(a, sliding_window=3)
        ref = SimpleNamespace(a=a)
        for layer in range(4):
            seen = visible(a, layer, torch.arange(12)[:, None], torch.arange(12)[None, :])
            want = [[_Dense.sees(ref, layer, i, j) for j in range(12)] for i in range(12)]
            assert seen.tolist() == want, (name, layer)


def test_chunked_visibility():
    a = load_model("tiny-llama4").attention
    seen = visible(a, 0, torch.tensor([[5]]), torch.arange(8)[None, :])
    assert seen.tolist() == [[False, False, False, False, True, True, False, False]]
    full = visible(a, 3, torch.tensor([[5]]), torch.arange(8)[None, :])  # the NoPE layer
    assert full.tolist() == [[True] * 6 + [False] * 2]


@pytest.fixture(scope="module")
def tiny_runs():
    """Each family's tiny model on 2 ranks, decoding past its chunk / top-k (context 9 > 4),
    with DBO and a real prefill for one; the check runs the dense reference."""
    base = RunOptions(model="tiny-deepseek-v32", world_size=2, batch=3, context=9, steps=2,
                      check=True)
    grid = {
        "v32": base,
        "v32+prefill+dbo": base.with_(prefill=True, dbo=True),
        "glm": base.with_(model="tiny-glm4-moe"),
        "glm+static+unfused": base.with_(model="tiny-glm4-moe", static=True, unfused=True),
        "llama4+dbo": base.with_(model="tiny-llama4", dbo=True),
        "llama4+prefill": base.with_(model="tiny-llama4", prefill=True),
    }
    return dict(zip(grid, launch_local(list(grid.values()), 2), strict=True))


def test_tiny_models_match_the_dense_reference(tiny_runs):
    for name, res in tiny_runs.items():
        assert res["max_rel_err"] < 1e-4, (name, res["max_rel_err_by_output"])
        assert res["token_mismatches"] == 0, name
        assert "indexer" in res["op_ms_per_step_by_kind"] or not name.startswith("v32")


def test_the_runtime_refuses_what_it_does_not_implement():
    from epsim.runtime import validate
    with pytest.raises(EpsimError, match="--mtp"):
        validate(RunOptions(model="tiny-glm4-moe", world_size=1, batch=1, context=4, steps=2,
                            mtp=1))
    with pytest.raises(EpsimError, match="sinks"):
        validate(RunOptions(model="gpt-oss-120b", world_size=1, batch=1, context=4, steps=2))
    with pytest.raises(EpsimError, match="softmax"):
        validate(RunOptions(model="qwen3-235b-a22b", world_size=1, batch=1, context=4,
                            steps=2))


def test_the_chunk_and_the_top_k_decide_what_is_attended(tmp_path):
    """The agreement above is not vacuous: past the chunk (top-k) the tiny models decode other
    tokens than the same model with a chunk (top-k) wider than the context."""
    from importlib import resources
    base = resources.files("epsim.model") / "configs"
    llama = json.loads((base / "tiny-llama4.json").read_text())
    llama["text_config"]["attention_chunk_size"] = 64
    v32 = json.loads((base / "tiny-deepseek-v32.json").read_text())
    v32["index_topk"] = 64
    (tmp_path / "llama.json").write_text(json.dumps(llama))
    (tmp_path / "v32.json").write_text(json.dumps(v32))
    run = RunOptions(model="tiny-llama4", world_size=1, batch=4, context=9, steps=3)
    grid = [run, run.with_(model=str(tmp_path / "llama.json")),
            run.with_(model="tiny-deepseek-v32"), run.with_(model=str(tmp_path / "v32.json"))]
    tokens = [r["next_tokens"] for r in launch_local(grid, 1)]
    assert tokens[0] != tokens[1] and tokens[2] != tokens[3]
