"""The fidelity benchmark: epsim against the published end-to-end checks of the development set.

    python bench/fidelity.py                  # run every check, print the table and the median
    python bench/fidelity.py --json           # one JSON object instead
    python bench/fidelity.py --write-bands    # ... and rewrite the shipped error bands
    python bench/fidelity.py --only NAME,...  # a few checks (and those their value reads)

The checks are ``bench/data/published_checks.json``: published figures with their sources, each
with the ``epsim`` command that expresses the deployment, the metric as a Python expression over
that command's ``--json`` result (``of(name)`` reads another check's result), the tolerance and
the regime (EP decode, TP decode, prefill, disaggregated) whose error band it counts in. They are
checks, never inputs: no profile number, overhead or default is set from them (docs/fidelity.md).

For each check it prints the prediction, the published figure, the signed error, whether it is
within its tolerance and the component that dominates the step (the largest entry of the step's
breakdown). Then the median |error| over the checks with a figure, and the direction checks.

``--write-bands`` writes ``epsim/data/error_bands.json``: per regime, the median and largest
|error| and the number of checks, stamped with the epsim version and the hash of the shipped
hardware profiles it was measured on. Every prediction's ``error_band`` reads that file
(``epsim/fidelity.py``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECKS = REPO / "bench" / "data" / "published_checks.json"
BANDS = REPO / "src" / "epsim" / "data" / "error_bands.json"


def run_command(argv: list[str]) -> dict:
    """One check's command with ``--json``, in its own process (as a user runs it)."""
    with tempfile.TemporaryDirectory() as scratch:
        r = subprocess.run([sys.executable, "-m", "epsim", *argv, "--json"], capture_output=True,
                           text=True, cwd=scratch, env=dict(os.environ))
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["(no stderr)"])[-1]}
    return json.loads(r.stdout)


def dominant_component(result: dict) -> str:
    """The largest entry of the step's breakdown (``step``: ``breakdown_ms``; ``predict``:
    ``step_breakdown_ms``), as ``name share%``."""
    parts = result.get("breakdown_ms") or result.get("step_breakdown_ms") or {}
    parts = {k: v for k, v in parts.items() if isinstance(v, (int, float)) and v > 0}
    if not parts:
        return "-"
    name = max(parts, key=parts.get)
    return f"{name} {100 * parts[name] / sum(parts.values()):.0f}%"


def evaluate(checks: list[dict], results: dict[str, dict]) -> list[dict]:
    rows = []
    for check in checks:
        result = results[check["name"]]
        row = {"name": check["name"], "regime": check["regime"], "published": check["published"],
               "tolerance": check["tolerance"], "helper": bool(check.get("helper"))}
        if "error" in result:
            row.update(predicted=None, failed=result["error"])
            rows.append(row)
            continue
        names = {k: v for k, v in result.items() if isinstance(v, (int, float, str))}
        try:
            value = eval(check["value"], {"__builtins__": {}},  # noqa: S307 (the shipped file)
                         {**names, "of": lambda n: results[n]})
        except KeyError as missing:  # a check it reads failed
            row.update(predicted=None, failed=f"needs {missing} of a check that failed")
            rows.append(row)
            continue
        row["predicted"] = value
        row["dominant"] = dominant_component(result)
        if isinstance(check["published"], (int, float)) and not isinstance(value, bool):
            err = (value - check["published"]) / check["published"]
            row["error"] = err
            row["within"] = abs(err) <= check["tolerance"]
        elif isinstance(value, bool):
            row["within"] = value
        rows.append(row)
    return rows


def bands(rows: list[dict]) -> dict:
    """Per regime: median and largest |error| over its checks with a published figure."""
    out: dict[str, dict] = {}
    for regime in sorted({r["regime"] for r in rows}):
        errs = [abs(r["error"]) for r in rows if r["regime"] == regime and "error" in r]
        if errs:
            out[regime] = {"median_abs_error": round(statistics.median(errs), 4),
                           "max_abs_error": round(max(errs), 4), "checks": len(errs)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checks", type=Path, default=CHECKS, help="the checks file")
    ap.add_argument("--only", help="comma list of check names")
    ap.add_argument("--jobs", type=int, default=2, help="commands run at once (default 2)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--write-bands", action="store_true",
                    help=f"rewrite {BANDS.relative_to(REPO)} from this run")
    args = ap.parse_args()
    if args.write_bands and args.only:
        ap.error("--write-bands measures every check: it cannot take --only")
    checks = json.loads(args.checks.read_text())["checks"]
    if args.only:
        wanted = set(args.only.split(","))
        needed = {c["name"] for c in checks if c["name"] in wanted}
        for c in checks:  # what the wanted values read through of()
            if c["name"] in wanted:
                needed |= {o["name"] for o in checks if f"of('{o['name']}')" in c["value"]}
        checks = [c for c in checks if c["name"] in needed]
    commands = {c["name"]: c["command"] for c in checks}
    unique = {tuple(v) for v in commands.values()}
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        ordered = sorted(unique)
        by_cmd = dict(zip(ordered, pool.map(run_command, [list(u) for u in ordered]),
                          strict=True))
    results = {name: by_cmd[tuple(cmd)] for name, cmd in commands.items()}
    rows = evaluate(checks, results)
    scored = [r for r in rows if "error" in r]
    median = statistics.median(abs(r["error"]) for r in scored) if scored else None
    judged = [r for r in rows if "within" in r]
    summary = {"checks": len(judged), "within": sum(r["within"] for r in judged),
               "median_abs_error": median, "bands": bands(rows)}
    if args.write_bands:
        from epsim.fidelity import model_version
        from epsim.model import jsonout
        from epsim.model.outputs import write_text_atomic
        BANDS.parent.mkdir(parents=True, exist_ok=True)
        doc = {"about": "expected error of a prediction per regime, from bench/fidelity.py over "
                        "the published checks in bench/data/published_checks.json",
               "measured_on": {**model_version(), "date": dt.date.today().isoformat()},
               "regimes": summary["bands"]}
        write_text_atomic(jsonout.dumps(doc, indent=1) + "\n", BANDS)  # whole or not at all
    if args.json:
        print(json.dumps({"rows": rows, **summary}))
        return 0
    print(f"{'check':45} {'regime':13} {'epsim':>10} {'published':>10} {'error':>7}  ok  dominant")
    for r in rows:
        if r["helper"]:
            continue
        pred = r.get("predicted")
        shown = ("FAILED: " + r["failed"]) if "failed" in r else (
            str(pred) if isinstance(pred, bool) else f"{pred:10.2f}")
        pub = r["published"] if isinstance(r["published"], str) else f"{r['published']:10.2f}"
        err = f"{100 * r['error']:+6.1f}%" if "error" in r else "      -"
        ok = {True: "yes", False: "NO"}.get(r.get("within"), "-")
        print(f"{r['name'][:45]:45} {r['regime']:13} {shown:>10} {pub:>10} {err}  {ok:3} "
              f"{r.get('dominant', '-')}")
    print(f"\nwithin tolerance: {summary['within']} of {summary['checks']}; median |error| "
          + (f"{100 * median:.1f} %" if median is not None else "-"))
    for regime, b in summary["bands"].items():
        print(f"  {regime:13} median {100 * b['median_abs_error']:.1f} %, largest "
              f"{100 * b['max_abs_error']:.1f} %, {b['checks']} checks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
