"""No NaN or Infinity in any JSON epsim writes (epsim.model.jsonout): a non-finite number is
null, so that a strict parser (jq, JavaScript, Go) reads the document."""

import json
import math

import numpy as np
import pytest

from epsim.model.jsonout import dumps, finite


def _strict(text: str):
    def refuse(word):
        raise AssertionError(f"{word} in JSON")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_become_null_at_any_depth():
    obj = {"a": math.nan, "b": [1.5, math.inf, (-math.inf, 2)], "c": {"d": {"e": np.float32("nan")}},
           "f": np.array([1.0, np.inf]), "g": np.int64(3), "h": "inf", "i": True, "j": None}
    assert _strict(dumps(obj)) == {"a": None, "b": [1.5, None, [None, 2]], "c": {"d": {"e": None}},
                                   "f": [1.0, None], "g": 3, "h": "inf", "i": True, "j": None}


def test_finite_values_pass_unchanged():
    assert finite({"x": 0.1, "y": [2**70, -0.0]}) == {"x": 0.1, "y": [2**70, -0.0]}
    assert dumps({"x": 1e308}) == '{"x": 1e+308}'


def test_what_json_cannot_write_is_still_an_error():
    with pytest.raises(TypeError):
        dumps({"x": object()})


def test_predict_json_of_a_degenerate_rate_has_no_nan(epsim):
    """--request-rate 5e-324: one request arrives after ~1e323 s; every rate is 0 or not a
    number, and the JSON says null, not NaN."""
    r = epsim("predict", "--model", "src/epsim/model/configs/tiny-deepseek.json", "--hardware", "mi300x",
              "--isl", "16", "--osl", "4", "--num-prompts", "2", "--request-rate", "5e-324",
              "--json")
    assert r.returncode in (0, 2), r.stderr
    if r.returncode == 0:
        _strict(r.stdout)
    else:  # refused before any work instead: one line
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
