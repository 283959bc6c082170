"""Cache record formats (dsv4.cache.formats): hand-checked bytes of each record kind, the
lossless round trip against the official fake quantization, and PackedRows."""

from __future__ import annotations

import pytest
import torch

from dsv4 import formats
from dsv4.cache import formats as cf
from dsv4.model import v41


def _bf16_bytes(v: float) -> list[int]:
    bits = torch.tensor([v], dtype=torch.bfloat16).view(torch.int16).item() & 0xFFFF
    return [bits & 0xFF, bits >> 8]  # little endian


def test_record_sizes_of_the_real_shapes() -> None:
    # SERVING.md §1.1–1.2: 584 B V4 record, 528 B V4.1 window, 288 B V4.1 compressed; the fp4
    # index key with e8m0 per 32 is 64 + 4 B.
    v4 = cf.v4_kv_record(512, 64)
    assert (v4.quant_dims, v4.tail_dims, v4.num_scales, v4.scale_pad) == (448, 64, 7, 1)
    assert (v4.tail_offset, v4.scale_offset, v4.record_bytes) == (448, 576, 584)
    assert cf.fp8_record(512, 32).record_bytes == 528
    assert cf.fp4_record(512, 16, "e4m3").record_bytes == 288
    assert cf.fp4_record(128, 32, "e8m0").record_bytes == 68
    # The blocks are those of the V4.1 fake-quant sites.
    assert (cf.V41_WINDOW_BLOCK, cf.V41_LATENT_BLOCK, cf.V41_INDEX_BLOCK) == (
        v41.WINDOW_KV_BLOCK, v41.LATENT_BLOCK, v41.INDEX_BLOCK)


def test_v4_record_bytes_by_hand() -> None:
    fmt = cf.v4_kv_record(128, 64)          # 64 nope (one scale) + 64 rope
    assert fmt.record_bytes == 64 + 128 + 8
    x = torch.zeros(1, 128)
    # amax 1.0: s = 2^ceil(log2(1/448)) = 2^-8 (byte 119); codes = x · 256.
    x[0, :4] = torch.tensor([1.0, -0.5, 0.0, 3 / 256])
    x[0, 64], x[0, 65], x[0, 127] = 1.0, -2.0, 0.375
    rec = fmt.pack(x)[0].tolist()
    # e4m3: 256 = 0 1111 000, −128 = 1 1110 000, 3 = 0 1000 100.
    assert rec[:4] == [0x78, 0xF0, 0x00, 0x44] and rec[4:64] == [0] * 60
    assert rec[64:66] == _bf16_bytes(1.0) and rec[66:68] == _bf16_bytes(-2.0)
    assert rec[190:192] == _bf16_bytes(0.375) and rec[68:190] == [0] * 122
    assert rec[192] == 119 and rec[193:] == [0] * 7
    back = fmt.unpack(fmt.pack(x))
    assert torch.equal(back, x)             # these values are on the grid: exact


def test_fp4_record_bytes_by_hand() -> None:
    keys = cf.fp4_record(64, 32, "e8m0")
    x = torch.zeros(1, 64)
    x[0, :3] = torch.tensor([6.0, -0.5, 1.0])   # amax 6: s = 1 (byte 127)
    rec = keys.pack(x)[0].tolist()
    # codes 6 -> 7, −0.5 -> 8|1, 1 -> 2, 0 -> 0; low nibble = even channel.
    assert rec[:2] == [0x97, 0x02] and rec[2:32] == [0] * 30
    # The all-zero second block takes the floor scale 2^-126 (byte 1).
    assert rec[32:] == [127, 1]
    assert torch.equal(keys.unpack(keys.pack(x)), x)

    latent = cf.fp4_record(32, 16, "e4m3")
    y = torch.zeros(1, 32)
    y[0, :4] = torch.tensor([3.0, -1.0, 0.75, 0.25])  # amax 3: s = e4m3(0.5) = 0 0110 000
    rec = latent.pack(y)[0].tolist()
    assert rec[:2] == [0xC7, 0x13] and rec[16] == 0x30
    assert torch.equal(latent.unpack(latent.pack(y)), y)


def test_e2m1_decode_matches_the_table() -> None:
    got = cf.e2m1_to_float(torch.arange(16, dtype=torch.uint8))
    assert got.tolist() == list(formats.E2M1_VALUES)


def _rows(dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows over many magnitudes (1e-7 .. 1e4), with a zero row and exact ties."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.logspace(-7, 4, 40)[:, None]
    x = torch.randn(40, dim, generator=g) * mag
    x[5] = 0.0
    x[6, : dim // 2] = 0.25 * torch.arange(dim // 2) % 7  # e2m1 midpoints and grid values
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_unpack_is_the_official_fake_quant(dtype: torch.dtype) -> None:
    x = _rows(128, dtype, 0)
    v4 = cf.v4_kv_record(128, 64)
    want = torch.cat((formats.fake_quant_fp8(x[:, :64], 64), x[:, 64:].to(torch.bfloat16)
                      .to(dtype)), dim=-1)
    assert torch.equal(v4.unpack(v4.pack(x), dtype), want)
    cases = [(cf.fp8_record(128, 32), formats.fake_quant_fp8(x, 32)),
             (cf.fp4_record(128, 16, "e4m3"), formats.fake_quant_fp4(x, 16, "e4m3")),
             (cf.fp4_record(128, 32, "e8m0"), formats.fake_quant_fp4(x, 32, "e8m0"))]
    for fmt, want in cases:
        got = fmt.unpack(fmt.pack(x), dtype)
        assert got.dtype == dtype and torch.equal(got, want), fmt.name


def test_pack_handles_leading_dims_and_rejects_bad_shapes() -> None:
    fmt = cf.fp8_record(64, 32)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1))
    rec = fmt.pack(x)
    assert rec.shape == (2, 3, fmt.record_bytes) and rec.dtype == torch.uint8
    assert torch.equal(fmt.unpack(rec), fmt.unpack(fmt.pack(x.reshape(6, 64))).view(2, 3, 64))
    with pytest.raises(ValueError, match="64 channels"):
        fmt.pack(torch.zeros(2, 32))
    with pytest.raises(ValueError, match=r"uint8 \[\.\.\., 66\]"):
        fmt.unpack(torch.zeros(2, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of the block"):
        cf.v4_kv_record(128, 32)              # 96 nope channels, block 64
    with pytest.raises(ValueError, match="index_head_dim"):
        cf.cache_formats(type("Cfg", (), dict(head_dim=100, rope_head_dim=64, index_head_dim=64,
                                              is_v41=False))())


def test_packed_rows_gathers_and_dequantizes_only_the_asked_rows() -> None:
    fmt = cf.v4_kv_record(128, 64)
    x = torch.randn(10, 128, generator=torch.Generator().manual_seed(2))
    rows = cf.PackedRows(fmt.pack(x), fmt)
    assert rows.shape == (10, 128) and rows.dim() == 2 and rows.dtype == torch.float32
    idx = torch.tensor([7, 0, 7])
    assert torch.equal(rows.index_select(0, idx), fmt.unpack(fmt.pack(x[idx])))
    with pytest.raises(ValueError, match="uint8"):
        cf.PackedRows(torch.zeros(3, 128), fmt)
    # encode / view helpers: plain rows pass through in the pool dtype.
    assert cf.encode_rows(x, None, torch.bfloat16).dtype == torch.bfloat16
    assert cf.rows_view(x, None) is x
    assert isinstance(cf.rows_view(fmt.pack(x), fmt), cf.PackedRows)
