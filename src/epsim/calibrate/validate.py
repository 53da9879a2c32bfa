"""Validation: run the runtime over a grid of configurations, simulate the same, compare.

A grid file is a JSON list of runtime configurations::

    [{"model": "tiny-deepseek", "world_size": 2, "batch": 8, "context": 64, "dbo": false},
     {"model": "path/to/config.json", "world_size": 4, "ep": 4, "dp": 4, "batch": 32,
      "context": 256, "dbo": true, "placement": "placement.json"}]

(``ep``, ``dp``, ``dbo``, ``placement`` optional; defaults as ``epsim run``.) Each case runs on
local ranks through ``epsim.runtime.launch.launch_local`` (``epsim run``'s machinery; the cases of one
world size share one launch) with per-op tracing, and the same model, plan, placement and batch
go through ``epsim.sim.step.simulate.simulate_step`` under the profile, one simulated step per timed runtime
step (the context grows by one per step, as in the runtime).

Disjointness: a fitted profile lists the configurations its microbenchmarks ran
(``calibration.configs``: model shape, world size, batch, context, DBO). ``check_disjoint``
refuses a grid case whose model shape, world size, batch, context and DBO equal one of them, and
the shipped calibration shapes are none of the shipped models, so the default grid never
overlaps (``tests/calibrate/test_validate.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from epsim.model.bounds import (
    MAX_BATCH,
    MAX_GPUS,
    MAX_TOKENS,
    check_count,
    read_json_file,
    show,
)
from epsim.model.config import ModelConfig, load_model
from epsim.model.errors import EpsimError
from epsim.model.opgraph import Batch
from epsim.model.outputs import check_output_target, staged_path
from epsim.model.shipped import shipped_names, shipped_text
from epsim.sim.hardware.profile import HardwareProfile

#: the shipped grid ``epsim validate`` runs without ``--grid`` (``calibrate/grids/cpu.json``)
DEFAULT_GRID = "cpu"
_CASE_KEYS = {"model", "world_size", "ep", "dp", "batch", "context", "dbo", "placement"}


@dataclass(frozen=True)
class Case:
    """One validation configuration (a row of the grid file).

    model: shipped name or config.json path. Example: ``"tiny-deepseek-wide"``.
    world_size: local ranks. Example: 4.
    batch / context: sequences per rank and their context in the first step. Example: 32 / 256.
    dbo: two microbatches.
    ep / dp: as ``epsim run`` (None: the world size).
    placement: expert placement file, None: contiguous.
    """

    model: str
    world_size: int
    batch: int
    context: int
    dbo: bool = False
    ep: int | None = None
    dp: int | None = None
    placement: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "world_size": self.world_size, "ep": self.ep,
                "dp": self.dp, "batch": self.batch, "context": self.context, "dbo": self.dbo,
                "placement": self.placement}

    def label(self) -> str:
        return (f"{Path(self.model).stem} w{self.world_size} b{self.batch} c{self.context} "
                f"{'dbo' if self.dbo else 'no-dbo'}")


def _int(obj: Mapping[str, Any], key: str, where: str, required: bool) -> int | None:
    if key not in obj or obj[key] is None:
        if required:
            raise EpsimError(f"{where}: lacks required key {key!r}")
        return None
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EpsimError(f"{where}: {key} must be a positive integer, got {show(value)}")
    # bounded before the runtime spawns world_size ranks or allocates batch x context
    return check_count(value, GRID_BOUNDS[key], key, where)


#: a grid case's counts -> their bound (epsim.model.bounds, docs/inputs.md)
GRID_BOUNDS = {"world_size": MAX_GPUS, "ep": MAX_GPUS, "dp": MAX_GPUS, "batch": MAX_BATCH,
               "context": MAX_TOKENS}


def parse_grid(obj: Any, where: str = "grid") -> list[Case]:
    """Validate a parsed grid (a JSON list of configuration objects) into cases."""
    if not isinstance(obj, list) or not obj:
        raise EpsimError(f"{where}: a validation grid must be a non-empty JSON list of "
                         "configurations")
    cases = []
    for i, item in enumerate(obj):
        at = f"{where}[{i}]"
        if not isinstance(item, Mapping):
            raise EpsimError(f"{at}: a configuration must be a JSON object")
        unknown = sorted(set(item) - _CASE_KEYS)
        if unknown:
            raise EpsimError(f"{at}: unknown key(s) {', '.join(unknown)} (known: "
                             f"{', '.join(sorted(_CASE_KEYS))})")
        model = item.get("model")
        if not isinstance(model, str) or not model:
            raise EpsimError(f"{at}: model must be a model name or config.json path, "
                             f"got {model!r}")
        dbo = item.get("dbo", False)
        if not isinstance(dbo, bool):
            raise EpsimError(f"{at}: dbo must be true or false, got {dbo!r}")
        placement = item.get("placement")
        if placement in ("contiguous", ""):
            placement = None
        if placement is not None and not isinstance(placement, str):
            raise EpsimError(f"{at}: placement must be a file path or null, got {placement!r}")
        cases.append(Case(model=model, world_size=_int(item, "world_size", at, True),
                          batch=_int(item, "batch", at, True),
                          context=_int(item, "context", at, True), dbo=dbo,
                          ep=_int(item, "ep", at, False), dp=_int(item, "dp", at, False),
                          placement=placement))
    return cases


def shipped_grids() -> list[str]:
    """Names of the validation grids shipped with epsim. Example: ``["cpu", "gpu1"]``."""
    return shipped_names("epsim.calibrate", "grids")


def read_grid(name_or_path: str | Path) -> list[Case]:
    """Read and validate a grid: a shipped name (``cpu``, ``gpu1``) or a grid file; an existing
    file wins over a shipped name."""
    text = str(name_or_path)
    if not Path(text).is_file():
        shipped = shipped_text("epsim.calibrate", "grids", text)
        if shipped is None:
            raise EpsimError(f"grid file not found: {text} (nor a shipped grid: "
                             f"{', '.join(shipped_grids())})")
        return parse_grid(json.loads(shipped), f"grid {text!r}")
    return parse_grid(read_json_file(name_or_path, "grid file", kind="grid"), text)


def shape_signature(model: ModelConfig) -> str:
    """A short hash of everything in a model config but its name (two files of the same shape
    have the same signature)."""
    return hashlib.sha1(repr(replace(model, name="")).encode()).hexdigest()[:12]


def case_key(shape: str, world_size: int, batch: int, context: int, dbo: bool) -> tuple:
    return (shape, int(world_size), int(batch), int(context), bool(dbo))


def check_disjoint(calibration_configs: Sequence[Mapping[str, Any]], cases: Sequence[Case],
                   models: Mapping[str, ModelConfig]) -> None:
    """Refuse a validation case that is also a calibration configuration (same model shape, world
    size, batch, context and DBO)."""
    fitted = {case_key(c["shape"], c["world_size"], c["batch"], c["context"], c["dbo"])
              for c in calibration_configs}
    for case in cases:
        key = case_key(shape_signature(models[case.model]), case.world_size, case.batch,
                       case.context, case.dbo)
        if key in fitted:
            raise EpsimError(f"validation case {case.label()} was also used to fit the profile: "
                             "fitting and validation configurations must be disjoint")


# --------------------------------------------------------------------------------------------
# running and simulating
# --------------------------------------------------------------------------------------------


def run_cases(cases: Sequence[Case], steps: int, repeats: int = 1, device: str = "cpu",
              timeout_s: float = 120.0, before_launch: Callable[[], Any] | None = None
              ) -> list[dict[str, Any]]:
    """Run every case on the runtime; per case the measured step times and per-kind op times.

    Each pass runs the cases of one world size in one launch, then the next world size's;
    ``repeats`` passes alternate so that slow drifts and bursts of the machine's background load
    are spread over every case. ``before_launch`` runs before each launch (the machine probe).

    Returns:
        Per case (in order): ``step_ms`` (every timed step of every pass: the slowest rank's),
        ``pass_ms`` (per pass, the median of its timed steps), ``kind_ms`` ({kind: [per timed
        step: mean over ranks of the kind's summed op time]}).
    """
    from epsim.runtime import RunOptions, launch_local

    out: list[dict[str, Any]] = [{"step_ms": [], "pass_ms": [], "kind_ms": {}} for _ in cases]
    worlds = sorted({c.world_size for c in cases})
    # passes alternate between the world sizes, so a burst of background load on the machine
    # lands on some steps of many cases rather than on every step of a few
    for _ in range(repeats):
        for world in worlds:
            if before_launch is not None:
                before_launch()
            index = [i for i, c in enumerate(cases) if c.world_size == world]
            options = [RunOptions(model=cases[i].model, world_size=world, batch=cases[i].batch,
                                  context=cases[i].context, steps=steps, dp=cases[i].dp,
                                  ep=cases[i].ep, dbo=cases[i].dbo,
                                  placement=cases[i].placement, device=device, trace=True)
                       for i in index]
            summaries = launch_local(options, world, timeout_s=timeout_s)
            for i, summary in zip(index, summaries, strict=True):
                timed = _timed_steps(summary, steps)
                out[i]["step_ms"].extend(timed)
                out[i]["pass_ms"].append(statistics.median(timed))
                for kind, per_step in _kind_ms(summary, world, steps).items():
                    out[i]["kind_ms"].setdefault(kind, []).extend(per_step)
    return out


def _timed_steps(summary: Mapping[str, Any], steps: int) -> list[float]:
    """The slowest rank's wall time of each timed decode step (the first is a warm-up)."""
    return [float(ms) for ms in summary["step_ms_per_step"][1:steps]]


def _kind_ms(summary: Mapping[str, Any], world: int, steps: int) -> dict[str, list[float]]:
    """{kind: [per timed step: mean over ranks of the kind's summed op ms]}."""
    acc: dict[str, dict[int, float]] = {}
    for e in summary["trace_events"]:
        step = e.args.get("step", 0)
        if step < 1:
            continue
        acc.setdefault(e.kind, {})
        acc[e.kind][step] = acc[e.kind].get(step, 0.0) + e.dur_us / 1e3 / world
    return {k: [v.get(s, 0.0) for s in range(1, steps)] for k, v in acc.items()}


def simulate_case(case: Case, profile: HardwareProfile, steps: int) -> dict[str, Any]:
    """Simulate the timed steps of ``case`` (contexts ``context + 1 ... context + steps - 1``):
    the runtime's own plan and placement, uniform routing (the runtime's random router weights
    have no trained skew), one routing seed per step.

    Returns:
        ``step_ms`` [timed steps], ``kind_ms`` {kind: [per step: mean over ranks of the kind's
        summed op ms]}.
    """
    from epsim.runtime.options import RunOptions, validate
    from epsim.sim.step import StepMemo, simulate_step

    opts = RunOptions(model=case.model, world_size=case.world_size, batch=case.batch,
                      context=case.context, steps=steps, dp=case.dp, ep=case.ep, dbo=case.dbo,
                      placement=case.placement)
    model, plan, placement = validate(opts)
    step_ms: list[float] = []
    kind_ms: dict[str, list[float]] = {}
    memo = StepMemo()  # the case's steps share one structure
    for s in range(1, steps):
        r = simulate_step(model, plan, Batch.decode(case.batch, case.context + s), profile,
                          placement=placement if plan.expert_parallel else None, eplb=False,
                          seed=s, trace=True, synthetic="uniform", memo=memo)
        step_ms.append(r.step_ms)
        per_kind: dict[str, float] = {}
        for e in r.events:
            per_kind[e.kind] = per_kind.get(e.kind, 0.0) + e.dur_us / 1e3 / case.world_size
        for k, v in per_kind.items():
            kind_ms.setdefault(k, []).append(v)
    return {"step_ms": step_ms, "kind_ms": kind_ms}


def adjust_for_load(cases: Sequence[Case], predicted: Sequence[Mapping[str, Any]],
                    ratio: float, cores: int) -> list[dict[str, Any]]:
    """The predictions scaled by the machine's state: each case's times times
    ``probe.load_factor(ratio, world size, cores)``, which each result keeps as
    ``load_factor`` beside its ``unadjusted_step_ms``."""
    from .probe import load_factor

    out = []
    for case, p in zip(cases, predicted, strict=True):
        f = load_factor(ratio, case.world_size, cores)
        out.append({"step_ms": [v * f for v in p["step_ms"]],
                    "kind_ms": {k: [v * f for v in vs] for k, vs in p["kind_ms"].items()},
                    "unadjusted_step_ms": list(p["step_ms"]), "load_factor": f})
    return out


def compare(cases: Sequence[Case], measured: Sequence[Mapping[str, Any]],
            predicted: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The validation report (``epsim validate --json``)."""
    rows = []
    for case, m, p in zip(cases, measured, predicted, strict=True):
        # judged on the median of its passes' medians: a pass run while the machine was busy
        # moves the case as little as a slow step moves a pass
        passes = m.get("pass_ms") or [statistics.median(m["step_ms"])]
        meas = statistics.median(passes)
        pred = statistics.median(p["step_ms"])
        kinds = sorted(set(m["kind_ms"]) | set(p["kind_ms"]))
        per_kind = {}
        for k in kinds:
            mk = statistics.median(m["kind_ms"][k]) if k in m["kind_ms"] else 0.0
            pk = statistics.median(p["kind_ms"][k]) if k in p["kind_ms"] else 0.0
            per_kind[k] = {"measured_ms": mk, "predicted_ms": pk,
                           "error_pct": (pk - mk) / mk * 100 if mk > 0 else None}
        rows.append({"configuration": case.to_json(), "label": case.label(),
                     "measured_ms": meas, "predicted_ms": pred,
                     "error_pct": (pred - meas) / meas * 100,
                     "measured_p10_ms": float(np.percentile(m["step_ms"], 10)),
                     "measured_p90_ms": float(np.percentile(m["step_ms"], 90)),
                     "measured_pass_ms": [float(v) for v in passes],
                     "pass_spread_pct": (max(passes) - min(passes)) / meas * 100,
                     "pass_error_pct": [(pred - v) / v * 100 for v in passes],
                     "timed_steps": len(m["step_ms"]), "per_kind_ms": per_kind})
        if "load_factor" in p:
            rows[-1]["load_factor"] = p["load_factor"]
            rows[-1]["predicted_unadjusted_ms"] = statistics.median(p["unadjusted_step_ms"])
    errs = np.abs([r["error_pct"] for r in rows])
    spreads = [r["pass_spread_pct"] for r in rows]
    return {"cases": rows,
            "median_pass_spread_pct": float(np.median(spreads)),
            "max_pass_spread_pct": float(np.max(spreads)),
            "median_abs_error_pct": float(np.median(errs)),
            "p90_abs_error_pct": float(np.percentile(errs, 90)),
            "max_abs_error_pct": float(np.max(errs))}


def plot(report: Mapping[str, Any], path: str | Path) -> None:
    """Measured against predicted step time, one point per case (matplotlib, imported here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = report["cases"]
    meas = np.array([c["measured_ms"] for c in cases])
    pred = np.array([c["predicted_ms"] for c in cases])
    fig, ax = plt.subplots(figsize=(6, 5.5))
    lo, hi = 0.8 * min(meas.min(), pred.min()), 1.25 * max(meas.max(), pred.max())
    xs = np.array([lo, hi])
    ax.plot(xs, xs, "k-", lw=1, label="predicted = measured")
    ax.fill_between(xs, xs * 0.9, xs * 1.1, color="tab:green", alpha=0.15, label="±10%")
    ax.fill_between(xs, xs * 0.75, xs * 1.25, color="tab:orange", alpha=0.08, label="±25%")
    markers = {(w, d): m for (w, d), m in zip(
        [(2, False), (2, True), (4, False), (4, True)], ["o", "s", "^", "D"], strict=True)}
    for c, x, y in zip(cases, meas, pred, strict=True):
        cfg = c["configuration"]
        wide = "wide" in str(cfg["model"])
        ax.scatter([x], [y], marker=markers.get((cfg["world_size"], cfg["dbo"]), "x"),
                   color="tab:red" if wide else "tab:blue", s=36)
    for (w, d), m in markers.items():
        ax.scatter([], [], marker=m, color="grey", label=f"world {w}, {'DBO' if d else 'no DBO'}")
    ax.scatter([], [], marker="o", color="tab:blue", label="tiny-deepseek")
    ax.scatter([], [], marker="o", color="tab:red", label="tiny-deepseek-wide")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step time (ms, runtime median)")
    ax.set_ylabel("predicted step time (ms, simulator)")
    ax.set_title(f"epsim validate: |error| median {report['median_abs_error_pct']:.1f}%, "
                 f"max {report['max_abs_error_pct']:.1f}%", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    try:
        with staged_path(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)


def kind_summary(report: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Per op kind over the cases: summed measured and predicted ms per step, and the median
    of the per-case relative errors."""
    out: dict[str, dict[str, Any]] = {}
    for c in report["cases"]:
        for k, v in c["per_kind_ms"].items():
            d = out.setdefault(k, {"measured_ms": 0.0, "predicted_ms": 0.0, "errors": []})
            d["measured_ms"] += v["measured_ms"]
            d["predicted_ms"] += v["predicted_ms"]
            if v["error_pct"] is not None:
                d["errors"].append(v["error_pct"])
    return {k: {"measured_ms_sum": d["measured_ms"], "predicted_ms_sum": d["predicted_ms"],
                "median_error_pct": float(np.median(d["errors"])) if d["errors"] else None}
            for k, d in out.items()}


def _probe_reference(probe: Any) -> Mapping[str, Any] | None:
    """The profile's ``calibration.probe`` checked (``None``: the profile has none), so that a
    malformed one is refused before any launch, not met as a traceback after the runs."""
    if not probe:
        return None
    seconds = probe.get("seconds") if isinstance(probe, Mapping) else None
    processes = probe.get("processes") if isinstance(probe, Mapping) else None
    if not (isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds > 0
            and isinstance(processes, int) and not isinstance(processes, bool)
            and processes > 0):
        raise EpsimError("the profile's calibration.probe must be an object with a positive "
                         "'seconds' and a positive integer 'processes' (epsim calibrate writes "
                         "it); remove it to validate without the machine probe")
    return probe


def _load_average() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):
        return None


def validate(profile: str | Path, grid: str | Path, steps: int = 8, repeats: int = 2,
             device: str = "cpu", plot_path: str | Path | None = None, log: Any = None,
             probe_scaling: bool = True, **kwargs: Any) -> dict[str, Any]:
    """Check ``grid``'s cases are runnable and disjoint from the profile's calibration, run them,
    simulate them, compare; optionally plot. Returns the report (``epsim validate --json``).
    ``probe_scaling``: scale the predictions by the machine probe's change since calibration
    (the probe is taken and reported either way)."""
    import importlib.util

    from epsim.runtime.options import RunOptions
    from epsim.runtime.options import validate as check_options
    from epsim.sim.hardware.profile import load_profile

    plot_path = kwargs.pop("plot", plot_path)
    if kwargs:
        raise TypeError(f"unexpected arguments {sorted(kwargs)}")
    say = log or (lambda msg: None)
    prof = load_profile(profile)
    prof.require_efficiency()
    cases = read_grid(grid)
    if plot_path is not None:
        check_output_target(plot_path, "--plot")
        if importlib.util.find_spec("matplotlib") is None:  # before the runs, not after
            raise EpsimError("--plot needs matplotlib (pip install 'epsim[plot]')")
    models = {c.model: load_model(c.model) for c in cases}
    for c in cases:  # every case runnable, before any rank starts
        check_options(RunOptions(model=c.model, world_size=c.world_size, batch=c.batch,
                                 context=c.context, steps=steps, dp=c.dp, ep=c.ep, dbo=c.dbo,
                                 placement=c.placement, device=device))
    calib = prof.raw.get("calibration")
    configs = calib.get("configs", []) if isinstance(calib, Mapping) else []
    check_disjoint(configs, cases, models)
    try:
        has_torch = importlib.util.find_spec("torch") is not None
    except Exception:
        has_torch = False
    if not has_torch:
        raise EpsimError("epsim validate runs the runtime, which needs torch: "
                         "pip install 'epsim[runtime]'")
    reference = _probe_reference(calib.get("probe") if isinstance(calib, Mapping) else None)
    say(f"running {len(cases)} configurations x {repeats} on the runtime")
    samples: list[float] = []
    hook = None
    if reference:
        from .probe import core_probe

        def hook() -> None:
            samples.append(core_probe(int(reference["processes"])))
    load_before = _load_average()
    measured = run_cases(cases, steps, repeats=repeats, device=device, before_launch=hook)
    if hook is not None:
        hook()  # and once after the last launch
    load_after = _load_average()
    say("simulating them")
    predicted = [simulate_case(c, prof, steps) for c in cases]
    probe_report = None
    if reference and samples:
        ratio = statistics.median(samples) / float(reference["seconds"])
        cores = int(reference["processes"])
        if probe_scaling:
            predicted = adjust_for_load(cases, predicted, ratio, cores)
        probe_report = {"calibration_s": float(reference["seconds"]), "validation_s": samples,
                        "ratio": ratio, "cores": cores, "extra_threads": cores * (ratio - 1.0),
                        "scaled": probe_scaling}
    report = compare(cases, measured, predicted)
    # the machine probe (epsim.calibrate.probe): plain compute, no grid configuration; the
    # predictions are scaled by the change in the machine's state it saw (None: the profile
    # has no probe, nothing is scaled)
    report["machine_probe"] = probe_report
    report["profile"] = str(profile)
    report["grid"] = str(grid)
    report["steps"] = steps
    report["repeats"] = repeats
    report["disjoint_from_calibration"] = bool(configs)
    # the machine's 1-minute load average before and after the runs (their own ranks included
    # in the second): other jobs on shared cores are the largest source of run-to-run spread
    report["load_average"] = {"before": load_before, "after": load_after}
    report["per_kind"] = kind_summary(report)
    if plot_path is not None:
        plot(report, plot_path)
        report["plot"] = str(plot_path)
    return report
