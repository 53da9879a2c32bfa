"""Validation grids, disjointness, the calibrate/validate CLI errors, a fitted profile in
``epsim step``, and a quick calibrate -> validate run end to end (structure only: no timing or
error thresholds on this machine's noisy measurements)."""

import json
from importlib import resources

import numpy as np
import pytest
from test_calibrate_fit import build, synthetic_tables

from epsim.calibrate.micro import CALIBRATION_SHAPES, write_shape_config
from epsim.calibrate.validate import (
    DEFAULT_GRID,
    Case,
    check_disjoint,
    compare,
    parse_grid,
    read_grid,
    shape_signature,
    shipped_grids,
)
from epsim.model import EpsimError, load_model


def test_default_grid_meets_the_acceptance_shape():
    cases = read_grid(DEFAULT_GRID)
    assert len(cases) >= 12
    assert {c.world_size for c in cases} == {2, 4}
    assert {c.dbo for c in cases} == {False, True}
    assert len({c.batch for c in cases}) >= 2 and len({c.context for c in cases}) >= 2
    assert {c.model for c in cases} == {"tiny-deepseek", "tiny-deepseek-wide"}


def test_shipped_grids_by_name_and_a_file_wins(tmp_path, monkeypatch):
    assert shipped_grids() == ["cpu", "gpu1"] and DEFAULT_GRID == "cpu"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cpu").write_text(json.dumps([{"model": "tiny-deepseek", "world_size": 2,
                                               "batch": 8, "context": 64}]))
    assert len(read_grid("cpu")) == 1  # the file in the working directory, not the shipped grid
    with pytest.raises(EpsimError, match=r"grid file not found: nosuch \(nor a shipped grid: cpu, gpu1\)"):
        read_grid("nosuch")


def test_gpu_grid_is_single_rank():
    cases = read_grid("gpu1")
    assert {c.world_size for c in cases} == {1} and {c.dbo for c in cases} == {False, True}


def test_grid_parsing_defaults():
    cases = parse_grid([{"model": "tiny-deepseek", "world_size": 2, "batch": 8, "context": 64,
                         "placement": "contiguous"}])
    assert cases == [Case("tiny-deepseek", 2, 8, 64, dbo=False, ep=None, dp=None,
                          placement=None)]
    assert cases[0].to_json()["dbo"] is False


@pytest.mark.parametrize("obj, message", [
    ({}, "non-empty JSON list"),
    ([], "non-empty JSON list"),
    ([3], r"grid\[0\]: a configuration must be a JSON object"),
    ([{"world_size": 2, "batch": 8, "context": 64}], "model must be"),
    ([{"model": "m", "batch": 8, "context": 64}], "lacks required key 'world_size'"),
    ([{"model": "m", "world_size": 2, "batch": 0, "context": 64}], "batch must be a positive"),
    ([{"model": "m", "world_size": 2, "batch": 8, "context": 64, "dbo": "yes"}],
     "dbo must be true or false"),
    ([{"model": "m", "world_size": 2, "batch": 8, "context": 64, "tp": 2}],
     "unknown key"),
])
def test_bad_grids(obj, message):
    with pytest.raises(EpsimError, match=message):
        parse_grid(obj)


def test_grid_files(tmp_path):
    bad = tmp_path / "g.json"
    bad.write_text("[{")
    with pytest.raises(EpsimError, match="malformed grid JSON"):
        read_grid(bad)
    with pytest.raises(EpsimError, match="grid file not found"):
        read_grid(tmp_path / "missing.json")


def test_calibration_shapes_are_not_the_validated_models(tmp_path):
    calib = {shape_signature(load_model(write_shape_config(s, tmp_path)))
             for s in CALIBRATION_SHAPES}
    validated = {shape_signature(load_model(m)) for m in ("tiny-deepseek", "tiny-deepseek-wide")}
    assert not calib & validated
    # the signature ignores the name: a copy of a shipped config has the same shape
    copy = tmp_path / "copy.json"
    copy.write_text(json.dumps(json.loads(
        (resources.files("epsim.model") / "configs" / "tiny-deepseek.json").read_text())))
    assert shape_signature(load_model(copy)) == shape_signature(load_model("tiny-deepseek"))


def test_disjointness_check():
    model = load_model("tiny-deepseek")
    sig = shape_signature(model)
    cases = [Case("tiny-deepseek", 2, 8, 64, dbo=False)]
    models = {"tiny-deepseek": model}
    check_disjoint([{"shape": sig, "world_size": 2, "batch": 8, "context": 64, "dbo": True}],
                   cases, models)  # DBO differs: fine
    with pytest.raises(EpsimError, match="also used to fit"):
        check_disjoint([{"shape": sig, "world_size": 2, "batch": 8, "context": 64,
                         "dbo": False}], cases, models)


def test_compare_statistics():
    cases = [Case("m", 2, 8, 64), Case("m", 2, 8, 65), Case("m", 4, 8, 64)]
    measured = [{"step_ms": [10.0, 10.0, 12.0], "kind_ms": {"gemm": [1.0]}},
                {"step_ms": [20.0], "kind_ms": {}}, {"step_ms": [40.0], "kind_ms": {}}]
    predicted = [{"step_ms": [11.0], "kind_ms": {"gemm": [0.5]}},
                 {"step_ms": [15.0], "kind_ms": {}}, {"step_ms": [40.0], "kind_ms": {}}]
    rep = compare(cases, measured, predicted)
    assert [c["error_pct"] for c in rep["cases"]] == pytest.approx([10.0, -25.0, 0.0])
    assert rep["median_abs_error_pct"] == pytest.approx(10.0)
    assert rep["max_abs_error_pct"] == pytest.approx(25.0)
    assert rep["p90_abs_error_pct"] == pytest.approx(np.percentile([10, 25, 0], 90))
    assert rep["cases"][0]["per_kind_ms"]["gemm"]["error_pct"] == pytest.approx(-50.0)


# --------------------------------------------------------------------------------------------
# the CLI
# --------------------------------------------------------------------------------------------


@pytest.fixture
def fitted(tmp_path):
    path = tmp_path / "fitted.json"
    path.write_text(json.dumps(build(synthetic_tables(np.random.default_rng(7)))))
    return path


def test_fitted_profile_in_epsim_step(epsim, fitted):
    r = epsim("step", "--model", "tiny-deepseek", "--hardware", str(fitted),
              "--gpus-per-node", "2", "--dp", "2", "--ep", "2", "--batch", "8", "--context", "64", "--no-graph", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["step_ms"] > 0
    r = epsim("predict", "--model", "tiny-deepseek", "--hardware", str(fitted),
              "--gpus-per-node", "2", "--dp", "2", "--ep", "2", "--concurrency", "4", "--isl",
              "16", "--osl", "4", "--num-prompts", "8", "--no-graph", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["completed"] == 8


@pytest.mark.parametrize("content, message", [
    ("{", "malformed profile JSON"),
    ('{"name": "x"}', "lacks required key"),
])
def test_corrupt_or_incomplete_profiles_are_one_line(epsim, tmp_path, fitted, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    for argv in (["validate", "--profile", str(bad)],
                 ["step", "--model", "tiny-deepseek", "--hardware", str(bad), "--batch", "8",
                  "--context", "64"]):
        r = epsim(*argv)
        assert r.returncode == 2
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # a fitted profile missing one of its efficiency keys
    obj = json.loads(fitted.read_text())
    del obj["efficiency"]["graph_node_s"]
    bad.write_text(json.dumps(obj))
    r = epsim("validate", "--profile", str(bad))
    assert r.returncode == 2 and "lacks required key 'graph_node_s'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_validate_cli_errors(epsim, tmp_path, fitted):
    grid = tmp_path / "g.json"
    grid.write_text('[{"model": "nope", "world_size": 2, "batch": 8, "context": 64}]')
    r = epsim("validate", "--profile", str(fitted), "--grid", str(grid))
    assert r.returncode == 2 and "unknown model 'nope'" in r.stderr
    r = epsim("validate", "--profile", str(fitted), "--grid", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "unknown validation grid" in r.stderr
    r = epsim("validate", "--profile", "mi300x", "--steps", "1")
    assert r.returncode == 2 and "[2, 10000] (the first step is a warm-up)" in r.stderr


def test_calibrate_cli_errors(epsim, tmp_path):
    import torch

    if not torch.cuda.is_available():
        r = epsim("calibrate", "--device", "cuda", "--out", str(tmp_path / "p.json"))
        assert r.returncode == 2
        assert "torch sees no CUDA device" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    r = epsim("calibrate", "--out", str(tmp_path / "no" / "p.json"))
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_quick_calibrate_then_validate(epsim, tmp_path):
    out = tmp_path / "cpu.json"
    r = epsim("calibrate", "--quick", "--out", str(out), "--json", timeout=180)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    for table in ("ops", "steps", "ranks", "a2a", "contention"):
        assert (tmp_path / f"cpu.{table}.csv").is_file()
        assert summary["tables"][table].endswith(f"cpu.{table}.csv")
    profile = json.loads(out.read_text())
    assert "fitted by epsim calibrate" in profile["sources"]["efficiency.op_overhead_s"]
    assert "cpu.ops.csv" in profile["sources"]["efficiency.op_overhead_s"]
    assert profile["calibration"]["configs"]
    # the ranks sweep's world-2 launches measured how far the slowest rank lags the mean one
    assert set(profile["efficiency"]["rank_skew_by_group_s"]) == {"2"}
    assert profile["efficiency"]["rank_skew_by_group_s"]["2"] >= 0.0
    assert "slowest rank" in profile["sources"]["efficiency.rank_skew_by_group_s"]
    # the exchanges' host holds come from the same decode steps (the in-step fit's default)
    assert "ranks sweep's decode steps" in profile["sources"][
        "efficiency.a2a_host_block_by_group_s"]
    assert set(profile["efficiency"]["a2a_host_block_fraction"]) == {"2"}
    # each op's share of a median step beside its median
    import pandas as pd

    ranks = pd.read_csv(tmp_path / "cpu.ranks.csv")
    assert (ranks["step_s"] > 0).all() and ranks["step_s"].notna().all()
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps([{"model": "tiny-deepseek", "world_size": 2, "batch": 4,
                                 "context": 16, "dbo": True}]))
    r = epsim("validate", "--profile", str(out), "--grid", str(grid), "--steps", "2",
              "--repeats", "1", "--json", "--plot", str(tmp_path / "v.png"), timeout=180)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert {"cases", "median_abs_error_pct", "p90_abs_error_pct", "max_abs_error_pct"} <= set(rep)
    (case,) = rep["cases"]
    assert {"configuration", "measured_ms", "predicted_ms", "error_pct"} <= set(case)
    assert case["configuration"]["dbo"] is True and case["measured_ms"] > 0
    assert {"attention_decode", "dispatch", "combine", "gemm"} <= set(case["per_kind_ms"])
    assert rep["disjoint_from_calibration"] is True
    assert (tmp_path / "v.png").read_bytes()[:4] == b"\x89PNG"
    # provenance: the profile written is named by its file's hash, in calibrate's JSON and in
    # what validate made with it; the file says which epsim wrote it
    import hashlib

    import epsim as package

    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    assert summary["provenance"]["profile_hash"] == rep["provenance"]["profile_hash"] == digest
    assert summary["provenance"]["hardware_profile"] == profile["name"] == "cpu"
    assert profile["provenance"]["epsim_version"] == package.__version__
    # the profile is a hardware profile wherever one is accepted
    r = epsim("step", "--model", "tiny-deepseek", "--hardware", str(out),
              "--gpus-per-node", "2", "--dp", "2", "--ep", "2", "--batch", "4", "--context", "16", "--no-graph", "--json")
    assert r.returncode == 0, r.stderr
