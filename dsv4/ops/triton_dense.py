"""Triton kernels of the dense hot ops: the FP8 block GEMM with fused activation quantization
(spec §2.4-2.5), and the jit helpers the other kernel modules share (rounding, stores, split-K
counters; the mHC kernels are in ``triton_mhc``).

Same signatures as the torch twins in ``dsv4/ops/torch_dense.py``.  The kernels run on Hopper
GPUs and, at tiny shapes, in the Triton interpreter (``TRITON_INTERPRET=1``) on CPU tensors.

FP8 rounding is done by hand (:func:`round_to_e4m3`) onto the e4m3 grid in fp32 before the cast,
so the quantized values are bit-identical on the GPU and in the interpreter (whose own fp32→fp8
cast mis-rounds values whose mantissa carries into the exponent).
"""

from __future__ import annotations

import math

import functools
import importlib
import os
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Callable, TypeVar

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from dsv4.ops import torch_dense
from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.streams import current_lane

__all__ = ["fp8_linear", "fp8_linear_with_config", "fp8_grouped_linear", "act_quant",
           "Fp8GemmConfig",
           "pick_fp8_config", "pick_fp8_gemv_config", "GEMV_MAX_M", "mma", "round_to_bf16",
           "store_rne"]

_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_E4M3 = torch.float8_e4m3fn


_F = TypeVar("_F", bound=Callable[..., Any])


def torch_twin_off_gpu(module: str) -> Callable[[_F], _F]:
    """Route calls on non-CUDA tensors to the torch twin of the same name in ``module``
    (unless the Triton interpreter is on), so ``get_ops("triton")`` works on any device."""
    def deco(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            first = args[0] if args else next(iter(kwargs.values()))
            if first.device.type != "cuda" and not _INTERPRET_HOST:
                return getattr(importlib.import_module(module), fn.__name__)(*args, **kwargs)
            return fn(*args, **kwargs)
        return wrapper  # type: ignore[return-value]
    return deco


# ------------------------------------------------------------------------- shared jit helpers
# The interpreter multiplies bf16 tiles as raw uint16 integers: kernels upcast them there.
_INTERPRET_HOST = os.environ.get("TRITON_INTERPRET", "0") == "1"
INTERPRET = tl.constexpr(_INTERPRET_HOST)
# round_to_bf16 by the GPU's own fp32 -> bf16 conversion (cvt.rn: nearest, ties to even; the
# same bits for finite values, ~4 integer instructions an element fewer) instead of the integer
# form the interpreter needs.  Opt-in (DSV4_HW_BF16_ROUND=1) until a GPU run checks every
# kernel's bits with it (bench/sessions/gpu_session_s40a.sh).
HW_BF16_ROUND = tl.constexpr(os.environ.get("DSV4_HW_BF16_ROUND", "0") == "1"
                             and not _INTERPRET_HOST)


@triton.jit
def mma(a, b, PREC: tl.constexpr):
    """``tl.dot(a, b)`` with fp32 accumulation; PREC applies to fp32 operands only."""
    if INTERPRET:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
        if b.dtype == tl.bfloat16:
            b = b.to(tl.float32)
    if a.dtype == tl.float32:
        c = tl.dot(a, b, input_precision=PREC)
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def e8m0_to_f32(b):
    """uint8 e8m0 exponents → fp32 ``2^(b-127)`` exactly (built from the exponent bits)."""
    return (b.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def pow2_from_exp(e):
    """int32 exponent e (normal range) → fp32 ``2^e`` exactly."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_to_e4m3(v):
    """Round fp32 ``v`` (|v| <= 448) to the nearest e4m3fn value, ties to even, kept in fp32.

    Normal range: round the fp32 mantissa to 3 bits in integer space (a carry into the exponent
    is then exact).  Below 2^-6 the e4m3 grid is uniform (step 2^-9): the 1.5·2^23 trick rounds.
    """
    b = v.to(tl.int32, bitcast=True)
    b = (b + 0x7FFFF + ((b >> 20) & 1)) & -1048576  # clear the low 20 mantissa bits, RNE
    normal = b.to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2**23
    sub = ((v * 512.0 + magic) - magic) * 0.001953125
    sub = tl.where(sub == 0.0, v * 0.0, sub)  # keep the sign of zero, as a real cast does
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def round_to_bf16(v, HW: tl.constexpr = HW_BF16_ROUND):
    """Round fp32 ``v`` to bf16 precision (nearest, ties to even), kept in fp32.

    The GPU's fp32→bf16 cast already rounds this way; the interpreter's truncates, so every bf16
    store goes through here and both give the same bits (``HW``, default
    :data:`HW_BF16_ROUND`: the cast; a kernel form whose code the cast makes worse passes
    False)."""
    if HW:
        return v.to(tl.bfloat16).to(tl.float32)
    b = v.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def store_rne(ptrs, v, mask, HW: tl.constexpr = HW_BF16_ROUND):
    """Store fp32 ``v`` into ``ptrs`` (any float dtype), bf16 rounded to nearest-even (``HW``:
    as :func:`round_to_bf16`)."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        v = round_to_bf16(v, HW)
    tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def round_as(v, ptr, HW: tl.constexpr = HW_BF16_ROUND):
    """fp32 ``v`` rounded as a store through ``ptr`` would round it (bf16 RNE), kept in fp32
    (``HW``: as :func:`round_to_bf16`)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        v = round_to_bf16(v, HW)
    return v


@triton.jit
def ue8m0_exponent(amax):
    """Exponent e of the power-of-two scale ``2^ceil(log2(amax · fp32(1/448)))``, read off the
    fp32 bits like the reference's ``fast_round_scale`` (a multiply by the fp32 reciprocal of
    448, not a division)."""
    t = amax * 0.002232142857142857
    bits = t.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def quantize_block_rows(x):
    """Per-row e4m3 quantization of a [R, B] fp32 tile (spec §2.5: amax floor 1e-4, ue8m0
    scale, clamp to ±448, round to nearest even): returns (q fp32 on the e4m3 grid, s [R])."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    e = ue8m0_exponent(amax)
    # x · 2^-e is exactly the reference's x / s (both scales are exact powers of two).
    q = tl.clamp(x * pow2_from_exp(-e)[:, None], -448.0, 448.0)
    return round_to_e4m3(q), pow2_from_exp(e)


# ------------------------------------------------------------------------------ act quant
@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, n_kb,
                      B: tl.constexpr, BR: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)
    pid_r = tl.program_id(0)
    kb = tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    cols = kb * B + tl.arange(0, B)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    q, s = quantize_block_rows(x.to(tl.float32))
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty),
             mask=mask)
    tl.store(s_ptr + rows * n_kb + kb, s, mask=rows < M)


def act_quant(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference activation quantizer on the GPU: x [M, K] → (q e4m3 [M, K], s fp32 [M, K/block])."""
    if x.dim() != 2 or x.shape[1] % block:
        raise ValueError(f"act_quant: x must be [M, K] with K a multiple of block={block}; "
                         f"found {tuple(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    M, K = x.shape
    n_kb = K // block
    q = torch.empty(M, K, dtype=_E4M3, device=x.device)
    s = torch.empty(M, n_kb, dtype=torch.float32, device=x.device)
    BR = 32
    if M and n_kb:
        _act_quant_kernel[(triton.cdiv(M, BR), n_kb)](
            x, q, s, M, K, x.stride(0), q.stride(0), n_kb, B=block, BR=BR, num_warps=4,
            **pdl_args(x))
    return q, s


# ------------------------------------------------------------------------------ split-K
@triton.jit
def splitk_reduce(acc, part, mask, split, stride_ws, count, SPLITS: tl.constexpr):
    """The split-K reduction inside a GEMM kernel: split ``split`` of SPLITS stores its fp32
    partial tile ``acc`` at ``part + split·stride_ws`` and counts itself in at its tile's
    arrival counter ``count``; returns ``(last, total)``: ``last`` for the split that arrived
    last, which gets ``total`` = the slices summed in the fixed order ``((s0 + s1) + s2) + …``
    (bit-reproducible whatever the arrival order) and has reset the counter to 0 (the next
    launch and CUDA-graph replays start clean); the caller stores ``total`` when ``last``."""
    tl.store(part + split * stride_ws, acc, mask=mask)
    # Every thread's partial stores are issued before one thread publishes the arrival; the
    # release of the atomic then orders them before any later acquirer's reads.
    tl.debug_barrier()
    arrived = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLITS - 1
    total = acc
    if last:
        # The acquire was done by one thread: the barrier orders all threads' reads after it
        # (cheap, and independent of how the atomic's result is broadcast).
        tl.debug_barrier()
        # Unrolled, so the SPLITS loads are in flight together (one L2 round trip); .cg reads
        # L2, never a possibly stale L1 line.
        total = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLITS):
            total += tl.load(part + s * stride_ws, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(count, 0)
    return last, total


# ------------------------------------------------------------------------------ FP8 GEMM
@triton.jit
def _fp8_gemm_kernel(a_ptr, sa_ptr, w_ptr, sw_ptr, out_ptr, ws_ptr, count_ptr,
                     M, N, K, stride_am, stride_wn, stride_om, stride_ws, stride_wm, n_kb,
                     k_blocks_per_split,
                     QUANT_A: tl.constexpr, SW_E8M0: tl.constexpr, B: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
                     SPLITS: tl.constexpr, PDL: tl.constexpr = False):
    """out[M, N] = Σ_kb (A8·sA)(W8·sW)^T, one B-wide K block per step.

    QUANT_A: A is the raw activation (bf16/fp32) and is quantized here, per row and K block,
    exactly as the reference act_quant; else A is e4m3 with fp32 scales sa [M, n_kb].
    Grid: (tiles of M×N in grouped order, SPLITS).  With SPLITS == 1 the tile is stored
    straight into ``out``.  Otherwise split s covers K blocks
    ``[s·k_blocks_per_split, min((s+1)·k_blocks_per_split, n_kb))`` (the last may be shorter)
    and the reduction happens here, deterministically:

    1. every split stores its fp32 partial tile into its slice ``ws[s]`` of the workspace;
    2. it then bumps the tile's int32 arrival counter ``count[pid]`` (acq_rel, gpu scope);
    3. the split that arrives last re-reads all the slices (its own too: the same bits) and
       sums them in the fixed order ``((ws[0] + ws[1]) + ws[2]) + … + ws[SPLITS−1]`` (fp32),
       so the bits never depend on which split arrived last; it stores the sum in out's dtype
       (bf16 rounded to nearest-even) and resets the counter to 0 for the next launch (and
       CUDA-graph replays).
    """
    grid_dependency_sync(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    # Grouped ordering: consecutive programs share W tiles in L2.
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    gsize = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % gsize
    pid_n = (pid % group) // gsize

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, B)
    m_mask = rm < M
    n_mask = rn < N
    # Weight scale row of each output column (blocks are B×B).
    sw_row = sw_ptr + (rn // B) * n_kb

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    kb0 = split * k_blocks_per_split
    kb1 = tl.minimum(kb0 + k_blocks_per_split, n_kb)
    for kb in range(kb0, kb1):
        ks = kb * B + rk
        k_mask = ks < K
        a = tl.load(a_ptr + rm[:, None] * stride_am + ks[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if QUANT_A:
            q, sa = quantize_block_rows(a.to(tl.float32))
            a8 = q.to(tl.float8e4nv)
        else:
            a8 = a
            sa = tl.load(sa_ptr + rm * n_kb + kb, mask=m_mask, other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + ks[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if SW_E8M0:
            sw = e8m0_to_f32(tl.load(sw_row + kb, mask=n_mask, other=127))
        else:
            sw = tl.load(sw_row + kb, mask=n_mask, other=1.0)
        # A fresh dot per K block keeps the tensor-core partial sums short (Hopper FP8 MMA
        # accumulates with reduced precision); the scaled sum is fp32.
        acc += tl.dot(a8, tl.trans(w)) * (sa[:, None] * sw[None, :])
    mask = m_mask[:, None] & n_mask[None, :]
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    if SPLITS > 1:
        part = ws_ptr + rm[:, None] * stride_wm + rn[None, :]
        last, total = splitk_reduce(acc, part, mask, split, stride_ws, count_ptr + pid, SPLITS)
        if last:
            store_rne(out, total, mask)
    else:
        store_rne(out, acc, mask)


@triton.jit
def _gemv_x_row(x_ptr, m, M, stride_xm, k0, k_hi, sw_row,
                SW_E8M0: tl.constexpr, B: tl.constexpr, BK: tl.constexpr,
                QUANT_X: tl.constexpr):
    """Activation row m's step [k0, k0 + BK) as the [BK/16, 16] fp32 tile x8·sx·sw, quantized
    on its own (:func:`quantize_block_rows` on [BK/B, B]; x·sw when not QUANT_X): the
    ``SPLIT_ROWS=False`` form of :func:`_fp8_gemv_kernel` (zero past the split and for rows
    m >= M)."""
    NB: tl.constexpr = BK // B
    rb = tl.arange(0, NB)
    b_ok = (k0 + rb * B) < k_hi
    x = tl.load(x_ptr + m * stride_xm + k0 + rb[:, None] * B + tl.arange(0, B)[None, :],
                mask=(b_ok & (m < M))[:, None], other=0.0)
    if SW_E8M0:
        sw = e8m0_to_f32(tl.load(sw_row + k0 // B + rb, mask=b_ok, other=127))
    else:
        sw = tl.load(sw_row + k0 // B + rb, mask=b_ok, other=1.0)
    if QUANT_X:
        q, sx = quantize_block_rows(x.to(tl.float32))
        xs = q * (sx * sw)[:, None]
    else:
        xs = x.to(tl.float32) * sw[:, None]
    return tl.reshape(xs, (BK // 16, 16))


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, sw_ptr, out_ptr, ws_ptr, count_ptr,
                     M, N, K, stride_xm, stride_wn, stride_om, stride_ws, stride_wm, n_kb,
                     k_blocks_per_split,
                     SW_E8M0: tl.constexpr, B: tl.constexpr, MP: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr,
                     SPLIT_ROWS: tl.constexpr, X_GROUP: tl.constexpr = 0,
                     QUANT_X: tl.constexpr = True, PDL: tl.constexpr = False):
    """out[M, N] for M <= MP (1, 2 or 4 rows) on the CUDA cores: the numerics of the QUANT_A
    path of :func:`_fp8_gemm_kernel` (activation quantized per row and B-block as
    ``act_quant``; fp32 sums; bf16 out rounded to nearest-even), the sums in another order.

    Grouped weights (``X_GROUP`` > 0, a multiple of BN: ``attn.wo_a``): weight rows
    ``[g·X_GROUP, (g+1)·X_GROUP)`` read columns ``[g·K, (g+1)·K)`` of x.  QUANT_X=False: x is
    used as it is (the reference's bf16 GEMM of a dequantized weight: x·w8·sw, exact products).

    Grid (N tiles of BN rows, SPLITS); BN divides B, so one weight-scale row serves the tile.
    Split s covers the K blocks ``[s·k_blocks_per_split, min((s+1)·k_blocks_per_split, n_kb))``
    in steps of BK columns (B·2^i); per step:

    * W as [BK/16, BN, 16] e4m3: one 16-byte vector per (16-column group, row), streamed
      evict-first; lanes run along K (the compiler orders the tile's dims so);
    * the activation step of all rows quantized once per program (not per N row) by
      :func:`quantize_block_rows` (a row per token and B-block) and scaled by sx·sw: x8·sx·sw
      is exact for e8m0 sw (powers of two; with fp32 sw one fp32 rounding per activation
      element, as in the twin's dequantized weight);
    * each thread multiply-adds its 16 columns per (group, row) (e4m3 -> fp32 converts; a
      product of two e4m3 values times powers of two is exact in fp32) into an fp32 partial per
      (token, group, row) kept across the steps: per block, Σ x8·w8·sx·sw equals
      (Σ x8·w8)·sx·sw up to the order of the fp32 sums.

    SPLIT_ROWS=False (MP > 1): each row's step quantized on its own (:func:`_gemv_x_row`), one
    layout change per row, no reshape across rows / tl.split (the fallback if the split form
    miscompiles: a reshape + split of a small tile once gave wrong results on the H200, issue
    #5 of the expert GEMV).

    The partials are summed across lanes once, at the end; splits are reduced in the launch by
    :func:`splitk_reduce` (fixed order, deterministic) as in the MMA kernel."""
    grid_dependency_sync(PDL)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    G: tl.constexpr = BK // 16
    rn = pid_n * BN + tl.arange(0, BN)
    n_mask = rn < N
    if X_GROUP > 0:
        x_ptr += ((pid_n * BN) // X_GROUP) * K
    kcol = tl.arange(0, G)[:, None, None] * 16 + tl.arange(0, 16)[None, None, :]  # [G, 1, 16]
    w_ptrs = w_ptr + rn.to(tl.int64)[None, :, None] * stride_wn + kcol
    # BN divides B: the whole tile reads one row of weight scales.
    sw_row = sw_ptr + ((pid_n * BN) // B) * n_kb

    acc0 = tl.zeros((G, BN), dtype=tl.float32)
    acc1 = tl.zeros((G, BN), dtype=tl.float32)
    acc2 = tl.zeros((G, BN), dtype=tl.float32)
    acc3 = tl.zeros((G, BN), dtype=tl.float32)
    k_lo = split * k_blocks_per_split * B
    k_hi = tl.minimum(k_lo + k_blocks_per_split * B, n_kb * B)
    # The activation step as the [MP·NB, B] tile the quantizer takes: row r = (token r // NB,
    # block r % NB of the step).
    NB: tl.constexpr = BK // B
    rr = tl.arange(0, MP * NB)
    xm = rr // NB
    xb = rr % NB
    x_ptrs = x_ptr + xm[:, None] * stride_xm + xb[:, None] * B + tl.arange(0, B)[None, :]
    for k0 in range(k_lo, k_hi, BK):
        w = tl.load(w_ptrs + k0, mask=n_mask[None, :, None] & ((k0 + kcol) < k_hi), other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        if MP > 1 and not SPLIT_ROWS:
            xs = _gemv_x_row(x_ptr, 0, M, stride_xm, k0, k_hi, sw_row, SW_E8M0, B, BK, QUANT_X)
            acc0 += tl.sum(w * xs[:, None, :], axis=2)
            xs = _gemv_x_row(x_ptr, 1, M, stride_xm, k0, k_hi, sw_row, SW_E8M0, B, BK, QUANT_X)
            acc1 += tl.sum(w * xs[:, None, :], axis=2)
            if MP > 2:
                xs = _gemv_x_row(x_ptr, 2, M, stride_xm, k0, k_hi, sw_row, SW_E8M0, B, BK,
                                 QUANT_X)
                acc2 += tl.sum(w * xs[:, None, :], axis=2)
                xs = _gemv_x_row(x_ptr, 3, M, stride_xm, k0, k_hi, sw_row, SW_E8M0, B, BK,
                                 QUANT_X)
                acc3 += tl.sum(w * xs[:, None, :], axis=2)
        else:
            b_ok = (k0 + xb * B) < k_hi
            x = tl.load(x_ptrs + k0, mask=(b_ok & (xm < M))[:, None], other=0.0)
            if SW_E8M0:
                sw = e8m0_to_f32(tl.load(sw_row + k0 // B + xb, mask=b_ok, other=127))
            else:
                sw = tl.load(sw_row + k0 // B + xb, mask=b_ok, other=1.0)
            if QUANT_X:
                q, sx = quantize_block_rows(x.to(tl.float32))
                xs = q * (sx * sw)[:, None]
            else:
                xs = x.to(tl.float32) * sw[:, None]
            # Rows split off with tl.split (in registers): one layout change of the whole step
            # to the lanes of W (SASS: a quarter of the barriers of one quantization per row).
            if MP == 1:
                acc0 += tl.sum(w * tl.reshape(xs, (G, 16))[:, None, :], axis=2)
            elif MP == 2:
                x0, x1 = tl.split(tl.permute(tl.reshape(xs, (2, G, 16)), (1, 2, 0)))
                acc0 += tl.sum(w * x0[:, None, :], axis=2)
                acc1 += tl.sum(w * x1[:, None, :], axis=2)
            else:
                # [G, 16, m % 2, m // 2]: the first split takes m // 2, the second m % 2.
                lo, hi = tl.split(tl.permute(tl.reshape(xs, (2, 2, G, 16)), (2, 3, 1, 0)))
                x0, x1 = tl.split(lo)
                x2, x3 = tl.split(hi)
                acc0 += tl.sum(w * x0[:, None, :], axis=2)
                acc1 += tl.sum(w * x1[:, None, :], axis=2)
                acc2 += tl.sum(w * x2[:, None, :], axis=2)
                acc3 += tl.sum(w * x3[:, None, :], axis=2)
    rm = tl.arange(0, MP)[:, None]
    total = tl.where(rm == 0, tl.sum(acc0, axis=0)[None, :], 0.0)                # [MP, BN]
    if MP > 1:
        total = tl.where(rm == 1, tl.sum(acc1, axis=0)[None, :], total)
    if MP > 2:
        total = tl.where(rm == 2, tl.sum(acc2, axis=0)[None, :], total)
        total = tl.where(rm == 3, tl.sum(acc3, axis=0)[None, :], total)
    mask = (rm < M) & n_mask[None, :]
    out = out_ptr + rm * stride_om + rn[None, :]
    if SPLITS > 1:
        part = ws_ptr + rm * stride_wm + rn[None, :]
        last, total = splitk_reduce(total, part, mask, split, stride_ws,
                                    count_ptr + pid_n, SPLITS)
        if last:
            store_rne(out, total, mask)
    else:
        store_rne(out, total, mask)


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Tile plan of one FP8 GEMM launch."""

    BM: int
    BN: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    fuse_quant: bool = True  # quantize A inside the GEMM (decode) or in a separate pass
    # The CUDA-core GEMV kernel (``_fp8_gemv_kernel``, 1-4 rows) instead of the MMA kernel: BN
    # rows per N tile (a divisor of the block), BK columns per K step (a power-of-two multiple
    # of the block); BM, group_m and fuse_quant do not apply (A is always quantized in it).
    gemv: bool = False
    BK: int = 512


# Up to this many rows the activation is quantized inside the GEMM (each N tile re-quantizes
# its few rows); beyond, once in its own pass (measured faster from 64 rows: the in-GEMM
# quantization of 64 rows made every tile CUDA-core bound, e.g. wo_b 46.4 vs 20.2 µs).
_FUSE_QUANT_MAX_M = 16
# Beyond this many rows the prefill plan (no K split).
_DECODE_MAX_M = 512
# One-row GEMV plans without split-K, warps along K (pick_fp8_gemv_config).  H200, 2026-12-04
# (docs/PERFORMANCE.md eighteenth session): alone faster (bench/fp8_decode_sweep.py --gemv
# --sweep --wide: V4-Flash's six projections 52.5 -> 47.1 µs), in the 4-layer B=1 step not
# (interleaved graph replays: 890.4 against 887.0 µs with the seventh session's rule): off;
# DSV4_FP8_GEMV_WIDE=1 turns it on.
GEMV_WIDE_ONE_ROW = os.environ.get("DSV4_FP8_GEMV_WIDE", "0") == "1"
# Up to this many rows (at most GEMV_LIMIT) pick_fp8_config plans the CUDA-core GEMV kernel.
# H200 (bench/fp8_decode_sweep.py --quick, docs/PERFORMANCE.md seventh session), the five
# V4-Flash projections of a layer: 1 row 55.0 -> 46.2 µs (wq_a+wkv 8.0 -> 5.3), 2 rows 55.1 ->
# 50.4, 4 rows 55.5 -> 83.8 (slower: the MMA kernel from 3 rows).
# DSV4_FP8_GEMV_MAX_M overrides it (0: off).
GEMV_MAX_M = int(os.environ.get("DSV4_FP8_GEMV_MAX_M", "2"))
# Rows the GEMV kernel holds (its accumulators are unrolled per row: MP = 1, 2 or 4).
GEMV_LIMIT = 4
# fp8_grouped_linear (attn.wo_a) runs the GEMV up to this many rows (the model's bf16 weight
# takes more: cuBLAS on it beat the in-register-dequant MMA kernel from 16 rows, seventh session).
GEMV_GROUPED_MAX_M = 2
# 2-4 rows: quantize the rows' activation step together and split the rows off in registers
# (True), or quantize each row on its own (False: the fallback form, see _fp8_gemv_kernel).
GEMV_SPLIT_ROWS = os.environ.get("DSV4_FP8_GEMV_SPLIT_ROWS", "1") == "1"


@lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a small stand-in off the GPU)."""
    if device.type != "cuda":
        return 4  # the interpreter: a token value that still exercises split-K
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _pow2_at_least(v: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(v, 1.0))))


def _pow2_at_most(v: float) -> int:
    return 1 << max(0, math.floor(math.log2(max(v, 1.0))))


def pick_fp8_config(M: int, N: int, K: int, block: int, device: torch.device) -> Fp8GemmConfig:
    """Tile plan by shape, from the H200 sweep of ``bench/fp8_decode_sweep.py`` (sixth session,
    docs/PERFORMANCE.md: the six projections of a V4-Flash step at 1, 16, 64 and 256 rows).

    * M <= 16 (16-row MMA tiles, A quantized in the GEMM, 8 warps): 256-wide N tiles unsplit
      when they alone give ~one program per SM (wq_b), else 128-wide tiles split over K so
      that ~2 programs per SM stream the weight (<= 8 splits of >= 2 K blocks each).  Splits
      cost no launch: the last split of each tile sums the fp32 slices in the kernel.
    * 16 < M <= 64: A quantized once in its own pass, 64-wide N tiles, 4 warps, 4 stages, the
      fewest power-of-two K splits that reach ~3/4 of a program per SM (wo_b at 64 rows: 20.2
      µs against 46.4 for the former in-GEMM quantization with 128-wide tiles).
    * 64 < M <= 512: 64×128 tiles (64×64 for N <= 2048), split over K while there are fewer
      than ~2 programs per SM and each split keeps >= 16 K blocks.
    * Prefill (M > 512): 64×128 tiles, one warpgroup, 4 stages, A quantized in its own pass.
    * 0 < M <= GEMV_MAX_M (2): the CUDA-core GEMV plan of :func:`pick_fp8_gemv_config`.
    """
    if 0 < M <= min(GEMV_MAX_M, GEMV_LIMIT):
        return pick_fp8_gemv_config(M, N, K, block, device)
    n_kb = triton.cdiv(K, block)
    stages = 4 if block >= 128 else 6
    sms = sm_count(device)
    if M > _DECODE_MAX_M:
        return Fp8GemmConfig(BM=64, BN=128, num_warps=4, num_stages=stages, fuse_quant=False)
    if M > 64:
        bn = 64 if N <= 2048 else 128
        tiles = triton.cdiv(M, 64) * triton.cdiv(N, bn)
        split = max(1, min(_pow2_at_most(2 * sms / tiles), n_kb // 16))
        return Fp8GemmConfig(BM=64, BN=bn, split_k=split, num_warps=4, num_stages=stages,
                             fuse_quant=False)
    bm = max(16, triton.next_power_of_2(M))
    max_split = max(1, min(8, n_kb // 2))
    if M > _FUSE_QUANT_MAX_M:
        tiles = triton.cdiv(M, bm) * triton.cdiv(N, 64)
        split = min(max_split, _pow2_at_least(0.72 * sms / tiles))
        return Fp8GemmConfig(BM=bm, BN=64, split_k=split, num_warps=4, num_stages=stages,
                             fuse_quant=False)
    if triton.cdiv(N, 256) >= 0.9 * sms:
        return Fp8GemmConfig(BM=bm, BN=256, split_k=1, num_warps=8, num_stages=3)
    tiles = triton.cdiv(N, 128)
    split = min(max_split, _pow2_at_least(2 * sms / tiles))
    return Fp8GemmConfig(BM=bm, BN=128, split_k=split, num_warps=8,
                         num_stages=3 if block >= 128 else 6)


# GEMV plans: the most K splits (each split costs an fp32 partial per output and a share of the
# reduction).
_GEMV_MAX_SPLIT = 16


def pick_fp8_gemv_config(M: int, N: int, K: int, block: int, device: torch.device
                         ) -> Fp8GemmConfig:
    """GEMV plan for 1-4 rows, from the H200 sweeps (``bench/fp8_decode_sweep.py --gemv --sweep
    [--wide]``, docs/PERFORMANCE.md seventh and eighteenth sessions; V4-Flash's projections):

    * 1 row (the default): K steps of 512 columns, 16-row N tiles on 2 warps (32 rows on 4
      warps above 8192 rows: wq_b), the most power-of-two K splits that keep ~8 programs per
      SM (wq_a+wkv 96 tiles × 8, wq_b 1024 × 1, wo_b and w1+w3 256 × 4);
    * 1 row with :data:`GEMV_WIDE_ONE_ROW`: no K split — one program per 16-row N tile (32 on
      4 warps above 8192 rows) streams the whole K, its warps along K, as many as keep ~2048
      warps in the launch (2-8: wo_a 512 tiles × 4, wo_b / w1+w3 / w2 256 × 8), K steps of
      4096·warps / BN columns (8 16-byte vectors a thread): alone wq_a+wkv 4.9 -> 4.6, wo_a
      12.1 -> 10.2, wo_b 12.5 -> 11.0, w1+w3 7.6 -> 6.7, w2 5.3 -> 4.4 µs, wq_b 10.1 the
      same, but no faster in the decode step;
    * 2-4 rows: K steps of 256 columns, 64-row tiles on 4 warps, ~4 programs per SM (wq_a+wkv
      24 × 16, wq_b 512 × 1, wo_b / w1+w3 / w2 64 × 8): 2 rows 51.1 -> 44.5 µs.

    K steps are at least the block (one weight scale per step and row) and at most the K extent;
    N tiles at most the block (one scale row per tile); splits within the K steps (<= 16)."""
    sms = sm_count(device)
    if M <= 1 and GEMV_WIDE_ONE_ROW:
        # One program per N tile over the whole K (no split-K tail), its warps along K: each
        # thread loads 8 16-byte weight vectors per step (BK = 4096·warps / BN).
        bn = 16 if N <= 8192 else 32
        tiles = triton.cdiv(N, bn)
        warps = 4 if bn == 32 else max(2, min(8, _pow2_at_most(2048 / tiles)))
        bk = max(block, min(4096 * warps // bn, triton.next_power_of_2(max(K, 16))))
        bn = min(bn, block)
        warps = max(1, min(warps, bn * bk // 512))      # at least one 16-byte vector a lane
        return Fp8GemmConfig(BM=1, BN=bn, split_k=1, num_warps=warps, num_stages=1, gemv=True,
                             BK=bk)
    if M <= 1:
        bk_pref, programs = 512, 8 * sms
        bn, warps = (16, 2) if N <= 8192 else (32, 4)
    else:
        bk_pref, programs = 256, 4 * sms
        bn, warps = 64, 4
    bk = max(block, min(bk_pref, triton.next_power_of_2(max(K, 16))))
    bn = min(bn, block)
    warps = max(1, min(warps, bn // 8))
    steps = triton.cdiv(K, bk)
    tiles = triton.cdiv(N, bn)
    split = max(1, min(_GEMV_MAX_SPLIT, steps, _pow2_at_most(programs / tiles)))
    return Fp8GemmConfig(BM=triton.next_power_of_2(M), BN=bn, split_k=split, num_warps=warps,
                         num_stages=1, gemv=True, BK=bk)


def _check_gemv_plan(cfg: Fp8GemmConfig, M: int, block: int) -> None:
    if M > GEMV_LIMIT:
        raise ValueError(f"fp8_linear: the GEMV plan serves at most {GEMV_LIMIT} rows; found {M}")
    if cfg.BN < 1 or cfg.BN & (cfg.BN - 1) or block % cfg.BN:
        raise ValueError(f"fp8_linear: GEMV BN must be a power of two dividing the block "
                         f"{block}; found {cfg.BN}")
    if cfg.BK < 16 or cfg.BK & (cfg.BK - 1) or cfg.BK % block:
        raise ValueError(f"fp8_linear: GEMV BK must be a power-of-two multiple of the block "
                         f"{block}; found {cfg.BK}")


# Split-K arrival counters, one int32 per output tile, per device.  Every launch leaves them at
# zero (the last split of each tile resets its counter), so they are zeroed once, at allocation,
# and never per call.  Growing allocates: the first call of each shape must happen before any
# CUDA-graph capture (the engine's and the bench's warm-up runs do that), and the split plans
# (FP8 GEMM, experts, linear_fp32: all share this buffer) never need more than a few tiles per
# SM, well under the initial size.  Launches that could run concurrently on two streams of one
# device would share these counters: the ops run a device's kernels on one stream.
_SPLITK_MIN_COUNTERS = 4096
# Keyed by the device (main lane) or (device, lane) (dsv4.ops.streams).
_splitk_counter_cache: dict[Any, torch.Tensor] = {}
# Outgrown buffers are kept alive: a captured CUDA graph still holds their addresses.
_splitk_retired: list[torch.Tensor] = []


def splitk_counters(device: torch.device, tiles: int, op: str = "split-K") -> torch.Tensor:
    """The zeroed int32 arrival counters of ``device``, at least ``tiles`` of them: one buffer
    per device shared by every split-K kernel (FP8 GEMM, experts, ``linear_fp32``), whose
    launches are stream-ordered and each leave their counters at zero.  ``op`` names the caller
    in the error raised when the buffer would have to grow inside a CUDA-graph capture."""
    # One buffer per stream lane (dsv4.ops.streams): launches of the two lanes may overlap.
    lane = current_lane()
    key: Any = device if lane == 0 else (device, lane)
    buf = _splitk_counter_cache.get(key)
    if buf is not None and buf.numel() >= tiles:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{op}: a split-K launch needs {tiles} tile counters but the buffer holds "
            f"{0 if buf is None else buf.numel()}; growing it inside a CUDA-graph capture is not "
            "allowed: run this shape once before capturing")
    if buf is not None:
        _splitk_retired.append(buf)
    size = max(_SPLITK_MIN_COUNTERS, triton.next_power_of_2(tiles))
    buf = torch.zeros(size, dtype=torch.int32, device=device)
    _splitk_counter_cache[key] = buf
    return buf


def splitk_workspace(out: torch.Tensor, split: int, tiles: int, op: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials [split, M, N], arrival counters) of a split-K GEMM writing ``out`` [M, N]
    over ``tiles`` output tiles; with one split neither is touched (``out`` stands in).  The
    partials come from the caching allocator per call (also inside CUDA graphs)."""
    if split == 1:
        return out, out
    M, N = out.shape
    ws = torch.empty(split, M, N, dtype=torch.float32, device=out.device)
    return ws, splitk_counters(out.device, tiles, op)


def _check_fp8_args(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, block: int) -> None:
    if w8.dim() != 2 or w8.dtype != _E4M3:
        raise ValueError(f"fp8_linear: weight must be a 2-D float8_e4m3fn tensor; found "
                         f"{w8.dtype} of shape {tuple(w8.shape)}")
    N, K = w8.shape
    if x.shape[-1] != K:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} input features, weight expects {K}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"fp8_linear: block must be a power of two >= 16; found {block}")
    if K % block:
        raise ValueError(f"fp8_linear: input features {K} are not a multiple of block {block}")
    want = (triton.cdiv(N, block), triton.cdiv(K, block))
    if tuple(w_scale.shape) != want:
        raise ValueError(f"fp8_linear: weight scale must be {list(want)} for a [{N}, {K}] weight "
                         f"with block {block}; found {list(w_scale.shape)}")
    if w_scale.dtype not in (_E8M0, torch.float32):
        raise ValueError(f"fp8_linear: weight scale dtype must be float8_e8m0fnu or float32; "
                         f"found {w_scale.dtype}")
    if x.device != w8.device or w_scale.device != w8.device:
        raise ValueError(f"fp8_linear: x, weight and scale must share a device; found "
                         f"{x.device}, {w8.device}, {w_scale.device}")


def _scale_operand(w_scale: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Block scales as the kernels take them: (fp32 scales, False) or (e8m0 bytes, True)."""
    if w_scale.dtype == torch.float32:
        return w_scale.contiguous(), False
    return w_scale.contiguous().view(torch.uint8), True


# Prefill-sized FP8 block GEMMs through cuBLAS's block-scaled FP8 kernel (``torch._scaled_mm``
# with 1x128 activation and 128x128 weight scales; CUDA >= 12.9): on the H200 it gave
# _fp8_gemm_kernel's bits for e8m0 weight scales at V4-Flash's prefill shapes, 950-1,230 TFLOP/s
# against 200-685 (docs/PERFORMANCE.md, twentieth session).  Used from FP8_CUBLAS_MIN_M rows;
# DSV4_FP8_CUBLAS=0: never.
FP8_CUBLAS = os.environ.get("DSV4_FP8_CUBLAS", "1") == "1"
FP8_CUBLAS_MIN_M = int(os.environ.get("DSV4_FP8_CUBLAS_MIN_M", "512"))
# device index -> whether this torch / cuBLAS runs the block-scaled call (probed once)
_CUBLAS_BLOCK_FP8: dict[int, bool] = {}
# e8m0 weight scale tensor -> (its version, the fp32 scales cuBLAS takes)
_FP32_SCALES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def tensor_version(t: torch.Tensor) -> int | None:
    """``t._version``, None for inference tensors (they keep no version counter and cannot
    change): the key under which per-tensor caches know a tensor is unchanged."""
    try:
        return t._version
    except RuntimeError:      # inference tensors keep no version counter (and cannot change)
        return None


def _fp32_block_scales(w_scale: torch.Tensor, make: bool = True) -> torch.Tensor | None:
    """The e8m0 block scales as fp32 powers of two (2^(byte - 127)), cached per tensor and
    version; None when not cached and not ``make``."""
    ver = tensor_version(w_scale)
    entry = _FP32_SCALES.get(w_scale)
    if entry is not None and entry[0] == ver:
        return entry[1]
    if not make:
        return None
    f = torch.exp2(w_scale.view(torch.uint8).to(torch.float32) - 127.0).contiguous()
    _FP32_SCALES[w_scale] = (ver, f)
    return f


def _cublas_block_fp8_works(device: torch.device) -> bool:
    """Whether torch's ``_scaled_mm`` takes block scales here (one tiny call, once a device;
    False inside a CUDA-graph capture before that)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CUBLAS_BLOCK_FP8:
        if torch.cuda.is_current_stream_capturing():
            return False
        try:
            cublas_block_fp8_mm(torch.zeros(4, 512, dtype=_E4M3, device=device),
                                torch.ones(4, 4, device=device),
                                torch.zeros(128, 512, dtype=_E4M3, device=device),
                                torch.ones(1, 4, device=device))
            _CUBLAS_BLOCK_FP8[idx] = True
        except (RuntimeError, TypeError, ValueError):
            _CUBLAS_BLOCK_FP8[idx] = False
    return _CUBLAS_BLOCK_FP8[idx]


def cublas_fp8_applies(x2: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, block: int,
                       out_dtype: torch.dtype) -> bool:
    """Whether :func:`fp8_linear` runs through cuBLAS (:data:`FP8_CUBLAS`): a CUDA x of at least
    :data:`FP8_CUBLAS_MIN_M` rows, block 128, e8m0 weight scales (the shape of the bits checked
    equal), bf16 out, N a multiple of 128 and K of 512 (cuBLAS's scale layouts), and a torch
    whose cuBLAS has the block-scaled FP8 GEMM."""
    if not (FP8_CUBLAS and x2.is_cuda and not _INTERPRET_HOST and block == 128):
        return False
    if w_scale.dtype != _E8M0 or out_dtype != torch.bfloat16 or x2.shape[0] < FP8_CUBLAS_MIN_M:
        return False
    N, K = w8.shape
    if N % 128 or K % 512:
        return False
    if torch.cuda.is_current_stream_capturing() \
            and _fp32_block_scales(w_scale, make=False) is None:
        return False    # nothing is cached inside a capture (its allocations belong to it)
    return _cublas_block_fp8_works(x2.device)


def cublas_block_fp8_mm(a: torch.Tensor, sa: torch.Tensor, w8: torch.Tensor,
                        sw: torch.Tensor) -> torch.Tensor:
    """a [M, K] e4m3 with fp32 scales sa [M, K / 128] (M a multiple of 4), w8 [N, K] e4m3
    with fp32 scales sw [N / 128, K / 128] -> a·w^T in bf16 through cuBLAS's block-scaled FP8
    GEMM, which reads the 1×128 scales outer-dim-major and B column-major ([K, N] = w8^T)."""
    return torch._scaled_mm(a, w8.t(), scale_a=sa.t().contiguous().t(), scale_b=sw.t(),
                            out_dtype=torch.bfloat16)


def _fp8_linear_cublas(x2: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                       block: int) -> torch.Tensor:
    """x2 [M, K] quantized by :func:`act_quant`, times the block-FP8 weight through cuBLAS:
    bf16 [M, N] (x2 padded to a multiple of 4 rows for it)."""
    M = x2.shape[0]
    pad = -M % 4
    if pad:
        x2 = torch.nn.functional.pad(x2, (0, 0, 0, pad))
    a, sa = act_quant(x2, block)
    out = cublas_block_fp8_mm(a, sa, w8, _fp32_block_scales(w_scale))
    return out[:M] if pad else out


def fp8_linear_with_config(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, block: int,
                           out_dtype: torch.dtype | None, cfg: Fp8GemmConfig | None
                           ) -> torch.Tensor:
    """:func:`fp8_linear` with an explicit tile plan (``None``: :func:`pick_fp8_config`)."""
    _check_fp8_args(x, w8, w_scale, block)
    out_dtype = out_dtype or x.dtype
    N, K = w8.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M == 0 or N == 0:
        return torch.empty(*lead, N, dtype=out_dtype, device=x.device)
    w8 = w8 if w8.stride(1) == 1 else w8.contiguous()
    n_kb = K // block
    if cfg is None:
        cfg = pick_fp8_config(M, N, K, block, x.device)
    sw, sw_e8m0 = _scale_operand(w_scale)
    if cfg.gemv:
        return _fp8_gemv(x2, w8, sw, sw_e8m0, block, out_dtype, cfg).view(*lead, N)
    if cfg.fuse_quant:
        a, sa = x2, x2  # sa unused when QUANT_A
    else:
        a, sa = act_quant(x2, block)
    split = max(1, min(cfg.split_k, n_kb))
    kbps = triton.cdiv(n_kb, split)
    split = triton.cdiv(n_kb, kbps)  # every split gets >= 1 K block (the last may get fewer)
    tiles = triton.cdiv(M, cfg.BM) * triton.cdiv(N, cfg.BN)
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    ws, counters = splitk_workspace(out, split, tiles, "fp8_linear")
    _fp8_gemm_kernel[(tiles, split)](
        a, sa, w8, sw, out, ws, counters, M, N, K, a.stride(0), w8.stride(0), out.stride(0),
        ws.stride(0) if split > 1 else 0, ws.stride(-2), n_kb, kbps,
        QUANT_A=cfg.fuse_quant, SW_E8M0=sw_e8m0, B=block, BM=cfg.BM, BN=cfg.BN,
        GROUP_M=cfg.group_m, SPLITS=split, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_args(a))
    return out.view(*lead, N)


def _fp8_gemv(x2: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor, sw_e8m0: bool, block: int,
              out_dtype: torch.dtype, cfg: Fp8GemmConfig, groups: int = 0,
              quant_x: bool = True) -> torch.Tensor:
    """Launch ``_fp8_gemv_kernel`` for x2 [M <= 4, K] (contiguous rows): out [M, N].
    ``groups`` > 0: x2 is [M, groups·K'] and weight rows of group g read its g-th K' columns."""
    M, K = x2.shape
    N = w8.shape[0]
    x_group = N // groups if groups else 0
    if groups:
        K //= groups
        if x_group % cfg.BN:
            raise ValueError(f"fp8 grouped GEMV: BN {cfg.BN} must divide the rows per group "
                             f"{x_group}")
    _check_gemv_plan(cfg, M, block)
    n_kb = K // block
    split = max(1, min(cfg.split_k, n_kb))
    kbps = triton.cdiv(n_kb, split)
    split = triton.cdiv(n_kb, kbps)  # every split gets >= 1 K block (the last may get fewer)
    tiles = triton.cdiv(N, cfg.BN)
    out = torch.empty(M, N, dtype=out_dtype, device=x2.device)
    ws, counters = splitk_workspace(out, split, tiles, "fp8_linear")
    _fp8_gemv_kernel[(tiles, split)](
        x2, w8, sw, out, ws, counters, M, N, K, x2.stride(0), w8.stride(0), out.stride(0),
        ws.stride(0) if split > 1 else 0, ws.stride(-2), n_kb, kbps,
        SW_E8M0=sw_e8m0, B=block, MP=triton.next_power_of_2(M), BN=cfg.BN, BK=cfg.BK,
        SPLITS=split, SPLIT_ROWS=GEMV_SPLIT_ROWS or M == 1, X_GROUP=x_group, QUANT_X=quant_x,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x2))
    return out


@torch_twin_off_gpu("dsv4.ops.torch_dense")
def fp8_grouped_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, block: int,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out[t, g, r] = Σ_k x[t, g, k] · W[g·R + r, k] for a block-FP8 weight W (w8 [G·R, K],
    w_scale [ceil(G·R/block), K/block]) and x [T, G, K], fp32 sums, ``out_dtype`` (default
    x.dtype): the reference's bf16 GEMM of the dequantized ``attn.wo_a`` (no activation
    quantization; bf16 x times e4m3·2^e products are exact in fp32).

    1-2 rows: the CUDA-core GEMV kernel reading the FP8 bytes (half of bf16's); more rows: the
    dequantized weight through torch (the model keeps its bf16 ``wo_a`` for those)."""
    torch_dense.check_grouped_linear_args(x, w8, w_scale, block)
    out_dtype = out_dtype or x.dtype
    T, G, K = x.shape
    R = w8.shape[0] // G
    if T == 0:
        return torch.empty(0, G, R, dtype=out_dtype, device=x.device)
    if T > GEMV_GROUPED_MAX_M:
        return torch_dense.fp8_grouped_linear(x, w8, w_scale, block, out_dtype)
    sw, sw_e8m0 = _scale_operand(w_scale)
    x2 = x.reshape(T, G * K)
    if x2.stride(1) != 1 or x2.stride(0) != G * K:
        x2 = x2.contiguous()
    cfg = pick_fp8_gemv_config(T, G * R, K, block, x.device)
    bn = cfg.BN
    while R % bn:                            # an N tile inside one group
        bn //= 2
    if bn != cfg.BN:
        cfg = replace(cfg, BN=bn, num_warps=max(1, min(cfg.num_warps, bn // 8)))
    w8 = w8 if w8.stride(1) == 1 else w8.contiguous()
    return _fp8_gemv(x2, w8, sw, sw_e8m0, block, out_dtype, cfg, groups=G,
                     quant_x=False).view(T, G, R)


@torch_twin_off_gpu("dsv4.ops.torch_dense")
def fp8_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, block: int,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """FP8 block GEMM with the activation quantization fused (spec §2.5).

    x [..., K] (bf16 / fp32); w8 [N, K] float8_e4m3fn; w_scale [ceil(N/block), K/block]
    (float8_e8m0fnu or fp32).  x is quantized per row and per ``block`` of K to e4m3 with
    power-of-two scales; ``y = Σ_kblocks (x8·sx)(W8·sW)^T`` in fp32, returned in ``out_dtype``
    (default x.dtype).  Prefill-sized calls (:func:`cublas_fp8_applies`) run cuBLAS's
    block-scaled FP8 GEMM on the quantized x instead of ``_fp8_gemm_kernel`` (same bits).
    """
    _check_fp8_args(x, w8, w_scale, block)
    out_dtype = out_dtype or x.dtype
    K = w8.shape[1]
    x2 = x.reshape(-1, K)
    if cublas_fp8_applies(x2, w8, w_scale, block, out_dtype):
        x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
        w8 = w8 if w8.stride(1) == 1 else w8.contiguous()
        return _fp8_linear_cublas(x2, w8, w_scale, block).view(*x.shape[:-1], w8.shape[0])
    return fp8_linear_with_config(x, w8, w_scale, block, out_dtype, None)


# ------------------------------------------------------------------------- exact fp32 x bf16
@triton.jit
def split_bf16x3(f):
    """An fp32 tile ``f`` as three bf16 tiles whose sum is f exactly (each remainder is exact in
    fp32 and has <= 16, then <= 8 significant bits; the interpreter's truncating cast splits
    exactly too): bf16 MMAs against the parts give exact products."""
    f1 = f.to(tl.bfloat16)
    r = f - f1.to(tl.float32)
    f2 = r.to(tl.bfloat16)
    f3 = (r - f2.to(tl.float32)).to(tl.bfloat16)
    return f1, f2, f3


@triton.jit
def _dot_bf16x3(acc, a, f):
    """acc += a @ f for a bf16 tile ``a`` and an fp32 tile ``f`` split by :func:`split_bf16x3`:
    each product is exact and only the fp32 sums round."""
    f1, f2, f3 = split_bf16x3(f)
    acc += mma(a, f3, "ieee")
    acc += mma(a, f2, "ieee")
    acc += mma(a, f1, "ieee")
    return acc
