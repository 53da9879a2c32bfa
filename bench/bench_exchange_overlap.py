"""Does a decode-size EP dispatch progress while its rank computes? (gloo ranks on this machine)

    python bench/bench_exchange_overlap.py [--world 2 4] [--repeats 25]

Per world size, ``W`` local gloo ranks (one torch thread each, as ``epsim run`` starts them) time
the runtime's own dispatch (``epsim.runtime.comm.dispatch_dynamic``, the exchange benchmark's
sizes: hidden 128, 24 experts, top-4, 16 and 64 tokens per rank), each after a barrier and a
short compute burst:

* alone: issued, then waited on at once (issue to end of wait);
* the issue call alone: how long issuing holds the host (the blocking count exchange);
* under compute: issued, then a fixed chunk of compute (RMSNorm, GEMM, SiLU: the contention
  probe's kernels, about 10-25 ms) runs before the wait; the chunk's time against the same chunk
  without an exchange in flight, and how long the wait after it still takes.

A wait near zero after the chunk says the exchange's asynchronous part progressed while the rank
computed (what the simulator's comm stream assumes), so what DBO cannot hide is the issue call.
Medians over ranks and repeats. Needs torch (the ``runtime`` extra). Used in docs/validation.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

ROUNDS = 60  # the compute chunk: ROUNDS probe rounds
KEYS = ("alone", "issue", "chunk_alone", "chunk_under", "wait")


def _probe(x, w, norm_w, rounds: int) -> float:  # noqa: ANN001
    from epsim.runtime import kernels

    t0 = time.perf_counter()
    for _ in range(rounds):
        kernels.silu_and_mul(kernels.rms_norm(x, norm_w, 1e-6) @ w)
    return time.perf_counter() - t0


def _rank(rank: int, world: int, init: str, repeats: int, queue) -> None:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    from epsim.calibrate.comm_bench import A2A_EXPERTS, A2A_HIDDEN, A2A_TOP_K, probe_inputs
    from epsim.runtime import comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(100 + rank)
    px, pw, pnw = probe_inputs(torch)
    out: dict[str, list[float]] = {k: [] for k in KEYS}
    for tokens in (16, 64):
        x = torch.randn(tokens, A2A_HIDDEN, generator=gen)
        slots = torch.stack([torch.randperm(A2A_EXPERTS, generator=gen)[:A2A_TOP_K]
                             for _ in range(tokens)])
        weights = torch.rand(tokens, A2A_TOP_K, generator=gen)

        args = (x, slots, weights, A2A_EXPERTS // world)
        for rep in range(repeats + 3):
            dist.barrier()
            _probe(px, pw, pnw, 20)
            t0 = time.perf_counter()
            comm.dispatch_dynamic(*args).wait()
            alone = time.perf_counter() - t0
            dist.barrier()
            _probe(px, pw, pnw, 20)
            chunk_alone = _probe(px, pw, pnw, ROUNDS)
            dist.barrier()
            _probe(px, pw, pnw, 20)
            t0 = time.perf_counter()
            pending = comm.dispatch_dynamic(*args)
            issued = time.perf_counter()
            chunk_under = _probe(px, pw, pnw, ROUNDS)
            t_wait = time.perf_counter()
            pending.wait()
            done = time.perf_counter()
            if rep >= 3:  # warm-up
                for key, value in zip(KEYS, (alone, issued - t0, chunk_alone, chunk_under,
                                             done - t_wait), strict=True):
                    out[key].append(value)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        queue.put(gathered)
    dist.destroy_process_group()


def measure(world: int, repeats: int) -> dict[str, float]:
    """Median ms of each figure (module docstring) over ``world`` ranks and the repeats."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="epsim-overlap-") as folder:
        procs = [ctx.Process(target=_rank, args=(r, world, f"file://{folder}/store", repeats,
                                                 queue)) for r in range(world)]
        for p in procs:
            p.start()
        gathered = queue.get(timeout=600)
        for p in procs:
            p.join()
    return {k: statistics.median(v for r in gathered for v in r[k]) * 1e3 for k in KEYS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=25)
    args = ap.parse_args()
    print("| world | dispatch alone ms | its issue call ms | compute chunk alone ms | "
          "chunk under the dispatch ms | wait after the chunk ms |")
    print("|---|---|---|---|---|---|")
    for world in args.world:
        m = measure(world, args.repeats)
        print(f"| {world} | {m['alone']:.2f} | {m['issue']:.2f} | {m['chunk_alone']:.2f} | "
              f"{m['chunk_under']:.2f} | {m['wait']:.2f} |")


if __name__ == "__main__":
    main()
