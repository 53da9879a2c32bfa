"""Storage sizes of the numeric formats epsim accounts for.

``bytes_per_element`` is what one stored value costs, including the scales of block-quantised
formats: DeepSeek's FP8 weights carry one fp32 scale per 128x128 block, MXFP4 (GPT-OSS experts)
one 8-bit scale per 32 values.
"""

from __future__ import annotations

from .errors import EpsimError

#: bytes per stored element, scales included
BYTES_PER_ELEMENT: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "fp8_block128": 1.0 + 4.0 / (128 * 128),  # e4m3 + fp32 scale per 128x128 block
    "fp8_token128": 1.0 + 4.0 / 128,  # e4m3 activations + fp32 scale per 128 values
    "mxfp4": 0.5 + 1.0 / 32,  # 4-bit values + e8m0 scale per 32 values
}

#: the dtype whose peak FLOP/s a matmul on this storage format runs at
COMPUTE_DTYPE: dict[str, str] = {
    "fp32": "fp32",
    "bf16": "bf16",
    "fp16": "fp16",
    "fp8": "fp8",
    "fp8_block128": "fp8",
    "fp8_token128": "fp8",
    "mxfp4": "bf16",  # MI300X/H100 have no FP4 units: MXFP4 weights are dequantised to bf16
}


def bytes_per_element(dtype: str) -> float:
    """Bytes one stored element of ``dtype`` costs (scales included)."""
    try:
        return BYTES_PER_ELEMENT[dtype]
    except KeyError:
        raise EpsimError(
            f"unknown dtype {dtype!r}; known: {', '.join(sorted(BYTES_PER_ELEMENT))}"
        ) from None
