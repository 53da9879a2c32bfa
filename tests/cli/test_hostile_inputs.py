"""Hostile inputs over every file the CLI reads, property-based (issue 31, deliver 9): each class
of docs/inputs.md drawn by hypothesis, each draw run through ``epsim.cli.main`` in this process,
and each must be refused in one line on stderr with exit status 2, nothing on stdout, and no
file created or changed in the working folder or in ``$TMPDIR`` (a fresh folder here).

The module's fixture prints the tally, class x tried/refused, when the file is done
(``pytest -s`` shows it). ``EPSIM_HOSTILE_EXAMPLES=N`` draws N of each class (default 30)."""

import collections
import contextlib
import io
import json
import os
import string
import tempfile
from importlib import resources
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim.workload.test_bench_results import VLLM

from epsim.calibrate.validate import GRID_BOUNDS
from epsim.cli import main
from epsim.model.bounds import (
    CONFIG_BOUNDS,
    MAX_CONCURRENCY,
    MAX_CSV_FIELD,
    MAX_EXPERTS,
    MAX_ID,
    MAX_LAYERS,
    MAX_PROMPTS,
    MAX_TOKENS,
    MIN_BURSTINESS,
    MIN_REQUEST_RATE,
)

R1 = ["--model", "deepseek-r1", "--hardware", "mi300x"]
#: each file the CLI reads: its file name and the command line that reads it
TARGETS = {
    "config.json": ("c.json", lambda f: ["describe", "--model", f]),
    "profile": ("p.json", lambda f: ["step", "--model", "deepseek-r1", "--hardware", f,
                                     "--batch", "8", "--context", "64"]),
    "load file": ("loads.json", lambda f: ["balance", "--loads", f, "--gpus", "8"]),
    "placement": ("place.json", lambda f: ["balance", "--loads", "decode_in2000out100",
                                           "--gpus", "8", "--previous", f]),
    "result (validate)": ("r.json", lambda f: ["validate", "--bench", f, *R1]),
    "result (calibrate)": ("r.json", lambda f: ["calibrate", "--from-bench", f, *R1, "--out",
                                                "fitted.json"]),
    "sharegpt": ("share.json", lambda f: ["predict", *R1, "--dataset", "sharegpt-like",
                                          "--dataset-path", f, "--num-prompts", "4"]),
    "kineto trace": ("trace.json", lambda f: ["calibrate", "--from-trace", f]),
    "grid": ("grid.json", lambda f: ["validate", "--profile", "mi300x", "--grid", f]),
    "request trace": ("t.csv", lambda f: ["predict", *R1, "--dataset", "trace",
                                          "--dataset-path", f]),
}
JSON_TARGETS = sorted(k for k, (name, _) in TARGETS.items() if name.endswith(".json"))
#: class -> [tried, refused]
TALLY: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
#: draws per class (EPSIM_HOSTILE_EXAMPLES: more, for a longer hunt)
FAST = settings(max_examples=int(os.environ.get("EPSIM_HOSTILE_EXAMPLES", "30")), deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """A work folder per draw under ``base/work``; ``$TMPDIR`` a fresh ``base/tmp``; a valid
    placement (``balance --out``) to mutate."""
    base = tmp_path_factory.mktemp("hostile")
    (base / "tmp").mkdir()
    (base / "work").mkdir()
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = str(base / "tmp"), str(base / "tmp")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["balance", "--loads", "decode_in2000out100", "--gpus", "8", "--out",
                     str(base / "placement.json")]) == 0
    yield base
    print("\nhostile inputs: class, tried, refused")
    for cls, (tried, ok) in sorted(TALLY.items()):
        print(f"  {cls:<20} {tried:>5} {ok:>8}")
    tempfile.tempdir = saved[1]
    if saved[0] is None:
        os.environ.pop("TMPDIR")
    else:
        os.environ["TMPDIR"] = saved[0]


def _state(folder: Path) -> set[tuple[str, int, int]]:
    return {(str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*")}


def refused(sandbox: Path, cls: str, target: str, content: str | bytes,
            *match: str) -> None:
    """``target``'s command on a file holding ``content``: one line, exit 2, nothing written."""
    name, argv = TARGETS[target]
    work = Path(tempfile.mkdtemp(dir=sandbox / "work"))
    (work / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    run(sandbox, cls, work, argv(name), *match)


def run(sandbox: Path, cls: str, work: Path, argv: list[str], *match: str) -> None:
    TALLY[cls][0] += 1
    before, tmp_before = _state(work), _state(sandbox / "tmp")
    out, err, cwd = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(work)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(argv)
            except SystemExit as exc:
                status = exc.code
    finally:
        os.chdir(cwd)
    text = err.getvalue()
    assert status == 2, (cls, argv, text[:300])
    assert text.count("\n") == 1 and text.endswith("\n") and "Traceback" not in text, text
    assert all(m in text for m in match), (match, text)
    assert out.getvalue() == ""
    assert _state(work) == before and _state(sandbox / "tmp") == tmp_before
    TALLY[cls][1] += 1


# --------------------------------------------------------------------------------------------
# Every JSON file: nesting, digits, malformed text
# --------------------------------------------------------------------------------------------


@FAST
@given(target=st.sampled_from(JSON_TARGETS), depth=st.integers(5000, 100_000),
       opener=st.sampled_from(["[", '{"a":']))
def test_json_nested_past_the_readers_limit(sandbox, target, depth, opener):
    """The parser's limit is Python's recursion limit (1,000; hypothesis raises it to ~2,048)."""
    closer = "]" if opener == "[" else "}"
    refused(sandbox, "json nesting", target, opener * depth + "1" + closer * depth,
            "nested deeper than the reader allows")


@FAST
@given(target=st.sampled_from(JSON_TARGETS), digits=st.integers(21, 20_000))
def test_json_integers_past_the_digit_bound(sandbox, target, digits):
    refused(sandbox, "json digits", target, '{"logical_count": ' + "7" * digits + "}",
            f"an integer of {digits} digits")


@FAST
@given(target=st.sampled_from(JSON_TARGETS), data=st.data())
def test_malformed_json_names_line_and_column(sandbox, target, data):
    doc = json.dumps({"a": [1, 2.5, {"b": "c"}], "d": None, "e": "x" * 20}, indent=1)
    cut = data.draw(st.integers(1, len(doc) - 1))
    refused(sandbox, "json malformed", target, doc[:cut], "at line ", " column ")


# --------------------------------------------------------------------------------------------
# Counts and sizes in each kind of file
# --------------------------------------------------------------------------------------------


def bad_count(low: int, high: int) -> st.SearchStrategy:
    """Values no count in [low, high] may take: past either end, non-finite, fractional, text."""
    return st.one_of(st.integers(high + 1, 10**19), st.integers(-10**19, low - 1),
                     st.sampled_from([float("inf"), float("-inf"), float("nan")]),
                     st.integers(low, min(high, 10**6)).map(lambda v: v + 0.5),
                     st.text(string.digits, min_size=1, max_size=6), st.just([1, 2]))


CONFIG = json.loads((resources.files("epsim.model") / "configs" / "deepseek-r1.json").read_text())


@FAST
@given(data=st.data(), key=st.sampled_from(sorted(CONFIG_BOUNDS)))
def test_config_counts_out_of_bounds(sandbox, data, key):
    value = data.draw(bad_count(*CONFIG_BOUNDS[key]))
    refused(sandbox, "config.json counts", "config.json", json.dumps({**CONFIG, key: value}),
            key)


PROFILE = json.loads((resources.files("epsim.sim.hardware") / "profiles" / "mi300x.json")
                     .read_text())


@FAST
@given(data=st.data(), key=st.sampled_from(["compute_units", "gpus_per_node", "hbm_bandwidth",
                                            "hbm_bytes", "nic_bandwidth_per_gpu",
                                            "kernel_launch_s"]))
def test_profile_numbers_out_of_bounds(sandbox, data, key):
    if key in ("compute_units", "gpus_per_node"):
        value = data.draw(st.one_of(bad_count(1, MAX_ID), st.floats(0.01, 0.99)))
    else:
        value = data.draw(st.one_of(st.floats(1.01e30, 1e300), st.integers(10**21, 10**40),
                                    st.floats(-1e30, 0.0), st.floats(5e-324, 9.9e-13),
                                    st.just("fast")))
    refused(sandbox, "profile numbers", "profile", json.dumps({**PROFILE, key: value}),
            "p.json")


@FAST
@given(data=st.data(), field=st.sampled_from(["id", "num_logical", "num_gpus"]))
def test_placement_ids_and_counts_out_of_bounds(sandbox, data, field):
    placement = json.loads((sandbox / "placement.json").read_text())
    if field == "id":
        table = placement["physical_to_logical"]
        table[data.draw(st.integers(0, len(table) - 1))][0] = data.draw(st.one_of(
            st.integers(placement["num_logical"], 10**19), st.integers(-10**19, -1),
            st.just(7.5)))
    else:
        placement[field] = data.draw(bad_count(1, MAX_EXPERTS if field == "num_logical"
                                               else MAX_ID))
    refused(sandbox, "placement ids", "placement", json.dumps(placement))


@FAST
@given(data=st.data(), key=st.sampled_from(sorted(GRID_BOUNDS)))
def test_grid_counts_out_of_bounds(sandbox, data, key):
    case = {"model": "tiny-deepseek", "world_size": 2, "batch": 2, "context": 8}
    case[key] = data.draw(bad_count(1, GRID_BOUNDS[key]))
    refused(sandbox, "grid counts", "grid", json.dumps([case]), key)


@FAST
@given(shape=st.one_of(st.tuples(st.just(1), st.integers(MAX_EXPERTS + 1, MAX_EXPERTS + 4000)),
                       st.tuples(st.integers(MAX_LAYERS + 1, MAX_LAYERS + 100), st.just(2))))
def test_a_load_file_too_wide_or_deep(sandbox, shape):
    layers, experts = shape
    rows = [[1] * experts for _ in range(layers)]
    refused(sandbox, "load file size", "load file", json.dumps({"logical_count": rows}),
            "experts" if layers == 1 else "logical_count's layers")


def _trace(header: str, rows: list[tuple[str, str, str]]) -> str:
    return header + "\n" + "".join(f"{a},{b},{c}\n" for a, b, c in rows)


@FAST
@given(data=st.data(), header=st.sampled_from(["TIMESTAMP,ContextTokens,GeneratedTokens",
                                               "arrived_at,num_prefill_tokens,num_decode_tokens"]),
       kind=st.sampled_from(["huge", "long field", "mixed", "not a number", "zero", "decreasing"]))
def test_hostile_request_traces(sandbox, data, header, kind):
    good = ("0", "100", "10")
    if kind == "huge":
        big = data.draw(st.one_of(st.integers(MAX_TOKENS + 1, 10**30).map(str),
                                  st.integers(21, 6000).map(lambda n: "9" * n)))
        rows = [good, ("1", big, "5")]
    elif kind == "long field":
        rows = [good, ("1", "5" * data.draw(st.integers(MAX_CSV_FIELD + 1, 3 * MAX_CSV_FIELD)),
                       "5")]
    elif kind == "mixed":
        rows = [good, ("2023-11-16 18:15:46", "5", "5")]
    elif kind == "not a number":
        rows = [good, ("1", data.draw(st.text(string.ascii_letters, min_size=1, max_size=8)),
                       "5")]
    elif kind == "zero":
        rows = [good, ("1", "5", str(data.draw(st.integers(-10**6, 0))))]
    else:
        rows = [("5", "5", "5"), (str(data.draw(st.integers(0, 4))), "5", "5")]
    refused(sandbox, "request trace", "request trace", _trace(header, rows))


@FAST
@given(data=st.data(), target=st.sampled_from(["result (validate)", "result (calibrate)"]),
       kind=st.sampled_from(["prompts", "rate", "concurrency", "goodput", "metric"]))
def test_hostile_result_files(sandbox, data, target, kind):
    result = dict(VLLM)
    if kind == "prompts":
        n = data.draw(st.integers(MAX_PROMPTS + 1, 10**18))
        result.update(num_prompts=n, completed=n)
    elif kind == "rate":
        result.update(request_rate=data.draw(st.floats(5e-324, MIN_REQUEST_RATE * 0.99)),
                      max_concurrency=None)
    elif kind == "concurrency":
        result["max_concurrency"] = data.draw(st.integers(MAX_CONCURRENCY + 1, 10**18))
    elif kind == "goodput":
        result["request_goodput"] = data.draw(st.one_of(st.text(min_size=1, max_size=5),
                                                        st.lists(st.integers(), max_size=3)))
    else:
        result[data.draw(st.sampled_from(["mean_ttft_ms", "p99_tpot_ms", "output_throughput"]))] = \
            data.draw(st.one_of(st.text(max_size=5), st.just({"a": 1})))
    refused(sandbox, "result file", target, json.dumps(result))


SLO = ["--slo", "median_itl_ms<=100", "--workers", "2"]
SEARCHES = {
    "sweep": ["sweep", *R1, "--concurrency", "4,8", "--workers", "2"],
    "tune": ["tune", *R1, *SLO],
    "plan": ["plan", *R1, *SLO, "--target-output-throughput", "1000"],
}


@FAST
@given(command=st.sampled_from(sorted(SEARCHES)), data=st.data(),
       file=st.sampled_from(["trace", "config"]))
def test_searches_with_two_workers_refuse_before_their_pool(sandbox, command, data, file):
    """The searches refuse a hostile file before a worker pool exists ($TMPDIR stays empty:
    no pymp-* folder)."""
    work = Path(tempfile.mkdtemp(dir=sandbox / "work"))
    argv = list(SEARCHES[command])
    if file == "trace":
        big = data.draw(st.integers(MAX_TOKENS + 1, 10**19))
        (work / "t.csv").write_text(_trace("TIMESTAMP,ContextTokens,GeneratedTokens",
                                           [("0", str(big), "5")]))
        argv += ["--dataset", "trace", "--dataset-path", "t.csv"]
    else:
        key = data.draw(st.sampled_from(["n_routed_experts", "num_hidden_layers"]))
        (work / "c.json").write_text(json.dumps({**CONFIG, key: 10**12}))
        argv[argv.index("deepseek-r1")] = "c.json"
        argv += ["--isl", "100", "--osl", "10"]
    run(sandbox, "search commands", work, argv, "docs/inputs.md")


@FAST
@given(flag=st.sampled_from(["--model", "--hardware"]),
       name=st.text(string.ascii_letters, min_size=256, max_size=2000))
def test_a_name_too_long_for_a_file(sandbox, flag, name):
    argv = ["describe", "--model", "deepseek-r1"] if flag == "--hardware" else ["describe"]
    run(sandbox, "long name", Path(tempfile.mkdtemp(dir=sandbox / "work")), [*argv, flag, name],
        "unknown")


@FAST
@given(flag=st.sampled_from(["--request-rate", "--burstiness"]), data=st.data())
def test_rates_too_small_to_mean_a_benchmark(sandbox, flag, data):
    low = MIN_REQUEST_RATE if flag == "--request-rate" else MIN_BURSTINESS
    value = data.draw(st.floats(5e-324, low * 0.99))
    run(sandbox, "tiny rate", Path(tempfile.mkdtemp(dir=sandbox / "work")),
        ["predict", *R1, "--isl", "100", "--osl", "10", "--request-rate", "1", flag,
         repr(value)], flag)
