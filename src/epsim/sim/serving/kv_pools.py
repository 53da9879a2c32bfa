"""KV-cache pools of one side's dp ranks, each with the admission rule of an engine.

    WholeSequence  a request reserves its whole sequence (prompt + every output token; output
                   lengths are exact) when it is admitted: requests wait while the cache is
                   full and are never preempted (epsim's ``prefill_first``; the prefill side of a
                   disaggregated deployment reserves the prompt only)
    Paged          vLLM V1: KV is allocated as tokens are computed, chunk by chunk and one slot
                   per decode step; when a step's slots do not fit, the scheduler preempts the
                   newest requests (their KV freed, recomputed later); no watermark
                   (``vllm/v1/core/sched/scheduler.py``, vLLM 0.33.0: ``allocate_slots``, then
                   ``self.running[-1]`` preempted until it fits)
    Reservation    SGLang: KV is allocated as tokens are computed, and a request is admitted
                   only if its remaining prompt and ``min(remaining output, clip)`` fit beside
                   what the admitted requests still expect (SGLang 0.5.23,
                   ``srt/managers/schedule_policy.py``: ``PrefillAdder.add_one_req``, running
                   requests' offset ``min(max_new_tokens - output, CLIP_MAX_NEW_TOKENS)`` times
                   ``new_token_ratio``, 1.0 under ``ignore_eos`` as benchmarks run;
                   ``CLIP_MAX_NEW_TOKENS`` = 4096). A decode step that does not fit retracts
                   requests (``ScheduleBatch.retract_decode``); outputs longer than the clip are
                   what meets that pressure

Capacities are per rank, in tokens (``epsim.model.accounting.memory_budget``). Allocation is by
token: vLLM and SGLang allocate in blocks or pages of a few tokens, a rounding of at most one
block per request that this model leaves out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np

from .loop_kernels import release
from .state import RequestState

#: SGLang's CLIP_MAX_NEW_TOKENS (``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION``, default 4096), in
#: sglang 0.5.23 ``srt/managers/schedule_policy.py``
SGLANG_CLIP_MAX_NEW_TOKENS = 4096


class KVPool:
    """Per rank, KV tokens held (allocated or reserved); per request, what it holds.

    rank: the side's rank of each request (``RequestState.rank``, or the prefill side's own).
    """

    name: ClassVar[str] = ""

    #: MTP draft slots a verify step writes past each request's last token (``mtp``)
    lookahead: int = 0

    def __init__(self, ranks: int, capacity: int, st: RequestState, rank: np.ndarray) -> None:
        self.capacity = capacity
        self.used = np.zeros(ranks, dtype=np.int64)
        self.held = np.zeros(len(st.isl), dtype=np.int64)
        self.st = st
        self.rank = rank

    def fits(self, r: int, tokens: int) -> bool:
        return self.used[r] + tokens <= self.capacity

    def free(self, r: int) -> int:
        return int(self.capacity - self.used[r])

    def usage(self) -> float:
        """Held share of the side's KV, in [0, 1]."""
        return float(sum(self.used.tolist())) / (self.capacity * len(self.used))

    def take(self, r: int, i: int, tokens: int) -> None:
        self.used[r] += tokens
        self.held[i] += tokens

    def release(self, ids: np.ndarray) -> None:
        """Free everything ``ids`` hold."""
        if len(ids):
            release(ids, self.rank, self.held, self.used)  # one compiled pass, exact in int64

    # what each engine's admission decides -------------------------------------------------

    def admit(self, r: int, i: int, tokens: int, admitted: Callable[[], np.ndarray]) -> bool:
        """Request ``i`` at the head of rank ``r``'s queue starts with a chunk of ``tokens``:
        take what it needs and say whether it could (``admitted()``: the rank's admitted
        requests, for a rule that looks at them)."""
        raise NotImplementedError

    def extend(self, r: int, i: int, tokens: int) -> bool:
        """An admitted request computes ``tokens`` more prompt tokens."""
        raise NotImplementedError

    def grow(self, r: int, ids: np.ndarray) -> bool:
        """Each of ``ids`` (decoding on rank ``r``) needs a slot for its next token (and its
        ``lookahead`` drafts)."""
        raise NotImplementedError

    def settle(self, ids: np.ndarray, counts: np.ndarray) -> None:
        """A verify step ended: ``ids`` kept ``counts`` of the ``1 + lookahead`` slots it wrote
        (the rejected drafts' slots are freed). Nothing to do for a whole-sequence reservation."""


class WholeSequence(KVPool):
    """The whole sequence reserved at admission (``need(i)`` tokens), nothing after."""

    name = "whole_sequence"

    def __init__(self, ranks: int, capacity: int, st: RequestState, rank: np.ndarray,
                 need: Callable[[int], int] | None = None) -> None:
        super().__init__(ranks, capacity, st, rank)
        self.need = need or (lambda i: st.isl.item(i) + st.osl.item(i) + self.lookahead)

    def admit(self, r: int, i: int, tokens: int, admitted: Callable[[], np.ndarray]) -> bool:
        need = self.need(i)
        if not self.fits(r, need):
            return False
        self.take(r, i, need)
        return True

    def extend(self, r: int, i: int, tokens: int) -> bool:
        return True

    def grow(self, r: int, ids: np.ndarray) -> bool:
        return True


class Paged(KVPool):
    """vLLM: slots allocated as tokens are computed; the scheduler preempts when they run out."""

    name = "paged"

    def admit(self, r: int, i: int, tokens: int, admitted: Callable[[], np.ndarray]) -> bool:
        return self.extend(r, i, tokens)

    def extend(self, r: int, i: int, tokens: int) -> bool:
        if not self.fits(r, tokens):
            return False
        self.take(r, i, tokens)
        return True

    def grow(self, r: int, ids: np.ndarray) -> bool:
        if not len(ids):  # nothing decodes here (used never passes the capacity)
            return True
        per = 1 + self.lookahead
        if not self.fits(r, len(ids) * per):
            return False
        self.used[r] += len(ids) * per
        self.held[ids] += per
        return True

    def settle(self, ids: np.ndarray, counts: np.ndarray) -> None:
        if not self.lookahead or not len(ids):
            return
        rejected = np.maximum(1 + self.lookahead - counts, 0)
        np.subtract.at(self.used, self.rank[ids], rejected)
        self.held[ids] -= rejected


class Reservation(Paged):
    """SGLang: allocated as computed; admitted against what the admitted requests still expect.

    clip: SGLang's ``CLIP_MAX_NEW_TOKENS``; a request's expected tokens are its remaining
    prompt plus ``min(remaining output, clip)``.
    """

    name = "reservation"

    def __init__(self, ranks: int, capacity: int, st: RequestState, rank: np.ndarray,
                 clip: int = SGLANG_CLIP_MAX_NEW_TOKENS) -> None:
        super().__init__(ranks, capacity, st, rank)
        self.clip = clip

    def expected(self, ids: np.ndarray) -> int:
        """Tokens ``ids`` will still take: the prompt (and recompute) not yet allocated plus
        the clipped output left."""
        st = self.st
        if not len(ids):
            return 0
        prompt = st.isl[ids] + st.generated[ids] - self.held[ids]
        out = np.minimum(st.osl[ids] - st.generated[ids], self.clip)
        return int(np.maximum(prompt, 0).sum() + np.maximum(out, 0).sum())

    def admit(self, r: int, i: int, tokens: int, admitted: Callable[[], np.ndarray]) -> bool:
        need = self.expected(np.array([i]))
        if self.free(r) - self.expected(admitted()) < need or not self.fits(r, tokens):
            return False
        self.take(r, i, tokens)
        return True

