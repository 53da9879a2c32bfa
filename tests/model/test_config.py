import json
from importlib import resources
from pathlib import Path

import pytest

from epsim.model import EpsimError, load_model, model_from_hf_config, param_counts, shipped_models
from epsim.model.accounting import kv_bytes_for_sequence, kv_bytes_per_token
from epsim.model.config import check_context_length

KIMI_K2 = Path(__file__).resolve().parents[1] / "data" / "kimi-k2-config.json"


def test_shipped_models_include_the_named_ones():
    names = set(shipped_models())
    assert {"deepseek-r1", "deepseek-v3", "gpt-oss-120b", "qwen3-235b-a22b", "mixtral-8x7b",
            "tiny-deepseek"} <= names


def test_deepseek_r1_shape():
    m = load_model("deepseek-r1")
    assert m.attention.kind == "mla"
    assert m.num_layers == 61 and len(m.moe_layers) == 58 and m.moe_layers[0] == 3
    assert m.moe.num_experts == 256 and m.moe.top_k == 8 and m.moe.num_shared_experts == 1
    assert (m.moe.n_group, m.moe.topk_group, m.moe.scoring) == (8, 4, "sigmoid")
    assert m.moe.routed_scaling_factor == 2.5
    assert m.weight_dtype == "fp8_block128"


def test_deepseek_r1_parameter_counts():
    c = param_counts(load_model("deepseek-r1"))
    assert abs(c.total / 671e9 - 1) < 0.01
    assert abs(c.activated_per_token / 37e9 - 1) < 0.02
    # one routed expert: gate, up, down of 7168 x 2048
    assert c.routed_per_expert_layer == 3 * 7168 * 2048
    assert c.routed_experts == 256 * 58 * 3 * 7168 * 2048


def test_deepseek_r1_kv_bytes():
    m = load_model("deepseek-r1")
    assert kv_bytes_per_token(m, "fp8") == 35136 == 61 * 576
    assert kv_bytes_per_token(m, "bf16") == 70272


def test_gpt_oss_parameter_counts_and_windows():
    m = load_model("gpt-oss-120b")
    c = param_counts(m)
    assert abs(c.total / 116.8e9 - 1) < 0.02
    assert abs(c.activated_per_token / 5.1e9 - 1) < 0.05
    assert m.attention.sinks and m.attention.sliding_window == 128
    assert m.attention.layer_types.count("sliding") == 18
    assert m.expert_weight_dtype == "mxfp4" and m.weight_dtype == "bf16"
    # 18 full layers grow per token; 18 sliding layers stop at the 128-token window
    per_layer = 2 * 8 * 64
    assert kv_bytes_per_token(m, "bf16") == 18 * per_layer * 2
    assert kv_bytes_for_sequence(m, "bf16", 1000) == (18 * 1000 + 18 * 128) * per_layer * 2
    assert kv_bytes_for_sequence(m, "bf16", 100) == 36 * 100 * per_layer * 2


def test_other_families_load():
    q = load_model("qwen3-235b-a22b")
    assert q.attention.qk_norm and len(q.moe_layers) == 94
    assert abs(param_counts(q).total / 235e9 - 1) < 0.02
    mx = load_model("mixtral-8x7b")
    assert abs(param_counts(mx).total / 46.7e9 - 1) < 0.02


def test_tiny_deepseek_is_deepseek_shaped():
    m = load_model("tiny-deepseek")
    assert m.family == "deepseek_v3" and m.attention.kind == "mla"
    assert m.moe.num_shared_experts == 1 and m.moe.scoring == "sigmoid" and m.moe.n_group > 1
    assert m.dense_layers == (0,)
    assert param_counts(m).total < 1e6


def test_load_from_path(tmp_path):
    src = json.loads((resources.files("epsim.model") / "configs" / "mixtral-8x7b.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps(src))
    assert load_model(str(path)).hidden_size == 4096
    assert load_model(str(tmp_path)).hidden_size == 4096  # a folder holding config.json


@pytest.mark.parametrize("content, message", [
    ("{not json", "malformed"),
    ('{"model_type": "deepseek_v3"}', "lacks required key"),
    ('{"model_type": "llama"}', "unsupported model_type"),
    ('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}', "architectures"),
    ("[1, 2]", "JSON object"),
])
def test_bad_config_files(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(EpsimError, match=message):
        load_model(str(path))


def test_unknown_name():
    with pytest.raises(EpsimError, match="unknown model 'nope'"):
        load_model("nope")


def test_kimi_k2_is_read_by_its_architecture():
    """Kimi-K2's model_type is its own (kimi_k2); its DeepseekV3ForCausalLM architecture picks
    the DeepSeek reader."""
    m = load_model(str(KIMI_K2))
    assert json.loads(KIMI_K2.read_text())["model_type"] == "kimi_k2"
    assert m.family == "deepseek_v3" and m.attention.kind == "mla"
    assert m.moe.num_experts == 384 and m.moe.top_k == 8 and m.moe.num_shared_experts == 1
    assert len(m.moe_layers) == 60 and m.dense_layers == (0,)
    assert m.attention.num_heads == 64 and (m.moe.n_group, m.moe.topk_group) == (1, 1)
    assert m.max_position_embeddings == 131072 and m.weight_dtype == "fp8_block128"
    c = param_counts(m)
    # Moonshot's model card: 1T total (1.03e12 counted), 32B activated
    assert abs(c.total / 1.03e12 - 1) < 0.005
    assert abs(c.activated_per_token / 32e9 - 1) < 0.02
    assert c.routed_experts == 384 * 60 * 3 * 7168 * 2048


def test_model_type_wins_over_architectures():
    cfg = json.loads((resources.files("epsim.model") / "configs" / "mixtral-8x7b.json").read_text())
    # an unknown model_type falls back on the architecture, a known one is read as itself
    assert model_from_hf_config({**cfg, "model_type": "my_mixtral"}).family == "mixtral"
    with pytest.raises(EpsimError, match="unsupported model_type 'my_mixtral'"):
        model_from_hf_config({**cfg, "model_type": "my_mixtral", "architectures": ["Nope"]})


def test_context_limit_is_read_and_enforced():
    r1 = load_model("deepseek-r1")
    assert r1.max_position_embeddings == 163840
    check_context_length(r1, 163840, "a request")  # exactly the limit fits
    with pytest.raises(EpsimError, match=r"163841 tokens exceed deepseek-r1's context of 163840 "
                       r"tokens \(max_position_embeddings"):
        check_context_length(r1, 163841, "a request")
    cfg = json.loads((resources.files("epsim.model") / "configs" / "tiny-deepseek.json").read_text())
    cfg.pop("max_position_embeddings")
    unlimited = model_from_hf_config(cfg)
    assert unlimited.max_position_embeddings is None
    check_context_length(unlimited, 10**9, "a request")  # no limit given, none enforced
    with pytest.raises(EpsimError, match="max_position_embeddings must be a positive integer"):
        model_from_hf_config({**cfg, "max_position_embeddings": 0})
