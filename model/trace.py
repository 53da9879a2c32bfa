"""The trace schema shared by simulated and measured steps, and its Chrome trace-event writer.

A trace is a list of :class:`TraceEvent`: one executed op (or one simulated op) on one rank and
stream. The simulator and the runtime both emit it with the op graph's ids, so the two traces of
one configuration line up op by op. ``write_chrome_trace`` writes the Chrome trace-event JSON
(``traceEvents``, ``ph: "X"``, ``pid`` = rank, ``tid`` = stream) that Perfetto and
chrome://tracing open.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import EpsimError

#: stream name -> Chrome ``tid``
STREAMS: dict[str, int] = {"compute": 0, "comm": 1, "host": 2}


@dataclass(frozen=True)
class TraceEvent:
    """One op's execution on one rank.

    op_id: the op graph's id, e.g. ``"L12.moe.dispatch.mb1"``; ``"launch"`` for host-side costs.
    kind: the op kind (``"dispatch"``).
    rank: global rank. Example: 3.
    stream: ``"compute"``, ``"comm"`` or ``"host"``.
    start_us / dur_us: start and duration in microseconds from the step's start.
    layer / microbatch: as on the op (-1 outside layers).
    args: anything else worth showing (bytes, flops, tokens).
    """

    op_id: str
    kind: str
    rank: int
    stream: str
    start_us: float
    dur_us: float
    layer: int = -1
    microbatch: int = 0
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


def to_chrome_trace(events: Iterable[TraceEvent], metadata: Mapping[str, Any] | None = None
                    ) -> dict[str, Any]:
    """The Chrome trace-event object for ``events``."""
    events = list(events)
    out: list[dict[str, Any]] = []
    for rank in sorted({e.rank for e in events}):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank}"}})
        for stream, tid in STREAMS.items():
            out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                        "args": {"name": stream}})
    for e in events:
        if e.stream not in STREAMS:
            raise ValueError(f"unknown stream {e.stream!r} for {e.op_id}")
        out.append({
            "name": e.op_id, "cat": e.kind, "ph": "X", "pid": e.rank, "tid": STREAMS[e.stream],
            "ts": round(e.start_us, 3), "dur": round(e.dur_us, 3),
            "args": {"layer": e.layer, "microbatch": e.microbatch, **dict(e.args)},
        })
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": dict(metadata or {})}


def write_json_atomic(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write ``obj`` as JSON to ``path`` whole or not at all (temp file, then rename)."""
    target = Path(path)
    if target.parent and not target.parent.exists():
        raise EpsimError(f"cannot write {target}: folder {target.parent} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or ".")
    except OSError as exc:
        raise EpsimError(f"cannot write {target}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_chrome_trace(events: Iterable[TraceEvent], path: str | os.PathLike[str],
                       metadata: Mapping[str, Any] | None = None) -> None:
    """Write ``events`` as Chrome trace-event JSON, whole or not at all."""
    write_json_atomic(to_chrome_trace(events, metadata), path)
