"""Every prediction carries the expected error of its regime (``epsim/fidelity.py``)."""

import json

import pytest

from epsim.fidelity import (
    SERVING_HEADLINE,
    band_text,
    error_band,
    model_version,
    regime_of,
    shipped_bands,
)

BANDS = {"measured_on": {**model_version(), "date": "2026-12-03"},
         "regimes": {"ep_decode": {"median_abs_error": 0.089, "max_abs_error": 0.31,
                                   "checks": 8}}}
R1_EP8 = ["--model", "deepseek-r1", "--hardware", "mi300x", "--dp", "8", "--ep", "8"]
SMALL = ["--model", "deepseek-r1", "--hardware", "mi300x", "--isl", "256", "--osl", "8"]


def test_the_regime_of_a_prediction():
    assert regime_of(ep=8) == "ep_decode" and regime_of(ep=1) == "tp_decode"
    assert regime_of(ep=8, phase="prefill") == "prefill"
    assert regime_of(ep=8, disaggregated=True) == "disaggregated"


def test_a_checked_regime_gives_its_band_and_ttft_says_it_is_unchecked():
    band = error_band("ep_decode", ["output_throughput", "median_ttft_ms"], BANDS)
    assert band["checks"] == 8 and "stale" not in band and "note" not in band
    assert band["metrics"]["output_throughput"] == {
        "checked": True, "expected_abs_error": 0.089, "max_abs_error": 0.31}
    assert band["metrics"]["median_ttft_ms"] == {"checked": False}
    assert band_text(band) == ("±8.9 % (largest 31 %), 8 published checks of EP decode; "
                               "no check of median_ttft_ms")


def test_a_regime_without_checks_says_so_and_other_profiles_make_a_band_stale():
    band = error_band("prefill", ["step_ms"], BANDS)
    assert band["checks"] == 0 and band["metrics"]["step_ms"] == {"checked": False}
    assert "outside every checked regime" in band["note"]
    assert band_text(band).startswith("none: outside every checked regime")
    old = {**BANDS, "measured_on": {"epsim": "0.0.1", "profiles": "000000000000"}}
    assert error_band("ep_decode", ["step_ms"], old)["stale"] is True


def test_the_shipped_bands_were_measured_on_the_shipped_profiles():
    # bench/fidelity.py --write-bands rewrites them; a profile change without it fails here
    measured = shipped_bands()["measured_on"]
    assert {k: measured[k] for k in ("epsim", "profiles")} == model_version()
    assert set(shipped_bands()["regimes"]) <= {"ep_decode", "tp_decode", "prefill",
                                               "disaggregated"}


@pytest.mark.parametrize("argv, regime", [
    (["step", *R1_EP8, "--batch", "64", "--context", "1000"], "ep_decode"),
    (["step", *R1_EP8, "--batch", "1", "--context", "1000", "--phase", "prefill"], "prefill"),
    (["predict", *SMALL, "--tp", "8", "--concurrency", "16"], "tp_decode"),
    (["predict", *SMALL, "--concurrency", "16"], "ep_decode"),
])
def test_step_and_predict_json_carry_the_band(epsim, argv, regime):
    r = epsim(*argv, "--json")
    assert r.returncode == 0, r.stderr
    band = json.loads(r.stdout)["error_band"]
    assert band["regime"] == regime
    assert band["measured_on"] == shipped_bands()["measured_on"]
    expected = shipped_bands()["regimes"].get(regime)
    for metric, entry in band["metrics"].items():
        if expected and metric not in ("mean_ttft_ms", "median_ttft_ms"):
            assert entry["expected_abs_error"] == expected["median_abs_error"]
        else:
            assert entry == {"checked": False}


def test_tune_and_plan_json_carry_the_band_of_their_answer(epsim):
    tuned = json.loads(epsim("tune", *SMALL, "--concurrency", "32", "--dbo", "off",
                             "--slo", "median_itl_ms<=1000", "--json").stdout)
    assert tuned["error_band"]["regime"] == regime_of(ep=tuned["best"]["ep"])
    assert set(tuned["error_band"]["metrics"]) == {m for m in SERVING_HEADLINE
                                                   if m in tuned["best"]}
    plan = json.loads(epsim("plan", *SMALL, "--concurrency", "32", "--dbo", "off",
                            "--slo", "median_itl_ms<=1000", "--target-output-throughput",
                            "10000", "--json").stdout)
    assert plan["error_band"] == plan["plans"][0]["error_band"]
    assert plan["error_band"]["regime"] == regime_of(ep=plan["plans"][0]["unit"]["ep"])
