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

The instances are co-simulated in one event loop (``sim/serving_loop.py``), so the load a router
reads is each instance's at the moment the request is routed: exact, not an estimate.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from epsim.model.errors import EpsimError


class Router:
    """One policy over ``instances`` instances; ``outstanding[k]``: requests routed to ``k``
    and not yet done there. Subclasses set ``name`` and implement :meth:`pick`."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""

    def __init__(self, instances: int) -> None:
        if instances < 1:
            raise EpsimError(f"a router needs at least one instance, got {instances}")
        self.instances = instances
        self.outstanding = np.zeros(instances, dtype=np.int64)

    def pick(self) -> int:
        """The instance the next request goes to (no state changes)."""
        raise NotImplementedError

    def route(self) -> int:
        """Send one request: pick its instance and count it there."""
        k = self.pick()
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


def make_router(name: str, instances: int) -> Router:
    """The registered router ``name`` over ``instances`` instances."""
    if name not in ROUTERS:
        raise EpsimError(f"router must be one of {', '.join(ROUTERS)}, got {name!r}")
    return ROUTERS[name](instances)


@register
class RoundRobin(Router):
    name = "round_robin"
    summary = "instance counter % instances (Vidur's RoundRobinGlobalScheduler)"

    def __init__(self, instances: int) -> None:
        super().__init__(instances)
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
        return int(np.argmin(self.outstanding))  # argmin keeps the first (lowest) minimum


#: the registered policies (the CLI's choices)
ROUTER_NAMES = tuple(ROUTERS)
