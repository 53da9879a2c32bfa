"""The development checks shipped as deployment files (``bench/deployments/``, written by
``bench/deployments.py``) give what their commands give: every file, read with ``--config``,
parses to the same arguments as the command it records, and a predict case to the same
scenario."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from epsim.cli import parse
from epsim.options import scenario_from_args

FILES = sorted((Path(__file__).resolve().parents[2] / "bench" / "deployments").glob("*.yaml"))


def _args(argv: list[str]) -> dict:
    return {k: v for k, v in vars(parse(argv)).items()
            if k not in ("config", "run") and not k.startswith("_given_")}


def test_the_development_checks_are_shipped_as_files():
    assert len(FILES) >= 40
    assert {yaml.safe_load(f.read_text())["_command"][1] for f in FILES} == {"predict", "step"}


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_a_deployment_file_equals_its_command(path):
    body = yaml.safe_load(path.read_text())
    command = [str(a) for a in body["_command"][1:]]
    from_file = _args([command[0], "--config", str(path)])
    assert from_file == _args(command)
    if command[0] == "predict":
        assert scenario_from_args(parse([command[0], "--config", str(path)])) == \
            scenario_from_args(parse(command))
