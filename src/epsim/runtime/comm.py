"""EP dispatch and combine over ``torch.distributed.all_to_all_single``.

Each token goes once to every rank that holds at least one of its chosen experts (as DeepEP and
MORI-EP send it), carrying its top-k physical slots and weights as metadata; the receiving rank
computes the weighted sum over its own slots and combine sends that partial sum back, where the
partials of all ranks are added.

Two variants:
    dynamic   the per-destination counts are exchanged first (a small blocking all-to-all), then
              the rows go with uneven splits; shapes follow the routing.
    static    every destination gets a fixed ``capacity`` rows (the microbatch's token count, the
              most a rank can send anywhere), padded; the valid counts travel as a tensor. No host
              synchronisation and fixed shapes, which graph capture needs.

Both return a :class:`Pending`: the data exchange is issued with ``async_op=True`` and its work
handles are waited on only when an op that reads the result runs (DBO overlap).

A rank calls them through an :class:`Exchange` chosen once when its runtime is built
(``epsim.runtime.backends.select_exchange``): :class:`DynamicExchange`, :class:`StaticExchange`,
or on ROCm MORI-EP's (``epsim.runtime.backends.MoriExchange``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from . import lifecycle


@dataclass
class Pending:
    """An exchange in flight: ``wait()`` blocks on its work handles, then runs ``finish``."""

    works: Sequence[Any]
    finish: Callable[[], Any]

    def wait(self) -> Any:
        with lifecycle.waiting_on_peers():
            for work in self.works:
                if work is not None:
                    work.wait()
        return self.finish()


@dataclass
class DispatchResult:
    """What a rank received.

    x: ``[N, h]`` token rows (static: ``N = ep * capacity``, padding rows are zero).
    slots: ``[N, k]`` int64 global physical slots of each row's choices (-1 on padding rows).
    weights: ``[N, k]`` routing weights (0 on padding rows).
    layout: what combine needs to route results back (:class:`DynamicLayout` or
        :class:`StaticLayout`).
    """

    x: torch.Tensor
    slots: torch.Tensor
    weights: torch.Tensor
    layout: Any


@dataclass
class DynamicLayout:
    """send_token: ``[S]`` the local token of each sent row (rows ordered by destination rank).
    send_splits / recv_splits: rows sent to / received from each rank. tokens: local tokens."""

    send_token: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    tokens: int


@dataclass
class StaticLayout:
    """flat: ``[t, ep]`` row of each (token, destination) pair in the padded send buffer, or the
    dump row ``ep * capacity`` when the token does not go there. capacity: rows per destination.
    recv_counts: ``[ep]`` valid rows received from each rank (a tensor, never read on the host)."""

    flat: torch.Tensor
    capacity: int
    recv_counts: torch.Tensor


def destinations(slots: torch.Tensor, slots_per_rank: int, ep: int) -> torch.Tensor:
    """``[t, k]`` physical slots -> ``[t, ep]`` bool: does the token go to each rank."""
    dest = slots // slots_per_rank
    return (dest[:, :, None] == torch.arange(ep, device=slots.device)[None, None, :]).any(1)


def _meta(slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    # fp32 holds slot ids exactly (< 2**24) and the weights; one tensor, one exchange
    return torch.cat([slots.to(torch.float32), weights.to(torch.float32)], dim=1)


def _unmeta(meta: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return meta[:, :k].round().to(torch.int64), meta[:, k:]


def dispatch_dynamic(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                     slots_per_rank: int, group: Any = None) -> Pending:
    """Send each token to the ranks holding its experts, uneven splits.

    Args:
        x: ``[t, h]``; slots: ``[t, k]`` global physical slots; weights: ``[t, k]``.
        slots_per_rank: slots each rank holds; group: the EP process group (None: default).

    Returns:
        A :class:`Pending` whose ``wait()`` gives a :class:`DispatchResult`.
    """
    ep = dist.get_world_size(group)
    k = slots.shape[1]
    mask = destinations(slots, slots_per_rank, ep)
    # rows ordered by destination rank, then token: rank r's rows are one contiguous split
    _, send_token = mask.t().nonzero(as_tuple=True)
    send_counts = mask.sum(0).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    with lifecycle.waiting_on_peers():
        dist.all_to_all_single(recv_counts, send_counts, group=group)  # small and blocking
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    x_send = x.index_select(0, send_token).contiguous()
    meta_send = _meta(slots.index_select(0, send_token), weights.index_select(0, send_token))
    received = sum(recv_splits)
    x_recv = x.new_empty(received, x.shape[1])
    meta_recv = meta_send.new_empty(received, 2 * k)
    works = [
        dist.all_to_all_single(x_recv, x_send, recv_splits, send_splits, group=group,
                               async_op=True),
        dist.all_to_all_single(meta_recv, meta_send, recv_splits, send_splits, group=group,
                               async_op=True),
    ]
    layout = DynamicLayout(send_token, send_splits, recv_splits, x.shape[0])

    def finish() -> DispatchResult:
        r_slots, r_weights = _unmeta(meta_recv, k)
        return DispatchResult(x_recv, r_slots, r_weights, layout)

    return Pending(works, finish)


def combine_dynamic(y: torch.Tensor, layout: DynamicLayout, group: Any = None) -> Pending:
    """Send the partial sums ``y [N, h]`` back; ``wait()`` gives ``[t, h]`` summed per token."""
    back = y.new_empty(sum(layout.send_splits), y.shape[1])
    work = dist.all_to_all_single(back, y.contiguous(), layout.send_splits, layout.recv_splits,
                                  group=group, async_op=True)

    def finish() -> torch.Tensor:
        out = y.new_zeros(layout.tokens, y.shape[1])
        return out.index_add_(0, layout.send_token, back)

    return Pending([work], finish)


def dispatch_static(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                    slots_per_rank: int, capacity: int, group: Any = None) -> Pending:
    """As :func:`dispatch_dynamic` with fixed shapes: ``capacity`` rows per destination.

    ``capacity`` must be the same on every rank and at least the local token count.
    """
    ep = dist.get_world_size(group)
    t, k = slots.shape
    if t > capacity:
        raise ValueError(f"{t} tokens exceed the static dispatch capacity {capacity}")
    mask = destinations(slots, slots_per_rank, ep)
    # Step 1: each (token, destination) pair's row in the padded buffer; pairs that do not
    # exist point at a dump row past the end, dropped before sending
    position = torch.cumsum(mask.to(torch.int64), dim=0) - 1
    base = torch.arange(ep, device=x.device)[None, :] * capacity
    dump = ep * capacity
    flat = torch.where(mask, base + position, torch.full_like(position, dump))
    flat_rows = flat.reshape(-1)
    x_buf = x.new_zeros(dump + 1, x.shape[1])
    x_buf.index_copy_(0, flat_rows, x.repeat_interleave(ep, dim=0))
    meta = _meta(slots, weights)
    meta_buf = meta.new_zeros(dump + 1, 2 * k)
    meta_buf[:, :k] = -1.0
    meta_buf.index_copy_(0, flat_rows, meta.repeat_interleave(ep, dim=0))
    send_counts = mask.sum(0).to(torch.int64)
    # Step 2: equal splits; the counts go as a tensor alongside
    x_recv = x.new_empty(dump, x.shape[1])
    meta_recv = meta.new_empty(dump, 2 * k)
    recv_counts = torch.empty_like(send_counts)
    works = [
        dist.all_to_all_single(x_recv, x_buf[:dump], group=group, async_op=True),
        dist.all_to_all_single(meta_recv, meta_buf[:dump], group=group, async_op=True),
        dist.all_to_all_single(recv_counts, send_counts, group=group, async_op=True),
    ]
    layout = StaticLayout(flat, capacity, recv_counts)

    def finish() -> DispatchResult:
        r_slots, r_weights = _unmeta(meta_recv, k)
        # padding rows: no slot, no weight (masked on device, no host read of the counts)
        row = torch.arange(capacity, device=x.device)[None, :]
        valid = (row < recv_counts[:, None]).reshape(-1, 1)
        r_slots = torch.where(valid, r_slots, torch.full_like(r_slots, -1))
        r_weights = torch.where(valid, r_weights, torch.zeros_like(r_weights))
        return DispatchResult(x_recv, r_slots, r_weights, layout)

    return Pending(works, finish)


def combine_static(y: torch.Tensor, layout: StaticLayout, group: Any = None) -> Pending:
    """Static-shape combine: ``y [ep * capacity, h]`` back to ``[t, h]``."""
    back = torch.empty_like(y)
    work = dist.all_to_all_single(back, y.contiguous(), group=group, async_op=True)

    def finish() -> torch.Tensor:
        padded = torch.cat([back, back.new_zeros(1, back.shape[1])], dim=0)
        # [t, ep, h]: each token's partial from every rank (the dump row is zero), summed
        return padded[layout.flat].sum(1)

    return Pending([work], finish)


def finished(result: Any) -> Pending:
    """A :class:`Pending` with nothing in flight: the exchange ended when its call returned
    (MORI-EP's own kernels)."""
    return Pending([], lambda: result)


class Exchange(Protocol):
    """A rank's EP dispatch and combine, one implementation picked per rank.

        dispatch(x, slots, weights, capacity)  sends ``x [t, h]`` to the ranks holding its
            ``slots [t, k]`` (global physical slots) with their ``weights [t, k]``; ``capacity``:
            the most rows one destination may get (the microbatch's token count), which only a
            fixed-shape exchange uses. Returns a :class:`Pending` of a :class:`DispatchResult`.
        combine(y, recv)  sends the partial sums ``y [N, h]`` of the rows ``recv`` (what dispatch
            gave) back. Returns a :class:`Pending` of ``[t, h]`` summed per token.
    """

    def dispatch(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                 capacity: int) -> Pending: ...

    def combine(self, y: torch.Tensor, recv: DispatchResult) -> Pending: ...


@dataclass(frozen=True)
class DynamicExchange:
    """:func:`dispatch_dynamic` and :func:`combine_dynamic` over ``group`` (None: default)."""

    slots_per_rank: int
    group: Any = None

    def dispatch(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                 capacity: int) -> Pending:
        return dispatch_dynamic(x, slots, weights, self.slots_per_rank, group=self.group)

    def combine(self, y: torch.Tensor, recv: DispatchResult) -> Pending:
        return combine_dynamic(y, recv.layout, group=self.group)


@dataclass(frozen=True)
class StaticExchange:
    """:func:`dispatch_static` and :func:`combine_static` over ``group`` (None: default)."""

    slots_per_rank: int
    group: Any = None

    def dispatch(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                 capacity: int) -> Pending:
        return dispatch_static(x, slots, weights, self.slots_per_rank, capacity=capacity,
                               group=self.group)

    def combine(self, y: torch.Tensor, recv: DispatchResult) -> Pending:
        return combine_static(y, recv.layout, group=self.group)
