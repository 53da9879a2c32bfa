"""Online expert rebalancing studied through the step simulator (a bench study, not part of the
package: no command runs it): re-place experts from a sliding window of recent
per-step loads every N steps, and charge the weight copies to the step that does it.

The pieces, usable on their own or by the per-step simulator:

* :func:`sample_step_loads` draws one step's per-expert token counts from load statistics (a
  multinomial per layer, as the simulator samples routing), :func:`load_stream` a run of steps
  whose workload changes between phases (e.g. one load file, then another);
* :class:`OnlineRebalancer` keeps the window and the placement in use; ``observe(step_loads)``
  returns the :class:`MoveCost` of a rebalance when one happens at that step;
* :func:`move_cost` prices going from one placement to another: each expert weight that a GPU
  must newly hold is copied from a GPU that held it, over the fabric of the hardware profile
  (xGMI full mesh: a link per GPU pair; a switch: per-GPU bandwidth; across nodes: the NIC);
* :func:`simulate_rebalancing` runs a stream with a static placement and with online
  rebalancing side by side and reports the imbalance per step and the moves.

The cost is charged whole to the rebalancing step (the copies are not overlapped with compute),
an upper bound on what a runtime that streams weights in the background would pay.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from epsim.model.accounting import expert_params
from epsim.model.config import ModelConfig
from epsim.model.dtypes import bytes_per_element
from epsim.model.eplb import DEFAULT_METHOD, balance_placement, gpu_incidence
from epsim.model.errors import EpsimError
from epsim.model.loads import frequencies
from epsim.model.opgraph import Batch
from epsim.model.placement import Placement
from epsim.model.plan import ParallelPlan
from epsim.sim.hardware.profile import HardwareProfile
from epsim.sim.step import StepMemo, simulate_step

#: usable share of a link's peak for bulk copies: about 48 of 64 GB/s per xGMI link on MI300X
#: (docs/design.md section 4, AMD's "MI300X RCCL xGMI" blog)
LINK_EFFICIENCY = 0.75


def expert_weight_bytes(model: ModelConfig) -> float:
    """Bytes of one routed expert's weights (gate, up, down; block scales included).
    Example: 44.05e6 for DeepSeek-R1 (FP8 with 128x128 block scales)."""
    return expert_params(model) * bytes_per_element(model.expert_weight_dtype)


@dataclass(frozen=True)
class MoveCost:
    """The price of one rebalance.

    experts: expert weight copies, summed over layers: (GPU, expert) pairs the new placement
        has and the old one had not. Example: 464.
    bytes: bytes over the fabric. Example: 2.04e10.
    seconds: time to copy them all, set by the busiest link or GPU port. Example: 0.061.
    """

    experts: int
    bytes: float
    seconds: float


def transfer_matrix(previous: Placement, new: Placement, expert_bytes: float) -> np.ndarray:
    """``[G, G]`` bytes each GPU sends each other GPU to go from ``previous`` to ``new``.

    A GPU that needs an expert it did not hold copies it from a GPU that held it (among
    replicas, the lowest-numbered holder that is not the receiver)."""
    prev_inc = gpu_incidence(previous)  # [L, G, E]
    need = gpu_incidence(new) & ~prev_inc
    layer, dst, expert = np.nonzero(need)
    src = np.argmax(prev_inc[layer, :, expert], axis=1)  # a holder (never dst: dst lacked it)
    g = previous.num_gpus
    sent = np.zeros((g, g))
    np.add.at(sent, (src, dst), expert_bytes)
    return sent


def transfer_seconds(sent: np.ndarray, profile: HardwareProfile,
                     link_efficiency: float = LINK_EFFICIENCY) -> float:
    """Seconds to deliver ``sent`` (``[G, G]`` bytes) with every link busy at once.

    Inside a node: full mesh, each GPU pair has its own link and each GPU's links together
    bound what it sends and receives; switch, only the per-GPU bandwidth bounds. Between nodes
    each GPU's NIC carries its share."""
    g = sent.shape[0]
    per_node = profile.gpus_per_node
    node = np.arange(g) // per_node
    local = node[:, None] == node[None, :]
    fabric = profile.fabric
    port = fabric.gpu_bandwidth * link_efficiency
    intra = np.where(local, sent, 0.0)
    inter = np.where(local, 0.0, sent)
    times = [intra.sum(axis=1).max() / port, intra.sum(axis=0).max() / port]
    if fabric.topology == "full_mesh":
        times.append(intra.max() / (fabric.link_bandwidth * link_efficiency))
    nic = profile.nic_bandwidth_per_gpu
    times += [inter.sum(axis=1).max() / nic, inter.sum(axis=0).max() / nic]
    return float(max(times))


def move_cost(previous: Placement, new: Placement, expert_bytes: float,
              profile: HardwareProfile) -> MoveCost:
    """The :class:`MoveCost` of replacing ``previous`` by ``new``."""
    sent = transfer_matrix(previous, new, expert_bytes)
    return MoveCost(experts=int(round(sent.sum() / expert_bytes)) if expert_bytes else 0,
                    bytes=float(sent.sum()), seconds=transfer_seconds(sent, profile))


# --------------------------------------------------------------------------------------------
# Load streams
# --------------------------------------------------------------------------------------------


def sample_step_loads(freqs: np.ndarray, assignments: int, rng: np.random.Generator
                      ) -> np.ndarray:
    """One step's token counts per expert: ``assignments`` (tokens x top-k) draws per loaded
    layer from its frequencies. ``[layers, experts]`` probabilities -> ``[layers, experts]``."""
    out = np.zeros(freqs.shape)
    rows = np.flatnonzero(freqs.sum(axis=1) > 0)
    out[rows] = rng.multinomial(assignments, freqs[rows])
    return out


def load_stream(phases: Sequence[tuple[np.ndarray, int]], assignments: int,
                seed: int = 0) -> Iterator[np.ndarray]:
    """Per-step loads for phases of ``(loads [layers, experts], steps)``: the workload changes
    from one phase to the next (e.g. alternating windows of two load files)."""
    rng = np.random.default_rng(seed)
    for loads, steps in phases:
        freqs = frequencies(np.asarray(loads, dtype=np.float64))
        for _ in range(steps):
            yield sample_step_loads(freqs, assignments, rng)


# --------------------------------------------------------------------------------------------
# The rebalancer
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RebalancePolicy:
    """When and how to re-place experts online.

    interval_steps: rebalance after every this many steps. Example: 200.
    window_steps: the loads of this many most recent steps are summed to fit. Example: 200.
    redundant: extra replica slots per layer (kept from the initial placement). Example: 0.
    max_moves: at most this many experts off their GPU per layer per rebalance (None: any).
    method: the balancer (``epsim.model.eplb.BALANCERS``).
    min_gain: re-place only when the window's mean imbalance drops by more than this (moving
        weights for a sampling-noise gain is a loss). Example: 0.002.
    """

    interval_steps: int
    window_steps: int
    redundant: int = 0
    max_moves: int | None = None
    method: str = DEFAULT_METHOD
    min_gain: float = 0.0

    def __post_init__(self) -> None:
        if self.interval_steps < 1 or self.window_steps < 1:
            raise EpsimError(f"rebalance interval and window must be >= 1 step, got "
                             f"{self.interval_steps} and {self.window_steps}")
        if not self.min_gain >= 0:
            raise EpsimError(f"min_gain must be >= 0, got {self.min_gain}")
        if self.max_moves is not None and self.max_moves < 0:
            raise EpsimError(f"max_moves must be >= 0, got {self.max_moves}")


class OnlineRebalancer:
    """The placement in use, the window of recent loads, and the rebalances so far."""

    def __init__(self, placement: Placement, policy: RebalancePolicy, expert_bytes: float,
                 profile: HardwareProfile) -> None:
        if placement.num_slots - placement.num_logical != policy.redundant:
            raise EpsimError(f"the initial placement has {placement.num_slots - placement.num_logical}"
                             f" redundant slots, the policy {policy.redundant}")
        self.placement = placement
        self.policy = policy
        self.expert_bytes = expert_bytes
        self.profile = profile
        self.window: deque[np.ndarray] = deque(maxlen=policy.window_steps)
        self.step = 0
        #: the last rebalance's gain in mean imbalance on its own window (in-sample: about
        #: 0.002-0.0035 from sampling noise alone over 100 steps of 4096 tokens x top-8)
        self.last_gain = float("nan")

    def observe(self, step_loads: np.ndarray) -> MoveCost | None:
        """Record one step's ``[layers, experts]`` loads (measured with the current placement);
        at the end of every interval re-place from the window (if that gains more than
        ``min_gain``) and return the move's cost, which belongs to this step. The new placement serves from the next step on."""
        self.window.append(np.asarray(step_loads, dtype=np.float64))
        self.step += 1
        if self.step % self.policy.interval_steps:
            return None
        fitted = np.sum(self.window, axis=0)
        new = balance_placement(fitted, self.placement.num_gpus, self.policy.method,
                                redundant=self.policy.redundant, previous=self.placement,
                                max_moves=self.policy.max_moves)
        rows = np.flatnonzero(fitted.sum(axis=1) > 0)
        gain = (np.mean(self.placement.imbalance(fitted)[rows])
                - np.mean(new.imbalance(fitted)[rows]))
        self.last_gain = float(gain)
        if gain <= self.policy.min_gain:
            return None
        cost = move_cost(self.placement, new, self.expert_bytes, self.profile)
        self.placement = new
        return cost


@dataclass(frozen=True)
class RebalanceRun:
    """A stream run with a static placement and with online rebalancing.

    static_imbalance / online_imbalance: ``[steps]`` mean over MoE layers of that step's max
        GPU load / mean GPU load. Example: 1.09 / 1.01.
    move_seconds: ``[steps]`` rebalance cost charged to each step (0 where none).
    costs: the :class:`MoveCost` of each rebalance, in order; steps: the step indices.
    static_step_s / online_step_s: ``[steps]`` step times from a step-time function (the
        online ones with the move cost added on the rebalancing steps), or None.
    """

    static_imbalance: np.ndarray
    online_imbalance: np.ndarray
    move_seconds: np.ndarray
    costs: list[MoveCost] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    static_step_s: np.ndarray | None = None
    online_step_s: np.ndarray | None = None

    def summary(self) -> dict[str, float]:
        """Means over the run (imbalance, copies, bytes and seconds)."""
        return {
            "steps": int(len(self.static_imbalance)),
            "static_imbalance_mean": float(np.mean(self.static_imbalance)),
            "online_imbalance_mean": float(np.mean(self.online_imbalance)),
            "rebalances": len(self.costs),
            "moved_experts": int(sum(c.experts for c in self.costs)),
            "moved_bytes": float(sum(c.bytes for c in self.costs)),
            "move_seconds_total": float(self.move_seconds.sum()),
            "move_seconds_max": float(self.move_seconds.max(initial=0.0)),
            **({"static_step_ms_mean": float(np.mean(self.static_step_s)) * 1e3,
                "online_step_ms_mean": float(np.mean(self.online_step_s)) * 1e3,
                "online_step_ms_max": float(np.max(self.online_step_s)) * 1e3}
               if self.static_step_s is not None else {}),
        }


def _step_imbalance(placement: Placement, loads: np.ndarray, rows: np.ndarray) -> float:
    return float(np.mean(placement.imbalance(loads)[rows]))


def simulate_rebalancing(stream: Iterable[np.ndarray], initial: Placement,
                         policy: RebalancePolicy, expert_bytes: float,
                         profile: HardwareProfile) -> RebalanceRun:
    """Run ``stream`` (per-step ``[layers, experts]`` loads) with ``initial`` kept throughout and
    with :class:`OnlineRebalancer` starting from it; each step is measured with the placement
    in use when it ran."""
    online = OnlineRebalancer(initial, policy, expert_bytes, profile)
    static, dynamic, seconds, costs, steps = [], [], [], [], []
    for t, loads in enumerate(stream):
        rows = np.flatnonzero(loads.sum(axis=1) > 0)
        static.append(_step_imbalance(initial, loads, rows))
        dynamic.append(_step_imbalance(online.placement, loads, rows))
        cost = online.observe(loads)
        seconds.append(cost.seconds if cost else 0.0)
        if cost:
            costs.append(cost)
            steps.append(t)
    if not static:
        raise EpsimError("the load stream has no steps")
    return RebalanceRun(np.asarray(static), np.asarray(dynamic), np.asarray(seconds),
                        costs, steps)


#: step_seconds(load statistics [layers, experts], placement, seed) -> one step's seconds
StepTime = Callable[[np.ndarray, Placement, int], float]


def simulate_timed_rebalancing(phases: Sequence[tuple[np.ndarray, int]], initial: Placement,
                               policy: RebalancePolicy, expert_bytes: float,
                               profile: HardwareProfile, step_seconds: StepTime,
                               assignments: int, seed: int = 0) -> RebalanceRun:
    """Like :func:`simulate_rebalancing`, with step times: each step of each phase is timed by
    ``step_seconds(phase loads, placement in use, step seed)`` (the per-step simulator, e.g.
    ``lambda l, p, s: simulate_step(model, plan, batch, profile, loads=l, placement=p,
    seed=s).step_s``), once with the static placement and once with the online one; a
    rebalance's move cost is added to the online time of the step that does it.

    The rebalancer's window gets this module's own sample of the step's routing
    (:func:`sample_step_loads` from the phase's loads, ``assignments`` tokens x top-k), drawn
    from the same distribution as the step function's.
    """
    online = OnlineRebalancer(initial, policy, expert_bytes, profile)
    rng = np.random.default_rng(seed)
    static, dynamic, seconds, costs, steps, t_static, t_online = [], [], [], [], [], [], []
    t = 0
    for loads, count in phases:
        loads = np.asarray(loads, dtype=np.float64)
        freqs = frequencies(loads)
        rows = np.flatnonzero(loads.sum(axis=1) > 0)
        for _ in range(count):
            sample = sample_step_loads(freqs, assignments, rng)
            static.append(_step_imbalance(initial, sample, rows))
            dynamic.append(_step_imbalance(online.placement, sample, rows))
            t_static.append(float(step_seconds(loads, initial, seed + t)))
            t_on = float(step_seconds(loads, online.placement, seed + t))
            cost = online.observe(sample)
            seconds.append(cost.seconds if cost else 0.0)
            t_online.append(t_on + seconds[-1])
            if cost:
                costs.append(cost)
                steps.append(t)
            t += 1
    if not static:
        raise EpsimError("the phases have no steps")
    return RebalanceRun(np.asarray(static), np.asarray(dynamic), np.asarray(seconds), costs,
                        steps, np.asarray(t_static), np.asarray(t_online))


def simulated_step_time(model: ModelConfig, plan: ParallelPlan, batch: Batch,
                        profile: HardwareProfile, mode: str = "fast") -> StepTime:
    """A :data:`StepTime` that runs the per-step simulator (:func:`sim.step.simulate.simulate_step`):
    routing sampled from the given load statistics, mapped through the given placement (the
    plan takes the placement's redundant slots, so the graph holds as many experts per GPU).
    Its steps share one :class:`~epsim.sim.step.memo.StepMemo`, owned by the function."""
    memo = StepMemo()

    def step_seconds(loads: np.ndarray, placement: Placement, seed: int) -> float:
        slots = plan.with_(redundant_experts=placement.num_slots - placement.num_logical)
        return simulate_step(model, slots, batch, profile, loads=loads, placement=placement,
                             mode=mode, seed=seed, memo=memo).step_s
    return step_seconds


def simulate_online_eplb(model: ModelConfig, plan: ParallelPlan, batch: Batch,
                         profile: HardwareProfile, phases: Sequence[tuple[np.ndarray, int]],
                         policy: RebalancePolicy, initial: Placement | None = None,
                         seed: int = 0) -> RebalanceRun:
    """Simulated steps of a deployment whose workload changes phase by phase, with the
    placement kept and with online rebalancing (its weight copies charged to the rebalancing
    steps). ``initial``: default, balanced on the first phase's loads with the policy's
    redundant slots. The rebalancer sees every step's ``batch.tokens x ranks x top-k`` pairs."""
    if not phases:
        raise EpsimError("no phases to simulate")
    if initial is None:
        initial = balance_placement(phases[0][0], plan.ep, policy.method,
                                    redundant=policy.redundant)
    assignments = batch.tokens * plan.dp * model.moe.top_k
    return simulate_timed_rebalancing(phases, initial, policy, expert_weight_bytes(model),
                                      profile, simulated_step_time(model, plan, batch, profile),
                                      assignments, seed)
