"""The torch fused-MoE backends' tokens/s on this CPU, against a per-token loop and against the
CPU's own matmul rate at the same shapes.

For one rank of an EP group: N received token rows, each with top-k expert choices over E experts,
of which the rank holds E/ep. Measured (fp32, one thread, best of --repeat):

    torch-sorted   runtime.kernels.moe_sorted: pairs sorted by expert, one matmul per segment
    torch-masked   runtime.kernels.moe_masked: every local expert over every row (static shapes)
    per-token      runtime.kernels.moe_per_token: a Python loop over tokens and their experts
    matmul only    the very matmuls torch-sorted issues (same segment shapes), nothing else:
                   the bound a fused-MoE kernel could reach on this CPU's matmul rate

Prints one table (or --json). Example: python bench/bench_moe_backend.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch  # noqa: E402

from epsim.runtime import kernels  # noqa: E402

SHAPES = {
    # name: (rows, hidden, inter, experts, top_k, ep)
    "tiny-deepseek-wide": (512, 256, 128, 32, 8, 4),
    "deepseek-like/8": (256, 896, 256, 256, 8, 8),
}


def best_of(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench(rows: int, hidden: int, inter: int, experts: int, top_k: int, ep: int,
          repeat: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    local_experts = experts // ep
    x = torch.randn(rows, hidden, generator=g)
    gate_up = torch.randn(local_experts, hidden, 2 * inter, generator=g) * hidden ** -0.5
    down = torch.randn(local_experts, inter, hidden, generator=g) * inter ** -0.5
    # uniform routing over all experts; choices outside this rank's range are -1
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(rows)])
    local = torch.where(ids < local_experts, ids, torch.full_like(ids, -1))
    weights = torch.rand(rows, top_k, generator=g)
    pairs = kernels.sort_pairs(local, weights, local_experts)
    n_pairs = int(sum(pairs.counts))
    segments = [(torch.randn(c, hidden, generator=g), torch.randn(c, inter, generator=g), e)
                for e, c in enumerate(pairs.counts) if c]

    def matmuls() -> None:
        for xs, hs, e in segments:
            xs @ gate_up[e]
            hs @ down[e]

    t_sorted = best_of(lambda: kernels.moe_sorted(x, local, weights, gate_up, down), repeat)
    t_masked = best_of(lambda: kernels.moe_masked(x, local, weights, gate_up, down), repeat)
    t_mm = best_of(matmuls, repeat)
    # the loop is slow: time a slice of rows and scale
    sub = max(1, rows // 16)
    t_loop = best_of(lambda: kernels.moe_per_token(
        x[:sub], local[:sub].clamp_min(0), torch.where(local[:sub] >= 0, weights[:sub], 0.0),
        gate_up, down), max(1, repeat // 2)) * rows / sub
    flops = 6.0 * n_pairs * hidden * inter
    return {
        "rows": rows, "local_pairs": n_pairs, "local_experts": local_experts,
        "torch_sorted_tok_s": rows / t_sorted,
        "torch_masked_tok_s": rows / t_masked,
        "per_token_loop_tok_s": rows / t_loop,
        "matmul_only_tok_s": rows / t_mm,
        "matmul_gflop_s": flops / t_mm / 1e9,
        "torch_sorted_gflop_s": flops / t_sorted / 1e9,
        "sorted_vs_matmul": t_mm / t_sorted,
        "sorted_vs_loop": t_loop / t_sorted,
    }


def square_matmul_gflops(n: int = 512, repeat: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n ** 3 / best_of(lambda: a @ b, repeat) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = {"threads": args.threads, "torch": torch.__version__,
           "square_matmul_512_gflop_s": square_matmul_gflops(repeat=args.repeat),
           "shapes": {name: {"shape": dict(zip(("rows", "hidden", "inter", "experts", "top_k",
                                                 "ep"), shape, strict=True)),
                             **bench(*shape, repeat=args.repeat)}
                      for name, shape in SHAPES.items()}}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"fp32, {args.threads} thread(s), torch {out['torch']}; 512x512 matmul: "
          f"{out['square_matmul_512_gflop_s']:.1f} GFLOP/s")
    for name, r in out["shapes"].items():
        s = r["shape"]
        print(f"\n{name}: {s['rows']} rows, hidden {s['hidden']}, inter {s['inter']}, "
              f"{r['local_experts']} of {s['experts']} experts local (ep {s['ep']}), top-{s['top_k']}, "
              f"{r['local_pairs']} local pairs")
        print(f"  torch-sorted   {r['torch_sorted_tok_s']:>12,.0f} tok/s  "
              f"({r['torch_sorted_gflop_s']:.1f} GFLOP/s, {r['sorted_vs_matmul']:.0%} of matmul only, "
              f"{r['sorted_vs_loop']:.1f}x the loop)")
        print(f"  torch-masked   {r['torch_masked_tok_s']:>12,.0f} tok/s")
        print(f"  per-token loop {r['per_token_loop_tok_s']:>12,.0f} tok/s")
        print(f"  matmul only    {r['matmul_only_tok_s']:>12,.0f} tok/s  "
              f"({r['matmul_gflop_s']:.1f} GFLOP/s at the segment shapes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
