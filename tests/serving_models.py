"""Analytic step-time models for the serving tests (results computable by hand).

Not a step simulator: ``epsim`` itself always uses ``epsim.sim.step.simulate.simulate_step``.
"""

from dataclasses import dataclass

from epsim.sim.serving import StepCost


@dataclass
class Affine:
    """decode = base + per_seq * seqs + per_ctx * seqs * context;
    prefill = p_base + p_token * seqs * (prompt - prefix)."""

    base: float = 0.01
    per_seq: float = 0.0
    per_ctx: float = 0.0
    p_base: float = 0.1
    p_token: float = 0.0
    calls: int = 0

    def decode(self, seqs, context):
        self.calls += 1
        return StepCost(self.base + self.per_seq * seqs + self.per_ctx * seqs * context,
                        {"attention": self.per_ctx * seqs * context * 1e3,
                         "other": (self.base + self.per_seq * seqs) * 1e3}, 1.0 + seqs / 1e4)

    def prefill(self, seqs, prompt, prefix):
        self.calls += 1
        return StepCost(self.p_base + self.p_token * seqs * (prompt - prefix))


def affine_factory(**kw):
    """A ``StepCache`` factory: DBO (two microbatches) shaves 20 % off the per-seq cost, BF16 KV
    doubles the attention cost, eager mode adds 5 ms."""

    def make(model, plan, profile, sc):
        per_seq = kw.get("per_seq", 1e-4) * (0.8 if plan.microbatches == 2 else 1.0)
        per_ctx = kw.get("per_ctx", 1e-8) * (2.0 if plan.kv_dtype == "bf16" else 1.0)
        base = kw.get("base", 0.01) + (0.0 if plan.graph_mode else 0.005)
        return Affine(base=base, per_seq=per_seq, per_ctx=per_ctx, p_base=kw.get("p_base", 0.02),
                      p_token=kw.get("p_token", 1e-6))

    return make


def assert_same_metrics(want: dict, got: dict, rel: float = 1e-12) -> None:
    """Two runs' ``compute_metrics``: the same keys, floats equal to ``rel``, the rest exactly."""
    import pytest

    assert got.keys() == want.keys()
    for k in want:
        if isinstance(want[k], float):
            assert got[k] == pytest.approx(want[k], rel=rel), k
        else:
            assert got[k] == want[k], k
