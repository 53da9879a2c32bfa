"""calibrate --from-bench: the fitted factors' mechanism (op_final_scale on the final op time,
a fitted host time), the fit (Levenberg-Marquardt, the identifiability rule, leave-one-out) and
a recovery test: runs simulated under known factors, written as vLLM files, fitted back."""

import hashlib
import json
import math
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import pytest

from epsim.calibrate import bench_fit as bf
from epsim.model.config import load_model
from epsim.model.errors import EpsimError
from epsim.model.opgraph import Batch
from epsim.model.plan import make_plan
from epsim.sim.hardware.profile import load_profile, profile_from_dict
from epsim.sim.step.simulate import simulate_step


def perturbed(raw, scale=None, host=None):
    obj = json.loads(json.dumps(raw))
    if scale is not None:
        obj["efficiency"]["op_final_scale"] = scale
        obj["sources"]["efficiency.op_final_scale"] = "test: known factors"
    if host is not None:
        obj["efficiency"]["host_ms_per_step"] = host
        obj["sources"]["efficiency.host_ms_per_step"] = "test: known host time"
    return obj


# --------------------------------------------------------------------------------------------
# The mechanism
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", ["aiter", "none"])
def test_final_scale_multiplies_each_class_under_any_kernel_set(kernels):
    model = load_model("tiny-deepseek")
    plan = make_plan(model, nodes=1, gpus_per_node=2, dp=2, ep=2, microbatches=1)
    # the scale multiplies the time the table or roofline gives, before the kernel floors
    # (sim/step/kernels.py): with the floors at 0 the op kinds' times scale exactly
    raw = json.loads(json.dumps(load_profile("mi300x").raw))
    raw["efficiency"]["kernel_floor_s"] = 0.0
    base = profile_from_dict(raw).with_kernels(kernels)
    scale = {"attention": 1.3, "grouped_gemm": 0.8, "communication": 2.0}
    fitted = profile_from_dict(perturbed(raw, scale)).with_kernels(kernels)
    batch = Batch.decode(16, 1000)
    before = simulate_step(model, plan, batch, base).op_kinds_ms
    after = simulate_step(model, plan, batch, fitted).op_kinds_ms
    factor = {"attention_decode": 1.3, "grouped_gemm": 0.8, "dispatch": 2.0, "combine": 2.0}
    assert set(factor) <= set(before)
    for kind, ms in before.items():
        assert after[kind] == pytest.approx(ms * factor.get(kind, 1.0), rel=1e-9), kind


def test_the_most_specific_scale_key_wins_and_unknown_keys_are_refused():
    raw = load_profile("mi300x").raw
    e = profile_from_dict(perturbed(raw, {"gemm": 2.0, "gemm.batched": 3.0, "other": 0.5,
                                          "norm": 0.25})).require_efficiency()
    assert (e.final_scale("gemm"), e.final_scale("gemm.batched")) == (2.0, 3.0)
    assert (e.final_scale("norm"), e.final_scale("rope"), e.final_scale("dispatch")) == \
        (0.25, 0.5, 1.0)
    assert load_profile("mi300x").require_efficiency().final_scale("gemm") == 1.0
    with pytest.raises(EpsimError, match="names no op kind, class or group: atention"):
        profile_from_dict(perturbed(raw, {"atention": 1.2}))


def test_a_fitted_host_time_acts_under_an_engine_and_a_flag_overrides_it(epsim, tmp_path):
    path = tmp_path / "host.json"
    path.write_text(json.dumps(perturbed(load_profile("mi300x").raw, host=6.0)))
    common = ["predict", "--model", "tiny-deepseek", "--gpus-per-node", "2", "--dp", "2",
              "--ep", "2", "--isl", "64", "--osl", "8", "--concurrency", "2", "--json"]
    tpot = {}
    for label, extra in (("shipped", ["--hardware", "mi300x", "--engine", "vllm"]),
                         ("fitted", ["--hardware", str(path), "--engine", "vllm"]),
                         ("flag", ["--hardware", str(path), "--engine", "vllm",
                                   "--host-ms-per-step", "5"])):
        r = epsim(*common, *extra)
        assert r.returncode == 0, r.stderr
        tpot[label] = json.loads(r.stdout)["mean_tpot_ms"]
    # the tiny model's GPU step is far below a fitted or flagged host time, which it overlaps:
    # TPOT = host; the shipped vLLM host model (19.4 us per request + 0.1 ms DP sync) is not
    assert tpot["fitted"] == pytest.approx(6.0) and tpot["flag"] == pytest.approx(5.0)
    assert tpot["shipped"] < 1.0


# --------------------------------------------------------------------------------------------
# The fit and the identifiability rule, on an analytic stand-in for the simulator
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    source: str
    measured: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))


class Analytic(bf.Simulator):
    """TPOT = attention * a + moe * m (ms) and TTFT = 10 * (attention * a + moe * m'), where
    each run has its own (a, m, m')."""

    def __init__(self, shares, truth, names=("attention", "grouped_gemm"), ttft=True):
        self.names, self.shares, self.evaluations = tuple(names), shares, 0
        self.runs = [Run(f"run{i}", MappingProxyType(self._metrics(s, truth, ttft)))
                     for i, s in enumerate(shares)]
        self.ttft = ttft

    @staticmethod
    def _metrics(share, f, ttft):
        a, m, mp = share
        out = {"mean_tpot_ms": f["attention"] * a + f.get("grouped_gemm", 1.0) * m}
        if ttft:
            out["mean_ttft_ms"] = 10 * (f["attention"] * a + f.get("grouped_gemm", 1.0) * mp)
        return out

    def predict(self, theta, which=None):
        f = dict(zip(self.names, np.exp(theta), strict=True))
        idx = which if which is not None else range(len(self.runs))
        self.evaluations += len(idx)
        return [self._metrics(self.shares[i], f, self.ttft) for i in idx]


TRUTH = {"attention": 1.3, "grouped_gemm": 0.8}


def test_levenberg_marquardt_recovers_the_factors_of_an_analytic_model():
    sim = Analytic([(2.0, 8.0, 1.0), (6.0, 4.0, 3.0), (1.0, 1.0, 9.0)], TRUTH)
    theta, iterations = bf._fit(sim, [0, 1, 2], np.zeros(2))
    assert np.exp(theta) == pytest.approx([1.3, 0.8], rel=1e-6)
    assert 0 < iterations < 30


def test_counting_more_factors_than_measurements_is_refused_naming_what_each_needs():
    sim = Analytic([(2.0, 8.0, 1.0)], TRUTH, ttft=False)
    with pytest.raises(EpsimError) as exc:
        bf.check_identifiable(sim, [0], np.zeros(2))
    text = str(exc.value)
    assert "2 factors (attention, grouped_gemm) need at least 2 measurements" in text
    assert "1 run gives 1" in text and "grouped_gemm: TPOT/ITL at two concurrencies" in text


def test_a_factor_that_moves_nothing_is_refused():
    # runs whose TPOT has no MoE share at all
    sim = Analytic([(2.0, 0.0, 0.0), (6.0, 0.0, 0.0)], TRUTH, ttft=False)
    with pytest.raises(EpsimError, match="factor grouped_gemm moves none of the fitted metrics"):
        bf.check_identifiable(sim, [0, 1], np.zeros(2))


def test_factors_that_move_the_runs_alike_are_refused():
    # the same attention:MoE mix in both runs (2:8 and 1:4): only their sum is determined
    sim = Analytic([(2.0, 8.0, 0.0), (1.0, 4.0, 0.0)], TRUTH, ttft=False)
    with pytest.raises(EpsimError, match="factors attention, grouped_gemm move the fitted "
                       "metrics of these 2 runs alike"):
        bf.check_identifiable(sim, [0, 1], np.zeros(2))
    # another mix in the second run determines both
    ok = Analytic([(2.0, 8.0, 0.0), (6.0, 1.0, 0.0)], TRUTH, ttft=False)
    bf.check_identifiable(ok, [0, 1], np.zeros(2))


def test_leave_one_out_predicts_each_run_from_the_others_or_says_why_not():
    sim = Analytic([(2.0, 8.0, 1.0), (6.0, 4.0, 3.0), (1.0, 1.0, 9.0)], TRUTH, ttft=False)
    rows = bf.leave_one_out(sim, np.zeros(2))
    assert [r["determined"] for r in rows] == [True, True, True]
    for row in rows:  # exact data: each run predicted to fit precision from the other two
        assert row["factors"]["attention"] == pytest.approx(1.3, rel=1e-6)
        assert abs(row["metrics"]["mean_tpot_ms"]["error_pct"]) < 1e-4
    two = Analytic([(2.0, 8.0, 1.0), (6.0, 4.0, 3.0)], TRUTH, ttft=False)
    rows = bf.leave_one_out(two, np.zeros(2))
    assert [r["determined"] for r in rows] == [False, False]
    assert "need at least 2 measurements" in rows[0]["why"]


class Planted(bf.Simulator):
    """TPOT = sum of each factor's share (ms) times the factor, per run; measured under
    ``truth``; fitted over ``names`` (the others at 1)."""

    def __init__(self, shares, truth, names):
        self.names, self.shares, self.evaluations = tuple(names), shares, 0
        self.runs = [Run(f"run{i}", MappingProxyType({"mean_tpot_ms": self._tpot(s, truth)}))
                     for i, s in enumerate(shares)]

    @staticmethod
    def _tpot(share, f):
        return sum(ms * f.get(name, 1.0) for name, ms in share.items())

    def start(self):
        return np.zeros(len(self.names))

    def predict(self, theta, which=None):
        f = dict(zip(self.names, np.exp(theta), strict=True))
        idx = which if which is not None else range(len(self.runs))
        self.evaluations += len(idx)
        return [{"mean_tpot_ms": self._tpot(self.shares[i], f)} for i in idx]

    def profile_obj(self, values):
        return {"efficiency": {"op_final_scale": dict(values)}}

    def close(self):
        pass


#: attention dominates every run; the MoE's small share cannot pin it down
SHARES = [{"attention": 10.0, "grouped_gemm": 1.0}, {"attention": 5.0, "grouped_gemm": 2.0},
          {"attention": 20.0, "grouped_gemm": 0.5}]


def test_an_implausible_fitted_factor_is_refused_and_the_others_refitted():
    # the runs were made with the MoE at 0.05x: a fit finds it, and it is refused
    names = ("attention", "grouped_gemm")
    report = bf.fit_screened(lambda active: Planted(SHARES, {"attention": 1.3,
                                                             "grouped_gemm": 0.05}, active),
                             names, loo=False)
    (refused,) = report["refused"]
    assert refused["factor"] == "grouped_gemm" and refused["range"] == [0.25, 4.0]
    assert refused["fitted"] == pytest.approx(0.05, rel=1e-4) and refused["kept"] == 1.0
    # the MoE keeps its sourced value; attention is refitted alone: the least-squares log fit
    # of 1.3 a + 0.05 m = x a + m over the three runs
    assert report["factors"]["grouped_gemm"] == 1.0
    a = [s["attention"] for s in SHARES]
    m = [s["grouped_gemm"] for s in SHARES]
    x = report["factors"]["attention"]
    resid = [math.log((x * ai + mi) / (1.3 * ai + 0.05 * mi)) for ai, mi in zip(a, m, strict=True)]
    grad = sum(r * ai / (x * ai + mi) for r, ai, mi in zip(resid, a, m, strict=True))
    assert 0.25 <= x <= 4.0 and abs(grad) < 1e-4  # a least-squares optimum (to LM tolerance)
    assert report["profile"] == {"efficiency": {"op_final_scale": {"attention": x}}}


def test_plausible_fits_are_kept_and_refusing_every_factor_keeps_the_base():
    names = ("attention", "grouped_gemm")
    truth = {"attention": 1.3, "grouped_gemm": 0.8}
    ok = bf.fit_screened(lambda active: Planted(SHARES, truth, active), names, loo=False)
    assert ok["refused"] == [] and ok["factors"] == pytest.approx(truth, rel=1e-5)
    # attention 6x: refused; then the MoE alone must explain it all: refused too
    bad = bf.fit_screened(lambda active: Planted(SHARES, {"attention": 6.0}, active),
                          ("attention",), loo=False)
    assert [r["factor"] for r in bad["refused"]] == ["attention"]
    assert bad["factors"] == {"attention": 1.0} and bad["iterations"] == 0
    assert bad["profile"] == {"efficiency": {"op_final_scale": {}}}


def test_the_report_prints_a_refusal(capsys):
    from epsim.calibrate_bench import _print

    _print({"profile": "p.json", "factors": {"attention": 1.2, "grouped_gemm": 1.0},
            "start": {"attention": 1.0, "grouped_gemm": 1.0}, "runs": [], "leave_one_out": [],
            "iterations": 3, "evaluations": 9,
            "refused": [{"factor": "grouped_gemm", "fitted": 0.02, "range": [0.25, 4.0],
                         "kept": 1.0}]})
    out = capsys.readouterr().out
    assert "grouped_gemm" in out and "1x kept: fitted 0.02x refused, outside [0.25, 4]" in out


# --------------------------------------------------------------------------------------------
# Recovery: runs simulated under known factors, fitted back through the CLI
# --------------------------------------------------------------------------------------------

#: a 6-layer DeepSeek-V3 (1 dense + 5 MoE layers): the decode step at concurrency 1 is
#: shorter than a 6 ms host time, at 64 x 4096 and 512 x 512 longer (GPU-bound)
RUNS = ((1, 512), (64, 4096), (512, 512))


def small_v3(tmp_path):
    from conftest import REPO

    cfg = json.loads((REPO / "src/epsim/model/configs/deepseek-v3.json").read_text())
    cfg.update(num_hidden_layers=6, first_k_dense_replace=1, num_nextn_predict_layers=0)
    path = tmp_path / "ds6.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_calibrate_from_bench_recovers_known_factors(epsim, tmp_path):
    model = small_v3(tmp_path)
    truth = tmp_path / "truth.json"
    truth.write_text(json.dumps(perturbed(load_profile("mi300x").raw,
                                          {"attention": 1.3, "grouped_gemm": 0.8}, 6.0)))
    deployment = ["--model", model, "--dp", "8", "--ep", "8", "--engine", "vllm"]
    files = []
    for conc, isl in RUNS:
        out = tmp_path / f"run-{conc}.json"
        r = epsim("predict", *deployment, "--hardware", str(truth), "--concurrency", str(conc),
                  "--isl", str(isl), "--osl", "16", "--save-result", str(out), "--save-detailed")
        assert r.returncode == 0, r.stderr
        files.append(str(out))
    fitted = tmp_path / "fit.json"
    r = epsim("calibrate", "--from-bench", *files, *deployment, "--hardware", "mi300x",
              "--out", str(fitted), "--no-loo", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["start"] == {"attention": 1.0, "grouped_gemm": 1.0, "host": 4.0}
    assert report["refused"] == []
    # every key of each file is used or listed with why (the clients' metadata among them)
    assert report["ignored"][files[0]]["date"] == "the run's metadata, not a measurement"
    for name, value in {"attention": 1.3, "grouped_gemm": 0.8, "host": 6.0}.items():
        assert abs(report["factors"][name] / value - 1) < 0.02, (name, report["factors"])
    obj = json.loads(fitted.read_text())
    eff = obj["efficiency"]
    assert set(eff["op_final_scale"]) == {"attention", "grouped_gemm"}
    assert eff["host_ms_per_step"] == pytest.approx(report["factors"]["host"])
    source = obj["sources"]["efficiency.op_final_scale"]
    for f in files:
        digest = hashlib.sha256(open(f, "rb").read()).hexdigest()
        assert f"{f} (sha256 {digest})" in source
    record = obj["calibration"]["from_bench"]
    assert record["deployment"]["engine"] == "vllm" and record["deployment"]["dp"] == 8
    assert record["date"] in source and obj["name"] == "mi300x-bench-fit"
    # provenance: the file names the profile it was fitted from, the JSON the file written
    base = load_profile("mi300x")
    assert obj["provenance"]["hardware_profile"] == "mi300x"
    assert obj["provenance"]["profile_hash"] == base.profile_hash
    assert obj["provenance"]["table_sources"] == base.provenance()["table_sources"]
    assert report["provenance"]["hardware_profile"] == "mi300x-bench-fit"
    assert report["provenance"]["profile_hash"] == hashlib.sha256(
        fitted.read_bytes()).hexdigest()
    # the fitted profile loads and predicts the measured run it was fitted to
    r = epsim("validate", "--bench", files[1], *deployment, "--hardware", str(fitted), "--json")
    assert r.returncode == 0, r.stderr
    tpot = json.loads(r.stdout)["metrics"]["mean_tpot_ms"]
    assert abs(tpot["error_pct"]) < 0.5


def test_from_bench_refusals_are_one_line(epsim, tmp_path):
    from conftest import REPO

    example = str(REPO / "tests/data/bench/vllm-example.json")
    base = ["calibrate", "--from-bench", example, "--model", "deepseek-v3", "--hardware",
            "mi300x", "--dp", "8", "--ep", "8", "--out", str(tmp_path / "p.json")]
    for argv, message in (
            (base + ["--engine", "vllm"], "3 factors (attention, grouped_gemm, host) need at "
             "least 3 measurements; 1 run gives"),
            # the default engine (vLLM on AMD) has host time; epsim's own policy has none
            (base + ["--engine", "prefill_first", "--factors", "attention,host"],
             "acts under --engine only"),
            (base[:-2], "needs --out"),
            (["calibrate", "--factors", "attention", "--out", str(tmp_path / "q.json")],
             "give --from-bench")):
        r = epsim(*argv)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (argv, r.stderr)
        assert message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "p.json").exists()
