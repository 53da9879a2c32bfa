"""Build the ``kernels`` sections of the shipped hardware profiles from published measurements.

Run (pandas and pyarrow are needed for the aiconfigurator parquet files)::

    python tools/build_kernel_tables.py --sources /work/shared/data/kernel-sources

``--sources`` is a folder holding copies of the published tables: ``aiter/*.csv`` (ROCm/aiter at
``AITER_COMMIT``), ``deepgemm/*.csv`` (the README tables of deepseek-ai/DeepGEMM at
``DEEPGEMM_COMMIT``, transcribed) and ``aiconfigurator/<gpu>/...`` (the parquet databases of
ai-dynamo/aiconfigurator at ``AIC_COMMIT``). The script rewrites the ``kernels`` key of
``sim/hardware/profiles/{mi300x,mi325x,mi355x,h100,h200}.json`` (every other key is left as it is) and
writes ``sim/hardware/profiles/h800.json`` whole (its hardware figures are the ``H800_*`` constants below,
the efficiency keys not published for H800 taken from ``h100.json``, each one saying so).
``--check`` writes nothing and fails when a profile differs from what it would write.
The repository never reads the sources at test or run time: the profiles carry the numbers.

Rules (docs/hardware.md, "Measured kernel tables"):

* only component measurements (kernel benchmarks, bandwidth tests), each point with its
  source (repository, path, commit or PR; or a document's url); no end-to-end result sets a
  number, and no table is adjusted to make a prediction better;
* the big tables are read from the copied files; the few figures published only in READMEs
  (MORI-EP, DeepEP, FlashMLA, AMD's aiter speedups, the H800 spec) are literal constants here,
  each with its source;
* times are kept as published (aiter ``us``, aiconfigurator ``latency`` in ms, DeepEP ``us``);
  a derived time (from a published bandwidth or TFLOP/s, or transferred from another GPU) is
  marked by a source whose note states the formula;
* only DeepSeek-V3 shapes (``deepseek_v3_shapes``), so each profile stays under ~400 KB.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROFILES = REPO / "src" / "epsim" / "sim" / "hardware" / "profiles"

AITER_REPO = "ROCm/aiter"
AITER_COMMIT = "e4048607a535ace3a2b51ded31b1c8c2d45c0879"
AITER_FMOE = "aiter/configs/model_configs/a8w8_blockscale_tuned_fmoe_ds_v3.csv"
AITER_GEMM = "aiter/configs/model_configs/a8w8_blockscale_tuned_gemm_ds_v3.csv"
DEEPGEMM_REPO = "deepseek-ai/DeepGEMM"
DEEPGEMM_COMMIT = "327ec92f6977e7fee022cb76a8f273b75483c3d8"
AIC_REPO = "ai-dynamo/aiconfigurator"
AIC_COMMIT = "095f58a51c4ca8e61b66ec108d86f223f8d559ce"
AIC_DATA = "aic-core/src/aiconfigurator_core/systems/data"
MORI_REPO = "ROCm/mori"
MORI_COMMIT = "ba156a8868c13a760f7b055a71bfdcc32d620505"
DEEPEP_REPO = "deepseek-ai/DeepEP"
# the last README.md with the V1 tables (EPv2 moved them to docs/legacy.md at b306af06; the
# figures are unchanged there at dd758caf)
DEEPEP_COMMIT = "567632dd59810d77b3cc05553df953cc0f779799"
FLASHMLA_REPO = "deepseek-ai/FlashMLA"
FLASHMLA_COMMIT = "9241ae3ef9bac614dd25e45e507e089f888280e0"

# --------------------------------------------------------------------------------------------
# DeepSeek-V3/R1 shapes
# --------------------------------------------------------------------------------------------

HIDDEN, Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD, HEADS = 7168, 1536, 512, 128, 64, 128, 128
DENSE_INTER, MOE_INTER, EXPERTS, TOP_K, VOCAB = 18432, 2048, 256, 8, 129280


def deepseek_v3_shapes() -> dict[tuple[int, int], str]:
    """``{(N, K): the ops}`` of DeepSeek-V3's GEMMs (out[M, N] = x[M, K] @ W[K, N]) under
    attention / dense TP 1, 2, 4, 8 (model/graph_builder.py's ops; the shared expert is unsharded under
    EP, sharded by TP without EP). Also SGLang's fused q_a + kv_a (2112 x 7168), which epsim
    runs as two GEMMs."""
    shapes: dict[tuple[int, int], list[str]] = {}

    def add(n: int, k: int, role: str) -> None:
        shapes.setdefault((n, k), []).append(role)

    add(Q_LORA, HIDDEN, "attn.q_a")
    add(KV_LORA + ROPE, HIDDEN, "attn.kv_a")
    add(Q_LORA + KV_LORA + ROPE, HIDDEN, "q_a+kv_a fused (SGLang)")
    add(EXPERTS, HIDDEN, "moe.router")
    add(2 * MOE_INTER, HIDDEN, "expert gate_up (routed, shared under EP)")
    add(HIDDEN, MOE_INTER, "expert down (routed, shared under EP)")
    for tp in (1, 2, 4, 8):
        hp = HEADS // tp
        add(hp * (NOPE + ROPE), Q_LORA, f"attn.q_b@tp{tp}")
        add(hp * (NOPE + V_HEAD), KV_LORA, f"attn.kv_b@tp{tp}")
        add(HIDDEN, hp * V_HEAD, f"attn.o_proj@tp{tp}")
        add(2 * DENSE_INTER // tp, HIDDEN, f"mlp.gate_up@tp{tp}")
        add(HIDDEN, DENSE_INTER // tp, f"mlp.down@tp{tp}")
        add(VOCAB // tp, HIDDEN, f"lm_head@tp{tp}")
        if tp > 1:
            add(2 * MOE_INTER // tp, HIDDEN, f"shared expert gate_up@tp{tp} (no EP)")
            add(HIDDEN, MOE_INTER // tp, f"shared expert down@tp{tp} (no EP)")
    return {key: ", ".join(roles) for key, roles in shapes.items()}


def p_hit(ranks: int, experts: int = EXPERTS, top_k: int = TOP_K) -> float:
    """The chance that a token's ``top_k`` distinct experts, drawn uniformly from ``experts``,
    include one of a given rank's ``experts / ranks``: 1 - C(E - E/R, k) / C(E, k)."""
    local = experts // ranks
    return 1.0 - math.comb(experts - local, top_k) / math.comb(experts, top_k)


# --------------------------------------------------------------------------------------------
# Figures published only in READMEs (literal constants, each with its source)
# --------------------------------------------------------------------------------------------

#: ROCm/mori README.md @ MORI_COMMIT, "Benchmarks / MORI-EP": DeepSeek V3 configurations
#: (7168 hidden, top-8 experts, FP8 dispatch + BF16 combine), EP8 in one node. "Latency" rows at
#: 128 tokens (us); "Bandwidth" rows at 4096 tokens (GB/s per rank = received token rows x
#: hidden x element size / time, local rows included: tests/python/ops/bench_dispatch_combine.py).
MORI_EP8 = {
    "MI300X + CX7": {"dispatch": {"latency_128_us": 35.0, "bandwidth_4096_GBps": 307.0},
                     "combine": {"latency_128_us": 47.0, "bandwidth_4096_GBps": 330.0}},
    "MI355X + AINIC": {"dispatch": {"latency_128_us": 31.0, "bandwidth_4096_GBps": 345.0},
                       "combine": {"latency_128_us": 36.0, "bandwidth_4096_GBps": 420.0}},
}
#: bytes per received row counted by MORI's bench: FP8 dispatch 1 byte, BF16 combine 2 bytes
MORI_ELEMENT_BYTES = {"dispatch": 1, "combine": 2}
#: the same README, "Latency" rows of the internode low-latency kernels ("EP16-V1-LL",
#: "EP32-V1-LL"; 128 tokens, 7168 hidden, top-8, FP8 dispatch + BF16 combine, 8 GPUs per node):
#: {EP size: (dispatch us, combine us)}. The README marks MI300X's EP32 row "* Stale data from
#: previous kernel version; updated numbers pending re-benchmarking"
MORI_LL_INTER = {
    "MI300X + CX7": {16: (76.0, 122.0), 32: (157.0, 280.0)},
    "MI355X + AINIC": {16: (84.0, 108.0), 32: (152.0, 187.0)},
}
MORI_LL_STALE = {("MI300X + CX7", 32)}

#: deepseek-ai/DeepEP README.md @ DEEPEP_COMMIT, low-latency kernels on H800 + CX7 400 Gb/s
#: ("128 tokens per batch, 7168 hidden, top-8 experts, FP8 dispatching and BF16 combining"):
#: {EP size: (dispatch us, combine us)}
DEEPEP_LL_128 = {8: (77.0, 114.0), 16: (118.0, 195.0), 32: (155.0, 273.0), 64: (173.0, 314.0),
                 128: (192.0, 369.0), 256: (194.0, 360.0)}
#: the same README, normal kernels, intranode EP8 on H800 (~160 GB/s NVLink): bottleneck
#: bandwidth in GB/s at 4096 tokens per rank (tests/test_intranode.py counts the received rows x
#: hidden x 2 bytes, times (1 + 4/128) / 2 for FP8 with its scales, local rows included)
DEEPEP_NORMAL_INTRA_GBPS = {"dispatch": 153.0, "combine": 158.0}
DEEPEP_NORMAL_ROW_BYTES = {"dispatch": HIDDEN * 2 * (1 + 4 / 128) / 2, "combine": HIDDEN * 2}

#: AMD's published "up to" aiter speedups (ROCm/aiter README.md @ AITER_COMMIT "Performance
#: Highlights"; AMD ROCm blog "Supercharge DeepSeek-R1 Inference on AMD Instinct MI300X",
#: 2025-03-21: "+2X GEMM, +3X MoE, +17x MLA decode")
AITER_SPEEDUP_UP_TO = {"gemm": 2.0, "grouped_gemm": 3.0, "attention_decode": 17.0}

#: deepseek-ai/FlashMLA README.md @ FLASHMLA_COMMIT: "up to 3000 GB/s in memory-bound
#: configuration and 660 TFLOPS in computation-bound configuration on H800 SXM5 with CUDA 12.8"
FLASHMLA_PEAK_BYTES_S = 3000e9
FLASHMLA_PEAK_FLOPS = 660e12

#: H800 SXM5 figures (sources in H800_SOURCES)
H800_PEAK_FLOPS = {"bf16": 989e12, "fp16": 989e12, "fp8": 1978e12, "fp32": 67e12}
H800_HBM_BYTES = 85899345920.0
H800_HBM_BANDWIDTH = 3.35e12
H800_NVLINK_PER_DIRECTION = 200e9
H800_NIC_PER_GPU = 50e9
#: HBM peak bytes/s of the aiconfigurator GPUs (the h100 / h200 profiles' hbm_bandwidth: NVIDIA
#: H100 SXM and H200 data sheets), the bound no measured kernel can beat reading its weights
HBM_PEAK = {"h100_sxm": 3.35e12, "h200_sxm": 4.8e12}
#: DeepGEMM's best dense FP8 GEMM on H800 (README @ DEEPGEMM_COMMIT: M 4096, N 7168, K 16384)
DEEPGEMM_BEST_DENSE_TFLOPS = 1520.0

# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------

_MI300X_ROWS_NOTE = (
    "gfx942 cu_num 304 rows first added by aiter PR #2881 (commit 1a4121e5, 2026-04-30, 'dsv3 "
    "blockscale gemm config in mi300'): measured on MI300X. They are the 37 rows of the file "
    "before PR #3951 (84493f0e^) that PR #3951 kept unchanged (M, N, K and us identical; none "
    "existed before 1a4121e5). time = column us (the aiter tuner's measured time of the chosen "
    "kernel); FP8 e4m3fnuz, 1x128 activation / 128x128 weight block scales")
_MI325X_ROWS_NOTE = (
    "gfx942 cu_num 304 rows added by aiter PR #3951 (commit 84493f0e, 2026-07-23, 'gfx942 "
    "MI325X: tuned a8w8 blockscale GEMM + FMoE configs for DSv3.2 TP8'): tuned on MI325X (304 "
    "CUs). time = column us")
_FMOE_NOTE = (
    "cu_num 304 rows (PR #3951, tuned on MI325X): model_dim 7168, inter_dim 2048, expert 33 = 32 "
    "local routed experts (EP8) + the fused shared expert, topk 9 = 8 routed + the shared one; "
    "tokens = column token (token rows entering the kernel); time = column us (= us1 gate/up + "
    "us2 down of the two-stage kernel). aiter's tuner routes random scores over all 33 experts "
    "(the shared expert is not forced into every row as in serving)")
_TRANSFER_RULE = (
    "DERIVED for MI300X: the MI325X row at the same features in this file, times "
    "(1 + (r - 1) * w), r = 6.0 / 5.3 (MI325X / MI300X HBM peak), w = min(1, t_mem / t_325), "
    "t_mem = the row's bytes (weights + activations as sim/step/roofline.py's roofline counts them) / "
    "(6.0 TB/s x the mi325x profile's hbm_fraction 0.7925): the weight-bound share of the row "
    "runs at MI300X's lower bandwidth, the rest unchanged (same 304-CU compute). "
    "tools/build_kernel_tables.py computes it")


def _aiter(path: str, pr: int, note: str) -> dict[str, Any]:
    return {"repository": AITER_REPO, "path": path, "commit": AITER_COMMIT, "pr": pr,
            "note": note}


def _mori(device: str, derived: bool, applied_to: str = "") -> dict[str, Any]:
    if derived:
        note = (f"MORI-EP 'Bandwidth' row, {device}, EP8, 4096 tokens per rank: time DERIVED from "
                "the published GB/s as t = 4096 x 8 x P(hit) x 7168 x element bytes / bandwidth, "
                "P(hit) = 1 - C(224, 8) / C(256, 8) = 0.6618 (uniform routing: the chance a "
                "token picks one of a rank's 32 experts; MORI's bench counts every received row "
                "x hidden x element size, local rows included); element 1 byte (FP8 dispatch), "
                "2 bytes (BF16 combine). The same formula gives 36.2 / 47.6 us for the measured "
                "128-token row (35 / 47 us)")
    else:
        note = (f"MORI-EP 'Latency' row, {device}, EP8, 128 tokens per rank, 7168 hidden, top-8, "
                "FP8 dispatch + BF16 combine: measured latency")
    if applied_to:
        note += (f". Measured on {device.split(' +')[0]} (the README's hardware column), applied "
                 f"unchanged to {applied_to}: intra-node dispatch/combine is bound by the xGMI "
                 "links (7 x 64 GB/s per direction on both GPUs), not by HBM")
    return {"repository": MORI_REPO, "path": "README.md", "commit": MORI_COMMIT, "note": note}


def _speedup_sources() -> dict[str, Any]:
    return {
        "aiter-readme": {
            "repository": AITER_REPO, "path": "README.md", "commit": AITER_COMMIT,
            "note": "'Performance Highlights': block-scale GEMM up to 2x, block-scale fused MoE up "
                    "to 3x, MLA decode up to 17x (MI300X); 'up to' maxima, baseline not stated"},
        "amd-blog-dsr1": {
            "url": "https://rocm.blogs.amd.com/artificial-intelligence/DeepSeekR1-Part2/README.html",
            "note": "AMD ROCm blog 'Supercharge DeepSeek-R1 Inference on AMD Instinct MI300X' "
                    "(2025-03-21): 'AITER kernels are optimized providing +2X GEMM, +3X MoE, +17x "
                    "MLA decode, +14X MHA prefill' (footnoted shapes and baselines not read)"},
    }


def _aic(gpu: str, rel: str, note: str) -> dict[str, Any]:
    return {"repository": AIC_REPO, "path": f"{AIC_DATA}/{gpu}/{rel}", "commit": AIC_COMMIT,
            "note": note}


def _deepgemm(layout: str) -> dict[str, Any]:
    return {"repository": DEEPGEMM_REPO, "path": "README.md", "commit": DEEPGEMM_COMMIT,
            "note": f"README performance table, {layout}, H800 SXM5, NVCC 12.8 ('all shapes "
                    "potentially used in DeepSeek-V3/R1 inference ... without tensor "
                    "parallelism'); FP8 with 1x128 / 128x128 block scales. Time DERIVED from the "
                    "published TFLOPS: t = 2 x M x N x K x groups / TFLOPS"}


def _deepep(kind: str) -> dict[str, Any]:
    if kind == "ll":
        note = ("low-latency kernels on H800 + CX7 400 Gb/s InfiniBand, 128 tokens per rank, "
                "7168 hidden, top-8 experts, FP8 dispatch, BF16 combine: measured latency (the "
                "same figures are in docs/legacy.md at dd758caf); EP8 runs in one node (NVLink "
                "since commit de8cfca, 2025-06-05), EP16 and above across nodes")
    else:
        note = ("normal kernels, intranode EP8 on H800 (~160 GB/s NVLink), 4096 tokens per rank, "
                "7168 hidden, top-8, FP8 dispatch / BF16 combine: 153 / 158 GB/s bottleneck "
                "bandwidth. Time DERIVED as t = 4096 x 8 x P(hit) x row bytes / bandwidth, "
                "P(hit) = 1 - C(224, 8) / C(256, 8) = 0.6618 (tests/test_intranode.py routes "
                "uniformly: topk of |randn| + 1 scores, and counts every received row, local ones "
                "included), row bytes 7168 x 2 x (1 + 4/128) / 2 = 7392 (FP8 with scales) for "
                "dispatch, 7168 x 2 for combine")
    return {"repository": DEEPEP_REPO, "path": "README.md", "commit": DEEPEP_COMMIT, "note": note}


# --------------------------------------------------------------------------------------------
# Reading the copied tables
# --------------------------------------------------------------------------------------------


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _num(text: str) -> float:
    """A published decimal as the nearest double (``"470.75"`` -> 470.75)."""
    return float(text)


def _int(value: float) -> int | float:
    return int(value) if float(value).is_integer() else float(value)


#: (M, N, K) of the gfx942 cu304 block-scale GEMM rows measured on MI300X (aiter PR #2881):
#: the rows of a8w8_blockscale_tuned_gemm_ds_v3.csv at 84493f0e^ that PR #3951 kept unchanged,
#: all first present at 1a4121e5 (git show / git blame of ROCm/aiter)
PR2881_ROWS = frozenset([
    (1, 3072, 1536), (1024, 2112, 7168), (1024, 256, 7168), (1024, 512, 7168),
    (128, 2112, 7168), (128, 3072, 1536), (16, 3072, 1536), (16, 7168, 2048), (2, 3072, 1536),
    (2, 4096, 512), (2, 7168, 2048), (2048, 256, 7168), (2048, 512, 7168), (20480, 3072, 1536),
    (20480, 4096, 512), (20480, 512, 7168), (20480, 7168, 2048), (256, 2112, 7168),
    (256, 4096, 512), (32, 3072, 1536), (32768, 2112, 7168), (32768, 256, 7168),
    (32768, 3072, 1536), (32768, 4096, 512), (32768, 512, 7168), (32768, 7168, 2048),
    (4, 3072, 1536), (4, 4096, 512), (4, 7168, 2048), (4096, 256, 7168), (512, 2112, 7168),
    (512, 512, 7168), (64, 3072, 1536), (64, 7168, 2048), (8, 3072, 1536), (8, 7168, 2048),
    (8192, 256, 7168),
])


def aiter_fmoe_cu304(src: Path) -> list[tuple[int, float]]:
    """[(token, us)] of the 15 cu_num 304 fused-MoE rows (DeepSeek EP8 + shared expert)."""
    out = []
    for r in _rows(src / "aiter" / "a8w8_blockscale_tuned_fmoe_ds_v3.csv"):
        if r["cu_num"] != "304":
            continue
        shape = (int(r["model_dim"]), int(r["inter_dim"]), int(r["expert"]), int(r["topk"]))
        if shape != (HIDDEN, MOE_INTER, 33, 9):
            raise SystemExit(f"unexpected cu_num 304 fused-MoE row {shape}")
        out.append((int(r["token"]), _num(r["us"])))
    if len(out) != 15:
        raise SystemExit(f"expected 15 cu_num 304 fused-MoE rows, found {len(out)}")
    return sorted(out)


def aiter_gemm(src: Path, gfx: str, max_m: int | None = None,
               shapes: dict | None = None) -> list[tuple[int, int, int, float]]:
    """[(M, N, K, us)] of the block-scale GEMM rows of ``gfx`` (cu_num 304 for gfx942)."""
    out = []
    for r in _rows(src / "aiter" / "a8w8_blockscale_tuned_gemm_ds_v3.csv"):
        if r["gfx"] != gfx:
            continue
        if gfx == "gfx942" and r["cu_num"] != "304":
            raise SystemExit(f"gfx942 row with cu_num {r['cu_num']}")
        m, n, k = int(r["M"]), int(r["N"]), int(r["K"])
        if (max_m is not None and m > max_m) or (shapes is not None and (n, k) not in shapes):
            continue
        out.append((m, n, k, _num(r["us"])))
    return sorted(out, key=lambda row: (row[1], row[2], row[0]))


def deepgemm(src: Path, table: str) -> list[dict[str, float]]:
    rows = []
    for r in _rows(src / "deepgemm" / f"{table}.csv"):
        g = int(r.get("num_groups", 1))
        m = int(r.get("m_per_group", r.get("m", 0)))
        n, k, tf = int(r["n"]), int(r["k"]), float(r["tflops"])
        rows.append({"groups": g, "m": m, "n": n, "k": k, "tflops": tf,
                     "us": round(2.0 * g * m * n * k / (tf * 1e12) * 1e6, 3)})
    return rows


def _parquet(src: Path, gpu: str, rel: str):
    import pandas as pd  # only this script needs pandas + pyarrow

    return pd.read_parquet(src / "aiconfigurator" / gpu / rel)


# --------------------------------------------------------------------------------------------
# The MI325X -> MI300X transfer (memory-bound share of each row)
# --------------------------------------------------------------------------------------------


class Transfer:
    """``t_300 = t_325 * (1 + (r - 1) * w)``, ``w = min(1, t_mem / t_325)``: ``t_mem`` is the
    row's bytes as ``sim/step/roofline.py``'s roofline counts them, over MI325X's achievable bandwidth
    (its peak times the mi325x profile's ``hbm_fraction``)."""

    def __init__(self, mi325x: dict[str, Any], mi300x: dict[str, Any]):
        import numpy as np

        from epsim.model import Batch, build_step_graph, load_model, make_plan
        from epsim.model.opgraph import Op
        from epsim.model.plan import Fusion
        from epsim.sim.hardware.profile import profile_from_dict
        from epsim.sim.step import op_kinds

        self.np, self.op_kinds = np, op_kinds
        self.r = mi325x["hbm_bandwidth"] / mi300x["hbm_bandwidth"]
        # the roofline of op_kinds with FLOP peaks no op reaches: only its bytes term is left
        raw = json.loads(json.dumps(mi325x))
        raw.pop("kernels", None)
        raw["peak_flops"] = {d: 1e30 for d in raw["peak_flops"]}
        self.memory_only = profile_from_dict(raw, "mi325x (bytes term only)")
        r1 = load_model("deepseek-r1")
        plan = make_plan(r1, dp=8, ep=8, microbatches=1,
                         fusion=Fusion(shared_expert_in_moe=True))
        graph = build_step_graph(r1, plan, Batch.decode(512, 2100))
        self.moe = next(op for op in graph if op.kind == "grouped_gemm")
        self.gemm = Op(id="transfer.gemm", kind="gemm", name="gemm", layer=0, microbatch=0,
                       category="other", dims={"batch": 1, "m": 1, "n": 1, "k": 1},
                       dtype="fp8", flops=2.0, bytes_read=5.0, bytes_written=2.0,
                       weight_bytes=1.0)

    def t_mem(self, op_kind: str, features: list[float]) -> float:
        """Seconds of the bytes term at ``features`` in ``FEATURES[op_kind]`` order."""
        op = self.moe if op_kind == "grouped_gemm" else self.gemm
        x = self.np.array([features], dtype=float)
        return float(self.op_kinds.feature_roofline(op, self.memory_only, x)[0])

    def __call__(self, op_kind: str, features: list[float], us_325: float) -> float:
        w = min(1.0, self.t_mem(op_kind, features) / (us_325 * 1e-6))
        return round(us_325 * (1.0 + (self.r - 1.0) * w), 4)


# --------------------------------------------------------------------------------------------
# Prefill attention (aiter's MHA forward on MI300X, aiconfigurator's context MLA on H100/H200)
# --------------------------------------------------------------------------------------------

#: ``FEATURES["attention_prefill"]`` as the tables list them (every point is a fresh causal
#: prefill: context = tokens)
PREFILL_FEATURES = ["qk_dim", "v_dim", "heads", "context", "batch", "tokens"]
AITER_MHA_README = "op_tests/cpp/mha/README.md"
AITER_MHA_COMMIT = "0403bcdfd0b507e0459012b82e00785a818f774a"
#: ROCm/aiter op_tests/cpp/mha/README.md @ AITER_MHA_COMMIT (added by PR #1270), "the asm kernel
#: performance of the attention forwards": BF16, BSHD, batch mode, head dim 128 (q, k and v),
#: causal rows, column FWD(TFLOPS) MI300X: ``(batch, q heads, seqlen_q = seqlen_kv, TFLOP/s)``
#: for kv_nheads 8 (the README's kv_nheads 4 rows differ by a few per cent; not used)
AITER_MHA_FWD_MI300X_CAUSAL = (
    (1, 32, 1024, 130.62), (1, 32, 2048, 255.105), (1, 32, 4096, 467.805),
    (1, 32, 8192, 522.68), (1, 32, 10240, 440.12),
    (4, 32, 1024, 334.005), (4, 32, 2048, 419.435), (4, 32, 4096, 486.73),
    (4, 32, 8192, 547.09), (4, 32, 10240, 527.705),
    (8, 32, 1024, 311.385), (8, 32, 2048, 412.99), (8, 32, 4096, 513.1),
    (8, 32, 8192, 537.36), (8, 32, 10240, 556.045),
    (1, 64, 1024, 228.54), (1, 64, 2048, 392.425), (1, 64, 4096, 474.385),
    (1, 64, 8192, 518.29), (1, 64, 10240, 510.895), (1, 64, 16384, 541.55),
    (4, 64, 1024, 326.51), (4, 64, 2048, 425.735), (4, 64, 4096, 513.79),
    (4, 64, 8192, 540.515), (4, 64, 10240, 557.475),
    (8, 64, 1024, 321.865), (8, 64, 2048, 452.03), (8, 64, 4096, 509.255),
    (8, 64, 8192, 550.67), (8, 64, 10240, 547.05),
)
_AITER_MHA_NOTE = (
    "README 'the asm kernel performance of the attention forwards' (PR #1270): aiter's fwd_v3 "
    "assembly kernel, BF16, head dim 128 / 128, GQA kv_nheads 8, causal, MI300X column. Time "
    "DERIVED from the published TFLOPS by the benchmark's own FLOP count (benchmark_mha_fwd.cpp: "
    "nhead x 2 x unmasked area x (hdim_q + hdim_v), causal area s (s + 1) / 2): t = batch x heads "
    "x 2 x s (s + 1) / 2 x 256 / TFLOPS. DeepSeek's MHA prefill (head dim 192 / 128, kv heads = "
    "q heads) runs aiter's CK kernel on MI300X (the same README: the 192 / 128 asm kernel is "
    "MI350/355 only) and no MI300X figure for it is published: the cost model transfers these "
    "points to the op's widths by the roofline ratio (an assumption: the 192 / 128 kernel "
    "reaches the 128 / 128 kernel's rate)")


def aiter_mha_prefill(applied_to: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """``({source id: source}, table)``: aiter's MI300X MHA forward figures as an
    ``attention_prefill`` table (``applied_to``: another GPU of the same 304-CU die)."""
    note = _AITER_MHA_NOTE
    if applied_to:
        note += (f". Measured on MI300X, applied unchanged to {applied_to} (same 304-CU "
                 "compute; long causal prefill is compute-bound)")
    src = {"repository": AITER_REPO, "path": AITER_MHA_README, "commit": AITER_MHA_COMMIT,
           "pr": 1270, "note": note}
    points = []
    for b, h, s, tflops in AITER_MHA_FWD_MI300X_CAUSAL:
        flop = b * h * 2.0 * s * (s + 1) / 2.0 * (128 + 128)
        points.append([128, 128, h, s, b, s, round(flop / (tflops * 1e12) * 1e6, 4)])
    table = _table("attention_prefill", "bf16", PREFILL_FEATURES, points,
                   source="aiter-mha-fwd-mi300x",
                   note="aiter MHA forward (asm v3, head dim 128, causal) on MI300X, derived "
                        "from the README's TFLOP/s; DeepSeek's 192 / 128 heads transfer by the "
                        "roofline ratio")
    return {"aiter-mha-fwd-mi300x": src}, table


def aic_context_mla(src: Path, gpu: str, label: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``({source id: source}, table)``: aiconfigurator's SGLang 0.5.14 context-MLA rows (BF16
    KV cache) as an ``attention_prefill`` table at the kernel's own widths, 576 / 512."""
    rel = "mla/sglang/0.5.14/context_mla_perf.parquet"
    note = (f"context_mla_perf: one prefill attention call (ms), measured by aiconfigurator's "
            f"collector on {label} through SGLang 0.5.14 (collector/sglang/collect_mla.py: "
            "RadixAttention forward alone, no q / kv up-projections, no o_proj; the fa3 "
            "FlashAttentionBackend of Hopper, page size 1). num_heads = local query heads, "
            "batch_size sequences of isl new tokens each, no cached prefix. On Hopper the "
            "collector feeds the ABSORBED MLA kernel: queries (heads x 512 latent + 64 RoPE) "
            "against one latent KV head (576 / 512, flash_attn_with_kvcache with qv), not the "
            "MHA over 192 / 128 per-head K and V that SGLang runs for a fresh prefill "
            "(deepseek_v2.py _handle_attention_backend: MHA_ONE_SHOT / MHA_CHUNKED_KV). The "
            "table keeps the kernel's widths; the cost model transfers to the op's widths by "
            "the roofline ratio. BF16 KV cache rows only (the MHA path computes on BF16 K / V), "
            "local heads 8-128 (DeepSeek's 128 heads under attention TP 1-16)")
    a = _parquet(src, gpu, rel)
    # local heads >= 8: DeepSeek's 128 heads under attention TP <= 16 (keeps the profile small)
    a = a[(a.kv_cache_dtype == "bfloat16") & (a.num_heads >= 8)]
    if set(a.kernel_source) != {"flash_attention"} or set(a.step) != {0}:
        raise SystemExit(f"{gpu}: unexpected context MLA rows")
    grouped = a.groupby(["num_heads", "batch_size", "isl"], sort=True)["latency"]
    sizes, means = grouped.size(), grouped.mean()
    sources = {"aic-context-mla": _aic(gpu, rel, note)}
    points = []
    for (h, b, isl), ms in means.items():
        points.append([KV_LORA + ROPE, KV_LORA, int(h), int(isl), int(b), int(isl), float(ms),
                       *([] if sizes[(h, b, isl)] == 1 else ["aic-context-mla-mean"])])
    if (sizes > 1).any():
        sources["aic-context-mla-mean"] = _aic(
            gpu, rel, note + ". DERIVED: the table holds these (num_heads, batch_size, isl) "
            "twice (two collections); the point is the mean of the two latencies")
    table = _table("attention_prefill", "bf16", PREFILL_FEATURES, points, unit="ms",
                   source="aic-context-mla",
                   note="SGLang MLA prefill attention (fa3, absorbed 576 / 512 kernel), BF16 "
                        "KV cache; DeepSeek's MHA prefill (192 / 128) transfers by the roofline "
                        "ratio")
    return sources, table


# --------------------------------------------------------------------------------------------
# Kernel sets per profile
# --------------------------------------------------------------------------------------------


def _table(op: str, dtype: str, features: list[str], points: list[list], *, unit: str = "us",
           source: str | None = None, quant: str | None = None, scope: str | None = None,
           note: str | None = None, mode: str | None = None,
           layout: str | None = None) -> dict[str, Any]:
    t: dict[str, Any] = {"op": op, "dtype": dtype}
    if scope is not None:
        t["scope"] = scope
    if mode is not None:
        t["mode"] = mode
    if layout is not None:
        t["layout"] = layout
    if quant is not None:
        t["quant"] = quant
    t["unit"] = unit
    if source is not None:
        t["source"] = source
    t["features"] = features
    if note is not None:
        t["note"] = note
    t["points"] = points
    return t


FMOE_FEATURES = ["tokens", "experts", "top_k", "hidden", "inter"]
GEMM_FEATURES = ["m", "n", "k"]
A2A_FEATURES = ["tokens", "ranks", "hidden"]


def _mori_tables(device: str, sid: str) -> list[dict[str, Any]]:
    tables = []
    for kind, dtype in (("dispatch", "fp8"), ("combine", "bf16")):
        fig = MORI_EP8[device][kind]
        rows = 4096 * 8 * p_hit(8)
        derived = rows * HIDDEN * MORI_ELEMENT_BYTES[kind] / (fig["bandwidth_4096_GBps"] * 1e9)
        tables.append(_table(kind, dtype, A2A_FEATURES, [
            [128, 8, HIDDEN, fig["latency_128_us"], sid],
            [4096, 8, HIDDEN, round(derived * 1e6, 3), sid + "-derived"],
        ], scope="intra", note="MORI-EP intra-node EP8; 128 tokens measured, 4096 derived from "
                               "the published bandwidth (its source states the formula)"))
        i = 0 if kind == "dispatch" else 1
        tables.append(_table(kind, dtype, A2A_FEATURES, [
            [128, ep, HIDDEN, times[i], sid + ("-ll-stale" if (device, ep) in MORI_LL_STALE
                                               else "-ll")]
            for ep, times in MORI_LL_INTER[device].items()],
            scope="inter", mode="low_latency",
            note="MORI-EP internode low-latency kernels (V1-LL), 128 tokens per rank, EP16 and "
                 "EP32 (2 and 4 nodes of 8); measured latency"))
    return tables


def _mori_ll(device: str, stale: bool = False, applied_to: str = "") -> dict[str, Any]:
    note = (f"MORI-EP 'Latency' rows EP16-V1-LL / EP32-V1-LL, {device}: internode low-latency "
            "dispatch/combine, 128 tokens per rank, 7168 hidden, top-8, FP8 dispatch + BF16 "
            "combine, 8 GPUs per node: measured latency")
    if stale:
        note += (". The README marks this row '* Stale data from previous kernel version; "
                 "updated numbers pending re-benchmarking': kept as the only published EP32 "
                 "figure")
    if applied_to:
        note += (f". Measured on {device.split(' +')[0]}, applied unchanged to {applied_to} "
                 "(the same 400 Gb/s NIC per GPU in the profile; internode latency is set by the "
                 "NIC and the kernel, not by HBM)")
    return {"repository": MORI_REPO, "path": "README.md", "commit": MORI_COMMIT, "note": note}


def amd_sets(src: Path, profiles: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    """mi325x and mi300x: set ``aiter`` (and ``no-aiter`` on mi300x)."""
    fmoe = aiter_fmoe_cu304(src)
    gemm = aiter_gemm(src, "gfx942")
    if len(gemm) != 295 or sum((m, n, k) in PR2881_ROWS for m, n, k, _ in gemm) != 37:
        raise SystemExit("expected 295 gfx942 block-scale GEMM rows, 37 of them from PR #2881")
    sources: dict[str, Any] = {}
    if name == "mi325x":
        sources["aiter-fmoe-mi325x"] = _aiter(AITER_FMOE, 3951, _FMOE_NOTE)
        sources["aiter-gemm-mi325x"] = _aiter(AITER_GEMM, 3951, _MI325X_ROWS_NOTE)
        sources["aiter-gemm-mi300x"] = _aiter(
            AITER_GEMM, 2881, _MI300X_ROWS_NOTE + ". On MI325X: MI300X-measured rows applied "
            "unchanged (same 304-CU compute; not sped up for MI325X's higher HBM bandwidth)")
        sources["mori-mi300x"] = _mori("MI300X + CX7", False, applied_to="MI325X")
        sources["mori-mi300x-derived"] = _mori("MI300X + CX7", True, applied_to="MI325X")
        sources["mori-mi300x-ll"] = _mori_ll("MI300X + CX7", applied_to="MI325X")
        sources["mori-mi300x-ll-stale"] = _mori_ll("MI300X + CX7", True, applied_to="MI325X")
        fmoe_points = [[t, 33, 9, HIDDEN, MOE_INTER, us] for t, us in fmoe]
        gemm_points = [[m, n, k, us, "aiter-gemm-mi300x" if (m, n, k) in PR2881_ROWS
                        else "aiter-gemm-mi325x"] for m, n, k, us in gemm]
        fmoe_source = "aiter-fmoe-mi325x"
        fmoe_note = "aiter fused MoE (2-stage), EP8 + the fused shared expert, measured on MI325X"
        gemm_note = ("aiter CK block-scale GEMM, 304 CUs: 258 rows measured on MI325X (PR #3951), "
                     "37 on MI300X (PR #2881); mostly TP8 shapes plus q_a / kv_a (see each "
                     "point's source)")
    else:
        transfer = Transfer(profiles["mi325x"], profiles["mi300x"])
        sources["aiter-fmoe-mi325x-to-mi300x"] = _aiter(AITER_FMOE, 3951,
                                                         _FMOE_NOTE + ". " + _TRANSFER_RULE)
        sources["aiter-gemm-mi300x"] = _aiter(AITER_GEMM, 2881, _MI300X_ROWS_NOTE)
        sources["aiter-gemm-mi325x-to-mi300x"] = _aiter(AITER_GEMM, 3951,
                                                         _MI325X_ROWS_NOTE + ". " + _TRANSFER_RULE)
        sources["mori-mi300x"] = _mori("MI300X + CX7", False)
        sources["mori-mi300x-derived"] = _mori("MI300X + CX7", True)
        sources["mori-mi300x-ll"] = _mori_ll("MI300X + CX7")
        sources["mori-mi300x-ll-stale"] = _mori_ll("MI300X + CX7", True)
        fmoe_points = []
        for t, us in fmoe:
            feats = [HIDDEN, MOE_INTER, 33, 9, t]  # FEATURES["grouped_gemm"] order
            fmoe_points.append([t, 33, 9, HIDDEN, MOE_INTER, transfer("grouped_gemm", feats, us)])
        gemm_points = []
        for m, n, k, us in gemm:
            if (m, n, k) in PR2881_ROWS:
                gemm_points.append([m, n, k, us, "aiter-gemm-mi300x"])
            else:
                gemm_points.append([m, n, k, transfer("gemm", [1, n, k, m], us),
                                    "aiter-gemm-mi325x-to-mi300x"])
        fmoe_source = "aiter-fmoe-mi325x-to-mi300x"
        fmoe_note = ("aiter fused MoE (2-stage), EP8 + the fused shared expert: MI325X rows "
                     "transferred to MI300X by the HBM-bandwidth rule (derived; see the source)")
        gemm_note = ("aiter CK block-scale GEMM: 37 rows measured on MI300X (PR #2881), 258 "
                     "MI325X rows (PR #3951) transferred to MI300X by the HBM-bandwidth rule")
    tables = [
        _table("grouped_gemm", "fp8", FMOE_FEATURES, fmoe_points, quant="per_1x128",
               source=fmoe_source, note=fmoe_note),
        _table("gemm", "fp8", GEMM_FEATURES, gemm_points, quant="per_1x128", note=gemm_note),
        *_mori_tables("MI300X + CX7", "mori-mi300x"),
    ]
    prefill_sources, prefill = aiter_mha_prefill("MI325X" if name == "mi325x" else "")
    sources.update(prefill_sources)
    tables.append(prefill)
    ar_sources, ar = amd_all_reduce(name)
    sources.update(ar_sources)
    tables.append(ar)
    gpu = name.upper()
    sets: dict[str, Any] = {"aiter": {
        "description": f"aiter on {gpu}: fused MoE (32 local experts + the shared expert, top-8 "
                       "+ 1) and FP8 block-scale GEMMs from aiter's tuned CSVs, MORI-EP "
                       "intra-node and internode low-latency dispatch/combine, aiter's MHA "
                       "forward for prefill attention (head dim 128, transferred to the op's "
                       "widths), vLLM's custom all-reduce; decode attention and everything else on "
                       "the roofline (no nhead-128 MLA decode table is published for this GPU)",
        "plan_options": {"shared_expert_in_moe": True},
        "tables": tables}}
    if name == "mi300x":
        sources.update(_speedup_sources())
        sets["no-aiter"] = {
            "description": "MI300X without aiter: aiter's times divided by AMD's published 'up "
                           "to' aiter speedups (block-scale GEMM 2x, fused MoE 3x, MLA decode "
                           "17x, ROCm/aiter README and AMD's DeepSeek-R1 blog). 'Up to' factors "
                           "are maxima over unstated shapes and baselines: this set is the bound "
                           "of a slow baseline, not a measured one. The shared expert runs as "
                           "its own GEMMs",
            "relative_to": "aiter",
            "plan_options": {"shared_expert_in_moe": False},
            "speedup": {kind: {"value": 1.0 / up, "source": "aiter-readme",
                               "note": f"aiter is up to {up:g}x faster: factor 1/{up:g} (see "
                                       "also amd-blog-dsr1)"}
                        for kind, up in AITER_SPEEDUP_UP_TO.items()}}
    return {"default": "aiter", "sources": sources, "sets": sets}


def mi355x_sets(src: Path) -> dict[str, Any]:
    shapes = deepseek_v3_shapes()
    gemm = aiter_gemm(src, "gfx950", max_m=32768, shapes=shapes)
    sources = {
        "aiter-gemm-gfx950": {
            "repository": AITER_REPO, "path": AITER_GEMM, "commit": AITER_COMMIT,
            "note": "gfx950 (MI350X/MI355X class, 256 CUs) rows at DeepSeek-V3 (N, K) shapes, M <= "
                    "32768; time = column us (the aiter tuner's measured time). The DeepSeek-V3.2 "
                    "indexer shapes of the file are left out"},
        "mori-mi355x": _mori("MI355X + AINIC", False),
        "mori-mi355x-derived": _mori("MI355X + AINIC", True),
        "mori-mi355x-ll": _mori_ll("MI355X + AINIC"),
    }
    tables = [
        _table("gemm", "fp8", GEMM_FEATURES, [[m, n, k, us] for m, n, k, us in gemm],
               quant="per_1x128", source="aiter-gemm-gfx950",
               note="aiter FP8 block-scale GEMM on gfx950 at DeepSeek-V3 shapes"),
        *_mori_tables("MI355X + AINIC", "mori-mi355x"),
    ]
    ar_sources, ar = amd_all_reduce("mi355x")
    sources.update(ar_sources)
    tables.append(ar)
    return {"default": "aiter", "sources": sources, "sets": {"aiter": {
        "description": "aiter on MI355X: FP8 block-scale GEMMs (gfx950 rows of aiter's DeepSeek-V3 "
                       "CSV), MORI-EP intra-node and internode low-latency dispatch/combine, vLLM's custom "
                       "all-reduce (8 GPUs). No fused-MoE table: aiter's "
                       "gfx950 DeepSeek fused-MoE rows are MoE-TP shapes only (257 experts, inter "
                       "256/512), no EP8 (33-expert) row, so the fused MoE stays on the roofline",
        "tables": tables}}}


REL_CAR = "comm/sglang/0.5.14/custom_allreduce_perf.parquet"
#: SGLang's custom all-reduce: used below this many bytes on NVLink (NCCL at and above)
CAR_MAX_BYTES = 8192 * 1024
SGLANG_CAR = ("sgl-project/sglang python/sglang/srt/distributed/device_communicators/"
              "custom_all_reduce.py @ 004e6561cb8ae26d62166c15782955f99f058274: "
              "should_custom_ar returns inp_size < max_size")


def _all_reduce_points(src: Path, gpu: str) -> list[list]:
    """The all-reduce SGLang runs on one node: its custom all-reduce (graph rows, source
    ``aic-car``) for messages under ``CAR_MAX_BYTES``, NCCL (``aic-nccl``) from there on."""
    car = _parquet(src, gpu, REL_CAR)
    car = car[car.backend == "sglang_graph"].sort_values(["num_gpus", "message_size"])
    nc = _parquet(src, gpu, "comm/nccl/2.29.2/nccl_perf.parquet")
    nc = nc[(nc.op_name == "all_reduce") & (nc.nccl_dtype == "half")].sort_values(
        ["num_gpus", "message_size"])
    points = [[int(r.num_gpus), 2 * int(r.message_size), float(r.latency), "aic-car"]
              for r in car.itertuples() if 2 * int(r.message_size) < CAR_MAX_BYTES]
    points += [[int(r.num_gpus), 2 * int(r.message_size), float(r.latency)]
               for r in nc.itertuples() if 2 * int(r.message_size) >= CAR_MAX_BYTES]
    return sorted(points, key=lambda p: (p[0], p[1]))


#: vLLM on ROCm runs its custom all-reduce below this many bytes (RCCL at and above); quick
#: reduce is off unless VLLM_ROCM_QUICK_REDUCE_QUANTIZATION is set (default "NONE")
VLLM_CAR_MAX_BYTES = 8192 * 1024
VLLM_CAR = ("vllm-project/vllm vllm/distributed/device_communicators/custom_all_reduce.py @ "
            "00d618aab60448acdf3fac3e9c4e2e22d0c6c753: CustomAllreduce(max_size=8192 * 1024), the "
            "CUDA-only CUSTOM_ALL_REDUCE_MAX_SIZES clamp skipped on ROCm; should_custom_ar returns "
            "inp_size < max_size on fully connected GPUs (the xGMI mesh); vllm/envs.py: "
            "VLLM_ROCM_QUICK_REDUCE_QUANTIZATION defaults to NONE (quick reduce off)")
#: vLLM PR #19744 (MI300X, kernel test, TP=4): the 'baseline' column, vLLM's all-reduce before
#: quick reduce, its custom all-reduce at these sizes (the PR: "vllm keeps using custom
#: allreduce for small inputs"); {message bytes: us}; 8 MB and up left out (RCCL runs there)
VLLM_CAR_MI300X_TP4_US = {2 * 1024: 7.18, 16 * 1024: 7.26, 32 * 1024: 7.58, 256 * 1024: 14.39,
                          512 * 1024: 14.65, 1024 ** 2: 22.91, 2 * 1024 ** 2: 36.64,
                          4 * 1024 ** 2: 63.86}
#: vLLM PR #39080 (MI355X, TP8, bf16, hidden 3072): the 'vllm/us' column, vLLM's shipped custom
#: all-reduce before the PR's change; {tokens: us}, bytes = tokens x 3072 x 2
VLLM_CAR_MI355X_TP8_US = {4: 6.3, 8: 6.7, 16: 7.6, 32: 10.0, 64: 13.1, 128: 16.0, 256: 24.2}


def amd_all_reduce(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(sources, table)``: the all-reduce vLLM runs on one AMD node, its custom all-reduce
    (below ``VLLM_CAR_MAX_BYTES``) as its PRs measured it. MI300X / MI325X: 4 GPUs only (no
    8-GPU table of vLLM's custom all-reduce on MI300X is transcribed), so an 8-GPU lookup is
    the nearest 4-GPU point scaled by the roofline (marked extrapolated); MI355X: 8 GPUs."""
    if name == "mi355x":
        sid = "vllm-car-mi355x"
        points = [[8, tokens * 3072 * 2, us] for tokens, us in VLLM_CAR_MI355X_TP8_US.items()]
        src = {"url": "https://github.com/vllm-project/vllm/pull/39080", "note": (
            "vLLM PR #39080 ('[ROCM] Optimize all-reduce performances', closed unmerged), table "
            "'TP8 (bf16, dim=3072)' on MI355X: the 'vllm/us' column, vLLM's custom all-reduce "
            "as shipped before the PR, tokens 4-256 (24 KiB - 1.5 MiB), bytes = tokens x 3072 "
            f"x 2. vLLM runs it below 8 MiB ({VLLM_CAR})")}
        note = "vLLM's custom all-reduce on MI355X, 8 GPUs, 24 KiB - 1.5 MiB"
    else:
        sid = "vllm-car-mi300x" + ("-to-mi325x" if name == "mi325x" else "")
        points = [[4, b, us] for b, us in VLLM_CAR_MI300X_TP4_US.items() if b < VLLM_CAR_MAX_BYTES]
        applied = (" Applied to MI325X unchanged (same gfx942 die and xGMI links: an "
                   "assumption)" if name == "mi325x" else "")
        src = {"url": "https://github.com/vllm-project/vllm/pull/19744", "note": (
            "vLLM PR #19744 ('[Feature][Rocm] add quick all reduce for rocm', merged), kernel "
            "test on MI300X, table 'TP=4': the 'baseline' column (us), vLLM's all-reduce "
            "without quick reduce, i.e. its custom all-reduce at these sizes (the PR: 'vllm "
            "keeps using custom allreduce for small inputs'), 2 KB - 4 MB (KB = 1024 bytes); "
            f"8 MB and up left out (RCCL runs there: {VLLM_CAR}). No 8-GPU table is "
            "transcribed: an 8-GPU all-reduce is the nearest 4-GPU point scaled by the "
            "roofline ratio (extrapolated)." + applied)}
        note = "vLLM's custom all-reduce on MI300X, 4 GPUs, 2 KB - 4 MB"
    table = _table("all_reduce", "bf16", ["ranks", "bytes"], points, scope="intra", source=sid,
                   note=note + "; outside it the nearest point scaled by the roofline "
                        "(extrapolated)")
    return {sid: src}, table


#: aiconfigurator's wide-EP MoE tables (SGLang 0.5.10): {exchange mode: (file, op_name, what)}
WIDEEP_MOE = {
    "low_latency": ("moe/sglang/0.5.10/wideep_generation_moe_perf.parquet", "moe_generation",
                    "decode: DeepEP low-latency layout, DeepGEMM masked grouped GEMM "
                    "(m_grouped_fp8_gemm_nt_masked) timed in a CUDA graph"),
    "normal": ("moe/sglang/0.5.10/wideep_context_moe_perf.parquet", "moe_context",
               "prefill: DeepEP normal layout, DeepGEMM contiguous grouped GEMM "
               "(m_grouped_fp8_gemm_nt_contiguous) timed eagerly with CUDA events"),
}
#: the collector that wrote them: the last version of the wide-EP MoE collector before the
#: tables' commit (PR #963, cb4d907c, "sglang 0.5.10 perf data"); it was folded into the v2
#: collector at 1d12d321 and is absent at AIC_COMMIT
WIDEEP_COLLECTOR = ("collector/sglang/collect_wideep_deepep_moe.py @ cb4d907c (PR #963, the "
                    "commit that added these tables)")
#: FP8 bytes of one DeepSeek-V3 routed expert's weights (gate, up, down)
EXPERT_WEIGHT_BYTES = 3 * HIDDEN * MOE_INTER


def _wideep_note(mode: str, dropped: int, peak: float) -> str:
    rel, op_name, what = WIDEEP_MOE[mode]
    note = (f"{rel.rsplit('/', 1)[-1]} ({op_name}, kernel_source deepepmoe, fp8_block, SGLang "
            f"0.5.10): {what}. DeepSeek-V3 (hidden 7168, inter 2048, 256 experts, topk 8), "
            "distribution 'uniform' rows only (the power_law_* rows are the collector's own "
            "skewed draws: epsim's routing supplies the imbalance). The collector "
            f"({WIDEEP_COLLECTOR}) loads 256 / ep experts on one GPU and feeds them "
            "num_token tokens per rank, each local expert getting num_token x 8 x ep / 256 "
            "rows; it logs num_tokens = num_token x ep. So tokens = num_tokens / ep (the "
            "rank's batch before dispatch), experts = 256 / ep; time = column latency (ms), "
            "the expert GEMMs alone (no dispatch / combine)")
    if dropped:
        note += (f". REFUSED {dropped} row(s) whose time is below what reading the active "
                 "experts' FP8 weights takes at the GPU's HBM peak (active experts x 7168 x 2048 "
                 f"x 3 bytes / latency > {peak / 1e12:g} TB/s: physically impossible; all at ep "
                 "<= 8 and few tokens)")
    return note


def wideep_moe_table(src: Path, gpu: str, mode: str, peak_bytes_s: float
                     ) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """``(table, source id, source)`` of one aiconfigurator wide-EP MoE table: the fused MoE as
    SGLang's DeepEP deployment runs it in exchange ``mode`` (EP layout)."""
    rel, op_name, _ = WIDEEP_MOE[mode]
    d = _parquet(src, gpu, rel)
    d = d[(d.hidden_size == HIDDEN) & (d.inter_size == MOE_INTER) & (d.topk == TOP_K)
          & (d.num_experts == EXPERTS) & (d.moe_dtype == "fp8_block") & (d.moe_tp_size == 1)
          & (d.distribution == "uniform")].sort_values(["moe_ep_size", "num_tokens"])
    if set(d.op_name) != {op_name} or set(d.kernel_source) != {"deepepmoe"}:
        raise SystemExit(f"{gpu}: unexpected wide-EP MoE rows in {rel}")
    if d.duplicated(["num_tokens", "moe_ep_size"]).any():
        raise SystemExit(f"{gpu}: duplicate wide-EP MoE rows in {rel}")
    points, dropped = [], 0
    for r in d.itertuples():
        ep, per_rank = int(r.moe_ep_size), int(r.num_tokens) / int(r.moe_ep_size)
        local = EXPERTS // ep
        # the collector's uniform rows: every local expert gets tokens once the group's pairs
        # cover them, else per_rank x 8 experts get one row each
        active = local if per_rank * TOP_K * ep >= EXPERTS else min(local, per_rank * TOP_K)
        if active * EXPERT_WEIGHT_BYTES / (float(r.latency) * 1e-3) > peak_bytes_s:
            dropped += 1
            continue
        points.append([_int(per_rank), local, TOP_K, HIDDEN, MOE_INTER, float(r.latency)])
    sid = f"aic-wideep-moe-{'decode' if mode == 'low_latency' else 'prefill'}"
    note = _wideep_note(mode, dropped, peak_bytes_s)
    kernel = "masked" if mode == "low_latency" else "contiguous"
    table = _table("grouped_gemm", "fp8", FMOE_FEATURES, points, unit="ms", source=sid,
                   quant="per_1x128", mode=mode, layout="ep",
                   note=f"SGLang wide EP ({'decode' if mode == 'low_latency' else 'prefill'}): "
                        f"DeepEP {mode.replace('_', '-')} + DeepGEMM {kernel} grouped GEMM, "
                        f"uniform routing, EP {int(d.moe_ep_size.min())}-"
                        f"{int(d.moe_ep_size.max())}")
    return table, sid, _aic(gpu, rel, note)


def tp_moe_table(src: Path, gpu: str, rel_moe: str, meta: str
                 ) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """``(table, source id, source)`` of the Triton fused MoE's TP rows (moe_ep_size 1): the
    MoE of a TP-only plan (every rank all 256 experts, inter / tp)."""
    e = _parquet(src, gpu, rel_moe)
    e = e[(e.hidden_size == HIDDEN) & (e.inter_size == MOE_INTER) & (e.topk == TOP_K)
          & (e.num_experts == EXPERTS) & (e.moe_dtype == "fp8_block") & (e.moe_ep_size == 1)
          & (e.distribution == "balanced")].sort_values(["moe_tp_size", "num_tokens"])
    if set(e.kernel_source) != {"sglang_fused_moe_triton"} or e.duplicated(
            ["num_tokens", "moe_tp_size"]).any():
        raise SystemExit(f"{gpu}: unexpected TP MoE rows")
    points = [[int(r.num_tokens), EXPERTS, TOP_K, HIDDEN, MOE_INTER // int(r.moe_tp_size),
               float(r.latency)] for r in e.itertuples()]
    sid = "aic-moe-tp"
    note = (f"moe_perf: fused-MoE latency (ms), {meta} 0.5.14, sglang_fused_moe_triton "
            "fp8_block, DeepSeek-V3 (hidden 7168, inter 2048, 256 experts, topk 8), moe_ep_size "
            "1, moe_tp_size 1-16, distribution 'balanced'. collector/sglang/collect_moe.py "
            "run_moe_torch: local_inter_size = inter_size / moe_tp_size, all 256 experts local, "
            "num_tokens rows entering the kernel (every TP rank sees every token). So tokens = "
            "num_tokens, experts 256, inter = 2048 / tp")
    table = _table("grouped_gemm", "fp8", FMOE_FEATURES, points, unit="ms", source=sid,
                   quant="per_1x128", layout="tp",
                   note="SGLang Triton fused MoE, TP-only (every rank a 1/tp slice of every "
                        f"expert), TP {int(e.moe_tp_size.min())}-{int(e.moe_tp_size.max())}")
    return table, sid, _aic(gpu, rel_moe, note)


def triton_ep_set(e, label: str) -> dict[str, Any]:
    """Set ``sglang-triton``: SGLang's EP without DeepEP, the Triton fused MoE's EP rows."""
    table = _table("grouped_gemm", "fp8", FMOE_FEATURES, [
        [_int(int(r.num_tokens) / int(r.moe_ep_size)), EXPERTS // int(r.moe_ep_size), TOP_K,
         HIDDEN, MOE_INTER, float(r.latency)] for r in e.itertuples()],
        unit="ms", source="aic-moe", quant="per_1x128", layout="ep",
        note="SGLang's Triton fused MoE (not the DeepGEMM kernels DeepEP deployments run), "
             "balanced routing, EP 8-256")
    return {"description": f"SGLang 0.5.14 on {label} with EP served by the Triton fused MoE "
                           "(SGLang's EP without --moe-a2a-backend deepep): the sglang set but "
                           "for the EP fused MoE, aiconfigurator's moe_perf EP rows. Their "
                           "rows at ep >= 16 imply 1-2 % of the FP8 peak",
            "relative_to": "sglang", "tables": [table]}


def nvidia_sglang_sets(src: Path, gpu: str, label: str) -> dict[str, Any]:
    """h100 / h200: set ``sglang`` from aiconfigurator's SGLang 0.5.14 databases."""
    shapes = deepseek_v3_shapes()
    meta = f"measured by aiconfigurator's collector on {label} through SGLang"
    rel_gemm = "gemm/sglang/0.5.14/gemm_perf.parquet"
    rel_moe = "moe/sglang/0.5.14/moe_perf.parquet"
    rel_mla = "mla/sglang/0.5.14/generation_mla_perf.parquet"
    rel_ll = "comm/sglang/0.5.12/wideep_deepep_ll_perf.parquet"
    rel_nccl = "comm/nccl/2.29.2/nccl_perf.parquet"
    sources = {
        "aic-gemm": _aic(gpu, rel_gemm, f"gemm_perf: one GEMM's latency (ms), {meta} 0.5.14; "
                         "fp8_block = sglang_deepgemm_gemm_nt_f8f8bf16 (DeepGEMM, 128x128 block "
                         "scales), bfloat16 = torch linear; DeepSeek-V3 (N, K) present in the "
                         "database's grid, M 1-4096"),
        "aic-moe": _aic(gpu, rel_moe, f"moe_perf: fused-MoE latency (ms), {meta} 0.5.14, "
                        "sglang_fused_moe_triton fp8_block, DeepSeek-V3 (hidden 7168, inter 2048, "
                        "256 experts, topk 8), moe_tp 1, distribution 'balanced'. num_tokens is "
                        "the EP group's batch; rank 0's 256/ep experts are timed on the tokens "
                        "routed to them (collector/sglang/collect_moe.py build_rank0_workloads), "
                        "so tokens = num_tokens / ep, experts = 256 / ep: the EP rows (ep >= 8) "
                        "of set sglang-triton (the TP rows, moe_ep_size 1, are source "
                        "aic-moe-tp). Not used: power_law_1.01 / power_law_1.2 rows, tp > 1 "
                        "with ep > 1, 1 < ep < 8"),
        "aic-mla": _aic(gpu, rel_mla, f"generation_mla_perf: one MLA decode attention call (ms), "
                        f"{meta} 0.5.14 (flash_attention backend, page size 1), DeepSeek geometry "
                        "(kv_lora 512, rope 64); num_heads = local heads; context = step + 1 (the "
                        "cached history plus the new token)"),
        "aic-deepep-ll": _aic(gpu, rel_ll, f"wideep_deepep_ll_perf: DeepEP low-latency "
                              f"dispatch / combine (us, *_avg_t_us), {meta} 0.5.12, one node (EP8), "
                              "hidden 7168, top-8, 256 experts, FP8 dispatch / BF16 combine, by "
                              "tokens per rank"),
        "aic-car": _aic(gpu, REL_CAR, f"custom_allreduce_perf: SGLang's custom all-reduce "
                        f"latency (ms), {meta} 0.5.14, the SGLang_CustomAllReduce_graph rows "
                        "(replayed in a CUDA graph, as the collector's provenance says: "
                        "used_cuda_graph); message_size is in elements (bf16), bytes = 2 x "
                        "message_size. SGLang runs it for messages under CustomAllreduce's "
                        f"_MAX_CAR_SIZE = 8192 * 1024 bytes ({SGLANG_CAR})"),
        "aic-nccl": _aic(gpu, rel_nccl, f"nccl_perf: NCCL 2.29.2 all_reduce latency (ms), {meta}'s "
                         "nccl-tests runs; nccl_dtype 'half' rows: message_size is in elements "
                         "(collector/network/collect_nccl.py), bytes = 2 x message_size; fp16 "
                         "moves the bytes of bf16, so the table is keyed bf16"),
    }
    tables = []
    g = _parquet(src, gpu, rel_gemm)
    g = g[g.m.le(4096) & g.gemm_dtype.isin(["fp8_block", "bfloat16"])]
    for dtype, key in (("fp8", "fp8_block"), ("bf16", "bfloat16")):
        d = g[(g.gemm_dtype == key)]
        d = d[[(int(n), int(k)) in shapes for n, k in zip(d.n, d.k, strict=True)]]
        d = d.sort_values(["n", "k", "m"])
        if d.duplicated(["m", "n", "k"]).any():
            raise SystemExit(f"{gpu}: duplicate {key} GEMM rows")
        tables.append(_table("gemm", dtype, GEMM_FEATURES,
                             [[int(r.m), int(r.n), int(r.k), float(r.latency)] for r in d.itertuples()],
                             unit="ms", source="aic-gemm",
                             quant="per_1x128" if dtype == "fp8" else None,
                             note=f"SGLang {'DeepGEMM block-scale FP8' if dtype == 'fp8' else 'BF16 torch'} "
                                  "GEMMs at the DeepSeek-V3 shapes aiconfigurator's grid has"))
    e = _parquet(src, gpu, rel_moe)
    e = e[(e.hidden_size == HIDDEN) & (e.inter_size == MOE_INTER) & (e.topk == TOP_K)
          & (e.num_experts == EXPERTS) & (e.moe_dtype == "fp8_block") & (e.moe_tp_size == 1)
          & (e.moe_ep_size >= 8) & (e.distribution == "balanced")]
    if set(e.kernel_source) != {"sglang_fused_moe_triton"}:
        raise SystemExit(f"{gpu}: unexpected MoE kernels {set(e.kernel_source)}")
    e = e.sort_values(["moe_ep_size", "num_tokens"])
    # the fused MoE each deployment runs: TP-only the Triton kernel's TP rows, wide-EP decode
    # (low-latency exchange) the masked and prefill (normal exchange) the contiguous grouped GEMM
    peak = HBM_PEAK[gpu]
    for table, sid, source in (tp_moe_table(src, gpu, rel_moe, meta),
                               wideep_moe_table(src, gpu, "low_latency", peak),
                               wideep_moe_table(src, gpu, "normal", peak)):
        tables.append(table)
        sources[sid] = source
    a = _parquet(src, gpu, rel_mla)
    for dtype, key in (("bf16", "bfloat16"), ("fp8", "fp8")):
        d = a[a.kv_cache_dtype == key]
        grouped = d.groupby(["num_heads", "batch_size", "step"], sort=True)["latency"]
        sizes = grouped.size()
        means = grouped.mean()
        points = []
        for (h, b, step), ms in means.items():
            points.append([int(h), int(b), int(step) + 1, float(ms),
                           "aic-mla" if sizes[(h, b, step)] == 1 else "aic-mla-mean"])
        note = ("SGLang MLA decode (flash_attention backend), heads = local heads, "
                f"{'BF16' if dtype == 'bf16' else 'FP8'} KV cache")
        if dtype == "fp8":
            note += ("; these FP8-KV rows are about 4x slower than the BF16-KV rows (an SGLang "
                     "backend artefact, not an FP8 kernel's capability): kept as measured")
        tables.append(_table("attention_decode", dtype, ["heads", "batch", "context"], points,
                             unit="ms", note=note))
        if (sizes > 1).any():
            sources["aic-mla-mean"] = _aic(
                gpu, rel_mla, sources["aic-mla"]["note"] + ". DERIVED: the table holds every "
                "(num_heads, batch_size, step) twice (two collections); the point is the mean "
                "of the two latencies")
    prefill_sources, prefill = aic_context_mla(src, gpu, label)
    sources.update(prefill_sources)
    tables.append(prefill)
    ll = _parquet(src, gpu, rel_ll)
    ll = ll[(ll.hidden_size == HIDDEN) & (ll.num_topk == TOP_K) & (ll.num_experts == EXPERTS)
            & (ll.node_num == 1)].sort_values("num_token")
    for kind, dtype in (("dispatch", "fp8"), ("combine", "bf16")):
        tables.append(_table(kind, dtype, A2A_FEATURES, [
            [int(r.num_token), 8, HIDDEN, float(getattr(r, f"{kind}_avg_t_us"))]
            for r in ll.itertuples()], scope="intra", source="aic-deepep-ll",
            note="DeepEP low-latency kernels in one node (EP8)"))
    tables.append(_table("all_reduce", "bf16", ["ranks", "bytes"], _all_reduce_points(src, gpu),
                         unit="ms", scope="intra", source="aic-nccl",
                         note="SGLang's custom all-reduce (CUDA-graph rows) below its 8 MiB "
                              "limit, NCCL at and above it; one node, 2, 4, 8 GPUs"))
    return {"default": "sglang", "sources": sources, "sets": {"sglang": {
        "description": f"SGLang 0.5.14 on {label} as aiconfigurator measured it: DeepGEMM FP8 and "
                       "BF16 GEMMs; the fused MoE each deployment runs (TP-only: the Triton "
                       "fused MoE's TP rows; EP: SGLang 0.5.10's DeepEP wide-EP kernels, the "
                       "masked grouped GEMM under the low-latency exchange (decode), the "
                       "contiguous one under the normal exchange (prefill)); MLA decode "
                       "(flash_attention backend; its FP8-KV rows are ~4x slower than BF16-KV, "
                       "kept as measured), context MLA for prefill attention (the absorbed "
                       "576 / 512 kernel, transferred to the op's MHA widths), DeepEP "
                       "low-latency dispatch/combine in one node, NCCL all-reduce",
        "tables": tables}, "sglang-triton": triton_ep_set(e, label)}}


def h800_sets(src: Path) -> dict[str, Any]:
    dense = deepgemm(src, "dense_gemm")
    masked = deepgemm(src, "grouped_masked")
    sources = {"deepgemm-dense": _deepgemm("dense GEMMs (normal layout)"),
               "deepgemm-masked": _deepgemm(
                   "grouped GEMMs, masked layout (decode; every group filled to m_per_group, i.e. "
                   "uniform routing). A fused-MoE point joins the up/gate row (N 4096 x K 7168) "
                   "and the down row (N 7168 x K 2048) of the same (groups, m_per_group): "
                   "experts = groups, top_k 8, tokens = groups x m_per_group / 8, time = t(up/"
                   "gate) + t(down) (the SwiGLU between them not counted)"),
               "deepep-ll": _deepep("ll"), "deepep-normal-derived": _deepep("normal")}
    gemm_points = [[r["m"], r["n"], r["k"], r["us"]] for r in dense]
    by_shape: dict[tuple[int, int], dict[tuple[int, int], float]] = {}
    for r in masked:
        by_shape.setdefault((r["groups"], r["m"]), {})[(r["n"], r["k"])] = r["us"]
    fmoe_points = []
    for (g, m), parts in sorted(by_shape.items()):
        up, down = parts.get((2 * MOE_INTER, HIDDEN)), parts.get((HIDDEN, MOE_INTER))
        if up is None or down is None:
            continue
        fmoe_points.append([_int(g * m / TOP_K), g, TOP_K, HIDDEN, MOE_INTER,
                            round(up + down, 3)])
    tables = [
        _table("gemm", "fp8", GEMM_FEATURES, gemm_points, quant="per_1x128",
               source="deepgemm-dense",
               note="DeepGEMM dense FP8 GEMMs at DeepSeek-V3's un-split shapes (times from TFLOPS)"),
        _table("grouped_gemm", "fp8", FMOE_FEATURES, fmoe_points, quant="per_1x128",
               source="deepgemm-masked",
               note="DeepGEMM masked grouped GEMMs: up/gate + down per (groups, m_per_group)"),
    ]
    for i, (kind, dtype) in enumerate((("dispatch", "fp8"), ("combine", "bf16"))):
        normal_us = (4096 * 8 * p_hit(8) * DEEPEP_NORMAL_ROW_BYTES[kind]
                     / (DEEPEP_NORMAL_INTRA_GBPS[kind] * 1e9) * 1e6)
        tables.append(_table(kind, dtype, A2A_FEATURES, [
            [128, 8, HIDDEN, DEEPEP_LL_128[8][i], "deepep-ll"],
            [4096, 8, HIDDEN, round(normal_us, 3), "deepep-normal-derived"]],
            scope="intra", note="DeepEP EP8 in one node: low-latency kernel at 128 tokens per "
                                "rank (measured), normal kernel at 4096 (derived from its "
                                "NVLink bandwidth)"))
        tables.append(_table(kind, dtype, A2A_FEATURES, [
            [128, ep, HIDDEN, times[i]] for ep, times in DEEPEP_LL_128.items() if ep > 8],
            scope="inter", source="deepep-ll", mode="low_latency",
            note="DeepEP low-latency kernels across nodes, 128 tokens per rank, EP16-EP256. The "
                 "README's internode normal-kernel RDMA bandwidths (EP16-64, 4096 tokens, top-4 "
                 "groups) are left out: their byte count depends on the group-limited routing "
                 "and the NVLink forwarding of the test, which do not map onto a per-rank time "
                 "without a model of both"))
    return {"default": "deepseek", "sources": sources, "sets": {"deepseek": {
        "description": "DeepSeek's own kernels on H800: DeepGEMM FP8 dense and masked grouped "
                       "GEMMs (times derived from the published TFLOPS), DeepEP dispatch/combine "
                       "(low-latency EP8-EP256 at 128 tokens per rank; normal intranode at 4096). "
                       "The shared expert runs as its own GEMMs (DeepSeek's layout); MLA decode "
                       "on the roofline with FlashMLA's published peaks",
        "plan_options": {"shared_expert_in_moe": False},
        "tables": tables}}}


# --------------------------------------------------------------------------------------------
# The H800 profile (hardware figures + efficiency), from h100.json and the H800 constants
# --------------------------------------------------------------------------------------------

_AIC_H800 = ("ai-dynamo/aiconfigurator src/aiconfigurator/systems/h800_sxm.yaml @ 77f0282e")


def h800_profile(h100: dict[str, Any]) -> dict[str, Any]:
    """sim/hardware/profiles/h800.json without its kernels: H800 figures where published, else H100's
    (same GH100 die), each key's source saying which."""
    prof = json.loads(json.dumps(h100))
    prof.pop("kernels", None)
    prof["name"] = "h800"
    prof["description"] = ("NVIDIA H800 SXM5 80 GB, 8 per node, NVLink capped at 400 GB/s "
                           "bidirectional, 8 x 400 Gb/s CX7 per node (DeepSeek's training and "
                           "serving GPU)")
    prof["peak_flops"] = dict(H800_PEAK_FLOPS)
    prof["hbm_bytes"] = H800_HBM_BYTES
    prof["hbm_bandwidth"] = H800_HBM_BANDWIDTH
    links = 8
    prof["fabric"] = {"topology": "switch", "links_per_gpu": links,
                      "link_bandwidth": H800_NVLINK_PER_DIRECTION / links}
    prof["nic_bandwidth_per_gpu"] = H800_NIC_PER_GPU
    s = prof["sources"]
    s["compute_units"] = ("borrowed from h100: 132 SMs (the H800 SXM5 is the GH100 SXM5 part; "
                          f"{_AIC_H800}: compute 'identical to H100 SXM')")
    s["peak_flops"] = (f"{_AIC_H800}: bfloat16_tc_flops 989 TF, fp8_tc_flops 1978 TF ('identical to "
                       "H100 SXM'); fp16 as bf16, fp32 67 TF borrowed from h100")
    s["hbm_bytes"] = f"{_AIC_H800}: mem_capacity 85899345920 (80 GiB)"
    s["hbm_bandwidth"] = (f"{_AIC_H800}: mem_bw 3350 GB/s ('identical to H100 SXM'); FlashMLA "
                          "docs/20250422-new-kernel-deep-dive.md: 'peak memory bandwidth of 3.35 TB/s'")
    s["fabric"] = (f"{_AIC_H800}: 'H800 NVLink is capped at ~400 GB/s bidirectional (200 GB/s per "
                   "direction)', intra_node_bw 200e9 per GPU single direction, all GPUs through "
                   "NVSwitch; links_per_gpu 8 x 25 GB/s is that figure over NVLink 4's per-link "
                   "rate (h100's 25 GB/s; only the product is used by the switch model)")
    s["nic_bandwidth_per_gpu"] = ("deepseek-ai/DeepEP README @ 567632dd: 'H800 ... each connected "
                                  "to a CX7 InfiniBand 400 Gb/s RDMA network card (~50 GB/s "
                                  f"maximum bandwidth)'; {_AIC_H800}: inter_node_bw 50e9")
    s["cache_bytes"] = "borrowed from h100: 50 MB L2 (same GH100 die)"
    s["kernel_launch_s"] = ("borrowed from h100 (CUDA launch overhead, about 4 us; an "
                            "assumption there: no primary launch microbenchmark cited)")
    e = prof["efficiency"]
    e["gemm_flops_fraction"] = dict(e["gemm_flops_fraction"])
    e["gemm_flops_fraction"]["fp8"] = DEEPGEMM_BEST_DENSE_TFLOPS * 1e12 / H800_PEAK_FLOPS["fp8"]
    s["efficiency.gemm_flops_fraction"] = (
        "fp8: deepseek-ai/DeepGEMM README @ 327ec92f, best dense FP8 GEMM on H800 1520 TFLOPS (M "
        "4096, N 7168, K 16384) over the 1978 TF peak; bf16 / fp16 borrowed from h100 (there: "
        "assumed MI325X's hipBLASLt fractions)")
    e["hbm_fraction"] = FLASHMLA_PEAK_BYTES_S / H800_HBM_BANDWIDTH
    s["efficiency.hbm_fraction"] = (
        "deepseek-ai/FlashMLA README @ 9241ae3e: MLA decode 'up to 3000 GB/s in memory-bound "
        "configuration ... on H800 SXM5', over the 3.35 TB/s peak")
    e["attention_decode_flops"] = {"fp8": FLASHMLA_PEAK_FLOPS, "bf16": FLASHMLA_PEAK_FLOPS}
    s["efficiency.attention_decode_flops"] = (
        "deepseek-ai/FlashMLA README @ 9241ae3e: dense MLA decode up to 660 TFLOPS compute-bound "
        "on H800 SXM5 (CUDA 12.8); fp8 KV: the kernel dequantises to BF16, taken at the same rate "
        "(assumption, as on h100)")
    e["link_bandwidth_usable"] = 0.775 * H800_NVLINK_PER_DIRECTION
    s["efficiency.link_bandwidth_usable"] = (
        "deepseek-ai/DeepEP README @ 567632dd: intranode dispatch/combine 153 / 158 GB/s on H800 "
        "NVLink (200 GB/s per direction): 0.775 of 200 GB/s")
    e["comm_compute_slowdown"] = 20 / 132
    s["efficiency.comm_compute_slowdown"] = (
        "borrowed from h100: DeepEP's default of 20 SMs for its kernels (vLLM "
        "DeepEPAll2AllManagerBase.num_sms = 20) of the 132 SMs; the DeepSeek-V3 report is quoted "
        "(secondary source: stratechery 'DeepSeek FAQ') as giving 20 of 132 SMs to communication")
    for key in ("attention_split_tokens", "collective_latency_s", "collective_latency_graph_s",
                "graph_node_s", "gemm_tile_m", "a2a_latency_s", "graph_launch_s",
                "kernel_floor_s"):
        s[f"efficiency.{key}"] = "borrowed from h100 (no H800 figure): " + s[f"efficiency.{key}"]
    s["efficiency.nic_bandwidth_usable"] = (
        "deepseek-ai/DeepEP README @ 567632dd: internode normal kernels on H800 + CX7 400 Gb/s "
        "(~50 GB/s maximum) reach 43-58 GB/s RDMA bottleneck bandwidth (EP16-64); h100's 45 GB/s "
        "(the midpoint of 43-47 GB/s) kept")
    return prof


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _scalar(v: Any) -> bool:
    return not isinstance(v, (dict, list))


def dumps(obj: Any, indent: int = 0) -> str:
    """JSON as ``json.dumps(indent=2)`` writes it, except that a list of scalars (a point)
    stays on one line."""
    pad, inner = " " * indent, " " * (indent + 2)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{inner}{json.dumps(k, ensure_ascii=False)}: {dumps(v, indent + 2)}"
                 for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list):
        if all(_scalar(v) for v in obj):
            return json.dumps(obj, ensure_ascii=False)
        return "[\n" + ",\n".join(inner + dumps(v, indent + 2) for v in obj) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=False)


# --------------------------------------------------------------------------------------------
# Kernel floors and framework dispatch (efficiency.kernel_floor_s, efficiency.framework_dispatch_s)
# --------------------------------------------------------------------------------------------

#: PyTorch's eager path of one op (Python call, dispatcher, a one-element kernel): 4.5 us
FRAMEWORK_DISPATCH_S = 4.5e-6
FRAMEWORK_DISPATCH_SOURCE = (
    "https://dev-discuss.pytorch.org/t/micro-optimizations-for-the-most-micro-of-benchmarks/1836 "
    "(PyTorch dev-discuss, J. Ansel): the eager baseline of add1(x) = x + 1 takes 4.5 us per call "
    "on an i9-11900K (Python call + dispatcher + a one-element CPU kernel); taken as the "
    "framework's cost of the torch op call behind each kernel of an eager engine, on every host "
    "(assumption: the serving hosts' CPUs are of that class)")
#: the profiles' floor: the smallest time of the GPU's measured GEMM table (a GEMM of a few KB
#: or MB of weights: launch to finish of a kernel doing almost no work)
_FLOOR_TABLES = {"mi300x": ("aiter", "gfx942"), "mi325x": ("aiter", "gfx942"),
                 "mi355x": ("aiter", "gfx950"), "h100": ("aic", "h100_sxm"),
                 "h200": ("aic", "h200_sxm")}


def kernel_floor(src: Path, name: str) -> tuple[float, str]:
    """``(seconds, source)``: profile ``name``'s kernel floor, the smallest point of its measured
    GEMM table (aiter's tuned block-scale GEMMs by ``gfx``; aiconfigurator's SGLang GEMMs)."""
    lib, tag = _FLOOR_TABLES[name]
    if lib == "aiter":
        with (src / "aiter" / Path(AITER_GEMM).name).open() as f:
            rows = [r for r in csv.DictReader(f) if r["gfx"] == tag and float(r["us"]) > 0]
        best = min(rows, key=lambda r: float(r["us"]))
        where = (f"{AITER_REPO} {AITER_GEMM} @ {AITER_COMMIT}: the smallest {tag} point, M "
                 f"{best['M']} N {best['N']} K {best['K']}: {best['us']} us")
        return float(best["us"] + "e-6"), where
    rel = "gemm/sglang/0.5.14/gemm_perf.parquet"
    df = _parquet(src, tag, rel)
    best = df.loc[df["latency"].idxmin()]
    where = (f"{AIC_REPO} {AIC_DATA}/{tag}/{rel} @ {AIC_COMMIT}: the smallest point, "
             f"{best['gemm_dtype']} m {best['m']} n {best['n']} k {best['k']}: "
             f"{float(best['latency']) * 1e3:.3f} us")
    return float(best["latency"]) * 1e-3, where


def _host_and_floor(src: Path, name: str, prof: dict[str, Any]) -> None:
    """Set ``prof``'s ``kernel_floor_s`` and ``framework_dispatch_s`` with their sources."""
    floor, where = kernel_floor(src, name)
    prof["efficiency"]["kernel_floor_s"] = floor
    prof["sources"]["efficiency.kernel_floor_s"] = (
        where + "; a kernel doing almost nothing: its launch-to-finish inside the benchmark's "
        "timed loop is the least any kernel occupies the GPU")
    prof["efficiency"]["framework_dispatch_s"] = FRAMEWORK_DISPATCH_S
    prof["sources"]["efficiency.framework_dispatch_s"] = FRAMEWORK_DISPATCH_SOURCE


def build(src: Path, profiles_dir: Path) -> dict[str, str]:
    """``{file name: new text}`` of every profile this script writes."""
    names = ("mi300x", "mi325x", "mi355x", "h100", "h200")
    profiles = {n: json.loads((profiles_dir / f"{n}.json").read_text()) for n in names}
    kernels = {
        "mi325x": amd_sets(src, profiles, "mi325x"),
        "mi300x": amd_sets(src, profiles, "mi300x"),
        "mi355x": mi355x_sets(src),
        "h100": nvidia_sglang_sets(src, "h100_sxm", "H100 SXM"),
        "h200": nvidia_sglang_sets(src, "h200_sxm", "H200 SXM"),
    }
    for name in names:
        _host_and_floor(src, name, profiles[name])
    profiles["h800"] = h800_profile(profiles["h100"])
    kernels["h800"] = h800_sets(src)
    out = {}
    for name, prof in profiles.items():
        prof = dict(prof)
        prof["kernels"] = kernels[name]
        # the table guard (sim/hardware/table_guard.py): a point above peak stops the build,
        # one below the floor is kept and named here
        from epsim.model.errors import EpsimError
        from epsim.sim.hardware.profile import profile_from_dict
        try:
            for flag in profile_from_dict(prof, name).kernels.flagged:
                print(f"{name}: flagged {flag.line()}", file=sys.stderr)
        except EpsimError as exc:
            print(f"build_kernel_tables: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        out[f"{name}.json"] = dumps(prof) + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sources", required=True, type=Path,
                    help="folder with the copied aiter/, deepgemm/ and aiconfigurator/ tables")
    ap.add_argument("--profiles", type=Path, default=PROFILES,
                    help=f"profiles folder to rewrite (default {PROFILES})")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 when a profile differs from what would be written")
    args = ap.parse_args(argv)
    for sub in ("aiter", "deepgemm", "aiconfigurator"):
        if not (args.sources / sub).is_dir():
            ap.error(f"--sources {args.sources}: no {sub}/ folder")
    texts = build(args.sources, args.profiles)
    stale = []
    for fname, text in texts.items():
        path = args.profiles / fname
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(fname)
            continue
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(text)
        tmp.replace(path)
        print(f"wrote {path} ({len(text.encode()) / 1024:.0f} KB)")
    if stale:
        print("out of date: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
