"""Number formats (dsv4.formats): round trips, edge values and hand-computed fake-quant cases."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.formats import (
    E2M1_VALUES, QuantWeight, act_quant, dequant_fp8_block, dequant_mxfp4, dequant_mxfp8,
    e2m1_codes, e4m3_to_float, e8m0_to_float, fake_quant_fp4, fake_quant_fp8, float_to_e4m3,
    float_to_e8m0, hadamard_transform, pack_e2m1, pow2_ceil, quant_fp8_block, quant_mxfp4,
    quant_mxfp8, unpack_e2m1)


def _t(*vals: float) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.float32)


# ------------------------------------------------------------------------------ e8m0
def test_e8m0_every_byte_decodes_to_its_power_of_two() -> None:
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = e8m0_to_float(b.view(torch.float8_e8m0fnu))
    for i in range(255):
        assert vals[i].item() == math.ldexp(1.0, i - 127), i
    assert math.isnan(vals[255].item())
    # uint8 views decode the same way
    assert torch.equal(e8m0_to_float(b)[:255], vals[:255])


def test_e8m0_round_trip_and_round_up() -> None:
    b = torch.arange(255, dtype=torch.int32).to(torch.uint8)
    back = float_to_e8m0(e8m0_to_float(b)).view(torch.uint8)
    assert torch.equal(back, b)
    got = e8m0_to_float(float_to_e8m0(_t(0.3, 1.5, 1.0, 3.0, 2.0 ** -130, 1e-45, 3e38)))
    assert got.tolist() == [0.5, 2.0, 1.0, 4.0, 2.0 ** -127, 2.0 ** -127, 2.0 ** 127]
    assert float_to_e8m0(_t(float("nan"))).view(torch.uint8).item() == 255
    with pytest.raises(ValueError, match="non-negative"):
        float_to_e8m0(_t(-1.0))


def test_pow2_ceil_uses_exponent_bits() -> None:
    x = _t(1.0, 1.0000001, 0.75, 2.0 ** -126, 448.0, 449.0)
    assert pow2_ceil(x).tolist() == [1.0, 2.0, 1.0, 2.0 ** -126, 512.0, 512.0]


# ------------------------------------------------------------------------------ e4m3
def test_e4m3_every_byte_round_trips() -> None:
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    f = e4m3_to_float(b.view(torch.float8_e4m3fn))
    finite = ~torch.isnan(f)
    assert int(finite.sum()) == 254  # 0x7F and 0xFF are NaN in the "fn" format
    back = float_to_e4m3(f[finite]).view(torch.uint8)
    assert torch.equal(back, b[finite])
    assert f[finite].abs().max().item() == 448.0


def test_e4m3_rounding_is_nearest_even_and_saturating() -> None:
    x = _t(1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, 255.0, 500.0, -500.0, 2.4, 0.0)
    want = [1.0, 1.25, 0.0, 2.0 ** -8, 256.0, 448.0, -448.0, 2.5, 0.0]
    assert float_to_e4m3(x).to(torch.float32).tolist() == want


# ------------------------------------------------------------------------------ e2m1 / MXFP4
def test_e2m1_ties_go_to_the_even_code() -> None:
    mids = _t(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
    mags = [E2M1_VALUES[c] for c in e2m1_codes(mids).tolist()]
    assert mags == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    above = e2m1_codes(mids + 1e-3).tolist()
    assert [E2M1_VALUES[c] for c in above] == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    neg = e2m1_codes(_t(-0.1, -6.0, -100.0, 7.0)).tolist()
    assert neg == [8, 15, 15, 7]  # -0 keeps its sign bit; beyond ±6 saturates


def test_e2m1_table_matches_spec() -> None:
    assert E2M1_VALUES[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert all(E2M1_VALUES[8 + i] == -E2M1_VALUES[i] for i in range(8))
    codes = e2m1_codes(torch.tensor(E2M1_VALUES))
    assert codes.tolist()[1:8] == list(range(1, 8)) and codes.tolist()[9:] == list(range(9, 16))


def test_nibble_order_low_is_even_index() -> None:
    packed = pack_e2m1(torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8))
    assert packed.dtype == torch.int8
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x43]]
    # byte 0x9A: low nibble 0xA = -1.0 (k=0), high nibble 0x9 = -0.5 (k=1)
    raw = torch.tensor([[0x9A] * 16], dtype=torch.uint8).view(torch.int8)
    assert unpack_e2m1(raw)[0, :2].tolist() == [0xA, 0x9]
    scale = torch.tensor([[128]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2.0
    w = dequant_mxfp4(raw, scale, torch.float32)
    assert w.shape == (1, 32)
    assert w[0, :4].tolist() == [-2.0, -1.0, -2.0, -1.0]


def test_pack_unpack_round_trip_random() -> None:
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (7, 64), generator=g, dtype=torch.uint8)
    assert torch.equal(unpack_e2m1(pack_e2m1(codes)), codes)
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(codes[:, :3])


def test_mxfp4_quant_dequant() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 128, generator=g)
    packed, scale = quant_mxfp4(w)
    assert packed.shape == (16, 64) and packed.dtype == torch.int8
    assert scale.shape == (16, 4) and scale.dtype == torch.float8_e8m0fnu
    deq = dequant_mxfp4(packed, scale, torch.float32)
    # scale = 2^ceil(log2(amax/6)) per 32 inputs, so every |w/s| <= 6 and the error is at most
    # half the widest grid step (2) times the scale.
    s = e8m0_to_float(scale).repeat_interleave(32, 1)
    assert torch.all((deq - w).abs() <= s)
    amax = w.view(16, 4, 32).abs().amax(-1)
    assert torch.equal(e8m0_to_float(scale), pow2_ceil(amax * (1 / 6)))
    # idempotent: values on the grid come back exactly
    p2, s2 = quant_mxfp4(deq)
    assert torch.equal(dequant_mxfp4(p2, s2, torch.float32), deq)


def test_mxfp8_quant_dequant() -> None:
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    q, s = quant_mxfp8(w)
    deq = dequant_mxfp8(q, s, torch.float32)
    assert torch.allclose(deq, w, rtol=2 ** -4, atol=1e-3)
    q2, s2 = quant_mxfp8(deq)
    assert torch.equal(dequant_mxfp8(q2, s2, torch.float32), deq)


# ------------------------------------------------------------------------------ FP8 blocks
def test_fp8_block_hand_case_e8m0_and_fp32() -> None:
    w = torch.full((4, 4), 3.0)
    q, s = quant_fp8_block(w, block=128, scale_dtype="e8m0")
    assert s.shape == (1, 1) and s.dtype == torch.float8_e8m0fnu
    assert e8m0_to_float(s).item() == 2.0 ** -7  # 3/448 = 0.0067 -> next power of two
    assert q.to(torch.float32).unique().tolist() == [384.0]
    assert torch.equal(dequant_fp8_block(q, s, 128, torch.float32), w)
    q, s = quant_fp8_block(w, block=128, scale_dtype="fp32")
    assert s.dtype == torch.float32 and s.item() == pytest.approx(3 / 448)
    assert q.to(torch.float32).unique().tolist() == [448.0]


def test_fp8_block_ragged_shapes_and_bounds() -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(200, 130, generator=g) * torch.linspace(0.01, 10, 130)
    for sdt in ("e8m0", "fp32"):
        q, s = quant_fp8_block(w, 128, sdt)
        assert q.shape == (200, 130) and s.shape == (2, 2)
        deq = dequant_fp8_block(q, s, 128, torch.float32)
        sf = s.float() if sdt == "fp32" else e8m0_to_float(s)
        step = sf.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :130]
        # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, absolute <= 2^-10 * scale
        assert torch.all((deq - w).abs() <= w.abs() * 2 ** -4 + step * 2 ** -10)
        q2, s2 = quant_fp8_block(deq, 128, sdt)
        if sdt == "e8m0":
            assert torch.equal(dequant_fp8_block(q2, s2, 128, torch.float32), deq)
    with pytest.raises(ValueError, match=r"scale .* must have shape \[2, 2\]"):
        dequant_fp8_block(q, s[:1], 128)


# ------------------------------------------------------------------------------ fake quant
def test_act_quant_hand_case() -> None:
    x = _t(1.0, -2.0, 0.3, 56.0)
    q, s = act_quant(x, 4)
    assert s.tolist() == [0.125]  # 56/448 is exactly 2^-3
    assert q.to(torch.float32).tolist() == [8.0, -16.0, 2.5, 448.0]
    assert fake_quant_fp8(x, 4).tolist() == [1.0, -2.0, 0.3125, 56.0]
    q8, s8 = act_quant(x, 4, scale_dtype="e8m0")
    assert s8.dtype == torch.float8_e8m0fnu and e8m0_to_float(s8).tolist() == [0.125]


def test_act_quant_amax_floor_and_no_rounding_mode() -> None:
    x = torch.full((2, 8), 1e-6)
    q, s = act_quant(x, 8)
    # amax floored to 1e-4: 1e-4/448 -> 2^-22
    assert s.shape == (2, 1) and s.flatten().tolist() == [2.0 ** -22] * 2
    assert q.to(torch.float32).unique().tolist() == [4.0]  # 1e-6 / 2^-22 = 4.19 -> 4
    assert fake_quant_fp8(x, 8).unique().tolist() == [4.0 * 2.0 ** -22]
    y = _t(3.0, 1.0)
    _, s = act_quant(y, 2, scale_fmt=None)
    assert s.item() == torch.tensor(3.0 * torch.tensor(1 / 448).item()).item()
    assert fake_quant_fp8(y, 2, None)[0].item() == pytest.approx(3.0, rel=1e-6)


def test_fake_quant_fp8_keeps_dtype_and_blocks() -> None:
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    y = fake_quant_fp8(x, 128)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    q, s = act_quant(x, 128)
    assert torch.equal(y, (q.float().view(3, 2, 128) * s[..., None]).view(3, 256).bfloat16())
    with pytest.raises(ValueError, match="multiple of the block size"):
        fake_quant_fp8(x, 100)


def test_fake_quant_fp4_e8m0_hand_cases() -> None:
    assert fake_quant_fp4(_t(6.0, 1.3, -0.2, 2.6), 4).tolist() == [6.0, 1.5, -0.0, 3.0]
    ties = _t(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0)
    assert fake_quant_fp4(ties, 8).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    # amax 7 -> 7/6 -> s = 2: 7/2 = 3.5 -> 4 (tie to even) -> 8; 1/2 = 0.5 -> 1
    assert fake_quant_fp4(_t(7.0, 1.0), 2).tolist() == [8.0, 1.0]
    assert fake_quant_fp4(torch.zeros(1, 32), 32).abs().sum().item() == 0.0


def test_fake_quant_fp4_e4m3_scale_hand_case() -> None:
    # amax 2.7 -> 0.45 -> e4m3 0.4375; 2.7/0.4375 = 6.17 -> 6 -> 2.625; 1/0.4375 = 2.29 -> 2
    got = fake_quant_fp4(_t(2.7, 1.0), 2, scale_dtype="e4m3")
    assert got.tolist() == [2.625, 0.875]
    z = fake_quant_fp4(torch.zeros(16), 16, scale_dtype="e4m3")
    assert torch.equal(z, torch.zeros(16))
    with pytest.raises(ValueError, match="scale_dtype"):
        fake_quant_fp4(torch.zeros(16), 16, scale_dtype="fp32")


def test_fake_quant_fp4_matches_mxfp4_weight_quant() -> None:
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(6))
    packed, scale = quant_mxfp4(w)
    assert torch.equal(fake_quant_fp4(w, 32), dequant_mxfp4(packed, scale, torch.float32))


def test_hadamard_transform() -> None:
    h = torch.tensor([[1.0]])
    for _ in range(3):
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]]), h)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(7))
    assert torch.allclose(hadamard_transform(x), x @ h.T / math.sqrt(8), atol=1e-6)
    assert torch.allclose(hadamard_transform(hadamard_transform(x)), x, atol=1e-6)
    assert hadamard_transform(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="power of two"):
        hadamard_transform(torch.zeros(3, 6))


# ------------------------------------------------------------------------------ QuantWeight
def test_quant_weight_formats_and_validation() -> None:
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(8))
    q, s = quant_fp8_block(w, 32, "e8m0")
    qw = QuantWeight(q, s, "fp8", 32, (64, 96))
    assert torch.equal(qw.dequantize(torch.float32), dequant_fp8_block(q, s, 32, torch.float32))
    assert qw.to("cpu").shape == (64, 96) and qw.nbytes == 64 * 96 + 2 * 3
    p, s4 = quant_mxfp4(w)
    q4 = QuantWeight(p, s4, "fp4", 32, (64, 96))
    assert q4.dequantize(torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="scale shape"):
        QuantWeight(q, s[:1], "fp8", 32, (64, 96))
    with pytest.raises(ValueError, match="does not fit"):
        QuantWeight(p, s4, "fp4", 32, (64, 64))
    with pytest.raises(ValueError, match="fmt"):
        QuantWeight(q, s, "int4", 32, (64, 96))
