#!/usr/bin/env python3
"""Turn raw/points/*.json (written by run_aic.py) into markdown tables (raw/tables.md). Pure re-arrangement, no adjustment."""
import glob
import json
import os

RAW = os.path.join(os.path.dirname(os.path.abspath(__file__)), "raw")

# leaf-op name -> column
COLS = ["attn GEMMs", "attn core", "norm+emb", "router", "dispatch", "experts", "combine", "shared exp", "logits"]
MAP = {
    "generation_downscale_gemm": "attn GEMMs", "generation_qkv_a_proj_gemm": "attn GEMMs",
    "generation_q_b_proj_gemm": "attn GEMMs", "generation_bmm_pre": "attn GEMMs", "generation_bmm_post": "attn GEMMs",
    "generation_proj_gemm": "attn GEMMs",
    "generation_attention": "attn core",
    "generation_add_norm_1": "norm+emb", "generation_add_norm_2": "norm+emb", "generation_embedding": "norm+emb",
    "generation_router_gemm": "router",
    "generation_moe_pre_dispatch": "dispatch", "generation_moe_dispatch": "dispatch",
    "generation_moe": "experts",
    "generation_moe_post_dispatch": "combine", "generation_moe_combine": "combine",
    "generation_shared_gate_up_gemm": "shared exp", "generation_shared_act_gate": "shared exp",
    "generation_shared_ffn2_gemm": "shared exp", "generation_gate_ffn1_gemm": "shared exp",
    "generation_act_gate": "shared exp", "generation_ffn2_gemm": "shared exp",
    "generation_logits_gemm": "logits",
}


def leaf_breakdown(tree):
    out = {c: 0.0 for c in COLS}
    overlap_hidden = 0.0
    for r in tree:
        if r["role"].startswith("primary:"):
            continue  # failed/unused primary handled below via top-level value
        kind, name, lat = r["kind"], r["name"], r["latency_ms_per_step"]
        if kind in ("Fallback", "Overlap") or lat is None:
            continue
        if name in MAP:
            out[MAP[name]] += lat
    # OverlapOp: engine takes max(group_a, group_b); report what was hidden
    for r in tree:
        if r["kind"] == "Overlap":
            a = sum(x["latency_ms_per_step"] for x in tree if x["role"].startswith("group_a:"))
            b = sum(x["latency_ms_per_step"] for x in tree if x["role"].startswith("group_b:"))
            overlap_hidden = a + b - r["latency_ms_per_step"]
        if r["kind"] == "Fallback":
            prim = [x for x in tree if x["role"].startswith("primary:")]
            if prim and prim[0]["latency_ms_per_step"] is not None:
                raise SystemExit("primary MLA module had data; table mapping would need changing")
    return out, overlap_hidden


def main():
    pts = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(RAW, "points", "*.json")))]
    lines = []
    for system in ("h200_sxm", "h100_sxm"):
        for kv in ("fp8", "bfloat16"):
            for variant in ("fused", "deepep"):
                sel = sorted([p for p in pts if p["system"] == system and p["kv"] == kv and p["variant"] == variant],
                             key=lambda p: p["bs_per_gpu"])
                if not sel:
                    continue
                lines.append(f"\n### {system} / {variant} / KV {kv} (perf DB sglang {sel[0]['perf_db_version']})\n")
                if "static_gen" not in sel[0]:
                    lines.append("not computed: " + sel[0].get("static_error", "?")[:300] + "\n")
                    continue
                hdr = ["bs/GPU", "step ms (s=2051)", "static TPOT ms", "tok/s/GPU", "tok/s total", "OOM"] + COLS + ["overlap hidden"] + \
                      ["agg TTFT ms", "agg TPOT ms", "agg tok/s/GPU"]
                lines.append("| " + " | ".join(hdr) + " |")
                lines.append("|" + "---|" * len(hdr))
                for p in sel:
                    sg, ds, ag = p["static_gen"], p["decode_step"], p.get("agg", {})
                    bd, hid = leaf_breakdown(ds["tree"])
                    tot = sum(bd.values()) - hid
                    assert abs(tot - ds["top_level_sum_ms"]) < 1e-6 * max(1, tot) + 1e-6, (tot, ds["top_level_sum_ms"])
                    row = [p["bs_per_gpu"], f"{ds['top_level_sum_ms']:.2f}", f"{sg['tpot']:.2f}", f"{sg['tokens/s/gpu']:.0f}",
                           f"{sg['tokens/s']:.0f}", "OOM" if sg["_oom"] else "-"] + [f"{bd[c]:.2f}" for c in COLS] + \
                          [f"-{hid:.2f}" if hid else "0"] + \
                          ([f"{ag['ttft']:.0f}", f"{ag['tpot']:.1f}", f"{ag['tokens/s/gpu']:.0f}" + (" (OOM)" if ag.get("_oom") else "") + (" (KV>cap)" if ag.get("_kv_cache_oom") else "")] if ag else ["-", "-", "-"])
                    lines.append("| " + " | ".join(str(x) for x in row) + " |")
    with open(os.path.join(RAW, "tables.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
