"""GEMV path of the routed experts at decode (1-4 tokens), MXFP4 stacks (dsv4 issues #5 / #7).

Same inputs and result as :func:`dsv4.ops.triton_moe.moe_experts_with_config` (and, to fp32
rounding, as the torch twin ``dsv4.ops.torch_dense.moe_experts``) for T <= MOE_GEMV_MAX_TOKENS:
with T tokens no expert gets more than T rows, so the 16-row MMA blocks of the grouped kernels
run mostly on padding; here every (token, pick) pair is a matrix-vector product instead.

Two launches, no plan, no host sync (CUDA graphs work; the routing is read on the device):

1. ``_gemv_up_kernel`` grid (pair p = t·k + j, N tile of the I gate/up outputs, K split):
   loads its token's x slice per K step (FP8 fake-quantized per ``act_block`` under official
   numerics, in registers), streams the packed MXFP4 bytes of w1 and w3 of its expert as
   [BN, BK/32, 16] uint8 tiles (16 contiguous bytes = one 32-wide scale group per thread,
   evict-first), decodes e2m1 -> fp16 bits (value × 2^-14, exact) -> fp32, multiplies by the
   even / odd activation columns, sums each 32-wide group (``tl.sum``, no tl.dot, no layout
   change) and scales the group sum by its e8m0 power of two (exact).  Products of bf16/e4m3
   activations by e2m1 values are exact in fp32, so the result equals the MMA path's to fp32
   rounding (another summation order).  The finished tile runs the twin's epilogue: gate / up
   rounded to x.dtype, the SwiGLU clamp, times the routing weight, rounded to x.dtype into
   ``act`` [P, I].
2. ``_gemv_down_kernel`` grid (token t, N tile of D, K split over I): for the k picks of its
   token in pick order, the same streaming over w2 of the pick's expert with the activation row
   fake-quantized per K step; each pick's result is rounded to x.dtype (the twin's bf16 GEMM
   output) and the picks are summed in fp32 in pick order, straight into ``out`` [T, D]: no
   per-pair rows, no combine launch, no atomics on data.

Split-K (grid axis 2, S > 1): each split stores its fp32 partials into a per-call workspace and
counts itself in at its tile's arrival counter (:func:`dsv4.ops.triton_dense.splitk_counters`,
shared with the other split-K kernels); the last split to arrive sums the partials in the fixed
order s = 0..S-1, runs the epilogue and resets the counter: bit-reproducible run to run and
across CUDA-graph replays.

Issue #5 (H200, first sweep): every plan with a K step > 32·warps (BK 256 / 512 at 4 warps, the
default included) gave wrong (rel ~0.8 vs the twin), run-to-run different results; BK 128 and
the 8-warp BK 256 plan were right, as were all interpreter runs.  The activation slice was then
one [BK/32, 16, 2] load split into even / odd columns and reshaped to [BK/QB, QB/2] for the
per-block amax (several elements per thread exactly in the failing plans); it is now two plain
[BK/32, 16] loads and a masked max over the groups (:func:`_act_slice`), and the second H200
run passed every GPU test (every plan of that sweep, run-to-run bits, graph replays).

Picks whose id is outside 0..E-1 are skipped (expert parallel shards), as the twin does.  Two
tokens that pick the same expert each stream it (at most 4× the bytes of that expert, fine for
T <= 4: the grouped MMA kernels take over from 5 tokens).

The expert inputs' fake quantization runs once per call (:data:`GEMV_PREQUANT`): x in its
own small launch, act in the up kernel's finish when its N tile holds whole act blocks; the K
loops then read 32-bit (even, odd) bf16 pairs instead of quantizing in every program (sm_90
SASS of the up K step: 9.9 -> 4.5 instructions per weight, 127 -> 80-96 registers).

Timing (H200, bench/moe_gemv.py, CUDA-graph replay, docs/PERFORMANCE.md seventeenth session,
K-chunk-major stacks): T = 1 54.3 µs with the best plan against the MMA kernels' 54.8 (127.1
with the in-loop quantization); T = 2 / 4 154 / 286 µs against 85 / 147 with the default plan.
In the 4-layer B=1 step 0.88 ms against 0.89: no gain worth a second path, so :data:`MOE_GEMV`
stays off (``DSV4_MOE_GEMV=1`` turns it on).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.torch_dense import ExpertWeights
from dsv4.ops.triton_dense import (
    INTERPRET,
    pow2_from_exp,
    round_as,
    round_to_e4m3,
    sm_count,
    splitk_counters,
    store_rne,
    ue8m0_exponent,
)
# The split-K prologue / arrival helpers and the argument checks of the MMA expert kernels
# (triton_moe imports this module lazily, inside moe_experts: no import cycle).
from dsv4.ops.triton_moe import _arrive_last, _check_experts, _split_k_range

__all__ = ["MOE_GEMV", "MOE_GEMV_MAX_TOKENS", "GemvConfig", "gemv_block_k", "gemv_qualifies",
           "moe_experts_gemv", "pick_gemv_config"]

# Off: slower than the MMA kernels on the H200 (module docstring).  triton_moe.moe_experts
# takes this path for T <= MOE_GEMV_MAX_TOKENS when the flag is on and :func:`gemv_qualifies`.
MOE_GEMV = os.environ.get("DSV4_MOE_GEMV", "0") == "1"
MOE_GEMV_MAX_TOKENS = 4
# MXFP4 decode on the GPU: "asm" (e2m1 -> e4m3 bytes, 4 at a time, then the sm_89+ e4m3x2 ->
# f16x2 conversion: :data:`_FP4_TO_F32_ASM`) or "alu" (per-byte fp16 bit building, the
# interpreter's decode).  Both exact: the same bits.  DSV4_GEMV_DECODE picks (benchmarks).
GEMV_DECODE = os.environ.get("DSV4_GEMV_DECODE", "asm")
if GEMV_DECODE not in ("asm", "alu"):
    raise ValueError(f"DSV4_GEMV_DECODE={GEMV_DECODE!r}: expected 'asm' or 'alu'")

# The expert inputs' FP8 fake quantization once per call (a small launch for x, the up
# kernel's finish for act) instead of in every program's K loop; DSV4_GEMV_PREQUANT=0: the
# in-loop form (benchmarks).  Same values either way.
GEMV_PREQUANT = os.environ.get("DSV4_GEMV_PREQUANT", "1") == "1"

_E8M0 = getattr(torch, "float8_e8m0fnu", None)


# ------------------------------------------------------------------------------ jit helpers
@triton.jit
def _act_slice(row_ptr, k0, QB: tl.constexpr, BK: tl.constexpr):
    """One activation row's K step [k0, k0 + BK) as its (even, odd) columns, each [BK/32, 16]
    fp32 (group g, lane i: column k0 + 2·(16g + i) (+1)); QB > 0 (a multiple of 32): FP8 fake
    quantization per QB columns (spec §2.5: amax floor 1e-4, ue8m0 scale, e4m3 RNE), exact in
    any float dtype.

    Two plain [G, 16] loads (even, odd columns), the per-group amax [G], and the per-block amax
    as a masked max over the G groups ([G, G], groups g and g' share a block iff g // (QB/32) ==
    g' // (QB/32)): no ``tl.split`` / 3-D pair tile / ``tl.reshape`` between layouts (issue #5:
    the earlier [G, 16, 2] load + split + reshape form gave wrong, run-to-run different results
    on the H200 whenever the pair tile held more than one element per thread, BK > 32·warps)."""
    G: tl.constexpr = BK // 32
    k0 = tl.multiple_of(k0, 32)
    rg = tl.arange(0, G)
    if QB == 0 and row_ptr.dtype.element_ty == tl.bfloat16:
        # A quantized-before bf16 row: each (even, odd) column pair as one 32-bit word (16-byte
        # vector loads instead of 2-byte gathers); bf16 -> fp32 is a 16-bit shift.
        pair = (row_ptr.to(tl.pointer_type(tl.int32)) + k0 // 2 + rg[:, None] * 16
                + tl.arange(0, 16)[None, :])
        word = tl.load(pair)
        return ((word << 16).to(tl.float32, bitcast=True),
                (word & -65536).to(tl.float32, bitcast=True))
    offs = k0 + rg[:, None] * 32 + tl.arange(0, 16)[None, :] * 2
    ev = tl.load(row_ptr + offs).to(tl.float32)
    od = tl.load(row_ptr + offs + 1).to(tl.float32)
    if QB > 0:
        GPB: tl.constexpr = QB // 32
        gmax = tl.maximum(tl.max(tl.abs(ev), axis=1), tl.max(tl.abs(od), axis=1))     # [G]
        if GPB > 1:
            same = (rg[:, None] // GPB) == (rg[None, :] // GPB)                      # [G, G]
            gmax = tl.max(tl.where(same, gmax[None, :], 0.0), axis=1)
        amax = tl.maximum(gmax, 1e-4)
        ex = ue8m0_exponent(amax)
        inv = pow2_from_exp(-ex)[:, None]
        s = pow2_from_exp(ex)[:, None]
        ev = round_to_e4m3(tl.clamp(ev * inv, -448.0, 448.0)) * s
        od = round_to_e4m3(tl.clamp(od * inv, -448.0, 448.0)) * s
    return ev, od


@triton.jit
def _e2m1_fp32_planes(byte):
    """Packed MXFP4 bytes (uint8, any shape) -> (low-nibble, high-nibble) fp32 tensors holding
    each e2m1 value × 2^-14 exactly: the code's magnitude bits go to fp16's exponent/mantissa
    field (the e2m1 subnormal 0.5 lands on fp16's subnormal 2^-15), the sign to bit 15, and the
    fp16 converts to fp32 exactly."""
    b = byte.to(tl.int32)
    lo = ((b & 7) << 9) | ((b & 8) << 12)
    hi = ((b & 0x70) << 5) | ((b & 0x80) << 8)
    return (lo.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32),
            hi.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32))


# Four MXFP4 bytes ($8: 8 codes) -> the four low-nibble values ($0..$3, byte order) and the four
# high-nibble values ($4..$7) in fp32, each e2m1 × 2^-6 exactly: a code's magnitude bits go to
# bits 2..4 of an e4m3 byte (exponent field = the e2m1 exponent, the e2m1 subnormal 0.5 landing
# on e4m3's subnormal 2^-7), its sign to bit 7; sm_89+ converts e4m3 pairs to f16x2 in one
# instruction, then f16 -> f32 (exact).  Four bytes at once: ~4.5 instructions per byte.
_FP4_TO_F32_ASM = tl.constexpr("""{
.reg .b32 t, l, h, f0, f1, f2, f3;
.reg .b16 l0, l1, h0, h1, a0, a1, a2, a3, a4, a5, a6, a7;
shl.b32 t, $8, 2; and.b32 l, t, 0x1C1C1C1C;
shl.b32 t, $8, 4; and.b32 t, t, 0x80808080; or.b32 l, l, t;
shr.b32 t, $8, 2; and.b32 h, t, 0x1C1C1C1C;
and.b32 t, $8, 0x80808080; or.b32 h, h, t;
mov.b32 {l0, l1}, l;
mov.b32 {h0, h1}, h;
cvt.rn.f16x2.e4m3x2 f0, l0;
cvt.rn.f16x2.e4m3x2 f1, l1;
cvt.rn.f16x2.e4m3x2 f2, h0;
cvt.rn.f16x2.e4m3x2 f3, h1;
mov.b32 {a0, a1}, f0; mov.b32 {a2, a3}, f1; mov.b32 {a4, a5}, f2; mov.b32 {a6, a7}, f3;
cvt.f32.f16 $0, a0; cvt.f32.f16 $1, a1; cvt.f32.f16 $2, a2; cvt.f32.f16 $3, a3;
cvt.f32.f16 $4, a4; cvt.f32.f16 $5, a5; cvt.f32.f16 $6, a6; cvt.f32.f16 $7, a7;
}""")


@triton.jit
def _gemv_step(w_ptr, s_ptr, e, rn, n_mask, k0, xe, xo, stride_we, stride_wn, stride_se,
               stride_sn, N, BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr,
               KCHUNK: tl.constexpr):
    """Σ_k W[e, rn, k]·x[k] over one K step [k0, k0 + BK) for the rows rn, fp32 [BN]: the
    packed bytes [BN, BK/32, 16] (one scale group per (row, g)) streamed evict-first, decoded
    exactly, multiplied by the (even, odd) activation columns xe / xo [BK/32, 16], summed per
    group, each group sum times its e8m0 scale 2^(s-127) (exact for s <= 240, as the ALU decode
    of the MMA kernels), then over the groups.  KCHUNK: the stacks are K-chunk-major with
    chunks of BK codes (``ExpertWeights.kchunk == BK``): the step's [N, BK/2] bytes of all N
    rows, then its [N, BK/32] scales, are each one contiguous run."""
    G: tl.constexpr = BK // 32
    e = e.to(tl.int64)
    rg = tl.arange(0, G)
    rn64 = rn.to(tl.int64)
    if KCHUNK:
        chunk = (k0 // BK) * N               # < 2^31 (chunks x rows); int64 from rn64 on
        row = w_ptr + e * stride_we + (chunk + rn64)[:, None] * (BK // 2)
        srow = s_ptr + e * stride_se + (chunk + rn64)[:, None] * G
    else:
        # k0 is a multiple of BK (>= 32): 16-byte aligned rows of bytes, one vector load each.
        row = w_ptr + e * stride_we + rn64[:, None] * stride_wn + tl.multiple_of(k0 // 2, 16)
        srow = s_ptr + e * stride_se + rn64[:, None] * stride_sn + k0 // 32
    byte = tl.load(row + tl.arange(0, BK // 2)[None, :], mask=n_mask[:, None], other=0,
                   eviction_policy="evict_first")
    byte = tl.reshape(byte, (BN, G, 16))
    sc = tl.load(srow + rg[None, :], mask=n_mask[:, None], other=0,
                 eviction_policy="evict_first")
    if ASM and not INTERPRET:
        lo, hi = tl.inline_asm_elementwise(_FP4_TO_F32_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [byte],
                                           dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
        bias: tl.constexpr = 6          # values e2m1 × 2^-6
    else:
        lo, hi = _e2m1_fp32_planes(byte)
        bias: tl.constexpr = 14         # values e2m1 × 2^-14
    gs = tl.sum(lo * xe[None, :, :] + hi * xo[None, :, :], axis=2)          # [BN, G]
    f = ((sc.to(tl.int32) + bias) << 23).to(tl.float32, bitcast=True)     # 2^(s-127+bias)
    return tl.sum(gs * f, axis=1)


@triton.jit
def _sum_splits(ptrs, mask, stride_s):
    """Σ over the S partial slices (stride ``stride_s``) in the fixed order s = 0..S-1; ``.cg``
    loads read L2, never a stale L1 line."""
    acc = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for _ in range(1, tl.num_programs(2)):
        ptrs += stride_s
        acc += tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def _fake_quant_tile(a, BN: tl.constexpr, QA: tl.constexpr):
    """fp32 [BN] ``a`` fake-quantized per QA consecutive values (spec §2.5: amax floor 1e-4,
    ue8m0 scale, e4m3 RNE): e4m3 values times their block's power of two, exact in bf16.  Blocks
    of one tile share a masked max ([BN / QA, BN]: no reshape between layouts)."""
    NB: tl.constexpr = BN // QA
    if NB == 1:
        ex = ue8m0_exponent(tl.maximum(tl.max(tl.abs(a), axis=0), 1e-4))
    else:
        same = (tl.arange(0, NB)[:, None] == tl.arange(0, BN)[None, :] // QA)       # [NB, BN]
        ex = ue8m0_exponent(tl.maximum(tl.max(tl.where(same, tl.abs(a)[None, :], 0.0), axis=1),
                                       1e-4))                                        # [NB]
        ex = tl.sum(tl.where(same, ex[:, None], 0), axis=0)                          # [BN]
    return round_to_e4m3(tl.clamp(a * pow2_from_exp(-ex), -448.0, 448.0)) * pow2_from_exp(ex)


@triton.jit
def _up_finish(acc1, acc3, act_ptr, wt_ptr, p, rn, n_mask, stride_act, limit,
               HAS_LIMIT: tl.constexpr, BN: tl.constexpr, QA: tl.constexpr):
    """act[p, rn] = (w · swiglu(g, u)).to(act dtype), g / u rounded to it first (the twin);
    QA > 0: then fake-quantized per QA columns, the down GEMV's input quantization done once
    here (BN a multiple of QA: every block inside the tile)."""
    g = round_as(acc1, act_ptr)
    u = round_as(acc3, act_ptr)
    if HAS_LIMIT:
        u = tl.clamp(u, -limit, limit)
        g = tl.minimum(g, limit)
    wt = tl.load(wt_ptr + p)
    a = g * tl.sigmoid(g) * u * wt
    if QA > 0:
        a = _fake_quant_tile(round_as(a, act_ptr), BN, QA)
    store_rne(act_ptr + p.to(tl.int64) * stride_act + rn, a, n_mask)


@triton.jit
def _fake_quant_rows_kernel(x_ptr, y_ptr, stride_x, stride_y, QB: tl.constexpr,
                            PDL: tl.constexpr = False):
    """y[t, block b] = x[t, block b] fake-quantized (:func:`_fake_quant_tile`), grid (T, K /
    QB): the up GEMV's input quantization once per call instead of once per program."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * QB + tl.arange(0, QB)
    a = tl.load(x_ptr + t * stride_x + cols).to(tl.float32)
    store_rne(y_ptr + t * stride_y + cols, _fake_quant_tile(a, QB, QB), cols >= 0)


# ------------------------------------------------------------------------------ kernels
@triton.jit
def _gemv_up_kernel(x_ptr, ids_ptr, wt_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, act_ptr, part_ptr,
                    count_ptr, N, K, E, TOPK, stride_x, stride_act, stride_we, stride_wn,
                    stride_se, stride_sn, stride_part_w, stride_part_s, limit,
                    QB: tl.constexpr, HAS_LIMIT: tl.constexpr, SPLIT: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr,
                    KCHUNK: tl.constexpr = False, QA: tl.constexpr = 0,
                    PDL: tl.constexpr = False):
    """act[p, tile] = w · swiglu(w1 x, w3 x) of pair p (token p // TOPK) for one N tile.
    SPLIT: partials into ``part`` [2, S, P, N] (gate, up); the last split finishes the tile.
    Skipped picks (id outside 0..E-1) touch nothing, in every split.  QB: x's fake
    quantization per step (0: x comes quantized); QA: act's, in the finish (0: none)."""
    grid_dependency_sync(PDL)
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + p)
    if (e >= 0) & (e < E):
        t = p // TOPK
        rn = pid_n * BN + tl.arange(0, BN)
        n_mask = rn < N
        x_row = x_ptr + t.to(tl.int64) * stride_x
        acc1 = tl.zeros((BN,), dtype=tl.float32)
        acc3 = tl.zeros((BN,), dtype=tl.float32)
        k_lo, k_hi = _split_k_range(K, BK, SPLIT)
        for k0 in range(k_lo, k_hi, BK):
            xe, xo = _act_slice(x_row, k0, QB, BK)
            acc1 += _gemv_step(w1_ptr, s1_ptr, e, rn, n_mask, k0, xe, xo, stride_we,
                               stride_wn, stride_se, stride_sn, N, BN, BK, ASM, KCHUNK)
            acc3 += _gemv_step(w3_ptr, s3_ptr, e, rn, n_mask, k0, xe, xo, stride_we,
                               stride_wn, stride_se, stride_sn, N, BN, BK, ASM, KCHUNK)
        if SPLIT:
            ptrs = (part_ptr + tl.program_id(2).to(tl.int64) * stride_part_s
                    + p.to(tl.int64) * N + rn)
            tl.store(ptrs, acc1, mask=n_mask)
            tl.store(ptrs + stride_part_w, acc3, mask=n_mask)
            tile = p * tl.num_programs(1) + pid_n
            if _arrive_last(count_ptr, tile):
                tl.debug_barrier()
                base = part_ptr + p.to(tl.int64) * N + rn
                acc1 = _sum_splits(base, n_mask, stride_part_s)
                acc3 = _sum_splits(base + stride_part_w, n_mask, stride_part_s)
                _up_finish(acc1, acc3, act_ptr, wt_ptr, p, rn, n_mask, stride_act, limit,
                           HAS_LIMIT, BN, QA)
                # Clean for the next launch and CUDA-graph replays: no per-call zeroing.
                tl.store(count_ptr + tile, 0)
        else:
            _up_finish(acc1, acc3, act_ptr, wt_ptr, p, rn, n_mask, stride_act, limit,
                       HAS_LIMIT, BN, QA)


@triton.jit
def _gemv_down_kernel(act_ptr, ids_ptr, w2_ptr, s2_ptr, out_ptr, part_ptr, count_ptr,
                      N, K, E, stride_act, stride_out, stride_we, stride_wn, stride_se,
                      stride_sn, stride_part_s, TOPK: tl.constexpr, QB: tl.constexpr,
                      SPLIT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      ASM: tl.constexpr, KCHUNK: tl.constexpr = False,
                      PDL: tl.constexpr = False):
    """out[t, tile] = Σ_j (w2[e_j] · act[t·k + j]) rounded to the act dtype, summed in fp32 in
    pick order over the picks j of token t whose id is in 0..E-1.  SPLIT: each split stores its
    per-pick partials into ``part`` [S, P, N]; the last split rounds and sums them."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    n_mask = rn < N
    k_lo, k_hi = _split_k_range(K, BK, SPLIT)
    total = tl.zeros((BN,), dtype=tl.float32)
    for j in range(TOPK):
        p = t * TOPK + j
        e = tl.load(ids_ptr + p)
        ok = (e >= 0) & (e < E)
        acc = tl.zeros((BN,), dtype=tl.float32)
        if ok:
            a_row = act_ptr + p.to(tl.int64) * stride_act
            for k0 in range(k_lo, k_hi, BK):
                xe, xo = _act_slice(a_row, k0, QB, BK)
                acc += _gemv_step(w2_ptr, s2_ptr, e, rn, n_mask, k0, xe, xo, stride_we,
                                  stride_wn, stride_se, stride_sn, N, BN, BK, ASM, KCHUNK)
        if SPLIT:
            tl.store(part_ptr + tl.program_id(2).to(tl.int64) * stride_part_s
                     + p.to(tl.int64) * N + rn, acc, mask=n_mask)
        else:
            if ok:
                total += round_as(acc, act_ptr)
    if SPLIT:
        tile = t * tl.num_programs(1) + pid_n
        if _arrive_last(count_ptr, tile):
            tl.debug_barrier()
            for j in range(TOPK):
                p = t * TOPK + j
                e = tl.load(ids_ptr + p)
                if (e >= 0) & (e < E):
                    acc = _sum_splits(part_ptr + p.to(tl.int64) * N + rn, n_mask, stride_part_s)
                    total += round_as(acc, act_ptr)
            tl.store(out_ptr + t.to(tl.int64) * stride_out + rn, total, mask=n_mask)
            tl.store(count_ptr + tile, 0)
    else:
        tl.store(out_ptr + t.to(tl.int64) * stride_out + rn, total, mask=n_mask)


# ------------------------------------------------------------------------------ host side
@dataclass(frozen=True)
class GemvConfig:
    """Tile plan of one GEMV expert call: N tiles of the up (BN_up rows of w1 and of w3) and
    down GEMVs, the K step BK (a multiple of 32 and of the act-quant block), the K splits
    (1: unsplit; more are clamped to the K steps) and the warps of each kernel."""

    BN_up: int = 32
    BN_down: int = 32
    BK: int = 256
    split_up: int = 1
    split_down: int = 1
    warps_up: int = 4
    warps_down: int = 4

    def __post_init__(self) -> None:
        for name in ("BN_up", "BN_down", "BK"):
            v = getattr(self, name)
            if v < (32 if name == "BK" else 1) or v & (v - 1):
                raise ValueError(f"GemvConfig: {name} must be a power of two"
                                 f"{' >= 32' if name == 'BK' else ''}; found {v}")
        for name in ("split_up", "split_down", "warps_up", "warps_down"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"GemvConfig: {name} must be an int >= 1; found {v!r}")


# DSV4_GEMV_PLAN="BN_up,BN_down,BK,split_up,split_down,warps_up,warps_down": every call's plan
# (benchmarks: a swept plan in the model).
_PLAN_ENV = os.environ.get("DSV4_GEMV_PLAN", "")
# Split-K targets: ~4 programs per SM, at most 8 splits (a first rule, not measured:
# bench/moe_gemv.py sweeps the plans).
_PROGRAMS_PER_SM = 4
_SPLIT_MAX = 8


def gemv_block_k(D: int, inter: int, act_block: int | None, want: int = 256) -> int | None:
    """The largest K step <= ``want`` (power of two >= 32) dividing D and I and a multiple of
    the act-quant block (itself a multiple of 32); None if there is none."""
    if act_block and act_block % 32:
        return None         # the fake quantization works on whole 32-column groups
    bk = want
    while bk >= 32:
        if D % bk == 0 and inter % bk == 0 and (not act_block or bk % act_block == 0):
            return bk
        bk //= 2
    return None


def _split(programs: int, steps: int, sms: int) -> int:
    s = 1
    while programs * s < _PROGRAMS_PER_SM * sms and s * 2 <= min(_SPLIT_MAX, steps):
        s *= 2
    return s


def pick_gemv_config(T: int, k: int, D: int, inter: int, act_block: int | None,
                     device: torch.device | None = None, kchunk: int = 0) -> GemvConfig:
    """Default plan: 32-row N tiles, K step 256 (or the largest that fits; K-chunk-major
    stacks: their chunk), 4 warps, K splits until ~4 programs per SM (V4-Flash, one token: up
    6 × 64 tiles × 2, down 128 tiles × 8)."""
    if _PLAN_ENV:
        return GemvConfig(*(int(v) for v in _PLAN_ENV.split(",")))
    if kchunk:
        # The best one-token plan of bench/moe_gemv.py on the H200 (seventeenth session, run
        # B: 54.3 µs against 88.2 for 32-row tiles; the splits are clamped to the K steps).
        return GemvConfig(BN_up=128, BN_down=64, BK=kchunk, split_up=4, split_down=8,
                          warps_up=8, warps_down=8)
    bk = gemv_block_k(D, inter, act_block)
    if bk is None:
        raise ValueError(f"moe_experts_gemv: no K step fits D={D}, I={inter}, "
                         f"act_block={act_block}")
    sms = sm_count(device) if device is not None else 132
    bn_up, bn_down = 32, 32
    return GemvConfig(BN_up=bn_up, BN_down=bn_down, BK=bk,
                      split_up=_split(T * k * -(-inter // bn_up), D // bk, sms),
                      split_down=_split(T * -(-D // bn_down), inter // bk, sms))


def _e8m0_bytes(s: torch.Tensor) -> torch.Tensor | None:
    if _E8M0 is not None and s.dtype == _E8M0:
        return s.view(torch.uint8)
    if s.dtype == torch.uint8:
        return s
    return None


def gemv_qualifies(x: torch.Tensor, topk_ids: torch.Tensor, experts: ExpertWeights) -> bool:
    """Whether :func:`moe_experts_gemv` serves this call: at most MOE_GEMV_MAX_TOKENS tokens,
    MXFP4 stacks with e8m0 scales, bf16 x (official or bf16 numerics), a K step that fits."""
    ab, kc = experts.act_block, experts.kchunk
    return (x.dim() == 2 and 0 < x.shape[0] <= MOE_GEMV_MAX_TOKENS
            and experts.fmt == "fp4" and x.dtype == torch.bfloat16
            and all(_e8m0_bytes(getattr(experts, n)) is not None for n in ("s1", "s3", "s2"))
            and (gemv_block_k(x.shape[1], experts.inter_dim, ab) is not None if not kc
                 else (kc & (kc - 1)) == 0 and (not ab or (kc % ab == 0 and ab % 32 == 0))))


def moe_experts_gemv(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     experts: ExpertWeights, swiglu_limit: float,
                     cfg: GemvConfig | None = None) -> torch.Tensor:
    """:func:`dsv4.ops.triton_moe.moe_experts` for a few tokens of MXFP4 experts (module doc):
    fp32 [T, D].  x bf16 or fp32 [T, D]; ``cfg`` None: :func:`pick_gemv_config`."""

    _check_experts(x, topk_ids, topk_weights, experts)
    if experts.fmt != "fp4":
        raise ValueError(f"moe_experts_gemv: MXFP4 experts only; found {experts.fmt!r}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"moe_experts_gemv: x must be bf16 or fp32; found {x.dtype}")
    scales = [_e8m0_bytes(getattr(experts, n)) for n in ("s1", "s3", "s2")]
    if any(s is None for s in scales):
        raise ValueError("moe_experts_gemv: MXFP4 scales must be e8m0 (or their uint8 bytes)")
    T, D = x.shape
    E, inter, k = experts.num_experts, experts.inter_dim, topk_ids.shape[1]
    out = torch.empty(T, D, dtype=torch.float32, device=x.device)
    if T == 0 or k == 0:
        return out.zero_()
    qb = experts.act_block or 0
    if cfg is None:
        cfg = pick_gemv_config(T, k, D, inter, experts.act_block, x.device, experts.kchunk)
    bk = cfg.BK
    if experts.kchunk and experts.kchunk != bk:
        raise ValueError(f"moe_experts_gemv: K-chunk-major stacks need the K step to be their "
                         f"chunk; found BK={bk}, kchunk={experts.kchunk}")
    if D % bk or inter % bk or (qb and (bk % qb or qb % 32)):
        raise ValueError(f"moe_experts_gemv: K step {bk} must divide D={D} and I={inter} and "
                         f"be a multiple of the act block {qb}")
    if x.stride(1) != 1 or x.stride(0) % 2 or x.storage_offset() % 2:
        x = x.contiguous()      # the K loops read bf16 column pairs as aligned 32-bit words
    # The input quantizations once per call (x here, act in the up finish when its tiles hold
    # whole act blocks) rather than in every program's K loop.
    pre = GEMV_PREQUANT and qb > 0
    qa = qb if pre and cfg.BN_up % qb == 0 else 0
    if pre:
        xq = torch.empty_like(x)
        _fake_quant_rows_kernel[(T, D // qb)](x, xq, x.stride(0), xq.stride(0), QB=qb,
                                              num_warps=1, **pdl_args(x))
        x = xq
    ids = topk_ids.contiguous()
    wts = topk_weights.reshape(-1).float().contiguous()
    w1, w3, w2 = (getattr(experts, n).view(torch.uint8) for n in ("w1", "w3", "w2"))
    s1, s3, s2 = scales
    if w1.stride() != w3.stride() or s1.stride() != s3.stride() or w1.stride(2) != 1 \
            or w2.stride(2) != 1 or s1.stride(2) != 1 or s2.stride(2) != 1:
        raise ValueError("moe_experts_gemv: w1 / w3 (and s1 / s3) must share strides, with "
                         "contiguous rows")
    P = T * k
    split_up = max(1, min(cfg.split_up, D // bk))
    split_down = max(1, min(cfg.split_down, inter // bk))
    tiles_up, tiles_down = triton.cdiv(inter, cfg.BN_up), triton.cdiv(D, cfg.BN_down)
    need = max(P * tiles_up if split_up > 1 else 0, T * tiles_down if split_down > 1 else 0)
    counters = splitk_counters(x.device, need, "moe_experts_gemv") if need else ids
    act = torch.empty(P, inter, dtype=x.dtype, device=x.device)
    part_up = (torch.empty(2, split_up, P, inter, dtype=torch.float32, device=x.device)
               if split_up > 1 else None)
    _gemv_up_kernel[(P, tiles_up, split_up)](
        x, ids, wts, w1, w3, s1, s3, act, act if part_up is None else part_up, counters,
        inter, D, E, k, x.stride(0), act.stride(0), w1.stride(0), w1.stride(1),
        s1.stride(0), s1.stride(1), 0 if part_up is None else part_up.stride(0),
        0 if part_up is None else part_up.stride(1), float(swiglu_limit),
        QB=0 if pre else qb, HAS_LIMIT=swiglu_limit > 0, SPLIT=split_up > 1, BN=cfg.BN_up,
        BK=bk, ASM=GEMV_DECODE == "asm", KCHUNK=bool(experts.kchunk), QA=qa,
        num_warps=cfg.warps_up, num_stages=1, **pdl_args(x))
    part_down = (torch.empty(split_down, P, D, dtype=torch.float32, device=x.device)
                 if split_down > 1 else None)
    _gemv_down_kernel[(T, tiles_down, split_down)](
        act, ids, w2, s2, out, out if part_down is None else part_down, counters,
        D, inter, E, act.stride(0), out.stride(0), w2.stride(0), w2.stride(1),
        s2.stride(0), s2.stride(1), 0 if part_down is None else part_down.stride(0),
        TOPK=k, QB=0 if qa else qb, SPLIT=split_down > 1, BN=cfg.BN_down, BK=bk,
        ASM=GEMV_DECODE == "asm", KCHUNK=bool(experts.kchunk), num_warps=cfg.warps_down,
        num_stages=1, **pdl_args(act))
    return out
