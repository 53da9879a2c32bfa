"""The frontier chart of sweep, tune and plan (``--plot``, ``--frontier-csv``, ``--gpu-hour-usd``):
output tok/s per GPU against interactivity (tok/s per user), one Pareto line per series
(``epsim.sim.search.frontier``; docs/serving.md "The frontier chart")."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from epsim.model.errors import EpsimError
from epsim.model.outputs import staged_path
from epsim.sim.search.frontier import frontier_points, slo_interactivity
from epsim.sim.search.slo import SLO

from .common import write_csv
from .inputs import add_flag
from .provenance import footer_text, provenance

#: what a frontier point carries of its row besides the chart's axes (those the row has)
CARRIED = ("hardware", "engine", "concurrency", "nodes", "gpus", "dp", "tp", "ep", "dbo",
           "kv_dtype", "isl", "osl", "request_rate", "output_throughput", "mean_tpot_ms",
           "meets_slo", "provenance")


def add_frontier_args(parser: argparse.ArgumentParser, *, prices: bool = True) -> None:
    """``--plot``, ``--frontier-csv`` and (``prices``; plan has its own) ``--gpu-hour-usd``."""
    g = parser.add_argument_group("the frontier chart (docs/serving.md)")
    add_flag(g, "--plot", metavar="OUT.png", default=None)
    add_flag(g, "--frontier-csv", metavar="OUT", default=None,
             help="write every point on the chart's axes as CSV, on_frontier marking the "
             "Pareto points of its series")
    if prices:
        add_flag(g, "--gpu-hour-usd", default=None)


def check_prices(prices: Mapping[str, float] | None, hardware: Sequence[str]) -> None:
    """A price for a hardware that is not run is an error (a typo would price nothing)."""
    unknown = sorted(set(prices or {}) - {"*", *hardware})
    if unknown:
        raise EpsimError(f"--gpu-hour-usd prices {', '.join(unknown)}, which is not "
                         f"searched (--hardware {','.join(hardware)})")


def require_matplotlib() -> None:
    """An error before any work when --plot cannot be drawn."""
    import importlib.util

    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except Exception:  # a broken install: as good as missing
        found = False
    if not found:
        raise EpsimError("--plot needs matplotlib (pip install 'epsim[plot]')")


def series_label(row: Mapping[str, Any], keys: Sequence[str]) -> str:
    """A series' name from its row: hardware and engine, then each key in ``keys`` (the swept
    ones that split series). Example: ``"h200 sglang, isl 2000"``."""
    head = f"{row['hardware']} {row.get('engine') or ''}".strip()
    return ", ".join([head, *(f"{k} {row[k]}" for k in keys)])


def frontier_of(rows: Sequence[Mapping[str, Any]], series_of: Callable[[Mapping[str, Any]], str],
                prices: Mapping[str, float] | None) -> list[dict[str, Any]]:
    """The chart's points of ``rows`` (the JSON's ``"interactivity_frontier"``)."""
    carry = [k for k in CARRIED if any(k in r for r in rows)]
    return frontier_points(rows, series_of, prices, carry)


def _note(p: Mapping[str, Any]) -> str:
    """A frontier point's label: its concurrency, and its $/M tokens when priced."""
    parts = [f"c{p['concurrency']}"] if p.get("concurrency") is not None else []
    if p.get("usd_per_million_output_tokens") is not None:
        parts.append(f"${p['usd_per_million_output_tokens']:.2f}/M")
    return " ".join(parts)


def _draw_series(ax: Any, name: str, pts: Sequence[Mapping[str, Any]], below: bool) -> None:
    """One series: its frontier joined and labelled (``below``: labels under the points, so
    two series' labels do not meet), its dominated points faint and loose."""
    front = [p for p in pts if p["on_frontier"]]
    price = pts[0].get("gpu_hour_usd")
    if price is not None:
        name += f" (${price:g}/GPU-hour)"
    line, = ax.plot([p["interactivity_tok_s_user"] for p in front],
                    [p["output_tok_s_per_gpu"] for p in front], marker="o", label=name)
    rest = [p for p in pts if not p["on_frontier"]]
    if rest:
        ax.scatter([p["interactivity_tok_s_user"] for p in rest],
                   [p["output_tok_s_per_gpu"] for p in rest], s=14, alpha=0.25,
                   color=line.get_color())
    for p in front:
        ax.annotate(_note(p), (p["interactivity_tok_s_user"], p["output_tok_s_per_gpu"]),
                    textcoords="offset points", xytext=(4, -11 if below else 4), fontsize=7,
                    color=line.get_color())


def write_frontier_plot(points: Sequence[Mapping[str, Any]], path: str, title: str,
                        slo: SLO | None = None) -> None:
    """The frontier chart as a PNG, written whole or not at all."""
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for n, name in enumerate(dict.fromkeys(p["series"] for p in points)):
        _draw_series(ax, name, [p for p in points if p["series"] == name], below=n % 2 == 1)
    met = [p for p in points if p.get("meets_slo")]
    if met:  # every term of the SLO, TTFT's too, which the axes cannot show
        ax.scatter([p["interactivity_tok_s_user"] for p in met],
                   [p["output_tok_s_per_gpu"] for p in met], s=90, facecolors="none",
                   edgecolors="black", linewidths=0.8, label="meets the whole SLO")
    for term, x in slo_interactivity(slo):  # the SLO passes right of its line
        ax.axvline(x, color="0.35", linestyle="--", linewidth=1)
        ax.annotate(f"SLO {term}", (x, 1), xycoords=("data", "axes fraction"),
                    xytext=(3, -12), textcoords="offset points", fontsize=7, color="0.35")
    ax.set_xlabel("interactivity: output tok/s per user (1000 / mean TPOT ms)")
    ax.set_ylabel("output tok/s per GPU")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    # beside the axes: inside, it would hide the low-throughput, high-interactivity corner
    ax.legend(fontsize=8, title="Pareto line per series (faint: dominated)", title_fontsize=7,
              loc="upper left", bbox_to_anchor=(1.01, 1.0))
    # under the axes: a chart passed around alone still says what made it
    fig.text(0.01, -0.02, chart_footer(points), fontsize=6, color="0.4", va="top",
             family="monospace")
    try:
        with staged_path(path) as tmp:
            fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")
    finally:
        plt.close(fig)


def chart_footer(points: Sequence[Mapping[str, Any]]) -> str:
    """The chart's footer: the provenance of its points (``epsim.provenance.footer_text``)."""
    marks = [p["provenance"] for p in points if isinstance(p.get("provenance"), Mapping)]
    return footer_text(provenance(*marks))


def chart_title(row: Mapping[str, Any], what: str) -> str:
    """``"deepseek-r1, in 2000 / out 100 tokens: sweep (simulated)"``."""
    return f"{row['model']}, in {row.get('isl')} / out {row.get('osl')} tokens: {what} (simulated)"


def write_frontier_outputs(args: argparse.Namespace, points: Sequence[Mapping[str, Any]],
                           first: Mapping[str, Any], what: str, slo: SLO | None) -> None:
    """``--frontier-csv`` and ``--plot`` of a search, where asked."""
    if args.frontier_csv:
        write_csv(points, args.frontier_csv)
    if args.plot:
        write_frontier_plot(points, args.plot, chart_title(first, what), slo)
