"""GPU kernel names -> op kinds: one named pattern per kernel family, no catch-all.

A profiler trace names kernels, not ops. :data:`FAMILIES` says, per kernel family of the
libraries an MoE serving or training stack launches (aiter and CK, hipBLASLt, DeepGEMM and
CUTLASS, FlashMLA and flash-attn, Triton fused MoE, NCCL and RCCL, DeepEP, MORI, PyTorch's own
ATen kernels, and the in-house kernels of DeepSeek's published profile), which op kind
(``epsim.model.opgraph.OP_KINDS``) its time belongs to. Each family carries the regular
expression it matches (searched in the demangled name Kineto records), an example name taken
from its source, and that source (repository, path, commit; or the trace that shows it where the
library is not public). The first family that matches wins, so specific families (DeepEP inside
a ``cutlass::device_kernel``) come before their wrappers; a name no family matches stays
unmapped and is listed with its time. ``docs/validation.md`` shows the table.

Kinds where epsim has no op of its own: activation quantisation (FP8 casts) and layout
transposes are streaming kernels and are counted as ``elementwise``; MoE token permutation and
the top-k weighted sum of expert outputs are counted as ``grouped_gemm`` (a fused-MoE op —
aiter's fmoe, vLLM's Triton ``fused_moe_kernel`` with ``moe_align_block_size`` — does them inside
the op epsim times as one grouped GEMM); attention backward kernels as ``attention_prefill``
(epsim simulates forward steps; the family keeps backward time out of the unmapped list).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from epsim.model.opgraph import OP_KINDS

#: DeepSeek's published profile (deepseek-ai/profile-data ``train.json``): the in-house kernels
#: (``dpsk::``, ``cuda::``) have no public source; their names are the trace's own
_DPSK_TRACE = "deepseek-ai/profile-data train.json (DeepSeek-V3 training, H800 EP64)"


@dataclass(frozen=True)
class KernelFamily:
    """One kernel family: kernels whose name matches ``pattern`` count as op ``kind``.

    name: ``library.family``, e.g. ``"deepep.dispatch"``.
    library: who ships the kernels, e.g. ``"DeepEP"``.
    kind: an ``OP_KINDS`` member.
    pattern: a regular expression searched in the kernel name.
    example: a real kernel name of the family (as the source spells it).
    source: where the names come from (repository, path, commit).
    """

    name: str
    library: str
    kind: str
    pattern: str
    example: str
    source: str
    regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"kernel family {self.name}: unknown op kind {self.kind!r}")
        object.__setattr__(self, "regex", re.compile(self.pattern))

    def matches(self, kernel: str) -> bool:
        return self.regex.search(kernel) is not None


def _f(name: str, library: str, kind: str, pattern: str, example: str, source: str
       ) -> KernelFamily:
    return KernelFamily(name, library, kind, pattern, example, source)


_DEEPEP = "deepseek-ai/DeepEP csrc/kernels/api.cuh @ 04bafa0f (namespace deep_ep: layout::, " \
          "intranode::, internode::, internode_ll:: kernels), internode.cu @ b805c0e1; " \
          + _DPSK_TRACE + " (the same kernels under namespace dpsk::ep)"
_EP_NS = r"(?:deep_ep|dpsk::ep)::"

#: the pattern table, most specific first (the first match wins)
FAMILIES: tuple[KernelFamily, ...] = (
    # --- expert-parallel dispatch / combine ---------------------------------------------------
    _f("deepep.dispatch", "DeepEP", "dispatch",
       _EP_NS + r"(?:internode|intranode|internode_ll)::(?:notify_dispatch|dispatch|"
       r"cached_notify_dispatch|clean_low_latency_buffer)\b",
       "void deep_ep::internode::dispatch<false, 8, false, 8>(...)", _DEEPEP),
    _f("deepep.combine", "DeepEP", "combine",
       # internode cached_notify: the barrier and head reset internode combine launches first
       _EP_NS + r"(?:internode|intranode|internode_ll)::(?:combine|cached_notify_combine|"
       r"cached_notify)\b",
       "void deep_ep::internode::combine<false, 8, __nv_bfloat16, 8, 2, 16, 24>(...)", _DEEPEP),
    _f("deepep.layout", "DeepEP", "dispatch", _EP_NS + r"\w+::get_dispatch_layout\b",
       "void deep_ep::layout::get_dispatch_layout<256, 32, 8>(...)", _DEEPEP),
    _f("mori.dispatch", "MORI", "dispatch", r"mori::moe::\w*EpDispatch\w*Kernel",
       "void mori::moe::EpDispatchIntraNodeKernel<__hip_bfloat16, false>(...)",
       "ROCm/mori src/ops/dispatch_combine/intranode.hpp @ ae712172, internode.hpp @ 552a6d5a"),
    _f("mori.combine", "MORI", "combine", r"mori::moe::\w*EpCombine\w*Kernel",
       "void mori::moe::EpCombineIntraNodeKernel<__hip_bfloat16>(...)",
       "ROCm/mori src/ops/dispatch_combine/intranode.hpp @ ae712172, internode.hpp @ 552a6d5a"),
    # --- NCCL / RCCL collectives (the collective is in the name; SendRecv and RCCL's Generic
    # kernel do not say which op they serve and stay unmapped) -------------------------------
    _f("nccl.all_reduce", "NCCL/RCCL", "all_reduce", r"\bnccl(?:Dev)?Kernel_AllReduce",
       "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
       "NVIDIA/nccl src/device/generate.py @ b6475625 (ncclDevKernel_<coll>_<op>_<type>_"
       "<algo>_<proto>); ROCm/rccl keeps NCCL's ncclKernel_/ncclDevKernel_ names"),
    _f("nccl.all_gather", "NCCL/RCCL", "all_gather", r"\bnccl(?:Dev)?Kernel_AllGather",
       "ncclDevKernel_AllGather_RING_LL",
       "NVIDIA/nccl src/device/generate.py @ b6475625; ROCm/rccl (same names)"),
    # --- grouped GEMMs (MoE experts) ---------------------------------------------------------
    _f("dpsk.grouped_gemm.grouped", "DeepSeek (in-house, DeepGEMM's naming)", "grouped_gemm",
       r"dpsk::grouped_gemm::\w+::m_grouped_\w+",
       "void cutlass::device_kernel<dpsk::grouped_gemm::cuda::m_grouped_fp8_ptp128c::"
       "GemmKernel>(...)", _DPSK_TRACE + "; m_grouped_ as DeepGEMM's m_grouped_gemm_fp8_fp8_"
       "bf16_nt_contiguous (deepseek-ai/DeepGEMM README)"),
    _f("deepgemm.grouped", "DeepGEMM", "grouped_gemm",
       r"deep_gemm::.*(?:GemmType::[MK]Grouped|m_grouped|k_grouped)",
       "deep_gemm::sm90_fp8_gemm_1d2d_impl<..., deep_gemm::GemmType::MGroupedContiguous, ...>",
       "deepseek-ai/DeepGEMM deep_gemm/include/deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh @ "
       "debb196d (kGemmType template argument), fp8_gemm.cuh @ 93c92c2c"),
    _f("aiter.fmoe", "aiter", "grouped_gemm", r"(?:_ZN5aiter\d+|aiter::)fmoe_",
       "_ZN5aiter47fmoe_bf16_blockscaleFp8_g1u1_vs_silu_1tg_32x128E",
       "ROCm/aiter hsa/gfx942/fmoe/silu/fmoe_bf16_blockscaleFp8_g1u1_silu.csv @ 05ddabb5 "
       "(knl_name column)"),
    _f("ck.moe_gemm", "CK (aiter)", "grouped_gemm",
       r"\bck::kernel_moe_(?:mx)?gemm|ck_tile::\w*(?:FusedMoe|MoeSorting|MoeFlatmm)",
       "void ck::kernel_moe_gemm<ck::GridwiseMoeGemmBlockScale<...>>(...)",
       "ROCm/composable_kernel include/ck/tensor_operation/gpu/grid/gridwise_moe_gemm.hpp @ "
       "b2e7af5f (kernel_moe_gemm), used by aiter's ck_moe 2-stage MoE"),
    _f("triton.fused_moe", "Triton fused MoE (vLLM, SGLang)", "grouped_gemm",
       r"^(?:fused_moe_kernel\w*|moe_align_block_size\w*|\w*moe_sum\w*)$|"
       r"vllm::moe::(?:moe_align_block_size|moe_sum|topk_softmax)\w*",
       "fused_moe_kernel",
       "vllm-project/vllm vllm/model_executor/layers/fused_moe/fused_moe.py @ 13cb3e44 "
       "(@triton.jit def fused_moe_kernel; moe_align_block_size, moe_sum from csrc/moe)"),
    _f("dpsk.moe_permute", "DeepSeek (in-house)", "grouped_gemm",
       r"\bcuda::(?:expand_to_fused_with_scales_impl|get_fused_mapping|clean_and_count_expert"
       r"|reduce_fused_impl)\b",
       "void cuda::get_fused_mapping<512>(...)", _DPSK_TRACE),
    # --- dense GEMMs --------------------------------------------------------------------------
    _f("dpsk.grouped_gemm.dense", "DeepSeek (in-house, DeepGEMM's naming)", "gemm",
       # the same library's plain (ungrouped) FP8 GEMMs: DeepGEMM's gemm_fp8_fp8_bf16_nt
       r"dpsk::grouped_gemm::\w+::fp8_\w+::GemmKernel",
       "void cutlass::device_kernel<dpsk::grouped_gemm::cuda::fp8_ptp128c::GemmKernel>(...)",
       _DPSK_TRACE),
    _f("deepgemm.dense", "DeepGEMM", "gemm", r"deep_gemm::\w*(?:fp8|bf16)_gemm\w*",
       "deep_gemm::sm90_fp8_gemm_1d2d_impl<..., deep_gemm::GemmType::Normal, ...>",
       "deepseek-ai/DeepGEMM deep_gemm/include/deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh @ "
       "debb196d; fp8_gemm.cuh @ 93c92c2c (fp8_gemm_kernel)"),
    _f("hipblaslt.tensile", "hipBLASLt", "gemm", r"^Cijk_A\w+_B\w+",
       "Cijk_Ailk_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT128x128x64_MI16x16x1",
       "ROCm/hipBLASLt tensilelite/Tensile/SolutionStructs/Naming.py @ f48effaa (Tensile "
       "solution names Cijk_<A layout>_<B layout>_...)"),
    _f("ck.gemm", "CK (aiter)", "gemm", r"\bck::kernel_gemm_\w+|ck_tile::\w*GemmKernel",
       "void ck::kernel_gemm_xdl_cshuffle_v3<...>(...)",
       "ROCm/composable_kernel include/ck/tensor_operation/gpu/grid/"
       "gridwise_gemm_xdl_cshuffle_v3.hpp (kernel_gemm_xdl_cshuffle_v3)"),
    _f("cublas.gemm", "cuBLAS", "gemm", r"^(?:sm\d+_xmma_gemm_|nvjet_)\w+",
       "sm90_xmma_gemm_bf16f32_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_"
       "execute_segment_k_off_kernel__5x_cublas",
       "cuBLAS (closed source): names as " + _DPSK_TRACE + " records them"),
    # --- attention ----------------------------------------------------------------------------
    _f("flashmla.decode", "FlashMLA", "attention_decode",
       r"flash_fwd_splitkv_mla(?:_combine)?_kernel|flash_fwd_mla_combine_kernel"
       r"|get_mla_metadata_kernel",
       "void flash::flash_fwd_splitkv_mla_kernel<Flash_fwd_kernel_traits_mla<576, 64, 64, 8, "
       "cutlass::bfloat16_t, 512>, true, flash::SharedStorageMLA<...>>(...)",
       "deepseek-ai/FlashMLA csrc/flash_fwd_mla_kernel.h @ 927eebc1, csrc/kernels/"
       "mla_combine.cu @ 287061ec, csrc/kernels/get_mla_metadata.h @ 287061ec"),
    _f("flash_attn.decode", "flash-attn", "attention_decode",
       r"\bflash_fwd_splitkv(?:_combine)?_kernel\b",
       "void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, "
       "cutlass::bfloat16_t, ...>, ...>(...)",
       "Dao-AILab/flash-attention csrc/flash_attn/src/flash_fwd_launch_template.h @ c1f0be2f"),
    _f("flash_attn.fwd", "flash-attn", "attention_prefill",
       r"\bflash_fwd_kernel\b|\bflash::compute_attn_ws\b|\bflash::FlashAttnFwd\w*",
       "void flash::compute_attn_ws<Flash_fwd_kernel_traits<192, 128, 128, 12, 2, false, 1, "
       "cutlass::bfloat16_t, 128>, true, flash::SingleTileScheduler, ...>(...)",
       "Dao-AILab/flash-attention csrc/flash_attn/src/flash_fwd_launch_template.h @ c1f0be2f "
       "(FA2 flash_fwd_kernel); hopper/flash_fwd_kernel.h (FA3 beta compute_attn_ws), "
       "hopper/flash_fwd_kernel_sm90.h @ c082294e (FlashAttnFwdSm90)"),
    _f("flash_attn.bwd", "flash-attn", "attention_prefill",
       r"\bflash_bwd_\w+_kernel\b|\bflash::FlashAttnBwd\w*",
       "void cutlass::device_kernel<flash::FlashAttnBwd<flash::CollectiveMainloopBwd<...>>>(...)",
       "Dao-AILab/flash-attention hopper/flash_bwd_kernel.h @ abcf72aa, "
       "hopper/flash_bwd_preprocess_kernel.h @ 900b3793, flash_bwd_postprocess_kernel.h @ "
       "383caa67"),
    _f("aiter.mla", "aiter", "attention_decode", r"(?:_ZN5aiter\d+|aiter::)mla_(?:a\d+w\d+|dec_stage1)_",
       "_ZN5aiter33mla_a8w8_qh16_qseqlen1_gqaratio16E",
       "ROCm/aiter hsa/gfx942/mla/mla_asm.csv @ 074f473a (knl_name column)"),
    _f("aiter.mla_prefill", "aiter", "attention_prefill", r"(?:_ZN5aiter\d+|aiter::)mla_pfl_",
       "_ZN5aiter41mla_pfl_bf16_a16w16_causal_subQ128_mqa128E",
       "ROCm/aiter hsa/gfx942/mla/mla_asm.csv @ 074f473a (knl_name column)"),
    # --- CUTLASS GEMMs (after every family that wraps its kernel in cutlass::device_kernel) ---
    _f("cutlass.gemm", "CUTLASS", "gemm",
       r"\bcutlass::(?:device_kernel|Kernel2?)<.*\bGemm|\bcutlass(?:3x)?_sm\d+_\w*gemm",
       "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<...>>(...)",
       "NVIDIA/cutlass include/cutlass/device_kernel.h @ 17cb1fb0 (device_kernel, Kernel, "
       "Kernel2); python/cutlass_library/generator.py (cutlass3x_sm90_tensorop_gemm_... names)"),
    # --- norms, rotary, router ----------------------------------------------------------------
    _f("apex.layer_norm", "Apex / TransformerEngine fast LayerNorm", "norm",
       r"\blayer_norm::ln_(?:fwd|bwd)\w*_kernel\b",
       "void layer_norm::ln_fwd_kernel<layer_norm::Kernel_traits<__nv_bfloat16, ..., 7168u, "
       "1u, 1u, 4u, 4u, 32u>>(layer_norm::FwdParams)",
       "NVIDIA/apex apex/contrib/csrc/layer_norm/ln_fwd_kernels.cuh @ e4d49d86, "
       "ln_bwd_kernels.cuh @ c80d2f6b"),
    _f("vllm.norm", "vLLM", "norm", r"\bvllm::(?:fused_add_)?rms_norm\w*kernel",
       "void vllm::rms_norm_kernel<c10::BFloat16, 8, 2>(...)",
       "vllm-project/vllm csrc/layernorm_kernels.cu"),
    _f("flash_attn.rotary", "flash-attn (Triton)", "rope", r"^rotary_kernel$",
       "rotary_kernel", "Dao-AILab/flash-attention flash_attn/ops/triton/rotary.py @ "
       "a9a3170f (@triton.jit def rotary_kernel)"),
    _f("vllm.rotary", "vLLM", "rope", r"\bvllm::(?:batched_)?rotary_embedding_kernel",
       "void vllm::rotary_embedding_kernel<c10::BFloat16, true>(...)",
       "vllm-project/vllm csrc/pos_encoding_kernels.cu"),
    _f("aten.topk", "PyTorch ATen", "router",
       r"\bat::native::(?:sbtopk|mbtopk)::\w+|\bbitonicSortKVInPlace\b",
       "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(...)",
       "pytorch/pytorch aten/src/ATen/native/cuda/TensorTopK.cu (sbtopk::gatherTopK)"),
    _f("dpsk.router", "DeepSeek (in-house)", "router",
       r"\bcuda::(?:topk_sum_and_topk_idx|unique_group_indices_impl|aux_fi_impl)\b",
       "void cuda::topk_sum_and_topk_idx<16, 64>(...)", _DPSK_TRACE),
    # --- streaming kernels --------------------------------------------------------------------
    _f("dpsk.fp8_cast", "DeepSeek (in-house)", "elementwise",
       r"\bcuda::(?:per_token_cast\w*|per_channel_cast\w*|cast_back_impl|"
       r"per_token_cast_back\w*)",
       "void cuda::per_token_cast_to_fp8_with_channels<__nv_bfloat16, 128, false, 128, false>"
       "(...)", _DPSK_TRACE),
    _f("dpsk.swiglu", "DeepSeek (in-house)", "elementwise", r"\bcuda::swiglu_\w+",
       "void cuda::swiglu_forward_with_weight_and_per_token_cast_to_fp8_with_channels_impl<"
       "__nv_bfloat16, true, false, 128>(...)", _DPSK_TRACE),
    _f("dpsk.transpose", "DeepSeek (in-house)", "elementwise",
       r"\bcuda::batched_transpose\b|dpsk::grouped_gemm::\w+::utils::(?:transpose|"
       r"fill_tensormaps_kernel)\b",
       "void cuda::batched_transpose<512, 128, 1, 1>(...)", _DPSK_TRACE),
    _f("vllm.activation", "vLLM", "elementwise", r"\bvllm::act_and_mul_kernel",
       "void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel, true>(...)",
       "vllm-project/vllm csrc/activation_kernels.cu"),
    _f("aten.elementwise", "PyTorch ATen", "elementwise",
       r"\bat::native::(?:vectorized_|unrolled_)?elementwise_kernel\b|"
       r"::elementwise_kernel_with_index<|\bat::native::\w*_scatter_gather_elementwise_kernel"
       r"|\bat::native::\w*distribution_elementwise_grid_stride_kernel"
       r"|\bat::native::index_elementwise_kernel|^_ZN2at6native\w*elementwise\w*kernel",
       "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::"
       "BFloat16>, at::detail::Array<char*, 3> >(int, ...)",
       "pytorch/pytorch aten/src/ATen/native/cuda/CUDALoops.cuh @ 9b79ae91 "
       "(vectorized_/unrolled_elementwise_kernel), Loops.cuh, ScatterGatherKernel.cu, "
       "DistributionTemplates.h, RangeFactories.cu (elementwise_kernel_with_index)"),
    _f("aten.reduce", "PyTorch ATen", "elementwise", r"\bat::native::reduce_kernel<",
       "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ...>>(...)",
       "pytorch/pytorch aten/src/ATen/native/cuda/Reduce.cuh (reduce_kernel)"),
)


def classify(kernel: str, families: Iterable[KernelFamily] = FAMILIES) -> KernelFamily | None:
    """The first family whose pattern matches ``kernel``; None: unmapped."""
    for family in families:
        if family.matches(kernel):
            return family
    return None


def short_name(kernel: str, limit: int = 160) -> str:
    """A kernel name without its argument list, cut to ``limit`` characters (for listing)."""
    head = kernel.split("(", 1)[0] if not kernel.startswith("void (") else kernel
    head = head.strip() or kernel
    return head if len(head) <= limit else head[: limit - 3] + "..."
