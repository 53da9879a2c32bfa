"""The router in front of several independent instances: which instance takes a request.

A deployment of several instances (``--instance-nodes K``: each side cut into instances of K
nodes, each with its own plan, scheduler and KV cache) has a router per side that sends each
request to one instance. The policies are Vidur's global schedulers (microsoft/vidur at
6e2138f3, ``vidur/scheduler/global_scheduler/``), one class per policy behind a registry:

    round_robin    ``round_robin_global_scheduler.py``: instance ``counter % instances``, the
                   counter advancing by one per request, whatever the load
    least_loaded   ``lor_global_scheduler.py`` (least outstanding requests): the instance with
                   the fewest requests, ties to the lowest index (Vidur takes ``min`` over its
                   replicas in id order, which keeps the first minimum); the count rises by one
                   as a request is routed, so requests routed in one instant spread out

What ``least_loaded`` counts. Vidur's LOR reads each replica scheduler's
``num_pending_requests``, its waiting queue (``base_replica_scheduler.py``). Here an instance's
load is its *outstanding* requests: routed to it and not yet done with it (co-located or
decode: until the last token; prefill: until its KV has left). The waiting queue would not do:
a disaggregated decode instance has none (its requests arrive by KV transfer, their KV reserved
before the prefill starts), and under a closed-loop benchmark every queue is empty between
steps, so almost every request would tie and go to instance 0. Outstanding requests are what
the policy's name says and what the router itself can count.

The same policies pick a request's dp rank inside one instance (``ServingConfig.dp_balance``):
there a rank's load is what it holds now, queued or running (read through ``load``, since the
rank's queues know it), not a count the router keeps.

The instances are co-simulated in one event loop (``sim/serving/loop.py``), so the load a router
reads is each instance's at the moment the request is routed: exact, not an estimate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np

from epsim.model.errors import EpsimError


class Router:
    """One policy over ``instances`` instances (or one instance's dp ranks). Subclasses set
    ``name`` and implement :meth:`pick`.

    outstanding: ``[instances]`` requests routed to each and not yet done there (kept only
        without ``load``). Example: ``[3, 2]``.
    load: where given, each target's load as its owner counts it (``load(k)``: a dp rank's
        queued and running requests), read by the load-aware policies in place of
        ``outstanding``. Example: ``lambda r: queues.pending(r)``.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""

    def __init__(self, instances: int, load: Callable[[int], int] | None = None) -> None:
        if instances < 1:
            raise EpsimError(f"a router needs at least one instance, got {instances}")
        self.instances = instances
        self.outstanding = np.zeros(instances, dtype=np.int64)
        self.load = load

    def pick(self) -> int:
        """The instance the next request goes to (no state changes)."""
        raise NotImplementedError

    def route(self) -> int:
        """Send one request: pick its instance and count it there (a router given ``load``
        keeps no count: its owner knows the load)."""
        k = self.pick()
        if self.load is None:
            self.outstanding[k] += 1
        self.advance()
        return k

    def advance(self) -> None:
        """What a policy updates once a request is routed (round robin's counter)."""

    def done(self, instances: np.ndarray) -> None:
        """Requests finished at ``instances`` (one entry per request)."""
        if len(instances):
            self.outstanding -= np.bincount(instances, minlength=len(self.outstanding))

    def done_at_one(self, n: int) -> None:
        """``n`` requests finished at the only instance."""
        self.outstanding[0] -= n


ROUTERS: dict[str, type[Router]] = {}


def register(cls: type[Router]) -> type[Router]:
    ROUTERS[cls.name] = cls
    return cls


def make_router(name: str, instances: int, load: Callable[[int], int] | None = None
                ) -> Router:
    """The registered router ``name`` over ``instances`` instances (``load``: as
    :class:`Router`'s)."""
    if name not in ROUTERS:
        raise EpsimError(f"router must be one of {', '.join(ROUTERS)}, got {name!r}")
    return ROUTERS[name](instances, load)


@register
class RoundRobin(Router):
    name = "round_robin"
    summary = "instance counter % instances (Vidur's RoundRobinGlobalScheduler)"

    def __init__(self, instances: int, load: Callable[[int], int] | None = None) -> None:
        super().__init__(instances, load)
        self.counter = 0

    def pick(self) -> int:
        return self.counter % self.instances

    def advance(self) -> None:
        self.counter += 1


@register
class LeastLoaded(Router):
    name = "least_loaded"
    summary = ("the instance with the fewest outstanding requests, ties to the lowest index "
               "(Vidur's LORGlobalScheduler)")

    def pick(self) -> int:
        if self.load is not None:
            load = self.load
            return min(range(self.instances), key=lambda k: (load(k), k))
        return int(np.argmin(self.outstanding))  # argmin keeps the first (lowest) minimum


#: the registered policies (the CLI's choices)
ROUTER_NAMES = tuple(ROUTERS)
