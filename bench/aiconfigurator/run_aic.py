#!/usr/bin/env python3
# ruff: noqa: E402  (aiconfigurator is imported after silencing its warnings)
"""Reproduce the aiconfigurator (AIC) DeepSeek-V3 decode estimates used by bench/aiconfigurator/RESULTS.md.

Setup (CPU only, offline registry):
    python3 -m venv /tmp/venv-aic && . /tmp/venv-aic/bin/activate && pip install aiconfigurator==0.12.0
    python bench/aiconfigurator/run_aic.py   # writes bench/aiconfigurator/raw/ (not committed)

What it runs, per system (h200_sxm, h100_sxm), SGLang perf DB (default 'current' slot = 0.5.14),
DeepSeek-V3, tp1 / attention-dp8 / moe-tp1 / moe-ep8, fp8_block GEMM + MoE, ISL 2000, OSL 100,
batch per attention-DP rank (= per GPU) 64/128/256/512:

  A. "fused" path = exactly what `aiconfigurator cli estimate ...` builds for intra-node EP8
     (MoEDispatch pre/post collectives, shared expert overlapped with the routed path).
     The real CLI is also invoked (subprocess) and its stdout saved: raw/cli/*.txt
  B. "deepep" path = what the Task/sweep path (`cli exp` / `cli default`) resolves for the same
     tuple: moe_comm_backend={context: deepep_ht, generation: deepep_ll} via the tool's own
     resolve_model_config_moe_comm(..., coverage_snapshot=<DB coverage>) (the same call Task makes).
     The real `cli exp` is also run for that tuple: raw/cli/exp_*.txt + its CSVs.

For every point it records:
  * static_gen (pure decode, no prefill mixing): TPOT averaged over the OSL (stride 32), tok/s, memory.
  * one decode step at the tool's mid-point context s = isl + osl//2 + 1 (what
    Engine.decode_step_latency uses), per top-level op as the engine sums it, plus each
    composite op's children evaluated individually (the OverlapOp takes max(group_a, group_b)).
  * agg (IFB, ctx_tokens = ISL): TTFT / TPOT / tok/s with prefill mixed into decode steps.
Nothing is adjusted: numbers are what the tool returns.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import traceback
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("PYTHONWARNINGS", "ignore")

from aiconfigurator.sdk import common  # noqa: E402
from aiconfigurator.sdk.backends.factory import get_backend  # noqa: E402
from aiconfigurator.sdk.config import RuntimeConfig  # noqa: E402
from aiconfigurator.sdk.config_builders import build_model_config  # noqa: E402
from aiconfigurator.sdk.inference_session import InferenceSession  # noqa: E402
from aiconfigurator.sdk.models import (
    get_model,  # noqa: E402
    resolve_context_fmha_by_data,  # noqa: E402
)
from aiconfigurator.sdk.moe_comm_resolver import (  # noqa: E402
    a2a_covers_parallel,  # noqa: E402
    moe_compute_coverage,
    resolve_model_config_moe_comm,
)
from aiconfigurator.sdk.perf_database import get_database_view, get_latest_database_version  # noqa: E402
from aiconfigurator_core.sdk import rust_engine_step as R  # noqa: E402
from aiconfigurator_core.sdk.engine import build_ops_json  # noqa: E402
from aiconfigurator_core.sdk.operations.moe_comm import MOE_A2A_BACKENDS, nodes_for  # noqa: E402

MODEL = "deepseek-ai/DeepSeek-V3"
BACKEND = "sglang"
ISL, OSL = 2000, 100
TP, PP, DP, ETP, EP = 1, 1, 8, 1, 8
OUT = os.path.dirname(os.path.abspath(__file__))
RAW = os.path.join(OUT, "raw")


def version_info() -> dict:
    from importlib.metadata import version

    return {
        "aiconfigurator": version("aiconfigurator"),
        "aiconfigurator-core": version("aiconfigurator-core"),
        "python": sys.version.split()[0],
    }


def load_db(system: str, version: str):
    return get_database_view(system, BACKEND, version, allow_missing_data=False, database_mode="SILICON", transfer_policy=None)


def deepep_coverage(db) -> dict:
    """Same computation as Task._large_ep_coverage (task_v2.py), for DeepSeek-V3's MoE shape."""
    gpn = int(db.system_spec["node"]["num_gpus_per_node"])
    sm = int(db.system_spec["gpu"]["sm_version"])
    qm = common.MoEQuantMode.fp8_block
    cov: dict = {}
    for phase in ("context", "generation"):
        a2a = db.moe_a2a_coverage(7168, 8, 256, qm, phase)
        comp = moe_compute_coverage(db, backend_name=BACKEND, hidden_size=7168, inter_size=2048, topk=8,
                                    num_experts=256, quant_mode=qm, phase=phase)
        per = {}
        for name, spec in MOE_A2A_BACKENDS.items():
            if BACKEND not in spec.frameworks or phase not in spec.inference_phases:
                continue
            eps = {ep for ep in comp if a2a_covers_parallel(a2a.get(name, set()), framework=BACKEND, comm_backend=name,
                                                            moe_ep_size=ep, expected_nodes=nodes_for(ep, gpn),
                                                            gpus_per_node=gpn)
                   and spec.feasible(topk=8, num_experts=256, moe_tp_size=1, moe_ep_size=ep, sm_version=sm)}
            if eps:
                per[name] = eps
        if per:
            cov[phase] = per
    return cov


def build(system: str, version: str, variant: str, kv: str, for_context: bool):
    db = load_db(system, version)
    fmha = "fp8_block" if variant == "deepep" else None  # deepep WideEP MLA tables only carry fp8_block rows
    mc = build_model_config(TP, PP, DP, ETP, EP, "fp8_block", kv, fmha, "fp8_block", None)
    if variant == "deepep":
        resolved = resolve_model_config_moe_comm(mc, model_path=MODEL, backend_name=BACKEND, database=db,
                                                 required_phases=("context", "generation"),
                                                 fmha_quant_mode_explicit=True, kvcache_quant_mode_explicit=True,
                                                 coverage_snapshot=deepep_coverage(db))
        if not resolved:
            raise RuntimeError("DeepEP coverage did not resolve")
    else:
        # exactly the CLI estimate path: resolver returns None for intra-node EP (fused path)
        resolve_model_config_moe_comm(mc, model_path=MODEL, backend_name=BACKEND, database=db,
                                      required_phases=("context", "generation"),
                                      fmha_quant_mode_explicit=False, kvcache_quant_mode_explicit=True)
        resolve_context_fmha_by_data(mc, MODEL, db, BACKEND, is_context_role=for_context)
    model = get_model(MODEL, mc, BACKEND)
    return db, mc, model


def _leaf_specs(spec: dict, depth=0):
    """Yield (depth, role, opname, spec) for a composite op tree (Fallback / Overlap)."""
    (kind, body), = spec.items()
    yield depth, kind, body.get("name"), spec
    if kind == "Fallback":
        yield from ((d, "primary:" + k, n, s) for d, k, n, s in _leaf_specs(body["primary"], depth + 1))
        for child in body["fallback"]:
            yield from ((d, "fallback:" + k, n, s) for d, k, n, s in _leaf_specs(child, depth + 1))
    elif kind == "Overlap":
        for g in ("group_a", "group_b"):
            for child in body[g]:
                yield from ((d, g + ":" + k, n, s) for d, k, n, s in _leaf_specs(child, depth + 1))


def decode_step_breakdown(model, db, bs: int) -> dict:
    handle = R._cached_engine_handle(model, db)
    top = handle._decode_step_per_op_with_metadata(bs, ISL, OSL)
    s = ISL + OSL // 2 + 1
    specs = json.loads(build_ops_json(model.generation_ops))
    full = handle.evaluate_ops_json(json.dumps(specs), is_context=False, batch_size=bs, s=s)
    rows = []
    for spec in specs:
        for depth, role, name, sub in _leaf_specs(spec):
            try:
                r = handle.evaluate_ops_json(json.dumps([sub]), is_context=False, batch_size=bs, s=s)
                lat, src = sum(x[1] for x in r), "/".join(sorted({x[3] for x in r}))
            except Exception as e:  # noqa: BLE001  (e.g. fallback op without data)
                lat, src = None, f"error: {str(e)[:160]}"
            (kind, body), = sub.items()
            rows.append({"depth": depth, "role": role, "name": name, "kind": kind,
                         "scale_factor(layers)": body.get("scale_factor"), "latency_ms_per_step": lat,
                         "source": src, "spec": body})
    return {
        "bs_per_gpu": bs, "kv_len_s": s,
        "top_level": [{"name": x[0], "latency_ms": x[1], "source": x[3], "moe_comm_fallback": str(x[4])} for x in top],
        "top_level_sum_ms": sum(x[1] for x in top),
        "evaluate_full_list_sum_ms": sum(x[1] for x in full),
        "tree": rows,
    }


def run_static(model, db, bs: int) -> dict:
    sess = InferenceSession(model, db, get_backend(BACKEND))
    summ = sess.run_static(runtime_config=RuntimeConfig(batch_size=bs, isl=ISL, osl=OSL, prefix=0), mode="static_gen", stride=32)
    d = dict(summ.get_result_dict() or {})
    d["_oom"] = bool(summ.check_oom())
    d["_memory"] = summ.get_memory()
    d["_generation_latency_dict_total_over_osl_ms"] = summ.get_generation_latency_dict()
    return d


def run_agg(model, db, bs: int) -> dict:
    sess = InferenceSession(model, db, get_backend(BACKEND))
    summ = sess.run_agg(RuntimeConfig(batch_size=bs, isl=ISL, osl=OSL, prefix=0), ctx_tokens=ISL)
    d = dict(summ.get_result_dict() or {})
    d["_oom"] = bool(summ.check_oom())
    d["_kv_cache_oom"] = bool(summ.check_kv_cache_oom())
    d["_memory"] = summ.get_memory()
    return d


def _clean(o):
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, (int, float, str, bool)) or o is None:
        return o
    try:
        return float(o)
    except Exception:  # noqa: BLE001
        return str(o)


def run_cli(system: str, mode: str, bs: int, kv: str, path: str):
    cmd = ["aiconfigurator", "cli", "estimate", "--model-path", MODEL, "--system", system, "--backend", BACKEND,
           "--estimate-mode", mode, "--isl", str(ISL), "--osl", str(OSL), "--batch-size", str(bs),
           "--tp", str(TP), "--dp", str(DP), "--etp", str(ETP), "--ep", str(EP),
           "--gemm-quant-mode", "fp8_block", "--moe-quant-mode", "fp8_block", "--kvcache-quant-mode", kv,
           "--detail", "all", "--no-color"]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    with open(path, "w") as f:
        f.write("$ " + " ".join(cmd) + f"\n# rc={p.returncode}\n")
        f.write(p.stdout)
        f.write("\n# ---- stderr ----\n")
        f.write(p.stderr)
    return p.returncode


EXP_YAML = """exps:
- {name}
{name}:
  serving_mode: agg
  isl: {isl}
  osl: {osl}
  prefix: 0
  ttft: 1000000.0
  tpot: 100000.0
  total_gpus: 8
  database_mode: SILICON
  model_path: {model}
  system_name: {system}
  backend_name: sglang
  backend_version: {version}
  enable_eplb: false
  nextn: 0
  gemm_quant_mode: fp8_block
  moe_quant_mode: fp8_block
  kvcache_quant_mode: {kv}
  fmha_quant_mode: fp8_block
  comm_quant_mode: half
  agg_num_gpu_candidates: [8]
  agg_tp_candidates: [1]
  agg_pp_candidates: [1]
  agg_dp_candidates: [8]
  agg_moe_tp_candidates: [1]
  agg_moe_ep_candidates: [8]
"""


def run_cli_exp(system: str, version: str, kv: str):
    name = f"{system}_agg_dp8ep8_kv{kv}"
    d = os.path.join(RAW, "cli", "exp_" + name)
    os.makedirs(d, exist_ok=True)
    y = os.path.join(d, "exp.yaml")
    with open(y, "w") as f:
        f.write(EXP_YAML.format(name=name, isl=ISL, osl=OSL, model=MODEL, system=system, version=version, kv=kv))
    cmd = ["aiconfigurator", "cli", "exp", "--yaml-path", y, "--save-dir", os.path.join(d, "out"), "--no-color", "--top-n", "5"]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    with open(os.path.join(d, "stdout.txt"), "w") as f:
        f.write("$ " + " ".join(cmd) + f"\n# rc={p.returncode}\n" + p.stdout + "\n# ---- stderr ----\n" + p.stderr)
    return p.returncode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--systems", default="h200_sxm,h100_sxm")
    ap.add_argument("--bs", default="64,128,256,512")
    ap.add_argument("--kv", default="fp8,bfloat16")
    ap.add_argument("--variants", default="fused,deepep")
    ap.add_argument("--no-cli", action="store_true", help="skip the subprocess CLI captures")
    a = ap.parse_args()
    os.makedirs(os.path.join(RAW, "cli"), exist_ok=True)
    os.makedirs(os.path.join(RAW, "points"), exist_ok=True)
    meta = {"versions": version_info(), "model": MODEL, "backend": BACKEND, "isl": ISL, "osl": OSL,
            "parallel": dict(tp=TP, pp=PP, attention_dp=DP, moe_tp=ETP, moe_ep=EP), "systems": {}}
    summary_rows = []
    for system in a.systems.split(","):
        version = get_latest_database_version(system=system, backend=BACKEND)
        db = load_db(system, version)
        meta["systems"][system] = {"perf_db_version": version, "system_spec_gpu": db.system_spec.get("gpu"),
                                   "system_spec_node": db.system_spec.get("node"),
                                   "deepep_coverage": {p: {k: sorted(v) for k, v in d.items()} for p, d in deepep_coverage(db).items()}}
        for kv in a.kv.split(","):
            if not a.no_cli:
                run_cli_exp(system, version, kv)
            for variant in a.variants.split(","):
                for bs in [int(x) for x in a.bs.split(",")]:
                    tag = f"{system}_{variant}_kv{kv}_bs{bs}"
                    rec = {"system": system, "perf_db_version": version, "variant": variant, "kv": kv, "bs_per_gpu": bs}
                    try:
                        db_, mc, model = build(system, version, variant, kv, for_context=False)
                        rec["model_config"] = {k: str(getattr(mc, k, None)) for k in
                                               ("gemm_quant_mode", "moe_quant_mode", "kvcache_quant_mode", "fmha_quant_mode",
                                                "comm_quant_mode", "moe_comm_backend", "num_gpus_per_node", "workload_distribution",
                                                "enable_eplb", "attention_backend")}
                        rec["static_gen"] = run_static(model, db_, bs)
                        rec["decode_step"] = decode_step_breakdown(model, db_, bs)
                    except Exception as e:  # noqa: BLE001
                        rec["static_error"] = f"{type(e).__name__}: {e}"
                        rec["static_traceback"] = traceback.format_exc()
                    try:
                        R._engine_handle_cache_clear()
                        db_, mc2, model2 = build(system, version, variant, kv, for_context=True)
                        rec["agg_model_config_fmha"] = str(mc2.fmha_quant_mode)
                        rec["agg"] = run_agg(model2, db_, bs)
                    except Exception as e:  # noqa: BLE001
                        rec["agg_error"] = f"{type(e).__name__}: {e}"
                    R._engine_handle_cache_clear()
                    with open(os.path.join(RAW, "points", tag + ".json"), "w") as f:
                        json.dump(_clean(rec), f, indent=1)
                    if variant == "fused" and not a.no_cli:
                        for mode in ("static_gen", "agg"):
                            run_cli(system, mode, bs, kv, os.path.join(RAW, "cli", f"estimate_{mode}_{system}_kv{kv}_bs{bs}.txt"))
                    sg, ag, ds = rec.get("static_gen", {}), rec.get("agg", {}), rec.get("decode_step", {})
                    row = {"system": system, "db": version, "variant": variant, "kv": kv, "bs_per_gpu": bs,
                           "static_tpot_ms": sg.get("tpot"), "static_tok_s_gpu": sg.get("tokens/s/gpu"),
                           "static_tok_s_total": sg.get("tokens/s"), "static_oom": sg.get("_oom"),
                           "step_mid_ms": ds.get("top_level_sum_ms"),
                           "agg_ttft_ms": ag.get("ttft"), "agg_tpot_ms": ag.get("tpot"), "agg_tok_s_gpu": ag.get("tokens/s/gpu"),
                           "agg_oom": ag.get("_oom"), "agg_kv_oom": ag.get("_kv_cache_oom"),
                           "errors": (rec.get("static_error") or "") + " | " + (rec.get("agg_error") or "")}
                    for t in ds.get("top_level", []):
                        row["op:" + t["name"]] = t["latency_ms"]
                    summary_rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if not k.startswith("op:")}), flush=True)
    keys = []
    for r in summary_rows:
        keys += [k for k in r if k not in keys]
    with open(os.path.join(RAW, "summary.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(summary_rows)
    with open(os.path.join(RAW, "meta.json"), "w") as f:
        json.dump(_clean(meta), f, indent=1)


if __name__ == "__main__":
    main()
