"""Measured benchmark results: reading vLLM's and SGLang's files, the clients' length rules,
vLLM's goodput and peaks, writing vLLM's format, and the predict -> validate round trip."""

import json
import math

import numpy as np
import pytest
from conftest import REPO

from epsim.model.errors import EpsimError
from epsim.sim.serving.bench_write import (
    max_concurrent_requests,
    max_output_tokens_per_s,
    vllm_result,
)
from epsim.sim.serving.metrics import (
    good_requests,
    goodput_slos,
    parse_goodput_item,
    per_request_itls_s,
)
from epsim.sim.serving.simulate import ServingRun
from epsim.sim.workload.bench_results import (
    RESULT_FORMATS,
    even_lengths,
    parse_bench,
    read_bench_file,
)
from epsim.sim.workload.spec import BENCH_CLIENTS, Requests, WorkloadSpec, sample_requests

#: a vllm bench serve --save-result file without --save-detailed (keys as serve.py writes them)
VLLM = {
    "date": "20250101-120000", "endpoint_type": "openai", "backend": "openai", "label": None,
    "model_id": "deepseek-ai/DeepSeek-V3", "tokenizer_id": "deepseek-ai/DeepSeek-V3",
    "num_prompts": 10, "request_rate": "inf", "burstiness": 1.0, "max_concurrency": 4,
    "duration": 12.5, "completed": 10, "failed": 0, "total_input_tokens": 1005,
    "total_output_tokens": 80, "request_throughput": 0.8, "request_goodput": None,
    "output_throughput": 6.4, "total_token_throughput": 86.8,
    "latencies": [1.0] * 10, "queue_times": [0.0] * 10,
    "max_output_tokens_per_s": 12.0, "max_concurrent_requests": 4, "rtfx": 0.0,
    "mean_ttft_ms": 250.0, "median_ttft_ms": 240.0, "std_ttft_ms": 20.0, "p99_ttft_ms": 300.0,
    "mean_tpot_ms": 40.0, "median_tpot_ms": 41.0, "std_tpot_ms": 2.0, "p99_tpot_ms": 45.0,
}

#: an SGLang bench_serving result line (keys as bench_serving.py's benchmark() writes them)
SGLANG = {
    "backend": "sglang", "dataset_name": "random", "request_rate": math.inf,
    "max_concurrency": 8, "sharegpt_output_len": None, "random_input_len": 3200,
    "random_output_len": 800, "random_range_ratio": 1.0, "duration": 40.0, "completed": 16,
    "total_input_tokens": 51200, "total_output_tokens": 12800,
    "total_output_tokens_retokenized": 12790, "request_throughput": 0.4,
    "input_throughput": 1280.0, "output_throughput": 320.0, "mean_e2e_latency_ms": 20000.0,
    "median_e2e_latency_ms": 19900.0, "std_e2e_latency_ms": 100.0,
    "p99_e2e_latency_ms": 20500.0, "mean_ttft_ms": 900.0, "p95_itl_ms": 30.0,
    "concurrency": 7.9, "accept_length": None,
}


def write(tmp_path, obj, name="r.json"):
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return path


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def test_a_vllm_file_without_lists_replays_the_mean_lengths_with_exact_totals(tmp_path):
    b = read_bench_file(write(tmp_path, VLLM))
    assert b.client == "vllm" and b.num_prompts == 10 and b.max_concurrency == 4
    assert math.isinf(b.request_rate) and b.input_lens is None
    req = b.requests()
    # 1005 / 10 = 100.5: five requests of 101 tokens, five of 100; outputs 8 each
    assert req.input_lens.tolist() == [101] * 5 + [100] * 5
    assert req.output_lens.tolist() == [8] * 10 and req.issue_times_s.tolist() == [0.0] * 10
    assert any("mean lengths" in n for n in b.notes)
    # every metric present, none absent; a null goodput is no measurement
    assert b.measured["p99_ttft_ms"] == 300.0 and b.measured["max_concurrent_requests"] == 4
    assert "request_goodput" not in b.measured and "mean_itl_ms" not in b.measured


def test_a_detailed_vllm_file_replays_its_completed_requests(tmp_path):
    detailed = {**VLLM, "num_prompts": 4, "completed": 3, "failed": 1,
                "total_input_tokens": 450, "total_output_tokens": 30,
                "input_lens": [100, 200, 300, 50], "output_lens": [10, 0, 15, 5],
                "errors": ["", "timeout", "", ""],
                "start_times": [10.0, 10.1, 10.5, 11.0], "queue_times": [0.0, 0.1, 0.2, 0.5],
                "request_rate": 4.0}
    b = read_bench_file(write(tmp_path, detailed))
    assert b.input_lens == (100, 300, 50) and b.output_lens == (10, 15, 5)
    # arrivals: start - queue = 10.0, 10.3, 10.5 -> from 0
    assert np.allclose(b.issue_times_s, [0.0, 0.3, 0.5])
    assert any("1 failed" in n for n in b.notes)


@pytest.mark.parametrize("change, message", [
    ({"total_input_tokens": 1010}, "sum(input_lens) 1000 disagrees"),
    ({"total_output_tokens": 90}, "sum(output_lens) 80 disagrees"),
    ({"completed": 12, "num_prompts": 12}, "completed requests listed 10 disagrees"),
])
def test_counts_that_disagree_by_more_than_a_thousandth_are_refused(tmp_path, change, message):
    lists = {**VLLM, "total_input_tokens": 1000, "input_lens": [100] * 10,
             "output_lens": [8] * 10}
    with pytest.raises(EpsimError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_bench_file(write(tmp_path, {**lists, **change}))
    # within 0.1 %: 1000 listed against 1001 in the total is accepted
    assert read_bench_file(write(tmp_path, {**lists, "total_input_tokens": 1001})).num_prompts == 10


def test_an_sglang_line_is_read_with_its_own_keys_at_the_last_line(tmp_path):
    first = {**SGLANG, "completed": 4, "total_input_tokens": 12800, "total_output_tokens": 3200}
    path = tmp_path / "sglang.jsonl"
    path.write_text(json.dumps(first) + "\n" + json.dumps(SGLANG) + "\n")  # Infinity, as json writes it
    b = read_bench_file(path)
    assert b.client == "sglang" and b.num_prompts == 16 and b.source.endswith("line 2 of 2")
    assert math.isinf(b.request_rate) and b.burstiness == 1.0
    assert b.requests().input_lens.tolist() == [3200] * 16
    m = b.measured
    assert m["mean_e2el_ms"] == 20000.0 and m["p99_e2el_ms"] == 20500.0
    assert m["p95_itl_ms"] == 30.0 and m["input_throughput"] == 1280.0 and m["concurrency"] == 7.9
    assert "spec_decode_acceptance_length" not in m  # accept_length null


@pytest.mark.parametrize("obj, message", [
    ([1, 2], "neither a vllm bench serve result"),
    ({"duration": 1.0, "completed": 2, "total_input_tokens": 4, "total_output_tokens": 4,
      "max_concurrency": 1}, "no key of either"),
    ({**VLLM, "mean_e2e_latency_ms": 1.0}, "mixes keys"),
    ({k: v for k, v in VLLM.items() if k != "duration"}, "lacks the workload key(s) duration"),
    ({**VLLM, "max_concurrency": None, "request_rate": None},
     "max_concurrency or request_rate"),
    ({**VLLM, "num_prompts": -3}, "num_prompts must be a positive integer"),
])
def test_files_of_neither_format_or_without_the_workload_are_refused(tmp_path, obj, message):
    with pytest.raises(EpsimError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_bench_file(write(tmp_path, obj))


def test_a_file_without_markers_takes_the_client_named_and_refuses_a_contradiction():
    bare = {"duration": 1.0, "completed": 2, "total_input_tokens": 4, "total_output_tokens": 4,
            "max_concurrency": 1}
    assert parse_bench(bare, client="sglang").client == "sglang"
    with pytest.raises(EpsimError, match="a vllm result, but --bench-client sglang"):
        parse_bench(VLLM, client="sglang")

    with pytest.raises(EpsimError, match="unknown benchmark client 'genai'"):
        parse_bench(bare, client="genai")


def test_each_bench_client_is_one_result_format_with_its_metric_names():
    # the clients whose flags epsim reads are the clients whose files it reads
    assert set(RESULT_FORMATS) == set(BENCH_CLIENTS) == {"vllm", "sglang"}
    assert all(name == f.name for name, f in RESULT_FORMATS.items())
    assert not RESULT_FORMATS["vllm"].keys & RESULT_FORMATS["sglang"].keys
    sglang = parse_bench({**SGLANG, "p99_e2e_latency_ms": 7.0})
    assert sglang.client == "sglang" and sglang.measured["p99_e2el_ms"] == 7.0
    assert parse_bench({**VLLM, "p99_e2el_ms": 5.0}).measured["p99_e2el_ms"] == 5.0


def test_even_lengths_sum_to_the_total():
    assert even_lengths(7, 3).tolist() == [3, 2, 2]


# --------------------------------------------------------------------------------------------
# The clients' random-range-ratio
# --------------------------------------------------------------------------------------------


def test_each_client_reads_random_range_ratio_its_own_way():
    vllm, sglang = BENCH_CLIENTS["vllm"], BENCH_CLIENTS["sglang"]
    assert vllm.length_range(100, 0.5) == (50, 150)  # [floor(L(1-r)), ceil(L(1+r))]
    assert sglang.length_range(100, 0.5) == (50, 100)  # [int(rL), L]
    assert sglang.length_range(3200, 1.0) == (3200, 3200)  # r = 1: fixed
    assert sglang.length_range(800, 0.0) == (1, 800)  # SGLang's default r = 0: [1, L]
    with pytest.raises(EpsimError, match=r"\[0, 1\) for --bench-client vllm"):
        WorkloadSpec(dataset="random", isl=3200, osl=800, random_range_ratio=1.0).validate()
    req = sample_requests(WorkloadSpec(dataset="random", num_prompts=50, isl=3200, osl=800,
                                       random_range_ratio=1.0, bench_client="sglang"))
    assert set(req.input_lens.tolist()) == {3200} and set(req.output_lens.tolist()) == {800}


def test_predict_takes_sglangs_command_with_fixed_lengths(epsim):
    r = epsim("predict", "--bench-client", "sglang", "--dataset", "random",
              "--random-range-ratio", "1", "--random-input", "3200", "--random-output", "800",
              "--model", "tiny-deepseek", "--hardware", "mi300x", "--gpus-per-node", "2",
              "--dp", "2", "--ep", "2", "--num-prompts", "6", "--concurrency", "3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["total_input_tokens"] == 6 * 3200 and out["total_output_tokens"] == 6 * 800
    assert out["bench_client"] == "sglang"


# --------------------------------------------------------------------------------------------
# vLLM's goodput and peaks on a hand-made run
# --------------------------------------------------------------------------------------------


def hand_run() -> ServingRun:
    """Three requests: sent at 0, 0, 1.5 s; first tokens at 0.1, 0.3, 1.6; done at 0.5, 1.1,
    2.4; 3, 1 and 5 output tokens."""
    req = Requests(input_lens=np.array([10, 10, 10]), output_lens=np.array([3, 1, 5]),
                   issue_times_s=np.array([0.0, 0.0, 1.5]))
    gaps = np.array([0.2, 0.2, 0.2, 0.2, 0.2, 0.2])  # request 0: two gaps, request 2: four
    ids = np.array([0, 0, 2, 2, 2, 2])
    return ServingRun(requests=req, send_s=np.array([0.0, 0.0, 1.5]),
                      first_token_s=np.array([0.1, 0.3, 1.6]), done_s=np.array([0.5, 1.1, 2.4]),
                      itls_s=gaps, steps=[], config=None, itl_request_ids=ids)


def test_goodput_counts_requests_meeting_every_slo_as_vllm():
    run = hand_run()
    # TTFTs 100, 300, 100 ms; TPOTs (0.5-0.1)/2 = 200, 0 (one token), (2.4-1.6)/4 = 200 ms
    assert good_requests(run, goodput_slos([("ttft", 150.0)])) == 2
    assert good_requests(run, goodput_slos([("ttft", 300.0), ("tpot", 199.0)])) == 1
    assert good_requests(run, goodput_slos([("e2el", 900.0)])) == 2  # 500, 1100, 900 ms
    assert parse_goodput_item("tpot:50") == ("tpot", 50.0)
    for bad in ("itl:5", "ttft", "ttft:-1", "ttft:x"):
        with pytest.raises(EpsimError):
            parse_goodput_item(bad)
    with pytest.raises(EpsimError, match="ttft twice"):
        goodput_slos([("ttft", 1.0), ("ttft", 2.0)])


def test_peaks_and_per_request_itls_as_vllm_computes_them():
    run = hand_run()
    assert per_request_itls_s(run) == [[0.2, 0.2], [], [0.2] * 4]
    # in flight: [0, 0.5), [0, 1.1), [1.5, 2.4): two at most
    assert max_concurrent_requests(run) == 2
    # outputs at 0.1, 0.3, 0.5 | 0.3 | 1.6, 1.8, 2.0, 2.2, 2.4: 4 in second 0, 2 in 1, 3 in 2
    assert max_output_tokens_per_s(run) == 4.0


def test_the_written_result_has_vllms_keys_and_drops_the_lists_without_detail():
    run = hand_run()
    result = {"num_prompts": 3, "duration": 2.4, "completed": 3, "total_input_tokens": 30,
              "total_output_tokens": 9, "request_throughput": 1.25, "output_throughput": 3.75,
              "total_token_throughput": 16.25, "request_rate": "inf", "max_concurrency": 2,
              "model": "m", "mean_ttft_ms": 166.7, "decode_throughput": 9.0}
    brief = vllm_result(run, result)
    full = vllm_result(run, result, detailed=True)
    for key in ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id",
                "num_prompts", "request_rate", "burstiness", "max_concurrency", "failed",
                "request_goodput", "latencies", "queue_times", "max_output_tokens_per_s",
                "max_concurrent_requests", "rtfx", "mean_ttft_ms"):
        assert key in brief, key
    assert "input_lens" not in brief and "itls" not in brief
    assert full["itls"] == [[0.2, 0.2], [], [0.2] * 4] and full["output_lens"] == [3, 1, 5]
    assert brief["epsim"]["decode_throughput"] == 9.0 and "decode_throughput" not in brief


# --------------------------------------------------------------------------------------------
# The round trip: predict --save-result, validate --bench
# --------------------------------------------------------------------------------------------

TINY = ["--model", "tiny-deepseek", "--hardware", "mi300x", "--gpus-per-node", "2", "--dp", "2",
        "--ep", "2"]


@pytest.mark.parametrize("workload, detailed", [
    (["--dataset", "random", "--isl", "64", "--osl", "8", "--random-range-ratio", "0.5",
      "--num-prompts", "24", "--concurrency", "6", "--request-rate", "3000"], True),
    (["--isl", "48", "--osl", "6", "--num-prompts", "16", "--request-rate", "2000"], False),
])
def test_a_saved_prediction_validates_against_itself(epsim, tmp_path, workload, detailed):
    out = tmp_path / "result.json"
    saved = ["--save-result", str(out)] + (["--save-detailed"] if detailed else [])
    r = epsim("predict", *TINY, *workload, "--goodput", "ttft:1", "tpot:0.1", *saved)
    assert r.returncode == 0, r.stderr
    r = epsim("validate", "--bench", str(out), *TINY, "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    names = set(report["metrics"])
    assert {"duration", "request_goodput", "output_throughput", "max_concurrent_requests",
            "p99_ttft_ms", "median_tpot_ms", "mean_itl_ms", "p90_e2el_ms"} <= names
    for name, m in report["metrics"].items():
        assert m["error_pct"] is not None and abs(m["error_pct"]) < 1e-6, (name, m)
    assert report["workload"]["lengths"] == ("listed" if detailed else "mean of the totals")


def test_a_saved_trace_replay_validates_against_itself(epsim, tmp_path):
    # a request trace's arrivals: the file says its offered rate, the detail lists the arrivals
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"{0.01 * i:.2f},{40 + i},{3 + i % 4}\n" for i in range(12)))
    out = tmp_path / "result.json"
    r = epsim("predict", *TINY, "--dataset", "trace", "--dataset-path", str(trace),
              "--save-result", str(out), "--save-detailed")
    assert r.returncode == 0, r.stderr
    saved = json.loads(out.read_text())
    assert isinstance(saved["request_rate"], float)  # a number, as vLLM writes it
    r = epsim("validate", "--bench", str(out), *TINY, "--json")
    assert r.returncode == 0, r.stderr
    for name, m in json.loads(r.stdout)["metrics"].items():
        assert m["error_pct"] is not None and abs(m["error_pct"]) < 1e-6, (name, m)


@pytest.mark.parametrize("change", [{"failed": "x"}, {"epsim": {"seed": "abc"}}])
def test_bad_values_in_a_result_file_are_one_line(epsim, tmp_path, change):
    path = write(tmp_path, {**VLLM, "completed": 10, "num_prompts": 11, "failed": 1, **change})
    r = epsim("validate", "--bench", str(path), *TINY)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_validate_bench_errors_are_one_line(epsim, tmp_path):
    bad = write(tmp_path, {"hello": 1})
    for argv in (["validate", "--bench", str(bad), *TINY],
                 ["validate", "--bench", str(write(tmp_path, VLLM, "v.json"))],
                 ["validate"]):
        r = epsim(*argv)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("fixture, client", [("vllm-example.json", "vllm"),
                                             ("sglang-example.jsonl", "sglang")])
def test_the_committed_examples_validate_metric_by_metric(epsim, fixture, client):
    path = f"tests/data/bench/{fixture}"
    r = epsim("validate", "--bench", path, "--model", "deepseek-v3", "--hardware", "mi300x",
              "--dp", "8", "--ep", "8", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["format"] == client and report["workload"]["lengths"] == "mean of the totals"
    measured = read_bench_file(REPO / path).measured
    assert set(report["metrics"]) == set(measured)  # every metric the file has, nothing else
    for name, m in report["metrics"].items():
        assert set(m) == {"measured", "predicted", "error_pct"}
        assert m["measured"] == measured[name]
        assert m["error_pct"] == pytest.approx((m["predicted"] - m["measured"]) / m["measured"]
                                               * 100)
