"""Bounds on what an input file may hold, and the one JSON reader every command uses.

Every count and size epsim reads from a file (a config.json, a hardware profile, a placement, a
load file, a request trace, a benchmark result, a ShareGPT dataset, a profiler trace) is checked
against a bound here *before* anything is allocated from it, so a hostile or corrupt file is one
line and exit status 2 instead of a traceback, a MemoryError or a run that never ends
(docs/inputs.md). Each bound sits well above any real deployment, so every real file still
runs; the comment on each says why it is where it is.

:func:`parse_json` / :func:`read_json_file` is the JSON reader: errors name the line and column,
nesting is bounded by the parser's recursion limit and integers by :data:`MAX_INT_DIGITS`.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from .errors import EpsimError

# --------------------------------------------------------------------------------------------
# The bounds (docs/inputs.md lists them with the same reasons)
# --------------------------------------------------------------------------------------------

#: requests in one benchmark, result file or trace: 10x the largest public trace replayed
#: (Azure's 2023 conversation trace: 19,366 rows; ShareGPT: ~94k conversations)
MAX_PROMPTS = 10**7
#: requests in flight at once (vLLM's --max-concurrency): 10**4x the largest graph batch an
#: engine captures by default (SGLang's cuda-graph bs tops at 512)
MAX_CONCURRENCY = 10**7
#: GPUs in one deployment or one runtime world (16x the 4,096 of a 512-node cluster)
MAX_GPUS = 65536
#: sequences one rank batches in a step: 2,000x the largest engine default (512)
MAX_BATCH = 2**20
#: routed experts per MoE layer: 256x DeepSeek-V3's 256, 170x Kimi-K2's 384
MAX_EXPERTS = 2**16
#: decoder layers: 40x Qwen3-235B-A22B's 94 (the deepest shipped config)
MAX_LAYERS = 4096
#: a width in a config.json (hidden, intermediate, head counts and dims, vocab): 2**24 is 64x
#: a 262k vocabulary and 1,000x a 16,384 hidden size (Llama-3.1-405B's)
MAX_WIDTH = 2**24
#: tokens in one request (prompt or output): above the longest context of a shipped model
#: (Llama-4 Scout's 10,485,760) and 64x the next (Llama-4 Maverick's 1,048,576 is 16x less)
MAX_TOKENS = 2**24
#: a logical or physical expert id, a GPU count in a placement: the expert bound's scale
MAX_ID = MAX_EXPERTS * 64
#: a number in a hardware profile (bytes, bytes/s, FLOP/s, a table's features): 10**30 is
#: 10**15x a GPU's peak FLOP/s (~2.6e15; planted test devices go to 1e24), and products of
#: five such numbers stay far from float overflow (1.8e308; a table of 1e300 overflowed)
MAX_PROFILE_NUMBER = 1e30
#: the least positive number in a hardware profile: 10**-12 (a picosecond, a fraction of one in
#: 10**12) is far below any latency (~1e-6 s), fraction or rate a profile holds; a denormal such
#: as 1e-320 overflows the divisions by it
MIN_PROFILE_NUMBER = 1e-12
#: JSON nesting: the parser's own bound, Python's recursion limit (1,000 levels by default,
#: less the stack in use); real files nest at most ~6 levels. A deeper text is refused in one
#: line (the parser's RecursionError), never a crash
MAX_JSON_DEPTH = sys.getrecursionlimit()
#: a JSON integer's digits: 20 holds any uint64 (an id, a pointer) and a nanosecond timestamp
#: since 1970 (19 digits: Kineto's baseTimeNanoseconds); Python's own limit is 4,300 digits
#: (a ValueError), and every count read is bounded far lower below
MAX_INT_DIGITS = 20
#: request rate (req/s) and gamma burstiness: the least a benchmark can mean. A rate of 1e-6 is
#: one request every 11.6 days; a shape of 1e-3 is gaps whose coefficient of variation is ~32
#: (vLLM's burstiness 1 is Poisson). Smaller values overflow the gap draws (1/rate, 1/shape)
MIN_REQUEST_RATE = 1e-6
MIN_BURSTINESS = 1e-3
#: a CSV field's characters: Python's csv module's own default limit (131,072); a trace cell
#: is a number or a date-time of at most ~30
MAX_CSV_FIELD = 131072
#: a name given where a file may be meant (--model, --hardware, ...): 255 is the longest file
#: name Linux file systems allow (NAME_MAX)
MAX_NAME_CHARS = 255
#: load statistics: snapshots x layers x experts cells a file may hold (a dump of 10**4 windows
#: of DeepSeek-R1's 61 x 256 is 1.6e8; 1.6 GB as float64); how much of it balance may work on
#: is its work budget's (epsim/work.py: 2**16 experts a layer unless --force)
MAX_LOAD_CELLS = 2 * 10**8


def check_count(value: Any, bound: int, what: str, source: str, *, low: int = 1) -> int:
    """``value`` as an int in [low, bound]; else one line naming ``what`` and the bound."""
    if isinstance(value, bool) or not isinstance(value, int | float) or (
            isinstance(value, float) and not (math.isfinite(value) and value.is_integer())):
        raise EpsimError(f"{source}: {what} must be a whole number, got {show(value)}")
    if low == 1 and value < 1:
        raise EpsimError(f"{source}: {what} must be a positive integer, got {show(value)}")
    if not low <= value <= bound:
        raise EpsimError(f"{source}: {what} {show(value)} is outside [{low}, {bound:,}] "
                         "(docs/inputs.md)")
    return int(value)


def show(value: Any, limit: int = 40) -> str:
    """A value as a message quotes it, cut to ``limit`` characters (a hostile value may be a
    string of megabytes)."""
    text = repr(value) if not isinstance(value, int) or isinstance(value, bool) else (
        str(value) if value.bit_length() < 128 else f"an integer of ~{int(value.bit_length() * 0.30103)} digits")
    return text if len(text) <= limit else text[:limit - 3] + "..."


# --------------------------------------------------------------------------------------------
# The JSON reader
# --------------------------------------------------------------------------------------------


class _LongInteger(ValueError):
    def __init__(self, digits: int) -> None:
        super().__init__(digits)
        self.digits = digits


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _LongInteger(digits)
    return int(text)


def parse_json(text: str, source: str, kind: str = "JSON") -> Any:
    """``json.loads(text)`` with the bounds: a malformed text names the line and column; a text
    nested deeper than the parser's recursion limit, or an integer longer than
    :data:`MAX_INT_DIGITS` digits, is refused in one line. ``kind`` names what was expected
    (``"config.json"``, ``"profile JSON"``)."""
    try:
        return json.loads(text, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise EpsimError(f"{source}: malformed {kind} ({exc.msg} at line {exc.lineno} column "
                         f"{exc.colno})") from None
    except RecursionError:
        raise EpsimError(f"{source}: {kind} nested deeper than the reader allows (about "
                         f"{sys.getrecursionlimit()} levels)") from None
    except _LongInteger as exc:
        raise EpsimError(f"{source}: {kind} holds an integer of {exc.digits} digits (at most "
                         f"{MAX_INT_DIGITS})") from None


def read_json_file(path: str | os.PathLike[str], what: str, kind: str = "") -> Any:
    """Parse the JSON file at ``path`` with :func:`parse_json`; a missing or unreadable file is
    an :class:`EpsimError` naming ``what`` it should have been (e.g. ``"load file"``), a
    malformed one the ``kind`` of JSON expected (e.g. ``"grid"``) and the error's position."""
    file = Path(path)
    try:
        if not file.is_file():
            raise EpsimError(f"{what} not found: {show(str(file), 300)}")
        text = file.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise EpsimError(f"cannot read the {what} {show(str(file), 300)}: {exc.strerror}") from None
    return parse_json(text, str(file), f"{kind} JSON" if kind else "JSON")


def is_file(path: Path) -> bool:
    """``path.is_file()``, False for a name the OS refuses (too long, a NUL byte) instead of
    an OSError: such a name is then read as a shipped name, which it is not either."""
    try:
        return len(str(path)) <= 4096 and path.is_file()
    except (OSError, ValueError):
        return False


#: config.json keys that are counts or sizes -> (least, most). Read before the model is built
#: (a config of 10**9 layers would otherwise allocate them); keys absent or null are skipped
_LAYERS = (1, MAX_LAYERS)
_EXPERTS = (1, MAX_EXPERTS)
_WIDTH = (1, MAX_WIDTH)
CONFIG_BOUNDS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": _LAYERS,
    "first_k_dense_replace": (0, MAX_LAYERS),
    "num_nextn_predict_layers": (0, MAX_LAYERS),
    # a MoE layer every N layers: 0 would divide by zero
    "moe_layer_freq": _LAYERS, "decoder_sparse_step": _LAYERS,
    "n_routed_experts": _EXPERTS, "num_local_experts": _EXPERTS, "num_experts": _EXPERTS,
    "num_experts_per_tok": _EXPERTS, "n_shared_experts": (0, MAX_EXPERTS),
    "n_group": _EXPERTS, "topk_group": _EXPERTS,
    "hidden_size": _WIDTH, "intermediate_size": _WIDTH, "moe_intermediate_size": _WIDTH,
    "shared_expert_intermediate_size": (0, MAX_WIDTH),
    "num_attention_heads": _WIDTH, "num_key_value_heads": _WIDTH, "head_dim": _WIDTH,
    "qk_nope_head_dim": _WIDTH, "qk_rope_head_dim": _WIDTH, "v_head_dim": _WIDTH,
    "kv_lora_rank": _WIDTH, "q_lora_rank": _WIDTH, "vocab_size": _WIDTH,
    "max_position_embeddings": (1, MAX_TOKENS), "sliding_window": (1, MAX_TOKENS),
    # Llama-4 (under text_config): a MoE layer every N (0: none), its dense width, chunks
    "interleave_moe_layer_step": (0, MAX_LAYERS), "no_rope_layer_interval": _LAYERS,
    "intermediate_size_mlp": _WIDTH, "attention_chunk_size": (1, MAX_TOKENS),
    # DeepSeek-V3.2's lightning indexer: the tokens it selects, its heads and head width
    "index_topk": (1, MAX_TOKENS), "index_n_heads": _WIDTH, "index_head_dim": _WIDTH,
}


def check_config_bounds(cfg: Any, source: str) -> None:
    """Every count of :data:`CONFIG_BOUNDS` in range and every top-level number finite, before
    a model is built from ``cfg`` (a parsed config.json; Llama-4's ``text_config`` too)."""
    if not isinstance(cfg, dict):
        return
    if isinstance(cfg.get("text_config"), dict):
        check_config_bounds(cfg["text_config"], f"{source}: text_config")
    for key, (low, high) in CONFIG_BOUNDS.items():
        if cfg.get(key) is not None:
            check_count(cfg[key], high, key, source, low=low)
    for key, value in cfg.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise EpsimError(f"{source}: {show(key)} is {value}, not a finite number")
