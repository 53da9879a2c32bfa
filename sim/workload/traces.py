"""Request traces: real arrival times and lengths, replayed by ``--dataset trace``.

A trace is a CSV with one request a row, in the columns of Azure's public LLM inference trace
(Azure/AzurePublicDataset, ``AzureLLMInferenceDataset2023.md``):

    TIMESTAMP        when the request arrived: a date-time (``2023-11-16 18:15:46.6805900``) or
                     seconds as a number; non-decreasing down the file
    ContextTokens    prompt tokens (>= 1)
    GeneratedTokens  output tokens (>= 1; simulated exactly, as under ``--ignore-eos``)

Other columns are ignored. Replay: the first ``num_prompts`` rows (all of them by default), the
first request at time 0 and each later one at ``(TIMESTAMP - first TIMESTAMP) * time_scale``, so
``time_scale`` 0.5 doubles the arrival rate and 2 halves it. Two traces ship with epsim
(``SHIPPED_TRACES``, CC-BY 4.0, with their license and attribution in
``model/data/traces/azure-llm-2023/``).
"""

from __future__ import annotations

import csv
import functools
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from epsim.model.errors import EpsimError

#: the columns a trace must have
TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
#: shipped traces by name -> their file under epsim.model's data/traces/
SHIPPED_TRACES = {
    "azure-conv": "azure-llm-2023/AzureLLMInferenceTrace_conv.csv",
    "azure-code": "azure-llm-2023/AzureLLMInferenceTrace_code.csv",
}


def shipped_traces() -> list[str]:
    """The shipped trace names (``--dataset-path NAME``)."""
    return sorted(SHIPPED_TRACES)


@dataclass(frozen=True)
class RequestTrace:
    """A trace as arrays, one entry per row (row order).

    arrival_s: seconds since the first row (first 0, non-decreasing). input_lens / output_lens:
    ContextTokens / GeneratedTokens (int64). source: the file or shipped name it came from.
    """

    arrival_s: np.ndarray
    input_lens: np.ndarray
    output_lens: np.ndarray
    source: str

    def __len__(self) -> int:
        return len(self.input_lens)


def trace_file(path_or_name: str) -> Path:
    """The file behind ``path_or_name``: a shipped name, else a path that must exist."""
    if path_or_name in SHIPPED_TRACES:
        res = resources.files("epsim.model") / "data" / "traces" / SHIPPED_TRACES[path_or_name]
        return Path(str(res))
    file = Path(path_or_name)
    if not file.is_file():
        raise EpsimError(f"request trace not found: {path_or_name} (a CSV, or a shipped name: "
                         f"{', '.join(shipped_traces())})")
    return file


def read_trace(path_or_name: str) -> RequestTrace:
    """Read and check a trace (memoised on the file's path, size and modification time)."""
    file = trace_file(path_or_name)
    st = file.stat()
    return _read_trace(str(file.resolve()), st.st_size, st.st_mtime_ns, path_or_name)


@functools.lru_cache(maxsize=4)
def _read_trace(path: str, _size: int, _mtime_ns: int, source: str) -> RequestTrace:
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            rows = list(csv.reader(f))
    except OSError as exc:
        raise EpsimError(f"{source}: cannot read the request trace ({exc.strerror})") from None
    if not rows:
        raise EpsimError(f"{source}: empty request trace (a CSV with columns "
                         f"{', '.join(TRACE_COLUMNS)})")
    header = [h.strip() for h in rows[0]]
    missing = [c for c in TRACE_COLUMNS if c not in header]
    if missing:
        raise EpsimError(f"{source}: the request trace lacks column(s) {', '.join(missing)} "
                         f"(it needs {', '.join(TRACE_COLUMNS)})")
    cols = [header.index(c) for c in TRACE_COLUMNS]
    body = [r for r in rows[1:] if any(cell.strip() for cell in r)]
    if not body:
        raise EpsimError(f"{source}: the request trace has a header but no requests")
    short = next((i for i, r in enumerate(body) if len(r) <= max(cols)), None)
    if short is not None:
        raise EpsimError(f"{source}: row {short + 2} has {len(body[short])} fields, the header "
                         f"{len(header)}")
    stamps, ins, outs = ([r[c].strip() for r in body] for c in cols)
    arrival = _seconds(stamps, source)
    tokens = [_tokens(values, name, source) for values, name in ((ins, "ContextTokens"),
                                                                 (outs, "GeneratedTokens"))]
    return RequestTrace(arrival_s=arrival, input_lens=tokens[0], output_lens=tokens[1],
                        source=source)


def _seconds(stamps: list[str], source: str) -> np.ndarray:
    """TIMESTAMP as seconds since the first row: numbers as seconds, else ISO date-times."""
    try:
        t = np.array([float(s) for s in stamps])
    except ValueError:
        try:
            ns = np.array(stamps, dtype="datetime64[ns]")
        except ValueError:
            bad = next(i for i, s in enumerate(stamps) if not _is_datetime(s))
            raise EpsimError(f"{source}: row {bad + 2}: TIMESTAMP {stamps[bad]!r} is neither a "
                             "date-time nor a number of seconds") from None
        t = (ns - ns[0]).astype(np.int64) / 1e9
    if not np.isfinite(t).all():
        bad = int(np.flatnonzero(~np.isfinite(t))[0])
        raise EpsimError(f"{source}: row {bad + 2}: TIMESTAMP {stamps[bad]!r} is not finite")
    back = np.flatnonzero(np.diff(t) < 0)
    if len(back):
        i = int(back[0]) + 1
        raise EpsimError(f"{source}: timestamps must not decrease, but row {i + 2} "
                         f"({stamps[i]}) is before row {i + 1} ({stamps[i - 1]})")
    return t - t[0]


def _is_datetime(text: str) -> bool:
    try:
        np.datetime64(text)
    except ValueError:
        return False
    return True


def _tokens(values: list[str], name: str, source: str) -> np.ndarray:
    """A token column as int64; every value a whole number >= 1."""
    out = np.empty(len(values), dtype=np.int64)
    for i, text in enumerate(values):
        try:
            v = int(text)
        except ValueError:
            raise EpsimError(f"{source}: row {i + 2}: {name} {text!r} is not a whole number of "
                             "tokens") from None
        if v < 1:
            raise EpsimError(f"{source}: row {i + 2}: {name} is {v}; a request has at least "
                             "one token of each")
        out[i] = v
    return out


def trace_head(path_or_name: str, num_prompts: int | None) -> RequestTrace:
    """The first ``num_prompts`` rows (``None``: all); more than the trace has is an error."""
    trace = read_trace(path_or_name)
    n = len(trace) if num_prompts is None else num_prompts
    if n > len(trace):
        raise EpsimError(f"the request trace {path_or_name} has {len(trace)} requests; "
                         f"--num-prompts {n} asks for more (omit it to replay them all)")
    return RequestTrace(trace.arrival_s[:n], trace.input_lens[:n], trace.output_lens[:n],
                        trace.source)


def arrival_rate(arrival_s: np.ndarray) -> float:
    """Requests per second the replay offers: (n - 1) gaps over the span (inf for one instant)."""
    span = float(arrival_s[-1] - arrival_s[0]) if len(arrival_s) else 0.0
    return (len(arrival_s) - 1) / span if span > 0 else float("inf")
