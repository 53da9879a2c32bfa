"""Generate the tables of docs/hardware.md from the shipped profiles, so docs and profiles
cannot drift.

    python tools/hardware_doc.py           # rewrite the generated blocks of docs/hardware.md
    python tools/hardware_doc.py --check   # exit 1 (one line) when the doc is out of date

A generated block sits between ``<!-- BEGIN generated: NAME -->`` and ``<!-- END generated: NAME
-->``; everything else in the doc is written by hand. Blocks: ``specs`` (peak figures),
``efficiency`` (the achievable-efficiency constants) and ``kernels`` (each profile's kernel
sets: tables, op kinds, dtypes, point counts, feature ranges, sources). ``tests/project/test_docs.py``
runs ``--check``.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from epsim.sim.hardware.profile import HardwareProfile, load_profile, shipped_profiles

DOC = Path(__file__).resolve().parents[1] / "docs" / "hardware.md"


def _num(x: float, digits: int = 6) -> str:
    return f"{x:.{digits}g}"


def _row(label: str, profiles: list[HardwareProfile], cell: Callable[[HardwareProfile], str]
         ) -> str:
    return "| " + " | ".join([label, *(cell(p) for p in profiles)]) + " |"


def _fabric(p: HardwareProfile) -> str:
    f = p.raw["fabric"]
    kind = "full mesh" if f["topology"] == "full_mesh" else "switch"
    return f"{kind}, {f['links_per_gpu']} x {_num(f['link_bandwidth'] / 1e9)} GB/s"


def specs_table(profiles: list[HardwareProfile]) -> list[str]:
    """Peak figures, one column per profile."""
    head = ["| figure | " + " | ".join(p.name for p in profiles) + " |",
            "|---" * (len(profiles) + 1) + "|"]
    rows = [
        _row("compute units", profiles, lambda p: str(p.raw["compute_units"])),
        _row("dense BF16 peak (TFLOP/s)", profiles,
             lambda p: _num(p.raw["peak_flops"]["bf16"] / 1e12)),
        _row("dense FP8 peak (TFLOP/s)", profiles,
             lambda p: _num(p.raw["peak_flops"]["fp8"] / 1e12)),
        _row("HBM (GB)", profiles, lambda p: _num(p.raw["hbm_bytes"] / 1e9)),
        _row("HBM peak (TB/s)", profiles, lambda p: _num(p.raw["hbm_bandwidth"] / 1e12)),
        _row("intra-node fabric (per direction)", profiles, _fabric),
        _row("NIC per GPU (GB/s per direction)", profiles,
             lambda p: _num(p.raw["nic_bandwidth_per_gpu"] / 1e9)),
        _row("kernel launch (us)", profiles, lambda p: _num(p.raw["kernel_launch_s"] * 1e6)),
    ]
    return head + rows


#: a figure whose source says it is not a measurement
_ASSUMED = re.compile(r"\b(assum|estimate|as mi3|as h1|taken as|borrowed)", re.I)


def _eff(key: str, scale: float = 1.0, digits: int = 4) -> Callable[[HardwareProfile], str]:
    def cell(p: HardwareProfile) -> str:
        value = p.raw.get("efficiency", {}).get(key)
        if value is None:
            return "-"
        if isinstance(value, dict):
            text = " / ".join(f"{k} {_num(v * scale, digits)}" for k, v in value.items())
        else:
            text = _num(value * scale, digits)
        source = str(p.sources.get(f"efficiency.{key}", ""))
        return text + (" †" if _ASSUMED.search(source) else "")
    return cell


EFFICIENCY_ROWS: tuple[tuple[str, str, float, str], ...] = (
    ("`gemm_flops_fraction`", "gemm_flops_fraction", 1.0,
     "achievable / peak FLOP/s of a large GEMM"),
    ("`gemm_tile_m`", "gemm_tile_m", 1.0,
     "matrix-core tile rows: a GEMM of M rows pays `ceil(M/tile)*tile`"),
    ("`hbm_fraction`", "hbm_fraction", 1.0, "achievable / peak HBM bandwidth"),
    ("`attention_split_tokens`", "attention_split_tokens", 1.0,
     "split-KV granularity of decode attention"),
    ("`attention_decode_flops` (TFLOP/s)", "attention_decode_flops", 1e-12,
     "a published decode-attention kernel's achieved rate (absent: the GEMM rate)"),
    ("`link_bandwidth_usable` (GB/s)", "link_bandwidth_usable", 1e-9,
     "what an all-to-all gets per link (mesh) or per GPU (switch)"),
    ("`nic_bandwidth_usable` (GB/s)", "nic_bandwidth_usable", 1e-9, "per GPU, inter-node"),
    ("`a2a_latency_s` (us)", "a2a_latency_s", 1e6, "fixed cost of one dispatch or combine"),
    ("`collective_latency_s` (us)", "collective_latency_s", 1e6,
     "small all-reduce / all-gather, eager"),
    ("`collective_latency_graph_s` (us)", "collective_latency_graph_s", 1e6,
     "the same inside a captured graph"),
    ("`graph_launch_s` (us)", "graph_launch_s", 1e6, "one graph launch"),
    ("`graph_node_s` (us)", "graph_node_s", 1e6, "GPU-side gap between two kernels"),
    ("`kernel_floor_s` (us)", "kernel_floor_s", 1e6,
     "least time one kernel occupies the GPU (launch to finish in a graph)"),
    ("`framework_dispatch_s` (us)", "framework_dispatch_s", 1e6,
     "eager: the framework's op call behind each kernel launch"),
    ("`comm_compute_slowdown`", "comm_compute_slowdown", 1.0,
     "compute lost while a comm kernel runs"),
)


def efficiency_table(profiles: list[HardwareProfile]) -> list[str]:
    head = ["| key | " + " | ".join(p.name for p in profiles) + " | meaning |",
            "|---" * (len(profiles) + 2) + "|"]
    rows = [_row(label, profiles, _eff(key, scale))[:-1] + f"| {meaning} |"
            for label, key, scale, meaning in EFFICIENCY_ROWS]
    return [*head, *rows, "",
            "† the profile's own source for the figure says it is an assumption or an "
            "estimate, not a measurement."]


def _ranges(table: Any) -> str:
    out = []
    for i, name in enumerate(table.features):
        if table.listed and name not in table.listed:
            continue
        values = sorted({float(v) for v in table.x[:, i]})
        if len(values) == 1:
            out.append(f"{name} {values[0]:g}")
        else:
            out.append(f"{name} {values[0]:g}-{values[-1]:g} ({len(values)})")
    return ", ".join(out)


def _cite(source: Any) -> str:
    j = source.to_json()
    if "url" in j:
        return j["url"]
    ref = j.get("commit", "")[:12] or (f"PR #{j['pr']}" if "pr" in j else "")
    return " ".join(filter(None, [j.get("repository"), j.get("path"), ref]))


def kernels_table(profiles: list[HardwareProfile]) -> list[str]:
    """Every kernel set of every shipped profile: its tables or its scaling, with sources."""
    lines = ["| profile | set | op | dtype | scope | points | features (range, distinct values) "
             "| sources |", "|---|---|---|---|---|---|---|---|"]
    for p in profiles:
        ks = p.kernels
        if ks is None:
            lines.append(f"| {p.name} | - | (no kernels section: the roofline alone) | | | | | |")
            continue
        for name in ks.names:
            kset = ks.get(name)
            if kset is None:
                continue
            mark = f"{name} (default)" if name == ks.default else name
            for table in kset.tables.values():
                cited = "; ".join(f"{sid}: {_cite(ks.sources[sid])}"
                                  for sid in sorted(set(table.sources)))
                # the deployment the table measured (exchange mode, MoE layout), if it names one
                scope = f"{table.scope} ({table.deployment})" if table.deployment else table.scope
                lines.append(f"| {p.name} | {mark} | {table.op} | {table.dtype} | "
                             f"{scope} | {len(table.seconds)} | {_ranges(table)} | "
                             f"{cited} |")
            for kind, (factor, sid) in kset.speedup.items():
                lines.append(f"| {p.name} | {mark} | {kind} | | | | speedup {factor:g} over "
                             f"{kset.relative_to} | {sid}: {_cite(ks.sources[sid])} |")
    return lines


BLOCKS: dict[str, Callable[[list[HardwareProfile]], list[str]]] = {
    "specs": specs_table, "efficiency": efficiency_table, "kernels": kernels_table,
}


def render(text: str, profiles: Iterable[HardwareProfile]) -> str:
    """``text`` with every generated block replaced from ``profiles``."""
    profs = list(profiles)
    for name, build in BLOCKS.items():
        pattern = re.compile(rf"(<!-- BEGIN generated: {name} -->\n).*?(<!-- END generated: "
                             rf"{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"hardware_doc: {DOC} has no generated block {name!r}")
        body = "\n".join(build(profs)) + "\n"
        text = pattern.sub(lambda m, body=body: m.group(1) + body + m.group(2), text)
    return text


#: AMD first (the reference GPU), then NVIDIA; others after, by name
ORDER = ("mi300x", "mi325x", "mi355x", "h100", "h200", "h800")


def _order(name: str) -> tuple[int, str]:
    return (ORDER.index(name) if name in ORDER else len(ORDER), name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail when the doc is out of date")
    args = ap.parse_args(argv)
    profiles = [load_profile(name) for name in sorted(shipped_profiles(), key=_order)]
    old = DOC.read_text(encoding="utf-8")
    new = render(old, profiles)
    if args.check:
        if new != old:
            sys.stderr.write("hardware_doc: docs/hardware.md is out of date: run python "
                             "tools/hardware_doc.py\n")
            return 1
        return 0
    DOC.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
