"""Triton kernels of the norm / RoPE glue of attention (spec §3.1, §3.6 items 1, 2 and 6):
``rms_norm``, ``apply_rope`` (also the inverse rotation of the attention output),
``head_norm_rope`` (V4 per-head q renorm + RoPE) and ``norm_rope`` (kv_norm + RoPE + optional
FP8 fake quant of the unrotated channels).  Each is one launch of one kernel that replaces 6–20
small torch kernels; same signatures as the twins (``torch_attn.rms_norm`` / ``apply_rope``,
``torch_norm.head_norm_rope`` / ``norm_rope``).

Numerics follow the twins' rounding points exactly:

* the weighted norm is fp32 math, rounded once to the output dtype, and the rotated tail starts
  from that rounded value (as ``apply_rope(rms_norm(x))`` does);
* the V4 q renorm runs "in q's dtype": for bf16 every step (square, mean, + eps, rsqrt,
  multiply) is rounded to bf16 like the reference's bf16 tensor ops;
* ``rsqrt`` is ``1 / sqrt`` with IEEE division and square root (what torch's CPU rsqrt gives);
  the rotation ``a·c − b·s`` is compiled without FMA contraction (``enable_fp_fusion=False``),
  so each product rounds as in the twin;
* bf16 stores round to nearest even (:func:`dsv4.ops.triton_dense.store_rne`).

What can still differ from the twin is the order of the fp32 sum of squares (a tree here),
~1e-7 relative in fp32; in bf16 that can move a rounding by one ulp (rarely; tests bound it).
Unsupported inputs (dtypes other than fp32/bf16, rows wider than ``MAX_DIM``, an FP8 block that
is not a power of two) run the torch twin.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import triton
import triton.language as tl

from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.torch_norm import check_norm_rope_args, check_rope_args
from dsv4.ops.triton_dense import (HW_BF16_ROUND, pow2_from_exp, round_as, round_to_e4m3,
                                   store_rne, torch_twin_off_gpu, ue8m0_exponent)

__all__ = ["rms_norm", "apply_rope", "head_norm_rope", "norm_rope", "MAX_DIM",
           "NORM_NONE", "NORM_WEIGHTED", "NORM_IN_DTYPE"]

# One program keeps whole rows in registers: rows wider than this go to the twin.
MAX_DIM = 16384
# Elements per program tile (rows × padded width): ~32 fp32 registers per thread at 4 warps.
_TILE_ELEMS = 4096
# NORM modes of the kernel: none, fp32 rms_norm (weight optional), per-head renorm in x's dtype.
NORM_NONE, NORM_WEIGHTED, NORM_IN_DTYPE = 0, 1, 2
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _fake_quant_fp8(y, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, FB: tl.constexpr):
    """e4m3 fake quant of a [BLOCK_R, BLOCK_D] fp32 tile per FB columns (spec §2.5 act_quant,
    ue8m0 scales): ``e4m3(clamp(y / s, ±448)) · s``, exact as ``formats.fake_quant_fp8``."""
    yb = tl.reshape(y, [BLOCK_R, BLOCK_D // FB, FB])
    amax = tl.maximum(tl.max(tl.abs(yb), axis=2), 1e-4)
    e = ue8m0_exponent(amax)
    # Scales are powers of two: y · 2^-e is exactly y / s, and q · 2^e exactly q · s.
    q = round_to_e4m3(tl.clamp(yb * pow2_from_exp(-e)[:, :, None], -448.0, 448.0))
    return tl.reshape(q * pow2_from_exp(e)[:, :, None], [BLOCK_R, BLOCK_D])


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr,
                      n_rows, M, d, nope, half,
                      stride_xt, stride_xm, stride_yt, stride_ym, stride_c, eps,
                      NORM: tl.constexpr, HAS_W: tl.constexpr, ROPE: tl.constexpr,
                      INVERSE: tl.constexpr, COPY_NOPE: tl.constexpr, FP8_BLOCK: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
                      PDL: tl.constexpr = False):
    """BLOCK_R rows of x viewed as [T, M, d] (row r = token r // M): optional norm of the row,
    rotation of its last 2·half channels (pair j = channels nope+2j, nope+2j+1) by cos/sin of
    the row's token, optional FP8 fake quant of the first ``nope`` channels."""
    grid_dependency_sync(PDL)
    # The cast rounding (HW_BF16_ROUND) doubles the registers of the multi-row rms_norm + RoPE
    # forms (sm_90 SASS, forty-second session: 80 -> 162 / 167, more instructions): those keep
    # the integer rounding; every other form's code shrinks with the cast.
    HW: tl.constexpr = HW_BF16_ROUND and not (NORM == 1 and ROPE and BLOCK_R > 1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    r64 = rows.to(tl.int64)
    t = r64 // M
    m = r64 - t * M
    x_row = x_ptr + t * stride_xt + m * stride_xm
    y_row = y_ptr + t * stride_yt + m * stride_ym
    cols = tl.arange(0, BLOCK_D)
    # The full row covers the tail too when there is no rotation (plain rms_norm).
    head_end = nope if ROPE else d
    head_mask = row_ok[:, None] & (cols[None, :] < head_end)
    row_mask = row_ok[:, None] & (cols[None, :] < d)
    j = tl.arange(0, BLOCK_HALF)
    pmask = row_ok[:, None] & (j[None, :] < half)
    even = nope + 2 * j[None, :]
    # Every load comes before any store: the kernel may run in place (y_ptr == x_ptr).
    a = tl.load(x_row[:, None] + even, mask=pmask, other=0.0).to(tl.float32)
    b = tl.load(x_row[:, None] + even + 1, mask=pmask, other=0.0).to(tl.float32)

    if NORM == 0:
        if COPY_NOPE:
            raw = tl.load(x_row[:, None] + cols[None, :], mask=head_mask, other=0.0)
            tl.store(y_row[:, None] + cols[None, :], raw.to(y_ptr.dtype.element_ty),
                     mask=head_mask)
    else:
        x = tl.load(x_row[:, None] + cols[None, :], mask=row_mask, other=0.0).to(tl.float32)
        d_f = d.to(tl.float32)
        if NORM == 1:
            # rms_norm: fp32 statistics, w · (x · rsqrt(mean(x²) + eps)), one final rounding.
            mean_sq = tl.div_rn(tl.sum(x * x, axis=1), d_f)
            r = tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))
            y = x * r[:, None]
            a = a * r[:, None]
            b = b * r[:, None]
            if HAS_W:
                w = tl.load(w_ptr + cols, mask=cols < d, other=0.0).to(tl.float32)
                wa = tl.load(w_ptr + even, mask=j[None, :] < half, other=0.0).to(tl.float32)
                wb = tl.load(w_ptr + even + 1, mask=j[None, :] < half, other=0.0).to(tl.float32)
                y = w[None, :] * y
                a = wa * a
                b = wb * b
            y = round_as(y, y_ptr, HW)
        else:
            # The reference's q renorm in q's dtype: each torch op rounds (bf16) in turn.
            sq = round_as(x * x, y_ptr, HW)
            mean_sq = round_as(tl.div_rn(tl.sum(sq, axis=1), d_f), y_ptr, HW)
            mean_sq = round_as(mean_sq + eps, y_ptr, HW)
            r = round_as(tl.div_rn(1.0, tl.sqrt_rn(mean_sq)), y_ptr, HW)
            y = round_as(x * r[:, None], y_ptr, HW)
            a = a * r[:, None]
            b = b * r[:, None]
        # The rotation starts from the norm's rounded output, as in apply_rope(norm(x)).
        a = round_as(a, y_ptr, HW)
        b = round_as(b, y_ptr, HW)
        if FP8_BLOCK > 0:
            y = _fake_quant_fp8(tl.where(head_mask, y, 0.0), BLOCK_R, BLOCK_D, FP8_BLOCK)
        store_rne(y_row[:, None] + cols[None, :], y, head_mask, HW)

    if ROPE:
        c = tl.load(cos_ptr + t[:, None] * stride_c + j[None, :], mask=pmask, other=0.0)
        s = tl.load(sin_ptr + t[:, None] * stride_c + j[None, :], mask=pmask, other=0.0)
        if INVERSE:
            s = -s
        store_rne(y_row[:, None] + even, a * c - b * s, pmask, HW)
        store_rne(y_row[:, None] + even + 1, a * s + b * c, pmask, HW)


def _twin(module: str, name: str, *args: Any, **kwargs: Any) -> Any:
    return getattr(importlib.import_module(module), name)(*args, **kwargs)


def _tile(n_rows: int, d: int, half: int) -> dict[str, int]:
    """Block sizes and warps of a launch over ``n_rows`` rows of width d."""
    block_d = triton.next_power_of_2(max(d, 1))
    block_r = max(1, min(_TILE_ELEMS // block_d, triton.next_power_of_2(max(n_rows, 1))))
    return {"BLOCK_R": block_r, "BLOCK_D": block_d,
            "BLOCK_HALF": triton.next_power_of_2(max(half, 1)),
            "num_warps": 4 if block_r * block_d <= _TILE_ELEMS else 8}


def _rows3(x: torch.Tensor) -> torch.Tensor:
    """x [T, ..., d] as a [T, M, d] view with unit stride on d (a copy only when it must)."""
    x3 = x.reshape(x.shape[0], -1, x.shape[-1])
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def _launch(x3: torch.Tensor, y3: torch.Tensor, weight: torch.Tensor | None,
            cos: torch.Tensor | None, sin: torch.Tensor | None, eps: float, norm: int,
            inverse: bool = False, fp8_block: int = 0) -> None:
    """Run the kernel over x3 [T, M, d] into y3 [T, M, d] (y3 may be x3)."""
    T, M, d = x3.shape
    n_rows = T * M
    if n_rows == 0:
        return
    rope = cos is not None
    half = cos.shape[-1] if rope else 0
    if rope:
        cos = cos.float().contiguous()
        sin = sin.float().contiguous()
    w = weight.float().contiguous() if weight is not None else None
    tile = _tile(n_rows, d, half)
    dummy = x3
    _norm_rope_kernel[(triton.cdiv(n_rows, tile["BLOCK_R"]),)](
        x3, w if w is not None else dummy, cos if rope else dummy, sin if rope else dummy, y3,
        n_rows, M, d, d - 2 * half, half,
        x3.stride(0), x3.stride(1), y3.stride(0), y3.stride(1),
        cos.stride(0) if rope else 0, float(eps),
        NORM=norm, HAS_W=w is not None, ROPE=rope, INVERSE=bool(inverse),
        COPY_NOPE=y3.data_ptr() != x3.data_ptr(), FP8_BLOCK=int(fp8_block),
        enable_fp_fusion=False, **tile, **pdl_args(x3))


def _kernel_fits(x: torch.Tensor) -> bool:
    return x.dtype in _KERNEL_DTYPES and x.shape[-1] <= MAX_DIM


@torch_twin_off_gpu("dsv4.ops.torch_attn")
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``weight · x · rsqrt(mean(x²) + eps)`` over the last dim, fp32 math, x.dtype out
    (one kernel).  x [..., d]; weight [d] or None."""
    if x.dim() == 0:
        raise ValueError("rms_norm: x must have at least one dim [..., d]; found a scalar")
    d = x.shape[-1]
    if weight is not None and tuple(weight.shape) != (d,):
        raise ValueError(f"rms_norm: weight must have shape ({d},); found {tuple(weight.shape)}")
    if not _kernel_fits(x):
        return _twin("dsv4.ops.torch_attn", "rms_norm", x, weight, eps)
    x2 = x.reshape(-1, d)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x2[:, None, :], y.view(-1, d)[:, None, :], weight, None, None, eps, NORM_WEIGHTED)
    return y


@torch_twin_off_gpu("dsv4.ops.torch_attn")
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               inverse: bool = False, inplace: bool = False) -> torch.Tensor:
    """Rotate the last ``2·cos.shape[-1]`` channels of x [T, ..., d] by interleaved pairs
    (conjugate when ``inverse``); fp32 math, x.dtype out, other channels copied into a new
    tensor — or (``inplace``) x's tail rotated where it lies: only the tail's bytes move (1/8
    of a V4 head's), where the copy would move the whole tensor twice."""
    check_rope_args("apply_rope", x, cos, sin)
    if not _kernel_fits(x):
        return _twin("dsv4.ops.torch_attn", "apply_rope", x, cos, sin, inverse, inplace)
    src = _rows3(x)
    if inplace and src.data_ptr() == x.data_ptr():     # a view of x: rotate it there
        _launch(src, src, None, cos, sin, 0.0, NORM_NONE, inverse=inverse)
        return x
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(src, y.view(x.shape[0], -1, x.shape[-1]), None, cos, sin, 0.0, NORM_NONE,
            inverse=inverse)
    if inplace:
        x.copy_(y)
        return x
    return y


@torch_twin_off_gpu("dsv4.ops.torch_norm")
def head_norm_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                   renorm: bool, inplace: bool = False) -> torch.Tensor:
    """Per-head RMS renorm in q's dtype (when ``renorm``) + RoPE of each head's tail, one kernel.
    q [T, H, d]; cos, sin [T, rd/2] fp32.  ``inplace`` writes into q and returns it."""
    check_rope_args("head_norm_rope", q, cos, sin, min_dim=3)
    if not _kernel_fits(q):
        return _twin("dsv4.ops.torch_norm", "head_norm_rope", q, cos, sin, eps, renorm, inplace)
    src = _rows3(q)
    if inplace and src.data_ptr() == q.data_ptr():
        out = q
        dst = src
    else:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dst = out.view(src.shape)
    _launch(src, dst, None, cos, sin, eps, NORM_IN_DTYPE if renorm else NORM_NONE)
    if inplace and out is not q:
        q.copy_(out)
        return q
    return out


@torch_twin_off_gpu("dsv4.ops.torch_norm")
def norm_rope(kv: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor,
              sin: torch.Tensor, eps: float, fp8_block: int = 0) -> torch.Tensor:
    """``rms_norm`` + RoPE of the tail (+ FP8 fake quant of the other channels per
    ``fp8_block`` when > 0), one kernel.  kv [T, ..., d]; weight [d] or None.  New tensor."""
    check_norm_rope_args(kv, weight, cos, sin, fp8_block)
    d = kv.shape[-1]
    pow2_block = fp8_block & (fp8_block - 1) == 0
    if not _kernel_fits(kv) or not pow2_block:
        return _twin("dsv4.ops.torch_norm", "norm_rope", kv, weight, cos, sin, eps, fp8_block)
    y = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
    _launch(_rows3(kv), y.view(kv.shape[0], -1, d), weight, cos, sin, eps, NORM_WEIGHTED,
            fp8_block=fp8_block)
    return y
