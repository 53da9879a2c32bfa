"""Every command in the README's and the docs' code blocks runs in a clone: no file outside
the repository, no flag set that fails. Commands run in order, file by file, in a scratch folder
(so one command's output, ``p.json``, feeds the next) that sees the repository's ``tests/`` and
``bench/``. Three kinds do not run, each listed with why:

    synopses    a line with a placeholder (``FILE``, ``M``, ``[--flag]``, ``A|B``, ``...``): a
                form, not a command (:func:`is_synopsis`)
    SKIPPED     real commands that need what a clone lacks (your own file, torch on a GPU, ROCm)
                or run for minutes (calibration, the benchmarks): by their exact text, with the
                reason
    the rest    run; searches and serving runs with fewer requests and points (REDUCED, flags
                appended: argparse keeps the last), so the whole test takes about a minute

A command the docs change without this table following fails here (an unknown skip is an
error, and a skip that no longer matches a command is one too).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

#: exact command text -> why it does not run here
SKIPPED: dict[str, str] = {
    "python3 -m venv .venv": "installs (what .ci/run does in a fresh clone)",
    ". .venv/bin/activate": "installs (what .ci/run does in a fresh clone)",
    "pip install .": "installs (what .ci/run does in a fresh clone)",
    "pip install torch==2.13.0": "installs (what .ci/run does in a fresh clone)",
    "pip install -e '.[runtime,dev,plot]'": "installs (what .ci/run does in a fresh clone)",
    "python -m pytest -q": "the whole suite, this test among it",
    "epsim describe --model path/to/config.json": "your own config.json",
    "epsim validate bench result.json --model deepseek-v3 --hardware mi300x --dp 8 --ep 8":
        "your own vllm / sglang result (the shipped examples run in docs/validation.md's)",
    "epsim balance --loads my_decode.json,prefill_in4096 --gpus 8 --redundant-experts 32 "
    "--out p.json": "your own load file",
    "epsim calibrate micro --out cpu.json": "calibration: about 2 minutes on 2 cores "
                                      "(tests/calibrate/test_validate.py runs --quick)",
    "epsim validate grid --profile cpu.json --grid cpu": "needs the calibrated cpu.json (minutes)",
    "epsim calibrate micro --out cpu.json --quick": "torch ranks measuring this machine "
                                              "(tests/calibrate/test_validate.py runs it)",
    "epsim step --model tiny-deepseek --hardware cpu.json --gpus-per-node 2 --dp 2 --ep 2 "
    "--batch 8 --context 256 --no-graph": "needs the calibrated cpu.json",
    "epsim calibrate micro --device cuda --out gpu.json": "a CUDA GPU",
    "python bench/fidelity.py": "a benchmark: minutes (tests/cli/test_error_band.py checks its bands)",
    "python bench/fidelity.py --write-bands": "rewrites the shipped error bands",
    "python bench/bench_predict.py --reproduce": "a benchmark: minutes",
    "python bench/kernel_report.py": "a benchmark: minutes",
    "python bench/bench_exchange_overlap.py": "a benchmark: minutes",
}

#: command -> flags appended to keep the run short (argparse keeps a repeated flag's last value)
REDUCED: dict[str, list[str]] = {
    "predict": ["--num-prompts", "64"],
    "sweep": ["--concurrency", "1,16", "--num-prompts", "32"],
    "tune": ["--concurrency", "16,64", "--num-prompts", "64", "--dbo", "on", "--workers", "1"],
    "plan": ["--concurrency", "16,64", "--num-prompts", "64", "--dbo", "on", "--workers", "1"],
}

_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\.\w+)?$|^\[|\]$|\.\.\.|\||[()]")


def is_synopsis(argv: list[str]) -> bool:
    """A form with placeholders, not a command: an upper-case word (``FILE``, ``M``,
    ``TRACE.json``), an optional ``[--flag]``, alternatives ``a|b``, ``...`` or a
    parenthesised remark."""
    return any(_PLACEHOLDER.search(word) for word in argv[1:])


#: what a command line of a block without a language starts with (the others are diagrams)
COMMAND_WORDS = ("epsim ", "python ", "python3 ", "torchrun ", "pip ")


def doc_commands(path: Path) -> list[tuple[int, str]]:
    """(line, command) of every command in ``path``'s ``bash`` blocks and of the command lines
    of its blocks without a language: continuations joined, comments dropped, ``a && b`` as two
    commands."""
    out = []
    block, start, pending = None, 0, ""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            block = line.strip()[3:] if block is None else None
            continue
        if block not in ("bash", ""):
            continue
        if not pending:
            if block == "" and not line.startswith(COMMAND_WORDS):
                continue
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        words = shlex.split(pending + line, comments=True)
        pending = ""
        command: list[str] = []
        for word in [*words, "&&"]:
            if word != "&&":
                command.append(word)
            elif command:
                out.append((start, shlex.join(command)))
                command = []
    return out


def _all() -> list[tuple[str, int, str]]:
    return [(p.name, n, c) for p in DOCS for n, c in doc_commands(p)]


def test_every_skip_names_a_command_of_the_docs():
    commands = {c for _, _, c in _all()}
    assert sorted(set(SKIPPED) - commands) == []


def _argv(command: str) -> list[str] | None:
    """The argv to run, or None for a synopsis or a skipped command."""
    argv = shlex.split(command)
    if command in SKIPPED or is_synopsis(argv):
        return None
    if argv[0] == "epsim":
        argv = [sys.executable, "-m", "epsim", *argv[1:], *REDUCED.get(argv[1], [])]
    elif argv[:3] == ["python", "-m", "epsim"] or argv[:1] == ["python"]:
        argv = [sys.executable, *argv[1:]]
    else:
        raise AssertionError(f"neither run nor skipped (add it to SKIPPED with why): {command}")
    return argv


#: commands run in their own process (pools, ranks); the rest run in this one, which saves
#: each its interpreter's start and imports
OWN_PROCESS = {"run", "sweep", "tune", "plan"}


def _run(argv: list[str], cwd: Path, capsys) -> tuple[int, str]:
    """(status, stderr) of one command."""
    if argv[1:3] == ["-m", "epsim"] and argv[3] not in OWN_PROCESS:
        from epsim import cli

        try:
            status = cli.main(argv[3:])
        except SystemExit as exc:  # --help
            status = int(exc.code or 0)
        return status, capsys.readouterr().err
    r = subprocess.run(argv, cwd=cwd, env=dict(os.environ, MPLBACKEND="Agg"),
                       capture_output=True, text=True, timeout=300)
    return r.returncode, r.stderr


@pytest.mark.parametrize("doc", [p.name for p in DOCS])
def test_the_commands_of_a_doc_run_in_a_clone(doc, tmp_path, monkeypatch, capsys):
    commands = [(n, c) for name, n, c in _all() if name == doc]
    runs = [(n, c, _argv(c)) for n, c in commands]
    runs = [(n, c, argv) for n, c, argv in runs if argv is not None]
    if not runs:
        pytest.skip(f"{doc}: no command that runs here")
    if any("run" in argv[3:4] for _, _, argv in runs):
        pytest.importorskip("torch")
    for name in ("tests", "bench"):
        (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    for n, command, argv in runs:
        status, stderr = _run(argv, tmp_path, capsys)
        assert status == 0, f"{doc}:{n}: {command}\n{stderr[-2000:]}"
