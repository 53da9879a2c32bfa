"""The validation layer (``epsim.inputs``, its specs in ``epsim.specs``): every valued flag of
every command takes its type from the one table, specs enforce their stated ranges, and no value
of any flag (fuzzed) gets past parsing as anything but a value or one line with exit status 2."""

import argparse
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epsim.cli import build_parser, parse
from epsim.inputs import COMMAND_FLAGS, parse_dp_x_tp, parse_prices, spec_for
from epsim.model.errors import EpsimError
from epsim.specs import Choice, Integer, Items, OutputFile, Real, Spec


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _valued_options(sub: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in sub._actions if a.option_strings and a.nargs != 0
            and not isinstance(a, argparse._HelpAction | argparse._VersionAction)]


def test_every_valued_flag_takes_its_type_from_the_table():
    seen = 0
    for command, sub in _commands().items():
        for action in _valued_options(sub):
            flag = action.option_strings[0]
            spec = spec_for(flag, command)  # KeyError: a flag without a declared range
            assert isinstance(action.type, Spec), f"{command} {flag}: type {action.type!r}"
            assert action.type in (spec, Items(spec)), f"{command} {flag}: not the table's spec"
            seen += 1
    assert seen > 100  # ten commands' flags, not an empty walk


def test_command_specific_specs_are_used_by_their_command():
    steps = {c: next(a for a in _valued_options(s) if a.option_strings[0] == "--steps")
             for c, s in _commands().items() if c in ("run", "validate")}
    assert steps["validate"].type == COMMAND_FLAGS[("validate", "--steps")]
    assert steps["run"].type == Integer(1, 10**5)


@pytest.mark.parametrize(("spec", "text", "value"), [
    (Integer(1, 8), "8", 8), (Integer(0, 5), " +3 ", 3), (Real(0, 1, low_open=True), "1", 1.0),
    (Real(0, 1e9, low_open=True, allow_inf=True), "inf", math.inf),
    (Items(Integer(1, 100)), "4, 8,16", (4, 8, 16)), (Choice(("fp8", "bf16")), "bf16", "bf16"),
])
def test_specs_accept_values_in_range(spec, text, value):
    assert spec(text) == value


@pytest.mark.parametrize(("spec", "text"), [
    (Integer(1, 8), "9"), (Integer(1, 8), "0"), (Integer(1, 8), "1.0"), (Integer(1, 8), "1e3"),
    (Integer(0, 2**32 - 1), "99999999999999999999"), (Integer(1, 8), ""),
    (Real(0, 1, low_open=True), "0"), (Real(0, 1, low_open=True), "nan"),
    (Real(0, 1e10, low_open=True), "1e300"), (Real(0, 1e10, low_open=True), "inf"),
    (Items(Integer(1, 100)), "32,,64"), (Items(Integer(1, 100)), "4,4"),
    (Items(Integer(1, 100)), ","), (Choice(("fp8", "bf16")), "fp16"),
])
def test_specs_refuse_values_out_of_range_or_malformed(spec, text):
    with pytest.raises(argparse.ArgumentTypeError):
        spec(text)


def test_split_and_price_parsers():
    assert parse_dp_x_tp("dp4xtp2") == (4, 2) and parse_dp_x_tp("1/8") == (1, 8)
    for bad in ("4x0", "4x", "x2", "4x9999999"):
        with pytest.raises(EpsimError):
            parse_dp_x_tp(bad)
    assert parse_prices("2.5") == {"*": 2.5}
    assert parse_prices("mi300x=2.1,h200=3.7") == {"mi300x": 2.1, "h200": 3.7}
    for bad in ("0", "mi300x=abc", "=2", "mi300x=1,mi300x=2", "1e300", "2,,3"):
        with pytest.raises(EpsimError):
            parse_prices(bad)


def test_output_file_refuses_directories_and_fifos(tmp_path):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for target in (tmp_path, fifo, tmp_path / "missing" / "x.json"):
        with pytest.raises(argparse.ArgumentTypeError):
            OutputFile("--trace")(str(target))
    assert OutputFile("--trace")(str(tmp_path / "new.json")) == str(tmp_path / "new.json")


# --------------------------------------------------------------------------------------------
# Fuzz: every numeric and list flag of every command, through parsing only
# --------------------------------------------------------------------------------------------

#: the least each command needs to parse (required flags)
BASE = {
    "describe": ["--model", "deepseek-r1"],
    "step": ["--model", "deepseek-r1", "--hardware", "mi300x", "--batch", "8", "--context", "64"],
    "predict": ["--model", "deepseek-r1", "--hardware", "mi300x"],
    "sweep": ["--model", "deepseek-r1", "--hardware", "mi300x"],
    "tune": ["--model", "deepseek-r1", "--slo", "median_itl_ms<=100"],
    "plan": ["--model", "deepseek-r1", "--slo", "median_itl_ms<=100",
             "--target-output-throughput", "1000"],
    "balance": ["--loads", "decode_in2000out100", "--gpus", "8"],
    "run": ["--model", "tiny-deepseek", "--batch", "2", "--context", "4"],
    "calibrate": ["--out", "fuzz-never-written.json"],
    "validate": ["--profile", "mi300x"],
}


def _fuzzed_flags() -> list[tuple[str, str]]:
    """Every valued flag of every command (numbers, lists, names, parsed text, paths)."""
    return [(command, action.option_strings[0]) for command, sub in _commands().items()
            for action in _valued_options(sub)]


FUZZED = _fuzzed_flags()

numbers = st.one_of(
    st.integers(min_value=-10**30, max_value=10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["inf", "-inf", "nan", "1e300", "0", "-0", "1e-300", "0x10", "1_000"]),
)
values = st.one_of(
    numbers,
    st.lists(numbers, min_size=1, max_size=4).map(",".join),
    st.lists(st.one_of(numbers, st.just("")), min_size=2, max_size=4).map(",".join),
    st.text(max_size=12),
)


def test_the_fuzzed_flags_cover_every_command_and_kind():
    assert {c for c, _ in FUZZED} == set(BASE)
    kinds = {type(_commands()[c]._option_string_actions[f].type).__name__ for c, f in FUZZED}
    assert {"Integer", "Real", "Items", "Choice", "Parsed", "Name", "OutputFile"} <= kinds


@settings(max_examples=600, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(FUZZED), value=values)
def test_any_value_of_any_numeric_or_list_flag_is_a_value_or_one_line(case, value, capsys):
    command, flag = case
    try:
        parse([command, *BASE[command], f"{flag}={value}"])
    except SystemExit as exc:
        assert exc.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("epsim: error: "), err
    else:
        assert capsys.readouterr().err == ""


def test_the_device_choices_are_the_calibration_recipes():
    from epsim.calibrate.devices import DEVICES

    assert spec_for("--device").values == tuple(DEVICES)


def test_building_the_parser_does_not_load_pandas():
    # every command's parser is built on each call; pandas (the calibration fits') is for
    # calibrate alone
    import subprocess
    import sys

    code = ("import sys; from epsim.cli import build_parser; build_parser(); "
            "from epsim.inputs import _lazy_flags; _lazy_flags(); print('pandas' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
