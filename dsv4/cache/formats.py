"""Cache record formats: the pools of ``kv_cache_dtype="fp8"`` in the official low-precision
layouts (spec §2.5, §3.6–3.8, §4.2–4.5; SERVING.md §1.1–1.2).

A record is one cache row (a window position, a compressed entry or an index key) stored as
bytes; a pool of records is one ``uint8`` tensor ``[..., record_bytes]``, so paging, copies and
slot resets treat it like any other pool, and a row index addresses one whole record.  Layout
of a record, in this order:

* the quantized channels ``0 .. quant_dims−1``: e4m3 codes (one byte each), or e2m1 codes two
  per byte (the LOW nibble is the even channel, as the MXFP4 weights);
* a bf16 tail (the remaining ``dim − quant_dims`` channels: the V4 RoPE part), little endian;
* one scale per ``block`` quantized channels: e8m0 bytes (``2^(b−127)``) or e4m3 bytes;
* pad bytes (V4 only: the 7 scales fill an 8-byte slot).

The formats (``cache_formats``):

=================  =======================================================  ===============
pool               record                                                   bytes (real)
=================  =======================================================  ===============
V4 window + comp.  448 e4m3 nope, 64 bf16 rope, 7 e8m0 (per 64), 1 pad      584 (hd 512)
V4.1 window        512 e4m3, 16 e8m0 (per 32)                               528
V4.1 compressed    512 e2m1 (256 B), 32 e4m3 scales (per 16)                288
index keys (both)  128 e2m1 (64 B), 4 e8m0 (per 32)                         68 (dI 128)
=================  =======================================================  ===============

The index keys keep the reference's own format (fp4 + e8m0 per 32, after the V4 Hadamard
rotation): storing them is then lossless, and 68 B is half of vLLM's Hopper form (fp8 + an fp32
scale, 132 B), which would re-round the fp4 values.  Records are per row and contiguous (not
FlashMLA's block-interleaved scales): no kernel here needs that layout, and a row index then
addresses a record in every pool.

Quantization on write is exactly the official fake quantization (``dsv4.formats``
``fake_quant_fp8`` / ``fake_quant_fp4``: same amax floors, same power-of-two or e4m3 scales,
same round-to-nearest-even), so ``unpack(pack(x)) == fake_quant(x)`` bit for bit and storing
records in numerics "official" loses nothing.  Every function is free of host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dsv4 import formats as _fmt
from dsv4.config import ModelConfig

__all__ = ["RECORD_DTYPE", "RecordFormat", "CacheFormats", "PackedRows", "cache_formats",
           "v4_kv_record", "fp8_record", "fp4_record", "encode_rows", "rows_view",
           "is_record_dtype", "e2m1_to_float", "V4_NOPE_BLOCK", "V4_INDEX_BLOCK",
           "V41_WINDOW_BLOCK", "V41_LATENT_BLOCK", "V41_INDEX_BLOCK"]

# The HybridCache storage dtype that selects record pools (kv_cache_dtype "fp8").
RECORD_DTYPE = torch.float8_e4m3fn

# Blocks of the official quantization sites (spec §3.6 item 2, §3.7, §3.8, §4.2, §4.3, §4.5).
V4_NOPE_BLOCK = 64       # V4 window / compressed nope: e4m3, ue8m0 per 64
V4_INDEX_BLOCK = 32      # V4 index keys: e2m1, ue8m0 per 32 (after the Hadamard rotation)
V41_WINDOW_BLOCK = 32    # V4.1 window: e4m3 over all channels, ue8m0 per 32
V41_LATENT_BLOCK = 16    # V4.1 compressed latent: e2m1, e4m3 scale per 16
V41_INDEX_BLOCK = 32     # V4.1 index keys: e2m1, ue8m0 per 32

_QUANTS = ("fp8", "fp4")
_SCALES = ("e8m0", "e4m3")


def is_record_dtype(dtype: torch.dtype) -> bool:
    """True when a cache ``dtype`` asks for record pools (kv_cache_dtype "fp8")."""
    return dtype == RECORD_DTYPE


@dataclass(frozen=True)
class RecordFormat:
    """Byte layout of one cache record (see the module docstring).

    ``dim`` logical channels; the first ``quant_dims`` are quantized (``quant`` "fp8": e4m3,
    "fp4": e2m1) with one ``scale`` ("e8m0" or "e4m3") per ``block`` channels, the rest are kept
    as bf16; ``scale_pad`` bytes follow the scales.
    """

    name: str
    dim: int
    quant: str
    quant_dims: int
    block: int
    scale: str
    scale_pad: int = 0

    def __post_init__(self) -> None:
        if self.quant not in _QUANTS or self.scale not in _SCALES:
            raise ValueError(f"RecordFormat {self.name}: quant {self.quant!r} / scale "
                             f"{self.scale!r} not supported; allowed {_QUANTS} / {_SCALES}")
        if not 0 < self.quant_dims <= self.dim or self.block <= 0 \
                or self.quant_dims % self.block:
            raise ValueError(f"RecordFormat {self.name}: the {self.quant_dims} quantized channels "
                             f"(of {self.dim}) must be a positive multiple of the block "
                             f"{self.block}")
        if self.quant == "fp4" and self.quant_dims % 2:
            raise ValueError(f"RecordFormat {self.name}: fp4 needs an even number of channels; "
                             f"got {self.quant_dims}")
        if self.tail_dims and self.tail_offset % 2:
            raise ValueError(f"RecordFormat {self.name}: the bf16 tail would sit at the odd byte "
                             f"{self.tail_offset}")

    # ------------------------------------------------------------------ layout
    @property
    def tail_dims(self) -> int:
        """Channels kept as bf16 after the quantized ones."""
        return self.dim - self.quant_dims

    @property
    def payload_bytes(self) -> int:
        """Bytes of the quantized codes."""
        return self.quant_dims if self.quant == "fp8" else self.quant_dims // 2

    @property
    def tail_offset(self) -> int:
        """Byte offset of the bf16 tail."""
        return self.payload_bytes

    @property
    def num_scales(self) -> int:
        return self.quant_dims // self.block

    @property
    def scale_offset(self) -> int:
        """Byte offset of the first scale."""
        return self.payload_bytes + 2 * self.tail_dims

    @property
    def record_bytes(self) -> int:
        return self.scale_offset + self.num_scales + self.scale_pad

    # ------------------------------------------------------------------ encode / decode
    def pack(self, x: Tensor) -> Tensor:
        """Rows ``x`` [..., dim] (any float dtype) -> records uint8 [..., record_bytes].

        The quantized channels round exactly as the official fake quantization does.
        """
        if x.shape[-1] != self.dim:
            raise ValueError(f"RecordFormat {self.name}: rows must have {self.dim} channels; "
                             f"found shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        nq = self.quant_dims
        out = torch.zeros(*lead, self.record_bytes, dtype=torch.uint8, device=x.device)
        if self.quant == "fp8":
            codes, scale_bytes = _quant_fp8(x[..., :nq], self.block)
            out[..., :nq] = codes.view(torch.uint8)
        else:
            codes, scale_bytes = _quant_fp4(x[..., :nq], self.block, self.scale)
            out[..., :nq // 2] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        if self.tail_dims:
            tail = x[..., nq:].to(torch.bfloat16).contiguous().view(torch.uint8)
            out[..., self.tail_offset:self.scale_offset] = tail
        out[..., self.scale_offset:self.scale_offset + self.num_scales] = scale_bytes
        return out

    def unpack(self, records: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """Records uint8 [..., record_bytes] -> rows [..., dim] in ``dtype`` (exact in bf16 and
        fp32: every stored value is a small-mantissa number times a power of two or an e4m3)."""
        if records.dtype != torch.uint8 or records.shape[-1] != self.record_bytes:
            raise ValueError(f"RecordFormat {self.name}: records must be uint8 [..., "
                             f"{self.record_bytes}]; found {records.dtype} "
                             f"{tuple(records.shape)}")
        nq, nb = self.quant_dims, self.num_scales
        sbytes = records[..., self.scale_offset:self.scale_offset + nb]
        if self.scale == "e8m0":
            scales = _fmt.e8m0_to_float(sbytes)
        else:
            scales = sbytes.view(torch.float8_e4m3fn).to(torch.float32)
        if self.quant == "fp8":
            vals = records[..., :nq].view(torch.float8_e4m3fn).to(torch.float32)
        else:
            vals = e2m1_to_float(_fmt.unpack_e2m1(records[..., :nq // 2]))
        q = (vals.unflatten(-1, (nb, self.block)) * scales[..., None]).flatten(-2)
        if self.tail_dims:
            tail = records[..., self.tail_offset:self.scale_offset].contiguous()
            q = torch.cat((q, tail.view(torch.bfloat16).to(torch.float32)), dim=-1)
        return q.to(dtype)


def e2m1_to_float(codes: Tensor) -> Tensor:
    """4-bit e2m1 codes (uint8 0..15, sign in bit 3) -> float32, built from the fp32 bits (no
    table: no host-to-device copy)."""
    c = codes.to(torch.int32)
    mag = c & 7
    e, m = mag >> 1, mag & 1
    normal = (((e + 126) << 23) | (m << 22)).view(torch.float32)   # 2^(e−1)·(1 + m/2)
    v = torch.where(e == 0, m.to(torch.float32) * 0.5, normal)
    return torch.where((c & 8) != 0, -v, v)


def _quant_fp8(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """e4m3 codes and e8m0 scale bytes, as ``formats.fake_quant_fp8(x, block)`` rounds."""
    xb = x.to(torch.float32).unflatten(-1, (x.shape[-1] // block, block))
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(_fmt._FP8_AMAX_FLOOR)
    s = _fmt.pow2_ceil(amax * _fmt._E4M3_MAX_INV)
    codes = _fmt.float_to_e4m3(xb / s).flatten(-2)
    return codes, _pow2_byte(s.squeeze(-1))


def _quant_fp4(x: Tensor, block: int, scale: str) -> tuple[Tensor, Tensor]:
    """e2m1 codes (uint8 [..., n]) and scale bytes, as ``formats.fake_quant_fp4`` rounds."""
    xb = x.to(torch.float32).unflatten(-1, (x.shape[-1] // block, block))
    amax = xb.abs().amax(-1, keepdim=True)
    if scale == "e8m0":
        s = _fmt.pow2_ceil(amax.clamp_min(_fmt._FP4_AMAX_FLOOR_E8M0) * _fmt._E2M1_MAX_INV)
        scale_bytes = _pow2_byte(s.squeeze(-1))
    else:
        s8 = _fmt.float_to_e4m3(amax.clamp_min(_fmt._FP4_AMAX_FLOOR_E4M3) * _fmt._E2M1_MAX_INV)
        s = s8.to(torch.float32)
        scale_bytes = s8.squeeze(-1).view(torch.uint8)
    codes = _fmt.e2m1_codes((xb / s).clamp(-_fmt.E2M1_MAX, _fmt.E2M1_MAX)).flatten(-2)
    return codes, scale_bytes


def _pow2_byte(s: Tensor) -> Tensor:
    """The e8m0 byte of normal powers of two (their fp32 exponent field); no host sync, unlike
    ``formats.float_to_e8m0``'s sign check."""
    return ((s.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


# ---------------------------------------------------------------------------- the formats
def v4_kv_record(head_dim: int, rope_dim: int) -> RecordFormat:
    """V4 window / compressed KV (spec §3.6 item 2, §3.7): the nope channels e4m3 with a ue8m0
    scale per 64, the RoPE tail bf16, the scales padded to a multiple of 8 bytes (584 B at 512)."""
    nope = head_dim - rope_dim
    n_scales = nope // V4_NOPE_BLOCK
    return RecordFormat("fp8_ds_mla", head_dim, "fp8", nope, V4_NOPE_BLOCK, "e8m0",
                        scale_pad=-n_scales % 8)


def fp8_record(dim: int, block: int) -> RecordFormat:
    """Every channel e4m3 with a ue8m0 scale per ``block`` (V4.1 window, 528 B at 512/32)."""
    return RecordFormat(f"fp8_e8m0_b{block}", dim, "fp8", dim, block, "e8m0")


def fp4_record(dim: int, block: int, scale: str) -> RecordFormat:
    """Every channel e2m1 with an ``scale`` ("e8m0" / "e4m3") per ``block``: V4.1 compressed
    latent (e4m3 / 16: 288 B at 512) and the index keys (e8m0 / 32: 68 B at 128)."""
    return RecordFormat(f"fp4_{scale}_b{block}", dim, "fp4", dim, block, scale)


@dataclass(frozen=True)
class CacheFormats:
    """The record format of each cache kind of a model."""

    window: RecordFormat
    compressed: RecordFormat
    index_keys: RecordFormat


def cache_formats(cfg: ModelConfig) -> CacheFormats:
    """Record formats of ``cfg``'s pools; ValueError when its dims do not fit the blocks."""
    hd, rd, di = cfg.head_dim, cfg.rope_head_dim, cfg.index_head_dim
    try:
        if cfg.is_v41:
            return CacheFormats(fp8_record(hd, V41_WINDOW_BLOCK),
                                fp4_record(hd, V41_LATENT_BLOCK, "e4m3"),
                                fp4_record(di, V41_INDEX_BLOCK, "e8m0"))
        kv = v4_kv_record(hd, rd)
        return CacheFormats(kv, kv, fp4_record(di, V4_INDEX_BLOCK, "e8m0"))
    except ValueError as e:
        raise ValueError(f"kv_cache_dtype 'fp8': the model's head_dim={hd}, rope_head_dim={rd}, "
                         f"index_head_dim={di} do not fit the official record blocks: {e}") \
            from None


# ---------------------------------------------------------------------------- rows for the ops
class PackedRows:
    """A flat record pool seen by the ops as ``N`` logical rows of ``fmt.dim`` channels.

    The torch twins use it like a [N, dim] tensor: ``shape``, ``dim()``, ``device`` and
    ``index_select(0, rows)``, which gathers only the requested records and dequantizes them
    (fp32), so no step ever dequantizes a whole pool.  The Triton kernels read ``data`` in
    place (``dsv4.ops.triton_attn``).
    """

    def __init__(self, data: Tensor, fmt: RecordFormat) -> None:
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != fmt.record_bytes:
            raise ValueError(f"PackedRows: {fmt.name} records must be uint8 [N, "
                             f"{fmt.record_bytes}]; found {data.dtype} {tuple(data.shape)}")
        self.data = data
        self.fmt = fmt

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.fmt.dim))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the rows ``index_select`` returns."""
        return torch.float32

    def dim(self) -> int:
        return 2

    def index_select(self, dim: int, index: Tensor) -> Tensor:
        """Rows ``index`` (1-D) dequantized: [len(index), fmt.dim] float32."""
        if dim != 0:
            raise ValueError(f"PackedRows.index_select: only dim 0 (rows); got {dim}")
        return self.fmt.unpack(self.data.index_select(0, index))

    def __repr__(self) -> str:
        return f"PackedRows({self.fmt.name}, rows={self.data.shape[0]})"


def encode_rows(rows: Tensor, fmt: RecordFormat | None, dtype: torch.dtype) -> Tensor:
    """What a pool stores for ``rows`` [..., d]: records (``fmt``) or the rows cast to ``dtype``."""
    return rows.to(dtype) if fmt is None else fmt.pack(rows)


def rows_view(flat: Tensor, fmt: RecordFormat | None) -> Tensor | PackedRows:
    """The flat pool ``flat`` [N, width] as the ops' row source (a tensor, or PackedRows)."""
    return flat if fmt is None else PackedRows(flat, fmt)
