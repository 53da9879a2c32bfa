"""What a benchmark sends: workloads as ``vllm bench serve`` and ``sglang.bench_serving``
define them, request traces, and measured results read back.

    spec.py           ``WorkloadSpec`` (dataset, lengths, rate, concurrency), the
                      ``Requests`` it samples, one class per dataset (``DATASETS``)
    sharegpt.py       ShareGPT-like lengths: synthetic, or from a local ShareGPT JSON
    traces.py         request traces (arrival times and lengths) replayed by ``--dataset trace``
    bench_results.py  measured benchmark results as their clients write them (``BenchResult``)

Uses ``epsim.model`` only.
"""

from .bench_results import BenchResult, read_bench_file
from .spec import DATASETS, Requests, WorkloadSpec, sample_requests

__all__ = ["DATASETS", "BenchResult", "Requests", "WorkloadSpec", "read_bench_file",
           "sample_requests"]
