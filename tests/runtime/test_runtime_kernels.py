"""The runtime's kernels against hand-computed numbers and independent slow forms."""

import math

import pytest

torch = pytest.importorskip("torch")

from epsim.runtime import kernels  # noqa: E402
from epsim.runtime.reference import rounding_error, route_reference  # noqa: E402


def test_rms_norm_hand_computed():
    x = torch.tensor([[3.0, 4.0]])
    # rms = sqrt((9 + 16) / 2) = sqrt(12.5)
    out = kernels.rms_norm(x, torch.tensor([1.0, 2.0]), eps=0.0)
    r = math.sqrt(12.5)
    assert torch.allclose(out, torch.tensor([[3 / r, 8 / r]]))


def test_silu_and_mul_hand_computed():
    out = kernels.silu_and_mul(torch.tensor([[0.0, 1.0, 5.0, 7.0]]))
    assert torch.allclose(out, torch.tensor([[0.0, 7.0 / (1 + math.exp(-1))]]))


def test_rope_rotates_pairs_and_keeps_norms():
    cos, sin = kernels.rope_cos_sin(torch.tensor([0, 1]), 4, 10000.0, torch.float64)
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    out = kernels.apply_rope(x, cos, sin)
    assert torch.allclose(out[0], x[0])  # position 0: identity
    # position 1, first pair (dims 0 and 2) turns by 1 radian
    assert torch.allclose(out[1], torch.tensor([math.cos(1), 0, math.sin(1), 0],
                                               dtype=torch.float64))
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1))


def test_fp8_rows_round_trip_within_e4m3_precision():
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    q, scale = kernels.quantize_rows(x, torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn
    back = kernels.dequantize_rows(q, scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: relative rounding error at most 2**-4 of each value
    assert torch.all((back - x).abs() <= x.abs() * 2 ** -4 + scale[:, None] * 2 ** -9)
    assert torch.allclose(back.abs().amax(-1), x.abs().amax(-1), rtol=2 ** -4)


def test_kv_check_accepts_either_rounding_only_at_a_midpoint():
    fp8 = torch.float8_e4m3fn
    # amax 448 makes the row's scale 1: e4m3 holds 112 and 120 but nothing between (midpoint 116)
    exact = torch.tensor([[448.0, 116.0 - 1e-4]])
    # the reference rounds 115.9999 down to 112; fp32 sums a hair larger round it up to 120
    assert rounding_error(exact, torch.tensor([[448.0, 112.0]]), fp8) == 0.0
    below = 116.0 - exact[0, 1].item()  # 1e-4 as fp32 holds it
    assert rounding_error(exact, torch.tensor([[448.0, 120.0]]), fp8) == pytest.approx(
        below / 448)
    # a value one step further, or the other neighbour of a value off the midpoint: wrong
    assert rounding_error(exact, torch.tensor([[448.0, 128.0]]), fp8) == pytest.approx(
        (4.0 + below) / 448)
    off_midpoint = torch.tensor([[448.0, 113.0]])
    assert rounding_error(off_midpoint, torch.tensor([[448.0, 120.0]]), fp8) == pytest.approx(
        3.0 / 448)


def test_routing_hand_computed():
    # 4 experts in 2 groups of 2, keep 1 group, top-2 inside it
    logits = torch.tensor([[0.0, 0.0, 2.0, 1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0])
    ids, w = kernels.route_grouped_sigmoid(logits, bias, 2, 2, 1, 2.5, True)
    assert ids.tolist() == [[2, 3]]
    s2, s3 = 1 / (1 + math.exp(-2)), 1 / (1 + math.exp(-1))
    assert torch.allclose(w, torch.tensor([[2.5 * s2 / (s2 + s3), 2.5 * s3 / (s2 + s3)]]))
    # a bias on expert 0 and 1 flips the group choice but not the weights' source
    ids, w = kernels.route_grouped_sigmoid(logits, torch.tensor([1.0, 1.0, 0, 0]), 2, 2, 1,
                                           1.0, False)
    assert sorted(ids[0].tolist()) == [0, 1]
    assert torch.allclose(w, torch.tensor([[0.5, 0.5]]))


@pytest.mark.parametrize("seed", range(4))
def test_routing_matches_the_per_token_reference(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(24, 32, generator=g) * 3
    bias = torch.randn(32, generator=g) * 0.1
    ids, w = kernels.route_grouped_sigmoid(logits, bias, 8, 8, 4, 2.5, True)
    ref_ids, ref_w = route_reference(logits, bias, 8, 8, 4, 2.5, True)
    assert ids.tolist() == ref_ids
    assert torch.allclose(w, torch.tensor(ref_w, dtype=torch.float32), atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_moe_backends_agree_with_the_per_token_loop(seed):
    g = torch.Generator().manual_seed(seed)
    n, h, inter, slots, k = 10, 8, 6, 4, 3
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    gate_up = torch.randn(slots, h, 2 * inter, generator=g, dtype=torch.float64)
    down = torch.randn(slots, inter, h, generator=g, dtype=torch.float64)
    local = torch.randint(-1, slots, (n, k), generator=g)  # -1: the expert lives elsewhere
    weights = torch.rand(n, k, generator=g, dtype=torch.float64)
    # the loop takes expert ids directly: send non-local choices to slot 0 with weight 0
    loop = kernels.moe_per_token(x, local.clamp_min(0), torch.where(local >= 0, weights, 0.0),
                                 gate_up, down)
    assert torch.allclose(kernels.moe_sorted(x, local, weights, gate_up, down), loop)
    assert torch.allclose(kernels.moe_masked(x, local, weights, gate_up, down), loop)


def test_absorbed_mla_equals_the_expanded_form():
    g = torch.Generator().manual_seed(1)
    t, H, n, p, r, v, L = 3, 4, 5, 2, 6, 3, 7
    q_nope = torch.randn(t, H, n, generator=g, dtype=torch.float64)
    q_pe = torch.randn(t, H, p, generator=g, dtype=torch.float64)
    c = torch.randn(t, L, r, generator=g, dtype=torch.float64)
    pe = torch.randn(t, L, p, generator=g, dtype=torch.float64)
    kv_b = torch.randn(H, n + v, r, generator=g, dtype=torch.float64)
    lengths = torch.tensor([7, 4, 1])
    scale = (n + p) ** -0.5
    q_lat = torch.einsum("thn,hnr->thr", q_nope, kv_b[:, :n])
    o_lat = kernels.mla_decode_absorbed(q_lat, q_pe, c, pe, lengths, scale)
    out = torch.einsum("thr,hvr->thv", o_lat, kv_b[:, n:])
    for i in range(t):
        ctx = int(lengths[i])
        k = torch.einsum("lr,hdr->lhd", c[i, :ctx], kv_b[:, :n])
        vals = torch.einsum("lr,hdr->lhd", c[i, :ctx], kv_b[:, n:])
        s = (torch.einsum("hd,lhd->hl", q_nope[i], k) + q_pe[i] @ pe[i, :ctx].T) * scale
        want = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), vals)
        assert torch.allclose(out[i], want)
