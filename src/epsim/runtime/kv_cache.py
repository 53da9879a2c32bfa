"""The KV cache of MLA: per layer a latent and a RoPE key per sequence and position.

Glossary:
    latent     ``c``: the normalised ``kv_lora_rank`` part of ``attn.kv_a``'s output, from which
               attention expands (prefill) or absorbs (decode) the per-head keys and values.
    rope key   ``pe``: the rotated ``qk_rope_head_dim`` part, shared by every head.
    storage    the dtype entries are kept in (``KV_STORAGE``): bf16, or float8_e4m3fn with one
               fp32 scale per token row; reads widen them to the compute dtype.
    index key  DSA (DeepSeek-V3.2): the lightning indexer's normalised, rotated key of each
               token (``index_head_dim`` values), kept in the compute dtype here (the released
               kernels store it in FP8; the simulator costs it so), so the runtime's top-k
               choice and the reference's are taken from the same values.
"""

from __future__ import annotations

import torch

from . import kernels

#: ``--kv-dtype`` -> storage dtype
KV_STORAGE = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}
#: an integer dtype of each storage width: writes go through a view of the same bits
_BITS = {1: torch.uint8, 2: torch.int16}


class LatentCache:
    """MLA's KV cache: per layer a latent ``[B, capacity, r]`` and a RoPE key ``[B, capacity, p]``,
    stored in bf16 or float8_e4m3fn (fp8: one fp32 scale per token row), widened on read."""

    def __init__(self, layers: int, seqs: int, capacity: int, latent: int, rope: int,
                 storage: torch.dtype, device: torch.device) -> None:
        self.storage = storage
        self.capacity = capacity
        self.c = [torch.zeros(seqs, capacity, latent, dtype=storage, device=device)
                  for _ in range(layers)]
        self.c_scale = [torch.ones(seqs, capacity, device=device) for _ in range(layers)]
        self.pe = [torch.zeros(seqs, capacity, rope, dtype=storage, device=device)
                   for _ in range(layers)]
        self.pe_scale = [torch.ones(seqs, capacity, device=device) for _ in range(layers)]
        # every write of a step as stored (widened), when a check replays a step whose entries
        # a later step overwrites (MTP's rejected drafts): {(layer, tag): [(seqs, pos, c, pe)]}
        self.journal: dict[tuple[int, int | None], list[tuple[torch.Tensor, ...]]] | None = None
        self.index: list[torch.Tensor] = []  # DSA's index keys per layer (enable_index)

    def enable_index(self, dim: int, dtype: torch.dtype) -> None:
        """Keep DSA's index keys too: per layer ``[B, capacity, dim]`` in ``dtype``."""
        seqs, device = self.c[0].shape[0], self.c[0].device
        self.index = [torch.zeros(seqs, self.capacity, dim, dtype=dtype, device=device)
                      for _ in self.c]

    def write_index(self, layer: int, seqs: torch.Tensor, positions: torch.Tensor,
                    keys: torch.Tensor) -> None:
        """Store index keys ``[t, dim]`` of sequences ``seqs [t]`` at ``positions [t]``."""
        self.index[layer][seqs, positions] = keys.to(self.index[layer].dtype)

    def read_index(self, layer: int, seqs: slice, upto: int) -> torch.Tensor:
        """``[t, upto, dim]`` index keys of sequences ``seqs``."""
        return self.index[layer][seqs, :upto]

    def take_journal(self) -> dict[tuple[int, int | None], tuple[torch.Tensor, ...]]:
        """The writes since the last call, concatenated per ``(layer, tag)``; starts a new one."""
        out = {key: tuple(torch.cat(parts) for parts in zip(*entries, strict=True))
               for key, entries in (self.journal or {}).items()}
        self.journal = {}
        return out

    def write(self, layer: int, seqs: torch.Tensor, positions: torch.Tensor, c: torch.Tensor,
              pe: torch.Tensor, tag: int | None = None) -> None:
        """Store ``c [t, r]`` and ``pe [t, p]`` of sequences ``seqs [t]`` at ``positions [t]``
        (``tag``: the MTP draft pass writing, for the journal)."""
        qc, sc = kernels.quantize_rows(c, self.storage)
        qp, sp = kernels.quantize_rows(pe, self.storage)
        if self.journal is not None:
            self.journal.setdefault((layer, tag), []).append((
                seqs.cpu(), positions.cpu(), kernels.dequantize_rows(qc, sc, torch.float32).cpu(),
                kernels.dequantize_rows(qp, sp, torch.float32).cpu()))
        # write through an integer view of the same bits: index_put is not implemented for
        # float8 on every device
        bits = _BITS[self.c[layer].element_size()]
        self.c[layer].view(bits)[seqs, positions] = qc.view(bits)
        self.c_scale[layer][seqs, positions] = sc
        self.pe[layer].view(bits)[seqs, positions] = qp.view(bits)
        self.pe_scale[layer][seqs, positions] = sp

    def widened(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's entries as stored, widened to fp32 on the CPU: ``c [layers, seqs,
        capacity, r]`` and ``pe [layers, seqs, capacity, p]`` (what ``--check`` compares)."""
        c = [kernels.dequantize_rows(q, s, torch.float32) for q, s in zip(self.c, self.c_scale,
                                                                           strict=True)]
        pe = [kernels.dequantize_rows(q, s, torch.float32) for q, s in zip(self.pe, self.pe_scale,
                                                                            strict=True)]
        return torch.stack(c).cpu(), torch.stack(pe).cpu()

    def read(self, layer: int, seqs: slice, upto: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[t, upto, r]`` and ``[t, upto, p]`` widened to ``dtype``."""
        c = kernels.dequantize_rows(self.c[layer][seqs, :upto], self.c_scale[layer][seqs, :upto],
                                    dtype)
        pe = kernels.dequantize_rows(self.pe[layer][seqs, :upto],
                                     self.pe_scale[layer][seqs, :upto], dtype)
        return c, pe
