"""The kernels an engine launches for each op of the op graph, per kernel set (data, not code).

The op graph (``epsim.model``) has one op per logical step of a layer (a norm, a GEMM, the MLA
core, the fused MoE); an engine runs one or more GPU kernels for it (an FP8 GEMM is an
activation-quantisation kernel and the GEMM; the MLA decode core is rotary, the KV-cache write,
the split-KV kernel and its reduce). Two costs follow the kernel count rather than the op count:

* each kernel occupies the device at least ``efficiency.kernel_floor_s`` (``sim.step.compile``:
  an op costs ``max(model, floor) + (kernels - 1) x floor``: the cost model times the op's main
  kernel, the others are the small auxiliary kernels whose work the op's model does not count);
* an eager host launches each kernel (``kernel_launch_s``) through one framework op call
  (``efficiency.framework_dispatch_s``).

An op listed with no kernels is fused into a neighbour's kernel (its work is still timed by its
cost model, but it adds no floor and no launch). An op the inventory does not list runs one
kernel. Keys: an op's ``name`` (``"attn.core"``) first, then its ``kind`` (``"norm"``).

Each inventory names the model file it was read from. The kernel names are descriptive labels
(the library's function where the file calls one), shown by ``epsim step --explain``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["INVENTORIES", "NO_DEPLOYMENT", "Inventory", "kernels_of"]

#: one FP8 GEMM: the activations are quantised (per token, per 1x128 block) by their own kernel
_FP8_GEMM = ("act_quant_fp8", "gemm_fp8")


@dataclass(frozen=True)
class Inventory:
    """One kernel set's kernels per op.

    kernel_set: the profile's kernel-set name (``"aiter"``). engine: who launches them.
    source: where the list was read (repository, path, commit).
    kernels: ``{op name or kind: (kernel, ...)}``. Example: ``{"norm": ("fused_add_rmsnorm",)}``.
    deployed: per ``(MoE layout, exchange mode)`` of a step, the entries that replace
        ``kernels``' for that deployment (the kernel set's per-deployment tables,
        ``sim.hardware.kernel_sets``). Example: ``{("ep", "low_latency"): {"grouped_gemm":
        (...)}}``. deployed_source: where those lists were read.
    """

    kernel_set: str
    engine: str
    source: str
    kernels: Mapping[str, tuple[str, ...]]
    deployed: Mapping[tuple[str, str], Mapping[str, tuple[str, ...]]] = field(
        default_factory=dict)
    deployed_source: str = ""


#: the layer as vLLM's DeepSeek-V2/V3 model file lays it out (the SGLang file has the same
#: kernel sequence for these ops): fused residual-add RMSNorm, q_a and kv_a as one fused GEMM
#: (``fused_qkv_a_proj``), the MLA decode core after rotary and the KV-cache write, the
#: absorbed-weight BMMs, the MoE router GEMM + grouped top-k, the fused MoE
_DEEPSEEK_COMMON: dict[str, tuple[str, ...]] = {
    "embedding": ("embedding",),
    "norm": ("fused_add_rmsnorm",),
    "attn.q_a_norm": ("rmsnorm",),
    "attn.kv_a_norm": ("rmsnorm",),
    "attn.q_a": _FP8_GEMM,          # fused_qkv_a_proj: q_a and kv_a in one GEMM
    "attn.kv_a": (),                # ... so kv_a is that GEMM's other half
    "attn.q_b": _FP8_GEMM,
    "attn.q_absorb": ("bmm_bf16",),
    "attn.v_absorb": ("bmm_bf16",),
    "attn.o_proj": _FP8_GEMM,
    "mlp.gate_up": _FP8_GEMM,
    "mlp.act": ("silu_and_mul",),
    "mlp.down": _FP8_GEMM,
    "moe.shared.gate_up": _FP8_GEMM,
    "moe.shared.act": ("silu_and_mul",),
    "moe.shared.down": _FP8_GEMM,
    "router": ("router_gemm", "grouped_topk"),
    "lm_head": ("gemm_bf16",),
    "all_reduce": ("all_reduce",),
    "all_gather": ("all_gather",),
    "dispatch": ("dispatch",),
    "combine": ("combine",),
    # temperature, top-k/top-p mask, softmax + sample
    "sample": ("logits_temperature", "top_k_top_p", "sample"),
}

#: DSA's lightning indexer (DeepSeek-V3.2) as SGLang runs it (sgl-project/sglang
#: python/sglang/srt/layers/attention/nsa/nsa_indexer.py 005e8bf8abf447d93cd14427efbf0b10bf42a326):
#: the key's LayerNorm, RoPE of queries and key, the Hadamard rotation, FP8 quantisation, the
#: index-cache write, DeepGEMM's (paged) MQA logits, the top-k; its three projections are GEMMs
_SGLANG_INDEXER: dict[str, tuple[str, ...]] = {
    "attn.indexer": ("layernorm", "rotary_embedding", "rotate_activation", "act_quant_fp8",
                     "set_index_k_and_scale", "fp8_mqa_logits", "topk_transform"),
}

_VLLM = "vllm-project/vllm vllm/model_executor/models/deepseek_v2.py b863fe5bf4e19680572603b4e166faefc5725551"
_SGLANG = "sgl-project/sglang python/sglang/srt/models/deepseek_v2.py 3e4a39ee73308590c5c753108bdcb8d333f7f1c6"

INVENTORIES: dict[str, Inventory] = {
    "aiter": Inventory("aiter", "vLLM / SGLang with aiter (ROCm)", _VLLM, {
        **_DEEPSEEK_COMMON,
        # aiter MLA decode: rotary, KV-cache write, split-KV stage 1, the splits' reduce
        "attn.core": ("rotary_embedding", "concat_and_cache_mla", "mla_decode_stage1",
                      "mla_decode_reduce"),
        # aiter fused MoE (2 stages): sort/align the routed tokens, quantise, gate-up, down
        "grouped_gemm": ("moe_sorting", "act_quant_fp8", "fmoe_stage1", "fmoe_stage2"),
    }),
    "no-aiter": Inventory("no-aiter", "vLLM without aiter (ROCm, Triton)", _VLLM, {
        **_DEEPSEEK_COMMON,
        "attn.core": ("rotary_embedding", "concat_and_cache_mla", "mla_decode_stage1",
                      "mla_decode_reduce"),
        # Triton fused MoE: align the routed tokens, quantise, the two GEMMs, SiLU-mul between,
        # the top-k sum
        "grouped_gemm": ("moe_align_block_size", "act_quant_fp8", "fused_moe_gate_up",
                         "silu_and_mul", "act_quant_fp8", "fused_moe_down", "moe_sum"),
    }),
    "sglang": Inventory("sglang", "SGLang (CUDA)", _SGLANG, {
        **_DEEPSEEK_COMMON,
        **_SGLANG_INDEXER,
        # FlashInfer / FlashMLA decode: rotary, KV-cache write, split-KV kernel, combine
        "attn.core": ("rotary_embedding", "set_mla_kv_buffer", "mla_decode_splitkv",
                      "mla_decode_combine"),
        "grouped_gemm": ("moe_align_block_size", "act_quant_fp8", "fused_moe_gate_up",
                         "silu_and_mul", "act_quant_fp8", "fused_moe_down", "moe_sum"),
    }, deployed={
        # DeepEP's low-latency dispatch hands over FP8 tokens per expert (masked layout):
        # DeepEPMoE.forward_deepgemm_masked
        ("ep", "low_latency"): {"grouped_gemm": (
            "m_grouped_gemm_masked_gate_up", "silu_and_mul_masked_post_quant",
            "tma_aligned_scale", "m_grouped_gemm_masked_down")},
        # DeepEP normal: scatter into the contiguous layout, two contiguous GEMMs, gather back:
        # DeepEPMoE.forward_deepgemm_contiguous
        ("ep", "normal"): {"grouped_gemm": (
            "ep_scatter", "tma_aligned_scale", "m_grouped_gemm_contiguous_gate_up",
            "silu_and_mul", "per_token_group_quant_fp8", "tma_aligned_scale",
            "m_grouped_gemm_contiguous_down", "ep_gather")},
    }, deployed_source="sgl-project/sglang python/sglang/srt/layers/moe/ep_moe/layer.py "
                       "3f02617653b8d762affee5011e1d9b2c6c1cc0cb"),
    "deepseek": Inventory("deepseek", "DeepSeek's inference stack (H800)", _SGLANG, {
        **_DEEPSEEK_COMMON,
        **_SGLANG_INDEXER,
        "attn.core": ("rotary_embedding", "set_mla_kv_buffer", "flash_mla_splitkv",
                      "flash_mla_combine"),
        # DeepGEMM masked grouped GEMM: quantise, gate-up, SiLU-mul + quantise, down
        "grouped_gemm": ("act_quant_fp8", "m_grouped_gemm_masked_gate_up",
                         "silu_and_mul_quant", "m_grouped_gemm_masked_down"),
    }),
}


#: SGLang's EP served by the Triton fused MoE: the sglang set's kernels
INVENTORIES["sglang-triton"] = Inventory("sglang-triton", "SGLang (CUDA), Triton fused MoE",
                                         _SGLANG, INVENTORIES["sglang"].kernels)
#: the deployments an op's kernels may depend on: the MoE layout and the exchange mode
NO_DEPLOYMENT = ("", "")


def kernels_of(kernel_set: str, kind: str, name: str,
               deployment: tuple[str, str] = NO_DEPLOYMENT) -> tuple[str, ...]:
    """The kernels ``kernel_set``'s engine launches for the op ``name`` of ``kind`` in a step of
    ``deployment`` (MoE layout, exchange mode): the deployment's entries first, then the op's
    name, then its kind; one kernel named for its kind where the set (or the op) is not listed
    (``"none"``: the roofline alone, one kernel per op)."""
    inv = INVENTORIES.get(kernel_set)
    if inv is None:
        return (kind,)
    for table in (inv.deployed.get(deployment, {}), inv.kernels):
        for key in (name, kind):
            if key in table:
                return table[key]
    return (kind,)
