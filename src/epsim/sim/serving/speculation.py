"""How many tokens a decode step emits per request under MTP speculative decoding.

A verify step emits ``1 + a`` tokens for each request it decodes, ``a`` the leading accepted drafts
(``epsim.model.mtp.sample_accepted``: a chain of Bernoulli(P) trials, at most ``N``), capped at
the tokens the request still has to produce. Draws come from one generator per serving run, seeded
by the benchmark's seed, in the order the steps run and their requests are listed, so a run is
deterministic in its seed; without MTP nothing is drawn and every request emits one token.

The counters are the ones ``vllm bench serve`` reports from the server's speculative-decoding
metrics (vllm-project/vllm vllm/benchmarks/serve.py at 009e6d4a, ``spec_decode_*`` keys):
``num_drafts`` (verified draft sequences: one per request and step), ``draft_tokens`` (N per
draft), ``accepted_tokens``, ``acceptance_rate`` (accepted / draft tokens, in percent),
``acceptance_length`` (1 + accepted / drafts: tokens per request step) and the per-position
acceptance rates (the share of drafts whose position ``i`` was accepted: ``P**(i+1)`` expected).
An accepted draft counts as emitted: one cut off by the request's end does not count.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from epsim.model.mtp import check_acceptance, sample_accepted

#: mixed into the run's seed, so the acceptance draws are no other stream's
_STREAM = 0x737065


class DraftAcceptance:
    """Samples each decode step's emitted tokens per request and counts what vLLM reports.

    drafts / acceptance: ``N`` and ``P`` (``drafts == 0``: no speculative decoding).
    seed: the benchmark's seed.
    """

    def __init__(self, drafts: int, acceptance: float, seed: int) -> None:
        self.drafts = drafts
        self.acceptance = check_acceptance(acceptance)
        self._rng = np.random.default_rng((seed, _STREAM)) if drafts else None
        self.num_drafts = 0
        self.accepted_per_pos = np.zeros(drafts, dtype=np.int64)

    def tokens(self, remaining: np.ndarray) -> np.ndarray:
        """``[requests]`` tokens each request decoded in a step emits (``remaining``: the
        tokens each still has to produce, at least 1)."""
        remaining = np.asarray(remaining, dtype=np.int64)
        if self._rng is None:
            return np.ones(len(remaining), dtype=np.int64)
        accepted = sample_accepted(self.drafts, self.acceptance, self._rng, len(remaining))
        emitted = np.minimum(1 + accepted, remaining)
        self.num_drafts += len(emitted)
        kept = emitted - 1
        self.accepted_per_pos += (kept[:, None] > np.arange(self.drafts)[None, :]).sum(axis=0)
        return emitted

    def metrics(self) -> dict[str, Any]:
        """vLLM's ``spec_decode_*`` result keys (empty without speculative decoding, as vLLM
        reports none then)."""
        if not self.drafts:
            return {}
        drafts = max(self.num_drafts, 1)
        accepted = int(self.accepted_per_pos.sum())  # a draft's accepted positions, summed
        draft_tokens = self.num_drafts * self.drafts
        return {
            "spec_decode_acceptance_rate": accepted / max(draft_tokens, 1) * 100.0,
            "spec_decode_acceptance_length": 1.0 + accepted / drafts,
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_draft_tokens": draft_tokens,
            "spec_decode_accepted_tokens": accepted,
            "spec_decode_per_position_acceptance_rates": [
                float(c) / drafts for c in self.accepted_per_pos],
        }
