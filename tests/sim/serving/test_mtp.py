"""MTP speculative decoding: the accepted-token chain, the verify step's op graph, the serving
loop's chunks and vLLM's metric definitions over them, and the commands' figures."""

import json
import math

import numpy as np
import pytest
from serving_models import Affine

from epsim.model import Batch, accounting, build_step_graph, load_model, make_plan
from epsim.model.errors import EpsimError
from epsim.model.mtp import DEFAULT_ACCEPTANCE, expected_tokens, sample_accepted
from epsim.sim.scenario import StepCache, run_scenario
from epsim.sim.serving import ServingConfig, simulate_serving
from epsim.sim.serving.metrics import compute_metrics
from epsim.sim.serving.speculation import DraftAcceptance
from epsim.sim.spec import Scenario
from epsim.sim.workload.spec import Requests, WorkloadSpec

R1 = load_model("deepseek-r1")
TINY = load_model("tiny-deepseek")


# -- the chain of accepted drafts ---------------------------------------------------------------


def test_expected_tokens_is_the_sum_of_powers_of_the_acceptance():
    assert expected_tokens(1, 0.6) == pytest.approx(1.6)
    assert expected_tokens(2, 0.5) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(3, 0.9) == pytest.approx(1 + 0.9 + 0.81 + 0.729)
    assert expected_tokens(0, 0.7) == 1.0
    assert expected_tokens(2, 0.0) == 1.0 and expected_tokens(2, 1.0) == 3.0
    with pytest.raises(EpsimError, match="probability"):
        expected_tokens(1, 1.5)


def test_the_default_acceptance_is_the_reports_lower_end():
    # DeepSeek-V3 report, 5.4.3: "ranges between 85% and 90%"
    assert DEFAULT_ACCEPTANCE == 0.85


def test_sampled_accepted_drafts_follow_the_chain():
    # N = 2, P = 0.7: a = 0 w.p. 0.3, 1 w.p. 0.7 * 0.3 = 0.21, 2 w.p. 0.49; E[a] = 1.19,
    # E[a^2] = 0.21 + 4 * 0.49 = 2.17, Var = 2.17 - 1.19^2 = 0.7539
    n = 20_000
    a = sample_accepted(2, 0.7, np.random.default_rng(7), n)
    se = math.sqrt(0.7539 / n)
    assert abs(a.mean() - 1.19) < 4 * se
    shares = np.bincount(a, minlength=3) / n
    for got, want in zip(shares, (0.3, 0.21, 0.49), strict=True):
        assert abs(got - want) < 4 * math.sqrt(want * (1 - want) / n)
    # one step's tokens per sequence: 1 + a, whose mean is sum P^k = 2.19
    assert abs((1 + a).mean() - expected_tokens(2, 0.7)) < 4 * se


def test_sampling_is_deterministic_and_exact_at_the_ends():
    draw = [sample_accepted(3, 0.6, np.random.default_rng(5), 100) for _ in range(2)]
    assert np.array_equal(*draw)
    assert (sample_accepted(3, 0.0, np.random.default_rng(0), 50) == 0).all()
    assert (sample_accepted(3, 1.0, np.random.default_rng(0), 50) == 3).all()
    assert sample_accepted(0, 0.9, np.random.default_rng(0), 4).tolist() == [0, 0, 0, 0]


# -- the plan and the op graph of a verify step -------------------------------------------------


def test_a_model_without_a_draft_module_refuses_mtp():
    with pytest.raises(EpsimError, match="no MTP draft module"):
        make_plan(load_model("qwen3-235b-a22b"), mtp=1)
    with pytest.raises(EpsimError, match=r"integer in \[0, 16\]"):
        make_plan(R1, mtp=17)
    assert R1.mtp_layers == 1 and R1.mtp_moe  # layer 61 is past first_k_dense_replace 3


def test_verify_step_shapes_and_the_draft_layers_flops():
    # 8 sequences per rank, one draft: every GEMM's M is 8 x 2 = 16
    graph = build_step_graph(R1, make_plan(R1, microbatches=1, mtp=1), Batch.decode(8, 2000))
    op = {o.id: o for o in graph}
    assert op["L0.attn.q_a.mb0"].dims["m"] == 16
    assert op["L5.moe.dispatch.mb0"].dims["tokens"] == 16
    assert op["lm_head.mb0"].dims["tokens"] == 16  # every position is verified
    core = op["L5.attn.core.mb0"]
    # the two queries read 2001 entries: the 1999 cached, the last token and the draft
    assert core.dims["query_tokens"] == 2 and core.dims["context"] == 2001
    attended = 2001 + 2000  # query 0 attends 2000, query 1 all 2001
    rope = 6.0 * 16 * (128 * 64 + 64)  # fused RoPE over q and k_pe of 16 tokens
    assert core.flops == 2.0 * 8 * 128 * attended * (576 + 512) + rope
    # the draft module: layer 61, pass 0 over the 16 verified rows
    assert op["L61.mtp.eh_proj.d0.mb0"].flops == 2.0 * 16 * 7168 * (2 * 7168)
    assert op["L61.mtp.eh_proj.d0.mb0"].dims == {"batch": 1, "m": 16, "n": 7168, "k": 14336}
    assert op["L61.attn.q_a.d0.mb0"].flops == 2.0 * 16 * 1536 * 7168
    assert op["L61.moe.dispatch.d0.mb0"].dims["tokens"] == 16
    # ... and its head over one row per sequence (the last accepted one)
    assert op["L61.mtp.lm_head.d0.mb0"].flops == 2.0 * 8 * 7168 * 129280
    assert graph.results[0]["draft_tokens0"] == ("L61.mtp.sample.d0.mb0", "next_tokens")
    kinds = {o.kind for o in graph if o.draft is not None}
    assert kinds == {"embedding", "norm", "gemm", "attention_decode", "router", "dispatch",
                     "grouped_gemm", "combine", "elementwise", "lm_head", "sample"}


def test_later_draft_passes_run_one_token_per_sequence_further_on():
    graph = build_step_graph(R1, make_plan(R1, microbatches=1, mtp=2), Batch.decode(8, 2000))
    op = {o.id: o for o in graph}
    core = op["L61.attn.core.d1.mb0"]
    assert core.dims["query_tokens"] == 1 and core.dims["context"] == 2003
    assert op["L61.mtp.eh_proj.d1.mb0"].dims["m"] == 8
    # pass 1 reads pass 0's sampled draft and the hidden state its head handed on
    assert graph.inputs("L61.mtp.embed.d1.mb0") == [("L61.mtp.sample.d0.mb0", "next_tokens")]
    assert graph.inputs("L61.mtp.hnorm.d1.mb0") == [("L61.mtp.lm_head.d0.mb0", "hidden")]


def test_without_mtp_the_graph_has_no_draft_op():
    plan = make_plan(R1)
    graph = build_step_graph(R1, plan, Batch.decode(8, 2000))
    assert all(o.draft is None for o in graph) and plan.mtp == 0
    assert graph.op("L5.attn.core.mb0").dims["context"] == 2000


def test_the_draft_layer_is_in_the_memory_accounting():
    # DeepSeek-R1, EP8: one MLA + MoE layer, eh_proj and 3 norms; embedding and head shared.
    # FP8 values (1 + 4 / 128^2 bytes each): attention 187,105,280 (q_a 11,010,048, q_b
    # 37,748,736, kv_a 4,128,768, kv_b 16,777,216, o_proj 117,440,512), 32 experts
    # 1,409,286,144, the shared expert 44,040,192, eh_proj 102,760,448; BF16 values (2 bytes):
    # q_a_norm 1536, kv_a_norm 512, two layer norms 14,336, the router 1,835,264, three norms
    # 21,504
    fp8 = 187_105_280 + 1_409_286_144 + 44_040_192 + 102_760_448
    bf16 = 1536 + 512 + 14_336 + 1_835_264 + 21_504
    with_mtp = accounting.weight_bytes_per_rank(R1, make_plan(R1, mtp=1))
    assert with_mtp["mtp"] == pytest.approx(fp8 * (1 + 4 / 128**2) + 2 * bf16, rel=1e-12)
    without = accounting.weight_bytes_per_rank(R1, make_plan(R1))
    assert with_mtp["total"] - without["total"] == pytest.approx(with_mtp["mtp"])
    # the draft layer caches its own 576 FP8 values per token: 62 layers instead of 61
    budget = accounting.memory_budget(R1, make_plan(R1, mtp=1), 192e9)
    assert budget.kv_bytes_per_token == 62 * 576


# -- the serving loop ---------------------------------------------------------------------------


def one_request(osl):
    return Requests(np.array([100]), np.array([osl]), np.zeros(1))


def test_under_mtp_itl_is_per_output_and_tpot_per_token():
    # prefill 0.1 s emits the first token; each 10 ms verify step accepts its one draft (P = 1)
    # and emits 2 tokens: 4 more tokens in 2 steps. vLLM: ITL per streamed output (2 gaps of
    # 10 ms), TPOT = (e2el - ttft) / (tokens - 1) = 20 ms / 4
    cfg = ServingConfig(dp=1, kv_capacity_tokens=10**6, mtp=1, mtp_acceptance=1.0)
    run = simulate_serving(one_request(5), cfg, Affine(base=0.01, p_base=0.1))
    m = compute_metrics(run)
    assert run.itls_s.tolist() == pytest.approx([0.01, 0.01])
    assert m["mean_itl_ms"] == pytest.approx(10.0)
    assert m["mean_tpot_ms"] == pytest.approx(5.0)
    assert m["mean_e2el_ms"] == pytest.approx(120.0)
    # decode only: 4 tokens in two 10 ms steps
    assert m["decode_throughput"] == pytest.approx(200.0)
    # vLLM's spec_decode_* keys: 2 drafts of 1 token, both accepted
    assert m["spec_decode_num_drafts"] == 2 and m["spec_decode_accepted_tokens"] == 2
    assert m["spec_decode_acceptance_rate"] == pytest.approx(100.0)
    assert m["spec_decode_acceptance_length"] == pytest.approx(2.0)


def test_a_rejected_draft_emits_one_token_and_the_last_step_stops_at_the_output_length():
    rejected = simulate_serving(
        one_request(5), ServingConfig(dp=1, kv_capacity_tokens=10**6, mtp=1, mtp_acceptance=0.0),
        Affine(base=0.01, p_base=0.1))
    m = compute_metrics(rejected)
    assert len(rejected.itls_s) == 4 and m["mean_tpot_ms"] == pytest.approx(10.0)
    assert m["spec_decode_acceptance_rate"] == 0.0
    # 4 tokens to go, 3 drafts all accepted: one step of 4 tokens (capped from 1 + 3)
    capped = simulate_serving(
        one_request(5), ServingConfig(dp=1, kv_capacity_tokens=10**6, mtp=3, mtp_acceptance=1.0),
        Affine(base=0.01, p_base=0.1))
    assert capped.itls_s.tolist() == pytest.approx([0.01])
    assert compute_metrics(capped)["spec_decode_accepted_tokens"] == 3


def test_the_serving_loop_draws_acceptance_from_its_seed():
    def run(seed):
        cfg = ServingConfig(dp=2, kv_capacity_tokens=10**6, mtp=2, mtp_acceptance=0.6, seed=seed)
        reqs = Requests(np.full(16, 100), np.full(16, 400), np.zeros(16))
        return compute_metrics(simulate_serving(reqs, cfg, Affine(base=0.01, p_base=0.1)))

    a, b, c = run(3), run(3), run(4)
    assert a == b
    assert a["spec_decode_per_position_acceptance_rates"] != \
        c["spec_decode_per_position_acceptance_rates"]
    # per position: P and P^2 of the drafts, within 4 standard errors (plus the 16 last
    # drafts, which the end of an output may cut short)
    first, second = a["spec_decode_per_position_acceptance_rates"]
    drafts = a["spec_decode_num_drafts"]
    assert drafts > 3000
    assert abs(first - 0.6) < 4 * math.sqrt(0.6 * 0.4 / drafts) + 16 / drafts
    assert abs(second - 0.36) < 4 * math.sqrt(0.36 * 0.64 / drafts) + 16 / drafts
    # tokens per request step: the 399 tokens after each first one over the drafts verified
    assert a["spec_decode_acceptance_length"] == pytest.approx(16 * 399 / drafts)


def test_draft_acceptance_counts_only_emitted_drafts():
    spec = DraftAcceptance(2, 1.0, seed=0)
    assert spec.tokens(np.array([5, 2, 1])).tolist() == [3, 2, 1]
    m = spec.metrics()
    assert m["spec_decode_num_drafts"] == 3 and m["spec_decode_draft_tokens"] == 6
    assert m["spec_decode_accepted_tokens"] == 2 + 1 + 0
    assert m["spec_decode_per_position_acceptance_rates"] == pytest.approx([2 / 3, 1 / 3])
    assert DraftAcceptance(0, 0.85, seed=0).metrics() == {}


def test_a_request_reserves_kv_for_the_drafts_past_its_end():
    # 100 in + 5 out + 1 draft: 106 tokens do not fit a 105-token cache
    cfg = ServingConfig(dp=1, kv_capacity_tokens=105, mtp=1)
    with pytest.raises(EpsimError, match="needs 106 KV tokens"):
        simulate_serving(one_request(5), cfg, Affine())


# -- the commands' figures ----------------------------------------------------------------------


def test_mtp_speeds_up_predict_when_drafts_are_accepted_and_slows_it_when_not():
    cache = StepCache()
    w = WorkloadSpec(dataset="fixed", num_prompts=128, isl=1000, osl=100,
                     concurrency=128).validate()
    base = Scenario.of(model="deepseek-r1", hardware="mi300x", workload=w, dp=8, ep=8)
    plain = run_scenario(base, cache)
    good = run_scenario(base.with_(mtp=1, mtp_acceptance=0.9), cache)
    bad = run_scenario(base.with_(mtp=1, mtp_acceptance=0.0), cache)
    assert good["output_throughput"] > plain["output_throughput"] > bad["output_throughput"]
    assert good["tokens_per_request_step"] == pytest.approx(1.9)
    assert plain["mtp"] == 0 and "spec_decode_num_drafts" not in plain
    # the verify step is longer than a plain one, so each output waits longer
    assert good["median_itl_ms"] > plain["median_itl_ms"]
    assert good["mean_tpot_ms"] < plain["mean_tpot_ms"] < bad["mean_tpot_ms"]


def test_step_reports_tokens_per_request_step_and_a_longer_step(epsim):
    args = ["step", "--model", "deepseek-r1", "--hardware", "mi300x", "--dp", "8", "--ep", "8",
            "--batch", "256", "--context", "2000", "--json"]
    plain = json.loads(epsim(*args).stdout)
    mtp = json.loads(epsim(*args, "--mtp", "1", "--mtp-acceptance", "0.6").stdout)
    assert mtp["tokens_per_request_step"] == pytest.approx(1.6)
    assert plain["tokens_per_request_step"] == 1.0 and plain["draft_module_ms"] == 0.0
    assert mtp["step_ms"] > plain["step_ms"]
    assert 0.0 < mtp["draft_module_ms"] < mtp["step_ms"]
    assert mtp["plan"]["mtp"] == 1 and mtp["plan"]["mtp_acceptance"] == 0.6


def test_mtp_flags_are_checked(epsim):
    for flag, value in (("--mtp", "17"), ("--mtp", "-1"), ("--mtp-acceptance", "1.5")):
        res = epsim("step", "--model", "deepseek-r1", "--hardware", "mi300x", "--batch", "8",
                    "--context", "100", flag, value)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    res = epsim("step", "--model", "qwen3-235b-a22b", "--hardware", "mi300x", "--batch", "8",
                "--context", "100", "--mtp", "1")
    assert res.returncode == 2 and "no MTP draft module" in res.stderr
