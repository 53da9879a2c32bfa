"""Calibration end to end: run the microbenchmarks, save their tables, fit, write the profile.

``calibrate(out, device, quick)`` writes, next to ``PROFILE.json``, the raw tables as CSV
(``PROFILE.ops.csv``, ``PROFILE.steps.csv``, ``PROFILE.ranks.csv``, ``PROFILE.a2a.csv``,
``PROFILE.contention.csv``)
and the fitted profile, whose ``sources`` name the CSV files and the machine, and whose
``calibration`` section lists the configurations the microbenchmarks ran (``epsim validate``
checks its grid against them). ``profile_from_tables`` does the fitting part alone (tests feed it
synthetic tables).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from epsim.model.config import load_model
from epsim.model.errors import EpsimError
from epsim.model.outputs import reserve_outputs, staged_path
from epsim.model.trace import write_json_atomic
from epsim.sim.hardware.efficiency import EFFICIENCY_KEYS
from epsim.sim.hardware.profile import load_profile, profile_from_dict

from . import comm_bench, micro, probe
from . import comm_fit as C
from . import fit as F
from .devices import DeviceRecipe, device_recipe
from .exchange_fits import DEFAULT_EXCHANGE_FIT
from .validate import shape_signature

_FORM = {"max": "t = overhead + scale * max(flops/F, bytes/B)",
         "sum": "t = overhead + scale * flops/F + bytes_scale * bytes/B"}
TABLES = ("ops", "steps", "ranks", "a2a", "contention")


def machine() -> dict[str, Any]:
    """What ran the microbenchmarks."""
    info: dict[str, Any] = {"host": platform.node(), "platform": platform.platform(),
                            "processor": platform.processor() or platform.machine(),
                            "cpu_count": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_memory_bytes"] = float(torch.cuda.get_device_properties(0).total_memory)
    except Exception:  # torch missing or broken: the CPU facts still describe the machine
        pass
    return info


def table_paths(out: str | Path) -> dict[str, Path]:
    """Where the raw tables of profile ``out`` go: ``NAME.<table>.csv`` beside it."""
    out = Path(out)
    stem = out.name[: -len(".json")] if out.name.endswith(".json") else out.name
    return {t: out.with_name(f"{stem}.{t}.csv") for t in TABLES}


def write_csv_atomic(df: pd.DataFrame, path: Path) -> None:
    """Write ``df`` as CSV whole or not at all (staged with the command's other outputs)."""
    with staged_path(path) as tmp:
        df.to_csv(tmp, index=False)


def read_tables(out: str | Path) -> dict[str, pd.DataFrame]:
    """The raw tables saved beside profile ``out``. No command reads them back (``epsim
    calibrate`` always measures): this exists for tests (``tests/calibrate/test_calibrate_fit.py``: the
    tables round-trip through CSV and refit to the same profile)."""
    tables = {}
    for name, path in table_paths(out).items():
        if not path.is_file():
            raise EpsimError(f"calibration table not found: {path}")
        tables[name] = pd.read_csv(path)
    return tables


def profile_from_tables(tables: dict[str, pd.DataFrame], name: str, device: str,
                        machine_info: dict[str, Any], csv_names: dict[str, str],
                        configs: list[dict[str, Any]], base: str | None = None,
                        exchange_fit: str = DEFAULT_EXCHANGE_FIT) -> dict[str, Any]:
    """Fit the tables and build a profile object in the simulator's schema.

    Args:
        tables: ``ops`` (op rows incl. the GEMM grid), ``steps`` (executor gaps), ``ranks``
            (op rows on several ranks; may be empty on one GPU), ``a2a`` (exchange rows; may
            be empty), ``contention`` (may be empty).
        name: the profile's name. device: a kind of ``calibrate/devices.py``'s ``DEVICES``
            (``"cpu"``, ``"cuda"``): what it fits and writes where kinds differ.
        machine_info: :func:`machine`'s facts. csv_names: table -> file name, for the sources.
        configs: the configurations the microbenchmarks ran (``calibration.configs``).
        base: a shipped profile whose communication figures are kept when ``a2a`` is empty.
        exchange_fit: the exchange model (``calibrate/exchange_fits.py``).

    Returns:
        A JSON-ready profile dict, checked by ``epsim.sim.hardware.profile.profile_from_dict``.
    """
    recipe = device_recipe(device)
    ops, steps, ranks, a2a, cont = (tables[t] for t in TABLES)
    comp = recipe.fit_compute(ops)
    host = machine_info.get("gpu") or f"{machine_info.get('host')} " \
        f"({machine_info.get('processor')}, {machine_info.get('cpu_count')} cores)"
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    d = _Draft(f"fitted by epsim calibrate on {host}, torch {machine_info.get('torch', '?')}, "
               f"{when}", csv_names)
    gap = float(steps["gap_s"].median()) if not steps.empty else 1e-9
    obj = _compute(d, recipe, comp, ops, gap, name, machine_info)
    exchange_parts: dict[str, Any] = {}
    if a2a is not None and not a2a.empty:
        exchange_parts = _measured_exchange(d, obj, a2a, ranks, exchange_fit)
    else:
        _borrowed_exchange(d, obj, base)
    obj["kernel_launch_s"] = gap if recipe.kernel_launch_placeholder is None else 1e-9
    if ranks is not None and not ranks.empty:
        _rank_sharing(d, ops, ranks)
    _contention(d, cont)
    for key, (value, text) in recipe.extra_efficiency().items():
        d.eff[key] = value
        d.sources[f"efficiency.{key}"] = text
    missing = [k for k in EFFICIENCY_KEYS if k not in d.eff]
    assert not missing, missing
    obj["efficiency"] = d.eff
    obj["sources"] = d.sources
    obj["calibration"] = {
        "device": device, "machine": machine_info, "when": when, "tables": csv_names,
        "configs": configs,
        "fit": {"flops": comp.flops, "bandwidth": comp.bandwidth, "exchange": exchange_parts,
                "median_abs_rel_err_by_kind": comp.rel_err, "rows_by_kind": comp.rows},
    }
    profile_from_dict(obj, name)  # the simulator accepts it, or this is a bug
    return obj


@dataclass(frozen=True)
class _Draft:
    """A profile's efficiency keys and sources as they are written, and what every fitted
    source says: ``src("ops", "what")`` -> ``"fitted by epsim calibrate on HOST, torch V, WHEN,
    from NAME.ops.csv: what"``. The dicts keep their insertion order into the JSON."""

    fitted: str
    csv_names: dict[str, str]
    eff: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def src(self, table: str, what: str) -> str:
        return f"{self.fitted}, from {self.csv_names[table]}: {what}"

    def put(self, key: str, table: dict[int, float], tname: str, what: str,
            fmt: Callable[[float], str]) -> None:
        """``efficiency.<key>``: a fitted per-world-size table, its source listing each entry."""
        self.eff[key] = _by_world(table)
        self.sources[f"efficiency.{key}"] = self.src(tname, f"{what} (" + ", ".join(
            f"W={w}: {fmt(v)}" for w, v in sorted(table.items())) + ")")


def _compute(d: _Draft, recipe: DeviceRecipe, comp: F.ComputeFit, ops: pd.DataFrame,
             gap: float, name: str, machine_info: dict[str, Any]) -> dict[str, Any]:
    """The profile's compute figures (roofline, per-kind fits, executor gaps) into ``d``;
    returns the profile object's head (name ... hbm_bandwidth)."""
    gemm = ops[ops["kind"] == "gemm"]
    measured_peak = float((gemm["flops"] / gemm["time_s"]).max())
    peak = max(measured_peak, comp.flops)
    d.eff.update({
        "gemm_flops_fraction": {"bf16": comp.flops / peak, "fp8": comp.flops / peak,
                                "fp32": comp.flops / peak},
        "gemm_tile_m": 1,
        "hbm_fraction": 1.0,
        "attention_split_tokens": 1 << 30,
        "graph_launch_s": 1e-9,
        "graph_node_s": max(gap, 1e-9),
        "op_overhead_s": dict(comp.overhead_s),
        "op_time_scale": dict(comp.scale),
        "roofline": comp.mode,
    })
    if comp.mode == "sum":
        d.eff["op_bytes_scale"] = dict(comp.bytes_scale)
    src = d.src
    d.sources.update({
        "peak_flops": src("ops", f"the fastest GEMM of the grid ({measured_peak / 1e9:.1f} "
                          "GFLOP/s; the runtime computes in fp32 here, so every dtype has it)"),
        "hbm_bytes": recipe.hbm_source,
        "hbm_bandwidth": src("ops", "the roofline bandwidth B of the GEMM rows (bytes as the op "
                             "graph counts them: bf16 weights, so about half the fp32 bytes "
                             "really moved); hbm_fraction 1"),
        "kernel_launch_s": recipe.kernel_launch_placeholder
        or src("steps", "median executor time per op outside the ops"),
        "efficiency.gemm_flops_fraction": src("ops", "roofline F of the GEMM rows over the "
                                              "fastest measured GEMM"),
        "efficiency.gemm_tile_m": "a CPU has no matrix-core tiles: 1",
        "efficiency.hbm_fraction": "1: hbm_bandwidth is already the fitted achievable figure",
        "efficiency.attention_split_tokens": "one compute unit: occupancy is always 1",
        "efficiency.graph_launch_s": "no graph capture on this device: negligible placeholder",
        "efficiency.graph_node_s": src("steps", "median executor time per op outside the ops "
                                       "(step wall time minus its ops, over ops)"),
        "efficiency.op_overhead_s": src("ops", f"per-kind fixed cost of the fit {_FORM[comp.mode]}"),
        "efficiency.op_time_scale": src("ops", "per-kind factor of the same fit (gemm: 1)"),
        "efficiency.op_bytes_scale": src("ops", "per-kind bytes factor of the same fit "
                                         "(gemm: 1)"),
        "efficiency.roofline": "sum on a CPU (one core computes and moves bytes in turn), max "
                               "on a GPU",
    })
    return {
        "name": name,
        "description": f"{recipe.name.upper()} profile {d.fitted}",
        "vendor": "fitted",
        "compute_units": 1,
        "gpus_per_node": recipe.gpus_per_node(machine_info),
        "peak_flops": {"bf16": peak, "fp8": peak, "fp32": peak},
        "hbm_bytes": recipe.hbm_bytes(machine_info),
        "hbm_bandwidth": comp.bandwidth,
    }


def _measured_exchange(d: _Draft, obj: dict[str, Any], a2a: pd.DataFrame,
                       ranks: pd.DataFrame | None, exchange_fit: str) -> dict[str, Any]:
    """The fabric and the exchange figures fitted to the all-to-all table (and the ranks sweep)
    into ``obj`` and ``d``; returns the exchange's parts for ``calibration.fit.exchange``
    (empty: the fit has no split)."""
    cf, parts = C.fit_exchange(a2a, ranks, exchange_fit)
    exchange_parts: dict[str, Any] = {}
    if parts:  # JSON keys are strings; the straggler's fraction is efficiency's own key
        exchange_parts = {"latency_s": {k: _by_world(t) for k, t in parts["latency_s"].items()},
                          "straggler_fixed_s": _by_world(parts["straggler_fixed_s"])}
    obj["fabric"] = {"topology": "full_mesh", "links_per_gpu": 63,
                     "link_bandwidth": cf.bandwidth}
    obj["nic_bandwidth_per_gpu"] = cf.bandwidth
    lat = cf.latency_s
    smallest = min(lat["dispatch"])
    d.eff.update({
        "link_bandwidth_usable": cf.bandwidth,
        "nic_bandwidth_usable": cf.bandwidth,
        "a2a_latency_s": max(lat["dispatch"][smallest], 1e-9),
        "a2a_latency_by_group_s": {k: {str(g): max(v, 1e-9) for g, v in sorted(t.items())}
                                   for k, t in lat.items()},
        "collective_latency_s": max(lat["combine"][smallest], 1e-9),
        "collective_latency_graph_s": max(lat["combine"][smallest], 1e-9),
    })
    what = (f"t = latency[kind][world] + link_bytes / W over the runtime's dispatch_dynamic "
            f"/ combine_dynamic between compute (median |error| {cf.rel_err:.0%})")
    if exchange_fit == "in-step":
        what = ("latency[kind][world]: the median over the exchange ops of the ranks "
                f"sweep's decode steps ({d.csv_names['ranks']}, each rank from its issue to "
                "the end of its wait) of their share of a median step (step_s); W: "
                "t = latency + link_bytes / W fitted over "
                f"{d.csv_names['a2a']}")
    if parts:
        what += ("; latency = what the last rank to arrive waits (a2a last_s) + the fixed part "
                 "of how long after the average rank the last one arrives in a decode step "
                 "(ranks straggler_s: " + ", ".join(
                     f"W={w}: {v * 1e3:.2f} ms" for w, v in
                     sorted(parts["straggler_fixed_s"].items())) + ")")
        d.eff["exchange_straggler_fraction"] = _by_world(parts["straggler_fraction"])
        d.sources["efficiency.exchange_straggler_fraction"] = d.src(
            "ranks", "straggler_s = fixed + fraction * segment_s over the ranks sweep's "
            "exchanges (mean minus least of the ranks' exchange times; the ranks' compute "
            "since the previous exchange), non-negative, per world size")
    src = d.src
    d.sources.update({
        "fabric": src("a2a", "every local rank reaches every other (loopback); the "
                      "fitted W per link"),
        "nic_bandwidth_per_gpu": src("a2a", "local ranks only: the fitted W"),
        "efficiency.link_bandwidth_usable": src("a2a", what),
        "efficiency.nic_bandwidth_usable": src("a2a", "no second node: the fitted W"),
        "efficiency.a2a_latency_s": src("a2a", what + f": dispatch at world {smallest}"),
        "efficiency.a2a_latency_by_group_s": src("a2a", what),
        "efficiency.collective_latency_s": src("a2a", "not measured (the runtime has no "
                                               "TP collectives): the smallest group's "
                                               "combine latency"),
        "efficiency.collective_latency_graph_s": src("a2a", "as collective_latency_s"),
    })
    _host_block(d, a2a, ranks, exchange_fit, parts.get("straggler_fixed_s", {}))
    return exchange_parts


def _host_block(d: _Draft, a2a: pd.DataFrame, ranks: pd.DataFrame | None, exchange_fit: str,
                late: dict[int, float]) -> None:
    """How long issuing an exchange holds the host, into ``d``: from the all-to-all table, then
    (``in-step``) from the ranks sweep's decode steps where it has them. ``late``: the
    straggler's fixed part per world size (``last-plus-straggler``; else empty)."""
    held_in_step, hold_fraction = ({}, {}) if exchange_fit != "in-step" else \
        C.fit_host_in_step(ranks)
    held = C.fit_host_block(a2a)
    # the dispatch's count exchange waits for the last rank too; the combine's call is the
    # rank's own (its time does not shrink for the last to arrive)
    if "dispatch" in held:
        held["dispatch"] = {w: v + late.get(w, 0.0) for w, v in held["dispatch"].items()}
    if held:
        d.eff["a2a_host_block_by_group_s"] = {k: {str(g): v for g, v in sorted(t.items())}
                                              for k, t in held.items()}
        dispatch = ("the last rank to arrive's time plus the dispatch straggler of the ranks "
                    "sweep" if late else "the last rank to arrive's time")
        d.sources["efficiency.a2a_host_block_by_group_s"] = d.src(
            "a2a", "host_s: the time inside the call that issues the exchange (dispatch: "
            f"its blocking count exchange, {dispatch}; combine: gloo's asynchronous call, "
            "the ranks' mean), fixed part of a line over link bytes, per kind and world "
            "size")
    if held_in_step:  # measured inside the decode steps, as the latencies are
        d.eff["a2a_host_block_by_group_s"] = {
            **d.eff.get("a2a_host_block_by_group_s", {}),
            **{k: _by_world(t) for k, t in held_in_step.items()}}
        d.sources["efficiency.a2a_host_block_by_group_s"] = d.src(
            "ranks", "host_s: how long the call that issues an exchange held the host in the "
            "ranks sweep's decode steps (the trace's issue_us); dispatch: the fixed part of "
            "host_s = fixed + fraction * segment_s (its blocking count exchange is a meeting "
            "of every rank), per world size; combine: the median of its asynchronous call")
        if hold_fraction:
            d.put("a2a_host_block_fraction", hold_fraction, "ranks", "the fraction of that "
                  "fit: a dispatch holds the host this share of the compute since the "
                  "previous exchange longer", lambda v: f"{v:.3f}")


def _borrowed_exchange(d: _Draft, obj: dict[str, Any], base: str | None) -> None:
    """No all-to-all was measured (one device): the fabric and exchange figures of the shipped
    profile ``base``, each source saying so."""
    if base is None:
        raise EpsimError("no all-to-all measurements and no --base profile to take the "
                         "communication figures from")
    b = load_profile(base)
    braw, beff = b.raw, b.require_efficiency()
    obj["provenance"] = b.provenance()  # what the borrowed figures came from (docs/provenance.md)
    obj["fabric"] = dict(braw["fabric"])
    obj["nic_bandwidth_per_gpu"] = braw["nic_bandwidth_per_gpu"]
    obj["gpus_per_node"] = braw["gpus_per_node"]
    for key in ("link_bandwidth_usable", "nic_bandwidth_usable", "a2a_latency_s",
                "collective_latency_s", "collective_latency_graph_s"):
        d.eff[key] = getattr(beff, key)
        d.sources[f"efficiency.{key}"] = f"not measured (one device): from profile {base}: " \
            + str(b.sources.get(f"efficiency.{key}", ""))
    for key in ("fabric", "nic_bandwidth_per_gpu"):
        d.sources[key] = f"not measured (one device): from profile {base}: " \
            + str(b.sources.get(key, ""))


def _rank_sharing(d: _Draft, ops: pd.DataFrame, ranks: pd.DataFrame) -> None:
    """How ranks sharing the machine slow each other, from the ranks sweep, into ``d``."""
    slow = F.fit_rank_slowdown(ops, ranks)
    d.eff["rank_compute_slowdown"] = {str(w): max(f, 1e-3) for w, f in slow.items()}
    by_kind = F.fit_rank_slowdown_by_kind(ops, ranks)
    if by_kind:
        d.eff["rank_compute_slowdown_by_kind"] = {
            k: {str(w): max(f, 1e-3) for w, f in t.items()} for k, t in by_kind.items()}
        d.sources["efficiency.rank_compute_slowdown_by_kind"] = d.src(
            "ranks", "the same ratio per op class (classes with at least 3 ops at every "
            "world size); other classes use rank_compute_slowdown")
    d.sources["efficiency.rank_compute_slowdown"] = d.src(
        "ranks", "summed time of the ops on W local ranks (their shares of a median step, "
        "step_s; decode steps of the calibration shapes launched as epsim run does, EP for "
        "W > 1) over their summed time in the op sweep (" + ", ".join(
            f"W={w}: {f:.2f}x" for w, f in slow.items()) + ")")
    skew = F.fit_rank_skew(ranks)
    if skew:
        d.put("rank_skew_by_group_s", skew, "ranks", "median over the ranks sweep's "
              "configurations of the slowest rank's step time minus the ranks' mean, per "
              "world size", lambda v: f"{v * 1e3:.2f} ms")


def _contention(d: _Draft, cont: pd.DataFrame | None) -> None:
    """How an exchange in flight slows compute, from the contention table, into ``d``
    (not measured: the floor of the fit, 0.01)."""
    if cont is not None and not cont.empty:
        d.eff["comm_compute_slowdown"] = F.fit_comm_slowdown(
            cont["probe_s"].tolist(), cont["probe_under_comm_s"].tolist())
        d.sources["efficiency.comm_compute_slowdown"] = d.src(
            "contention", "1 - probe time / probe time under a large all-to-all in flight "
            "(median over world sizes, clamped to [0.01, 0.9])")
        d.put("comm_compute_slowdown_by_group", F.fit_comm_slowdown_by_world(cont),
              "contention", "the same per world size", lambda v: f"{v:.2f}")
    else:
        d.eff["comm_compute_slowdown"] = 0.01
        d.sources["efficiency.comm_compute_slowdown"] = "not measured (one device): 0.01"


def _by_world(table: dict[int, float]) -> dict[str, float]:
    """``{world: value}`` with JSON's string keys, in world order."""
    return {str(w): v for w, v in sorted(table.items())}


def calibrate(out: str | Path, device: str = "cpu", quick: bool = False,
              base: str | None = None, log: Any = None,
              exchange_fit: str = DEFAULT_EXCHANGE_FIT,
              stamp: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any]:
    """Measure, save the tables beside ``out``, fit, write the profile; returns the profile.
    ``exchange_fit``: the exchange model (``calibrate/exchange_fits.py``). ``stamp``: applied
    to the profile object before it is written (the front door's provenance: the epsim
    version, and the profile the figures were borrowed from, if any).

    ``device``: a kind of ``calibrate/devices.py``'s ``DEVICES``. ``"cuda"``: world size 1 on
    one GPU (no all-to-all: the communication figures come from ``base``, default ``h200``).
    ``quick``: a small subset of every sweep (tests).
    """
    out = Path(out)
    reserve_outputs({"profile": out, **{f"{name} table": p for name, p in table_paths(out).items()}})
    recipe = device_recipe(device)
    recipe.check_available()
    base = base or recipe.default_base
    say = log or (lambda msg: None)
    probes: list[float] = []  # the machine-state probe around the sweeps validation leans on
    tables, signatures = _measure(recipe, quick, say, lambda: probes.append(probe.core_probe()))
    paths = table_paths(out)
    for t, df in tables.items():
        write_csv_atomic(df, paths[t])
    configs = _measured_configs(tables, signatures)
    say("fit")
    name = out.name[: -len(".json")] if out.name.endswith(".json") else out.name
    obj = profile_from_tables(tables, name, device, machine(),
                              {t: p.name for t, p in paths.items()}, configs, base,
                              exchange_fit)
    if probes:
        obj["calibration"]["probe"] = probe.probe_record(probes)
    if stamp is not None:
        stamp(obj)
    write_json_atomic(obj, out)
    return obj


def _measure(recipe: DeviceRecipe, quick: bool, say: Callable[[str], None],
             sample: Callable[[], None]) -> tuple[dict[str, pd.DataFrame], dict[str, str]]:
    """Run the sweeps ``recipe`` calls for; returns the tables (:data:`TABLES`; a sweep not run
    is an empty table) and ``{calibration shape: its config signature}``. ``sample``: takes
    the machine-state probe (before each multi-rank launch and after the last)."""
    points = micro.QUICK_POINTS if quick else micro.SWEEP_POINTS
    shapes = micro.CALIBRATION_SHAPES[:2] if quick else micro.CALIBRATION_SHAPES
    with tempfile.TemporaryDirectory(prefix="epsim-calib-shapes-") as folder:
        say("op sweep (single-rank decode steps of the calibration shapes)")
        ops, steps = micro.op_sweep(Path(folder), shapes, points, steps=3 if quick else 6,
                                    device=recipe.name, rounds=1 if quick else 3)
        signatures = {s.name: shape_signature(load_model(Path(folder) / f"{s.name}.json"))
                      for s in shapes}
    say("GEMM grid")
    gemm = micro.gemm_sweep(micro.QUICK_GEMM_GRID if quick else micro.GEMM_GRID,
                            repeats=5 if quick else 15, device=recipe.name)
    ops = pd.concat([ops, gemm], ignore_index=True)
    ranks, a2a, cont = pd.DataFrame(), pd.DataFrame(), pd.DataFrame()
    if recipe.local_ranks:
        say("the same ops on 2 and 4 local ranks")
        with tempfile.TemporaryDirectory(prefix="epsim-calib-shapes-") as folder:
            ranks = micro.ranks_sweep(Path(folder), shapes[1:2] if quick else shapes,
                                      micro.QUICK_POINTS[:1] if quick else micro.RANKS_POINTS,
                                      worlds=(1, 2) if quick else (1, 2, 4),
                                      steps=3 if quick else 8,
                                      rounds=1 if quick else 3, before_launch=sample)
        say("all-to-all and contention (world sizes 2 and 4)")
        a2a, cont = comm_bench.comm_sweep(
            worlds=(2,) if quick else (2, 4), tokens=comm_bench.QUICK_A2A_TOKENS if quick else comm_bench.A2A_TOKENS,
            repeats=3 if quick else 12, probe_rounds=10 if quick else 40,
            probe_repeats=2 if quick else 5, comm_rows=1024 if quick else 8192,
            rounds=1 if quick else 2, before_launch=sample)
        sample()
    return {"ops": ops, "steps": steps, "ranks": ranks, "a2a": a2a, "contention": cont}, signatures


def _measured_configs(tables: dict[str, pd.DataFrame], signatures: dict[str, str]
                      ) -> list[dict[str, Any]]:
    """``calibration.configs``: every configuration the sweeps ran (``epsim validate`` refuses
    a grid case equal to one), op sweep first, then the ranks sweep's and the exchanges'."""
    steps, ranks, a2a = tables["steps"], tables["ranks"], tables["a2a"]
    configs = [{"shape": signatures[s], "shape_name": s, "world_size": 1, "batch": int(b),
                "context": int(c), "dbo": bool(d)}
               for s, b, c, d in steps[["shape", "batch", "context", "dbo"]]
               .drop_duplicates().itertuples(index=False)]
    if not ranks.empty:
        configs += [{"shape": signatures[s], "shape_name": s, "world_size": int(w),
                     "batch": int(b), "context": int(c), "dbo": False}
                    for s, w, b, c in ranks[ranks["world"] > 1][["shape", "world", "batch",
                                                                  "context"]]
                    .drop_duplicates().itertuples(index=False)]
    if not a2a.empty:
        configs += [{"shape": f"a2a-h{comm_bench.A2A_HIDDEN}-e{comm_bench.A2A_EXPERTS}"
                              f"-k{comm_bench.A2A_TOP_K}", "shape_name": "all-to-all",
                     "world_size": int(w), "batch": int(t), "context": 0, "dbo": False}
                    for w, t in a2a[["world", "tokens"]].drop_duplicates()
                    .itertuples(index=False)]
    return configs
