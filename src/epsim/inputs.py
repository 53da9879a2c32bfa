"""The validation layer: every flag's value type and range, in one table.

Every option that takes a value is declared in :data:`FLAGS` (or, where one command reads it
differently, :data:`COMMAND_FLAGS`) with a *spec* (``epsim/specs.py``: an argparse ``type`` that
parses the text and enforces the flag's stated range), so an absurd or malformed value is one
line and exit status 2 before any work starts. Commands add their flags through
:func:`add_flag`, which takes the spec from the table; ``tests/cli/test_inputs.py`` walks every
command's parser and fails for an option whose type is not the table's spec (a new flag cannot
skip its check). The domain parsers here (``parse_prices``, ``parse_dp_x_tp``, ...) read the
values of the flags no other package owns.

Bounds say what a deployment can mean, not what the simulator happens to handle: e.g. 4096
nodes, 2**20 sequences per rank, 2**24 tokens per request, 10**7 requests in a benchmark.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import Any

from epsim.model.bounds import (
    MAX_BATCH,
    MAX_GPUS,
    MAX_PROMPTS,
    MAX_TOKENS,
    MIN_BURSTINESS,
    MIN_REQUEST_RATE,
)
from epsim.model.errors import EpsimError

from .specs import (
    Choice,
    InputFile,
    Integer,
    Items,
    Name,
    OutputFile,
    Parsed,
    Real,
    Spec,
    show_text,
)

# --------------------------------------------------------------------------------------------
# The table: every valued flag and its range
# --------------------------------------------------------------------------------------------

#: the largest deployment a flag may describe
MAX_NODES = 4096
#: GPUs, sequences per rank in one step, tokens per request, requests per benchmark: the same
#: bounds as a file's (epsim.model.bounds, docs/inputs.md)
MAX_REQUESTS = MAX_PROMPTS
#: seeds as numpy's and torch's generators both take them
MAX_SEED = 2**32 - 1

_count = Integer(1, MAX_GPUS)


def parse_on_off(text: str) -> bool:
    """``on``/``true``/``1`` -> True, ``off``/``false``/``0`` -> False."""
    if text in ("on", "true", "1"):
        return True
    if text in ("off", "false", "0"):
        return False
    raise ValueError(text)


def parse_annotations(text: str) -> tuple[str, ...]:
    """``"attn(F),mlp(F)"`` -> ``("attn(F)", "mlp(F)")``; ``"all"`` -> ``()`` (every kernel)."""
    if text == "all":
        return ()
    names = tuple(n.strip() for n in text.split(","))
    if not all(names) or len(set(names)) != len(names):
        raise ValueError(text)
    return names


def parse_dp_x_tp(text: str) -> tuple[int, int]:
    """``"4x2"``, ``"dp4xtp2"`` or ``"4/2"`` -> ``(4, 2)``, each in [1, MAX_GPUS]."""
    m = re.fullmatch(r"(?:dp)?(\d{1,6})\s*[x/]\s*(?:tp)?(\d{1,6})", text)
    if not m or not all(1 <= int(g) <= MAX_GPUS for g in m.groups()):
        raise EpsimError(f"a split is DPxTP with each in [1, {MAX_GPUS}] (e.g. 4x2), got "
                         f"{show_text(text)}")
    return int(m.group(1)), int(m.group(2))


def parse_ray_address(text: str) -> str:
    """``auto`` (the running cluster), ``local`` (start one here) or an address
    (``HOST:PORT``, ``ray://HOST:PORT``); whether it answers is checked when the search starts."""
    if text in ("auto", "local") or re.fullmatch(
            r"(ray://)?[A-Za-z0-9][A-Za-z0-9.-]{0,252}:\d{1,5}", text):
        return text
    raise EpsimError(f"--ray takes auto, local or HOST:PORT (ray://HOST:PORT), got {show_text(text)}")


def parse_word(text: str, what: str) -> str:
    """A name made of letters, digits and ``._+-`` (a kernel set: ``aiter``, ``no-aiter``);
    whether the profile has it is checked when the profile is loaded."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}", text):
        raise EpsimError(f"a {what} name is letters, digits and ._+-, got {show_text(text)}")
    return text


def parse_kernel_set(text: str) -> str:
    return parse_word(text, "kernel set")


#: a GPU-hour price in USD: positive, at most this
MAX_GPU_HOUR_USD = 1e4


def parse_prices(text: str) -> dict[str, float]:
    """``"2.5"`` (every hardware) or ``"mi300x=2.1,h200=3.7"`` -> {hardware or "*": USD per
    GPU-hour}; which names are searched is checked by the command."""
    price = Real(0.0, MAX_GPU_HOUR_USD, low_open=True)
    try:
        parts = Items(str)(text)
    except argparse.ArgumentTypeError as exc:
        raise EpsimError(f"--gpu-hour-usd: {exc}") from None
    out: dict[str, float] = {}
    for part in parts:
        name, eq, value = part.partition("=")
        if not eq:
            name, value = "*", name
        name = name.strip()
        if not name:
            raise EpsimError(f"--gpu-hour-usd: {show_text(part)} has no hardware name")
        if name in out:
            raise EpsimError(f"--gpu-hour-usd: {name} is priced twice")
        try:
            out[name] = price(value)
        except argparse.ArgumentTypeError as exc:
            raise EpsimError(f"--gpu-hour-usd: {show_text(part)}: {exc}") from None
    return out


def _lazy_flags() -> dict[str, Spec]:
    """Specs that need other packages' registries (imported once, when a parser is built)."""
    from epsim.calibrate.bench_fit import FACTORS
    from epsim.calibrate.exchange_fits import EXCHANGE_FITS
    from epsim.calibrate.validate import shipped_grids
    from epsim.model.config import shipped_models
    from epsim.model.eplb import BALANCERS
    from epsim.model.loads import shipped_loads
    from epsim.model.plan import KV_DTYPES, MAX_MTP
    from epsim.sim.hardware.a2a import A2A_CHOICES
    from epsim.sim.hardware.profile import shipped_profiles
    from epsim.sim.search.bisect import VARIABLES
    from epsim.sim.search.samplers import STRATEGIES
    from epsim.sim.search.slo import parse_slo
    from epsim.sim.search.tune import OBJECTIVE_ALIASES, OBJECTIVES
    from epsim.sim.serving.config import DP_BALANCE
    from epsim.sim.serving.metrics import (
        parse_goodput_item,
        parse_percentile_metrics,
        parse_percentiles,
    )
    from epsim.sim.serving.presets import ENGINES
    from epsim.sim.serving.router import ROUTER_NAMES
    from epsim.sim.spec import parse_disagg
    from epsim.sim.step import MODES
    from epsim.sim.workload.spec import BENCH_CLIENTS, DATASETS, MEASURES
    from epsim.sim.workload.traces import shipped_traces

    disagg = Parsed(parse_disagg, "P:D node counts (e.g. 1:2)", max_len=32)
    return {
        "--kv-dtype": Choice(tuple(KV_DTYPES)),
        "--mtp": Integer(0, MAX_MTP, why="draft tokens per step; 0: off"),
        "--dataset": Choice(tuple(DATASETS)),
        "--measure": Choice(MEASURES),
        "--bench-client": Choice(tuple(BENCH_CLIENTS)),
        "--dp-balance": Choice(tuple(DP_BALANCE)),
        "--router": Choice(ROUTER_NAMES),
        "--engine": Choice(tuple(ENGINES)),
        "--factors": Choice(tuple(FACTORS)),
        "--objective": Choice((*OBJECTIVES, *OBJECTIVE_ALIASES)),
        "--sla-variable": Choice(tuple(VARIABLES)),
        "--search": Choice(tuple(STRATEGIES)),
        "--method": Choice(tuple(BALANCERS)),
        "--mode": Choice(tuple(MODES)),
        "--slo": Parsed(parse_slo, "an SLO, e.g. median_itl_ms<=100"),
        "--goodput": Parsed(parse_goodput_item, "KEY:MS, KEY ttft, tpot or e2el", max_len=64),
        "--disagg": disagg,
        "--disagg-splits": Items(disagg),
        "--metric-percentiles": Parsed(parse_percentiles, "percentiles in [0, 100]"),
        "--percentile-metrics": Parsed(parse_percentile_metrics, "metric names"),
        "--model": Name(shipped_models, "model"),
        "--hardware": Name(shipped_profiles, "hardware profile"),
        "--loads": Name(shipped_loads, "load file"),
        "--eval": Name(shipped_loads, "load file"),
        "--grid": Name(shipped_grids, "validation grid"),
        "--profile": Name(shipped_profiles, "hardware profile"),
        "--base": Name(shipped_profiles, "hardware profile"),
        "--dataset-path": Name(shipped_traces, "dataset file"),
        "--a2a-mode": Choice(A2A_CHOICES),  # how EP dispatch/combine run (epsim.sim.hardware.a2a)
        "--exchange-fit": Choice(EXCHANGE_FITS),  # calibrate's exchange model
    }


FLAGS: dict[str, Spec] = {
    # the deployment
    "--nodes": Integer(1, MAX_NODES),
    "--gpus-per-node": Integer(1, 72),
    "--dp": _count, "--tp": _count, "--ep": _count, "--world-size": _count,
    "--gpus": _count,
    "--mem-fraction": Real(0.0, 1.0, low_open=True),
    # instances behind a router, and the prefill side's own plan under --disagg
    "--instance-nodes": Integer(1, MAX_NODES),
    "--prefill-tp": _count, "--prefill-dp": _count, "--prefill-ep": _count,
    # one step
    "--batch": Integer(1, MAX_BATCH),
    "--context": Integer(1, MAX_TOKENS),
    # the benchmark (vllm bench serve)
    "--concurrency": Integer(1, MAX_REQUESTS),
    "--num-prompts": Integer(1, MAX_REQUESTS),
    "--isl": Integer(1, MAX_TOKENS), "--osl": Integer(1, MAX_TOKENS),
    # the least rate and burstiness a benchmark can mean (epsim.model.bounds: below them the
    # gap draws overflow)
    "--request-rate": Real(MIN_REQUEST_RATE, 1e9, allow_inf=True),
    "--burstiness": Real(MIN_BURSTINESS, 1e6),
    # vLLM: 0 <= r < 1, SGLang: 0 <= r <= 1; WorkloadSpec checks the --bench-client's own range
    "--random-range-ratio": Real(0.0, 1.0),
    "--time-scale": Real(0.0, 1e6, low_open=True),
    # a trace's lengths x F (Vidur's scale factors): 1e3 makes a 16k-token prompt 16M tokens
    "--length-scale": Real(0.0, 1e3, low_open=True),
    "--prefill-scale": Real(0.0, 1e3, low_open=True),
    "--decode-scale": Real(0.0, 1e3, low_open=True),
    "--seed": Integer(0, MAX_SEED),
    "--chunked-prefill-size": Integer(1, MAX_TOKENS),
    # MTP speculative decoding: each draft token's acceptance probability (--mtp: _lazy_flags)
    "--mtp-acceptance": Real(0.0, 1.0),
    # serving-engine overrides (per dp rank)
    "--max-num-seqs": Integer(1, MAX_BATCH),
    "--max-num-batched-tokens": Integer(1, MAX_TOKENS),
    "--cuda-graph-max-bs": Integer(1, MAX_BATCH),
    "--host-ms-per-step": Real(0.0, 1e4),
    # search and capacity
    "--target-output-throughput": Real(0.0, 1e10, low_open=True),
    "--workers": Integer(1, 4096),
    "--trials": Integer(1, 10**5),
    "--ray": Parsed(parse_ray_address, "auto, local or HOST:PORT", max_len=300),
    # balance
    "--expert-groups": Integer(1, 4096),
    "--redundant": Integer(0, MAX_GPUS),
    "--redundant-experts": Integer(0, MAX_GPUS),
    "--max-moves": Integer(0, MAX_GPUS),
    # runtime, calibration, validation
    "--steps": Integer(1, 10**5),
    "--repeats": Integer(1, 1000),
    "--timeout": Integer(1, 86400),
    "--stall-timeout": Integer(1, 86400),
    # calibrate --from-trace: MoE layers the trace's scope holds; its CPU annotations
    "--layers": Integer(1, 4096),
    "--annotations": Parsed(parse_annotations, "annotation names (comma list) or all"),
    # execution and search switches
    "--phase": Choice(("decode", "prefill")),
    # calibrate/devices.py's DEVICES (its fits pull in pandas, which no other command needs;
    # tests/cli/test_inputs.py checks the two agree)
    "--device": Choice(("cpu", "cuda")),
    "--dtype": Choice(("fp32", "bf16")),
    "--dbo": Parsed(parse_on_off, "on or off", max_len=8),
    "--graph": Parsed(parse_on_off, "on or off", max_len=8),
    "--splits": Parsed(parse_dp_x_tp, "DPxTP (e.g. 4x2)", max_len=32),
    "--gpu-hour-usd": Parsed(parse_prices, "a price, or HARDWARE=PRICE,..."),
    "--kernels": Parsed(parse_kernel_set, "a kernel set name", max_len=64),
    # outputs and inputs
    "--trace": OutputFile("--trace"),
    "--csv": OutputFile("--csv"),
    "--plot": OutputFile("--plot"),
    "--frontier-csv": OutputFile("--frontier-csv"),
    "--out": OutputFile("--out"),
    "--bench": InputFile("benchmark result file"),
    "--save-result": OutputFile("--save-result"),
    "--previous": InputFile("placement file"),
    "--placement": InputFile("placement file"),
    "--from-trace": InputFile("profiler trace"),
    "--from-bench": InputFile("benchmark result file"),
    "--config": InputFile("deployment file"),
}

#: the help of the flags several commands share that are no field of a deployment (those carry
#: their help on their field: epsim/options.py): one text each, so a flag has one meaning
#: wherever it appears; ``add_flag`` takes it from here and refuses a second text
HELP: dict[str, str] = {
    "--batch": "sequences per dp rank in the step (run: per rank, each rank its own dp rank; "
               "calibrate trace: in the traced pass)",
    "--context": "tokens each sequence attends to, the new one included (a decode step's cached "
                 "context; prefill: the prompt length; calibrate trace: default the trace "
                 "name's seqlen)",
    "--steps": "decode steps; the first is a warm-up, not timed when there are more "
               "(validate grid: per case and pass)",
    "--device": "where the runtime runs: cpu, or cuda (one GPU; calibrate micro: world size 1, "
                "the communication figures then from --base)",
    "--trace": "write a Chrome trace JSON (Perfetto): predict the serving timeline (a track per "
               "rank, running and queued requests, KV-cache use, a slice per request), step "
               "every rank's simulated ops, run every rank's executed ops",
    "--out": "write the command's result here, whole or not at all (balance: the placement; "
             "calibrate: the fitted profile, micro's tables beside it, trace's with --model)",
    "--plot": "draw a chart (PNG, needs matplotlib): sweep, tune and plan the frontier of output "
              "tok/s per GPU against tok/s per user, one Pareto line per hardware/engine; "
              "validate grid measured against predicted",
    "--gpu-hour-usd": "price per GPU-hour, for plan's cost and the charts' $/M tokens: one "
                      "number, or per hardware (mi300x=2.1,h200=3.7)",
    "--force": "run even past the work budget (10,000 points, 4,000,000 simulated requests, "
               "50% of memory; balance: 2^16 experts a layer, 2^22 loads in all; "
               "docs/performance.md, docs/placement.md)",
}

#: where one command reads a flag with another range
COMMAND_FLAGS: dict[tuple[str, str], Spec] = {
    ("validate", "--steps"): Integer(2, 10**4, why="the first step is a warm-up"),
}


def spec_for(flag: str, command: str | None = None) -> Spec:
    """The spec of ``flag`` (``command``'s own where it has one); KeyError if undeclared."""
    if command is not None and (command, flag) in COMMAND_FLAGS:
        return COMMAND_FLAGS[(command, flag)]
    if flag not in FLAGS:
        FLAGS.update(_lazy_flags())
    return FLAGS[flag]


def add_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str,
             *aliases: str, spec: Spec | None = None, command: str | None = None,
             lists: bool = False, **kwargs: Any) -> argparse.Action:
    """``parser.add_argument(flag, *aliases, type=<the table's spec>, **kwargs)``; ``lists``:
    a comma list of it; ``spec``: a command-specific spec (must be a :class:`Spec`)."""
    if flag in HELP:
        if "help" in kwargs:
            raise ValueError(f"{flag}'s help is defined once, in epsim.inputs.HELP")
        default = kwargs.get("default")
        kwargs["help"] = HELP[flag].replace("%", "%%") + (
            f" (default {default})" if default not in (None, False) else "")
    base = spec if spec is not None else spec_for(flag, command)
    kind = Items(base) if lists else base
    if isinstance(base, Choice) and "metavar" not in kwargs:
        kwargs["metavar"] = "{" + ",".join(base.values) + "}"
    return parser.add_argument(flag, *aliases, type=kind, **kwargs)


def as_list(value: Sequence[Any] | Any | None) -> list[Any]:
    """A parsed comma list as a list; ``None`` (not given) -> ``[None]`` (one point)."""
    if value is None:
        return [None]
    if isinstance(value, tuple | list):
        return list(value)
    return [value]
