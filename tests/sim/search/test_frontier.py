"""The frontier chart of sweep, tune and plan (``epsim.sim.search.frontier``,
``epsim.frontier_chart``): its points on hand-built rows, and the commands' outputs."""

import csv
import json

import pytest

from epsim.cli import main
from epsim.sim.search.frontier import (
    frontier_points,
    interactivity,
    pareto_mask,
    slo_interactivity,
    throughput_per_gpu,
    usd_per_million_tokens,
)
from epsim.sim.search.slo import parse_slo


def _row(hw, tpot_ms, tok_s, gpus=8, conc=1):
    return {"hardware": hw, "engine": "e", "mean_tpot_ms": tpot_ms, "output_throughput": tok_s,
            "gpus": gpus, "concurrency": conc}


def test_axes_and_price_are_hand_computed():
    r = _row("a", 25.0, 8000.0)
    assert interactivity(r) == 40.0  # 1000 / 25 ms
    assert throughput_per_gpu(r) == 1000.0  # 8000 tok/s over 8 GPUs
    # $2 per GPU-hour over 1000 tok/s x 3600 s = 3.6 M tokens an hour
    assert usd_per_million_tokens(1000.0, 2.0) == pytest.approx(2 / 3.6)
    assert usd_per_million_tokens(1000.0, None) is None


def test_pareto_mask_keeps_only_points_no_other_beats_on_both_axes():
    xs = [1.0, 2.0, 1.0, 3.0, 2.5, 3.0]
    ys = [3.0, 2.0, 1.0, 0.5, 1.5, 0.5]
    # (1,1) is beaten by (1,3) and (2,2); (2.5,1.5) by nothing; of the equal (3,0.5) the first
    assert pareto_mask(xs, ys) == [True, True, False, True, True, False]


def test_frontier_is_pareto_optimal_within_each_series_and_priced_by_hardware():
    rows = [_row("a", 10.0, 800.0, conc=1),     # x 100, y 100
            _row("a", 20.0, 3200.0, conc=4),    # x 50,  y 400
            _row("a", 25.0, 2400.0, conc=8),    # x 40,  y 300: beaten by conc 4
            _row("b", 20.0, 1600.0, conc=4),    # x 50,  y 200: beaten by a's conc 4 only
            _row("b", 50.0, 4000.0, gpus=16, conc=16)]  # x 20, y 250
    pts = frontier_points(rows, lambda r: r["hardware"], {"a": 3.6, "*": 7.2},
                          carry=("concurrency",))
    got = [(p["series"], p["concurrency"], p["interactivity_tok_s_user"],
            p["output_tok_s_per_gpu"], p["on_frontier"]) for p in pts]
    assert got == [("a", 8, 40.0, 300.0, False), ("a", 4, 50.0, 400.0, True),
                   ("a", 1, 100.0, 100.0, True),
                   ("b", 16, 20.0, 250.0, True), ("b", 4, 50.0, 200.0, True)]
    # a at $3.6/GPU-hour: 3.6 / (400 x 3600) x 1e6 = $2.5/M; b takes the "*" price
    assert pts[1]["usd_per_million_output_tokens"] == pytest.approx(2.5)
    assert pts[3]["gpu_hour_usd"] == 7.2
    assert pts[3]["usd_per_million_output_tokens"] == pytest.approx(7.2 / (250 * 3600) * 1e6)


def test_slo_lines_are_the_decode_gap_bounds_as_tok_s_per_user():
    slo = parse_slo("mean_tpot_ms<=50,mean_ttft_ms<=5000,p90_itl_ms<=100")
    assert slo_interactivity(slo) == [("mean_tpot_ms<=50", 20.0), ("p90_itl_ms<=100", 10.0)]
    assert slo_interactivity(parse_slo("median_ttft_ms<=100")) == []
    assert slo_interactivity(None) == []


SWEEP = ["sweep", "--model", "deepseek-r1", "--hardware", "mi300x,h200", "--dp", "8", "--ep",
         "8", "--isl", "256", "--osl", "8", "--concurrency", "1,16", "--workers", "1"]


def _run(capsys, *argv):
    status = main(list(argv))
    out = capsys.readouterr()
    assert status == 0, out.err
    return out.out


def test_sweep_over_two_hardware_writes_rows_frontier_csv_and_png(capsys, tmp_path):
    png, fcsv = tmp_path / "f.png", tmp_path / "f.csv"
    res = json.loads(_run(capsys, *SWEEP, "--gpu-hour-usd", "mi300x=2,h200=4", "--plot",
                          str(png), "--frontier-csv", str(fcsv), "--json"))
    rows = res["results"]
    assert [(r["hardware"], r["max_concurrency"]) for r in rows] == [
        ("mi300x", 1), ("mi300x", 16), ("h200", 1), ("h200", 16)]
    pts = res["interactivity_frontier"]
    assert [p["series"] for p in pts] == ["mi300x vllm"] * 2 + ["h200 sglang"] * 2
    for p in pts:  # the points are the rows on the chart's axes
        r = next(r for r in rows if (r["hardware"], r["max_concurrency"])
                 == (p["hardware"], p["concurrency"]))
        assert p["interactivity_tok_s_user"] == pytest.approx(1000 / r["mean_tpot_ms"])
        assert p["output_tok_s_per_gpu"] == pytest.approx(r["output_throughput"] / 8)
        assert p["gpu_hour_usd"] == {"mi300x": 2.0, "h200": 4.0}[p["hardware"]]
    with fcsv.open() as f:
        table = list(csv.DictReader(f))
    assert [(t["series"], int(t["concurrency"]), float(t["output_tok_s_per_gpu"]),
             t["on_frontier"]) for t in table] == [
        (p["series"], p["concurrency"], p["output_tok_s_per_gpu"], json.dumps(p["on_frontier"]))
        for p in pts]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_sweep_text_names_the_hardware_of_each_row(capsys):
    lines = _run(capsys, *SWEEP).splitlines()
    assert lines[0].split()[:2] == ["hardware", "max_concurrency"]
    assert [ln.split()[0] for ln in lines[1:]] == ["mi300x", "mi300x", "h200", "h200"]


def test_tune_plot_and_frontier_csv(capsys, tmp_path):
    png, fcsv = tmp_path / "t.png", tmp_path / "t.csv"
    res = json.loads(_run(capsys, "tune", *SWEEP[1:], "--dbo", "on,off", "--slo",
                          "mean_tpot_ms<=1000", "--plot", str(png), "--frontier-csv",
                          str(fcsv), "--json"))
    pts = res["interactivity_frontier"]
    assert len(pts) == len(res["points"]) == 8  # 2 hardware x 2 DBO x 2 concurrencies
    assert {p["series"] for p in pts} == {"mi300x vllm", "h200 sglang"}
    assert all(p["meets_slo"] for p in pts)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with fcsv.open() as f:
        assert len(list(csv.DictReader(f))) == 8


def test_a_price_for_hardware_not_run_is_one_line(capsys):
    assert main([*SWEEP, "--gpu-hour-usd", "b200=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prices b200, which is not searched" in err


def test_missing_matplotlib_is_one_line_before_any_work(capsys, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main([*SWEEP, "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--plot needs matplotlib" in err
    assert not any(tmp_path.iterdir())


def test_plan_draws_every_unit_search_one_series_per_hardware_and_layout(capsys, tmp_path):
    fcsv = tmp_path / "p.csv"
    res = json.loads(_run(capsys, "plan", *SWEEP[1:], "--dbo", "on", "--slo",
                          "mean_tpot_ms<=1000", "--target-output-throughput", "1000",
                          "--gpu-hour-usd", "2", "--frontier-csv", str(fcsv), "--json"))
    pts = res["interactivity_frontier"]
    assert [(p["series"], p["concurrency"]) for p in pts] == [
        ("mi300x vllm, 1 node co-located", 16), ("mi300x vllm, 1 node co-located", 1),
        ("h200 sglang, 1 node co-located", 16), ("h200 sglang, 1 node co-located", 1)]
    assert all(p["gpu_hour_usd"] == 2.0 for p in pts)
    with fcsv.open() as f:
        assert [t["series"] for t in csv.DictReader(f)] == [p["series"] for p in pts]
