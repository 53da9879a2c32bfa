"""A component cross-check: aiconfigurator's wide-EP MLA *module* rows against epsim's per-op
composition of the same block. Not a table of any profile: the rows time a whole attention
module, epsim times the ops of its graph one by one, so the rows can only check their sum.

    python bench/wideep_mla_module.py --sources /work/shared/data/kernel-sources
    python bench/wideep_mla_module.py --sources ... --phase prefill   # the context rows

What a row covers (ai-dynamo/aiconfigurator ``collector/sglang/collect_mla_module.py`` at
cb4d907c, PR #963, the commit that added the SGLang 0.5.10 tables): one call of a DeepSeek-V3
layer's ``self_attn`` module (SGLang ModelRunner, dummy weights, 2 layers, tp_size 1 so
``num_heads`` is the rank's heads: 128 under DP attention), decode timed in a CUDA graph replay
(``benchmark_with_power``), prefill eagerly with CUDA events. The fused q_a + kv_a projection is
replaced by a random tensor (its latent is fed through ``AttentionInputs``), so a row covers
q_a / kv_a layernorms, q_b, rope, the two absorption BMMs, the attention kernel (backend
``kernel_source``: fa3 or flashinfer) and o_proj, and not the input norm nor q_a / kv_a. The
collector runs every wide-EP MLA case with ``kv_cache_dtype="bfloat16"`` and logs it as
``fp8`` / ``fp8_block`` (its own comment: "bfloat16 run, log as fp8_block/fp8"). It leaves
ServerArgs' quantization unset, so the weights are quantised as SGLang reads the checkpoint
config (aiconfigurator's DeepSeek-V3 config names FP8 128x128 blocks; not verified by a run). Decode ``isl`` is the cached length
before the step: the new token makes the context ``isl + 1``. A context row is ``batch_size``
prompts of ``isl`` tokens with nothing cached (SGLang's MHA path: kv_b up-projection instead of
the absorption BMMs), timed eagerly: it includes the host's launch of each kernel (the rows'
floor, batch 1 x 1 token, is 0.59-0.64 ms).

epsim's side: the ops of one decoder layer's attention block that the row covers (``COVERED``),
each timed by ``sim.step.cost.op_time`` under the profile's default kernel set, plus the profile's
``graph_node_s`` per op (the gap a graph replay puts between kernels, which the row includes);
DP attention (tp 1), one microbatch, KV cache BF16 (as measured) and FP8 (epsim's default).
Prefill adds no gap and no launch cost: the eager rows' host time is theirs alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from epsim.model import Batch, load_model
from epsim.model.graph import build_step_graph
from epsim.model.plan import ParallelPlan
from epsim.sim.hardware.profile import HardwareProfile, load_profile
from epsim.sim.step.cost import op_time

#: the graph's ops (``model/graph_builder.py`` names) a module row's time covers
COVERED = ("attn.q_a_norm", "attn.q_b", "attn.kv_a_norm", "attn.rope", "attn.q_absorb",
           "attn.kv_b", "attn.core", "attn.v_absorb", "attn.o_proj")
GPUS = {"h100": "h100_sxm", "h200": "h200_sxm"}
#: per phase: the table, and the (batch, isl) grid reported
PHASES = {
    "decode": ("mla/sglang/0.5.10/wideep_generation_mla_perf.parquet",
               (1, 8, 32, 64, 128, 256, 512), (1, 1024, 4096)),
    "prefill": ("mla/sglang/0.5.10/wideep_context_mla_perf.parquet",
                (1, 4, 16), (1, 256, 1024, 4096, 8192)),
}
LAYER = 5  # a MoE layer of DeepSeek-V3 (every layer's attention block is alike)


def epsim_block_ms(profile: HardwareProfile, phase: str, seqs: int, context: int,
                   kv_dtype: str) -> float:
    """Milliseconds epsim charges the covered ops of one layer of one microbatch."""
    model = load_model("deepseek-v3")
    plan = ParallelPlan(nodes=1, gpus_per_node=8, dp=8, tp=1, ep=8, microbatches=1,
                        kv_dtype=kv_dtype, graph_mode=phase == "decode")
    graph = build_step_graph(model, plan, Batch(phase, seqs, context))
    gap = profile.require_efficiency().graph_node_s if phase == "decode" else 0.0
    ops = [op for op in graph.ops.values()
           if op.id.startswith(f"L{LAYER}.") and op.name in COVERED and op.id.endswith(".mb0")]
    return sum(op_time(op, profile) + gap for op in ops) * 1e3


def report(sources: Path, hardware: str, phase: str) -> list[str]:
    """Markdown rows: batch, isl, the fa3 / flashinfer rows, epsim BF16 / FP8 KV."""
    import pandas as pd  # only this script needs pandas + pyarrow

    rel, batches, lengths = PHASES[phase]
    df = pd.read_parquet(sources / "aiconfigurator" / GPUS[hardware] / rel)
    df = df[df.num_heads == 128]
    profile = load_profile(hardware)
    lines = [f"{hardware} {phase}, 128 heads (ms):", "",
             "| batch | isl | fa3 | flashinfer | epsim BF16 KV | epsim FP8 KV | epsim BF16 / fa3 |",
             "|---|---|---|---|---|---|---|"]
    for seqs in batches:
        for isl in lengths:
            rows = df[(df.batch_size == seqs) & (df.isl == isl)]
            if rows.empty:  # the collector ran out of memory there
                continue
            fa3 = float(rows[rows.kernel_source == "fa3"].latency.mean())
            fi = float(rows[rows.kernel_source == "flashinfer"].latency.mean())
            context = isl + 1 if phase == "decode" else isl
            bf16, fp8 = (epsim_block_ms(profile, phase, seqs, context, kv)
                         for kv in ("bf16", "fp8"))
            lines.append(f"| {seqs} | {isl} | {fa3:.4f} | {fi:.4f} | {bf16:.4f} | {fp8:.4f} | "
                         f"{bf16 / fa3:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sources", required=True, type=Path,
                    help="folder with the copied aiconfigurator/ tables")
    ap.add_argument("--hardware", choices=sorted(GPUS), action="append",
                    help="profile(s) to check (default: both)")
    ap.add_argument("--phase", choices=sorted(PHASES), default="decode",
                    help="decode: the generation rows (default); prefill: the context rows")
    args = ap.parse_args(argv)
    if not (args.sources / "aiconfigurator").is_dir():
        print(f"--sources {args.sources}: no aiconfigurator/ folder", file=sys.stderr)
        return 2
    for hardware in args.hardware or sorted(GPUS):
        print("\n".join(report(args.sources, hardware, args.phase)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
