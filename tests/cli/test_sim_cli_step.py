"""``epsim step`` as a user runs it."""

import json

ARGS = ["step", "--model", "deepseek-r1", "--hardware", "mi300x", "--dp", "8", "--ep", "8",
        "--batch", "512", "--context", "2100"]


def test_step_json_has_the_documented_keys(epsim):
    r = epsim(*ARGS, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # exactly one JSON object
    assert {"step_ms", "breakdown_ms", "exposed_comm_ms", "expert_imbalance"} <= set(out)
    assert set(out["breakdown_ms"]) >= {"attention", "moe_experts", "dispatch", "combine",
                                        "dense", "other", "launch"}
    assert abs(sum(out["breakdown_ms"].values()) - out["step_ms"]) < 1e-6 * out["step_ms"]
    # a step has no engine: one microbatch unless --dbo (vLLM and SGLang run without it)
    assert not out["plan"]["dbo"] and out["plan"]["graph"] and out["plan"]["kv_dtype"] == "fp8"
    dbo = json.loads(epsim(*ARGS, "--dbo", "--json").stdout)
    assert dbo["plan"]["dbo"] and dbo["step_ms"] != out["step_ms"]
    both = epsim(*ARGS, "--dbo", "--no-dbo")
    assert both.returncode == 2 and len(both.stderr.strip().splitlines()) == 1


def test_step_trace_is_chrome_trace_json(epsim, tmp_path):
    path = tmp_path / "trace.json"
    r = epsim(*ARGS[:-4], "--batch", "16", "--context", "512", "--trace", str(path),
              "--mode", "exact", "--dbo")
    assert r.returncode == 0, r.stderr
    assert "trace" in r.stdout and "step" in r.stdout
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == set(range(8))
    assert {e["tid"] for e in events} == {0, 1}  # compute and comm streams
    assert {e["args"]["microbatch"] for e in events} == {0, 1}
    assert all(e["dur"] >= 0 for e in events)
    names = {m["args"]["name"] for m in trace["traceEvents"] if m["ph"] == "M"}
    assert {"rank 0", "compute", "comm"} <= names


def test_step_flags_and_real_loads(epsim):
    real = "decode_in2000out100"
    r = epsim(*ARGS, "--loads", real, "--no-eplb", "--no-dbo", "--no-graph", "--kv-dtype",
              "bf16", "--mem-fraction", "0.95", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert 1.7 <= out["expert_imbalance"] <= 2.1
    assert not out["plan"]["dbo"] and not out["plan"]["graph"] and not out["plan"]["eplb"]


def test_step_errors_are_one_line(epsim, tmp_path):
    bad = tmp_path / "loads.json"
    bad.write_text("{")
    cases = [
        (["--hardware", "b200"], "unknown hardware"),
        (["--batch", "4096"], "KV cache"),
        (["--kv-dtype", "bf16"], "75.6 GB of KV cache per GPU, only 67.7 GB fit"),
        (["--loads", str(bad)], "malformed JSON"),
        (["--ep", "3"], "ep 3"),
    ]
    for extra, message in cases:
        args = list(ARGS)
        for i in range(0, len(extra), 2):
            flag = extra[i]
            if flag in args:
                args[args.index(flag) + 1] = extra[i + 1]
            else:
                args += extra[i:i + 2]
        r = epsim(*args)
        assert r.returncode == 2, (extra, r.stderr)
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert r.stdout == ""


def test_step_runs_without_torch():
    from test_without_torch import run_without_torch
    r = run_without_torch(*ARGS[:-4], "--batch", "32", "--context", "1000", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step_ms"] > 0


def test_step_context_beyond_the_model_is_one_line(epsim):
    r = epsim(*ARGS[:-2], "--context", "163841", "--json")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "--context 163841" in r.stderr and "max_position_embeddings" in r.stderr
    assert "163840" in r.stderr
