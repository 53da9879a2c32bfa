"""ShareGPT-like request lengths: a synthetic stand-in for the ShareGPT conversations, or a
local ShareGPT JSON's first turns, both filtered as vLLM filters ShareGPT.

    ShareGPTLike           the synthetic distribution's parameters and vLLM's filter
                           (``SHAREGPT_LIKE``: the defaults)
    sharegpt_like_lengths  ``n`` synthetic (prompt, answer) lengths
    sharegpt_file_lengths  ``n`` (prompt, answer) lengths from a local ShareGPT JSON
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from epsim.model.bounds import read_json_file
from epsim.model.errors import EpsimError


@dataclass(frozen=True)
class ShareGPTLike:
    """Parameters of the synthetic ShareGPT-like length distribution (log-normal, then filtered).

    input_mean / output_mean: mean prompt and answer tokens before filtering. Example: 161.31 /
        337.99, the ShareGPT means the vLLM paper reports (Kwon et al., "Efficient Memory
        Management for Large Language Model Serving with PagedAttention", SOSP 2023, section 6.1).
    input_sigma / output_sigma: log-space standard deviations (epsim's assumption, not fitted:
        ShareGPT lengths span about two orders of magnitude).
    min_len / max_prompt_len / max_total_len: vLLM's ShareGPT filter (``is_valid_sequence``):
        drop pairs with a prompt or answer under 4 tokens, a prompt over 1024 or a total over 2048.
    """

    input_mean: float = 161.31
    output_mean: float = 337.99
    input_sigma: float = 1.0
    output_sigma: float = 0.9
    min_len: int = 4
    max_prompt_len: int = 1024
    max_total_len: int = 2048


SHAREGPT_LIKE = ShareGPTLike()

#: characters per token used to size a local ShareGPT file's texts without a tokenizer (the
#: usual rule of thumb for English text under BPE tokenizers)
CHARS_PER_TOKEN = 4.0


def _lognormal_for_mean(rng: np.random.Generator, n: int, mean: float, sigma: float) -> np.ndarray:
    """Log-normal draws with the given arithmetic mean: mu = ln(mean) - sigma^2 / 2."""
    mu = math.log(mean) - sigma * sigma / 2.0
    return rng.lognormal(mu, sigma, size=n)


def _valid_pairs(ins: np.ndarray, outs: np.ndarray, p: ShareGPTLike, fixed_out: bool) -> np.ndarray:
    """vLLM's ShareGPT filter as a boolean mask over candidate (prompt, answer) pairs."""
    ok = (ins >= p.min_len) & (ins <= p.max_prompt_len) & (ins + outs <= p.max_total_len)
    if not fixed_out:  # an answer length the user fixed is not filtered (as in vLLM)
        ok &= outs >= p.min_len
    return ok


def sharegpt_like_lengths(rng: np.random.Generator, n: int, osl: int | None = None,
                          params: ShareGPTLike = SHAREGPT_LIKE) -> tuple[np.ndarray, np.ndarray]:
    """``n`` synthetic ShareGPT-like (prompt, answer) lengths -> two (n,) int64 arrays.

    Steps: draw log-normal candidates in batches, round to tokens, keep the pairs vLLM's filter
    keeps, stop at ``n``.
    """
    ins_out: list[np.ndarray] = []
    outs_out: list[np.ndarray] = []
    have = 0
    if osl is not None and osl + params.min_len > params.max_total_len:
        raise EpsimError(f"osl {osl} leaves no room under the ShareGPT filter's "
                         f"{params.max_total_len}-token total")
    while have < n:
        batch = max(2 * (n - have), 64)
        ins = np.maximum(1, np.rint(_lognormal_for_mean(rng, batch, params.input_mean,
                                                        params.input_sigma))).astype(np.int64)
        if osl is None:
            outs = np.maximum(1, np.rint(_lognormal_for_mean(
                rng, batch, params.output_mean, params.output_sigma))).astype(np.int64)
        else:
            outs = np.full(batch, osl, dtype=np.int64)
        keep = _valid_pairs(ins, outs, params, osl is not None)
        ins_out.append(ins[keep])
        outs_out.append(outs[keep])
        have += int(keep.sum())
    return np.concatenate(ins_out)[:n], np.concatenate(outs_out)[:n]


def _token_estimate(text: str) -> int:
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def sharegpt_file_lengths(path: str, rng: np.random.Generator, n: int, osl: int | None = None,
                          params: ShareGPTLike = SHAREGPT_LIKE) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, answer) lengths from a local ShareGPT JSON, as vLLM samples it -> two (n,) arrays.

    Steps: keep conversations with at least two turns; prompt = first turn, answer = second
    (tokens estimated as characters / ``CHARS_PER_TOKEN``, there being no tokenizer here);
    shuffle with the seed; apply vLLM's filter; take the first ``n`` (cycling when the file has
    fewer valid pairs, as vLLM's oversampling does).
    """
    file = Path(path)
    data = read_json_file(file, "ShareGPT dataset file")
    if not isinstance(data, list):
        raise EpsimError(f"{file}: a ShareGPT file is a JSON list of conversations")
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        pairs.append((_token_estimate(str(first.get("value", ""))),
                      _token_estimate(str(second.get("value", "")))))
    if not pairs:
        raise EpsimError(f"{file}: no conversation with two turns (ShareGPT format expected)")
    arr = np.array(pairs, dtype=np.int64)[rng.permutation(len(pairs))]
    ins = arr[:, 0]
    outs = arr[:, 1] if osl is None else np.full(len(arr), osl, dtype=np.int64)
    keep = _valid_pairs(ins, outs, params, osl is not None)
    if not keep.any():
        raise EpsimError(f"{file}: no prompt/answer pair passes the ShareGPT length filter")
    ins, outs = ins[keep], outs[keep]
    reps = math.ceil(n / len(ins))
    return np.tile(ins, reps)[:n], np.tile(outs, reps)[:n]
