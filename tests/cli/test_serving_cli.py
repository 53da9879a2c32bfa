"""The serving commands end to end, with the real step simulator (small scenarios, plus the
issue's acceptance command)."""

import csv
import json

import pytest

R1 = ["--model", "deepseek-r1", "--hardware", "mi300x"]
SMALL = R1 + ["--isl", "256", "--osl", "8"]

#: the keys docs/design.md section 3 promises
KEYS = ("output_throughput", "total_token_throughput", "request_throughput", "mean_ttft_ms",
        "median_ttft_ms", "p90_ttft_ms", "mean_itl_ms", "median_itl_ms", "p10_itl_ms",
        "p25_itl_ms", "p75_itl_ms", "p90_itl_ms", "mean_tpot_ms", "mean_e2el_ms",
        "median_e2el_ms", "decode_throughput", "mean_decode_step_ms", "step_breakdown_ms",
        "expert_imbalance", "kv_cache_usage", "sim_wall_s", "completed", "num_prompts")


def _json(res):
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_acceptance_command_prints_every_key(epsim):
    out = _json(epsim("predict", *R1, "--dp", "8", "--ep", "8", "--concurrency", "4096",
                      "--num-prompts", "4096", "--isl", "2000", "--osl", "100", "--json"))
    for key in KEYS:
        assert key in out, key
    assert out["completed"] == out["num_prompts"] == 4096
    assert out["total_output_tokens"] == 4096 * 100
    assert set(out["step_breakdown_ms"]) >= {"attention", "moe_experts"}
    assert out["max_running_per_rank"] == 512  # 4096 over 8 dp ranks, all fit in FP8 KV


def test_same_seed_same_json(epsim):
    argv = ["predict", *R1, "--dataset", "random", "--isl", "300", "--osl", "12",
            "--random-range-ratio", "0.5", "--request-rate", "50", "--num-prompts", "80",
            "--seed", "7", "--json"]
    a, b = _json(epsim(*argv)), _json(epsim(*argv))
    a.pop("sim_wall_s"), b.pop("sim_wall_s")
    assert a == b
    c = _json(epsim(*argv[:-3], "--seed", "8", "--json"))
    c.pop("sim_wall_s")
    assert c != a


def test_predict_text_and_trace(epsim, tmp_path):
    trace = tmp_path / "serve.json"
    res = epsim("predict", *SMALL, "--concurrency", "32", "--trace", str(trace))
    assert res.returncode == 0, res.stderr
    assert "Output token throughput (tok/s):" in res.stdout
    assert "decode_throughput:" in res.stdout
    ev = json.loads(trace.read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["name"] == "process_name"}
    assert sorted(procs.values()) == ["ranks", "requests"]
    ranks = [e for e in ev if e["ph"] == "X" and procs[e["pid"]] == "ranks"]
    assert {e["tid"] for e in ranks} == set(range(8))  # one track per dp rank
    assert {e["name"] for e in ranks} == {"prefill", "decode"}
    requests = [e for e in ev if e["ph"] == "X" and procs[e["pid"]] == "requests"]
    assert sorted(e["args"]["request"] for e in requests) == list(range(32))
    assert {(e["name"], k) for e in ev if e["ph"] == "C" and procs[e["pid"]] == "requests"
            for k in e["args"]} == {
        ("requests", "running"), ("requests", "queued"), ("KV cache", "use")}
    # and per rank, on the ranks' process
    assert {(e["name"], k) for e in ev if e["ph"] == "C" and procs[e["pid"]] == "ranks"
            for k in e["args"]} == {
        (f"rank {r} {name}", k) for r in range(8)
        for name, k in (("requests", "running"), ("requests", "queued"), ("KV cache", "use"))}


def test_sweep_throughput_and_itl_rise_with_concurrency(epsim, tmp_path):
    out_csv, out_png = tmp_path / "s.csv", tmp_path / "s.png"
    res = _json(epsim("sweep", *SMALL, "--concurrency", "64,256,1024", "--csv", str(out_csv),
                      "--plot", str(out_png), "--json"))
    rows = res["results"]
    assert [r["max_concurrency"] for r in rows] == [64, 256, 1024]
    dec = [r["decode_throughput"] for r in rows]
    itl = [r["median_itl_ms"] for r in rows]
    assert dec[0] < dec[1] < dec[2] and itl[0] < itl[1] < itl[2]
    with out_csv.open() as f:
        table = list(csv.DictReader(f))
    assert [int(r["max_concurrency"]) for r in table] == [64, 256, 1024]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tune_and_plan_commands(epsim):
    tuned = _json(epsim("tune", *SMALL, "--concurrency", "32,128", "--dbo", "on",
                        "--slo", "median_itl_ms<=1000", "--json"))
    assert len(tuned["points"]) == 2 and tuned["best"]["concurrency"] == 128
    assert tuned["frontier"]
    plan = _json(epsim("plan", *SMALL, "--concurrency", "128", "--dbo", "on",
                       "--slo", "median_itl_ms<=1000", "--target-output-throughput", "100000",
                       "--gpu-hour-usd", "2", "--json"))
    p = plan["plans"][0]
    assert p["nodes"] * p["per_node_output_throughput"] >= 100000
    assert (p["nodes"] - 1) * p["per_node_output_throughput"] < 100000
    assert p["cost_per_hour_usd"] == pytest.approx(p["gpus"] * 2)


def test_no_feasible_slo_is_one_line(epsim):
    res = epsim("plan", *SMALL, "--concurrency", "32", "--dbo", "on",
                "--slo", "median_itl_ms<=0.01", "--target-output-throughput", "1000")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "meets the SLO" in res.stderr


@pytest.mark.parametrize("argv, message", [
    (["tune", "--isl", "abc", "--osl", "100"], "--isl/--random-input-len/--random-input: expected an integer in [1, 2**24], got 'abc'"),
    (["tune", "--isl", "100", "--osl", "100", "--request-rate", "-3"],
     "--request-rate: expected a number in [1e-06, 1e+09] or inf, got '-3'"),
    (["plan", "--isl", "100,200", "--osl", "100", "--target-output-throughput", "1000"],
     "--isl takes one value here"),
])
def test_search_commands_reject_bad_lengths_and_rates_in_one_line(epsim, argv, message):
    r = epsim(*argv, "--model", "deepseek-r1", "--hardware", "mi300x",
              "--slo", "median_itl_ms<=100")
    assert r.returncode == 2
    assert message in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("argv, message", [
    (["predict", "--isl", "200000", "--osl", "100"], "--isl 200000 + --osl 100: 200100 tokens"),
    (["sweep", "--isl", "1000,163800", "--osl", "100"], "--isl 163800 + --osl 100: 163900 tokens"),
    (["predict", "--dataset", "random", "--isl", "110000", "--osl", "100",
      "--random-range-ratio", "0.5"], "165150 tokens"),  # 110000 * 1.5 + 100 * 1.5
])
def test_requests_beyond_the_context_are_one_line(epsim, argv, message):
    r = epsim(*argv, *R1, "--num-prompts", "4", "--json")
    assert r.returncode == 2 and r.stdout == ""
    assert message in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "deepseek-r1's context of 163840 tokens (max_position_embeddings" in r.stderr


def _flat_keys(obj, prefix=""):
    for key, value in obj.items():
        if isinstance(value, dict):
            yield from _flat_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def test_sweep_csv_has_every_json_key_at_full_precision(epsim, tmp_path):
    out_csv = tmp_path / "s.csv"
    rows = _json(epsim("sweep", *SMALL, "--concurrency", "16,32", "--csv", str(out_csv),
                       "--json"))["results"]
    with out_csv.open() as f:
        header, *lines = list(csv.reader(f))
    assert header == list(_flat_keys(rows[0]))  # every key, in the JSON's order
    assert len(header) == len(set(header)) > 76  # 76 keys, step_breakdown_ms spread out
    assert {"model", "hardware", "nodes", "dp", "tp", "ep", "dbo", "eplb", "graph",
            "step_breakdown_ms.attention", "step_breakdown_ms.moe_experts"} <= set(header)
    table = [dict(zip(header, line, strict=True)) for line in lines]
    for row, cells in zip(rows, table, strict=True):
        # floats read back exactly (no rounding to 2 decimals)
        assert float(cells["median_itl_ms"]) == row["median_itl_ms"]
        assert round(row["median_itl_ms"], 2) != row["median_itl_ms"]  # so rounding would show
        assert float(cells["step_breakdown_ms.attention"]) == row["step_breakdown_ms"]["attention"]
        assert cells["dbo"] == "false" and cells["disagg"] == "" and cells["model"] == "deepseek-r1"


def test_plan_names_the_context_limit_not_the_slo(epsim):
    r = epsim("plan", *R1, "--isl", "200000", "--osl", "100", "--concurrency", "8",
              "--num-prompts", "8", "--slo", "median_itl_ms<=100",
              "--target-output-throughput", "1000")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "200100 tokens exceed deepseek-r1's context of 163840 tokens" in r.stderr


@pytest.mark.parametrize("target", ["folder", "folder/inside/x.csv"])
def test_an_output_that_cannot_be_written_is_one_line(epsim, tmp_path, target):
    (tmp_path / "folder").mkdir()
    r = epsim("sweep", *R1, "--concurrency", "8", "--num-prompts", "8", "--isl", "100",
              "--osl", "10", "--csv", str(tmp_path / target))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "cannot write" in r.stderr and (tmp_path / "folder").is_dir()
