"""The decode step of a tiny DeepSeek-shaped model on one CUDA/ROCm GPU (world size 1), eager and
graph-captured, with both step times.

    python bench/gpu_decode_step.py [--model tiny-deepseek] [--batch 64] [--context 1024]
                                    [--steps 20] [--dtype bf16|fp32] [--json]

Runs three configurations through the runtime's own entry (runtime.launch.run_rank, one rank,
NCCL): eager with dynamic shapes, eager with static shapes, and captured (static shapes replayed
as one CUDA graph per step). Captured step 0 runs eagerly to warm up and record; the step times
exclude the first step. Also checks the eager and captured runs decode the same tokens.

Without a GPU it runs the eager static configuration on the CPU (the same code path up to the
device), prints that step time and exits with status 2 and one line saying capture needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from epsim.runtime.launch import run_rank  # noqa: E402
from epsim.runtime.options import RunOptions  # noqa: E402


def run(options: list[RunOptions]) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        results = run_rank(options, 0, 1, f"file://{folder}/store", timeout_s=300)
    assert results is not None
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-deepseek")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--kv-dtype", choices=("fp8", "bf16"), default="fp8")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    import torch

    base = RunOptions(model=args.model, world_size=1, batch=args.batch, context=args.context,
                      steps=args.steps, dtype=args.dtype, kv_dtype=args.kv_dtype)
    if not torch.cuda.is_available():
        [cpu] = run([base.with_(static=True, steps=min(args.steps, 3), batch=min(args.batch, 8),
                                context=min(args.context, 64))])
        print(f"CPU self-check (static eager, {cpu['batch_per_rank']} seqs, context "
              f"{cpu['context']}): step {cpu['step_ms']['median']:.2f} ms")
        sys.stderr.write("gpu_decode_step: no CUDA/ROCm device: the captured step needs a GPU\n")
        return 2
    configs = {"eager": base.with_(device="cuda"),
               "eager-static": base.with_(device="cuda", static=True),
               "captured": base.with_(device="cuda", static=True, capture=True)}
    results = dict(zip(configs, run(list(configs.values())), strict=True))
    same = results["eager-static"]["next_tokens"] == results["captured"]["next_tokens"]
    out = {"device": torch.cuda.get_device_name(), "model": args.model, "batch": args.batch,
           "context": args.context, "dtype": args.dtype, "kv_dtype": args.kv_dtype,
           "captured_tokens_match_eager": same,
           **{name: {"step_ms": r["step_ms"], "tokens_per_s": r["tokens_per_s"]}
              for name, r in results.items()}}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{out['device']}: {args.model}, {args.batch} seqs, context {args.context}, "
              f"{args.dtype}, kv {args.kv_dtype}")
        for name in configs:
            st = out[name]["step_ms"]
            print(f"  {name:<13} step median {st['median']:8.3f} ms  p10 {st['p10']:8.3f}  "
                  f"p90 {st['p90']:8.3f}  ({out[name]['tokens_per_s']:,.0f} tok/s)")
        print(f"  captured decodes the same tokens as eager-static: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
