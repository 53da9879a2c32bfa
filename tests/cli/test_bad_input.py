"""Every class of bad input the reliability review found, through the commands themselves: one
line on stderr, exit status 2, no traceback, nothing written or replaced (docs/design.md
section 5 lists the classes)."""

import json
import os
import stat
import subprocess
import sys

import pytest
from conftest import REPO
from test_signals import descendants

from epsim.cli import main

R1 = ["--model", "deepseek-r1", "--hardware", "mi300x"]
LENGTHS = ["--isl", "100", "--osl", "10"]
SLO = ["--slo", "median_itl_ms<=100"]


def cli(*argv: str, capsys) -> tuple[int, str, str]:
    """``epsim ARGV`` in this process: (exit status, stdout, stderr)."""
    try:
        status = main(list(argv))
    except SystemExit as exc:
        status = exc.code
    out = capsys.readouterr()
    return status, out.out, out.err


def refused(capsys, *argv: str, match: str = "") -> str:
    status, out, err = cli(*argv, capsys=capsys)
    assert status == 2, (argv, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert match in err, err
    return err


@pytest.fixture
def targets(tmp_path, monkeypatch):
    """A FIFO and a directory in a temp folder (never a device of the machine), cwd there."""
    monkeypatch.chdir(tmp_path)
    os.mkfifo("fifo")
    os.mkdir("folder")
    yield tmp_path
    assert stat.S_ISFIFO(os.stat(tmp_path / "fifo").st_mode)  # never replaced
    assert (tmp_path / "folder").is_dir() and not any((tmp_path / "folder").iterdir())


OUTPUT_FLAGS = [
    ["step", *R1, "--batch", "8", "--context", "64", "--trace"],
    ["predict", *R1, *LENGTHS, "--concurrency", "4", "--trace"],
    ["run", "--model", "tiny-deepseek", "--batch", "2", "--context", "4", "--trace"],
    ["balance", "--loads", "decode_in2000out100", "--gpus", "8", "--out"],
    ["calibrate", "--quick", "--out"],
    ["sweep", *R1, *LENGTHS, "--concurrency", "4", "--csv"],
    ["sweep", *R1, *LENGTHS, "--concurrency", "4", "--plot"],
    ["validate", "--profile", "mi300x", "--plot"],
]


@pytest.mark.parametrize("argv", OUTPUT_FLAGS, ids=lambda a: f"{a[0]} {a[-1]}")
@pytest.mark.parametrize("target", ["fifo", "folder"])
def test_an_output_that_is_not_a_regular_file_is_refused_before_work(argv, target, targets,
                                                                       capsys):
    kind = "a FIFO" if target == "fifo" else "a directory"
    refused(capsys, *argv, target, match=f"cannot write {target}: it is {kind}")
    assert sorted(p.name for p in targets.iterdir()) == ["fifo", "folder"]


@pytest.mark.parametrize("argv", [
    ["sweep", *R1, *LENGTHS, "--concurrency", "4", "--csv", "/proc/epsim-x.csv"],
    ["calibrate", "--quick", "--out", "/proc/epsim-x.json"],
    ["validate", "--profile", "mi300x", "--plot", "/proc/epsim-x.png"],
    ["balance", "--loads", "decode_in2000out100", "--gpus", "8", "--out", "/proc/epsim-x.json"],
], ids=lambda a: a[0])
def test_an_output_folder_where_no_file_can_be_created_is_one_line(argv, capsys):
    refused(capsys, *argv, match="cannot write /proc/epsim-x")


def test_partial_results_are_never_left_behind(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    refused(capsys, "sweep", *R1, *LENGTHS, "--concurrency", "4", "--csv", "ok.csv",
            "--plot", "/nodir/x.png", match="folder /nodir does not exist")
    assert not any(tmp_path.iterdir())

    # a failure after the CSV was staged: neither output appears
    import epsim.commands.sweep as sweep
    from epsim.model.errors import EpsimError

    def plot_fails(*_args):
        raise EpsimError("the plot failed")

    monkeypatch.setattr(sweep, "write_plot", plot_fails)
    refused(capsys, "sweep", *R1, *LENGTHS, "--concurrency", "4", "--csv", "ok.csv",
            "--plot", "fig.png", match="the plot failed")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("argv", "match"), [
    (["predict", *R1, *LENGTHS, "--seed", "-1"], "--seed: expected an integer in [0, 4294967295]"),
    (["sweep", *R1, *LENGTHS, "--seed", "-1"], "--seed"),
    (["tune", *R1, *LENGTHS, *SLO, "--seed", "-1"], "--seed"),
    (["predict", *R1, *LENGTHS, "--num-prompts", "99999999999999999999"], "--num-prompts"),
    (["predict", *R1, "--isl", "99999999999999999999", "--osl", "10"], "--isl"),
    (["balance", "--loads", "decode_in2000out100", "--gpus", "8", "--max-moves",
      "99999999999999999999"], "--max-moves"),
    (["plan", "--model", "deepseek-r1", *LENGTHS, *SLO, "--target-output-throughput", "1e300"],
     "--target-output-throughput: expected a number in (0, 1e+10]"),
    (["tune", *R1, *LENGTHS, "--slo", "median_itl_ms<=-5"], "the bound must be positive"),
    (["step", *R1, "--batch", "8", "--context", "64", "--mem-fraction", "1.5"], "(0, 1]"),
], ids=lambda v: v[0] if isinstance(v, list) else None)
def test_numbers_out_of_their_stated_range_are_one_line(argv, match, capsys):
    refused(capsys, *argv, match=match)


@pytest.mark.parametrize(("argv", "match"), [
    (["plan", "--model", "deepseek-r1", "--hardware", "mi300x,nosuch", *LENGTHS, *SLO,
      "--target-output-throughput", "1000"], "unknown hardware profile 'nosuch'"),
    (["tune", *R1, *LENGTHS, *SLO, "--splits", "8x1,4x3"], "--splits 4x3:"),
    (["plan", "--model", "deepseek-r1", *LENGTHS, *SLO, "--target-output-throughput", "1000",
      "--gpu-hour-usd", "bogus=2"], "--gpu-hour-usd prices bogus, which is not searched"),
    (["sweep", *R1, *LENGTHS, "--concurrency", "32,,64"], "an empty item in '32,,64'"),
    (["sweep", *R1, *LENGTHS, "--concurrency", "32,32"], "'32' is given twice"),
    (["step", *R1, "--batch", "8", "--context", "999999"], "exceed deepseek-r1's context"),
    (["predict", *R1, "--isl", "170000", "--osl", "10"], "context"),
], ids=lambda v: v[0] if isinstance(v, list) else None)
def test_unknown_or_malformed_is_an_error_never_a_skip(argv, match, capsys):
    refused(capsys, *argv, match=match)


def test_a_placement_of_non_integer_ids_is_refused_not_truncated(tmp_path, capsys):
    status, _, _ = cli("balance", "--loads", "decode_in2000out100", "--gpus", "8", "--out",
                       str(tmp_path / "p.json"), capsys=capsys)
    assert status == 0
    placement = json.loads((tmp_path / "p.json").read_text())
    placement["physical_to_logical"][3][5] = 7.5
    (tmp_path / "bad.json").write_text(json.dumps(placement))
    refused(capsys, "balance", "--loads", "decode_in2000out100", "--gpus", "8", "--previous",
            str(tmp_path / "bad.json"), match="non-integer id 7.5")


def test_a_bad_value_from_a_fresh_process_is_one_line_without_traceback():
    """The same rule end to end (``python -m epsim``), as a user meets it."""
    r = subprocess.run([sys.executable, "-m", "epsim", "predict", *R1, *LENGTHS, "--seed", "-1"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_sigterm_during_a_command_leaves_no_output_and_no_temp_file(tmp_path):
    """The output is checked before the work and held in memory during it (no temp file on
    disk, which a kill would leave): SIGTERM then ends the command in one line (exit 143) and
    the target never appears. tests/cli/test_signals.py covers every signal and the pool."""
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-m", "epsim", "sweep", *R1, "--isl", "2000", "--osl",
                          "100", "--concurrency", "256,512,1024,2048,3072,4096", "--kv-dtype",
                          "fp8,bf16", "--workers", "2", "--csv", str(tmp_path / "out.csv")],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(descendants(p.pid)) < 4 and time.monotonic() < deadline:  # the pool runs
            time.sleep(0.05)
        assert len(descendants(p.pid)) >= 4, "the search never started"
        assert list(tmp_path.iterdir()) == []  # reserved, but nothing on disk
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 143
    assert err.splitlines() == ["epsim sweep: error: terminated by SIGTERM"]
    assert list(tmp_path.iterdir()) == []


def test_a_flag_the_chosen_mode_would_ignore_is_refused(tmp_path, capsys):
    bench = tmp_path / "result.json"
    bench.write_text("{}")
    refused(capsys, "calibrate", "--device", "cuda", "--out", str(tmp_path / "p.json"),
            "--exchange-fit", "slowest", match="--exchange-fit")
    refused(capsys, "validate", "--bench", str(bench), "--no-probe-scaling",
            match="--no-probe-scaling")
