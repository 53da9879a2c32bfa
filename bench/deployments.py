"""The development checks as deployment files: ``bench/deployments/*.yaml``.

    python bench/deployments.py                         # from ../shared/data/published-checks
    python bench/deployments.py --checks DIR --out DIR  # another copy of the checks

Each published check (``checks.json``: twelve published results and a direction check;
``inferencex/cases.json``: the InferenceX development split) comes with the epsim command that
expresses it. This writes each as a deployment file that ``--config`` reads (``epsim predict
--config bench/deployments/NAME.yaml``; ``tune``, ``validate bench`` and ``calibrate bench``
take the same file): the command's flags under the groups of a scenario (``--help=GROUP``),
with the check's source, published figures and the command itself as comment keys (``_...``).
``tests/cli/test_deployments.py`` holds every file against its command: the same scenario.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from epsim.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
CHECKS = REPO.parent / "shared" / "data" / "published-checks"
OUT = REPO / "bench" / "deployments"


def _group_of(command: argparse.ArgumentParser) -> dict[str, str]:
    """dest -> the group a deployment file nests it under (the ``--help=GROUP`` name of the
    argument group that holds its flag; top level for the rest: model, hardware, a step's
    batch)."""
    return {a.dest: getattr(g, "epsim_group", "") for g in command._action_groups
            for a in g._group_actions}


def _scalar(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def deployment_file(argv: list[str]) -> dict[str, Any]:
    """The flags of ``argv`` (``predict ...`` or ``step ...``) as a nested mapping."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = sub.choices[argv[0]]
    groups = _group_of(command)
    out: dict[str, Any] = {}
    i = 1
    while i < len(argv):
        flag = argv[i]
        action = command._option_string_actions[flag]
        takes = action.nargs not in (0,) and not isinstance(
            action, argparse._StoreConstAction | argparse._StoreTrueAction)
        values: list[str] = []
        while takes and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            values.append(argv[i + 1])
            i += 1
            if action.nargs != "+":
                break
        i += 1
        if isinstance(action, argparse._StoreConstAction):  # a switch: the field's value
            value: Any = action.const
        elif flag.startswith("--no-"):  # --no-dbo: the on/off field off
            value = False
        elif not values:  # --dbo alone
            value = True
        elif action.nargs == "+":
            value = [_scalar(v) for v in values]
        else:
            value = _scalar(values[0])
        group = groups.get(action.dest, "")
        (out.setdefault(group, {}) if group else out)[action.dest] = value
    return out


def _cases(checks: Path) -> list[tuple[str, list[str], dict[str, Any]]]:
    out = []
    for check in json.loads((checks / "checks.json").read_text()):
        if isinstance(check.get("command"), list):
            meta = {k: check[k] for k in ("what", "metric", "published", "tolerance", "source")
                    if k in check}
            out.append((check["name"].replace("/", "-"), check["command"], meta))
    for case in json.loads((checks / "inferencex" / "cases.json").read_text())["cases"]:
        meta = {"published": case["published"], "regime": case["regime"],
                "image": case["image"], "date": case["date"],
                "source": case["source"].get("run_url"), "notes": case.get("notes", [])}
        out.append((case["id"], ["predict", *case["args"]], meta))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checks", type=Path, default=CHECKS)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, argv, meta in _cases(args.checks):
        body = {"_check": name, **{f"_{k}": v for k, v in meta.items()},
                "_command": ["epsim", *argv], **deployment_file(argv)}
        text = yaml.safe_dump(body, sort_keys=False, width=100, allow_unicode=True)
        (args.out / f"{name}.yaml").write_text(text)
    print(f"wrote {len(_cases(args.checks))} deployment files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
