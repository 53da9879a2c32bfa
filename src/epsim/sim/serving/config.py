"""One deployment's scheduling parameters, as the serving loop reads them.

    ServingConfig   dp ranks, KV capacity, chunking, the scheduler and its caps, MTP, the
                    instances and their router (one frozen record, checked by ``validate``)
    COLOCATED       the scheduler policies a co-located deployment can run
    DP_BALANCE      how a request picks its dp rank: the router policies
                    (``sim/serving/router.py``), applied to one instance's ranks

The loop, the schedulers and the simulation read it; none of them owns it.
"""

from __future__ import annotations

from dataclasses import dataclass

from epsim.model.errors import EpsimError
from epsim.model.mtp import DEFAULT_ACCEPTANCE, check_acceptance

from .kv_pools import SGLANG_CLIP_MAX_NEW_TOKENS
from .router import ROUTER_NAMES, make_router

#: the policies a co-located deployment can run (the disaggregated roles are not among them)
COLOCATED = ("prefill_first", "sglang", "decode_first", "split")
#: a request's dp rank within its instance: round robin or the least loaded rank (fewest
#: requests queued or running), by the router registry's policies
DP_BALANCE = ROUTER_NAMES


@dataclass(frozen=True)
class ServingConfig:
    """One deployment's (one instance's) scheduling parameters.

    dp: decode-side dp ranks (co-located: all ranks). Example: 8.
    kv_capacity_tokens: KV-cache tokens one decode rank holds (``memory_budget``). Example:
        1_925_783 (DeepSeek-R1, DP8/EP8, MI300X, FP8 KV).
    chunked_prefill_size: prompt tokens one rank prefills per step at most. Example: 8192.
    dp_balance: ``"round_robin"`` or ``"least_loaded"`` (fewest requests queued or running).
    prefill_dp: disaggregated: prefill ranks (``None``: prefill co-located with decode).
    prefill_kv_capacity_tokens: disaggregated: KV tokens one prefill rank holds.
    kv_transfer_s_per_token: disaggregated: seconds to ship one prompt token's KV over the NIC.
    kv_transfer_latency_s: disaggregated: fixed cost per transfer (handshake).
    scheduler: the co-located policy (``sim/serving/schedulers.py``: ``prefill_first``, ``sglang``,
        ``decode_first``, ``split``); a disaggregated deployment runs ``disagg_prefill`` and
        ``disagg_decode``. Example: ``"decode_first"``.
    max_running_per_rank: requests one rank holds in its running batch at most (vLLM's
        ``max_num_seqs``, SGLang's ``max_running_requests`` per DP rank; ``None``: no cap).
    max_batched_tokens: tokens one rank's step holds at most, decodes included (vLLM's
        ``max_num_batched_tokens``; ``None``: ``chunked_prefill_size``).
    mixed_chunk: ``sglang``: a prefilling rank's running requests decode in the same batch
        (SGLang's ``enable_mixed_chunk``).
    reserve_clip_tokens: ``sglang``: output tokens a request is expected to need at most
        (SGLang's ``CLIP_MAX_NEW_TOKENS``).
    mtp / mtp_acceptance: MTP speculative decoding: draft tokens verified per decode step and
        each one's acceptance probability (``epsim.sim.serving.speculation``); 0: off. The KV pools hold
        ``mtp`` draft slots per decoding request beyond its tokens.
    seed: seeds the acceptance draws.
    instances / prefill_instances: independent instances of this plan (co-located or decode /
        prefill), each with its own ranks, queues and KV cache, behind a router (``router``:
        ``sim/serving/router.py``). Example: 3 / 2 (``--disagg 2:3 --instance-nodes 1``).
    """

    dp: int
    kv_capacity_tokens: int
    chunked_prefill_size: int = 8192
    dp_balance: str = "round_robin"
    prefill_dp: int | None = None
    prefill_kv_capacity_tokens: int | None = None
    kv_transfer_s_per_token: float = 0.0
    kv_transfer_latency_s: float = 0.0
    scheduler: str = "prefill_first"
    mtp: int = 0
    mtp_acceptance: float = DEFAULT_ACCEPTANCE
    seed: int = 0
    max_running_per_rank: int | None = None
    max_batched_tokens: int | None = None
    mixed_chunk: bool = False
    reserve_clip_tokens: int = SGLANG_CLIP_MAX_NEW_TOKENS
    instances: int = 1
    prefill_instances: int = 1
    router: str = "round_robin"

    @property
    def disaggregated(self) -> bool:
        return self.prefill_dp is not None

    def validate(self) -> ServingConfig:
        if self.dp < 1:
            raise EpsimError(f"dp must be a positive integer, got {self.dp}")
        if self.kv_capacity_tokens < 1:
            raise EpsimError(f"KV capacity must be positive, got {self.kv_capacity_tokens} tokens")
        if self.chunked_prefill_size < 1:
            raise EpsimError(f"chunked-prefill-size must be positive, got "
                             f"{self.chunked_prefill_size}")
        if self.dp_balance not in DP_BALANCE:
            raise EpsimError(f"dp balance must be one of {', '.join(DP_BALANCE)}, "
                             f"got {self.dp_balance!r}")
        if self.scheduler not in COLOCATED:
            raise EpsimError(f"scheduler must be one of {', '.join(COLOCATED)}, "
                             f"got {self.scheduler!r}")
        if self.mtp < 0:
            raise EpsimError(f"mtp must be 0 or more draft tokens, got {self.mtp}")
        check_acceptance(self.mtp_acceptance)
        for name in ("max_running_per_rank", "max_batched_tokens", "reserve_clip_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise EpsimError(f"{name.replace('_', '-')} must be positive, got {value}")
        for name in ("instances", "prefill_instances"):
            if getattr(self, name) < 1:
                raise EpsimError(f"{name.replace('_', ' ')} must be at least 1, got "
                                 f"{getattr(self, name)}")
        make_router(self.router, 1)  # an unknown router is one line
        if self.disaggregated:
            if self.prefill_dp < 1 or not self.prefill_kv_capacity_tokens \
                    or self.prefill_kv_capacity_tokens < 1:
                raise EpsimError("disaggregated serving needs prefill ranks with a KV cache")
        return self
