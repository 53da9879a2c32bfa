"""A step compiled once per plan: a new batch costed on a known structure (from one layer per
class) gives exactly what a fresh build gives."""

import gc

import numpy as np
import pytest

from epsim.model import Batch, load_model, make_plan
from epsim.model.graph import build_representative_ops, build_step_graph, representative_layers
from epsim.sim.hardware.profile import load_profile
from epsim.sim.step import StepMemo, routed, simulate_step
from epsim.sim.step import compile as step_compile

R1 = load_model("deepseek-r1")
OSS = load_model("gpt-oss-120b")
MI = load_profile("mi300x")
H100 = load_profile("h100")


def _fresh(*args, **kwargs):
    """A step simulated with nothing kept from any other call (its own fresh memo)."""
    return simulate_step(*args, **kwargs).to_json()


def test_representative_layers_group_layers_whose_ops_are_equal():
    # DeepSeek-R1: layer 0 opens the residual stream, 1-2 dense, 3-60 MoE
    assert representative_layers(R1) == (0, 1, 1, *([3] * 58))
    # GPT-OSS alternates sliding and full attention over MoE layers
    reps = representative_layers(OSS)
    assert set(reps) == {0, 1, 2}
    assert all(OSS.attention.layer_types[layer] == OSS.attention.layer_types[reps[layer]]
               for layer in range(1, OSS.num_layers))


@pytest.mark.parametrize("batch", [Batch.decode(37, 1234), Batch.decode(64, 900),
                                   Batch("prefill", 2, 2000)],
                         ids=["unequal-microbatches", "equal-microbatches", "prefill"])
def test_representative_ops_stand_for_every_op_of_the_full_graph(batch):
    # an equal second microbatch's ops are copied from the first's: they must still be its own
    plan = make_plan(R1, dp=8, ep=8, mtp=1)
    full = build_step_graph(R1, plan, batch)
    reps = build_representative_ops(R1, plan, batch)
    assert len(reps) < len(full.ops) / 10
    layer_rep = representative_layers(R1)
    for op in full.ops.values():
        layer = layer_rep[op.layer] if op.draft is None and 0 <= op.layer < R1.num_layers \
            else op.layer
        key = op.id.replace(f"L{op.layer}.", f"L{layer}.", 1) if op.layer >= 0 else op.id
        rep = reps[key]
        assert rep.id == key
        fields = ("kind", "name", "microbatch", "category", "dims", "dtype", "flops",
                  "bytes_read", "bytes_written", "weight_bytes", "peer_bytes", "routed",
                  "outputs", "draft")
        assert [getattr(rep, f) for f in fields] == [getattr(op, f) for f in fields]


CASES = [
    (R1, MI, dict(dp=8, ep=8)),
    (R1, MI, dict(dp=8, ep=8, mtp=1)),
    (R1, H100, dict(tp=8)),
    (OSS, MI, dict(dp=8, ep=8)),
]
SHAPES = [Batch.decode(64, 900), Batch.decode(511, 2100), Batch.decode(1, 50),
          Batch("prefill", 2, 2000), Batch("prefill", 1, 4096, 1024)]


@pytest.mark.parametrize("model,profile,plan_kw", CASES, ids=["r1-ep8", "r1-mtp", "r1-tp8",
                                                              "oss-ep8"])
def test_a_recosted_batch_equals_a_fresh_build_bit_for_bit(model, profile, plan_kw):
    plan = make_plan(model, **plan_kw)
    fresh = {b: _fresh(model, plan, b, profile, seed=2) for b in SHAPES}
    memo = StepMemo()
    for b in SHAPES:  # the first of each phase builds the structure; the rest are recosted
        assert simulate_step(model, plan, b, profile, seed=2, memo=memo).to_json() == fresh[b]
    # decode with 2 microbatches, decode with 1 (a single sequence), prefill with 2 and 1
    assert len(memo.structures) == 4


CONTEXT_FAMILIES = [Batch.decode(64, 900), Batch.decode(64, 2500), Batch.decode(64, 31),
                    Batch.decode(511, 2100), Batch.decode(511, 700),
                    Batch.prefill(1, 4096, 1024), Batch.prefill(1, 6000, 2928),
                    Batch.prefill(1, 3072)]


@pytest.mark.parametrize("model,profile,plan_kw", CASES, ids=["r1-ep8", "r1-mtp", "r1-tp8",
                                                              "oss-ep8"])
def test_a_new_context_of_a_costed_batch_equals_a_fresh_build_bit_for_bit(model, profile,
                                                                          plan_kw):
    # batches differing in context (a prefill: in prompt and prefix, its new tokens equal)
    # are recosted from the first one's ops with their attention cores rebuilt
    plan = make_plan(model, **plan_kw)
    fresh = {b: _fresh(model, plan, b, profile, seed=4) for b in CONTEXT_FAMILIES}
    memo = StepMemo()
    for b in CONTEXT_FAMILIES:
        assert simulate_step(model, plan, b, profile, seed=4, memo=memo).to_json() == fresh[b]
    # one costing per (phase, sequences, new tokens) recosted: 64 and 511 sequences, a prefill
    # of 3072 new tokens (the first batch of each structure is costed on its full graph)
    assert len(memo.costed) == 3
    same = [step_compile.compile_step(model, plan, b, profile, memo)
            for b in CONTEXT_FAMILIES[1:3]]
    shared = [a is b for a, b in zip(same[0].ops, same[1].ops, strict=True)]
    assert any(shared) and not all(shared)  # the non-attention ops are the same objects


def test_explain_after_a_recost_equals_a_fresh_build_s():
    # the ops it lists (outside every table) are named by their own ids, not their stand-ins'
    plan = make_plan(R1, dp=8, ep=8)
    batch = Batch.decode(96, 1500)
    fresh = _fresh(R1, plan, batch, MI, explain=True)
    memo = StepMemo()
    simulate_step(R1, plan, Batch.decode(128, 1000), MI, memo=memo)
    recosted = simulate_step(R1, plan, batch, MI, explain=True, memo=memo).to_json()
    assert recosted == fresh
    listed = [i for kind in fresh["kernel_sources"].values() for entry in kind["outside"]
              for i in entry["ops"]]
    assert any(i.startswith("L4.") for i in listed)  # a layer that is not a representative


@pytest.mark.parametrize("plan_kw,eplb", [(dict(dp=8, ep=8), True), (dict(dp=8, ep=8), False),
                                          (dict(dp=8, ep=8, mtp=2), True)],
                         ids=["balanced", "contiguous", "mtp2"])
def test_a_serving_grid_reuses_samples_and_equals_fresh_steps(plan_kw, eplb):
    # the serving simulator's grid points: one seed, a batch at several contexts (one sample
    # and one set of routed times), another seed at a context already met (a new sample)
    plan = make_plan(R1, **plan_kw)
    calls = [(Batch.decode(200, c), 0) for c in (300, 1100, 2600, 5000)]
    calls += [(Batch.decode(200, 1100), 7), (Batch.decode(96, 1100), 0)]
    fresh = [_fresh(R1, plan, b, MI, seed=s, eplb=eplb) for b, s in calls]
    memo = StepMemo()
    for (b, s), want in zip(calls, fresh, strict=True):
        assert simulate_step(R1, plan, b, MI, seed=s, eplb=eplb, memo=memo).to_json() == want
    # three samples (batch 200 with seed 0 and 7, batch 96), each costed once: the memo was used
    assert len(memo.samples) == 3
    assert len(memo.routed) == 3  # the full-graph batch and its recosts alike
    sampled = next(iter(memo.samples.values()))
    assert not sampled.routing.slot_pairs.flags.writeable  # shared: nobody may change it
    # a new seed gives a new draw
    assert fresh[4]["rank_ms"] != fresh[1]["rank_ms"]


def test_routed_times_keep_no_op_graph_alive():
    # a routed-times entry names its structure's graph weakly, as a costed batch kept for its
    # other contexts names its structure: dropping the compiled steps frees the graph (some
    # MB) whatever the routed and costed memos still hold
    memo = StepMemo()
    simulate_step(R1, make_plan(R1, dp=8, ep=8), Batch.decode(64, 900), MI, memo=memo)
    simulate_step(R1, make_plan(R1, dp=8, ep=8), Batch.decode(64, 1900), MI,
                  memo=memo)  # recosted
    assert len(memo.costed) == 1
    entry = next(iter(memo.routed.values()))
    assert entry.graph() is not None
    memo.compiled.clear()
    memo.structures.clear()
    gc.collect()
    assert entry.graph() is None
    # and a step after that is still the fresh one
    again = simulate_step(R1, make_plan(R1, dp=8, ep=8), Batch.decode(64, 900), MI,
                          memo=memo).to_json()
    assert again == _fresh(R1, make_plan(R1, dp=8, ep=8), Batch.decode(64, 900), MI)


def test_new_samples_of_a_known_batch_equal_fresh_steps_with_kept_fused_moe_seconds():
    # a new seed draws a new sample; the fused MoE's table seconds are kept by token count per
    # compiled batch, so later samples cost only the counts not met before: same results
    plan = make_plan(R1, dp=8, ep=8)
    batch = Batch.decode(256, 1500)
    fresh = [_fresh(R1, plan, batch, MI, seed=s) for s in range(5)]
    memo = StepMemo()
    for s, want in enumerate(fresh):
        assert simulate_step(R1, plan, batch, MI, seed=s, memo=memo).to_json() == want
    kept = step_compile.compile_step(R1, plan, batch, MI, memo).memo["experts_seconds"]
    assert (kept.keys[1:] > kept.keys[:-1]).all()  # sorted, distinct
    # 5 samples x 58 layers x 2 microbatches x 8 GPUs = 4,640 counts, far fewer distinct ones
    assert 100 < len(kept.keys) < 4640 // 4


def test_seconds_by_value_costs_each_new_value_once(monkeypatch):
    asked = []

    def compute(v):
        asked.append(np.array(v, copy=True))
        return np.asarray(v) * 2.0 + 1.0

    memo = routed.SecondsByValue()
    first = memo.get(np.array([[3.0, 1.0], [3.0, 2.5]]), compute)
    assert first.tolist() == [[7.0, 3.0], [7.0, 6.0]]
    assert asked[-1].tolist() == [1.0, 2.5, 3.0]  # each distinct value once
    again = memo.get(np.array([2.5, 4.0, 1.0, 4.0]), compute)
    assert again.tolist() == [6.0, 9.0, 3.0, 9.0] and asked[-1].tolist() == [4.0]
    assert memo.keys.tolist() == [1.0, 2.5, 3.0, 4.0]
    n = len(asked)
    assert memo.get(np.array([4.0, 1.0]), compute).tolist() == [9.0, 3.0] and len(asked) == n
    # a NaN is never kept (it would match nothing): computed as given
    out = memo.get(np.array([1.0, np.nan]), compute)
    assert out[0] == 3.0 and np.isnan(out[1]) and len(memo.keys) == 4
    # past the limit the memo starts over from the values of this call
    monkeypatch.setattr(routed.SecondsByValue, "LIMIT", 5)
    memo.get(np.array([10.0, 11.0]), compute)
    assert memo.keys.tolist() == [10.0, 11.0]
    assert memo.get(np.array([11.0, 1.0]), compute).tolist() == [23.0, 3.0]
