"""DeepSeek-V3 blockwise FP8 reference (moerl.precision.fp8) against HAND-WORKED values.

E4M3 facts used below (OCP FP8 spec): max 448; in [2^e, 2^(e+1)) the step is 2^(e-3); subnormals are
multiples of 2^-9; the cast rounds to nearest, ties to even. Scales are chosen so that ``amax / 448``
is a power of two (amax = 7 * 2^k gives 2^(k-6)) wherever the hand computation must be exact.
"""

from __future__ import annotations

import math

import pytest
import torch

from moerl.precision.fp8 import (AMAX_FLOOR, block_scaled_gemm, dequantize_activation, dequantize_weight,
                                 quantize_activation, quantize_weight)


def f32(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_activation_tile_hand_worked():
    # amax 7 -> s = 7/448 = 1/64; x/s = 448, -224, 64, 6.4; 6.4 lies in [4, 8) (step 0.5): 6.5
    q, s = quantize_activation(f32([[7.0, -3.5, 1.0, 0.1]]), block=4)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.tolist() == [[1 / 64]]
    assert q.float().tolist() == [[448.0, -224.0, 64.0, 6.5]]
    assert dequantize_activation(q, s, block=4).tolist() == [[7.0, -3.5, 1.0, 6.5 / 64]]


def test_activation_ragged_last_tile_has_its_own_scale():
    # K = 6 with 1x4 tiles: tiles [7, -3.5, 1, 0.1] and [0.4375, -0.1] (ragged, 2 wide).
    # tile 1: amax 0.4375 = 7/16 -> s = 1/1024; -0.1 * 1024 = -102.4 in [64, 128) (step 8): -104
    q, s = quantize_activation(f32([[7.0, -3.5, 1.0, 0.1, 0.4375, -0.1]]), block=4)
    assert q.shape == (1, 6) and s.shape == (1, 2)
    assert s.tolist() == [[1 / 64, 1 / 1024]]
    assert q.float().tolist() == [[448.0, -224.0, 64.0, 6.5, 448.0, -104.0]]
    assert dequantize_activation(q, s, block=4)[0, 4:].tolist() == [0.4375, -104 / 1024]


def test_pow2_scale_rounds_up():
    # amax 4 -> 4/448 = 2^-6.807 -> UE8M0 rounds UP to 2^-6 = 1/64: x * 64 = 64, -128, 256, 32 (exact,
    # 256 < 448: the power-of-two scale gives up part of the range so the scale is a pure exponent)
    q, s = quantize_activation(f32([[1.0, -2.0, 4.0, 0.5]]), block=4, pow2=True)
    assert s.tolist() == [[1 / 64]]
    assert q.float().tolist() == [[64.0, -128.0, 256.0, 32.0]]
    assert dequantize_activation(q, s, block=4).tolist() == [[1.0, -2.0, 4.0, 0.5]]
    # without pow2 the same tile uses the whole range: s = 4/448, 4 -> 448
    q2, s2 = quantize_activation(f32([[1.0, -2.0, 4.0, 0.5]]), block=4)
    assert q2.float().tolist() == [[112.0, -224.0, 448.0, 56.0]]
    assert s2.item() == pytest.approx(4 / 448, rel=1e-7)


def test_all_zero_block_scale_is_positive_and_finite():
    q, s = quantize_activation(torch.zeros(1, 4), block=4)
    assert s.item() == pytest.approx(AMAX_FLOOR / 448, rel=1e-6) and s.item() > 0
    assert q.float().tolist() == [[0.0] * 4]
    # pow2: 1e-4 / 448 = 2.23e-7 lies in (2^-23, 2^-22] -> 2^-22
    _, sp = quantize_activation(torch.zeros(1, 4), block=4, pow2=True)
    assert sp.item() == 2.0 ** -22
    wq, ws = quantize_weight(torch.zeros(3, 3), block_size=(2, 2))
    assert bool(torch.isfinite(ws).all()) and bool((ws > 0).all())
    assert dequantize_weight(wq, ws, (2, 2)).abs().sum().item() == 0.0


def test_one_huge_value_crushes_its_tile_only():
    # tile [1000, 1, 0.01, -1] | [1, 0.5, 0.25, -1]: s0 = 1000/448 = 2.2321...
    # 1/s0 = 0.448 in [0.25, 0.5) (step 1/32): 0.4375; 0.01/s0 = 0.00448 is subnormal (multiples of
    # 2^-9 = 0.001953): 2 * 2^-9 = 0.00390625; the second tile (amax 1) keeps its own fine scale.
    x = f32([[1000.0, 1.0, 0.01, -1.0, 1.0, 0.5, 0.25, -1.0]])
    q, s = quantize_activation(x, block=4)
    assert q.float()[0, :4].tolist() == [448.0, 0.4375, 0.00390625, -0.4375]
    assert s[0, 0].item() == pytest.approx(1000 / 448, rel=1e-7)
    assert q.float()[0, 4:].tolist() == [448.0, 224.0, 112.0, -448.0]
    back = dequantize_activation(q, s, block=4)
    assert back[0, 1].item() == pytest.approx(0.4375 * 1000 / 448, rel=1e-6)  # 0.9766: 2.3% off
    assert back[0, 4:].tolist() == pytest.approx([1.0, 0.5, 0.25, -1.0], rel=1e-6)


def test_weight_blocks_hand_worked_ragged_3x3():
    # 2x2 blocks over [3, 3]: grid [2, 2]; block (0,0) amax 7 -> 1/64; block (0,1) = [0.4375, 0]^T ->
    # 1/1024; blocks (1,0), (1,1) (the ragged row 2) all zero -> AMAX_FLOOR / 448
    w = f32([[7.0, 1.0, 0.4375], [-3.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    q, s = quantize_weight(w, block_size=(2, 2))
    assert q.shape == (3, 3) and s.shape == (2, 2)
    assert s[0].tolist() == [1 / 64, 1 / 1024]
    assert s[1].tolist() == pytest.approx([AMAX_FLOOR / 448] * 2, rel=1e-6)
    assert q.float().tolist() == [[448.0, 64.0, 448.0], [-224.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert dequantize_weight(q, s, (2, 2)).tolist() == w.tolist()
    assert dequantize_weight(q, s, (2, 2), dtype=torch.bfloat16).dtype == torch.bfloat16


def test_weight_128_blocks_match_a_brute_force_per_block_loop():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * 0.02
    w[5, 7] = 3.0  # one huge value in block (0, 0)
    w[256:, 128:] = 0.0  # the ragged corner block (44 x 72) all zero
    q, s = quantize_weight(w)
    assert s.shape == (3, 2)  # ceil(300/128), ceil(200/128)
    for i in range(3):
        for j in range(2):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            sc = max(blk.abs().max().item(), AMAX_FLOOR) / 448
            assert s[i, j].item() == pytest.approx(sc, rel=1e-6)
            ref = (blk / s[i, j]).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert torch.equal(q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].view(torch.uint8), ref.view(torch.uint8))
    assert s[0, 0].item() == pytest.approx(3.0 / 448, rel=1e-6)
    # element bound: |w - q*s| <= half a step = 2^-4 |w| (normal range) or 2^-10 s (subnormal range)
    err = (dequantize_weight(q, s) - w).abs()
    bound = torch.maximum(w.abs() * 2.0 ** -4, s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200] * 2.0 ** -10)
    assert bool((err <= bound * (1 + 1e-6)).all())


def test_block_scaled_gemm_hand_worked():
    # y = x @ w.T with 1x2 tiles / 2x2 blocks, K = 4 (two K-blocks):
    # x = [7, 1 | 0.4375, 0.4375]: scales 1/64 | 1/1024, q = [448, 64 | 448, 448]
    # w row 0 = [1, 0 | 0.4375, 0.4375], row 1 = [0, -7 | 0, 0]: block scales [[1/64, 1/1024]],
    # q = [[64, 0 | 448, 448], [0, -448 | 0, 0]]
    # K-block 0: [448*64, 64*-448] * (1/64)(1/64) = [7, -7]; K-block 1: [2 * 448 * 448, 0] / 1024^2
    # = [0.3828125, 0]  ->  y = [7.3828125, -7]
    xq, xs = quantize_activation(f32([[7.0, 1.0, 0.4375, 0.4375]]), block=2)
    wq, ws = quantize_weight(f32([[1.0, 0.0, 0.4375, 0.4375], [0.0, -7.0, 0.0, 0.0]]), block_size=(2, 2))
    assert ws.tolist() == [[1 / 64, 1 / 1024]]
    y = block_scaled_gemm(xq, xs, wq, ws, block=2)
    assert y.dtype == torch.float32 and y.tolist() == [[7.3828125, -7.0]]


def test_block_scaled_gemm_128_matches_dequantised_matmul():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 300, generator=g), torch.randn(200, 300, generator=g) * 0.05
    xq, xs = quantize_activation(x)
    wq, ws = quantize_weight(w)
    y = block_scaled_gemm(xq, xs, wq, ws, out_dtype=torch.bfloat16)
    ref = dequantize_activation(xq, xs).double() @ dequantize_weight(wq, ws).double().T
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), ref, rtol=2 ** -8, atol=1e-3)  # bf16 output rounding
    # vs unquantised: each operand is off by at most 2^-4 relative (half an e4m3 step; these values
    # stay out of the subnormal range but for a few, covered by the 1e-3 slack), so
    # |y - x @ w.T| <= (2 * 2^-4 + 2^-8) * sum_k |x_k| |w_k|
    exact = x.double() @ w.double().T
    bound = (2 * 2 ** -4 + 2 ** -8) * (x.abs().double() @ w.abs().double().T) + 1e-3
    assert bool(((block_scaled_gemm(xq, xs, wq, ws).double() - exact).abs() <= bound).all())


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_weight(f32([[float("nan"), 1.0]]))
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight(torch.ones(2, 2, 2))
    with pytest.raises(ValueError, match="weight_scale_inv shape"):
        dequantize_weight(torch.zeros(3, 3, dtype=torch.float8_e4m3fn), torch.ones(1, 1), (2, 2))
    with pytest.raises(ValueError, match="block"):
        quantize_activation(torch.ones(2, 4), block=0)


def test_round_trip_error_of_random_weights_vs_bf16(capsys):
    """Relative Frobenius error of quantise-dequantise on random N(0, 0.02) weights: FP8 128x128 blocks
    (amax/448 and pow2 scales) against a plain bf16 cast; printed for the README."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(1024, 1024, generator=g) * 0.02
    norm = w.norm().item()
    bf16 = (w.to(torch.bfloat16).float() - w).norm().item() / norm
    fp8 = (dequantize_weight(*quantize_weight(w)) - w).norm().item() / norm
    fp8p2 = (dequantize_weight(*quantize_weight(w, pow2=True)) - w).norm().item() / norm
    with capsys.disabled():
        print(f"\nround-trip relative error, 1024x1024 N(0, 0.02): bf16 {bf16:.2e}, fp8 128x128 {fp8:.2e}, "
              f"fp8 pow2 {fp8p2:.2e} (fp8/bf16 = {fp8 / bf16:.1f}x)")
    # bf16 keeps 8 significant bits (rel. rounding error ~ 2^-9 / sqrt(3) in RMS), e4m3 keeps 4 (~2^-5 / sqrt(3))
    assert 2 ** -10 < bf16 < 2 ** -8
    assert 2 ** -7 < fp8 < 2 ** -4 and math.isfinite(fp8p2) and fp8 <= fp8p2 < 2 ** -4
