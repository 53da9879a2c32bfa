"""Engine presets (``--engine vllm|sglang|split``): a scheduling policy and the engine's defaults,
one :class:`EnginePreset` per engine, found by name in :data:`ENGINES` (:func:`engine_preset`).

Every default below is read from the engine's own code, at one release each:

    vLLM 0.33.0    the PyPI wheel ``vllm-0.33.0`` (``vllm/_version.py``: commit g4ba787ec9)
    SGLang 0.5.23  the PyPI wheel ``sglang-0.5.23`` (``sglang/_version.py``)

Several defaults depend on the GPU (both engines size them by device memory) or on the
deployment (SGLang divides its chunk over the DP-attention ranks), so a preset's settings are a
function of the hardware profile's HBM, the plan and the KV capacity (:class:`EngineContext`):
:meth:`EnginePreset.settings`, or :func:`engine_settings` by name. Every figure
is per dp rank, as both engines run one scheduler per DP rank (vLLM's engine core per DP rank;
SGLang's scheduler per attention-DP worker). Explicit flags override a preset
(:class:`EngineOverrides`). Without ``--engine`` a deployment runs its hardware vendor's engine
(:func:`default_engine`: vLLM on AMD, SGLang on NVIDIA); epsim's own policy stays a named option,
``--engine prefill_first`` (:class:`PrefillFirstPreset`).

The engine's host work per step (:data:`HOST_SOURCES`) is fixed + per request + per token, plus
a per-step DP synchronisation when dp > 1, on the busiest rank. vLLM's per-request term is the
one measured figure: its V1 engine loop run with a no-op model costs 0.62 ms per step at 32
requests (tenstorrent/vllm#305), all of it put on the per-request term; its fixed and per-token
terms are 0 and its DP synchronisation 0.1 ms, assumptions. SGLang keeps the flat 4 ms (the GPU
idle per decode step of vllm-project/vllm#6854, vLLM V0), an assumption: no per-request
measurement of it was found. Both current releases overlap the host with the GPU (vLLM's async
scheduling, on by default: ``vllm/config/vllm.py``; SGLang's overlap scheduler,
``disable_overlap_schedule = False``: ``srt/arg_groups/fields/schedule.py``), so it is charged
only where a step is shorter than it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, ClassVar

from epsim.model.errors import EpsimError

from .step_time import StepPolicy

VLLM = "vLLM 0.33.0"
SGLANG = "SGLang 0.5.23"
GIB = 2**30
MIB = 2**20

#: epsim's own chunk per rank (``--engine prefill_first``)
EPSIM_CHUNKED_PREFILL = 8192
#: epsim's own policy, a named option beside the engines (``--engine prefill_first``)
PREFILL_FIRST = "prefill_first"
#: the assumed host time per step (vllm-project/vllm#6854), milliseconds: SGLang's flat term
HOST_MS_PER_STEP = 4.0
HOST_SOURCE = ("assumption: vllm-project/vllm#6854 measured about 4 ms of GPU idle per decode "
               "step (vLLM V0, Llama-3-8B); overlapped by both engines' default schedulers")
#: vLLM V1's host microseconds per request in a step: its engine loop (scheduler, input
#: preparation, output processing) with a no-op model, 0.62 ms per step at 32 requests, DP 1
#: (tenstorrent/vllm#305, 2026-01-28, after its optimisation), divided by the 32 requests
VLLM_HOST_US_PER_REQUEST = 0.62e3 / 32
#: vLLM's per-step all-reduce of the DP ranks' token counts (``vllm/v1/worker/dp_utils.py``),
#: milliseconds: "100s of microseconds" over NCCL, ~10 ms over gloo across two nodes
#: (vllm-project/vllm#24105, which moved it to NCCL); 0.1 ms, the low end, is an assumption
VLLM_HOST_DP_SYNC_MS = 0.1
HOST_SOURCES = {
    "vllm_per_request": "tenstorrent/vllm#305: vLLM V1 with a no-op model (DummyNoOpModel), "
                        "0.62 ms host time per decode step at batch 32, DP 1; all of it put "
                        "on the per-request term (an upper bound on that term), 0.62/32 ms",
    "vllm_fixed": "assumption: 0 (the no-op measurement has one batch size, so its fixed "
                  "part is not separated; all of it is on the per-request term)",
    "per_token": "assumption: 0 (no published per-token host measurement found)",
    "vllm_dp_sync": "assumption: 0.1 ms when dp > 1, the low end of vllm-project/vllm#24105's "
                    "'100s of microseconds' for the NCCL all-reduce of the DP token counts",
    "sglang": HOST_SOURCE + "; no per-request or DP-sync measurement found (0)",
}
#: the settings' fields of the host model, echoed with their sources
HOST_FIELDS = ("host_ms_per_step", "host_us_per_request", "host_us_per_token", "host_dp_sync_ms",
               "host_overlap")

@dataclass(frozen=True)
class EngineSettings:
    """What an engine runs one deployment with, per dp rank, each figure with its source.

    engine: the preset's name (:data:`ENGINES`): ``"vllm"``, ``"sglang"``, ``"split"`` or
        ``"prefill_first"`` (epsim's own).
    scheduler: the policy (``sim/serving/schedulers.py``).
    max_running_per_rank / max_batched_tokens / chunked_prefill_size: the scheduler's caps
        (``ServingConfig``'s fields of the same names).
    cuda_graph_max_bs: the largest decode batch a captured graph replays (``None``: any).
    dbo / dbo_min_decode_tokens / dbo_min_prefill_tokens: two microbatches, and above which
        tokens per rank.
    eager_if_any_prefill: a step with any prefill runs eagerly on every rank.
    prefill_eager: a step with prefill runs eagerly (the engines'; epsim's own runs every step
        as the plan says).
    host_ms_per_step / host_us_per_request / host_us_per_token / host_dp_sync_ms: the host's
        work per step on the busiest rank, fixed + per request + per token + the DP ranks'
        synchronisation (``--host-ms-per-step`` pins a flat value, the others 0).
    host_overlap: whether the host overlaps the GPU (a step lasts ``max(GPU, host)``).
    mixed_chunk: SGLang's ``enable_mixed_chunk``.
    sources: field -> where the figure comes from (file and release, or "flag").
    """

    engine: str | None
    scheduler: str
    chunked_prefill_size: int
    max_running_per_rank: int | None = None
    max_batched_tokens: int | None = None
    cuda_graph_max_bs: int | None = None
    dbo: bool = True
    dbo_min_decode_tokens: int = 0
    dbo_min_prefill_tokens: int = 0
    eager_if_any_prefill: bool = False
    prefill_eager: bool = True
    host_ms_per_step: float = 0.0
    host_us_per_request: float = 0.0
    host_us_per_token: float = 0.0
    host_dp_sync_ms: float = 0.0
    host_overlap: bool = True
    mixed_chunk: bool = False
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def step_policy(self, graph: bool) -> StepPolicy:
        """How each step runs (``graph``: the plan's graph mode, ``--no-graph`` off)."""
        return StepPolicy(graph=graph, dbo=self.dbo, graph_max_bs=self.cuda_graph_max_bs,
                          prefill_eager=self.prefill_eager,
                          eager_if_any_prefill=self.eager_if_any_prefill,
                          dbo_min_decode_tokens=self.dbo_min_decode_tokens,
                          dbo_min_prefill_tokens=self.dbo_min_prefill_tokens,
                          host_s=self.host_ms_per_step / 1e3,
                          host_per_request_s=self.host_us_per_request / 1e6,
                          host_per_token_s=self.host_us_per_token / 1e6,
                          host_dp_sync_s=self.host_dp_sync_ms / 1e3,
                          host_overlap=self.host_overlap)

    def echo(self) -> dict[str, Any]:
        """The settings as a result reports them."""
        return {"engine": self.engine, "scheduler": self.scheduler,
                "max_num_seqs": self.max_running_per_rank,
                "max_num_batched_tokens": self.max_batched_tokens,
                "chunked_prefill_size": self.chunked_prefill_size,
                "cuda_graph_max_bs": self.cuda_graph_max_bs,
                "host_ms_per_step": self.host_ms_per_step,
                "host": {"fixed_ms": self.host_ms_per_step,
                         "per_request_us": self.host_us_per_request,
                         "per_token_us": self.host_us_per_token,
                         "dp_sync_ms": self.host_dp_sync_ms, "overlap": self.host_overlap,
                         "sources": {k: self.sources[k] for k in HOST_FIELDS
                                     if k in self.sources}}}


@dataclass(frozen=True)
class EngineOverrides:
    """Explicit flags, each ``None`` when not given (the preset's value stands)."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    chunked_prefill_size: int | None = None
    cuda_graph_max_bs: int | None = None
    dbo: bool | None = None
    host_ms_per_step: float | None = None
    host_overlap: bool | None = None


@dataclass(frozen=True)
class EngineContext:
    """What the presets' defaults depend on: one GPU's HBM in bytes, the dp ranks and tp of
    the plan, one rank's KV capacity in tokens and the model's context length."""

    hbm_bytes: float
    dp: int
    tp: int
    kv_capacity_tokens: int
    context_len: int | None


#: at most this many engine parameters are fitted per engine (:attr:`EnginePreset.fitted`)
MAX_FITTED = 3


class EnginePreset:
    """One engine: its defaults for a deployment (:meth:`defaults`) and the rules by which
    explicit flags change them (:meth:`settings`). One subclass per engine, one instance each
    in :data:`ENGINES`.

    name: ``--engine``'s value, echoed as ``"engine"``.
    dbo_default: DBO when neither ``--dbo`` nor ``--no-dbo`` is given.
    overridable: the caps and the host time may be overridden (epsim's own policy has neither:
        only its chunk and DBO).
    has_host_model: the engine charges host time per step.
    prefill_eager: a step with prefill runs eagerly (:attr:`EngineSettings.prefill_eager`).
    chunk_follows_batched_tokens: ``--max-num-batched-tokens`` alone sets the prompt chunk too
        (vLLM chunks prompts within its token budget; SGLang's chunk is its own flag).
    checks_vllm_caps: ``max_num_batched_tokens >= max_num_seqs`` is enforced, as vLLM does.
    caption: what a result's summary says in place of the engine's caps (``None``: the caps).
    fitted: engine parameters fitted to measured runs, name -> value, at most
        :data:`MAX_FITTED` per engine (e.g. the request path's ms, the scheduler's ms per step,
        the overhead per prefill). None is fitted yet: every preset's is empty and nothing
        reads it; a fit fills it here, each value with its source beside it.
    """

    name: ClassVar[str]
    dbo_default: ClassVar[bool] = False
    overridable: ClassVar[bool] = True
    has_host_model: ClassVar[bool] = True
    prefill_eager: ClassVar[bool] = True
    chunk_follows_batched_tokens: ClassVar[bool] = False
    checks_vllm_caps: ClassVar[bool] = False
    caption: ClassVar[str | None] = None
    fitted: ClassVar[Mapping[str, float]] = MappingProxyType({})

    def defaults(self, ctx: EngineContext) -> EngineSettings:
        """The engine's own settings for deployment ``ctx``."""
        raise NotImplementedError

    def graph_bs_after_cap(self, s: EngineSettings, seqs: int, tokens: int | None
                           ) -> int | None:
        """The capture limit after ``--max-num-seqs seqs`` (``tokens``: an explicit
        ``--max-num-batched-tokens``): the preset's own unless the engine resizes it."""
        return s.cuda_graph_max_bs

    def settings(self, ctx: EngineContext, overrides: EngineOverrides | None = None
                 ) -> EngineSettings:
        """The settings for deployment ``ctx``, the explicit flags of ``overrides`` in place of
        the preset's values."""
        o = overrides or EngineOverrides()
        s = self.defaults(ctx)
        if not self.overridable:  # no caps to override, no host time
            own = {k: v for k, v in (("chunked_prefill_size", o.chunked_prefill_size),
                                     ("dbo", o.dbo)) if v is not None}
            return replace(s, **own) if own else s
        changes: dict[str, Any] = {}
        if o.max_num_seqs is not None:
            changes["max_running_per_rank"] = o.max_num_seqs
            if o.cuda_graph_max_bs is None:  # both engines size the graphs by the cap
                changes["cuda_graph_max_bs"] = self.graph_bs_after_cap(
                    s, o.max_num_seqs, o.max_num_batched_tokens)
        if o.max_num_batched_tokens is not None:
            changes["max_batched_tokens"] = o.max_num_batched_tokens
            if self.chunk_follows_batched_tokens and o.chunked_prefill_size is None:
                changes["chunked_prefill_size"] = o.max_num_batched_tokens
        for name, value in (("chunked_prefill_size", o.chunked_prefill_size),
                            ("cuda_graph_max_bs", o.cuda_graph_max_bs), ("dbo", o.dbo),
                            ("host_ms_per_step", o.host_ms_per_step),
                            ("host_overlap", o.host_overlap)):
            if value is not None:
                changes[name] = value
        if o.host_ms_per_step is not None:  # a flat value: the batch terms give way
            changes.update(host_us_per_request=0.0, host_us_per_token=0.0, host_dp_sync_ms=0.0)
        flagged = {k: "flag" for k in changes}
        s = replace(s, **changes, sources={**s.sources, **flagged}) if changes else s
        if self.checks_vllm_caps and s.max_batched_tokens < (s.max_running_per_rank or 0):
            # vLLM refuses it too (SchedulerConfig.verify_max_model_len)
            raise EpsimError(f"--max-num-batched-tokens {s.max_batched_tokens} must be at "
                             f"least --max-num-seqs {s.max_running_per_rank} (as vLLM requires)")
        return s


# --------------------------------------------------------------------------------------------
# vLLM V1
# --------------------------------------------------------------------------------------------

def vllm_batch_defaults(hbm_bytes: float) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) of vLLM's OpenAI server for a GPU of
    ``hbm_bytes``: ``EngineArgs.get_batch_defaults`` (vllm/engine/arg_utils.py, vLLM 0.33.0).
    A100 and GB10, kept on the small tier by name, have no profile here."""
    if hbm_bytes >= 160 * GIB:
        return 16384, 1024
    if hbm_bytes >= 70 * GIB:
        return 8192, 1024
    return 2048, 256


def vllm_capture_max(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """vLLM's largest CUDA-graph capture size: ``min(max_num_seqs * 2, 512)`` (1024 on
    data-center Blackwell, which has no profile here), then at most ``max_num_batched_tokens``
    (``VllmConfig._set_cudagraph_sizes``, vllm/config/vllm.py, vLLM 0.33.0)."""
    return min(max_num_seqs * 2, 512, max_num_batched_tokens)


class VllmPreset(EnginePreset):
    """vLLM V1 (``--engine vllm``): decode first, prefill chunks in the same step, vLLM's caps;
    DBO off."""

    name = "vllm"
    scheduler: ClassVar[str] = "decode_first"
    dbo_source: ClassVar[str] = f"{VLLM} vllm/config/parallel.py enable_dbo = False"
    chunk_follows_batched_tokens = True
    checks_vllm_caps = True

    def defaults(self, ctx: EngineContext) -> EngineSettings:
        tokens, seqs = vllm_batch_defaults(ctx.hbm_bytes)
        batch_src = (f"{VLLM} vllm/engine/arg_utils.py EngineArgs.get_batch_defaults "
                     "(OPENAI_API_SERVER, by device memory: >=160 GiB 16384/1024, >=70 GiB "
                     "8192/1024, else 2048/256)")
        return EngineSettings(
            engine=self.name, scheduler=self.scheduler, chunked_prefill_size=tokens,
            max_running_per_rank=seqs, max_batched_tokens=tokens,
            cuda_graph_max_bs=vllm_capture_max(seqs, tokens), dbo=self.dbo_default,
            dbo_min_decode_tokens=32, dbo_min_prefill_tokens=512, eager_if_any_prefill=True,
            host_ms_per_step=0.0, host_us_per_request=VLLM_HOST_US_PER_REQUEST,
            host_dp_sync_ms=VLLM_HOST_DP_SYNC_MS if ctx.dp > 1 else 0.0, host_overlap=True,
            sources={
                "scheduler": f"{VLLM} vllm/v1/core/sched/scheduler.py Scheduler.schedule",
                "max_num_batched_tokens": batch_src, "max_num_seqs": batch_src,
                "chunked_prefill_size": "vLLM chunks prompts within max_num_batched_tokens",
                "cuda_graph_max_bs": f"{VLLM} vllm/config/vllm.py VllmConfig."
                                     "_set_cudagraph_sizes (min(max_num_seqs * 2, 512, "
                                     "max_num_batched_tokens); the mode synchronised over DP "
                                     "ranks by the minimum: vllm/v1/worker/dp_utils.py)",
                "dbo": self.dbo_source,
                "dbo_thresholds": f"{VLLM} vllm/config/parallel.py dbo_decode_token_threshold "
                                  "32, dbo_prefill_token_threshold 512",
                "host_ms_per_step": HOST_SOURCES["vllm_fixed"],
                "host_us_per_request": HOST_SOURCES["vllm_per_request"],
                "host_us_per_token": HOST_SOURCES["per_token"],
                "host_dp_sync_ms": HOST_SOURCES["vllm_dp_sync"],
                "host_overlap": f"{VLLM} vllm/config/vllm.py async_scheduling on by default "
                                "(auto: on unless a pooling model, an incompatible speculative "
                                "method or executor, DP not among them; a vLLM 0.19.1 log with "
                                "--enforce-eager says 'Asynchronous scheduling is enabled.'; "
                                "default since vllm-project/vllm#27614, on in v0.16.0 server "
                                "logs; opt-in --async-scheduling before, "
                                "vllm-project/vllm#19970)",
            })

    def graph_bs_after_cap(self, s: EngineSettings, seqs: int, tokens: int | None
                           ) -> int | None:
        """vLLM recomputes its capture limit from the cap (:func:`vllm_capture_max`)."""
        return vllm_capture_max(seqs, tokens or s.max_batched_tokens or seqs)


class SplitPreset(VllmPreset):
    """The reference report's modified vLLM (``--engine split``): separate prefill and decode
    queues, vLLM's caps, with the report's DBO and graphs (docs/design.md section 1)."""

    name = "split"
    scheduler = "split"
    dbo_default = True
    dbo_source = "the reference report enables dual batch overlap (docs/design.md 1)"


# --------------------------------------------------------------------------------------------
# SGLang
# --------------------------------------------------------------------------------------------

def sglang_memory_defaults(hbm_bytes: float, tp: int) -> tuple[int, int]:
    """(chunked_prefill_size, cuda_graph_max_bs) for a GPU of ``hbm_bytes`` (SGLang 0.5.23,
    srt/arg_groups/memory_hook.py ``handle_gpu_memory_settings``, memory in MiB)."""
    mib = hbm_bytes / MIB
    big_tp = tp >= 4
    if mib < 20 * 1024:
        return 2048, 8
    if mib < 35 * 1024:
        return 4096, 160 if big_tp else 48
    if mib < 60 * 1024:
        return 4096, 160 if big_tp else 32
    if mib < 160 * 1024:  # H100 (< 90 GiB) and H200 share the tier
        return 8192, 512 if big_tp else 256
    return 16384, 512


def sglang_max_running(kv_capacity_tokens: int, context_len: int | None) -> int:
    """SGLang's default max_running_requests per DP worker:
    ``min(clamp(int(tokens / context_len * 512), 2048, 4096), tokens // 2)``
    (srt/mem_cache/kv_cache_configurator.py ``resolve_max_num_reqs``, SGLang 0.5.23)."""
    estimated = int(kv_capacity_tokens / (context_len or kv_capacity_tokens) * 512)
    return min(max(min(estimated, 4096), 2048), kv_capacity_tokens // 2)


class SglangPreset(EnginePreset):
    """SGLang with DP attention (``--engine sglang``): prefill first, its chunk divided over
    the DP ranks."""

    name = "sglang"

    def defaults(self, ctx: EngineContext) -> EngineSettings:
        chunk, graph_bs = sglang_memory_defaults(ctx.hbm_bytes, ctx.tp)
        per_rank = max(1, chunk // ctx.dp) if ctx.dp > 1 else chunk
        mem = f"{SGLANG} srt/arg_groups/memory_hook.py handle_gpu_memory_settings"
        return EngineSettings(
            engine=self.name, scheduler="sglang", chunked_prefill_size=per_rank,
            max_running_per_rank=max(1, sglang_max_running(ctx.kv_capacity_tokens,
                                                           ctx.context_len)),
            max_batched_tokens=16384, cuda_graph_max_bs=graph_bs, dbo=self.dbo_default,
            eager_if_any_prefill=True, host_ms_per_step=HOST_MS_PER_STEP, host_overlap=True,
            sources={
                "scheduler": f"{SGLANG} srt/managers/scheduler.py (a new prefill batch runs "
                             "before decode), srt/managers/schedule_policy.py PrefillAdder",
                "chunked_prefill_size": f"{mem} (by GPU memory: <90 GiB 8192, <160 GiB 8192, "
                                        "else 16384), divided by the DP-attention size: "
                                        "srt/arg_groups/parallel_hook.py",
                "max_num_seqs": f"{SGLANG} srt/mem_cache/kv_cache_configurator.py "
                                "resolve_max_num_reqs (per DP worker)",
                "max_num_batched_tokens": f"{SGLANG} srt/arg_groups/fields/schedule.py "
                                          "max_prefill_tokens = 16384",
                "cuda_graph_max_bs": f"{mem} (decode max_bs: 256 if tp < 4 else 512 below 160 "
                                     "GiB, 512 above)",
                "dbo": f"{SGLANG} srt/arg_groups/fields/exec_.py enable_two_batch_overlap = "
                       "False",
                "mixed_chunk": f"{SGLANG} srt/arg_groups/fields/schedule.py enable_mixed_chunk "
                               "= False",
                "host_ms_per_step": HOST_SOURCES["sglang"],
                "host_overlap": f"{SGLANG} srt/arg_groups/fields/schedule.py "
                                "disable_overlap_schedule = False",
            })

    def graph_bs_after_cap(self, s: EngineSettings, seqs: int, tokens: int | None
                           ) -> int | None:
        """SGLang lowers its default to the cap when the cap is smaller (memory_hook.py)."""
        return min(s.cuda_graph_max_bs, seqs) if s.cuda_graph_max_bs else None


# --------------------------------------------------------------------------------------------
# epsim's own policy, the registry
# --------------------------------------------------------------------------------------------

class PrefillFirstPreset(EnginePreset):
    """epsim's own policy (``--engine prefill_first``): prefill first, 8192-token chunks, no
    caps, every step as the plan says, no host time."""

    name = PREFILL_FIRST
    overridable = False
    has_host_model = False
    prefill_eager = False
    caption = "epsim's own policy, --engine prefill_first"

    def defaults(self, ctx: EngineContext) -> EngineSettings:
        return EngineSettings(engine=self.name, scheduler="prefill_first",
                              chunked_prefill_size=EPSIM_CHUNKED_PREFILL, dbo=self.dbo_default,
                              prefill_eager=self.prefill_eager,
                              sources={"scheduler": "epsim's own policy (docs/serving.md)"})


#: the presets by name (``--engine``'s choices, in this order)
ENGINES: Mapping[str, EnginePreset] = MappingProxyType({
    p.name: p for p in (VllmPreset(), SglangPreset(), SplitPreset(), PrefillFirstPreset())})


#: the engine a deployment runs when ``--engine`` is not given, by the hardware's vendor: the
#: engine its vendor's published deployments use (AMD's DeepSeek deployments and the reference
#: report run vLLM with aiter + MORI; NVIDIA's large-EP deployments and aiconfigurator's
#: measured kernel tables are SGLang's)
DEFAULT_ENGINE_BY_VENDOR: dict[str, str] = {"amd": "vllm", "nvidia": "sglang"}


def default_engine(vendor: str) -> str:
    """The engine a deployment on ``vendor``'s hardware runs without ``--engine`` (vLLM where
    the vendor is unknown, as for a fitted CPU profile)."""
    return DEFAULT_ENGINE_BY_VENDOR.get(vendor, "vllm")


def engine_preset(engine: str | None) -> EnginePreset:
    """The preset named ``engine``; an unknown name is refused in one line naming the four."""
    preset = ENGINES.get(engine) if isinstance(engine, str) else None
    if preset is None:
        raise EpsimError(f"unknown engine {engine!r} (one of {', '.join(ENGINES)})")
    return preset


def charges_host(engine: str | None) -> bool:
    """Whether ``engine`` charges host time per step (``None``: the hardware vendor's engine,
    which does)."""
    return engine is None or engine_preset(engine).has_host_model


def engine_settings(engine: str | None, ctx: EngineContext,
                    overrides: EngineOverrides | None = None) -> EngineSettings:
    """The settings of ``engine`` for deployment ``ctx``, with the explicit flags of
    ``overrides`` in place of the preset's values (:meth:`EnginePreset.settings`)."""
    return engine_preset(engine).settings(ctx, overrides)
