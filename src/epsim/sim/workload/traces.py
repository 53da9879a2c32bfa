"""Request traces: real arrival times and lengths, replayed by ``--dataset trace``.

A trace is a CSV with one request a row, in either of two column sets (``TRACE_FORMATS``):

    azure   Azure's public LLM inference trace (Azure/AzurePublicDataset,
            ``AzureLLMInferenceDataset2023.md``):
              TIMESTAMP        when the request arrived: a date-time
                               (``2023-11-16 18:15:46.6805900``) or seconds as a number
              ContextTokens    prompt tokens (>= 1)
              GeneratedTokens  output tokens (>= 1; simulated exactly, as under ``--ignore-eos``)
    vidur   Vidur's processed request traces (microsoft/vidur ``data/processed_traces/*.csv``,
            e.g. ``splitwise_conv.csv``, read by its ``trace_request_length_generator`` /
            ``trace_replay_request_generator``):
              arrived_at          seconds since the trace's start
              num_prefill_tokens  prompt tokens
              num_decode_tokens   output tokens

Other columns are ignored. Every TIMESTAMP of a file is of one kind (all numbers or all
date-times) and they never decrease. Replay: the first ``num_prompts`` rows (all of them by
default), the first request at time 0 and each later one at ``(TIMESTAMP - first TIMESTAMP) *
time_scale``, so ``time_scale`` 0.5 doubles the arrival rate and 2 halves it. Lengths may be
scaled as Vidur's ``prefill_scale_factor`` / ``decode_scale_factor`` scale them
(:func:`scaled_lengths`: ``tokens x scale``, truncated to an integer, at least 1). Bounds
(``epsim.model.bounds``): at most ``MAX_PROMPTS`` rows, ``MAX_TOKENS`` tokens a length, a field
of at most ``MAX_CSV_FIELD`` characters. Two traces ship with epsim (``SHIPPED_TRACES``, CC-BY
4.0, with their license and attribution in ``model/data/traces/azure-llm-2023/``).
"""

from __future__ import annotations

import csv
import functools
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from epsim.model.bounds import MAX_CSV_FIELD, MAX_PROMPTS, MAX_TOKENS, show
from epsim.model.errors import EpsimError

#: each format's columns: (arrival, prompt tokens, output tokens); the first format whose
#: columns the header has is read
TRACE_FORMATS: dict[str, tuple[str, str, str]] = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "vidur": ("arrived_at", "num_prefill_tokens", "num_decode_tokens"),
}
#: the columns of the default (Azure) format
TRACE_COLUMNS = TRACE_FORMATS["azure"]
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
    header, body = _read_rows(path, source)
    fmt = next((f for f, cols in TRACE_FORMATS.items() if all(c in header for c in cols)), None)
    if fmt is None:  # name what the nearest format lacks
        near = max(TRACE_FORMATS, key=lambda f: sum(c in header for c in TRACE_FORMATS[f]))
        missing = [c for c in TRACE_FORMATS[near] if c not in header]
        wanted = " or ".join(f"{f}: {', '.join(cols)}" for f, cols in TRACE_FORMATS.items())
        raise EpsimError(f"{source}: the request trace lacks column(s) {', '.join(missing)} "
                         f"(it needs {wanted})")
    names = TRACE_FORMATS[fmt]
    cols = [header.index(c) for c in names]
    short = next((i for i, r in enumerate(body) if len(r) <= max(cols)), None)
    if short is not None:
        raise EpsimError(f"{source}: row {short + 2} has {len(body[short])} fields, the header "
                         f"{len(header)}")
    stamps, ins, outs = ([r[c].strip() for r in body] for c in cols)
    arrival = _seconds(stamps, names[0], source)
    tokens = [_tokens(values, name, source) for values, name in ((ins, names[1]),
                                                                 (outs, names[2]))]
    return RequestTrace(arrival_s=arrival, input_lens=tokens[0], output_lens=tokens[1],
                        source=source)


def _read_rows(path: str, source: str) -> tuple[list[str], list[list[str]]]:
    """The header and the non-blank rows, at most ``MAX_PROMPTS`` of them; a field over the
    csv module's limit or a NUL byte is one line naming the row."""
    rows: list[list[str]] = []
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            reader = csv.reader(f)
            for row in reader:
                if len(rows) > MAX_PROMPTS:
                    raise EpsimError(f"{source}: the request trace has more than "
                                     f"{MAX_PROMPTS:,} requests (docs/inputs.md)")
                if not rows or any(cell.strip() for cell in row):
                    rows.append(row)
    except OSError as exc:
        raise EpsimError(f"{source}: cannot read the request trace ({exc.strerror})") from None
    except csv.Error as exc:  # a field over csv.field_size_limit(), a NUL byte
        raise EpsimError(f"{source}: line {reader.line_num}: not a CSV row ({exc}; a field "
                         f"holds at most {MAX_CSV_FIELD:,} characters)") from None
    if not rows:
        raise EpsimError(f"{source}: empty request trace (a CSV with columns "
                         f"{', '.join(TRACE_COLUMNS)})")
    if len(rows) == 1:
        raise EpsimError(f"{source}: the request trace has a header but no requests")
    return [h.strip() for h in rows[0]], rows[1:]


def _seconds(stamps: list[str], column: str, source: str) -> np.ndarray:
    """The arrival column as seconds since the first row: all numbers (seconds) or all ISO
    date-times; a mix is refused, naming the first row of the other kind."""
    numbers = [_as_float(s) for s in stamps]
    if all(v is not None for v in numbers):
        t = np.array(numbers, dtype=float)
    else:
        if any(v is not None for v in numbers):
            bad = next(i for i, v in enumerate(numbers) if (v is None) != (numbers[0] is None))
            raise EpsimError(f"{source}: row {bad + 2}: {column} {show(stamps[bad])} mixes "
                             f"kinds: row 2 is {'a number' if numbers[0] is not None else 'a date-time'}")
        try:
            ns = np.array(stamps, dtype="datetime64[ns]")
        except (ValueError, OverflowError):
            bad = next(i for i, s in enumerate(stamps) if not _is_datetime(s))
            raise EpsimError(f"{source}: row {bad + 2}: {column} {show(stamps[bad])} is "
                             "neither a date-time nor a number of seconds") from None
        t = (ns - ns[0]).astype(np.int64) / 1e9
    if not np.isfinite(t).all():
        bad = int(np.flatnonzero(~np.isfinite(t))[0])
        raise EpsimError(f"{source}: row {bad + 2}: {column} {show(stamps[bad])} is not finite")
    back = np.flatnonzero(np.diff(t) < 0)
    if len(back):
        i = int(back[0]) + 1
        raise EpsimError(f"{source}: timestamps must not decrease, but row {i + 2} "
                         f"({show(stamps[i])}) is before row {i + 1} ({show(stamps[i - 1])})")
    return t - t[0]


def _as_float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _is_datetime(text: str) -> bool:
    try:
        np.datetime64(text)
    except (ValueError, OverflowError):
        return False
    return True


def _tokens(values: list[str], name: str, source: str) -> np.ndarray:
    """A token column as int64; every value a whole number in [1, MAX_TOKENS]."""
    out = np.empty(len(values), dtype=np.int64)
    for i, text in enumerate(values):
        try:
            v = int(text) if len(text) <= 20 else None  # digits bounded before int() reads them
        except ValueError:
            v = None
        if v is None:
            raise EpsimError(f"{source}: row {i + 2}: {name} {show(text)} is not a whole number "
                             "of tokens")
        if not 1 <= v <= MAX_TOKENS:
            raise EpsimError(f"{source}: row {i + 2}: {name} is {show(v)}; a request has "
                             f"1 to {MAX_TOKENS:,} tokens of each (docs/inputs.md)")
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


def scaled_lengths(lens: np.ndarray, scale: float, what: str) -> np.ndarray:
    """``lens x scale`` as Vidur scales a trace (``prefill_scale_factor``,
    ``decode_scale_factor``): truncated to an integer, at least 1; above ``MAX_TOKENS`` is an
    error. Example: ``scaled_lengths([374, 3], 0.5, ...)`` -> ``[187, 1]``."""
    if scale == 1.0:
        return lens
    out = np.maximum(1, np.floor(lens * float(scale))).astype(np.int64)
    if len(out) and int(out.max()) > MAX_TOKENS:
        raise EpsimError(f"{what} x {scale:g} gives a request of {int(out.max()):,} tokens, "
                         f"over {MAX_TOKENS:,} (docs/inputs.md)")
    return out


def arrival_rate(arrival_s: np.ndarray) -> float:
    """Requests per second the replay offers: (n - 1) gaps over the span (inf for one instant)."""
    span = float(arrival_s[-1] - arrival_s[0]) if len(arrival_s) else 0.0
    return (len(arrival_s) - 1) / span if span > 0 else float("inf")


def offered_rate(arrival_s: np.ndarray) -> float | str:
    """:func:`arrival_rate` as a report writes it: ``"inf"`` (as ``request_rate`` spells it)
    when every request arrives at once, never Infinity in JSON."""
    rate = arrival_rate(arrival_s)
    return rate if np.isfinite(rate) else "inf"
