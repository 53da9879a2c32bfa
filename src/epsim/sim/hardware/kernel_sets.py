"""Measured kernel tables: the ``kernels`` section of a hardware profile, and their lookup.

A profile may carry, per kernel library, points measured at real shapes (aiter's tuned CSVs,
DeepGEMM, FlashMLA, MORI-EP, ...). The cost model (``epsim.sim.step.cost.timing``) uses them where one
matches an op's kind, dtype and scope, and the roofline everywhere else. Schema::

    "kernels": {
      "default": "aiter",                   a set name, or "none" (the roofline only)
      "sources": {"<id>": {"repository": "ROCm/aiter", "path": "aiter/configs/tuned_fmoe.csv",
                           "commit": "<7-40 hex>" | "pr": <number>, "note": "..."}
                  | {"url": "https://...", "note": "..."}},
      "sets": {
        "<name>": {
          "description": "...",
          "plan_options": {"shared_expert_in_moe": true},   fusions the library implies
          "tables": [{"op": "grouped_gemm", "dtype": "fp8", "unit": "us",
                      "features": ["tokens", "experts", "top_k", "hidden", "inter"],
                      "quant": "per_1x128", "scope": "intra", "source": "<id>",
                      "points": [[512, 33, 9, 7168, 2048, 671.55], [..., 470.75, "<id>"]]}],
          "relative_to": "<set>" | "none",  a set scaled from another one
          "speedup": {"<op kind>": {"value": 2.0, "source": "<id>"}}
        }}}

A point is its feature values in the table's ``features`` order, then its time in ``unit``, then
optionally its source id (else the table's ``source``). ``FEATURES`` lists each op kind's
features; those with a default may be omitted (the table was measured at the default; for the
``SELECTORS`` it then describes only ops at that default). ``scope``
(collectives only) is ``intra`` (default) or ``inter``-node; ``quant`` is informational.

Deployment selectors: which kernel an op kind runs depends on how the plan is deployed, and a
table may say which deployment it measured (absent: every one):

* ``mode`` (``MODE_KINDS``: dispatch / combine, and the fused MoE ``grouped_gemm``): the EP
  exchange mode of the step (``sim.hardware.a2a``: ``low_latency`` or ``normal``). The exchange
  decides the MoE kernel too: DeepEP's low-latency mode hands DeepGEMM's *masked* grouped GEMM
  its tokens (decode), the normal mode the *contiguous* one (prefill);
* ``layout`` (``LAYOUT_KINDS``: ``grouped_gemm``): the plan's MoE layout (``LAYOUTS``: ``ep``,
  experts spread over the EP group; ``tp``, TP-only, every rank a 1/tp slice of every expert).

Several tables of one (op, dtype, scope) may coexist in a set when their selectors differ; a step
uses the most specific one it matches: the one naming most of the step's selectors (both, then
either, then an untagged one); a selector the step does not give (``op_time`` without a step)
excludes nothing and counts for nothing; ties go to the table listed first. Example (h100's ``sglang``): wide-EP
decode (``layout ep``, ``mode low_latency``) reads the masked grouped-GEMM table, wide-EP
prefill (``ep``, ``normal``) the contiguous one, a TP-only plan (``tp``) the Triton fused MoE's
TP rows. ``--explain`` names the table chosen (``kernel_sources[kind]["tables"]``).

A set with ``relative_to`` times each op kind as that set does, divided by ``speedup[kind]``
(kinds without a factor: as the base); its own tables take precedence. ``plan_options`` are not
inherited.

Lookup rules: ``epsim.sim.hardware.kernel_tables``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from decimal import Decimal
from typing import Any

import numpy as np

from epsim.model.bounds import (
    MAX_ID,
    MAX_PROFILE_NUMBER,
    MIN_PROFILE_NUMBER,
    check_count,
    show,
)
from epsim.model.errors import EpsimError
from epsim.model.opgraph import OP_KINDS
from epsim.model.plan import Fusion

from . import table_guard
from .kernel_tables import (
    COLLECTIVE_TABLES,
    EXACT,
    EXTRAPOLATED,
    FEATURES,
    INTERPOLATED,
    LAYOUT_KINDS,
    LAYOUTS,
    METHODS,
    MODE_KINDS,
    SCOPES,
    SELECTORS,
    TABLE_MODES,
    UNITS,
    How,
    Table,
    lookup,
)

__all__ = ["COLLECTIVE_TABLES", "EXACT", "EXTRAPOLATED", "FEATURES", "INTERPOLATED", "LAYOUTS",
           "LAYOUT_KINDS", "METHODS", "MODE_KINDS", "NONE", "PLAN_OPTIONS", "SCOPES", "SELECTORS",
           "TABLE_MODES", "UNITS", "How", "KernelSet", "KernelSets", "Source", "Table",
           "TableKey", "lookup", "parse_kernels"]

#: the reserved set name: no tables, the roofline only
NONE = "none"
#: plan options a kernel set may imply, and their JSON types (the model side reads them)
PLAN_OPTIONS: dict[str, type] = {f.name: bool for f in fields(Fusion)}
_HEX = re.compile(r"^[0-9a-fA-F]{7,40}$")
_TABLE_KEYS = {"op", "dtype", "unit", "features", "points", "source", "scope", "quant", "note",
               "mode", "layout"}
#: a table's place in its set: ``(op, dtype, scope, mode, layout)`` (``""``: no selector).
#: Example: ``("grouped_gemm", "fp8", "intra", "low_latency", "ep")``
TableKey = tuple[str, str, str, str, str]
_SET_KEYS = {"description", "plan_options", "tables", "relative_to", "speedup"}
_SOURCE_KEYS = {"repository", "path", "commit", "pr", "url", "note", "title"}


@dataclass(frozen=True)
class Source:
    """Where measured points were published. Example: ``Source("aiter-fmoe", "ROCm/aiter",
    "aiter/configs/tuned_fmoe.csv", commit="1a2b3c4")``; or ``url`` for a blog post."""

    id: str
    repository: str = ""
    path: str = ""
    commit: str = ""
    pr: int | None = None
    url: str = ""
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        out = {"id": self.id}
        for key in ("repository", "path", "commit", "pr", "url", "note"):
            value = getattr(self, key)
            if value not in ("", None):
                out[key] = value
        return out


@dataclass(frozen=True)
class KernelSet:
    """One kernel library's timings.

    name: e.g. ``"aiter"``. tables: ``{(op kind, dtype, scope, mode, layout): Table}``
        (``TableKey``; ``""`` where the table names no mode / layout).
    relative_to: the set this one scales (``"none"``: the roofline), or None.
    speedup: ``{op kind: (factor, source id)}``: this set's time is the base's over ``factor``.
    plan_options: fusions the library implies. Example: ``{"shared_expert_in_moe": True}``.
    """

    name: str
    description: str
    tables: Mapping[TableKey, Table]
    relative_to: str | None = None
    speedup: Mapping[str, tuple[float, str]] = field(default_factory=dict)
    plan_options: Mapping[str, Any] = field(default_factory=dict)

    def table(self, op: str, dtype: str, scope: str = "intra", mode: str = "",
              layout: str = "") -> Table | None:
        """The set's own table of exactly these selectors (None: none)."""
        return self.tables.get((op, dtype, scope, mode, layout))

    def pick(self, op: str, dtype: str, scope: str, mode: str = "", layout: str = ""
             ) -> Table | None:
        """The set's own table a step in exchange ``mode`` with MoE ``layout`` uses for
        ``op`` in ``dtype`` and ``scope`` (module docstring: the most specific match)."""
        best, rank = None, -1
        for (o, d, sc, m, lay), t in self.tables.items():
            if (o, d, sc) != (op, dtype, scope) or not t.matches(mode, layout):
                continue
            # selectors the step gives and the table names alike: the more, the more specific
            specific = (bool(m) and m == mode) + (bool(lay) and lay == layout)
            if specific > rank:
                best, rank = t, specific
        return best


@dataclass(frozen=True)
class KernelSets:
    """A profile's ``kernels`` section: its sets, the default one, the sources they cite and
    the points the table guard flagged (``flagged``)."""

    default: str
    sets: Mapping[str, KernelSet]
    sources: Mapping[str, Source]
    #: points below the table guard's floor (``table_guard``), kept and flagged
    flagged: tuple[table_guard.Verdict, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """Set names, ``"none"`` (roofline only) last."""
        return (*self.sets, NONE)

    def get(self, name: str) -> KernelSet | None:
        """The set ``name`` (None for ``"none"``); unknown: one line naming the sets."""
        if name == NONE:
            return None
        if name not in self.sets:
            raise EpsimError(f"unknown kernel set {name!r}; this profile has "
                             f"{', '.join(self.names)}")
        return self.sets[name]

    def cited(self, name: str) -> dict[str, str]:
        """Where the tables set ``name`` times with were published, per source id: its own
        tables' and points' sources, its speedups' and those of the sets it scales, each as
        ``repository@commit`` (else ``repository#pr``, else the url). Example:
        ``{"aiter-gemm-mi300x": "ROCm/aiter@e4048607a535ace3a2b51ded31b1c8c2d45c0879"}``."""
        ids: list[str] = []
        current = self.get(name)
        while current is not None:
            for table in current.tables.values():
                ids += table.sources
            ids += [source for _, source in current.speedup.values()]
            current = self.get(current.relative_to) if current.relative_to else None
        return {sid: _where(self.sources[sid]) if sid in self.sources else sid
                for sid in sorted(set(ids))}

    def resolve(self, name: str, kind: str, dtype: str, scope: str, mode: str = "",
                layout: str = ""
                ) -> tuple[Table | None, float, tuple[tuple[str, float, str], ...]]:
        """The table set ``name`` times ``kind`` with, the factor on its (or the roofline's)
        time, and the scalings applied: ``((set, factor, source id), ...)``. ``mode``: the EP
        exchange mode of the step, ``layout``: its MoE layout (a table measured in another
        deployment does not apply; ``KernelSet.pick``)."""
        factor, chain = 1.0, []
        current = self.get(name)
        while current is not None:
            table = current.pick(kind, dtype, scope, mode, layout)
            if table is not None:
                return table, factor, tuple(chain)
            if current.relative_to is None:
                break
            if kind in current.speedup:
                value, source = current.speedup[kind]
                factor /= value
                chain.append((current.name, 1.0 / value, source))
            current = self.get(current.relative_to)
        return None, factor, tuple(chain)


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


def _where(src: Source) -> str:
    """A source as one token a result can carry: ``repository@commit``, ``repository#pr`` or
    the url (what a reader needs to fetch the exact table)."""
    if src.repository and src.commit:
        return f"{src.repository}@{src.commit}"
    if src.repository and src.pr is not None:
        return f"{src.repository}#{src.pr}"
    return src.url or src.repository or src.id


def _member(value: Any, names: Any) -> bool:
    """``value`` is a string among ``names`` (a list or a number from JSON is not: it would
    raise TypeError on a dict lookup instead of the one-line error)."""
    return isinstance(value, str) and value in names


#: table features that count things (whole numbers, at most MAX_ID)
_WHOLE_FEATURES = frozenset({"ranks", "experts", "top_k", "heads"})


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not MIN_PROFILE_NUMBER <= value <= MAX_PROFILE_NUMBER:  # a profile's bounds
        raise EpsimError(f"{where} must be a positive number in [{MIN_PROFILE_NUMBER:g}, "
                         f"{MAX_PROFILE_NUMBER:g}], got {show(value)}")
    return float(value)


def _text(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value.strip():
        raise EpsimError(f"{where}.{key} must be a non-empty string, got {value!r}")
    return value


def _unknown(obj: Mapping[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise EpsimError(f"{where}: unknown key {extra[0]!r} (allowed: {', '.join(sorted(allowed))})")


def _source(sid: str, obj: Any, where: str) -> Source:
    if not isinstance(obj, Mapping):
        raise EpsimError(f"{where} must be an object")
    _unknown(obj, _SOURCE_KEYS, where)
    if "url" in obj:
        return Source(sid, url=_text(obj, "url", where), note=str(obj.get("note", "")))
    repo, path = _text(obj, "repository", where), _text(obj, "path", where)
    commit, pr = obj.get("commit", ""), obj.get("pr")
    if not commit and pr is None:
        raise EpsimError(f"{where} needs a commit or a pr (or a url instead of a repository)")
    if commit and (not isinstance(commit, str) or not _HEX.match(commit)):
        raise EpsimError(f"{where}.commit must be 7-40 hex digits, got {commit!r}")
    if pr is not None and (isinstance(pr, bool) or not isinstance(pr, int) or pr < 1):
        raise EpsimError(f"{where}.pr must be a positive integer, got {pr!r}")
    return Source(sid, repo, path, commit or "", pr, note=str(obj.get("note", "")))


def _table(obj: Any, where: str, sources: Mapping[str, Source], set_name: str) -> Table:
    if not isinstance(obj, Mapping):
        raise EpsimError(f"{where} must be an object")
    _unknown(obj, _TABLE_KEYS, where)
    kind = obj.get("op")
    if not _member(kind, FEATURES):
        raise EpsimError(f"{where}.op must be one of {', '.join(FEATURES)}, got {kind!r}")
    dtype = _text(obj, "dtype", where)
    unit = obj.get("unit")
    if not _member(unit, UNITS):
        raise EpsimError(f"{where}.unit must be one of {', '.join(UNITS)}, got {unit!r}")
    scope = obj.get("scope", "intra")
    if kind not in COLLECTIVE_TABLES and "scope" in obj:
        raise EpsimError(f"{where}.scope is for collectives only ({kind} has none)")
    if not _member(scope, SCOPES):
        raise EpsimError(f"{where}.scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    mode = obj.get("mode", "")
    if "mode" in obj and (kind not in MODE_KINDS or not _member(mode, TABLE_MODES)):
        raise EpsimError(f"{where}.mode must be one of {', '.join(TABLE_MODES)} (tables of "
                         f"{', '.join(sorted(MODE_KINDS))} only), got {mode!r}")
    layout = obj.get("layout", "")
    if "layout" in obj and (kind not in LAYOUT_KINDS or not _member(layout, LAYOUTS)):
        raise EpsimError(f"{where}.layout must be one of {', '.join(LAYOUTS)} (tables of "
                         f"{', '.join(sorted(LAYOUT_KINDS))} only), got {layout!r}")
    spec = dict(FEATURES[kind])
    given = obj.get("features")
    if not isinstance(given, list) or not given:
        raise EpsimError(f"{where}.features must be a non-empty list of {kind} features")
    for name in given:
        if not _member(name, spec):
            raise EpsimError(f"{where}.features: unknown {kind} feature {name!r} "
                             f"(known: {', '.join(spec)})")
    if len(set(given)) != len(given):
        raise EpsimError(f"{where}.features lists a feature twice: {given}")
    missing = [n for n, d in spec.items() if d is None and n not in given]
    if missing:
        raise EpsimError(f"{where}.features lacks {', '.join(missing)} (a {kind} table needs "
                         f"{', '.join(n for n, d in spec.items() if d is None)})")
    default_source = obj.get("source")
    if default_source is not None and not _member(default_source, sources):
        raise EpsimError(f"{where}.source: unknown source id {default_source!r}")
    points = obj.get("points")
    if not isinstance(points, list) or not points:
        raise EpsimError(f"{where}.points must be a non-empty list")
    order = [n for n, _ in FEATURES[kind]]
    rows, secs, point_sources, seen = [], [], [], {}
    for i, p in enumerate(points):
        pw = f"{where}.points[{i}]"
        if not isinstance(p, list) or len(p) not in (len(given) + 1, len(given) + 2):
            raise EpsimError(f"{pw} must be [{', '.join(given)}, time] (+ a source id), got "
                             f"{p!r}")
        named = {n: _positive(v, f"{pw} {n}") for n, v in zip(given, p, strict=False)}
        for n in _WHOLE_FEATURES & set(named):  # counts: half a rank sizes an empty group
            check_count(named[n], MAX_ID, n, pw)
        secs.append(_positive(p[len(given)], f"{pw} time"))
        sid = p[len(given) + 1] if len(p) == len(given) + 2 else default_source
        if sid is None:
            raise EpsimError(f"{pw} has no source (give one per point or the table's source)")
        if not _member(sid, sources):
            raise EpsimError(f"{pw}: unknown source id {sid!r}")
        row = tuple(named.get(n, spec[n]) for n in order)
        if row in seen:
            raise EpsimError(f"{pw} duplicates points[{seen[row]}] (same features)")
        seen[row] = i
        rows.append(row)
        point_sources.append(sid)
    seconds = np.array([float(Decimal(repr(t)).scaleb(UNITS[unit])) for t in secs])
    if not (seconds > 0).all() or not np.isfinite(seconds).all():  # under- or overflow
        raise EpsimError(f"{where}.points[{int(np.argmin(seconds))}] time is not a positive "
                         f"number of seconds once converted from {unit}")
    return Table(kind, dtype, scope, str(obj.get("quant", "")), tuple(order),
                 np.array(rows, dtype=np.float64), seconds,
                 tuple(point_sources), f"kernels.sets.{set_name}.{where.rsplit('.', 1)[-1]}",
                 unit, tuple(secs), tuple(given), mode, layout, str(obj.get("note", "")))


def _kernel_set(name: str, obj: Any, where: str, sources: Mapping[str, Source]) -> KernelSet:
    if not isinstance(obj, Mapping):
        raise EpsimError(f"{where} must be an object")
    _unknown(obj, _SET_KEYS, where)
    tables: dict[TableKey, Table] = {}
    raw_tables = obj.get("tables", [])
    if not isinstance(raw_tables, list):
        raise EpsimError(f"{where}.tables must be a list")
    for i, t in enumerate(raw_tables):
        table = _table(t, f"{where}.tables[{i}]", sources, name)
        key = (table.op, table.dtype, table.scope, table.mode, table.layout)
        if key in tables:
            named = f" ({table.deployment})" if table.deployment else ""
            raise EpsimError(f"{where}.tables[{i}] repeats a {table.op} {table.dtype} "
                             f"{table.scope}{named} table")
        tables[key] = table
    relative_to = obj.get("relative_to")
    if relative_to is not None and (not isinstance(relative_to, str) or not relative_to):
        raise EpsimError(f"{where}.relative_to must be a set name, got {relative_to!r}")
    speedup: dict[str, tuple[float, str]] = {}
    raw_speedup = obj.get("speedup", {})
    if not isinstance(raw_speedup, Mapping):
        raise EpsimError(f"{where}.speedup must be an object {{op kind: {{value, source}}}}")
    if raw_speedup and relative_to is None:
        raise EpsimError(f"{where}.speedup needs relative_to (the set it speeds up)")
    for kind, entry in raw_speedup.items():
        sw = f"{where}.speedup.{kind}"
        if kind not in OP_KINDS:
            raise EpsimError(f"{sw}: unknown op kind (known: {', '.join(OP_KINDS)})")
        if not isinstance(entry, Mapping) or set(entry) - {"value", "source", "note"}:
            raise EpsimError(f"{sw} must be an object {{value, source}}")
        sid = entry.get("source")
        if not _member(sid, sources):
            raise EpsimError(f"{sw}.source: unknown source id {sid!r}")
        speedup[kind] = (_positive(entry.get("value"), f"{sw}.value"), sid)
    options = obj.get("plan_options", {})
    if not isinstance(options, Mapping):
        raise EpsimError(f"{where}.plan_options must be an object")
    for key, value in options.items():
        if key not in PLAN_OPTIONS:
            raise EpsimError(f"{where}.plan_options: unknown option {key!r} (known: "
                             f"{', '.join(PLAN_OPTIONS)})")
        if not isinstance(value, PLAN_OPTIONS[key]):
            raise EpsimError(f"{where}.plan_options.{key} must be a "
                             f"{PLAN_OPTIONS[key].__name__}, got {value!r}")
    if not tables and relative_to is None:
        raise EpsimError(f"{where} has neither tables nor relative_to")
    return KernelSet(name, str(obj.get("description", "")), tables, relative_to, speedup,
                     dict(options))


def parse_kernels(obj: Any, where: str = "profile", roof: table_guard.Roof | None = None
                  ) -> KernelSets:
    """Validate a profile's ``kernels`` object (module docstring); a malformed one is an
    :class:`EpsimError` of one line naming the key or point. ``roof``: the device's peaks, for
    the table guard (``table_guard``: a point above peak is refused, one below the floor kept
    and flagged); None: no guard."""
    w = f"{where}: kernels"
    if not isinstance(obj, Mapping):
        raise EpsimError(f"{w} must be an object")
    _unknown(obj, {"default", "sources", "sets"}, w)
    raw_sources = obj.get("sources", {})
    if not isinstance(raw_sources, Mapping):
        raise EpsimError(f"{w}.sources must be an object {{id: source}}")
    sources = {str(k): _source(str(k), v, f"{w}.sources.{k}") for k, v in raw_sources.items()}
    raw_sets = obj.get("sets")
    if not isinstance(raw_sets, Mapping) or not raw_sets:
        raise EpsimError(f"{w}.sets must be a non-empty object {{name: set}}")
    sets: dict[str, KernelSet] = {}
    for name, s in raw_sets.items():
        if not isinstance(name, str) or not name or name == NONE:
            raise EpsimError(f"{w}.sets: {name!r} is not a usable set name ('none' is reserved)")
        sets[name] = _kernel_set(name, s, f"{w}.sets.{name}", sources)
    for name, s in sets.items():
        seen = [name]
        base = s.relative_to
        while base is not None and base != NONE:
            if base not in sets:
                raise EpsimError(f"{w}.sets.{name}.relative_to: unknown set {base!r}")
            if base in seen:
                raise EpsimError(f"{w}.sets.{name}.relative_to: a cycle "
                                 f"({' -> '.join([*seen, base])})")
            seen.append(base)
            base = sets[base].relative_to
    default = obj.get("default")
    if default != NONE and not _member(default, sets):
        raise EpsimError(f"{w}.default must name a set or 'none' "
                         f"({', '.join([*sets, NONE])}), got {default!r}")
    flagged: tuple[table_guard.Verdict, ...] = ()
    if roof is not None:
        cite = {sid: _cite_text(src) for sid, src in sources.items()}
        flagged = table_guard.refuse((t for s in sets.values() for t in s.tables.values()),
                                     roof, cite, where)
    return KernelSets(default, sets, sources, flagged)


def _cite_text(src: Source) -> str:
    """A source in a few words: its url, or repository, path and commit (or PR)."""
    ref = src.commit or (f"PR #{src.pr}" if src.pr is not None else "")
    return src.url or " ".join(filter(None, (src.repository, src.path, ref)))
