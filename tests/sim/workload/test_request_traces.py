"""--dataset trace: a request trace's arrival times and lengths, replayed (hand-written CSVs; the
shipped Azure traces only through the package)."""

import json
from importlib import resources

import numpy as np
import pytest

from epsim.model.errors import EpsimError
from epsim.sim.workload.spec import WorkloadSpec, sample_requests
from epsim.sim.workload.traces import arrival_rate, read_trace, shipped_traces

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
#: four requests: 0 s, 1.5 s, 1.5 s, 4 s
ROWS = ("2023-11-16 18:15:46.0000000,100,10\n2023-11-16 18:15:47.5000000,200,20\n"
        "2023-11-16 18:15:47.5000000,300,30\n2023-11-16 18:15:50.0000000,400,40\n")


def _csv(tmp_path, text, name="t.csv"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _spec(path, **kw):
    return WorkloadSpec(dataset="trace", dataset_path=path, **kw)


def test_timestamps_become_seconds_since_the_first_row(tmp_path):
    t = read_trace(_csv(tmp_path, HEADER + ROWS))
    assert t.arrival_s.tolist() == [0.0, 1.5, 1.5, 4.0]
    assert t.input_lens.tolist() == [100, 200, 300, 400]
    assert t.output_lens.tolist() == [10, 20, 30, 40]
    # seconds as plain numbers, extra columns and column order do not matter
    t = read_trace(_csv(tmp_path, "id,GeneratedTokens,TIMESTAMP,ContextTokens\n"
                        "a,5,10.0,7\nb,6,12.5,8\n", "n.csv"))
    assert t.arrival_s.tolist() == [0.0, 2.5] and t.input_lens.tolist() == [7, 8]
    assert t.output_lens.tolist() == [5, 6]


def test_num_prompts_takes_the_first_rows_and_time_scale_stretches(tmp_path):
    path = _csv(tmp_path, HEADER + ROWS)
    every = sample_requests(_spec(path, num_prompts=None))
    assert len(every) == 4 and every.issue_times_s.tolist() == [0.0, 1.5, 1.5, 4.0]
    head = sample_requests(_spec(path, num_prompts=2, time_scale=0.5))
    assert head.input_lens.tolist() == [100, 200]
    assert head.issue_times_s.tolist() == [0.0, 0.75]
    # 3 gaps over 4 s; at scale 0.5 over 2 s: twice the rate
    assert arrival_rate(every.issue_times_s) == 0.75
    assert arrival_rate(sample_requests(_spec(path, num_prompts=None, time_scale=0.5))
                        .issue_times_s) == 1.5
    with pytest.raises(EpsimError, match="has 4 requests; --num-prompts 5 asks for more"):
        sample_requests(_spec(path, num_prompts=5))


@pytest.mark.parametrize("text, message", [
    ("TIMESTAMP,ContextTokens\n0,1\n", "lacks column"),
    (HEADER + "0,10,5\n2,10,1\n1,10,1\n", "row 4 .* is before row 3"),
    (HEADER + "0,10,5\n1,10,-3\n", "row 3: GeneratedTokens is -3"),
    (HEADER + "0,-1,5\n", "row 2: ContextTokens is -1"),
    (HEADER + "0,1.5,5\n", "not a whole number"),
    (HEADER + "yesterday,1,5\n", "neither a date-time nor a number"),
    (HEADER, "no requests"),
    ("", "empty request trace"),
])
def test_a_bad_trace_is_one_error(tmp_path, text, message):
    with pytest.raises(EpsimError, match=message):
        read_trace(_csv(tmp_path, text))


@pytest.mark.parametrize("kw, message", [
    ({"request_rate": 4.0}, "its own arrival times"),
    ({"burstiness": 2.0}, "its own arrival times"),
    ({"isl": 100}, "drop --isl"),
    ({"osl": 100}, "drop --osl"),
])
def test_flags_a_trace_replaces_are_refused(tmp_path, kw, message):
    with pytest.raises(EpsimError, match=message):
        _spec(_csv(tmp_path, HEADER + ROWS), **kw).validate()


def test_time_scale_and_a_missing_path_outside_a_trace_are_refused():
    with pytest.raises(EpsimError, match="--time-scale"):
        WorkloadSpec(dataset="fixed", isl=1, osl=1, time_scale=0.5).validate()
    with pytest.raises(EpsimError, match="needs --dataset-path"):
        WorkloadSpec(dataset="trace").validate()
    with pytest.raises(EpsimError, match="use it with --dataset trace"):
        WorkloadSpec(dataset="sharegpt-like", dataset_path="azure-conv").validate()


def test_the_shipped_traces_come_with_their_license():
    assert shipped_traces() == ["azure-code", "azure-conv"]
    conv, code = read_trace("azure-conv"), read_trace("azure-code")
    assert (len(conv), len(code)) == (19366, 8819)
    for t in (conv, code):
        assert t.arrival_s[0] == 0.0 and (np.diff(t.arrival_s) >= 0).all()
        assert 3000 < t.arrival_s[-1] < 3600  # about one hour
        assert t.input_lens.min() >= 1 and t.output_lens.min() >= 1
    folder = resources.files("epsim.model") / "data" / "traces" / "azure-llm-2023"
    assert "Attribution" in (folder / "LICENSE").read_text()
    assert "Splitwise" in (folder / "README.md").read_text()


def _predict(epsim, path, *extra):
    res = epsim("predict", "--model", "tiny-deepseek", "--hardware", "mi300x", "--dataset",
                "trace", "--dataset-path", path, "--json", *extra)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_predict_replays_a_trace_and_time_scale_doubles_the_rate(tmp_path, epsim):
    path = _csv(tmp_path, HEADER + ROWS)
    one = _predict(epsim, path)
    half = _predict(epsim, path, "--time-scale", "0.5", "--concurrency", "2")
    assert one["completed"] == 4 and one["total_input_tokens"] == 1000
    assert one["request_rate"] == "trace" and one["trace_arrival_rate"] == 0.75
    assert half["trace_arrival_rate"] == 1.5 and half["time_scale"] == 0.5
    assert half["max_concurrency"] == 2 and one["max_concurrency"] is None


def test_a_bad_trace_on_the_command_line_is_one_line_exit_2(tmp_path, epsim):
    res = epsim("predict", "--model", "tiny-deepseek", "--hardware", "mi300x", "--dataset",
                "trace", "--dataset-path", _csv(tmp_path, HEADER + "0,10,5\n1,10,-3\n"), "--json")
    assert res.returncode == 2 and res.stdout == ""
    assert len(res.stderr.strip().splitlines()) == 1 and "GeneratedTokens is -3" in res.stderr
