"""Read a PyTorch profiler (Kineto) Chrome trace: GPU kernels, who launched them, and when.

The layout (``torch.profiler`` ``export_chrome_trace``; one JSON object):

    traceEvents     Chrome trace events. ``cat: "kernel"`` (also ``gpu_memcpy``, ``gpu_memset``):
                    GPU activity, ``ts`` / ``dur`` in microseconds, ``args.correlation`` the id
                    of the runtime call that launched it. ``cat: "cuda_runtime"`` /
                    ``"cuda_driver"`` (HIP: the same categories): host-side launches, with the
                    same ``args.correlation``. ``cat: "user_annotation"``: ``record_function``
                    ranges on a CPU thread. ``cat: "ac2g"``, ``ph: "s"``: the flow from a launch
                    (its ``pid``/``tid``/``ts``) to the kernel of correlation ``id``.
                    ``cat: "cpu_op"``: ATen ops, ``args["External id"]``.
    distributedInfo ``{"backend", "rank", "world_size"}`` (torch.distributed runs)
    deviceProperties per device ``{"name", ...}``
    traceName       the file name the profiler wrote

A GPU kernel is *under* an annotation when the call that launched it lies within the
annotation's CPU span on the same thread: the launch is found by correlation id (runtime
events), else by the ``ac2g`` flow start of that id, else by the ``External id`` of a CPU op.
Kernels launched under none of the selected annotations are outside the scope.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epsim.model.bounds import parse_json
from epsim.model.errors import EpsimError

GPU_KERNEL_CATS = frozenset({"kernel"})
GPU_COPY_CATS = frozenset({"gpu_memcpy", "gpu_memset"})
_LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver", "hip_runtime", "hip_driver"})
#: DeepSeek's DualPipe chunk annotations of a forward chunk (deepseek-ai/profile-data
#: ``train.json``): attention, MLP, EP dispatch and combine of each layer
FORWARD_ANNOTATIONS: tuple[str, ...] = ("attn(F)", "mlp(F)", "dispatch(F)", "combine(F)")


@dataclass(frozen=True)
class GpuKernel:
    """One GPU activity. name: as recorded (demangled); ts_us / dur_us: start and length;
    correlation: the launch's id (None when the trace has none); external_id: the CPU op's."""

    name: str
    ts_us: float
    dur_us: float
    correlation: int | None
    external_id: int | None
    stream: int | None


@dataclass(frozen=True)
class Span:
    """A CPU range (annotation or launch): name, ``pid``/``tid``, ``ts_us`` .. ``end_us``."""

    name: str
    pid: Any
    tid: Any
    ts_us: float
    end_us: float

    def holds(self, pid: Any, tid: Any, ts: float) -> bool:
        return self.pid == pid and self.tid == tid and self.ts_us <= ts <= self.end_us


@dataclass(frozen=True)
class KinetoTrace:
    """A read trace: ``kernels`` (``cat: kernel``), ``copies`` (memcpy/memset), the
    ``annotations``, launch positions by correlation id, and ``metadata``."""

    path: str
    kernels: tuple[GpuKernel, ...]
    copies: tuple[GpuKernel, ...]
    annotations: tuple[Span, ...]
    launches: Mapping[int, Span]
    cpu_ops: Mapping[int, Span]
    metadata: Mapping[str, Any]

    def launch_of(self, k: GpuKernel) -> Span | None:
        """Where ``k`` was launched (module docstring), None when the trace does not say."""
        if k.correlation is not None and k.correlation in self.launches:
            return self.launches[k.correlation]
        if k.external_id is not None:
            return self.cpu_ops.get(k.external_id)
        return None


def _num(value: Any) -> float | None:
    """A finite number, else None (the event is skipped: NaN or inf would reach --json)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _span(ev: Mapping[str, Any]) -> Span | None:
    ts, dur = _num(ev.get("ts")), _num(ev.get("dur", 0.0))
    if ts is None or dur is None:
        return None
    return Span(str(ev.get("name", "")), ev.get("pid"), ev.get("tid"), ts, ts + dur)


def _gpu(ev: Mapping[str, Any]) -> GpuKernel | None:
    ts, dur = _num(ev.get("ts")), _num(ev.get("dur"))
    if ts is None or dur is None or dur < 0:
        return None
    args = ev.get("args") if isinstance(ev.get("args"), Mapping) else {}
    return GpuKernel(str(ev.get("name", "")), ts, dur, _int(args.get("correlation")),
                     _int(args.get("External id")), _int(args.get("stream")))


def metadata_of(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What the trace says about its run: rank, world size, backend, device, trace name and a
    sequence length where the trace name carries one (``..._seqlen4096``)."""
    meta: dict[str, Any] = {}
    dist = obj.get("distributedInfo")
    if isinstance(dist, Mapping):
        for key in ("backend", "rank", "world_size"):
            if key in dist:
                meta[key] = dist[key]
    devices = obj.get("deviceProperties")
    if isinstance(devices, list) and devices and isinstance(devices[0], Mapping):
        meta["device"] = str(devices[0].get("name", ""))
    name = obj.get("traceName")
    if isinstance(name, str):
        meta["trace_name"] = name
        found = re.search(r"seq_?len(\d+)", name, re.IGNORECASE)
        if found:
            meta["seq_len"] = int(found.group(1))
    return meta


def parse_trace(obj: Any, where: str = "trace") -> KinetoTrace:
    """A :class:`KinetoTrace` from a loaded Chrome trace object (one line on a bad layout)."""
    events = obj.get("traceEvents") if isinstance(obj, Mapping) else obj
    if not isinstance(events, list):
        raise EpsimError(f"{where}: not a Chrome trace (no traceEvents list)")
    kernels, copies, annotations = [], [], []
    launches: dict[int, Span] = {}
    flows: dict[int, Span] = {}
    cpu_ops: dict[int, Span] = {}
    for ev in events:
        if not isinstance(ev, Mapping):
            continue
        cat, ph = ev.get("cat"), ev.get("ph")
        if not isinstance(cat, str):  # a list or object as the category: no event of ours
            continue
        if cat in GPU_KERNEL_CATS or cat in GPU_COPY_CATS:
            k = _gpu(ev)
            if k is not None:
                (kernels if cat in GPU_KERNEL_CATS else copies).append(k)
        elif cat == "user_annotation":
            s = _span(ev)
            if s is not None:
                annotations.append(s)
        elif cat in _LAUNCH_CATS or cat == "cpu_op":
            s = _span(ev)
            args = ev.get("args") if isinstance(ev.get("args"), Mapping) else {}
            key = _int(args.get("correlation") if cat != "cpu_op" else args.get("External id"))
            if s is not None and key is not None:
                (launches if cat != "cpu_op" else cpu_ops)[key] = s
        elif cat == "ac2g" and ph == "s":
            s, key = _span(ev), _int(ev.get("id"))
            if s is not None and key is not None:
                flows[key] = s
    if not kernels:
        raise EpsimError(f"{where}: no GPU kernel events (cat \"kernel\") in the trace")
    for key, s in flows.items():  # a flow start stands in for a missing runtime event
        launches.setdefault(key, s)
    return KinetoTrace(where, tuple(kernels), tuple(copies), tuple(annotations), launches,
                       cpu_ops, metadata_of(obj) if isinstance(obj, Mapping) else {})


def read_trace(path: str | Path) -> KinetoTrace:
    """Read a Kineto Chrome trace JSON file (``.json``; one line and exit 2 when it is not)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise EpsimError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    return parse_trace(parse_json(text, str(path), "trace JSON"), str(path))


def scope_annotations(trace: KinetoTrace, names: Sequence[str] | None) -> list[Span]:
    """The annotations named ``names`` (None: :data:`FORWARD_ANNOTATIONS`, or every kernel —
    an empty list — when the trace has none of them; ``()``: every kernel)."""
    wanted = FORWARD_ANNOTATIONS if names is None else tuple(names)
    spans = [a for a in trace.annotations if a.name in wanted]
    if names is not None and wanted and not spans:
        raise EpsimError(f"{trace.path}: no annotation named {', '.join(wanted)} "
                         f"(the trace has: {', '.join(annotation_names(trace)) or 'none'})")
    return spans


def annotation_names(trace: KinetoTrace) -> list[str]:
    """The distinct annotation names, in order of first appearance."""
    return list(dict.fromkeys(a.name for a in trace.annotations))


def kernels_under(trace: KinetoTrace, spans: Iterable[Span],
                  kernels: Iterable[GpuKernel] | None = None) -> list[tuple[GpuKernel, str]]:
    """``(kernel, annotation name)`` for every kernel launched within one of ``spans`` (the
    innermost where they nest); every kernel with annotation ``""`` when ``spans`` is empty."""
    pool = trace.kernels if kernels is None else tuple(kernels)
    spans = sorted(spans, key=lambda s: s.end_us - s.ts_us)  # innermost first
    if not spans:
        return [(k, "") for k in pool]
    out = []
    for k in pool:
        launch = trace.launch_of(k)
        if launch is None:
            continue
        for s in spans:
            if s.holds(launch.pid, launch.tid, launch.ts_us):
                out.append((k, s.name))
                break
    return out


def unlinked(trace: KinetoTrace) -> int:
    """Kernels whose launch the trace does not record (they can be under no annotation)."""
    return sum(1 for k in trace.kernels if trace.launch_of(k) is None)
