"""Fit a profile's factors to measured benchmark runs (``epsim calibrate --from-bench``).

A measured run (``epsim.sim.workload.bench_results.BenchResult``) is replayed through the simulator
(``epsim.sim.replay``) under one deployment; a small named set of factors (:data:`FACTORS`)
is fitted to several runs by least squares on the log of the factors:

    op factors   attention, grouped_gemm (MoE), gemm (dense), communication, other: a multiplier
                 on the final time of that class of ops (``efficiency.op_final_scale``, under any
                 kernel set: ``epsim.sim.step.cost.roofline.final_scaled``)
    host         the engine's host time per step, ms (``efficiency.host_ms_per_step``; it acts
                 under ``--engine`` only, overlapped with the GPU: a step lasts max(GPU, host))

Residuals: per run and phase, ``log(predicted / measured)`` of one metric (:data:`FIT_METRICS`):
the decode step's (mean TPOT, else mean ITL, else their medians) and the prefill's (mean TTFT,
else median TTFT). Other metrics of a run (percentiles, throughputs) follow from the same steps
and add no independent information, so they are not fitted.

Identifiability (:func:`check_identifiable`, refused in one line before any fit):

1. counting: F factors need at least F measurements; each run gives at most two (one decode-step
   metric, one TTFT). E.g. attention and MoE both act on every decode step: telling them apart
   needs TPOT at two points where attention's share differs (another context or concurrency).
2. sensitivity: at the starting point (the base profile's values), each factor must move some
   fitted metric: ``|d log metric / d log factor| >= SENSITIVITY_MIN`` for at least one. The host
   time, overlapped with the GPU, moves a metric only in a run whose steps are shorter than it.
3. independence: the sensitivity matrix, each factor's column scaled to unit length, must have
   its smallest singular value at least ``INDEPENDENCE_MIN``: no factor's effect on the runs is
   (nearly) a combination of the others'. The refusal names the factors that move alike.

The fit: Levenberg-Marquardt with forward-difference Jacobians in log space (a handful of
parameters; each residual evaluation replays every run). Leave-one-out: each run predicted from
a fit on the others (from the same start, under the same rule), where they determine the
factors.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from epsim.model.errors import EpsimError
from epsim.sim.hardware.profile import load_profile, profile_from_dict
from epsim.sim.replay import replay
from epsim.sim.scenario import StepCache
from epsim.sim.serving.presets import HOST_MS_PER_STEP, charges_host
from epsim.sim.spec import Scenario
from epsim.sim.workload.bench_results import BenchResult

from . import plausible

#: a factor needs a fitted metric it moves by at least this (d log metric / d log factor)
SENSITIVITY_MIN = 1e-3
#: smallest singular value of the column-normalised sensitivity matrix
INDEPENDENCE_MIN = 0.05
#: log-space step of the forward-difference Jacobian (0.1 %)
JACOBIAN_STEP = 1e-3
#: factors stay within [1/BOUND, BOUND] of 1 (the host time: of 1 ms)
BOUND = 50.0


@dataclass(frozen=True)
class Factor:
    """One fittable factor: ``key`` in the profile's efficiency, and what a run needs to show
    it (the refusal's wording)."""

    name: str
    key: str
    needs: str


FACTORS: dict[str, Factor] = {f.name: f for f in (
    Factor("attention", "op_final_scale",
           "TPOT/ITL at two contexts or concurrencies (its share of a decode step grows with "
           "batch x context), or a TTFT"),
    Factor("grouped_gemm", "op_final_scale",
           "TPOT/ITL at two concurrencies (the MoE's share falls as attention grows with "
           "context)"),
    Factor("gemm", "op_final_scale",
           "TPOT/ITL and TTFT (dense GEMMs weigh more in prefill than in decode)"),
    Factor("communication", "op_final_scale",
           "runs where the EP dispatch/combine are exposed (TPOT at several concurrencies)"),
    Factor("other", "op_final_scale", "TPOT/ITL at another concurrency"),
    Factor("host", "host_ms_per_step",
           "a run whose decode steps are shorter than the host time (low concurrency: TPOT "
           "then is the host time), under an engine (not --engine prefill_first)"),
)}
#: per phase, the metric fitted: the first of these the file has
FIT_METRICS: dict[str, tuple[str, ...]] = {
    "decode": ("mean_tpot_ms", "mean_itl_ms", "median_tpot_ms", "median_itl_ms"),
    "prefill": ("mean_ttft_ms", "median_ttft_ms"),
}
#: the host time the fit starts from: the engine presets' assumed one (ms)
HOST_START_MS = HOST_MS_PER_STEP


def fit_metrics(bench: BenchResult) -> tuple[str, ...]:
    """The metrics of ``bench`` that are fitted (at most one per phase)."""
    out = []
    for names in FIT_METRICS.values():
        picked = next((n for n in names if bench.measured.get(n, 0.0) > 0), None)
        if picked:
            out.append(picked)
    return tuple(out)


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class Simulator:
    """Replays the runs under a profile with given factor values; memoised per value."""

    def __init__(self, runs: Sequence[BenchResult], sc: Scenario, names: Sequence[str]):
        self.runs, self.sc, self.names = list(runs), sc, tuple(names)
        self.raw = copy.deepcopy(dict(load_profile(sc.hardware).raw))
        self._dir = tempfile.TemporaryDirectory(prefix="epsim-bench-fit-")
        self._memo: dict[tuple[float, ...], list[dict[str, float]]] = {}
        self.evaluations = 0

    def start(self) -> np.ndarray:
        """Log of the base profile's values (op factors 1 unless set, the host time the
        deployment's)."""
        eff = self.raw.get("efficiency", {})
        scale = eff.get("op_final_scale", {})
        host = self.sc.deployment.engine.host_ms_per_step or eff.get("host_ms_per_step") or HOST_START_MS
        return np.log([host if n == "host" else scale.get(n, 1.0) for n in self.names])

    def profile_obj(self, values: Mapping[str, float]) -> dict[str, Any]:
        obj = copy.deepcopy(self.raw)
        eff = obj["efficiency"]
        scale = {**eff.get("op_final_scale", {}),
                 **{n: float(v) for n, v in values.items() if FACTORS[n].key == "op_final_scale"}}
        if scale:
            eff["op_final_scale"] = scale
            obj.setdefault("sources", {}).setdefault("efficiency.op_final_scale", "trial")
        if "host" in values:
            eff["host_ms_per_step"] = float(values["host"])
            obj.setdefault("sources", {}).setdefault("efficiency.host_ms_per_step", "trial")
        return obj

    def predict(self, theta: np.ndarray, which: Sequence[int] | None = None
                ) -> list[dict[str, float]]:
        """Per run (all, or ``which``): ``{metric: predicted}`` at log-factors ``theta``."""
        key = tuple(float(t) for t in theta)
        if key not in self._memo:
            self._memo[key] = [{}] * len(self.runs)
        done = self._memo[key]
        todo = [i for i in (which if which is not None else range(len(self.runs))) if not done[i]]
        if todo:
            values = dict(zip(self.names, np.exp(theta).tolist(), strict=True))
            path = Path(self._dir.name) / f"p{len(self._memo)}.json"
            obj = self.profile_obj(values)
            profile_from_dict(obj, "fitted profile")  # a bad value: refused here, not mid-run
            path.write_text(json.dumps(obj))
            sc = self.sc.with_(hardware=str(path), host_ms_per_step=values.get(
                "host", self.sc.deployment.engine.host_ms_per_step))
            cache = StepCache()
            for i in todo:
                report = replay(self.runs[i], sc, cache)
                done[i] = {m: report["metrics"][m]["predicted"]
                           for m in fit_metrics(self.runs[i]) if m in report["metrics"]}
                self.evaluations += 1
        return [done[i] for i in (which if which is not None else range(len(self.runs)))]

    def residuals(self, theta: np.ndarray, which: Sequence[int]) -> np.ndarray:
        preds = self.predict(theta, which)
        out = []
        for i, pred in zip(which, preds, strict=True):
            for m in fit_metrics(self.runs[i]):
                p = pred.get(m)
                out.append(math.log(p / self.runs[i].measured[m]) if p and p > 0 else 10.0)
        return np.array(out)

    def jacobian(self, theta: np.ndarray, which: Sequence[int], r0: np.ndarray) -> np.ndarray:
        cols = []
        for j in range(len(theta)):
            t = theta.copy()
            t[j] += JACOBIAN_STEP
            cols.append((self.residuals(t, which) - r0) / JACOBIAN_STEP)
        return np.column_stack(cols) if cols else np.zeros((len(r0), 0))

    def close(self) -> None:
        self._dir.cleanup()


def _runs_text(n: int) -> str:
    return f"{n} run" + ("" if n == 1 else "s")


def check_identifiable(sim: Simulator, which: Sequence[int], theta: np.ndarray,
                       r0: np.ndarray | None = None, J: np.ndarray | None = None) -> None:
    """Refuse (EpsimError) a fit of more factors than runs ``which`` determine (module
    docstring: counting, sensitivity, independence)."""
    names = sim.names
    m = sum(len(fit_metrics(sim.runs[i])) for i in which)
    if m < len(names):
        raise EpsimError(
            f"{len(names)} factors ({', '.join(names)}) need at least {len(names)} measurements; "
            f"{_runs_text(len(which))} {'gives' if len(which) == 1 else 'give'} {m} (one decode metric, TPOT or ITL, and one TTFT "
            "per run): add runs at other concurrencies or lengths, or fit fewer --factors ("
            + "; ".join(f"{n}: {FACTORS[n].needs}" for n in names) + ")")
    if J is None:
        r0 = sim.residuals(theta, which) if r0 is None else r0
        J = sim.jacobian(theta, which, r0)
    norms = np.linalg.norm(J, axis=0)
    flat = [n for n, v in zip(names, norms, strict=True) if v < SENSITIVITY_MIN]
    if flat:
        raise EpsimError(
            f"factor {', '.join(flat)} moves none of the fitted metrics of these "
            f"{_runs_text(len(which))}: it needs " + "; ".join(
                f"{n}: {FACTORS[n].needs}" for n in flat))
    _, s, vt = np.linalg.svd(J / norms, full_matrices=False)
    if len(names) > 1 and s[-1] < INDEPENDENCE_MIN:
        alike = [n for n, v in zip(names, vt[-1], strict=True) if abs(v) > 0.3]
        raise EpsimError(
            f"factors {', '.join(alike)} move the fitted metrics of these "
            f"{_runs_text(len(which))} alike (independence {s[-1]:.3f} < {INDEPENDENCE_MIN}): "
            "they need " + "; ".join(f"{n}: {FACTORS[n].needs}" for n in alike))


def levenberg_marquardt(fun: Callable[[np.ndarray], np.ndarray],
                        jac: Callable[[np.ndarray, np.ndarray], np.ndarray], x0: np.ndarray,
                        lower: np.ndarray, upper: np.ndarray, *, max_iter: int = 30,
                        xtol: float = 1e-7, ftol: float = 1e-14) -> tuple[np.ndarray, int]:
    """Minimise ``|fun(x)|^2`` within [lower, upper]; returns ``(x, iterations)``."""
    x, r = x0.copy(), fun(x0)
    lam = 1e-3
    for it in range(1, max_iter + 1):
        cost = float(r @ r)
        if cost < ftol:
            return x, it - 1
        J = jac(x, r)
        g, A = J.T @ r, J.T @ J
        while True:
            step = np.linalg.solve(A + lam * np.diag(np.maximum(np.diag(A), 1e-12)), -g)
            x_new = np.clip(x + step, lower, upper)
            r_new = fun(x_new)
            if float(r_new @ r_new) < cost:
                lam = max(lam / 10.0, 1e-9)
                break
            lam *= 10.0
            if lam > 1e8:
                return x, it
        moved = float(np.max(np.abs(x_new - x)))
        x, r = x_new, r_new
        if moved < xtol:
            return x, it
    return x, max_iter


def _fit(sim: Simulator, which: Sequence[int], x0: np.ndarray) -> tuple[np.ndarray, int]:
    lo = np.log([1.0 / BOUND] * len(x0))
    hi = np.log([BOUND] * len(x0))
    return levenberg_marquardt(lambda t: sim.residuals(t, which),
                               lambda t, r: sim.jacobian(t, which, r), x0, lo, hi)


def _errors(sim: Simulator, theta: np.ndarray, i: int) -> dict[str, dict[str, float]]:
    pred = sim.predict(theta, [i])[0]
    out = {}
    for m in fit_metrics(sim.runs[i]):
        measured = sim.runs[i].measured[m]
        out[m] = {"measured": measured, "predicted": pred[m],
                  "error_pct": (pred[m] - measured) / measured * 100.0}
    return out


def leave_one_out(sim: Simulator, theta: np.ndarray) -> list[dict[str, Any]]:
    """Per run: its fitted metrics predicted from a fit on the other runs started where the
    full fit started (``theta``), or why the others do not determine the factors."""
    rows = []
    for i, run in enumerate(sim.runs):
        others = [j for j in range(len(sim.runs)) if j != i]
        row: dict[str, Any] = {"run": run.source}
        try:
            check_identifiable(sim, others, theta)
        except EpsimError as exc:
            rows.append({**row, "determined": False, "why": str(exc)})
            continue
        fitted, _ = _fit(sim, others, theta)
        rows.append({**row, "determined": True,
                     "factors": dict(zip(sim.names, np.exp(fitted).tolist(), strict=True)),
                     "metrics": _errors(sim, fitted, i)})
    return rows


def fit_bench(runs: Sequence[BenchResult], sc: Scenario, names: Sequence[str], *,
              loo: bool = True) -> dict[str, Any]:
    """Fit factors ``names`` to ``runs`` replayed under deployment ``sc`` -> the report:
    ``factors``, ``start``, ``runs`` (per run the fitted metrics at the fit), ``leave_one_out``,
    ``iterations``, ``evaluations``, ``refused`` (:func:`fit_screened`)."""
    unknown = [n for n in names if n not in FACTORS]
    if unknown or not names:
        raise EpsimError(f"unknown factor {', '.join(unknown) or '(none)'}: choose from "
                         + ", ".join(FACTORS))
    if "host" in names and not charges_host(sc.deployment.engine.engine):
        raise EpsimError("the host time per step acts under --engine only, and --engine "
                         "prefill_first (epsim's own policy) charges none: run another engine "
                         "(the default is the hardware vendor's), or drop host from --factors")
    return fit_screened(lambda active: Simulator(runs, sc, active), names, loo=loo)


def fit_screened(make: Callable[[Sequence[str]], Simulator], names: Sequence[str], *,
                 loo: bool = True) -> dict[str, Any]:
    """Fit ``names`` with simulators ``make(names)``; an op factor outside the plausible range
    (``calibrate.plausible``) is refused: it keeps its start (sourced) value and the others
    are fitted again without it. ``refused``: ``[{"factor", "fitted", "range", "kept"}]``."""
    active, refused, start, evaluations = list(names), [], None, 0
    while True:
        sim = make(active)
        try:
            x0 = sim.start()
            if start is None:
                start = dict(zip(active, np.exp(x0).tolist(), strict=True))
            theta, iterations = x0, 0
            if active:
                check_identifiable(sim, list(range(len(sim.runs))), x0)
                theta, iterations = _fit(sim, list(range(len(sim.runs))), x0)
            fitted = dict(zip(active, np.exp(theta).tolist(), strict=True))
            bad = plausible.refusals({n: v for n, v in fitted.items()
                                      if FACTORS[n].key == "op_final_scale"}, start)
            if bad:  # keep the sourced values and fit the others again
                refused += bad
                active = [n for n in active if n not in {r["factor"] for r in bad}]
                evaluations += sim.evaluations
                continue
            report = {
                "factors": {n: fitted.get(n, start[n]) for n in names},
                "start": start,
                "runs": [{"run": r.source, "metrics": _errors(sim, theta, i)}
                         for i, r in enumerate(sim.runs)],
                "iterations": iterations,
                "refused": refused,
            }
            report["leave_one_out"] = leave_one_out(sim, x0) if loo and active else []
            report["evaluations"] = evaluations + sim.evaluations
            report["profile"] = sim.profile_obj(fitted)
            return report
        finally:
            sim.close()


def fitted_profile(report: Mapping[str, Any], base_name: str, files: Sequence[str],
                   deployment: Mapping[str, Any], date: str | None = None) -> dict[str, Any]:
    """The profile object to write: the base with the fitted keys, each key's source naming the
    files (and their sha256), the deployment and the date, and a ``calibration.from_bench``
    record of the whole fit."""
    obj = copy.deepcopy(dict(report["profile"]))
    date = date or datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    listed = [{"path": str(f), "sha256": file_sha256(f)} for f in files]
    dep = ", ".join(f"{k} {v}" for k, v in deployment.items() if v is not None)
    note = ("fitted by epsim calibrate --from-bench on " + date + " to "
            + ", ".join(f"{x['path']} (sha256 {x['sha256']})" for x in listed)
            + f", replayed as {dep}, from {base_name}: a fit to these runs predicts this stack, "
            "not a component measurement")
    sources = obj.setdefault("sources", {})
    factors = report["factors"]
    refused = {r["factor"] for r in report.get("refused", [])}
    if any(FACTORS[n].key == "op_final_scale" and n not in refused for n in factors):
        sources["efficiency.op_final_scale"] = note
    if "host" in factors:
        sources["efficiency.host_ms_per_step"] = note
    if not str(obj.get("name", "")).endswith("-bench-fit"):
        obj["name"] = f"{obj.get('name', 'profile')}-bench-fit"
    obj.setdefault("calibration", {})["from_bench"] = {
        "date": date, "files": listed, "deployment": dict(deployment), "base": base_name,
        "factors": dict(factors), "start": report["start"],
        "refused": report.get("refused", []),
        "rule": {"sensitivity_min": SENSITIVITY_MIN, "independence_min": INDEPENDENCE_MIN},
        "runs": report["runs"], "leave_one_out": report["leave_one_out"]}
    return obj
