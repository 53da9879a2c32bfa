"""The serving simulation: a benchmark client against continuous-batching dp ranks.

    simulate.py      ``simulate_serving``: one run, request by request -> ``ServingRun``
    config.py        ``ServingConfig``: one deployment's scheduling parameters
    loop.py          the loop's machinery: the sides' steps, the instances behind routers
    state.py         what the schedulers look at: requests, queues, the running set, the client
    schedulers.py    one class per engine policy: what runs in the next step
    kv_pools.py      KV-cache pools, each with an engine's admission rule
    loop_kernels.py  the loop's per-step passes over running requests (numba)
    router.py        which instance (or dp rank) takes a request
    speculation.py   tokens a decode step emits under MTP speculative decoding
    step_time.py     what a step costs (the one file that imports ``epsim.sim.step``)
    presets.py       engine presets (vLLM, SGLang): a policy and the engine's defaults
    tally.py         what a run keeps as it goes (memory that does not grow with tokens)
    metrics.py       ``vllm bench serve``'s metrics, plus epsim's own
    window.py        steady-state measurement: the metrics without warm-up and cool-down
    instances.py     per-instance figures and their aggregate
    bench_write.py   a simulated run written as ``vllm bench serve --save-result`` writes one
    trace.py         the run as a Chrome trace

Uses ``epsim.sim.workload``, ``epsim.sim.hardware`` and (through ``step_time.py``)
``epsim.sim.step``.
"""

from .config import ServingConfig
from .metrics import compute_metrics
from .simulate import ServingRun, simulate_serving
from .step_time import EngineStepTime, StepCost, StepPolicy, StepTimeModel

__all__ = ["EngineStepTime", "ServingConfig", "ServingRun", "StepCost", "StepPolicy",
           "StepTimeModel", "compute_metrics", "simulate_serving"]
