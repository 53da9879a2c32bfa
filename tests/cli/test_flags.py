"""Each flag is defined once, a deployment is a file, and DBO is decided in one place.

Walks every command's parser (subcommands included): a flag that several commands share has
one help text, one value type and one set of spellings everywhere (the deployment's flags are
generated from its fields, ``epsim/options.py``; the others take their text from
``epsim.inputs.HELP``). ``--config FILE`` gives what the same flags give, a flag given wins
over the file, a bad file is one line and exit status 2 naming the key.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

from epsim.cli import build_parser, parse

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "epsim"
R1 = ["--model", "deepseek-r1", "--hardware", "mi300x"]


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _definitions() -> dict[str, set[tuple]]:
    """option string -> the distinct (help, type, spellings) it is defined with (a legacy
    spelling's hidden copy of a subcommand's flag is the same definition, not shown)."""
    found: dict[str, set[tuple]] = defaultdict(set)
    for _, p in _parsers(build_parser()):
        for action in p._actions:
            if action.help == argparse.SUPPRESS:
                continue
            text = re.sub(r" \(comma list\)", "", action.help or "")
            text = re.sub(r" \(default [^)]*\)$", "", text)
            spec = getattr(action.type, "item", action.type)  # a comma list of the same spec
            kind = type(spec).__name__ if spec is not None else None
            for s in action.option_strings:
                if s not in ("-h", "--help"):
                    found[s].add((text, kind, tuple(action.option_strings)))
    return found


def test_every_flag_has_one_definition_across_all_commands():
    defs = _definitions()
    assert len(defs) > 100  # the walk saw every command
    twice = {flag: sorted(d) for flag, d in defs.items() if len({x[0] for x in d}) > 1
             or len({x[1] for x in d}) > 1 or len({x[2] for x in d}) > 1}
    assert not twice, "flags defined more than once:\n" + "\n".join(
        f"{flag}: {d}" for flag, d in twice.items())


def test_the_walk_catches_a_second_definition():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub.choices["describe"].add_argument("--batch", type=int, help="something else")
    helps = {a.help for _, p in _parsers(parser) for a in p._actions
             if "--batch" in a.option_strings and a.help != argparse.SUPPRESS}
    assert len({re.sub(r" \(default [^)]*\)$", "", h) for h in helps}) == 2


def test_a_shared_help_cannot_be_given_a_second_text():
    from epsim.inputs import add_flag

    with pytest.raises(ValueError, match="defined once"):
        add_flag(argparse.ArgumentParser(), "--trace", help="another meaning")


# --------------------------------------------------------------------------------------------
# --dbo: one flag, one meaning; --no-dbo its negation
# --------------------------------------------------------------------------------------------


def test_dbo_spellings():
    base = ["predict", *R1, "--isl", "10", "--osl", "2"]
    assert parse(base).dbo is None  # the engine's default, decided by the resolution
    assert parse([*base, "--dbo"]).dbo is True
    assert parse([*base, "--dbo", "off"]).dbo is False
    assert parse([*base, "--no-dbo"]).dbo is False
    assert parse([*base, "--dbo", "off", "--dbo", "on"]).dbo is True  # argparse's last wins
    tune = ["tune", *R1, "--isl", "10", "--osl", "2", "--slo", "median_itl_ms<=100"]
    assert parse(tune).dbo == (True, False) and parse(tune).graph == (True,)
    assert parse([*tune, "--no-dbo"]).dbo == (False,)
    assert parse([*tune, "--dbo", "on"]).dbo == (True,)


def test_dbo_and_no_dbo_contradict(capsys):
    with pytest.raises(SystemExit) as exc:
        parse(["predict", *R1, "--isl", "10", "--osl", "2", "--dbo", "--no-dbo"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "contradict" in err


def test_dbo_is_decided_in_one_place():
    # the preset's default DBO and the EP rule are read in sim/deployment.py alone
    readers = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                     if re.search(r"\.dbo_default\b|DBO_NEEDS_EP\b", p.read_text()))
    assert readers == ["sim/deployment.py", "sim/serving/presets.py"]
    presets = (SRC / "sim" / "serving" / "presets.py").read_text()
    assert "DBO_NEEDS_EP" not in presets  # presets declare their default; they do not decide


def test_an_explicit_dbo_without_ep_is_refused_and_a_preset_default_does_not_apply():
    from epsim.model.errors import EpsimError
    from epsim.sim.deployment import resolve_deployment
    from epsim.sim.spec import Scenario
    from epsim.sim.workload.spec import WorkloadSpec

    w = WorkloadSpec(isl=100, osl=10)
    tp8 = Scenario.of(model="deepseek-r1", hardware="mi300x", workload=w, tp=8)
    assert resolve_deployment(tp8.with_(engine="split").deployment).dbo is False
    with pytest.raises(EpsimError, match="expert-parallel"):
        resolve_deployment(tp8.with_(dbo=True).deployment)
    ep8 = Scenario.of(model="deepseek-r1", hardware="mi300x", workload=w, dp=8, ep=8)
    assert resolve_deployment(ep8.with_(engine="split").deployment).dbo is True
    assert resolve_deployment(ep8.with_(engine="split", dbo=False).deployment).dbo is False
    r = resolve_deployment(ep8.deployment)  # the vendor's engine: vLLM on AMD, DBO off
    assert (r.engine.engine, r.dbo, r.engine.dbo) == ("vllm", False, False)


# --------------------------------------------------------------------------------------------
# A deployment is a file
# --------------------------------------------------------------------------------------------

FLAGS = ["predict", "--model", "deepseek-r1", "--hardware", "mi300x", "--dp", "8", "--ep", "8",
         "--engine", "vllm", "--max-num-seqs", "64", "--dbo", "--no-eplb", "--kv-dtype", "bf16",
         "--isl", "500", "--osl", "20", "--concurrency", "16", "--goodput", "ttft:500"]
YAML = """\
_source: a comment key, ignored
model: deepseek-r1
hardware: mi300x
plan: {dp: 8, ep: 8}
engine: {engine: vllm, max-num-seqs: 64}
execution: {dbo: on, eplb: false, kv_dtype: bf16}
workload: {isl: 500, osl: 20, concurrency: 16}
measurement: {goodput: ["ttft:500"]}
"""


def _scenario(argv):
    from epsim.options import scenario_from_args

    return scenario_from_args(parse(argv))


def test_a_config_file_equals_the_same_flags(tmp_path):
    (tmp_path / "d.yaml").write_text(YAML)
    flat = {"model": "deepseek-r1", "hardware": "mi300x", "dp": 8, "ep": 8, "engine": "vllm",
            "max_num_seqs": 64, "dbo": True, "eplb": False, "kv_dtype": "bf16", "isl": 500,
            "osl": 20, "concurrency": 16, "goodput": ["ttft:500"]}
    (tmp_path / "d.json").write_text(json.dumps(flat))
    want = _scenario(FLAGS)
    assert _scenario(["predict", "--config", str(tmp_path / "d.yaml")]) == want
    assert _scenario(["predict", "--config", str(tmp_path / "d.json")]) == want
    assert want.deployment.execution.dbo is True and want.measurement.goodput == (("ttft", 500.0),)


def test_a_flag_wins_over_the_file(tmp_path):
    (tmp_path / "d.yaml").write_text(YAML)
    sc = _scenario(["predict", "--config", str(tmp_path / "d.yaml"), "--dp", "4", "--tp", "2",
                    "--no-dbo", "--max-num-seqs", "8"])
    assert (sc.deployment.plan.dp, sc.deployment.plan.tp) == (4, 2)
    assert sc.deployment.execution.dbo is False
    assert sc.deployment.engine.max_num_seqs == 8
    assert sc.deployment.execution.kv_dtype == "bf16"  # the file's, not given as a flag


@pytest.mark.parametrize("text, says", [
    ("model: deepseek-r1\nplan: {dpp: 8}\n", "unknown key 'plan.dpp'"),
    ("model: deepseek-r1\nworkload: {isl: -3}\n", "workload.isl: expected an integer"),
    ("model: deepseek-r1\nexecution: {eplb: maybe}\n", "execution.eplb is a switch"),
    ("- a list\n", "mapping"),
    ("model: deepseek-r1\ndp: 4\nplan: {dp: 8}\n", "'dp' and 'plan.dp' are the same flag"),
    ("model: deepseek-r1\nmax-num-seqs: 4\nmax_num_seqs: 8\n", "the same flag"),
    ("model: deepseek-r1\neplb: false\nno-eplb: true\n", "gives --no-eplb again"),
    ("model: [unclosed\n", "not valid YAML"),
])
def test_a_bad_file_is_one_line_naming_the_key(tmp_path, capsys, text, says):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exc:
        parse(["predict", "--config", str(path), "--hardware", "mi300x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and err.startswith("epsim: error: "), err


def test_a_missing_config_file_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(["predict", "--config", str(tmp_path / "none.yaml")])
    assert exc.value.code == 2 and capsys.readouterr().err.count("\n") == 1


def test_every_command_that_takes_a_deployment_takes_config():
    parser = build_parser()
    takes = {" ".join(path) for path, p in _parsers(parser)
             if any("--config" in a.option_strings for a in p._actions)}
    assert {"predict", "sweep", "tune", "plan", "step", "describe", "validate bench",
            "calibrate bench"} <= takes


def test_help_group_shows_that_group_alone(capsys):
    with pytest.raises(SystemExit) as exc:
        parse(["predict", "--help=engine"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--max-num-seqs" in out and "--isl" not in out and "--dp " not in out
    with pytest.raises(SystemExit) as exc:
        parse(["predict", "--help=nosuch"])
    assert exc.value.code == 2
