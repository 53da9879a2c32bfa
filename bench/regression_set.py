"""The regression set: outputs that a change claiming "no behaviour change" must leave byte-identical.

    python bench/regression_set.py --out DIR              # run every case, write DIR/<case>.out
    python bench/regression_set.py --out DIR --against BASE   # ... and compare with BASE's files

Eleven ``epsim step --json`` cases (models, hardware, plans, phases, kernel sets, MTP, eager,
multi-node EP), five ``epsim predict --json`` cases (closed and open loop, engines, datasets,
MTP, disaggregation) and the README tour's deterministic commands (``describe``, ``step`` with and
without ``--explain``, ``balance``, ``predict``, ``sweep``, ``tune``, ``plan``, ``run``). Keys
and lines that measure this machine rather than the simulation (``sim_wall_s`` and other wall
times, the real runtime's step times) are removed before writing, and so is ``provenance`` (what
made the output: a version bump alone is no change of behaviour; docs/provenance.md). Each case
runs in its own process, as a user runs it.
With ``--against`` it prints one line per case that differs and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

R1_EP8 = "--model deepseek-r1 --hardware mi300x --dp 8 --ep 8"
STEP_CASES = {
    "step_r1_ep8_decode": f"step {R1_EP8} --batch 512 --context 2100",
    "step_r1_ep8_explain": f"step {R1_EP8} --batch 512 --context 2100 --explain",
    "step_r1_ep8_roofline": f"step {R1_EP8} --batch 512 --context 2100 --kernels none",
    "step_r1_ep8_prefill": f"step {R1_EP8} --batch 2 --context 4096 --phase prefill",
    "step_r1_ep8_eager_nodbo": f"step {R1_EP8} --batch 64 --context 1500 --no-dbo --no-graph",
    "step_r1_tp8_small": "step --model deepseek-r1 --hardware mi300x --tp 8 --batch 4 "
                         "--context 1100",
    "step_r1_mtp_exact": f"step {R1_EP8} --batch 128 --context 2000 --mtp 1 --mode exact",
    "step_v3_h100_ep72": "step --model deepseek-v3 --hardware h100 --nodes 9 --dp 72 --ep 72 "
                         "--redundant-experts 32 --batch 256 --context 2000",
    "step_gptoss_h100_tp8": "step --model gpt-oss-120b --hardware h100 --tp 8 --batch 64 "
                            "--context 3000",
    "step_qwen3_h200_ep8": "step --model qwen3-235b-a22b --hardware h200 --dp 8 --ep 8 "
                           "--batch 256 --context 1000 --no-eplb",
    "step_mixtral_mi355x_tp2dp4": "step --model mixtral-8x7b --hardware mi355x --tp 2 --dp 4 "
                                  "--ep 8 --batch 32 --context 500 --uniform",
}
PREDICT_CASES = {
    "predict_readme": f"predict {R1_EP8} --concurrency 4096 --num-prompts 4096 --isl 2000 "
                      "--osl 100",
    "predict_sharegpt_open": f"predict {R1_EP8} --dataset sharegpt-like --num-prompts 2048 "
                             "--request-rate 40",
    "predict_vllm_mtp": f"predict {R1_EP8} --concurrency 512 --isl 1000 --osl 200 --engine vllm "
                        "--mtp 1",
    "predict_trace_replay": f"predict {R1_EP8} --dataset trace --dataset-path azure-conv "
                            "--num-prompts 500 --time-scale 0.5",
    "predict_disagg_h200": "predict --model deepseek-v3 --hardware h200 --nodes 3 --dp 16 "
                           "--ep 16 --disagg 1:2 --concurrency 256 --isl 2000 --osl 200 "
                           "--engine sglang",
}
# the README tour as written there (text output; lines naming a wall time are dropped, files
# the command writes are appended: their bytes for JSON, their size being non-zero otherwise)
TOUR_CASES = {
    "tour_describe": f"describe {R1_EP8}",
    "tour_describe_json": "describe --model gpt-oss-120b --tp 8 --hardware h100 --json",
    "tour_step": f"step {R1_EP8} --batch 512 --context 2100",
    "tour_step_explain": f"step {R1_EP8} --batch 512 --context 2100 --explain",
    "tour_step_roofline": f"step {R1_EP8} --batch 512 --context 2100 --kernels none",
    "tour_step_ep72": "step --model deepseek-v3 --hardware h100 --nodes 9 --dp 72 --ep 72 "
                      "--redundant-experts 32 --batch 256 --context 2000",
    "tour_balance": "balance --loads decode_in2000out100 --gpus 8 --redundant-experts 32 "
                    "--out p.json",
    "tour_predict": "predict --model deepseek-r1 --hardware mi300x --concurrency 4096 --isl 2000 "
                    "--osl 100",
    "tour_predict_vllm_mtp": f"predict {R1_EP8} --concurrency 1024 --isl 1000 --osl 1000 "
                             "--engine vllm --mtp 1",
    "tour_sweep": "sweep --model deepseek-r1 --hardware mi300x --concurrency 1024,2048,3072,4096 "
                  "--isl 2000 --osl 100 --plot sweep.png",
    "tour_tune": "tune --model deepseek-r1 --hardware mi300x --isl 2000 --osl 100 "
                 "--slo median_itl_ms<=100",
    "tour_plan": "plan --model deepseek-r1 --hardware mi300x,h200 --isl 2000 --osl 100 "
                 "--slo median_itl_ms<=100 --target-output-throughput 1000000 "
                 "--gpu-hour-usd 2",
    "tour_run": "run --model tiny-deepseek --world-size 4 --batch 8 --context 64 --steps 4 "
                "--dbo --check",
}
MEASURED = re.compile(r"ms/step|step ms|tokens/s")
# keys whose values measure this machine (wall clocks, search diagnostics), not the simulation
VOLATILE = {"sim_wall_s", "wall_s", "elapsed_s", "search_wall_s", "points_per_s", "workers",
            "wall_ms", "host_wall_s", "diagnostics"}
# what made the output, not what it computed: the epsim version, the profile's hash, the tables'
# commits (docs/provenance.md); a changed figure still shows, a version bump alone does not
NOT_COMPARED = {"provenance"}


def strip_volatile(value):
    if isinstance(value, dict):
        return {k: strip_volatile(v) for k, v in value.items()
                if k not in VOLATILE and k not in NOT_COMPARED}
    if isinstance(value, list):
        return [strip_volatile(v) for v in value]
    return value


def run_case(args: str) -> str:
    cmd = [sys.executable, "-m", "epsim", *args.split()]
    with tempfile.TemporaryDirectory() as scratch:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=scratch,
                           env=dict(os.environ))
        text = r.stdout
        if "--json" in args and r.returncode == 0:
            text = json.dumps(strip_volatile(json.loads(text)), indent=1, sort_keys=True) + "\n"
        elif r.returncode == 0:  # a runtime's timings are this machine's, not the simulation's
            text = "".join(line for line in text.splitlines(keepends=True)
                           if "wall" not in line.lower() and not MEASURED.search(line))
        for written in sorted(Path(scratch).iterdir()):
            body = (json.dumps(strip_volatile(json.loads(written.read_text())), indent=1,
                               sort_keys=True) + "\n" if written.suffix == ".json"
                    else f"non-empty: {written.stat().st_size > 0}\n")
            text += f"--- wrote {written.name}\n{body}"
    return f"$ epsim {args}\nrc={r.returncode}\n{text}" + (
        f"--- stderr\n{r.stderr}" if r.returncode else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for <case>.out files")
    ap.add_argument("--against", type=Path, help="a folder written by an earlier --out")
    ap.add_argument("--only", help="comma list of case names (default: all)")
    args = ap.parse_args()
    cases = {k: v + " --json" for k, v in STEP_CASES.items()}
    cases.update({k: v + " --json" for k, v in PREDICT_CASES.items()})
    cases.update(TOUR_CASES)
    if args.only:
        cases = {k: cases[k] for k in args.only.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    differ = 0
    for name, case in cases.items():
        text = run_case(case)
        (args.out / f"{name}.out").write_text(text)
        status = "ok"
        if args.against is not None:
            base = args.against / f"{name}.out"
            if not base.exists():
                status = "NEW (no baseline)"
            elif base.read_text() != text:
                status = "DIFFERS"
                differ += 1
        rc_line = text.splitlines()[1]
        print(f"{name:32s} {rc_line:6s} {status}", flush=True)
    if args.against is not None:
        print(f"{differ} of {len(cases)} cases differ from {args.against}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
