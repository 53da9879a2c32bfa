"""The installed layout: one top-level package, package data present, nothing reaching outside.

The wheel itself is built and installed in a venv without torch by .ci/run; these checks are the
cheap half that runs with the suite.
"""

import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from epsim.calibrate.validate import DEFAULT_GRID, read_grid, shipped_grids
from epsim.model.config import shipped_models
from epsim.model.loads import read_loads, shipped_loads
from epsim.sim.hardware.profile import shipped_profiles

REPO = Path(__file__).resolve().parents[2]
LAYERS = ("model", "sim", "runtime", "calibrate")


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


SRC = REPO / "src"


def test_the_import_path_is_the_file_path():
    # src layout: epsim.sim.step is src/epsim/sim/step/, found by setuptools under src/
    setuptools = _pyproject()["tool"]["setuptools"]
    assert setuptools["packages"]["find"]["where"] == ["src"]
    assert "package-dir" not in setuptools
    for layer in LAYERS:
        module = __import__(f"epsim.{layer}", fromlist=["_"])
        assert Path(module.__file__).resolve().parent == SRC / "epsim" / layer
    assert sorted(p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__"
                  and not p.name.endswith(".egg-info")) == ["epsim"]


def test_every_package_folder_holding_python_has_an_init():
    # setuptools' find ships only folders with an __init__.py: a module in one without it
    # would be left out of the wheel
    for path in (SRC / "epsim").rglob("*.py"):
        assert (path.parent / "__init__.py").exists(), f"{path.parent} has no __init__.py"


def test_every_package_data_pattern_matches_files():
    setuptools = _pyproject()["tool"]["setuptools"]
    for package, patterns in setuptools["package-data"].items():
        folder = SRC / Path(*package.split("."))
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"{package}: {pattern} matches no file in {folder}"


def test_shipped_data_by_name():
    assert shipped_loads() == ["decode_in1000out1000", "decode_in2000out100", "prefill_in2048",
                               "prefill_in4096"]
    assert read_loads("prefill_in4096").shape == (61, 256)
    assert (resources.files("epsim.model") / "data" / "loads" / "README.md").is_file()
    assert DEFAULT_GRID in shipped_grids() and len(read_grid(DEFAULT_GRID)) >= 12
    assert {"deepseek-r1", "tiny-deepseek"} <= set(shipped_models())
    assert {"mi300x", "h200"} <= set(shipped_profiles())


def test_an_unknown_load_name_lists_the_shipped_ones(epsim):
    r = epsim("balance", "--loads", "decode_nosuch", "--gpus", "8")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "decode_in2000out100" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("command", ["step", "predict", "balance"])
def test_help_lists_the_shipped_load_names(epsim, command):
    text = " ".join(epsim(command, "--help").stdout.split())
    for name in shipped_loads():
        assert name in text, (command, name)


def test_validate_help_names_the_default_grid(epsim):
    text = " ".join(epsim("validate", "grid", "--help").stdout.split())
    assert f"default: the shipped {DEFAULT_GRID!r}" in text


def test_nothing_puts_the_repository_on_the_import_path():
    pattern = re.compile(r"PYTHONPATH|sys\.path\.(insert|append)")
    me = Path(__file__).resolve()
    for folder in ("src", "tests", "bench"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.resolve() == me:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                assert not pattern.search(line), f"{path.relative_to(REPO)}:{number}: {line}"


def test_old_top_level_names_are_not_importable_outside_the_source_tree(tmp_path):
    # from another directory, only the installed distribution is importable: the layers exist
    # as epsim.* and never as top-level packages of their own
    code = ("import importlib.util as u; "
            "print([n for n in ('model', 'sim', 'runtime', 'calibrate') if u.find_spec(n)]); "
            "import epsim.model, epsim.sim, epsim.calibrate")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_shipped_text_by_name_only():
    from epsim.model.shipped import shipped_names, shipped_text

    assert shipped_names("epsim.calibrate", "grids") == ["cpu", "gpu1"]
    assert '"model"' in shipped_text("epsim.calibrate", "grids", "cpu")
    assert shipped_text("epsim.calibrate", "grids", "nosuch") is None
    assert shipped_text("epsim.model", "configs", "../data/loads/prefill_in2048") is None
