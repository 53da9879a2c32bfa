"""Argument groups and output helpers the commands share.

Every flag a group defines takes its type and range from the validation layer
(``epsim.inputs``: its choices come from the package that owns them, KV dtypes from
``epsim.model.plan``, datasets from ``epsim.sim.workload.spec``, ...) and its default from
:class:`~epsim.sim.scenario.Scenario`'s and :class:`~epsim.sim.workload.spec.WorkloadSpec`'s own
defaults, so a help text cannot drift from what runs.

    model / hardware / plan    what is deployed: ``add_model_arg``, ``add_hardware_arg``,
                               ``add_plan_args``
    workload                   the benchmark (``vllm bench serve`` flags): ``add_workload_args``
    execution                  how it is served (DBO, EPLB, KV dtype, disaggregation, ...):
                               ``add_execution_args``
    engine                     a serving-engine preset and the flags that override it:
                               ``add_engine_args``
    scenario                   all of the above plus ``--json``: ``add_scenario_args``, read back
                               by ``scenario_from_args`` (predict, sweep)
    search                     a scenario plus the SLO and search space: ``add_search_args``,
                               read back by ``search_space_from_args`` and
                               ``search_base_from_args`` (tune, plan)
    lists                      sweep, tune and plan take comma lists where a value is swept;
                               the validation layer parses them into tuples
    outputs                    ``emit_json``, ``print_columns``, ``write_csv`` (sweep's and the
                               frontier's CSV: one column per JSON key)
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from epsim.model import jsonout
from epsim.model.errors import EpsimError
from epsim.model.loads import shipped_loads
from epsim.model.mtp import ACCEPTANCE_SOURCE, DEFAULT_ACCEPTANCE
from epsim.model.outputs import write_text_atomic
from epsim.sim.hardware.a2a import AUTO
from epsim.sim.scenario import Scenario
from epsim.sim.serving.metrics import (
    DEFAULT_PERCENTILE_METRICS,
    DEFAULT_PERCENTILES,
    goodput_slos,
    percentile_word,
)
from epsim.sim.serving.presets import EPSIM_CHUNKED_PREFILL
from epsim.sim.workload.spec import DATASETS, WorkloadSpec
from epsim.sim.workload.traces import shipped_traces

from .inputs import add_flag
from .provenance import row_provenance, stamp_provenance


def loads_help(what: str) -> str:
    """Help text of a ``--loads``-like flag: a file or one of the shipped names."""
    return (f"{what}: a shipped name ({', '.join(shipped_loads())}) or a file "
            '{"logical_count": [layers][experts]} (.json, or .pt with torch)')


def add_model_arg(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    add_flag(parser, "--model", required=required, metavar="M",
             help="shipped model name (e.g. deepseek-r1) or path to a config.json")


def add_plan_args(parser: argparse.ArgumentParser, *, lists: bool = False) -> None:
    g = parser.add_argument_group("parallel plan")
    add_flag(g, "--nodes", default=1, lists=lists,
             help="nodes (default 1)" + (" (comma list: tune searches them; plan: the "
                                          "co-located unit's nodes, one value)" if lists else ""))
    add_flag(g, "--gpus-per-node", default=None,
             help="GPUs per node (default: the hardware profile's, else 8)")
    add_flag(g, "--dp", default=None, help="data-parallel attention groups")
    add_flag(g, "--tp", default=None, help="tensor-parallel degree")
    add_flag(g, "--ep", default=None,
             help="expert-parallel degree: 1 or the world size (default: world if dp > 1)")
    add_flag(g, "--redundant-experts", default=Scenario.redundant_experts, metavar="R",
             help="replica slots per MoE layer for the hottest experts (balanced from the "
             "loads): experts + R slots, ep must divide them (default 0)")


def add_hardware_arg(parser: argparse.ArgumentParser, *, required: bool = True,
                     lists: bool = False) -> None:
    add_flag(parser, "--hardware", required=required, metavar="H", lists=lists,
             help="hardware profile name or path (e.g. mi300x)" + (" (comma list)" if lists
                                                                    else ""))


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


# --------------------------------------------------------------------------------------------
# A scenario: deployment + benchmark (predict, sweep; tune and plan through add_search_args)
# --------------------------------------------------------------------------------------------


def add_workload_args(parser: argparse.ArgumentParser, *, lists: bool = False) -> None:
    """The benchmark, with ``vllm bench serve``'s flag names and meanings."""
    many = " (comma list)" if lists else ""
    w = WorkloadSpec  # its field defaults are the flags' defaults
    g = parser.add_argument_group("benchmark (vllm bench serve semantics)")
    add_flag(g, "--concurrency", "--max-concurrency", dest="concurrency", lists=lists,
             default=None, metavar="C", help="closed loop: requests in flight at most" + many)
    add_flag(g, "--request-rate", lists=lists, default="inf" if lists else w.request_rate,
             metavar="R", help="open loop: requests/s, Poisson arrivals, or inf (default)" + many)
    add_flag(g, "--burstiness", default=w.burstiness,
             help="gamma shape of inter-arrival gaps (1: Poisson)")
    add_flag(g, "--num-prompts", default=None, metavar="N",
             help=f"requests in the benchmark (default: the concurrency, else {w.num_prompts}; "
             "--measure steady: enough for its window; "
             "--dataset trace: its first N rows, default all)")
    add_flag(g, "--measure", default=None, metavar="steady|burst",
             help="steady: every metric over a window without the warm-up burst and the "
             "cool-down drain, the run sized for it (default of tune and plan); burst: the "
             "whole run, as vllm bench serve reports a finite run (default of predict and "
             "sweep); docs/serving.md")
    add_flag(g, "--dataset", "--dataset-name", dest="dataset", default=None,
             help="request lengths (default: fixed with --isl, else sharegpt-like)")
    # --random-input / --random-output: the names SGLang's bench_serving documents (argparse
    # prefixes of its --random-input-len / --random-output-len), declared so they stay valid
    add_flag(g, "--isl", "--random-input-len", "--random-input", dest="isl", lists=lists,
             default=None, metavar="I", help="input tokens" + many)
    add_flag(g, "--osl", "--random-output-len", "--random-output", dest="osl", lists=lists,
             default=None, metavar="O", help="output tokens (exact, as under --ignore-eos)" + many)
    add_flag(g, "--random-range-ratio", default=w.random_range_ratio, metavar="r",
             help="random dataset: lengths uniform in [L(1-r), L(1+r)], r < 1 (vLLM), or in "
             f"[rL, L], r <= 1 (--bench-client sglang) (default {w.random_range_ratio:g})")
    add_bench_client_arg(g)
    add_flag(g, "--dataset-path", default=None, metavar="FILE",
             help="a local ShareGPT JSON for --dataset sharegpt-like; a request trace CSV "
             "(Azure's TIMESTAMP, ContextTokens, GeneratedTokens or Vidur's arrived_at, "
             "num_prefill_tokens, num_decode_tokens) or a shipped one "
             f"({', '.join(shipped_traces())}) for --dataset trace")
    add_flag(g, "--time-scale", default=w.time_scale, metavar="S",
             help="--dataset trace: arrival times x S (0.5 doubles the arrival rate; default 1)")
    add_flag(g, "--length-scale", default=1.0, metavar="F",
             help="--dataset trace: every prompt and output length x F, truncated, at least 1 "
             "(Vidur's prefill and decode scale factors together; default 1)")
    add_flag(g, "--prefill-scale", default=w.prefill_scale, metavar="F",
             help="--dataset trace: prompt lengths x F (Vidur's prefill_scale_factor; times "
             "--length-scale; default 1)")
    add_flag(g, "--decode-scale", default=w.decode_scale, metavar="F",
             help="--dataset trace: output lengths x F (Vidur's decode_scale_factor; times "
             "--length-scale; default 1)")
    add_flag(g, "--seed", default=w.seed, help=f"seeds requests and routing (default {w.seed})")
    percentiles = ",".join(percentile_word(p) for p in DEFAULT_PERCENTILES)
    add_flag(g, "--metric-percentiles", default=percentiles,
             help=f"percentiles reported (default {percentiles})")
    metrics = ",".join(DEFAULT_PERCENTILE_METRICS)
    add_flag(g, "--percentile-metrics", default=metrics,
             help=f"metrics with percentiles (default {metrics})")
    add_goodput_arg(g)


def add_goodput_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """vLLM's ``--goodput KEY:MS ...``: per-request SLOs that ``request_goodput`` counts."""
    add_flag(parser, "--goodput", nargs="+", default=None, metavar="KEY:MS",
             help="SLOs per request as vllm bench serve takes them (ttft:MS tpot:MS e2el:MS): "
             "request_goodput counts the requests meeting all of them, per second")


def add_bench_client_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                         default: str | None = WorkloadSpec.bench_client) -> None:
    """``--bench-client vllm|sglang``: whose benchmark flags (``--random-range-ratio``) these are."""
    add_flag(parser, "--bench-client", default=default,
             help="read the benchmark flags as this client does: vllm (vllm bench serve) or "
             "sglang (python -m sglang.bench_serving)" + (
                 f" (default {default})" if default else ""))


def add_kernels_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    add_flag(parser, "--kernels", default=None, metavar="SET",
             help="the hardware profile's kernel set: measured kernel tables of one library "
             "(e.g. aiter, no-aiter on mi300x; default: the profile's own default set; none: the "
             "roofline alone); the fusions the set implies join the plan")


def add_a2a_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    add_flag(parser, "--a2a-mode", default=AUTO,
             help="how EP dispatch/combine run: low_latency (pure RDMA per target GPU, kernels "
             "that free the compute units: no interference), normal (node-then-GPU: one NIC "
             "crossing per destination node, forwarded over the node's fabric; occupies compute "
             "units); auto (default): across nodes as SGLang's --deepep-mode auto (low_latency "
             "for decode, normal for a step with any prefill), normal within one node (epsim's "
             "assumption; SGLang would pick low_latency there)")


def add_mtp_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                 lists: bool = False) -> None:
    """``--mtp N`` and ``--mtp-acceptance P``: MTP speculative decoding (step, predict, sweep,
    tune, plan, run; ``lists``: tune and plan search a comma list of N)."""
    add_flag(parser, "--mtp", default=None if lists else 0, metavar="N", lists=lists,
             help="MTP speculative decoding: draft tokens per decode step, verified by the next "
             "step (1 + N query tokens per sequence) and proposed by the model's MTP draft "
             "module run N times (default 0: off)")
    add_flag(parser, "--mtp-acceptance", default=DEFAULT_ACCEPTANCE, metavar="P",
             help="probability that a draft token is accepted given the one before it was "
             f"(default {DEFAULT_ACCEPTANCE:g}: {ACCEPTANCE_SOURCE})".replace("%", "%%"))


def add_execution_args(parser: argparse.ArgumentParser, *, lists: bool = False,
                       search: bool = False) -> None:
    """How the deployment serves: overlap, placement, graphs, KV, disaggregation, scheduling
    (``search``: tune and plan, whose ``--dbo`` is the list of values to try)."""
    many = " (comma list)" if lists else ""
    sc = Scenario  # its field defaults are the flags' defaults
    o = parser.add_argument_group("execution options")
    add_kernels_arg(o)
    add_a2a_arg(o)
    if not search:
        o.add_argument("--dbo", action="store_true",
                       help="two microbatches (dual-batch overlap): the default only under "
                       "--engine split; vllm and sglang run without it unless given")
    o.add_argument("--no-dbo", action="store_true", help="one microbatch (no dual-batch overlap)")
    o.add_argument("--no-eplb", action="store_true", help="contiguous expert placement")
    o.add_argument("--no-graph", action="store_true", help="eager launches (no graph replay)")
    add_flag(o, "--kv-dtype", default=sc.kv_dtype, lists=lists,
             help=f"KV-cache dtype (default {sc.kv_dtype})" + many)
    add_flag(o, "--loads", default=None, metavar="NAME|FILE",
             help=loads_help("expert load statistics for routing (default: synthetic)"))
    add_flag(o, "--disagg", default=None, metavar="P:D",
             help="prefill on P nodes, decode on D nodes (KV shipped over the NIC)")
    add_flag(o, "--chunked-prefill-size", default=None, lists=search,
             help="prompt tokens one rank prefills per step (default: the engine's; "
             f"{EPSIM_CHUNKED_PREFILL} under --engine prefill_first)" + (" (comma list)" if search else ""))
    add_flag(o, "--dp-balance", default=sc.dp_balance,
             help=f"how requests are spread over dp ranks (default {sc.dp_balance})")
    add_flag(o, "--mem-fraction", default=sc.mem_fraction,
             help=f"share of HBM for weights + activations + KV (default {sc.mem_fraction})")
    add_mtp_args(o, lists=search)


def add_instance_args(parser: argparse.ArgumentParser) -> None:
    """Instances behind a router, and the prefill side's own plan (docs/serving.md)."""
    sc = Scenario  # its field defaults are the flags' defaults
    g = parser.add_argument_group("instances and the prefill side's plan")
    add_flag(g, "--instance-nodes", default=None, metavar="K",
             help="cut each side (prefill and decode under --disagg P:D, else --nodes) into "
             "independent instances of K nodes, each running the plan over its own GPUs, "
             "behind a router (K must divide each side's nodes; default: one instance per side)")
    add_flag(g, "--router", default=sc.router,
             help="how requests are spread over the instances: round_robin or least_loaded "
             f"(fewest outstanding requests; Vidur's global schedulers; default {sc.router})")
    for side in ("tp", "dp", "ep"):
        add_flag(g, f"--prefill-{side}", default=None,
                 help=f"--disagg: the prefill side's {side} (default: the decode side's "
                 "tp and EP choice over a prefill instance's GPUs)")


def add_engine_args(parser: argparse.ArgumentParser, *, lists: bool = False) -> None:
    """A serving engine's scheduling policy and defaults, and the flags that override them."""
    g = parser.add_argument_group(
        "serving engine (docs/serving.md: each preset's defaults and their sources)")
    add_flag(g, "--engine", default=None,
             help="schedule as this engine does, with its defaults: vllm (V1: decode first, "
             "prompt chunks in the same step), sglang (prefill first, reservation and "
             "retraction), split (separate prefill and decode queues), prefill_first (epsim's "
             "own: prefill first, no caps, no host time); default: the hardware vendor's "
             "engine, vllm on AMD and sglang on NVIDIA")
    add_flag(g, "--max-num-seqs", default=None, metavar="N", lists=lists,
             help="requests one dp rank runs at most (vLLM max_num_seqs; SGLang "
             "max_running_requests / dp)" + (" (comma list)" if lists else ""))
    add_flag(g, "--max-num-batched-tokens", default=None, metavar="T",
             help="tokens in one rank's step at most (vLLM's budget, decodes included; "
             "SGLang's max_prefill_tokens)")
    add_flag(g, "--cuda-graph-max-bs", default=None, metavar="B",
             help="the largest decode batch per rank a captured graph replays; larger steps "
             "run eagerly")
    add_flag(g, "--host-ms-per-step", default=None, metavar="MS",
             help="pin the engine's host time per step to a flat value (scheduling, inputs, "
             "sampling, output processing); default: the engine's host model, by requests "
             "per rank (docs/serving.md); 0 under prefill_first")
    g.add_argument("--no-host-overlap", action="store_true",
                   help="the host's work adds to each step instead of overlapping the GPU "
                   "(vLLM before async scheduling became its default, or "
                   "--no-async-scheduling; SGLang --disable-overlap-schedule)")


def add_scenario_args(parser: argparse.ArgumentParser, *, lists: bool = False,
                      hardware_required: bool = True, hardware_lists: bool = False,
                      search: bool = False) -> None:
    """Everything a :class:`Scenario` is built from, plus ``--json`` (``lists``: comma lists
    where sweepable)."""
    add_model_arg(parser)
    add_hardware_arg(parser, required=hardware_required, lists=hardware_lists)
    add_plan_args(parser, lists=search)
    parser.set_defaults(nodes=None)  # None: 1, or P + D under --disagg
    add_workload_args(parser, lists=lists)
    add_execution_args(parser, lists=lists, search=search)
    add_instance_args(parser)
    add_engine_args(parser, lists=search)
    add_json_arg(parser)


def scenario_from_args(args: argparse.Namespace, **override: Any) -> Scenario:
    """A :class:`Scenario` from parsed arguments (``override`` replaces single values; a swept
    flag's value must be overridden by one of its items)."""
    v = {**vars(args), **override}
    isl, osl = v["isl"], v["osl"]
    dataset = v["dataset"] or ("fixed" if isl is not None else "sharegpt-like")
    conc = v["concurrency"]
    n, measure = v["num_prompts"], v.get("measure") or "burst"
    # a trace replays every row unless told; steady: run_scenario sizes the run for its window
    if n is None and not DATASETS[dataset].replays and measure != "steady":
        n = conc if conc is not None else WorkloadSpec.num_prompts
    workload = WorkloadSpec(
        dataset=dataset, num_prompts=n, isl=isl, osl=osl,
        random_range_ratio=v["random_range_ratio"], max_concurrency=conc,
        request_rate=v["request_rate"], burstiness=v["burstiness"],
        dataset_path=v["dataset_path"], time_scale=v.get("time_scale", 1.0),
        prefill_scale=v.get("length_scale", 1.0) * v.get("prefill_scale", 1.0),
        decode_scale=v.get("length_scale", 1.0) * v.get("decode_scale", 1.0), seed=v["seed"],
        bench_client=v.get("bench_client") or WorkloadSpec.bench_client,
        measure=measure).validate()
    return Scenario(
        model=v["model"], hardware=v["hardware"], workload=workload, nodes=v["nodes"],
        gpus_per_node=v["gpus_per_node"], dp=v["dp"], tp=v["tp"], ep=v["ep"],
        dbo=_dbo_from_args(v), eplb=not v["no_eplb"], graph=not v["no_graph"],
        kv_dtype=v["kv_dtype"], loads=v["loads"], disagg=v["disagg"],
        chunked_prefill_size=v["chunked_prefill_size"], dp_balance=v["dp_balance"],
        mem_fraction=v["mem_fraction"], percentiles=v["metric_percentiles"],
        percentile_metrics=v["percentile_metrics"], kernels=v["kernels"],
        a2a_mode=v.get("a2a_mode") or AUTO,
        redundant_experts=v["redundant_experts"],
        mtp=v["mtp"], mtp_acceptance=v["mtp_acceptance"],
        engine=v["engine"], max_num_seqs=v["max_num_seqs"],
        max_num_batched_tokens=v["max_num_batched_tokens"],
        cuda_graph_max_bs=v["cuda_graph_max_bs"], host_ms_per_step=v["host_ms_per_step"],
        host_overlap=False if v.get("no_host_overlap") else None,
        goodput=goodput_slos(v.get("goodput")),
        **_instances_from_args({**v, "disagg": v["disagg"] or vars(args).get("disagg")}),
    )


def _instances_from_args(v: Mapping[str, Any]) -> dict[str, Any]:
    """The instance flags as :class:`Scenario` fields; ``--prefill-*`` need a prefill side
    (``--disagg``, or ``plan``'s ``--disagg-splits``)."""
    prefill = {f"prefill_{s}": v.get(f"prefill_{s}") for s in ("tp", "dp", "ep")}
    if any(x is not None for x in prefill.values()) and not (
            v.get("disagg") or v.get("disagg_splits")):
        raise EpsimError("--prefill-tp, --prefill-dp and --prefill-ep need --disagg P:D")
    return {"instance_nodes": v.get("instance_nodes"), "router": v.get("router") or "round_robin",
            **prefill}


def _dbo_from_args(v: Mapping[str, Any]) -> bool | None:
    """``--dbo`` on, ``--no-dbo`` off, neither: the engine's default (``None``). Under tune
    and plan ``--dbo`` is the list the search tries, set per point."""
    on = v.get("dbo") is True
    if on and v["no_dbo"]:
        raise EpsimError("--dbo and --no-dbo contradict each other")
    if on:
        return True
    if v["no_dbo"]:
        return False
    return None


def emit_json(obj: Mapping[str, Any], *profiles: Mapping[str, Any]) -> None:
    """One JSON object on stdout and nothing else there, its provenance first
    (``epsim.stamp.stamp_provenance``: of the results it holds and of ``profiles``); a
    non-finite number is ``null`` (``epsim.model.jsonout``: never NaN or Infinity, which no
    strict parser reads)."""
    out = stamp_provenance(dict(obj), *profiles)
    sys.stdout.write(jsonout.dumps(out, indent=2, sort_keys=False, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


class Progress:
    """A one-line progress bar on stderr; silent under --json or when stderr is not a terminal."""

    def __init__(self, label: str, enabled: bool, width: int = 30) -> None:
        self.label, self.width = label, width
        self.enabled = enabled and sys.stderr.isatty() and os.environ.get("TERM") != "dumb"
        self._shown = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        fill = round(self.width * done / total)
        sys.stderr.write(f"\r{self.label} [{'#' * fill}{'.' * (self.width - fill)}] "
                         f"{done}/{total}")
        sys.stderr.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._shown = False


def _column_cell(v: Any, digits: int) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def print_columns(rows: Sequence[Mapping[str, Any]], cols: Sequence[str], *, digits: int = 1,
                  indent: str = "  ") -> None:
    """One right-aligned column per key of ``cols``, one line per row (sweep's, tune's and
    plan's tables); floats with ``digits`` decimals."""
    cells = [[_column_cell(r.get(c), digits) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print(indent + "  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print(indent + "  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def print_table(rows: Sequence[tuple[str, str]], title: str | None = None) -> None:
    """Two aligned columns."""
    if title:
        print(title)
    width = max((len(k) for k, _ in rows), default=0)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    raise AssertionError


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def flatten(obj: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level with dotted keys: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _csv_cell(value: Any) -> str:
    """A JSON value as a CSV cell, losing nothing: floats as ``repr`` (they read back exactly),
    booleans and lists as JSON spells them, ``None`` empty."""
    if value is None:
        return ""
    if isinstance(value, bool | list | tuple):
        return json.dumps(value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def write_csv(rows: Sequence[Mapping[str, Any]], path: str) -> None:
    """The sweep as CSV: one column per key of the points' JSON (nested keys dotted, e.g.
    ``step_breakdown_ms.attention``), in the JSON's order, each row's provenance last
    (``provenance.epsim_version``, ...: a row read alone says what made it); written whole or
    not at all."""
    flat = [flatten({**{k: v for k, v in r.items() if k != "provenance"},
                     "provenance": row_provenance(r)}) for r in rows]
    columns = list(dict.fromkeys(k for r in flat for k in r))
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(columns)
    for r in flat:
        w.writerow([_csv_cell(r.get(c)) for c in columns])
    write_text_atomic(buf.getvalue(), path)
