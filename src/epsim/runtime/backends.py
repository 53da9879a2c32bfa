"""Backends per op kind: which implementation runs the routed experts and the EP exchange.

    routed experts   ``torch-sorted``   tokens sorted by expert, one matmul per expert segment
                                        (dynamic shapes; the default in eager mode)
                     ``torch-masked``   every local expert over every received row, weights zero
                                        where not routed (static shapes; graph capture)
                     ``aiter``          aiter's ``fused_moe`` (ROCm), when ``aiter`` imports
    dispatch/combine ``torch``          ``torch.distributed.all_to_all_single`` (runtime.comm),
                                        dynamic or static as the routed experts
                     ``mori``           MORI-EP's ``EpDispatchCombineOp`` (ROCm), when ``mori.ops``
                                        imports

Each rank picks both once, when its runtime is built (``select_moe_backend``,
``select_exchange``); the ops call through what it picked.

The optional imports are guarded with ``except Exception``: aiter raises RuntimeError, not
ImportError, on machines without ROCm. The aiter and MORI paths follow those projects' public
Python APIs; neither library exists on the machines this project was built and tested on, so
neither path has been exercised (docs/runtime.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import comm, kernels

MoEFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                 torch.Tensor]


def _try_import(name: str) -> Any:
    try:
        import importlib

        return importlib.import_module(name)
    except Exception:  # aiter raises RuntimeError without ROCm
        return None


def aiter_moe(fused_moe: Callable[..., torch.Tensor], global_slots: int, slot_base: int) -> MoEFn:
    """Wrap ``aiter.fused_moe.fused_moe(hidden_states, w1, w2, topk_weight, topk_ids,
    expert_mask=...)``: w1 ``[S, 2I, h]`` and w2 ``[S, h, I]`` (output-major), ids are global slot
    ids and ``expert_mask [global_slots]`` marks this rank's slots."""
    cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def run(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor,
            gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        key = id(gate_up)
        if key not in cache:
            mask = torch.zeros(global_slots, dtype=torch.int32, device=x.device)
            mask[slot_base:slot_base + gate_up.shape[0]] = 1
            cache[key] = (gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous(),
                          mask)
        w1, w2, mask = cache[key]
        # choices on other ranks keep a weight of zero and an id aiter's mask skips
        ids = torch.where(local >= 0, local + slot_base, torch.zeros_like(local))
        w = torch.where(local >= 0, weights, torch.zeros_like(weights))
        return fused_moe(x, w1, w2, w.to(torch.float32), ids.to(torch.int32), expert_mask=mask)

    return run


def select_moe_backend(rt: Any) -> MoEFn:
    """The routed-expert backend for a rank: aiter on ROCm GPUs in bf16 when it imports, else the
    torch backend matching the shape mode."""
    if rt.device.type == "cuda" and rt.dtype == torch.bfloat16 and not rt.opts.check:
        module = _try_import("aiter.fused_moe")
        if module is not None and getattr(torch.version, "hip", None):
            total = rt.placement.num_slots
            return aiter_moe(module.fused_moe, total, rt.slot_base)
    return kernels.moe_masked if rt.static else kernels.moe_sorted


def select_exchange(rt: Any) -> comm.Exchange:
    """The EP exchange (dispatch/combine) for a rank: MORI-EP where :func:`_mori_exchange` finds
    it, else torch's all-to-all in the step's shape mode."""
    mori = _mori_exchange(rt)
    if mori is not None:
        return mori
    torch_exchange = comm.StaticExchange if rt.static else comm.DynamicExchange
    return torch_exchange(rt.slots_per_rank, rt.group)


def _mori_exchange(rt: Any) -> MoriExchange | None:
    """MORI-EP for the EP exchange on ROCm GPUs when ``mori.ops`` imports (never under --check,
    whose 1e-4 contract is verified with the torch exchange only)."""
    if rt.device.type != "cuda" or not getattr(torch.version, "hip", None) or rt.opts.check:
        return None
    if not rt.plan.expert_parallel:
        return None
    mori = _try_import("mori")
    if mori is None or _try_import("mori.ops") is None:
        return None
    import torch.distributed as dist

    # MORI's symmetric memory is set up over a registered torch process group
    torch._C._distributed_c10d._register_process_group("default", dist.group.WORLD)
    mori.shmem.shmem_torch_process_group_init("default")
    return MoriExchange(mori, rt.rank, rt.plan.ep, rt.model.hidden_size, rt.opts.batch,
                        rt.slots_per_rank, rt.model.moe.top_k, rt.dtype)


class MoriExchange:
    """MORI-EP dispatch/combine (ROCm, intra-node), following its public Python API:
    ``EpDispatchCombineConfig(...)``, ``EpDispatchCombineOp(config)``,
    ``op.dispatch(x, weights, scales, indices)`` and ``op.combine(y, weights, indices)``.
    A :class:`epsim.runtime.comm.Exchange` whose exchanges finish within the call. Not exercised
    here (no ROCm); the torch exchange is what the tests run."""

    def __init__(self, mori: Any, rank: int, world: int, hidden: int, max_tokens: int,
                 slots_per_rank: int, top_k: int, dtype: torch.dtype) -> None:
        ops = mori.ops
        config = ops.EpDispatchCombineConfig(
            data_type=dtype, rank=rank, world_size=world, hidden_dim=hidden, scale_dim=0,
            scale_type_size=1, max_token_type_size=4, max_num_inp_token_per_rank=max_tokens,
            num_experts_per_rank=slots_per_rank, num_experts_per_token=top_k,
            kernel_type=ops.EpDispatchCombineKernelType.IntraNode)
        self.op = ops.EpDispatchCombineOp(config)

    def dispatch(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                 capacity: int) -> comm.Pending:
        """Rows received, their global slot ids and weights (only the valid rows); MORI sizes
        its buffers from the configured ``max_tokens``, not ``capacity``."""
        out, out_w, _scales, out_ids, received = self.op.dispatch(
            x, weights.float(), None, slots.to(torch.int32))
        n = int(received.reshape(-1)[0]) if torch.is_tensor(received) else int(received)
        return comm.finished(comm.DispatchResult(out[:n], out_ids[:n].to(torch.int64), out_w[:n],
                                                 None))

    def combine(self, y: torch.Tensor, recv: comm.DispatchResult) -> comm.Pending:
        out, _ = self.op.combine(y, recv.weights.float(), recv.slots.to(torch.int32))
        return comm.finished(out)
