"""Lossless ingestion: every key of a vLLM or SGLang result file is used or listed under
``ignored`` with why; wrong types are refused naming the key; JSON errors name the line and
column; Vidur's request-trace CSV is read and traces' lengths scale as Vidur scales them."""

import json
import math

import numpy as np
import pytest
from test_bench_results import SGLANG, VLLM, write

from epsim.cli import main
from epsim.model.bounds import parse_json
from epsim.model.errors import EpsimError
from epsim.sim.workload.bench_results import WORKLOAD_KEYS, parse_bench, read_bench_file
from epsim.sim.workload.traces import read_trace, scaled_lengths

R1 = ["--model", "deepseek-r1", "--hardware", "mi300x"]


def test_every_key_of_a_vllm_file_is_used_or_ignored_with_a_reason():
    b = parse_bench(VLLM)
    used = (set(b.measured) | WORKLOAD_KEYS) & set(VLLM)
    assert set(b.ignored) | used == set(VLLM) and not set(b.ignored) & used
    assert "latencies" in b.ignored and "*_e2el_ms" in b.ignored["latencies"]
    assert "rtfx" in b.ignored and "audio" in b.ignored["rtfx"]
    # queue_times alone (no start_times) cannot place arrivals: listed, not dropped
    assert "start_times" in b.ignored["queue_times"]
    assert b.ignored["request_goodput"] == "null: no value"
    assert b.ignored["date"] == "the run's metadata, not a measurement"
    assert b.measured["mean_ttft_ms"] == 250.0 and b.measured["total_token_throughput"] == 86.8


def test_sglang_total_throughput_is_compared_and_its_other_keys_listed():
    b = parse_bench({**SGLANG, "total_throughput": 1600.0, "max_itl_ms": 80.0,
                     "total_throughput_retokenized": 1599.0, "some_future_key": 3})
    assert b.measured["total_token_throughput"] == 1600.0
    assert b.measured["mean_e2el_ms"] == 20000.0  # SGLang's e2e_latency under vLLM's name
    assert "longest gap" in b.ignored["max_itl_ms"]
    assert "re-tokenized" in b.ignored["total_throughput_retokenized"]
    assert "not a key of sglang's result" in b.ignored["some_future_key"]
    assert "total_throughput" not in b.ignored and "mean_e2e_latency_ms" not in b.ignored


@pytest.mark.parametrize(("key", "value"), [
    ("request_goodput", "fast"), ("request_goodput", [1, 2]), ("mean_ttft_ms", "12"),
    ("output_throughput", {"a": 1}), ("p99_tpot_ms", True),
])
def test_a_metric_of_the_wrong_type_is_refused_naming_the_key(key, value):
    with pytest.raises(EpsimError, match=f"{key} must be a number"):
        parse_bench({**VLLM, key: value})


@pytest.mark.parametrize(("change", "match"), [
    ({"num_prompts": 10**15, "completed": 10**15}, r"completed 10{15} is outside \[1, 1e\+07\]"),
    ({"request_rate": 1e-300, "max_concurrency": None}, r"request_rate 1e-300 is outside"),
    ({"max_concurrency": 10**15}, r"max_concurrency 10{15} is outside"),
    ({"duration": "inf"}, r"duration inf is outside"),
    ({"epsim": {"goodput": ["ttft", 5]}}, "epsim.goodput must map each metric"),
    ({"epsim": {"goodput": {"ttft": "5"}}}, "epsim.goodput must map each metric"),
])
def test_absurd_workload_numbers_are_refused_before_any_allocation(change, match):
    with pytest.raises(EpsimError, match=match):
        parse_bench({**VLLM, **change})


def test_a_malformed_result_names_its_line_and_column(tmp_path):
    path = tmp_path / "r.json"
    path.write_text('{\n  "num_prompts": 10,\n  "duration": }\n')
    with pytest.raises(EpsimError, match="Expecting value at line 3 column 15"):
        read_bench_file(path)
    # one object per line: the file's line is named
    good = json.dumps(SGLANG)
    path.write_text(f"{good}\n{good}\n{good[:-1]}\n")
    with pytest.raises(EpsimError, match=r"r.json line 3: malformed result line \(.* at line 1 "
                                         r"column \d+\)"):
        read_bench_file(path)


def test_the_json_reader_bounds_nesting_and_digits():
    with pytest.raises(EpsimError, match="nested deeper than the reader allows"):
        parse_json("[" * 100_000 + "]" * 100_000, "f")
    with pytest.raises(EpsimError, match="an integer of 5000 digits"):
        parse_json('{"a": ' + "9" * 5000 + "}", "f")
    assert parse_json('{"ns": 1700000000000000000}', "f") == {"ns": 1700000000000000000}


def test_validate_bench_reports_the_ignored_keys(tmp_path, capsys):
    bench = write(tmp_path, VLLM)
    assert main(["validate", "--bench", str(bench), *R1, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ignored"]["latencies"].startswith("per-request E2E latencies")
    assert main(["validate", "--bench", str(bench), *R1]) == 0
    text = capsys.readouterr().out
    assert "rtfx" in text and "ignored: vLLM's real-time factor" in text


VIDUR = ("arrived_at,num_prefill_tokens,num_decode_tokens\n"
         "0.0,374,44\n4.314579,396,109\n4.541877,879,55\n")  # splitwise_conv.csv's first rows


def test_vidurs_processed_trace_is_read(tmp_path):
    path = tmp_path / "splitwise.csv"
    path.write_text(VIDUR)
    t = read_trace(str(path))
    assert t.input_lens.tolist() == [374, 396, 879] and t.output_lens.tolist() == [44, 109, 55]
    assert t.arrival_s.tolist() == [0.0, 4.314579, 4.541877]


def test_lengths_scale_as_vidurs_factors():
    lens = np.array([374, 396, 879, 1])
    assert scaled_lengths(lens, 0.5, "p").tolist() == [187, 198, 439, 1]  # truncated, >= 1
    assert scaled_lengths(lens, 0.001, "p").tolist() == [1, 1, 1, 1]
    assert scaled_lengths(lens, 1.0, "p") is lens
    with pytest.raises(EpsimError, match="over 16,777,216"):
        scaled_lengths(np.array([2**24]), 2.0, "a prompt")


def test_predict_replays_a_scaled_vidur_trace(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "v.csv").write_text(VIDUR)
    argv = ["predict", *R1, "--dataset", "trace", "--dataset-path", "v.csv", "--json"]
    assert main([*argv, "--length-scale", "2", "--prefill-scale", "0.25"]) == 0
    r = json.loads(capsys.readouterr().out)
    # prompts x 0.5: 187 + 198 + 439; outputs x 2: 88 + 218 + 110
    assert (r["prefill_scale"], r["decode_scale"]) == (0.5, 2.0)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (824, 416)
    assert main(["predict", *R1, "--isl", "10", "--osl", "10", "--length-scale", "0.5"]) == 2
    assert "use them with --dataset trace" in capsys.readouterr().err


@pytest.mark.parametrize(("body", "match"), [
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,5,5\n5,5,5\n",
     "row 3: TIMESTAMP '5' mixes kinds: row 2 is a date-time"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n0,99999999999999999999,5\n",
     "ContextTokens is 99999999999999999999; a request has 1 to 16,777,216"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n0," + "9" * 5000 + ",5\n", "not a whole number"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n0," + "1" * 200_000 + ",5\n",
     "line 2: not a CSV row"),
    ("arrived_at,num_prefill_tokens\n0,5\n", "lacks column.s. num_decode_tokens"),
])
def test_a_hostile_trace_is_one_error(tmp_path, body, match):
    path = tmp_path / "t.csv"
    path.write_text(body)
    with pytest.raises(EpsimError, match=match):
        read_trace(str(path))


def test_no_infinity_reaches_json(tmp_path, capsys, monkeypatch):
    from epsim.sim.replay import error_pct

    assert error_pct(1e-320, 5.0) is None and error_pct(4.0, 5.0) == 25.0
    monkeypatch.chdir(tmp_path)
    (tmp_path / "once.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,100,10\n"
                                       "0,100,10\n")
    assert main(["predict", *R1, "--dataset", "trace", "--dataset-path", "once.csv",
                 "--json"]) == 0
    text = capsys.readouterr().out
    assert json.loads(text)["trace_arrival_rate"] == "inf" and "Infinity" not in text


def test_a_quantization_config_that_is_not_an_object_is_one_error():
    from importlib import resources

    from epsim.model.config import model_from_hf_config

    cfg = json.loads((resources.files("epsim.model") / "configs" / "deepseek-r1.json").read_text())
    with pytest.raises(EpsimError, match="quantization_config must be an object, got 0.5"):
        model_from_hf_config({**cfg, "quantization_config": 0.5})


def _mi300x():
    from importlib import resources

    return json.loads((resources.files("epsim.sim.hardware") / "profiles" / "mi300x.json")
                      .read_text())


@pytest.mark.parametrize(("change", "match"), [
    (lambda p: p["efficiency"].update(link_bandwidth_usable=1e-320),
     r"link_bandwidth_usable must be a positive number in \[1e-12, 1e\+30\]"),
    (lambda p: p["efficiency"].update(attention_split_tokens=0.5),
     "attention_split_tokens must be a whole number"),
    # a dispatch table's point [tokens, ranks, hidden, us, source] with half a rank
    (lambda p: p["kernels"]["sets"]["aiter"]["tables"][2]["points"][0].__setitem__(1, 0.5),
     "ranks must be a whole number"),
    (lambda p: p["kernels"]["sets"]["aiter"]["tables"][2]["points"][0].__setitem__(3, 1e300),
     r"time must be a positive number in \[1e-12, 1e\+30\]"),
])
def test_a_profile_number_past_its_bounds_is_one_error(change, match):
    from epsim.sim.hardware.profile import profile_from_dict

    profile = _mi300x()
    change(profile)
    with pytest.raises(EpsimError, match=match):
        profile_from_dict(profile, "p.json")


def test_a_kineto_event_of_non_finite_time_or_odd_category_is_skipped():
    from epsim.calibrate.kineto import parse_trace

    good = {"cat": "kernel", "name": "k", "ts": 1.0, "dur": 2.0, "pid": 0, "tid": 7,
            "args": {"correlation": 1}}
    trace = parse_trace({"traceEvents": [good, {**good, "dur": math.nan},
                                         {**good, "ts": math.inf}, {**good, "cat": ["kernel"]}]})
    assert [(k.ts_us, k.dur_us) for k in trace.kernels] == [(1.0, 2.0)]


def test_llama4s_nested_text_config_is_bounded_too():
    from importlib import resources

    from epsim.model.config import model_from_hf_config

    cfg = json.loads((resources.files("epsim.model") / "configs" / "llama-4-scout-17b-16e.json")
                     .read_text())
    text = {**cfg["text_config"], "num_local_experts": 10**12}
    with pytest.raises(EpsimError, match="text_config: num_local_experts 1000000000000 is "
                                         "outside"):
        model_from_hf_config({**cfg, "text_config": text})
