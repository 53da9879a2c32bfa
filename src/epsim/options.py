"""The command line of a deployment, generated from its fields (as vLLM's ``EngineArgs``).

Every flag of a deployment and its benchmark is declared once, on its field
(``epsim.sim.spec``: the deployment's groups; ``epsim.sim.workload.spec.WorkloadSpec``: the
benchmark; ``epsim.model.fields.option`` holds the flag, aliases and help text), and its value
type and range come from the validation table (``epsim.inputs``). This module walks those fields:

    add_fields(parser, cls, ...)    one argument group with a flag per field of ``cls``
    add_scenario_args(parser, ...)  every group of a scenario plus ``--json`` and ``--config``
                                    (predict, sweep; tune and plan through ``search_args``)
    scenario_from_args(args, ...)   the :class:`~epsim.sim.spec.Scenario` the flags describe
    lists                           sweep, tune and plan take comma lists where a field is
                                    swept (``Option.swept``: ``"sweep"`` in both, ``"search"``
                                    in tune and plan only)

A deployment file (``--config FILE``, ``epsim/config_file.py``) uses the same names; the flags
given win over the file, the file over the defaults. ``--help=GROUP`` shows one group's flags.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from epsim.model.errors import EpsimError
from epsim.model.fields import Option, options_of
from epsim.model.loads import shipped_loads
from epsim.sim.serving.metrics import goodput_slos, percentile_word
from epsim.sim.spec import (
    Deployment,
    EngineSpec,
    ExecutionSpec,
    InstanceSpec,
    MeasurementSpec,
    PlanSpec,
    Scenario,
)
from epsim.sim.workload.spec import DATASETS, WorkloadSpec
from epsim.sim.workload.traces import shipped_traces

from .inputs import add_flag

#: each group's title on the command line, by its name in ``--help=GROUP`` and a deployment file
GROUPS: dict[str, tuple[type, str]] = {
    "deployment": (Deployment, "deployment"),
    "plan": (PlanSpec, "parallel plan"),
    "workload": (WorkloadSpec, "benchmark (vllm bench serve semantics)"),
    "measurement": (MeasurementSpec, "what the metrics report"),
    "execution": (ExecutionSpec, "execution options"),
    "instances": (InstanceSpec, "instances and the prefill side's plan"),
    "engine": (EngineSpec, "serving engine (docs/serving.md: each preset's defaults and their "
                           "sources)"),
}
#: list modes: where a field's flag takes a comma list
SWEEP, SEARCH = "sweep", "search"


def _help(opt: Option, default: Any, listed: bool) -> str:
    """The field's help text with the names it lists and its default."""
    text = opt.help.format(traces=", ".join(shipped_traces()),
                           loads=", ".join(shipped_loads()))
    if listed:
        text += " (comma list)"
    if opt.switch is None and not opt.derived and default is not None and "default" not in text:
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        text += f" (default {shown})"
    return text.replace("%", "%%")


class OnOff(argparse.Action):
    """``--dbo [on|off]`` and its negation ``--no-dbo``: one field, one flag (``--dbo`` alone:
    on). A repeated spelling keeps its last value, as argparse does; the two spellings with
    different values on one command line are refused."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        negated = option_string is not None and option_string.startswith("--no-")
        if negated:
            if values is not self.const:
                raise argparse.ArgumentError(self, f"{option_string} takes no value")
            values = (False,) if isinstance(self.const, tuple) else False
        seen = f"_given_{self.dest}"
        before = getattr(namespace, seen, None)  # (negated, value) of the last spelling given
        if before is not None and before[0] != negated and before[1] != values:
            raise argparse.ArgumentError(
                self, f"{' and '.join(self.option_strings)} contradict each other")
        setattr(namespace, seen, (negated, values))
        setattr(namespace, self.dest, values)


def add_field(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
              f: dataclasses.Field, opt: Option, *, listed: bool = False,
              default: Any = dataclasses.MISSING, required: bool = False) -> argparse.Action:
    """One field's flag: its value type and range from the validation table, its default the
    field's (``default`` in place; ``None`` where the option is derived)."""
    if default is dataclasses.MISSING:
        default = None if opt.derived else f.default
    shown = _help(opt, default, listed)
    if opt.switch is not None:  # a flag without a value
        return parser.add_argument(opt.flag, *opt.aliases, dest=f.name, action="store_const",
                                   const=opt.switch, default=default, help=shown)
    kw: dict[str, Any] = {"dest": f.name, "help": shown, "default": default}
    if opt.metavar:
        kw["metavar"] = opt.metavar
    if listed and default is not None and not isinstance(default, str):
        kw["default"] = ",".join(map(str, default)) if isinstance(default, tuple) \
            else str(default)
    if opt.aliases and opt.aliases[0].startswith("--no-"):  # an on/off field and its negation
        kw.update(action=OnOff, nargs="?")
        action = add_flag(parser, opt.flag, *opt.aliases, lists=listed, **kw)
        action.const = action.type("on")  # --dbo alone: on (a one-item list in a search)
        return action
    return add_flag(parser, opt.flag, *opt.aliases, lists=listed, required=required, **kw)


def add_fields(parser: argparse.ArgumentParser, cls: type, *, mode: str | None = None,
               only: Collection[str] | None = None, skip: Collection[str] = (),
               defaults: Mapping[str, Any] | None = None, group: str | None = None,
               required: Collection[str] = ()) -> argparse._ArgumentGroup:
    """A flag per field of ``cls`` (``only`` / ``skip`` by field name), in one argument group
    (``group``: its name in :data:`GROUPS`, else the class's); ``mode``: ``"sweep"`` or
    ``"search"`` makes the swept fields comma lists; ``defaults`` replace the fields'."""
    name = group or next(k for k, (c, _) in GROUPS.items() if c is cls)
    g = parser.add_argument_group(GROUPS[name][1])
    g.epsim_group = name  # type: ignore[attr-defined]  # --help=GROUP
    for f, opt in options_of(cls):
        if (only is not None and f.name not in only) or f.name in skip:
            continue
        listed = mode is not None and (opt.swept == SWEEP or (opt.swept == SEARCH
                                                              and mode == SEARCH))
        default = (defaults or {}).get(f.name, dataclasses.MISSING)
        add_field(g, f, opt, listed=listed, default=default, required=f.name in required)
    return g


def field_option(cls: type, name: str) -> tuple[dataclasses.Field, Option]:
    """The field ``name`` of ``cls`` and its option (to add that one flag elsewhere)."""
    return next((f, o) for f, o in options_of(cls) if f.name == name)


def add_model_arg(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    add_field(parser, *field_option(Deployment, "model"), default=None, required=required)


def add_hardware_arg(parser: argparse.ArgumentParser, *, required: bool = True,
                     lists: bool = False) -> None:
    add_field(parser, *field_option(Deployment, "hardware"), listed=lists, default=None,
              required=required)


def add_plan_args(parser: argparse.ArgumentParser, *, lists: bool = False) -> None:
    """The plan's flags (``lists``: a search's comma lists)."""
    add_fields(parser, PlanSpec, mode=SEARCH if lists else None)


def add_workload_args(parser: argparse.ArgumentParser, *, lists: bool = False) -> None:
    """The benchmark, with ``vllm bench serve``'s flag names and meanings, and what the
    metrics report."""
    g = add_fields(parser, WorkloadSpec, mode=SWEEP if lists else None,
                   defaults={"request_rate": "inf"} if lists else None)
    add_flag(g, "--length-scale", default=1.0, metavar="F",
             help="--dataset trace: every prompt and output length x F, truncated, at least 1 "
             "(Vidur's prefill and decode scale factors together; default 1)")
    add_measurement_args(parser)


def add_measurement_args(parser: argparse.ArgumentParser) -> None:
    """Which percentiles of which metrics, and vLLM's ``--goodput`` SLOs."""
    g = parser.add_argument_group(GROUPS["measurement"][1])
    g.epsim_group = "measurement"  # type: ignore[attr-defined]
    m = MeasurementSpec
    add_flag(g, "--metric-percentiles", dest="percentiles",
             default=",".join(percentile_word(p) for p in m.percentiles),
             help="percentiles reported (default "
             f"{','.join(percentile_word(p) for p in m.percentiles)})")
    add_flag(g, "--percentile-metrics", dest="percentile_metrics",
             default=",".join(m.percentile_metrics),
             help=f"metrics with percentiles (default {','.join(m.percentile_metrics)})")
    add_goodput_arg(g)


def add_goodput_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """vLLM's ``--goodput KEY:MS ...``: per-request SLOs that ``request_goodput`` counts."""
    add_flag(parser, "--goodput", nargs="+", default=None, metavar="KEY:MS",
             help="SLOs per request as vllm bench serve takes them (ttft:MS tpot:MS e2el:MS): "
             "request_goodput counts the requests meeting all of them, per second")


def add_bench_client_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                         default: str | None = WorkloadSpec.bench_client) -> None:
    """``--bench-client vllm|sglang``: whose benchmark flags (``--random-range-ratio``) these are."""
    add_field(parser, *field_option(WorkloadSpec, "bench_client"), default=default)


def add_kernels_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    add_field(parser, *field_option(ExecutionSpec, "kernels"))


def add_a2a_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    add_field(parser, *field_option(ExecutionSpec, "a2a_mode"))


def add_mtp_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                 lists: bool = False) -> None:
    """``--mtp N`` and ``--mtp-acceptance P`` (``lists``: tune and plan search a list of N)."""
    add_field(parser, *field_option(ExecutionSpec, "mtp"), listed=lists,
              default=None if lists else ExecutionSpec.mtp)
    add_field(parser, *field_option(ExecutionSpec, "mtp_acceptance"))


def add_execution_args(parser: argparse.ArgumentParser, *, lists: bool = False,
                       search: bool = False) -> None:
    """How the deployment serves (``lists``: a sweep's comma lists; ``search``: tune's and
    plan's, whose ``--dbo`` is the list of values to try, default on,off)."""
    mode = SEARCH if search else SWEEP if lists else None
    add_fields(parser, ExecutionSpec, mode=mode,
               defaults={"dbo": "on,off", "graph": "on", "mtp": None} if search else None)
    add_fields(parser, InstanceSpec, only=("disagg",), group="instances")
    add_fields(parser, EngineSpec, only=("chunked_prefill_size",), mode=mode, group="engine")


def add_instance_args(parser: argparse.ArgumentParser) -> None:
    """Instances behind a router, and the prefill side's own plan (docs/serving.md)."""
    add_fields(parser, InstanceSpec, skip=("disagg",))


def add_engine_args(parser: argparse.ArgumentParser, *, lists: bool = False) -> None:
    """A serving engine's scheduling policy and defaults, and the flags that override them."""
    add_fields(parser, EngineSpec, mode=SEARCH if lists else None,
               skip=("chunked_prefill_size",))


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    """``--config FILE``: a deployment file (``epsim/config_file.py`` reads it)."""
    add_flag(parser, "--config", default=None, metavar="FILE",
             help="a deployment file (YAML or JSON) whose keys are this command's flags, "
             "optionally under the groups of --help=GROUP; the flags given win over it")


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def add_scenario_args(parser: argparse.ArgumentParser, *, lists: bool = False,
                      hardware_required: bool = True, hardware_lists: bool = False,
                      search: bool = False) -> None:
    """Everything a :class:`Scenario` is built from, plus ``--json`` (``lists``: comma lists
    where sweepable; ``search``: tune's and plan's lists)."""
    add_model_arg(parser)
    add_hardware_arg(parser, required=hardware_required, lists=hardware_lists)
    add_plan_args(parser, lists=search)
    add_workload_args(parser, lists=lists)
    add_execution_args(parser, lists=lists, search=search)
    add_instance_args(parser)
    add_engine_args(parser, lists=search)
    add_json_arg(parser)
    add_config_arg(parser)


def _workload(v: Mapping[str, Any]) -> WorkloadSpec:
    """The benchmark the flags describe (its derived defaults filled)."""
    isl, osl = v["isl"], v["osl"]
    dataset = v["dataset"] or ("fixed" if isl is not None else "sharegpt-like")
    conc = v["concurrency"]
    n, measure = v["num_prompts"], v.get("measure") or "burst"
    # a trace replays every row unless told; steady: run_scenario sizes the run for its window
    if n is None and not DATASETS[dataset].replays and measure != "steady":
        n = conc if conc is not None else WorkloadSpec.num_prompts
    scale = v.get("length_scale", 1.0)
    return WorkloadSpec(
        dataset=dataset, num_prompts=n, isl=isl, osl=osl,
        random_range_ratio=v["random_range_ratio"], concurrency=conc,
        request_rate=v["request_rate"], burstiness=v["burstiness"],
        dataset_path=v["dataset_path"], time_scale=v.get("time_scale", 1.0),
        prefill_scale=scale * v.get("prefill_scale", 1.0),
        decode_scale=scale * v.get("decode_scale", 1.0), seed=v["seed"],
        bench_client=v.get("bench_client") or WorkloadSpec.bench_client,
        measure=measure).validate()


def _group(cls: type, v: Mapping[str, Any]) -> Any:
    """An instance of a group from the values of its fields' flags (a field whose flag this
    command does not define keeps its default)."""
    return cls(**{f.name: v[f.name] for f in dataclasses.fields(cls) if f.name in v})


def deployment_from_args(args: argparse.Namespace, **override: Any) -> Deployment:
    """The :class:`Deployment` of the flags this command defines (every other field at its
    default): ``step`` and ``describe``, which take a deployment without a benchmark."""
    v = {**vars(args), **override}
    return Deployment(model=v["model"], hardware=v["hardware"], plan=_group(PlanSpec, v),
                      engine=_group(EngineSpec, v), execution=_group(ExecutionSpec, v),
                      instances=_group(InstanceSpec, v))


def scenario_from_args(args: argparse.Namespace, **override: Any) -> Scenario:
    """A :class:`Scenario` from parsed arguments (``override`` replaces single values; a swept
    flag's value must be overridden by one of its items)."""
    v = {**vars(args), **override}
    for name in ("dbo", "graph"):  # a search's lists: each point sets its own
        if isinstance(v.get(name), tuple):
            v[name] = ExecutionSpec.dbo if name == "dbo" else ExecutionSpec.graph
    prefill = [v.get(f"prefill_{s}") for s in ("tp", "dp", "ep")]
    if any(x is not None for x in prefill) and not (
            v.get("disagg") or vars(args).get("disagg") or v.get("disagg_splits")):
        raise EpsimError("--prefill-tp, --prefill-dp and --prefill-ep need --disagg P:D")
    deployment = deployment_from_args(argparse.Namespace(**v))
    measurement = MeasurementSpec(percentiles=v["percentiles"],
                                  percentile_metrics=v["percentile_metrics"],
                                  goodput=goodput_slos(v.get("goodput")))
    return Scenario(deployment, _workload(v), measurement)
