"""Triton kernel of the routed experts (spec §3.9) on quantized stacks: MXFP4 (V4-Flash/Pro) or
FP8 block (the *-Base checkpoints), and dense stacks.

Same signature as the torch twin ``dsv4.ops.torch_dense.moe_experts``:

1. plan (``dsv4.ops.triton_moe_plan``: one launch, no host sync, so a decode step can be captured in a
   CUDA graph; :func:`moe_plan_torch` is its torch twin): sort the (token, pick) pairs by expert
   and lay them out in row blocks of BM, each block owned by one expert (a static upper bound
   of blocks; unused blocks exit at once);
2. ``_moe_up_kernel``: per (block, N tile) the gate and up GEMMs of that expert with the weights
   dequantized in registers (e2m1 codes -> fp16 bits -> fp32 × 2^scale -> compute dtype, exact),
   then the clamped SwiGLU times the routing weight, rounded to the compute dtype;
3. ``_moe_down_kernel``: the w2 GEMM of the same blocks, one output row per pair;
4. ``_moe_combine_kernel``: per token the fp32 sum of its picks (fixed order, no atomics).

Split-K (decode: :attr:`MoeConfig.split_up` / ``split_down`` > 1, grid axis 2): each split of
the up or down GEMM walks its share of the K steps and stores its fp32 partial tile(s) in a
per-call workspace; after a barrier it counts itself in at the tile's int32 arrival counter
(one atomic, acq_rel at GPU scope), and the last split to arrive sums the partials in the fixed
order s = 0..S-1, runs what the unsplit kernel runs after its K loop, and resets the counter.
The result is bit-reproducible whatever the arrival order, and equal to the unsplit plan's to
fp32 rounding (another summation order), not bit-equal.  The counters are one persistent
zeroed buffer per device shared with the other split-K kernels
(:func:`dsv4.ops.triton_dense.splitk_counters`), never re-zeroed per call.

Large calls (prefill: at least ``DEQUANT_GEMM_MIN_ROWS`` pairs per expert on average; off by
default until measured on the GPU) can take :func:`moe_experts_grouped` instead: every expert dequantized once by ``_dequant_experts_kernel``
into a scratch, then ``torch._grouped_mm`` (cuBLAS) for the two GEMMs, the same combine.

MXFP4 bytes pack k = 2j (low nibble) and k = 2j + 1 (high nibble): the kernels multiply the even
and the odd columns of the activation by the two nibble planes separately, so the codes never need
interleaving.  The activations are made ready for that once per call by ``_moe_prep_kernel``
(gathered into the plan's sorted rows, FP8 fake-quantized per ``act_block`` under official
numerics, and for MXFP4 split per K step into [even columns | odd columns]): before, every N tile
of the GEMMs repeated the quantization of its rows (16× at the up GEMM, 32× at the down GEMM) and
read them with stride-2 loads.

On the GPU with bf16 compute, an MXFP4 byte pair is decoded by a few bit operations in inline
PTX (:data:`FP4_DECODE` "asm", :func:`_fp4_decode_asm`): four bytes -> eight bf16 values (code ×
2^-126, the e2m1 subnormal landing on bf16's; 3 integer operations per pair of values), then
one packed bf16 multiply by the group's 2^(s-1) when every scale byte of the stacks is <= 128
(``SCALE_LE_128``: checked once per scale tensor, :func:`_fold_ok`; real checkpoints' scales
are far below 2^1), else two (2^63, then 2^(s-64)); every step is exact.  The interpreter and
fp32 compute take the fp32 decode (:func:`_mxfp4_planes`), which is exact too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.torch_dense import ExpertWeights, expert_k_step
from dsv4.ops.triton_dense import (
    _INTERPRET_HOST,
    INTERPRET,
    tensor_version,
    mma,
    pow2_from_exp,
    round_as,
    round_to_bf16,
    round_to_e4m3,
    splitk_counters,
    store_rne,
    torch_twin_off_gpu,
    ue8m0_exponent,
)
from dsv4.ops.triton_moe_plan import (SMALL_PLAN_MAX_PAIRS, flat_ids, moe_plan,
                                      moe_plan_torch, small_plan_rows, small_plan_store)

__all__ = [
    "DEQUANT_GEMM_MIN_ROWS",
    "DecodePlan",
    "FP4_DECODE",
    "MoeConfig",
    "decode_plan_params",
    "dequant_experts",
    "moe_encode_ahead",
    "moe_experts",
    "moe_experts_grouped",
    "moe_experts_shared",
    "moe_experts_with_config",
    "moe_plan",
    "moe_plan_prep",
    "moe_plan_torch",
    "moe_prep",
    "pick_moe_config",
]

_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_FMT_CODE = {"dense": 0, "fp4": 1, "fp8": 2}


# ------------------------------------------------------------------------------ jit helpers
@triton.jit
def _e2m1_fp16_planes(byte):
    """Packed MXFP4 bytes (uint8, any shape) -> (low-nibble, high-nibble) fp16 tensors holding
    each e2m1 value × 2^-14 exactly: the code's 3 magnitude bits shifted into fp16's
    exponent/mantissa field (the e2m1 subnormal 0.5 lands on fp16's subnormal 2^-15), the sign
    bit moved to bit 15."""
    b = byte.to(tl.int32)
    lo = ((b & 7) << 9) | ((b & 8) << 12)
    hi = ((b & 0x70) << 5) | ((b & 0x80) << 8)
    return (lo.to(tl.uint16).to(tl.float16, bitcast=True),
            hi.to(tl.uint16).to(tl.float16, bitcast=True))


@triton.jit
def _mxfp4_planes(byte, scale, BN: tl.constexpr, BKH: tl.constexpr, OUT: tl.constexpr):
    """Packed MXFP4 bytes [BN, BKH] (uint8) and their e8m0 exponents [BN, BKH // 16] (uint8)
    -> (even-k plane, odd-k plane), each [BN, BKH] in ``OUT``, exactly.

    A code's low 3 bits shifted into fp16's exponent/mantissa field give the e2m1 value × 2^-14
    (its subnormal 0.5 lands on fp16's subnormal 2^-15, which converts to fp32 exactly); the
    sign bit goes to bit 15.  The scale 2^(s-127) and the 2^14 fold into one fp32 power of two.
    """
    lo, hi = _e2m1_fp16_planes(byte)
    lo = lo.to(tl.float32)
    hi = hi.to(tl.float32)
    f = ((scale.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)      # 2^(s - 113)
    f = tl.reshape(tl.broadcast_to(f[:, :, None], (BN, BKH // 16, 16)), (BN, BKH))
    return (lo * f).to(OUT), (hi * f).to(OUT)


def _fp4_decode_asm(fold: bool) -> str:
    """Inline PTX of the MXFP4 -> bf16 decode: four bytes (one 32-bit register $4, 8 codes) ->
    their low-nibble codes as two bf16x2 registers ($0: bytes 0, 1; $1: bytes 2, 3) and their
    high-nibble codes as two more ($2, $3), times the group scales ($5: bytes 0, 1; $6: 2, 3).

    prmt puts bytes 0, 1 (2, 3) in the high bytes of the two 16-bit halves of t0 (t1), zeros
    below; a code's magnitude bits then go to bf16 bits 8..6 (value = e2m1 × 2^-126: the e2m1
    subnormal 0.5 is bf16's subnormal 2^-127) and its sign to bit 15.  Low nibble: t >> 2 holds
    the magnitude bits in place and zeros at bit 15, t << 4 the sign in place and zeros at bits
    8..6, so one or and one mask merge them; high nibble: the sign is in place in t.  Then
    ``fold``: one exact multiply by the bf16x2 2^(s-1) (s <= 128); else two, by 2^63 then by
    2^(s-64) (s <= 191)."""
    if fold:
        mul = ["mul.rn.bf16x2 {d}, a, {s};"]
    else:
        mul = ["mul.rn.bf16x2 a, a, c;", "mul.rn.bf16x2 {d}, a, {s};"]
    lines = [".reg .b32 z, c, t0, t1, a, b;", "mov.b32 z, 0;"]
    if not fold:
        lines.append("mov.b32 c, 0x5F005F00;")          # 2^63 in both halves
    lines += ["prmt.b32 t0, $4, z, 0x1404;", "prmt.b32 t1, $4, z, 0x3424;"]
    for d, t, sc in (("$0", "t0", "$5"), ("$1", "t1", "$6")):
        lines += [f"shr.b32 a, {t}, 2;", f"shl.b32 b, {t}, 4;", "or.b32 a, a, b;",
                  "and.b32 a, a, 0x81C081C0;"] + [m.format(d=d, s=sc) for m in mul]
    for d, t, sc in (("$2", "t0", "$5"), ("$3", "t1", "$6")):
        lines += [f"shr.b32 a, {t}, 6;", "and.b32 a, a, 0x01C001C0;",
                  f"and.b32 b, {t}, 0x80008000;", "or.b32 a, a, b;"]
        lines += [m.format(d=d, s=sc) for m in mul]
    return "{\n" + "\n".join(lines) + "\n}"


_FP4_TO_BF16_ASM = tl.constexpr(_fp4_decode_asm(False))
# The one-multiply variant, for stacks whose scale bytes are all <= 128 (:func:`_fold_ok`).
_FP4_TO_BF16_FOLD_ASM = tl.constexpr(_fp4_decode_asm(True))


@triton.jit
def _mxfp4_planes_bf16(byte, scale, BN: tl.constexpr, BKH: tl.constexpr, FOLD: tl.constexpr):
    """:func:`_mxfp4_planes` for bf16 compute on the GPU, in packed bit operations (inline PTX,
    module docstring): exact for scales up to 2^64 (e8m0 byte <= 191); FOLD: one multiply per
    pair instead of two, exact for scales up to 2^1 (byte <= 128)."""
    if FOLD:
        f = ((scale.to(tl.int32) + 126) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        f = ((scale.to(tl.int32) + 63) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    f = tl.reshape(tl.broadcast_to(f[:, :, None], (BN, BKH // 16, 16)), (BN, BKH))
    if FOLD:
        lo, hi = tl.inline_asm_elementwise(_FP4_TO_BF16_FOLD_ASM, "=r,=r,=r,=r,r,r,r",
                                           [byte, f], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=4)
    else:
        lo, hi = tl.inline_asm_elementwise(_FP4_TO_BF16_ASM, "=r,=r,=r,=r,r,r,r", [byte, f],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                           pack=4)
    return lo, hi


@triton.jit
def _fake_quant_pair(a, b):
    """FP8 fake quantization (spec §2.5: amax floor 1e-4, ue8m0 scale, e4m3 RNE) of the rows of
    one activation block held as two halves a, b [R, C] (fp32); returns both halves dequantized."""
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(a), axis=1), tl.max(tl.abs(b), axis=1)), 1e-4)
    e = ue8m0_exponent(amax)
    inv = pow2_from_exp(-e)[:, None]
    s = pow2_from_exp(e)[:, None]
    qa = round_to_e4m3(tl.clamp(a * inv, -448.0, 448.0)) * s
    qb = round_to_e4m3(tl.clamp(b * inv, -448.0, 448.0)) * s
    return qa, qb


@triton.jit
def _to_compute(v, OUT: tl.constexpr):
    """fp32 -> the compute dtype with round-to-nearest-even (the interpreter's cast truncates)."""
    if INTERPRET:
        if OUT == tl.bfloat16:
            v = round_to_bf16(v)
    return v.to(OUT)


@triton.jit
def _load_weight_tile(w_ptr, s_ptr, e, rn, n_mask, k0, stride_we, stride_wn, stride_se,
                      stride_sn, FMT: tl.constexpr, SB: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, OUT: tl.constexpr, SW_E8M0: tl.constexpr,
                      FAST_FP4: tl.constexpr, SCALE_LE_128: tl.constexpr,
                      KCHUNK: tl.constexpr = False, n_rows=0):
    """One [BN, BK] weight tile of expert e at K offset k0, dequantized into ``OUT``.

    FMT 1 (fp4): returns the (even-k, odd-k) planes [BN, BK/2] (FAST_FP4: the inline-PTX
    decode, bf16 only; SCALE_LE_128: its one-multiply variant; KCHUNK: codes and scales stored
    K-chunk-major with chunks of BK, ``n_rows`` rows per expert — ``ExpertWeights.kchunk``);
    FMT 2 (fp8) and 0 (dense): returns the tile twice (the second value unused)."""
    # 64-bit expert offsets: E × (N·K) passes 2^31 elements for V4-Pro stacks and for the
    # bf16 w1|w3 scratch of V4-Flash (255 × 16.8M).
    e = e.to(tl.int64)
    if FMT == 1:
        rj = tl.arange(0, BK // 2)
        rs = tl.arange(0, BK // 32)
        if KCHUNK:
            # Chunk k0 / BK holds every row's BK/2 bytes (BK/32 scales) in turn.
            w_off = (k0 // BK) * (n_rows * (BK // 2)) + rn[:, None] * (BK // 2) + rj[None, :]
            s_off = (k0 // BK) * (n_rows * (BK // 32)) + rn[:, None] * (BK // 32) + rs[None, :]
        else:
            w_off = rn[:, None] * stride_wn + (k0 // 2 + rj)[None, :]
            s_off = rn[:, None] * stride_sn + (k0 // 32 + rs)[None, :]
        byte = tl.load(w_ptr + e * stride_we + w_off, mask=n_mask[:, None], other=0)
        # Masked rows decode byte 0 to +0 whatever the scale: other=0 spares a select per group
        # (the async copy already zero-fills).
        sc = tl.load(s_ptr + e * stride_se + s_off, mask=n_mask[:, None], other=0)
        # The interpreter cannot run inline PTX: it takes the fp32 decode.
        if FAST_FP4 and not INTERPRET:
            lo, hi = _mxfp4_planes_bf16(byte, sc, BN, BK // 2, SCALE_LE_128)
        else:
            lo, hi = _mxfp4_planes(byte, sc, BN, BK // 2, OUT)
        return lo, hi
    else:
        rk = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + e * stride_we + rn[:, None] * stride_wn + rk[None, :],
                    mask=n_mask[:, None], other=0.0)
        if FMT == 2:
            # BK == SB: one scale per output row in this K step.
            sp = s_ptr + e * stride_se + (rn // SB) * stride_sn + k0 // SB
            if SW_E8M0:
                sw = ((tl.load(sp, mask=n_mask, other=127).to(tl.int32)) << 23).to(
                    tl.float32, bitcast=True)
            else:
                sw = tl.load(sp, mask=n_mask, other=1.0)
            w = _to_compute(w.to(tl.float32) * sw[:, None], OUT)
        else:
            w = w.to(OUT)
        return w, w


@triton.jit
def _load_prepped_tile(a_ptr, rm, m_mask, k0, stride_am, FMT: tl.constexpr, BK: tl.constexpr):
    """Rows rm [BM] of an activation made ready by ``_moe_prep_kernel``, K step k0: fp4 weights
    want the (even, odd) column halves (stored side by side per K step), the others the tile
    (returned twice).  Contiguous loads."""
    base = a_ptr + rm.to(tl.int64)[:, None] * stride_am + k0
    if FMT == 1:
        rj = tl.arange(0, BK // 2)
        ev = tl.load(base + rj[None, :], mask=m_mask[:, None], other=0.0)
        od = tl.load(base + (BK // 2 + rj)[None, :], mask=m_mask[:, None], other=0.0)
        return ev, od
    else:
        t = tl.load(base + tl.arange(0, BK)[None, :], mask=m_mask[:, None], other=0.0)
        return t, t


@triton.jit
def _dot_tile(acc, a_ev, a_od, w_ev, w_od, FMT: tl.constexpr):
    """acc += A · Wᵀ for one K step (fp4: even and odd planes separately)."""
    acc += mma(a_ev, tl.trans(w_ev), "ieee")
    if FMT == 1:
        acc += mma(a_od, tl.trans(w_od), "ieee")
    return acc


# ------------------------------------------------------------------------------ split-K helpers
@triton.jit
def _split_k_range(K, BK: tl.constexpr, SPLIT: tl.constexpr):
    """[k_lo, k_hi) of this program: all of K unsplit; split s = program_id(2) of S =
    num_programs(2) takes K steps s·n/S .. (s+1)·n/S (n = K / BK; shares differ by one step at
    most, none empty as the host keeps S <= n)."""
    if SPLIT:
        steps = K // BK
        s = tl.program_id(2)
        S = tl.num_programs(2)
        k_lo = (s * steps // S) * BK
        k_hi = ((s + 1) * steps // S) * BK
    else:
        k_lo = 0
        k_hi = K
    return k_lo, k_hi


@triton.jit
def _store_partial(part_ptr, offs, acc, mask, stride_part_s):
    """This split's fp32 partial tile into its slice of the workspace."""
    tl.store(part_ptr + tl.program_id(2).to(tl.int64) * stride_part_s + offs, acc, mask=mask)


@triton.jit
def _arrive_last(arrivals_ptr, tile):
    """Count this split in at the tile's arrival counter (after its partial stores); True for the
    split that arrives last, which then owns the reduction."""
    # Every thread's partial stores are issued before the single arrival, whose release makes
    # them visible to the last program's acquire.
    tl.debug_barrier()
    old = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu")
    return old == tl.num_programs(2) - 1


@triton.jit
def _sum_partials(part_ptr, offs, mask, stride_part_s):
    """Σ of the S partial tiles in the fixed order s = 0, 1, .., S-1 (bit-reproducible whatever
    the order the splits arrived in).  ``.cg`` loads read L2: never an L1 line of this SM that
    predates the other splits' stores."""
    ptrs = part_ptr + offs
    acc = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for _ in range(1, tl.num_programs(2)):
        ptrs += stride_part_s       # 64-bit pointers: slice s at s·stride without int32 products
        acc += tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    return acc


# ------------------------------------------------------------------------------ kernels
@triton.jit
def block_pairs(pair_ptr, blk, P, BM: tl.constexpr):
    """Rows of row block ``blk`` in the plan's sorted layout: (rows [BM], their (token, pick)
    pair ids, mask of the real pairs: padding rows hold ids >= P)."""
    rm = blk * BM + tl.arange(0, BM)
    pair = tl.load(pair_ptr + rm)
    return rm, pair, pair < P


@triton.jit
def block_tile_ids(N_FIRST: tl.constexpr):
    """(row block, N tile, row blocks, N tiles) of this program.  N_FIRST: grid axis 0 walks
    the N tiles of one row block (:func:`tile_grid`), so the programs resident together share
    their blocks' activation rows (and an expert's weights) in L2; else axis 0 walks the blocks."""
    if N_FIRST:
        return tl.program_id(1), tl.program_id(0), tl.num_programs(1), tl.num_programs(0)
    else:
        return tl.program_id(0), tl.program_id(1), tl.num_programs(0), tl.num_programs(1)


@triton.jit
def store_prepped(base, t, mask, FMT: tl.constexpr, QUANT: tl.constexpr, BK: tl.constexpr):
    """One K step of activation rows ``t`` [R, BK] stored GEMM-ready at ``base`` [R, 1] (each
    row's start + k0, in the destination dtype): FP8 fake-quantized per row (QUANT: the block is
    the K step), for MXFP4 (FMT 1) split into [even columns | odd columns]; rows where ``mask``
    is False are not written."""
    OUT: tl.constexpr = base.dtype.element_ty
    R: tl.constexpr = t.shape[0]
    if FMT == 1:
        ev, od = tl.split(tl.reshape(t, (R, BK // 2, 2)))
        if QUANT:
            ev, od = _fake_quant_pair(ev.to(tl.float32), od.to(tl.float32))
        rj = tl.arange(0, BK // 2)
        tl.store(base + rj[None, :], ev.to(OUT), mask=mask[:, None])
        tl.store(base + (BK // 2 + rj)[None, :], od.to(OUT), mask=mask[:, None])
    else:
        if QUANT:
            tf = t.to(tl.float32)
            t, _ = _fake_quant_pair(tf, tf)
        tl.store(base + tl.arange(0, BK)[None, :], t.to(OUT), mask=mask[:, None])


@triton.jit
def _moe_prep_kernel(src_ptr, pair_ptr, bexp_ptr, dst_ptr, P, E, TOPK, stride_src, stride_dst,
                     GATHER: tl.constexpr, FMT: tl.constexpr, QUANT: tl.constexpr,
                     BM: tl.constexpr, BK: tl.constexpr, RB: tl.constexpr,
                     PDL: tl.constexpr = False):
    """dst[row] = the GEMM-ready activation of RB rows (a slice of one row block) and one K
    step: source row pair // TOPK (GATHER: the token of the pair) or the row itself, FP8
    fake-quantized (QUANT, BK = block), for MXFP4 split into [even columns | odd columns].
    Padding rows and unused blocks are left unwritten (their GEMM rows are masked).

    Each row's BK values are one contiguous (vectorized) load, split into the even and odd
    columns in registers (a [RB, BK/2, 2] view: each thread holds whole pairs), not two
    stride-2 loads of 2 bytes per thread."""
    grid_dependency_sync(PDL)
    pid = tl.program_id(0)
    blk = pid // (BM // RB)
    k0 = tl.program_id(1) * BK
    e = tl.load(bexp_ptr + blk)
    if e < E:
        rm = pid * RB + tl.arange(0, RB)        # the rows of one block are consecutive
        pair = tl.load(pair_ptr + rm)
        m_mask = pair < P
        if GATHER:
            rows = pair // TOPK
        else:
            rows = rm
        t = tl.load(src_ptr + rows.to(tl.int64)[:, None] * stride_src + k0
                    + tl.arange(0, BK)[None, :], mask=m_mask[:, None], other=0.0)
        store_prepped(dst_ptr + rm.to(tl.int64)[:, None] * stride_dst + k0, t, m_mask, FMT,
                      QUANT, BK)


@triton.jit
def _moe_plan_prep_small_kernel(ids_ptr, src_ptr, pairs_ptr, bexp_ptr, dst_ptr, P, E, NB, TOPK,
                                stride_src, stride_dst, FMT: tl.constexpr,
                                QUANT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                                PP: tl.constexpr, NBP: tl.constexpr, RB: tl.constexpr,
                                PDL: tl.constexpr = False):
    """The routing plan of P <= PP pairs and the activation prep of ``_moe_prep_kernel``
    (GATHER) in one launch, for decode: every program works out the plan's rows in registers
    (:func:`small_plan_rows`: a few [PP, PP] comparisons, cheaper than waiting for another
    kernel); program 0 writes the plan, program 1 + j the K step j of every pair's activation
    row (x of its token, FP8 fake-quantized under QUANT, split [even | odd] for MXFP4) at its
    plan row.  Padding rows are left unwritten, as by ``_moe_prep_kernel``."""
    grid_dependency_sync(PDL)
    rp, key, valid, dest, first, nblk, first_blk = small_plan_rows(ids_ptr, P, E, BM, PP)
    pid = tl.program_id(0)
    if pid == 0:
        small_plan_store(pairs_ptr, bexp_ptr, P, E, NB, rp, key, valid, dest, first, nblk,
                         first_blk, BM, NBP, RB)
    else:
        k0 = (pid - 1) * BK
        tok = rp // TOPK
        t = tl.load(src_ptr + tok.to(tl.int64)[:, None] * stride_src + k0
                    + tl.arange(0, BK)[None, :], mask=valid[:, None], other=0.0)
        store_prepped(dst_ptr + dest.to(tl.int64)[:, None] * stride_dst + k0, t, valid, FMT,
                      QUANT, BK)


def moe_plan_prep(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, BM: int,
                  fmt: int, quant: bool, BK: int) -> tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
    """(pairs, block_expert, xs) of :func:`moe_plan` and :func:`moe_prep` (GATHER) in one launch
    for at most :data:`SMALL_PLAN_MAX_PAIRS` pairs (CUDA or the interpreter); the same values
    (xs padding rows unwritten)."""
    flat = flat_ids(topk_ids)
    P, (T, D) = flat.numel(), x.shape
    if not 0 < P <= SMALL_PLAN_MAX_PAIRS or BM < 1 or BM & (BM - 1) or D % BK:
        raise ValueError(f"moe_plan_prep: expected 1..{SMALL_PLAN_MAX_PAIRS} pairs, BM a power "
                         f"of two and D a multiple of {BK}; found P={P}, BM={BM}, D={D}")
    nb = triton.cdiv(P, BM) + min(num_experts, P)
    pairs = torch.empty(nb * BM, dtype=torch.int32, device=x.device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=x.device)
    xs = torch.empty(nb * BM, D, dtype=x.dtype, device=x.device)
    _moe_plan_prep_small_kernel[(1 + D // BK,)](
        flat, x, pairs, block_expert, xs, P, num_experts, nb, P // T, x.stride(0), xs.stride(0),
        FMT=fmt, QUANT=quant, BM=BM, BK=BK, PP=max(16, triton.next_power_of_2(P)),
        NBP=max(16, triton.next_power_of_2(nb)), RB=256, num_warps=4, **pdl_args(x))
    return pairs, block_expert, xs


@dataclass(frozen=True)
class PrepPlan:
    """Tile plan of ``_moe_prep_kernel``: ``rows`` rows per program (a power of two dividing
    the call's row block BM; larger values are clamped to BM) and num_warps."""

    rows: int = 32
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("rows", "num_warps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"PrepPlan: {name} must be a power of two; found {v!r}")


def pick_prep_plan(BM: int) -> PrepPlan:
    """Default prep plan for row blocks of BM: 32 rows per program (8 KB of bf16 per program
    at BK 128: ~32 values per thread, a few per-row reductions; at decode BM 16 stays whole).
    The H200 sweep (bench/sweep_glue.py, fifth session) had every candidate within ~5% of it
    (8,192 tokens: up 453 µs, down 230; the old kernel took 663)."""
    return PrepPlan(rows=min(BM, 32), num_warps=4)


def moe_prep(src: torch.Tensor, pairs: torch.Tensor, block_expert: torch.Tensor,
             dst: torch.Tensor, P: int, E: int, topk: int, gather: bool, fmt: int, quant: bool,
             BM: int, BK: int, plan: PrepPlan | None = None) -> torch.Tensor:
    """Launch ``_moe_prep_kernel`` over ``dst`` [blocks·BM, K] (K = src width, a multiple of
    BK) with ``plan`` (``None``: :func:`pick_prep_plan`); returns dst."""
    plan = plan or pick_prep_plan(BM)
    rb = min(plan.rows, BM)
    nb = block_expert.shape[0]
    _moe_prep_kernel[(nb * (BM // rb), src.shape[1] // BK)](
        src, pairs, block_expert, dst, P, E, topk, src.stride(0), dst.stride(0),
        GATHER=gather, FMT=fmt, QUANT=quant, BM=BM, BK=BK, RB=rb, num_warps=plan.num_warps,
        **pdl_args(src))
    return dst


@triton.jit
def weighted_swiglu(g, u, wt, limit, OUT: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """w · swiglu(g, u) in fp32 of the rows' gate / up GEMM sums g, u [R, C] and routing weights
    wt [R]: g and u rounded to the compute dtype ``OUT`` first (the twin's w1 / w3 GEMMs return
    it), the V4 clamp under HAS_LIMIT."""
    if OUT == tl.bfloat16:
        g = round_to_bf16(g)
        u = round_to_bf16(u)
    if HAS_LIMIT:
        u = tl.clamp(u, -limit, limit)
        g = tl.minimum(g, limit)
    return g * tl.sigmoid(g) * u * wt[:, None]


@triton.jit
def _up_epilogue(acc1, acc3, act_ptr, wt_ptr, rm, pair, m_mask, rn, n_mask, stride_actm, limit,
                 OUT: tl.constexpr, HAS_LIMIT: tl.constexpr, n0=0, PREP: tl.constexpr = False,
                 FMT: tl.constexpr = 0, QUANT: tl.constexpr = False, BN: tl.constexpr = 128):
    """act = w · swiglu(g, u) of one tile from the fp32 gate/up GEMM results, stored rounded;
    PREP (the tile is one whole K step of the down GEMM, BN = its BK): stored GEMM-ready
    instead (``store_prepped`` of the rounded values: what ``_moe_prep_kernel`` makes of the
    stored act)."""
    wt = tl.load(wt_ptr + pair, mask=m_mask, other=0.0)
    a = weighted_swiglu(acc1, acc3, wt, limit, OUT, HAS_LIMIT)
    if PREP:
        store_prepped(act_ptr + rm.to(tl.int64)[:, None] * stride_actm + n0,
                      round_as(a, act_ptr), m_mask, FMT, QUANT, BN)
    else:
        store_rne(act_ptr + rm.to(tl.int64)[:, None] * stride_actm + rn[None, :], a,
                  m_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_up_kernel(xs_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, pair_ptr, bexp_ptr, wt_ptr, act_ptr,
                   part1_ptr, part3_ptr, arrivals_ptr,
                   P, N, K, E, stride_xm, stride_actm, stride_part_s, stride_part_m,
                   stride_we, stride_wn, stride_se, stride_sn, limit,
                   FMT: tl.constexpr, SB: tl.constexpr, SW_E8M0: tl.constexpr,
                   HAS_LIMIT: tl.constexpr, FAST_FP4: tl.constexpr, SCALE_LE_128: tl.constexpr,
                   SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   KCHUNK: tl.constexpr = False, TOKEN_ROWS: tl.constexpr = False,
                   TOPK: tl.constexpr = 1, PREP_ACT: tl.constexpr = False,
                   QUANT_ACT: tl.constexpr = False, N_FIRST: tl.constexpr = False,
                   PDL: tl.constexpr = False):
    """act[row] = w · swiglu(w1 x, w3 x) for the pairs of one row block and N tile (program
    order: :func:`block_tile_ids`).

    PREP_ACT (BN = the down GEMM's K step): ``act`` is stored GEMM-ready for the down kernel
    (FP8 fake-quantized per K step under QUANT_ACT, [even | odd] for MXFP4), as
    ``_moe_prep_kernel`` would make it of the plain act: one launch less.

    ``xs`` and ``act`` rows follow the padded sorted layout of the plan (row = block·BM + i);
    ``xs`` comes from ``_moe_prep_kernel``.  TOKEN_ROWS: ``xs`` holds one GEMM-ready row per
    token instead (the gate's decode plan, ``triton_route.moe_gate_plan``): a pair's row is
    its token's, pair // TOPK.  SPLIT (grid axis 2 = S splits of K): each split
    stores its fp32 gate and up partials into ``part1`` / ``part3`` [S, rows, N]; the last split
    to arrive at the tile's counter in ``arrivals`` sums them in split order, runs the epilogue
    and resets the counter to 0.  Unused blocks (id >= E) touch nothing, in every split."""
    grid_dependency_sync(PDL)
    blk, pid_n, _, n_tiles = block_tile_ids(N_FIRST)
    e = tl.load(bexp_ptr + blk)
    if e < E:
        rm, pair, m_mask = block_pairs(pair_ptr, blk, P, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        n_mask = rn < N
        OUT: tl.constexpr = xs_ptr.dtype.element_ty
        acc1 = tl.zeros((BM, BN), dtype=tl.float32)
        acc3 = tl.zeros((BM, BN), dtype=tl.float32)
        k_lo, k_hi = _split_k_range(K, BK, SPLIT)
        if TOKEN_ROWS:
            xrow = tl.where(m_mask, pair // TOPK, 0)
        else:
            xrow = rm
        for k0 in range(k_lo, k_hi, BK):
            x_ev, x_od = _load_prepped_tile(xs_ptr, xrow, m_mask, k0, stride_xm, FMT, BK)
            g_ev, g_od = _load_weight_tile(w1_ptr, s1_ptr, e, rn, n_mask, k0, stride_we,
                                           stride_wn, stride_se, stride_sn, FMT, SB, BN, BK,
                                           OUT, SW_E8M0, FAST_FP4, SCALE_LE_128,
                                           KCHUNK, N)
            acc1 = _dot_tile(acc1, x_ev, x_od, g_ev, g_od, FMT)
            u_ev, u_od = _load_weight_tile(w3_ptr, s3_ptr, e, rn, n_mask, k0, stride_we,
                                           stride_wn, stride_se, stride_sn, FMT, SB, BN, BK,
                                           OUT, SW_E8M0, FAST_FP4, SCALE_LE_128,
                                           KCHUNK, N)
            acc3 = _dot_tile(acc3, x_ev, x_od, u_ev, u_od, FMT)
        if SPLIT:
            tile = blk * n_tiles + pid_n
            offs = rm.to(tl.int64)[:, None] * stride_part_m + rn[None, :]
            mask = m_mask[:, None] & n_mask[None, :]
            _store_partial(part1_ptr, offs, acc1, mask, stride_part_s)
            _store_partial(part3_ptr, offs, acc3, mask, stride_part_s)
            if _arrive_last(arrivals_ptr, tile):
                acc1 = _sum_partials(part1_ptr, offs, mask, stride_part_s)
                acc3 = _sum_partials(part3_ptr, offs, mask, stride_part_s)
                _up_epilogue(acc1, acc3, act_ptr, wt_ptr, rm, pair, m_mask, rn, n_mask,
                             stride_actm, limit, OUT, HAS_LIMIT, pid_n * BN, PREP_ACT, FMT,
                             QUANT_ACT, BN)
                # Clean for the next launch (and CUDA-graph replays): no per-call zeroing.
                tl.store(arrivals_ptr + tile, 0)
        else:
            _up_epilogue(acc1, acc3, act_ptr, wt_ptr, rm, pair, m_mask, rn, n_mask, stride_actm,
                         limit, OUT, HAS_LIMIT, pid_n * BN, PREP_ACT, FMT, QUANT_ACT, BN)


@triton.jit
def _moe_down_kernel(act_ptr, w2_ptr, s2_ptr, pair_ptr, bexp_ptr, y_ptr, part_ptr, arrivals_ptr,
                     P, N, K, E, stride_actm, stride_ym, stride_part_s, stride_part_m,
                     stride_we, stride_wn, stride_se, stride_sn,
                     FMT: tl.constexpr, SB: tl.constexpr, SW_E8M0: tl.constexpr,
                     FAST_FP4: tl.constexpr, SCALE_LE_128: tl.constexpr, SPLIT: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     KCHUNK: tl.constexpr = False, ids_ptr=None, out_ptr=None,
                     shared_ptr=None, T=0, COMBINE: tl.constexpr = False,
                     TOPK: tl.constexpr = 1, SHARED: tl.constexpr = False,
                     N_FIRST: tl.constexpr = False, PDL: tl.constexpr = False):
    """y[pair] = w2 · act[row] for the pairs of one row block and N tile (compute dtype);
    ``act`` made ready by ``_moe_prep_kernel`` (or plain: dense/FP8 stacks without act quant).
    SPLIT: as ``_moe_up_kernel``, one fp32 partial per split in ``part`` [S, rows, N].

    COMBINE (decode): ``_moe_combine_kernel`` of this N tile too, by the program whose block
    finishes the tile last — every row block (unused ones by their split 0) counts itself in at
    the tile's counter ``arrivals[nb·tiles + pid_n]`` once its y rows are stored — for the T
    tokens into ``out`` (+ ``shared`` under SHARED): the same sums in the same order."""
    grid_dependency_sync(PDL)
    blk, pid_n, n_blocks, n_tiles = block_tile_ids(N_FIRST)
    e = tl.load(bexp_ptr + blk)
    # Whether this program counts its block in at the combine's counter.
    stored = (tl.program_id(2) == 0) & (e >= E)
    if e < E:
        rm, pair, m_mask = block_pairs(pair_ptr, blk, P, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        n_mask = rn < N
        OUT: tl.constexpr = act_ptr.dtype.element_ty
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k_lo, k_hi = _split_k_range(K, BK, SPLIT)
        for k0 in range(k_lo, k_hi, BK):
            a_ev, a_od = _load_prepped_tile(act_ptr, rm, m_mask, k0, stride_actm, FMT, BK)
            w_ev, w_od = _load_weight_tile(w2_ptr, s2_ptr, e, rn, n_mask, k0, stride_we,
                                           stride_wn, stride_se, stride_sn, FMT, SB, BN, BK,
                                           OUT, SW_E8M0, FAST_FP4, SCALE_LE_128,
                                           KCHUNK, N)
            acc = _dot_tile(acc, a_ev, a_od, w_ev, w_od, FMT)
        y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_ym + rn[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT:
            tile = blk * n_tiles + pid_n
            offs = rm.to(tl.int64)[:, None] * stride_part_m + rn[None, :]
            _store_partial(part_ptr, offs, acc, mask, stride_part_s)
            if _arrive_last(arrivals_ptr, tile):
                acc = _sum_partials(part_ptr, offs, mask, stride_part_s)
                store_rne(y_ptrs, acc, mask)
                tl.store(arrivals_ptr + tile, 0)
                stored = pid_n >= 0
        else:
            store_rne(y_ptrs, acc, mask)
            stored = pid_n >= 0
    if COMBINE:
        if stored:
            count = arrivals_ptr + n_blocks * n_tiles + pid_n
            tl.debug_barrier()
            if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == n_blocks - 1:
                tl.debug_barrier()
                _combine_tile(y_ptr, ids_ptr, out_ptr, shared_ptr, T, N, E, stride_ym,
                              pid_n * BN + tl.arange(0, BN), TOPK, SHARED)
                tl.store(count, 0)


@triton.jit
def _combine_tile(y_ptr, ids_ptr, out_ptr, shared_ptr, T, D, E, stride_ym, rd,
                  TOPK: tl.constexpr, SHARED: tl.constexpr):
    """``_moe_combine_kernel``'s sums for columns ``rd`` of every token, the y rows read from L2
    (``.cg``: other programs just stored them)."""
    d_mask = rd < D
    # Row pointers advanced per token (64-bit pointer arithmetic, no int32 row products).
    y_row, out_row, sh_row = y_ptr + rd, out_ptr + rd, shared_ptr + rd
    for t in range(T):
        acc = tl.zeros(rd.shape, dtype=tl.float32)
        for j in tl.static_range(TOPK):
            e = tl.load(ids_ptr + t * TOPK + j)
            ok = (e >= 0) & (e < E)
            v = tl.load(y_row + j * stride_ym, mask=d_mask & ok, other=0.0,
                        cache_modifier=".cg")
            acc += v.to(tl.float32)
        if SHARED:
            sh = tl.load(sh_row, mask=d_mask, other=0.0)
            store_rne(out_row, acc + sh.to(tl.float32), d_mask)
        else:
            tl.store(out_row, acc, mask=d_mask)
        y_row += TOPK * stride_ym
        out_row += D
        sh_row += D


@triton.jit
def _moe_combine_kernel(y_ptr, ids_ptr, out_ptr, shared_ptr, D, E, TOPK: tl.constexpr,
                        BD: tl.constexpr, SHARED: tl.constexpr = False,
                        PDL: tl.constexpr = False):
    """out[t] = Σ_j y[t·k + j] in fp32 over the picks j whose expert id is in 0..E-1.

    SHARED (:func:`moe_experts_shared`): plus ``shared[t]`` in fp32, rounded once to out's
    dtype — the sum and rounding of ``triton_route.moe_combine``, without its launch."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    d_mask = rd < D
    acc = tl.zeros((BD,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        e = tl.load(ids_ptr + t * TOPK + j)
        ok = (e >= 0) & (e < E)
        v = tl.load(y_ptr + (t * TOPK + j).to(tl.int64) * D + rd, mask=d_mask & ok, other=0.0)
        acc += v.to(tl.float32)
    if SHARED:
        sh = tl.load(shared_ptr + t.to(tl.int64) * D + rd, mask=d_mask, other=0.0)
        store_rne(out_ptr + t.to(tl.int64) * D + rd, acc + sh.to(tl.float32), d_mask)
    else:
        tl.store(out_ptr + t.to(tl.int64) * D + rd, acc, mask=d_mask)


@triton.jit
def _dequant_experts_kernel(w_ptr, s_ptr, out_ptr, N, stride_we, stride_wn, stride_se,
                            stride_sn, stride_oe, stride_on, FMT: tl.constexpr,
                            SB: tl.constexpr, SW_E8M0: tl.constexpr, FAST_FP4: tl.constexpr,
                            BR: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = False):
    """out[e, n, k] = the dequantized weight (exact for MXFP4) for one [BR, BK] tile."""
    grid_dependency_sync(PDL)
    rn = tl.program_id(0) * BR + tl.arange(0, BR)
    k0 = tl.program_id(1) * BK
    e = tl.program_id(2)
    n_mask = rn < N
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    e = e.to(tl.int64)
    ev, od = _load_weight_tile(w_ptr, s_ptr, e, rn, n_mask, k0, stride_we, stride_wn, stride_se,
                               stride_sn, FMT, SB, BR, BK, OUT, SW_E8M0, FAST_FP4, False)
    base = out_ptr + e * stride_oe + rn[:, None] * stride_on
    if FMT == 1:
        rj = tl.arange(0, BK // 2)
        tl.store(base + (k0 + 2 * rj)[None, :], ev, mask=n_mask[:, None])
        tl.store(base + (k0 + 2 * rj + 1)[None, :], od, mask=n_mask[:, None])
    else:
        tl.store(base + (k0 + tl.arange(0, BK))[None, :], ev, mask=n_mask[:, None])


# ------------------------------------------------------------------------------ host side
# How the kernels decode MXFP4 weights for bf16 compute on the GPU: "asm" (packed bit operations
# in inline PTX, ~2 operations per weight) or "alu" (the fp32 decode of the interpreter, ~9).
# Both are exact.  (A third variant, fp16 MMAs per 32-wide group with the scales on the partial
# sums, measured 2x slower than "alu" on the H200 at every size and was removed.)
# DSV4_FP4_DECODE=alu picks the other one (benchmarks compare them).
FP4_DECODE = os.environ.get("DSV4_FP4_DECODE", "asm")
if FP4_DECODE not in ("asm", "alu"):
    raise ValueError(f"DSV4_FP4_DECODE={FP4_DECODE!r}: expected 'asm' or 'alu'")
# Whether the "asm" decode may take its one-multiply variant when every scale byte of the stack
# is <= FOLD_MAX_SCALE_BYTE (bit-identical results; DSV4_FP4_FOLD=0 keeps two multiplies, for
# the benchmarks and the equality test).
FP4_FOLD = os.environ.get("DSV4_FP4_FOLD", "1") != "0"


@dataclass(frozen=True)
class MoeConfig:
    """Tile plan of one expert call: BM rows per block (each block one expert), N tiles of the
    up (gate+up) and down GEMMs, K step (= the FP8 act-quant block under official numerics),
    and the K splits of the up and down GEMMs (1: unsplit; more are clamped to the K steps).

    A split GEMM sums its fp32 partials in a fixed order inside the kernel: its output is
    bit-reproducible run to run and equal to the unsplit one to fp32 rounding, not bit-equal
    (another accumulation order)."""

    BM: int
    BN_up: int
    BN_down: int
    BK: int = 128
    warps_up: int = 4
    warps_down: int = 4
    stages: int = 3
    split_up: int = 1
    split_down: int = 1

    def __post_init__(self) -> None:
        for name in ("BM", "BN_up", "BN_down"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoeConfig: {name} must be a power of two >= 16; found {v}")
        for name in ("split_up", "split_down"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MoeConfig: {name} must be an int >= 1; found {v!r}")


# Split-K at decode.  At one token only ~6 row blocks × the N tiles stream the weights (192
# programs at V4-Flash widths, 1.45 waves of the H200's 132 SMs, ~1.1 TB/s): K splits multiply
# the programs up to ~4 per SM, while each split keeps >= 512 of K (4 steps of 128).  H200
# sweep (bench/moe_decode.py --sweep, docs/PERFORMANCE.md fifth session), V4-Flash, one token:
# up/down splits 4/4 69.3 µs, 4/2 72.4, 8/2 76.1, 1/1 81.1; from 16 tokens unsplit is best.
_SPLIT_SMS = 132
_SPLIT_TARGET_PROGRAMS = 4 * _SPLIT_SMS
_SPLIT_MIN_K = 512
_SPLIT_MAX = 8


def _pick_split(programs: int, k: int) -> int:
    """Smallest power-of-two K split giving >= the target programs (or the most allowed) for a
    GEMM of ``programs`` unsplit programs over a reduction of length ``k``."""
    split = 1
    while (programs * split < _SPLIT_TARGET_PROGRAMS and split * 2 <= _SPLIT_MAX
           and k // (split * 2) >= _SPLIT_MIN_K):
        split *= 2
    return split


def pick_moe_config(num_pairs: int, num_experts: int, dim: int, inter: int, block_k: int
                    ) -> MoeConfig:
    """Tile plan by the average rows per active expert (decode: ~1; 8K prefill: ~190).

    From the H200 sweeps (docs/PERFORMANCE.md, V4-Flash shapes, bench/moe_decode.py --sweep):
    16-row blocks for decode with wide N tiles (64/128 at one token, 128/128 from 16 tokens
    up), 64-row blocks with 128-wide tiles, 4 warps and (H100 sweep) two stages beyond, 128-row
    blocks with 8 warps from 128 rows per expert (8K prefill: 11.8 ms against 12.3 with 64-row
    blocks).  16-row blocks whose programs (active experts × N tiles) are too few to fill the
    GPU split K (:func:`_pick_split`; V4-Flash: one token up 4 / down 4, 8 tokens and more
    unsplit)."""
    active = max(1, min(num_experts, num_pairs))
    rows = num_pairs / active
    if rows <= 16:
        # (128-wide up tiles at one token too where they are one K step: UP_PREP_ACT.)
        narrow = num_pairs <= 8 and not (UP_PREP_ACT and block_k == 128)
        bn_up, bn_down = (64, 128) if narrow else (128, 128)
        return MoeConfig(BM=16, BN_up=bn_up, BN_down=bn_down, BK=block_k, stages=3,
                         split_up=_pick_split(active * -(-inter // bn_up), dim),
                         split_down=_pick_split(active * -(-dim // bn_down), inter))
    if rows <= 32:
        return MoeConfig(BM=32, BN_up=128, BN_down=128, BK=block_k, stages=3)
    if rows < 128:
        # Two stages (H100 sweep, twenty-fourth session, 256 experts: 512 / 1,024 / 2,048
        # tokens 2,813 / 2,876 / 3,199 µs at three stages, 2,431 / 2,497 / 2,782 at two).
        return MoeConfig(BM=64, BN_up=128, BN_down=128, BK=block_k, stages=MOE_BM64_STAGES)
    return MoeConfig(BM=128, BN_up=128, BN_down=128, BK=block_k, warps_up=8, warps_down=8,
                     stages=3)


# 1: at decode (the one-launch plan's pair counts) the up kernel stores the activation
# GEMM-ready for the down kernel (FP8 fake quant per K step, MXFP4's [even | odd] split) when
# its N tile is one K step of the down GEMM (BN_up = BK), instead of a separate prep launch
# over the stored act: the same values, one launch less on the decode chain; the one-token
# plans then take 128-wide up tiles too (64 otherwise).  H100 (docs/PERFORMANCE.md,
# twenty-seventh session), the same bits: 4 layers B=1 1,056.7 against 1,087.6 µs (graph
# replays interleaved), B=2 1,228.6 against 1,233.9, B 16 / 64 unchanged (not applied there);
# 43 layers B=1 ~8.51 against ~8.58 ms.  DSV4_MOE_UP_PREP=0 turns it off.
UP_PREP_ACT = int(os.environ.get("DSV4_MOE_UP_PREP", "1"))

# 1: at decode (the one-launch plan's pair counts) the down kernel also sums each token's picks
# (+ the shared expert) into the output: the block that finishes an N tile last does the
# combine kernel's sums for it (the same values), one launch less on the decode chain.
# Measured no faster and left off (H100, 4 layers, interleaved graph replays, the same bits:
# B=1 1,087.6 µs either way, B=2 1,240.0 against 1,233.9): the finisher's tail after the last
# block costs what the launch did.  DSV4_MOE_DOWN_COMBINE=1 turns it on.
DOWN_COMBINE = int(os.environ.get("DSV4_MOE_DOWN_COMBINE", "0"))

# 1 (default): the expert GEMMs of prefill plans (row blocks of N_FIRST_MIN_BM rows and more:
# over 16 pairs an active expert; the FP8-MMA kernels of triton_moe_fp8 too) walk the N tiles
# of one row block before the next block (grid axis 0 = N tiles).  Walking the blocks first,
# the ~260 programs resident at once hold ~260 blocks' activation rows (~135 MB at a 2K chunk,
# past L2), so each block's rows come from HBM once per N tile (16-32 times); N tiles first,
# the programs resident together share a few blocks' rows and their expert's weight tiles.
# Same bits (each tile's sums are unchanged).  H100, V4-Flash widths, 256 experts
# (docs/PERFORMANCE.md, thirty-third session; bench/moe_order.py): the expert call at 2K tokens
# 2,854 -> 2,520 µs (bf16-MMA), at 8K 10,776 -> 9,992 (FP8-MMA, re-encoded); 43 layers, 8K
# prefill 662 -> 641-645 ms.  Decode plans (16-row blocks, ~1-2 pairs each: nothing to share)
# keep the block-first order they were tuned in.  DSV4_MOE_N_FIRST=0 turns it off.
N_FIRST = int(os.environ.get("DSV4_MOE_N_FIRST", "1"))
N_FIRST_MIN_BM = 32
# CUDA's grid axes 1 and 2 hold at most 65,535 programs.
_GRID_YZ_MAX = 65535


def tile_grid(blocks: int, tiles: int, *rest: int, n_first: bool = False
              ) -> tuple[tuple[int, ...], bool]:
    """The launch grid of an expert GEMM over ``blocks`` row blocks and ``tiles`` N tiles
    (then ``rest``: the K splits), and whether it runs N tiles first (``block_tile_ids``):
    ``n_first`` unless the blocks overflow grid axis 1."""
    n_first = bool(n_first) and blocks <= _GRID_YZ_MAX
    return ((tiles, blocks, *rest) if n_first else (blocks, tiles, *rest)), n_first


# Pipeline stages of the 64-row expert blocks (DSV4_MOE_BM64_STAGES=3: the former plan, A/B).
MOE_BM64_STAGES = int(os.environ.get("DSV4_MOE_BM64_STAGES", "2"))

# Shared memory the pipelined operand buffers of one program may take (the H200: 227 KB).
_SMEM_BUDGET = 224 * 1024


def _fit_stages(stages: int, rows: int, cols: int, BK: int, itemsize: int) -> int:
    """Pipeline depth for dense stacks, whose operand tiles (``rows`` activation rows and
    ``cols`` weight rows of BK elements) the compiler buffers in shared memory once per stage:
    at most ``stages``, fewer where they would not fit (bf16 BM 64 × 2·128 at 3 stages needs
    240 KB).  Quantized stacks are decoded in registers and are not buffered this way."""
    per_stage = (rows + cols) * BK * itemsize
    return max(1, min(stages, _SMEM_BUDGET // per_stage))


def _fast_fp4(experts: ExpertWeights, dtype: torch.dtype) -> bool:
    """Whether the kernels decode MXFP4 with the inline-PTX path (bf16 compute; the kernels
    ignore it in the interpreter)."""
    return FP4_DECODE == "asm" and experts.fmt == "fp4" and dtype == torch.bfloat16


# Largest e8m0 byte for which the one-multiply decode (SCALE_LE_128) is exact: 2^(s-1) must be
# a bf16 normal.  Real checkpoints' expert scales are far below 2^1.
FOLD_MAX_SCALE_BYTE = 128

# scale tensor -> {statistic name: (the tensor's version when computed, the value)}
_SCALE_STATS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def cached_scale_stat(s: torch.Tensor, name: str,
                      compute: Callable[[torch.Tensor], int]) -> int | None:
    """``compute(s)`` (a host int, typically one reduction and one host sync), cached per scale
    tensor, ``name`` and the tensor's version; None when not cached and not computable now
    (inside a CUDA-graph capture, where a sync is not allowed)."""
    ver = tensor_version(s)
    entry = _SCALE_STATS.get(s)
    if entry is not None and name in entry and entry[name][0] == ver:
        return entry[name][1]
    if s.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    val = int(compute(s))
    if entry is None:
        entry = _SCALE_STATS[s] = {}
    entry[name] = (ver, val)
    return val


def _scale_max(s: torch.Tensor) -> int | None:
    """Largest byte of an e8m0 (or uint8) scale tensor (:func:`cached_scale_stat`)."""
    def largest(t: torch.Tensor) -> int:
        u = t.view(torch.uint8) if t.dtype == _E8M0 else t
        return int(u.max().item()) if u.numel() else 0
    return cached_scale_stat(s, "max", largest)


def _fold_ok(experts: ExpertWeights) -> bool:
    """Whether every MXFP4 scale byte of the three stacks is <= :data:`FOLD_MAX_SCALE_BYTE`, so
    the kernels may take the one-multiply decode; False when unknown (first call inside a
    CUDA-graph capture: the two-multiply decode is exact for every scale)."""
    for name in ("s1", "s3", "s2"):
        s = getattr(experts, name)
        if s is None or s.dtype not in (_E8M0, torch.uint8):
            return False
        m = _scale_max(s)
        if m is None or m > FOLD_MAX_SCALE_BYTE:
            return False
    return True


def _check_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   experts: ExpertWeights) -> None:
    if x.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 \
            or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts: expected x [T, D], topk_ids/topk_weights [T, k]; found "
                         f"{tuple(x.shape)}, {tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    E, inter = experts.num_experts, experts.inter_dim
    D = x.shape[1]
    packed = 2 if experts.fmt == "fp4" else 1
    want = {"w1": (E, inter, D // packed), "w3": (E, inter, D // packed),
            "w2": (E, D, inter // packed)}
    for name, shape in want.items():
        got = tuple(getattr(experts, name).shape)
        if got != shape:
            raise ValueError(f"moe_experts: {name} has shape {got}; expected {shape} for "
                             f"{experts.fmt} experts and x of width {D}")
    if experts.fmt == "fp4" and (D % 32 or inter % 32):
        raise ValueError(f"moe_experts: MXFP4 experts need D and I multiples of 32; found "
                         f"D={D}, I={inter}")


def _weight_args(experts: ExpertWeights, which: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(weight, scale, scale-is-e8m0) as the kernels read them (uint8 views of byte formats)."""
    w = getattr(experts, which)
    if experts.fmt == "dense":
        return w, w, False
    s = getattr(experts, "s" + which[1])
    if experts.fmt == "fp4":
        w = w.view(torch.uint8)
    if s.dtype == _E8M0:
        return w, s.view(torch.uint8), True
    if s.dtype == torch.uint8:
        return w, s, True
    return w, s.float(), False


def _block_k(experts: ExpertWeights, D: int, inter: int) -> int:
    """K step: the act-quant block when set, the FP8 weight block for fp8, else up to 128."""
    if experts.fmt == "fp8" and not experts.act_block:
        bk = experts.block
    else:
        bk = expert_k_step(experts.act_block, D, inter)
    if experts.fmt == "fp8" and bk != experts.block:
        raise ValueError(f"moe_experts: FP8 experts need the act block ({bk}) equal to the "
                         f"weight block ({experts.block})")
    if D % bk or inter % bk or bk < (32 if experts.fmt == "fp4" else 16):
        raise ValueError(f"moe_experts: D={D} and I={inter} must be multiples of the K step "
                         f"{bk} (>= 32 for MXFP4)")
    return bk


# Rows per active expert from which a call dequantizes every expert once into a bf16 scratch and
# runs cuBLAS grouped GEMMs (prefill) instead of dequantizing tiles inside the grouped kernel.
# None: off.  With 64-bit offsets it is correct on the H200 but ~100 ms per call at V4-Flash
# widths (every expert dequantized per call), slower than the in-kernel path: it stays off
# (docs/PERFORMANCE.md, bench/moe_prefill.py).
DEQUANT_GEMM_MIN_ROWS: int | None = None


def dequant_experts(experts: ExpertWeights, which: str, out: torch.Tensor) -> torch.Tensor:
    """Dequantize the stack ``which`` ("w1", "w3", "w2") into ``out`` [E, N, K] (any row
    stride; exact for MXFP4, the twin's rounding for FP8 with fp32 scales)."""
    if experts.kchunk:
        raise ValueError("dequant_experts: K-chunk-major stacks (kchunk) are read by the MMA "
                         "expert kernels only")
    w, s, e8m0 = _weight_args(experts, which)
    E, N = w.shape[0], w.shape[1]
    K = out.shape[2]
    if experts.fmt == "dense":
        return out.copy_(w)
    if experts.fmt == "fp8":
        bk = experts.block
        if K % bk:
            raise ValueError(f"dequant_experts: K={K} is not a multiple of the FP8 block {bk}")
    else:
        bk = 128
        while K % bk and bk > 32:
            bk //= 2
        if K % bk:
            raise ValueError(f"dequant_experts: K={K} is not a multiple of 32")
    BR = 64
    _dequant_experts_kernel[(triton.cdiv(N, BR), K // bk, E)](
        w, s, out, N, w.stride(0), w.stride(1), s.stride(0), s.stride(1),
        out.stride(0), out.stride(1), FMT=_FMT_CODE[experts.fmt],
        SB=experts.block if experts.fmt == "fp8" else 32, SW_E8M0=e8m0,
        FAST_FP4=_fast_fp4(experts, out.dtype), BR=BR, BK=bk, num_warps=4, **pdl_args(w))
    return out


def moe_experts_grouped(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        experts: ExpertWeights, swiglu_limit: float) -> torch.Tensor:
    """The prefill path: every expert dequantized once into a scratch of x.dtype (w1|w3 stacked,
    then w2), the pairs sorted by expert, and ``torch._grouped_mm`` for the two GEMMs.

    Same rounding points as the twin (GEMM outputs in x.dtype, SwiGLU in fp32, activation
    rounded to x.dtype before w2).  Pairs whose id is outside 0..E-1 run through expert 0
    with weight 0 and are left out of the sum (no host sync to count them).
    Scratch: (3·I·D + the pair rows) elements of x.dtype (12.9 GB at V4-Flash widths).
    """
    from dsv4.formats import fake_quant_fp8
    from dsv4.ops.torch_dense import swiglu

    _check_experts(x, topk_ids, topk_weights, experts)
    T, D = x.shape
    E, inter, k = experts.num_experts, experts.inter_dim, topk_ids.shape[1]
    out = torch.empty(T, D, dtype=torch.float32, device=x.device)
    if T == 0 or k == 0:
        return out.zero_()
    ids = topk_ids.contiguous()
    flat = ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < E)
    key = torch.where(valid, flat, 0)
    wts = torch.where(valid, topk_weights.reshape(-1).float(), 0.0)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=x.device)
    counts.index_add_(0, key, torch.ones_like(key))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xin = fake_quant_fp8(x, experts.act_block) if experts.act_block else x
    xs = xin[order // k]
    w13 = torch.empty(E, 2 * inter, D, dtype=x.dtype, device=x.device)
    dequant_experts(experts, "w1", w13[:, :inter])
    dequant_experts(experts, "w3", w13[:, inter:])
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    del w13, xs
    a = (swiglu(h[:, :inter], h[:, inter:], swiglu_limit) * wts[order, None]).to(x.dtype)
    del h
    if experts.act_block:
        a = fake_quant_fp8(a, experts.act_block)
    w2 = dequant_experts(experts, "w2", torch.empty(E, D, inter, dtype=x.dtype,
                                                    device=x.device))
    y_sorted = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
    del w2, a
    y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)
    BD = min(1024, triton.next_power_of_2(D))
    _moe_combine_kernel[(T, triton.cdiv(D, BD))](y, ids, out, out, D, E, TOPK=k, BD=BD, num_warps=4,
                                                 **pdl_args(y))
    return out


@dataclass(frozen=True)
class DecodePlan:
    """The routing plan of a decode call built ahead by the gate (``triton_route.moe_gate_plan``,
    in the launch that routes): ``pairs`` / ``block_expert`` as :func:`moe_plan` makes them for
    ``P`` (token, pick) pairs and ``BM``-row blocks, and ``xs`` [T, D] the GEMM-ready
    activation of each token (``_moe_prep_kernel``'s rows for K steps of ``BK``, one per token
    instead of one per pair).  The expert ops use it when their own plan would be the same (P,
    BM and BK agree), so the plan + prep launch leaves the decode chain."""

    pairs: torch.Tensor
    block_expert: torch.Tensor
    xs: torch.Tensor
    P: int
    BM: int
    BK: int


def decode_plan_params(T: int, top_k: int, D: int, experts: ExpertWeights
                       ) -> tuple[int, int, int, bool, int] | None:
    """(BM, BK, format code, quant, row blocks) of the plan :func:`moe_experts_with_config`
    makes for T tokens of top_k picks, when a gate may build it (:class:`DecodePlan`: at most
    ``SMALL_PLAN_MAX_PAIRS`` pairs); else None."""
    P = T * top_k
    if not 0 < P <= SMALL_PLAN_MAX_PAIRS or experts.fmt not in _FMT_CODE:
        return None
    E, inter = experts.num_experts, experts.inter_dim
    bk = _block_k(experts, D, inter)
    cfg = pick_moe_config(P, E, D, inter, bk)
    nb = triton.cdiv(P, cfg.BM) + min(E, P)
    return cfg.BM, bk, _FMT_CODE[experts.fmt], bool(experts.act_block), nb


def moe_experts_with_config(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                            experts: ExpertWeights, swiglu_limit: float,
                            cfg: MoeConfig | None = None, shared: torch.Tensor | None = None,
                            wait_shared: Callable[[], None] | None = None,
                            plan: DecodePlan | None = None) -> torch.Tensor:
    """:func:`moe_experts` with an explicit tile plan (``None``: :func:`pick_moe_config`);
    with ``shared``, :func:`moe_experts_shared` (``wait_shared`` runs before its first read);
    ``plan``: the gate's :class:`DecodePlan` of these ids, used when it matches."""
    _check_experts(x, topk_ids, topk_weights, experts)
    T, D = x.shape
    E, inter, k = experts.num_experts, experts.inter_dim, topk_ids.shape[1]
    if T == 0 or k == 0:
        return _with_shared(torch.zeros(T, D, dtype=torch.float32, device=x.device), x, shared,
                            wait_shared)
    P = T * k
    from dsv4.ops import gluon_moe_decode as gm   # (it imports this module)
    if cfg is None and gm.qualifies(x, topk_ids, experts):
        # One-token decode on FP8 wgmma, the codes decoded in registers (DSV4_MOE_WGMMA=0: off).
        own = plan is not None and plan.P == P and plan.BM == gm.PLAN_BM
        return gm.moe_experts_wgmma(x, topk_ids, topk_weights, experts, swiglu_limit,
                                    plan.pairs if own else None,
                                    plan.block_expert if own else None, shared, wait_shared)
    # fp32 routed rows, or (with shared) the MoE output in x's dtype.
    out = torch.empty(T, D, dtype=torch.float32 if shared is None else x.dtype, device=x.device)
    bk = _block_k(experts, D, inter)
    if cfg is None:
        cfg = pick_moe_config(P, E, D, inter, bk)
    if cfg.BK != bk:
        cfg = replace(cfg, BK=bk)
    if experts.kchunk and experts.kchunk != bk:
        raise ValueError(f"moe_experts: K-chunk-major stacks need kchunk = the K step {bk}; "
                         f"found kchunk={experts.kchunk}")
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.contiguous()
    wts = topk_weights.reshape(-1).float().contiguous()
    fmt = _FMT_CODE[experts.fmt]
    quant = bool(experts.act_block)
    # Decode: the gate's plan, or the plan and the activation prep in one launch; else two.
    fused_prep = P <= SMALL_PLAN_MAX_PAIRS and (x.is_cuda or _INTERPRET_HOST)
    token_rows = (fused_prep and plan is not None and plan.P == P and plan.BM == cfg.BM
                  and plan.BK == cfg.BK and plan.xs.shape == x.shape)
    if token_rows:
        pairs, block_expert, xs = plan.pairs, plan.block_expert, plan.xs
    elif fused_prep:
        pairs, block_expert, xs = moe_plan_prep(x, ids, E, cfg.BM, fmt, quant, cfg.BK)
    else:
        pairs, block_expert = moe_plan(ids, E, cfg.BM)
    nb = block_expert.shape[0]
    w1, s1, e8m0 = _weight_args(experts, "w1")
    w3, s3, _ = _weight_args(experts, "w3")
    w2, s2, _ = _weight_args(experts, "w2")
    sb = experts.block if experts.fmt == "fp8" else 32
    fast = _fast_fp4(experts, x.dtype)
    # Only CUDA launches run the inline PTX (elsewhere: the interpreter, or the sm_90 recorder).
    fold = fast and FP4_FOLD and x.is_cuda and _fold_ok(experts)
    stages_up, stages_down = cfg.stages, cfg.stages
    if experts.fmt == "dense":
        size = experts.w1.element_size()
        stages_up = _fit_stages(cfg.stages, cfg.BM, 2 * cfg.BN_up, cfg.BK, size)
        stages_down = _fit_stages(cfg.stages, cfg.BM, cfg.BN_down, cfg.BK, size)
    rows = nb * cfg.BM
    consts = dict(FMT=fmt, SB=sb, SW_E8M0=e8m0, FAST_FP4=fast, SCALE_LE_128=fold,
                  KCHUNK=bool(experts.kchunk))
    # K splits (at most one per K step); grid axis 2.
    split_up = min(cfg.split_up, D // cfg.BK)
    split_down = min(cfg.split_down, inter // cfg.BK)
    tiles_up, tiles_down = triton.cdiv(inter, cfg.BN_up), triton.cdiv(D, cfg.BN_down)
    # Decode: the combine in the down kernel (its counters after the split arrivals').
    combine_in_down = bool(DOWN_COMBINE) and fused_prep
    need = max(nb * tiles_up if split_up > 1 else 0,
               nb * tiles_down if split_down > 1 else 0,
               (nb + 1) * tiles_down if combine_in_down else 0)
    arrivals = splitk_counters(x.device, need, "moe_experts") if need else block_expert
    # The activation, gathered into the plan's rows and made GEMM-ready once (not per N tile).
    if not fused_prep:
        xs = torch.empty(rows, D, dtype=x.dtype, device=x.device)
        moe_prep(x, pairs, block_expert, xs, P, E, k, True, fmt, quant, cfg.BM, cfg.BK)
    # The down GEMM's input: the act prepared GEMM-ready by the up kernel (PREP_ACT), or the
    # plain act, prepared by moe_prep below (FP8 act quant / MXFP4 split) or read as is.
    needs_prep = quant or fmt == _FMT_CODE["fp4"]
    prep_in_up = bool(UP_PREP_ACT) and needs_prep and cfg.BN_up == cfg.BK and fused_prep
    act = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    # fp32 partials of the splits (gate, up: [2, S, rows, I]); only real rows are written and
    # read.  Unsplit: never touched (act stands in).
    part_up = (torch.empty(2, split_up, rows, inter, dtype=torch.float32, device=x.device)
               if split_up > 1 else act.expand(2, 1, rows, inter))
    # Prefill-sized calls may walk N tiles first (N_FIRST); decode keeps block-first order.
    prefill_order = bool(N_FIRST) and cfg.BM >= N_FIRST_MIN_BM
    grid_up, n_first = tile_grid(nb, tiles_up, split_up, n_first=prefill_order)
    _moe_up_kernel[grid_up](
        xs, w1, w3, s1, s3, pairs, block_expert, wts, act, part_up[0], part_up[1], arrivals,
        P, inter, D, E, xs.stride(0), act.stride(0), part_up.stride(1), part_up.stride(2),
        w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), float(swiglu_limit),
        HAS_LIMIT=swiglu_limit > 0, SPLIT=split_up > 1, BM=cfg.BM, BN=cfg.BN_up, BK=cfg.BK,
        TOKEN_ROWS=token_rows, TOPK=k if token_rows else 1, PREP_ACT=prep_in_up,
        QUANT_ACT=quant, N_FIRST=n_first, num_warps=cfg.warps_up, num_stages=stages_up,
        **consts, **pdl_args(xs))
    del xs, part_up
    if prep_in_up:
        act_in = act
    elif needs_prep:
        act_in = torch.empty_like(act)
        moe_prep(act, pairs, block_expert, act_in, P, E, k, False, fmt, quant, cfg.BM, cfg.BK)
        del act
    else:
        act_in = act
    y = torch.empty(P, D, dtype=x.dtype, device=x.device)
    part_down = (torch.empty(split_down, rows, D, dtype=torch.float32, device=x.device)
                 if split_down > 1 else y[None])
    combine = {}
    if combine_in_down:
        if shared is not None:
            if wait_shared is not None:
                wait_shared()
            _check_shared(x, shared)
        combine = dict(ids_ptr=ids, out_ptr=out,
                       shared_ptr=out if shared is None else shared.contiguous(), T=T,
                       COMBINE=True, TOPK=k, SHARED=shared is not None)
    grid_down, n_first = tile_grid(nb, tiles_down, split_down, n_first=prefill_order)
    _moe_down_kernel[grid_down](
        act_in, w2, s2, pairs, block_expert, y, part_down, arrivals, P, D, inter, E,
        act_in.stride(0), y.stride(0), part_down.stride(0), part_down.stride(1),
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), SPLIT=split_down > 1,
        BM=cfg.BM, BN=cfg.BN_down, BK=cfg.BK, N_FIRST=n_first, num_warps=cfg.warps_down,
        num_stages=stages_down, **combine, **consts, **pdl_args(act_in))
    del part_down
    if combine_in_down:
        return out
    BD = min(1024, triton.next_power_of_2(D))
    if shared is not None:
        # The routed + shared sum in this launch (one launch less on the decode chain); the
        # shared expert's branch is joined only now, after the routed GEMMs were issued.
        if wait_shared is not None:
            wait_shared()
        _check_shared(x, shared)
        _moe_combine_kernel[(T, triton.cdiv(D, BD))](y, ids, out, shared.contiguous(), D, E,
                                                     TOPK=k, BD=BD, SHARED=True, num_warps=4,
                                                     **pdl_args(y))
        return out
    _moe_combine_kernel[(T, triton.cdiv(D, BD))](y, ids, out, out, D, E, TOPK=k, BD=BD,
                                                 num_warps=4, **pdl_args(y))
    return out


def _check_shared(x: torch.Tensor, shared: torch.Tensor) -> None:
    if shared.shape != x.shape or shared.device != x.device:
        raise ValueError(f"moe_experts_shared: shared must be [T, D] = {tuple(x.shape)} on "
                         f"{x.device}; found {tuple(shared.shape)} on {shared.device}")


def _with_shared(routed: torch.Tensor, x: torch.Tensor, shared: torch.Tensor | None,
                 wait_shared: Callable[[], None] | None) -> torch.Tensor:
    """``routed`` as is without ``shared``; else routed + shared in x's dtype (its own op)."""
    if shared is None:
        return routed
    if wait_shared is not None:
        wait_shared()
    _check_shared(x, shared)
    from dsv4.ops import triton_route
    return triton_route.moe_combine(routed, shared, x.dtype)


def _other_expert_path(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       experts: ExpertWeights, swiglu_limit: float) -> torch.Tensor | None:
    """The routed experts through a path other than the grouped split-K kernels, where one
    applies (GEMV, FP8-MMA prefill, dequantize + grouped GEMM); None otherwise."""
    from dsv4.ops import triton_moe_gemv as gemv
    # A few tokens of MXFP4 experts: matrix-vector kernels (off until timed: gemv.MOE_GEMV).
    if gemv.MOE_GEMV and gemv.gemv_qualifies(x, topk_ids, experts):
        return gemv.moe_experts_gemv(x, topk_ids, topk_weights, experts, swiglu_limit)
    # Large prefill calls of MXFP4 experts under official numerics: FP8 tensor cores on the
    # experts re-encoded to e4m3 chunk by chunk (triton_moe_fp8.fp8mma_applies says when).
    from dsv4.ops import triton_moe_fp8 as fp8mma
    if fp8mma.FP8MMA_PREFILL and fp8mma.fp8mma_applies(x, topk_ids, experts):
        return fp8mma.moe_experts_fp8mma(x, topk_ids, topk_weights, experts, swiglu_limit)
    pairs = topk_ids.numel()
    if (DEQUANT_GEMM_MIN_ROWS is not None and experts.fmt != "dense" and not experts.kchunk
            and hasattr(torch, "_grouped_mm")
            and pairs >= DEQUANT_GEMM_MIN_ROWS * experts.num_experts):
        return moe_experts_grouped(x, topk_ids, topk_weights, experts, swiglu_limit)
    return None


def moe_encode_ahead(experts: ExpertWeights, tokens: int, topk: int,
                     dtype: torch.dtype = torch.bfloat16) -> Any:
    """The op of ``torch_dense.moe_encode_ahead``: the FP8 re-encoding of MXFP4 stacks started
    on a stream of its own for a prefill step whose call takes the FP8-MMA path
    (``triton_moe_fp8.encode_ahead``: off unless ``DSV4_FP8MMA_AHEAD=1``), else None."""
    from dsv4.ops import triton_moe_fp8 as fp8mma
    return fp8mma.encode_ahead(experts, tokens, topk, dtype)


@torch_twin_off_gpu("dsv4.ops.torch_dense")
def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                experts: ExpertWeights, swiglu_limit: float,
                plan: DecodePlan | None = None) -> torch.Tensor:
    """Weighted sum of the routed experts picked per token (spec §3.9), fp32 [T, D].

    x [T, D] (bf16 / fp32); topk_ids [T, k] (ids outside 0..E-1 are skipped); topk_weights
    [T, k] fp32; ``experts`` dense, MXFP4 or FP8-block stacks (:class:`ExpertWeights`).  Each
    pick computes ``w2((w · swiglu(w1 x, w3 x)).to(x.dtype))`` with the clamp of ``swiglu_limit``;
    the picks are summed in fp32.  ``plan``: the gate's :class:`DecodePlan` of these ids
    (``moe_gate_plan``; the same result, one launch less).
    """
    routed = _other_expert_path(x, topk_ids, topk_weights, experts, swiglu_limit)
    if routed is not None:
        return routed
    return moe_experts_with_config(x, topk_ids, topk_weights, experts, swiglu_limit, None,
                                   plan=plan)


@torch_twin_off_gpu("dsv4.ops.torch_route")
def moe_experts_shared(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       experts: ExpertWeights, swiglu_limit: float, shared: torch.Tensor,
                       wait_shared: Callable[[], None] | None = None,
                       plan: DecodePlan | None = None) -> torch.Tensor:
    """The MoE output of one rank: :func:`moe_experts` plus the shared expert's ``shared``
    [T, D], summed in fp32 and rounded to x's dtype — ``moe_combine(moe_experts(...), shared,
    x.dtype)`` bit for bit, with the sum done in the experts' last launch on the grouped
    kernels' path.  ``wait_shared`` (e.g. joining the stream lane that computes ``shared``)
    is called once, after the routed GEMMs are issued and before ``shared`` is first read;
    ``plan`` as :func:`moe_experts`."""
    routed = _other_expert_path(x, topk_ids, topk_weights, experts, swiglu_limit)
    if routed is not None:
        return _with_shared(routed, x, shared, wait_shared)
    return moe_experts_with_config(x, topk_ids, topk_weights, experts, swiglu_limit, None,
                                   shared, wait_shared, plan)
