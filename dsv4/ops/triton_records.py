"""Triton kernel of the cache writes: encode rows into cache records (``dsv4.cache.formats``) and
scatter them into pool rows, one launch (same signatures as ``dsv4/ops/torch_records.py``).

Before, a decode step's window write was ``RecordFormat.pack`` (~25 small torch kernels: block
amax, power-of-two scale, divide, e4m3 cast, byte views, the bf16 tail, the scale bytes) plus a
gather and an ``index_copy_``.  Here one program encodes a tile of rows and stores each record
straight into its pool row:

* the quantized channels: per ``block`` channels ``amax`` (with the official floor), the scale
  (``2^ceil(log2(amax/max))`` read off the fp32 bits, or for e4m3 scales ``e4m3(amax/6)``),
  ``x / s`` (IEEE division), clamp, round to nearest even onto the e4m3 / e2m1 grid, and the
  code bytes built from the fp32 bits (e2m1 codes two per byte, low nibble first);
* the bf16 tail, rounded to nearest even and stored as two little-endian bytes;
* the scale bytes (e8m0: the exponent field; e4m3: the code) and zero pad bytes.

Every step is exact or correctly rounded in fp32, as in the twin, so the bytes are identical to
``RecordFormat.pack`` (the tests compare them byte for byte).  Plain pools (``fmt`` None) store
the rows cast to the pool's dtype (bf16 rounded to nearest even).  Unsupported inputs (pool or
row dtypes other than fp32/bf16(/fp16 rows), fp8 records with e4m3 scales, blocks that are not
powers of two) run the torch twin.

``hadamard=True`` (the V4 indexer compressor's index keys) rotates each row first, in the same
program: the butterflies of ``formats.hadamard_transform`` in fp32 (``triton_index._hadamard``,
the same pairing and order), times fp32 ``d^-0.5``, rounded to the rows' dtype as the twin's
output cast rounds; rows that are not fp32/bf16 or a width that is not a power of two run the
twin.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import triton
import triton.language as tl

from dsv4.cache.formats import RecordFormat
from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.specialize import lengths
from dsv4.ops.torch_records import _check_rows, check_read_args, check_write_args
from dsv4.ops.triton_attn import load_rows, record_meta
from dsv4.ops.triton_dense import (round_to_bf16, round_to_e4m3, store_rne,
                                   torch_twin_off_gpu)
from dsv4.ops.triton_index import _hadamard

__all__ = ["encode_records", "write_records", "read_records", "record_tile",
           "record_constexprs"]

# Elements per program tile (rows × padded width).
_TILE_ELEMS = 4096
_ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PLAIN_POOL_DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _e4m3_byte(q):
    """fp32 values on the e4m3fn grid (|q| <= 448) -> their e4m3fn bytes (int32 0..255)."""
    bits = q.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    abits = bits & 0x7FFFFFFF
    a = abits.to(tl.float32, bitcast=True)
    # Normal: exponent re-biased 127 -> 7, the top 3 mantissa bits; subnormal: multiples of 2^-9.
    normal = ((((abits >> 23) & 0xFF) - 120) << 3) | ((abits >> 20) & 7)
    sub = (a * 512.0).to(tl.int32)
    return tl.where(a >= 0.015625, normal, sub) | sign


@triton.jit
def _e2m1_code(v):
    """e2m1 codes (int32, sign in bit 3) of fp32 ``v`` (|v| <= 6): round to nearest, ties to the
    even code, the thresholds of ``formats.e2m1_codes``."""
    a = tl.abs(v)
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
           + (a > 5.0).to(tl.int32))
    mag = tl.where(a != a, 7, mag)                         # NaN -> the largest magnitude
    sign = (v.to(tl.int32, bitcast=True) >> 28) & 8
    return mag | sign


@triton.jit
def _pow2_scale_bits(t):
    """Biased exponent b of ``2^ceil(log2(t))`` (the reference's ``fast_round_scale``), clamped
    to the normal range 1..254 like ``formats.pow2_ceil``."""
    bits = t.to(tl.int32, bitcast=True)
    b = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.minimum(tl.maximum(b, 1), 254)


@triton.jit(**lengths("M"))
def _write_records_kernel(rows_ptr, src_ptr, dst_ptr, pool_ptr, M, stride_r, stride_p,
                          had_scale,
                          HAS_SRC: tl.constexpr, HAS_DST: tl.constexpr,
                          HADAMARD: tl.constexpr, LOG2_D: tl.constexpr,
                          PLAIN: tl.constexpr, FP4: tl.constexpr, E4M3_SCALE: tl.constexpr,
                          DIM: tl.constexpr, NQ: tl.constexpr, QB: tl.constexpr,
                          TAIL_OFF: tl.constexpr, SC_OFF: tl.constexpr, PAD: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """Rows ``src[i]`` of ``rows`` encoded into pool rows ``dst[i]`` for BLOCK_M values of i."""
    grid_dependency_sync(PDL)
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = i < M
    i64 = i.to(tl.int64)
    src = i64
    if HAS_SRC:
        src = tl.load(src_ptr + i, mask=ok, other=0).to(tl.int64)
    dst = i64
    if HAS_DST:
        dst = tl.load(dst_ptr + i, mask=ok, other=0).to(tl.int64)
    c = tl.arange(0, BLOCK_D)
    x = tl.load(rows_ptr + src[:, None] * stride_r + c[None, :],
                mask=ok[:, None] & (c[None, :] < DIM), other=0.0).to(tl.float32)
    if HADAMARD:
        # BLOCK_D == DIM here (a power of two); the twin's output is in the rows' dtype.
        x = _hadamard(x, BLOCK_M, BLOCK_D, LOG2_D) * had_scale
        if rows_ptr.dtype.element_ty == tl.bfloat16:
            x = round_to_bf16(x)
    rec = pool_ptr + dst * stride_p
    if PLAIN:
        v = x
        if pool_ptr.dtype.element_ty == tl.bfloat16:
            v = round_to_bf16(x)
        tl.store(rec[:, None] + c[None, :], v.to(pool_ptr.dtype.element_ty),
                 mask=ok[:, None] & (c[None, :] < DIM))
    else:
        # Per block of QB channels (blocks at or past NQ are tail / padding: not stored).
        xb = tl.reshape(tl.where(c[None, :] < NQ, x, 0.0), [BLOCK_M, BLOCK_D // QB, QB])
        amax = tl.max(tl.abs(xb), axis=2)
        if FP4:
            if E4M3_SCALE:
                s = round_to_e4m3(tl.minimum(tl.maximum(amax, 0.01171875) * 0.16666666666666666,
                                             448.0))
                sbyte = _e4m3_byte(s)
            else:
                sbyte = _pow2_scale_bits(tl.maximum(amax, 7.052966104933725e-38)
                                         * 0.16666666666666666)
                s = (sbyte << 23).to(tl.float32, bitcast=True)
            v = tl.clamp(tl.div_rn(xb, s[:, :, None]), -6.0, 6.0)
            code = tl.reshape(_e2m1_code(v), [BLOCK_M, BLOCK_D // 2, 2])
            lo, hi = tl.split(code)
            j = tl.arange(0, BLOCK_D // 2)
            tl.store(rec[:, None] + j[None, :], (lo | (hi << 4)).to(tl.uint8),
                     mask=ok[:, None] & (j[None, :] < NQ // 2))
        else:
            sbyte = _pow2_scale_bits(tl.maximum(amax, 1e-4) * 0.002232142857142857)
            s = (sbyte << 23).to(tl.float32, bitcast=True)
            q = round_to_e4m3(tl.clamp(tl.div_rn(xb, s[:, :, None]), -448.0, 448.0))
            code = tl.reshape(_e4m3_byte(q), [BLOCK_M, BLOCK_D])
            tl.store(rec[:, None] + c[None, :], code.to(tl.uint8),
                     mask=ok[:, None] & (c[None, :] < NQ))
        b = tl.arange(0, BLOCK_D // QB)
        tl.store(rec[:, None] + SC_OFF + b[None, :], sbyte.to(tl.uint8),
                 mask=ok[:, None] & (b[None, :] < NQ // QB))
        if DIM > NQ:
            # bf16 tail, little endian: low byte first.
            bits = (round_to_bf16(x).to(tl.int32, bitcast=True) >> 16) & 0xFFFF
            t_off = TAIL_OFF + 2 * (c - NQ)
            t_mask = ok[:, None] & (c[None, :] >= NQ) & (c[None, :] < DIM)
            tl.store(rec[:, None] + t_off[None, :], (bits & 0xFF).to(tl.uint8), mask=t_mask)
            tl.store(rec[:, None] + t_off[None, :] + 1, (bits >> 8).to(tl.uint8), mask=t_mask)
        if PAD > 0:
            p = tl.arange(0, 8)
            tl.store(rec[:, None] + SC_OFF + NQ // QB + p[None, :],
                     tl.zeros([BLOCK_M, 8], dtype=tl.uint8), mask=ok[:, None] & (p[None, :] < PAD))


def record_tile(n_rows: int, dim: int) -> dict[str, int]:
    """BLOCK_M / BLOCK_D / num_warps of a launch over ``n_rows`` rows of ``dim`` channels."""
    block_d = triton.next_power_of_2(max(dim, 2))
    block_m = max(1, min(_TILE_ELEMS // block_d, triton.next_power_of_2(max(n_rows, 1))))
    return {"BLOCK_M": block_m, "BLOCK_D": block_d, "num_warps": 4}


def record_constexprs(fmt: RecordFormat | None, dim: int) -> dict[str, Any]:
    """The format's constexprs of the kernel (``fmt`` None: a plain cast-and-copy)."""
    if fmt is None:
        return dict(PLAIN=True, FP4=False, E4M3_SCALE=False, DIM=dim, NQ=dim, QB=1, TAIL_OFF=0,
                    SC_OFF=0, PAD=0)
    return dict(PLAIN=False, FP4=fmt.quant == "fp4", E4M3_SCALE=fmt.scale == "e4m3",
                DIM=fmt.dim, NQ=fmt.quant_dims, QB=fmt.block, TAIL_OFF=fmt.tail_offset,
                SC_OFF=fmt.scale_offset, PAD=fmt.scale_pad)


def _kernel_fits(rows: torch.Tensor, pool_dtype: torch.dtype, fmt: RecordFormat | None) -> bool:
    if rows.dtype not in _ROW_DTYPES:
        return False
    if fmt is None:
        return pool_dtype in _PLAIN_POOL_DTYPES
    pow2 = fmt.block & (fmt.block - 1) == 0
    return pow2 and fmt.block >= 2 and fmt.scale_pad <= 8 and \
        not (fmt.quant == "fp8" and fmt.scale != "e8m0")


def _index(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _launch(rows: torch.Tensor, src: torch.Tensor | None, dst: torch.Tensor | None,
            pool: torch.Tensor, fmt: RecordFormat | None, M: int, hadamard: bool = False) -> None:
    if M == 0:
        return
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    dim = rows.shape[1]
    tile = record_tile(M, dim)
    _write_records_kernel[(triton.cdiv(M, tile["BLOCK_M"]),)](
        rows, _index(src) if src is not None else rows, _index(dst) if dst is not None else rows,
        pool, M, rows.stride(0), pool.stride(0), float(dim) ** -0.5 if hadamard else 1.0,
        HAS_SRC=src is not None, HAS_DST=dst is not None, HADAMARD=bool(hadamard),
        LOG2_D=max(dim, 1).bit_length() - 1 if hadamard else 0,
        **record_constexprs(fmt, dim), **tile, **pdl_args(rows))


def _twin(name: str, *args: Any) -> Any:
    return getattr(importlib.import_module("dsv4.ops.torch_records"), name)(*args)


@torch_twin_off_gpu("dsv4.ops.torch_records")
def encode_records(rows: torch.Tensor, fmt: RecordFormat | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """What a pool of ``dtype`` stores for ``rows`` [N, d] (records of ``fmt``, or the rows cast
    to ``dtype``), one launch.  See the torch twin."""
    _check_rows("encode_records", rows, fmt)
    if not _kernel_fits(rows, dtype, fmt):
        return _twin("encode_records", rows, fmt, dtype)
    N = rows.shape[0]
    if fmt is None:
        out = torch.empty(N, rows.shape[1], dtype=dtype, device=rows.device)
    else:
        out = torch.empty(N, fmt.record_bytes, dtype=torch.uint8, device=rows.device)
    _launch(rows, None, None, out, fmt, N)
    return out


@torch_twin_off_gpu("dsv4.ops.torch_records")
def write_records(pool: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor,
                  src: torch.Tensor | None, fmt: RecordFormat | None,
                  hadamard: bool = False) -> None:
    """``pool[dst[i]] = encode(rows[src[i]])`` (``hadamard``: of the rotated row), in place, one
    launch.  See the torch twin."""
    check_write_args(pool, dst, rows, src, fmt)
    d = rows.shape[1]
    fits = _kernel_fits(rows, pool.dtype, fmt) and pool.stride(1) == 1
    if hadamard:
        if d < 1 or d & (d - 1):
            raise ValueError(f"write_records: hadamard needs a power-of-two row width; found {d}")
        fits = fits and rows.dtype in (torch.float32, torch.bfloat16) and d >= 2
    if not fits:
        return _twin("write_records", pool, dst, rows, src, fmt, hadamard)
    _launch(rows, src, dst, pool, fmt, dst.shape[0], hadamard)


# ------------------------------------------------------------------ reading records back
@triton.jit
def _read_records_kernel(pool_ptr, rows_ptr, out_ptr, M, D, stride_p, HAS_ROWS: tl.constexpr,
                         FMT: tl.constexpr, NQ: tl.constexpr, QB: tl.constexpr,
                         SC_OFF: tl.constexpr, TAIL_OFF: tl.constexpr, BR: tl.constexpr,
                         BC: tl.constexpr, PDL: tl.constexpr = False):
    """out[i] = the record pool[rows[i]] (pool[i] without rows) dequantized, BR rows × BC
    channels a program: the attention kernels' record reads (``triton_attn.load_rows``: exact
    values), stored in out's dtype (exact in bf16 / fp32)."""
    grid_dependency_sync(PDL)
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    r_mask = r < M
    if HAS_ROWS:
        src = tl.load(rows_ptr + r, mask=r_mask, other=0)
    else:
        src = r
    mask = r_mask[:, None] & (c < D)[None, :]
    val = load_rows(pool_ptr, src.to(tl.int64), c, mask, stride_p, FMT, NQ, QB, SC_OFF,
                    TAIL_OFF)
    store_rne(out_ptr + r.to(tl.int64)[:, None] * D + c[None, :], val, mask)


@torch_twin_off_gpu("dsv4.ops.torch_records")
def read_records(pool: torch.Tensor, rows: torch.Tensor | None, fmt: RecordFormat,
                 dtype: torch.dtype) -> torch.Tensor:
    """The records ``pool[rows]`` dequantized to ``dtype`` (bf16 / fp32; other dtypes run the
    twin), one launch: a prefill's dense copy of a record source, which the twin builds from
    ~15 elementwise torch ops.  See the torch twin."""
    check_read_args(pool, rows, fmt, dtype)
    M = pool.shape[0] if rows is None else rows.shape[0]
    if dtype not in (torch.float32, torch.bfloat16) or pool.stride(1) != 1:
        return _twin("read_records", pool, rows, fmt, dtype)
    out = torch.empty(M, fmt.dim, dtype=dtype, device=pool.device)
    if M == 0:
        return out
    kind, nq, qb, sc_off, tail_off = record_meta(fmt)
    BC = min(512, triton.next_power_of_2(fmt.dim))
    BR = max(1, 8192 // BC)
    rows_t = _index(rows) if rows is not None else out
    _read_records_kernel[(triton.cdiv(M, BR), triton.cdiv(fmt.dim, BC))](
        pool, rows_t, out, M, fmt.dim, pool.stride(0), HAS_ROWS=rows is not None, FMT=kind,
        NQ=nq, QB=qb, SC_OFF=sc_off, TAIL_OFF=tail_off, BR=BR, BC=BC, num_warps=4,
        **pdl_args(pool))
    return out
