"""``epsim calibrate micro|trace|bench`` and ``epsim validate grid|bench`` (``epsim.modes``):
every spelling from before the subcommands parses to the same run with the same arguments as its
subcommand, the help lists the subcommands, a flag given before the subcommand is one line and
exit status 2, and every flag of a subcommand takes its type from the one table."""

import argparse
import json

import pytest
from conftest import REPO

import epsim.commands.calibrate as calibrate_cmd
import epsim.commands.validate as validate_cmd
from epsim.cli import build_parser, main, parse
from epsim.inputs import spec_for
from epsim.specs import Items, Spec

RESULT = str(REPO / "tests" / "data" / "bench" / "vllm-example.json")
DEPLOYMENT = ["--model", "deepseek-v3", "--hardware", "mi300x", "--dp", "8", "--ep", "8"]
TINY = ["--model", "tiny-deepseek", "--hardware", "mi300x", "--gpus-per-node", "2", "--dp", "2",
        "--ep", "2"]

#: (legacy argv, subcommand argv, the run function both reach); a file for --out is added
SPELLINGS = [
    (["calibrate", "--out", "{out}", "--quick"], ["calibrate", "micro", "--out", "{out}",
                                                  "--quick"], (calibrate_cmd, "run_micro")),
    (["calibrate", "--from-trace", RESULT, "--model", "deepseek-v3", "--json"],
     ["calibrate", "trace", RESULT, "--model", "deepseek-v3", "--json"],
     (calibrate_cmd, "run_trace")),
    (["calibrate", "--from-bench", RESULT, RESULT, *DEPLOYMENT, "--out", "{out}", "--no-loo"],
     ["calibrate", "bench", RESULT, RESULT, *DEPLOYMENT, "--out", "{out}", "--no-loo"],
     (calibrate_cmd, "run_bench_fit")),
    (["validate", "--profile", "mi300x", "--grid", "cpu", "--steps", "3"],
     ["validate", "grid", "--profile", "mi300x", "--grid", "cpu", "--steps", "3"],
     (validate_cmd, "run_grid")),
    (["validate", "--bench", RESULT, *DEPLOYMENT, "--json"],
     ["validate", "bench", RESULT, *DEPLOYMENT, "--json"], (validate_cmd, "run_bench")),
]


def _ran(monkeypatch, argv: list[str]) -> tuple[str, dict]:
    """The run function ``argv`` reaches and the arguments it gets (the modes' run functions
    replaced by a recorder before the parser is built)."""
    seen: list[tuple[str, dict]] = []
    for module, name in {(calibrate_cmd, "run_micro"), (calibrate_cmd, "run_trace"),
                         (calibrate_cmd, "run_bench_fit"), (validate_cmd, "run_grid"),
                         (validate_cmd, "run_bench")}:
        monkeypatch.setattr(module, name, lambda a, name=name: seen.append((name, vars(a))) or 0)
    args = parse(argv)
    assert args.run(args) == 0
    assert len(seen) == 1
    name, values = seen[0]
    return name, {k: v for k, v in values.items() if k not in ("run", "mode")}


@pytest.mark.parametrize(("legacy", "mode", "reached"), SPELLINGS,
                         ids=[" ".join(s[1][:2]) for s in SPELLINGS])
def test_legacy_and_subcommand_spellings_reach_the_same_run(monkeypatch, tmp_path, legacy, mode,
                                                            reached):
    out = str(tmp_path / "p.json")
    legacy = [a.replace("{out}", out) for a in legacy]
    mode = [a.replace("{out}", out) for a in mode]
    old_name, old_args = _ran(monkeypatch, legacy)
    new_name, new_args = _ran(monkeypatch, mode)
    assert old_name == new_name == reached[1]
    assert old_args == new_args


@pytest.mark.parametrize(("command", "modes"), [("calibrate", ("micro", "trace", "bench")),
                                                 ("validate", ("grid", "bench"))])
def test_help_lists_the_subcommands(capsys, command, modes):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "{" + ",".join(modes) + "}" in text
    for mode in modes:
        assert f"\n    {mode} " in text, mode


@pytest.mark.parametrize("argv", [
    ["calibrate", "--quick", "micro", "--out", "x.json"],
    ["validate", "--model", "deepseek-v3", "bench", RESULT],
    ["calibrate", "micro"],  # --out is required
    ["calibrate", "trace"],  # the trace is
    ["calibrate", "bench", RESULT, *DEPLOYMENT],  # --out
    ["validate", "grid", "--bench", RESULT],  # grid has no --bench
    ["calibrate", "nosuch"],
])
def test_subcommand_usage_errors_are_one_line(capsys, argv):
    with pytest.raises(SystemExit) as done:
        parse(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("epsim: error:"), err


def test_run_errors_of_a_subcommand_are_one_line(capsys):
    assert main(["validate", "bench", RESULT]) == 2  # the deployment is missing
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model and --hardware" in err


def _mode_parsers() -> list[tuple[str, str, argparse.ArgumentParser]]:
    top = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    found = []
    for command in ("calibrate", "validate"):
        parser = top.choices[command]
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        found += [(command, mode, p) for mode, p in sub.choices.items()]
    return found


def test_every_valued_flag_of_a_subcommand_takes_its_type_from_the_table():
    seen = 0
    for command, mode, parser in _mode_parsers():
        for action in parser._actions:
            if action.nargs == 0 or isinstance(action, argparse._HelpAction):
                continue
            flag = action.option_strings[0] if action.option_strings else \
                "--" + action.dest.replace("_", "-")  # a positional: its legacy flag's spec
            spec = spec_for(flag, command)
            assert isinstance(action.type, Spec), f"{command} {mode} {flag}"
            assert action.type in (spec, Items(spec)), f"{command} {mode} {flag}"
            seen += 1
    assert seen > 40


def test_validate_bench_prints_one_json_object_under_both_spellings(epsim, tmp_path):
    out = tmp_path / "result.json"
    r = epsim("predict", *TINY, "--isl", "48", "--osl", "6", "--num-prompts", "16",
              "--request-rate", "2000", "--save-result", str(out))
    assert r.returncode == 0, r.stderr
    reports = []
    for argv in (["validate", "--bench", str(out)], ["validate", "bench", str(out)]):
        r = epsim(*argv, *TINY, "--json")
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout)  # one object, nothing else on stdout
        report.pop("sim_wall_s", None)
        reports.append(report)
    assert reports[0] == reports[1]


@pytest.mark.parametrize(("argv", "flag"), [
    (["calibrate", "micro", "--out", "{d}/p.json"], "--out"),
    (["calibrate", "bench", RESULT, *DEPLOYMENT, "--out", "{d}/p.json"], "--out"),
    (["calibrate", "trace", RESULT, "--out", "{d}/p.json"], "--out"),
    (["validate", "grid", "--profile", "mi300x", "--plot", "{d}/p.png"], "--plot"),
])
def test_a_subcommands_outputs_are_reserved_before_it_runs(tmp_path, argv, flag):
    from epsim.specs import output_targets

    args = parse([a.replace("{d}", str(tmp_path)) for a in argv])
    assert [(what, str(path)) for what, path in output_targets(args)] == \
        [(flag, argv[-1].replace("{d}", str(tmp_path)))]


def test_an_output_a_subcommand_cannot_write_is_one_line(capsys):
    # reserved before the run: no calibration starts
    assert main(["calibrate", "micro", "--quick", "--out", "/proc/epsim-x.json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write /proc/epsim-x" in err, err
