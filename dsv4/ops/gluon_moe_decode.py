"""Routed MXFP4 experts at decode on Hopper's FP8 tensor cores, the codes decoded in registers
(dsv4 issue #5: the decode expert GEMMs of :mod:`dsv4.ops.triton_moe` run at ~2.6x their bytes,
bound by ~4 SASS instructions per weight).

The same contract as :func:`dsv4.ops.triton_moe.moe_experts_with_config` for a decode call of
K-chunk-major MXFP4 stacks under official numerics (FP8 activations per 128 columns), one token
by default (:data:`MAX_TOKENS`).  Three launches:

1. ``_wgmma_gemv_kernel`` (Gluon) on w1 and w3: per (N tile, row block of the plan, K split)
   the weights are the M side of ``wgmma m64n8k32`` (64 rows a warpgroup), the block's pairs
   its N side (8 or 16 columns), one asynchronous product per 32-wide scale group.  Each lane
   loads exactly the packed bytes its A fragment wants (4 bytes = 8 codes of one row's group)
   and turns them into e4m3 with a few integer operations (e2m1 · 2^-6 is an e4m3 code with
   the e2m1 bits moved: exact); the layouts are chosen so that nothing moves between the load,
   the decode and the MMA (``convert_layout(..., assert_trivial=True)`` checks it when the
   kernel compiles).  The activation (the pairs' token rows) is FP8-quantized per 128 columns
   by each program for its own K split into shared memory, as e4m3 codes in the MMA column
   order (below) and fp32 powers of two.  Each product is scaled by its group's e8m0 power of
   two per row and the chunk's sum by the activation's per token, in fp32.  Split-K partials
   are summed in split order by the last split to arrive (the counters of
   ``triton_dense.splitk_counters``): h = the gate and up sums, fp32;
2. ``_wgmma_gemv_kernel`` on w2, its activation act = w · swiglu(g, u) of h rounded to bf16
   (the twin's epilogue), FP8-quantized the same way: each pair's output row rounded to bf16;
3. ``triton_moe._moe_combine_kernel``: each token's picks summed (+ the shared expert).

:data:`FUSED_FILL` off: the activations are quantized by two Triton launches instead
(``_x_codes_kernel`` before 1, ``_act_codes_kernel`` between 1 and 2) into codes the GEMMs
read; the same functions (``quantize_block_rows``, ``weighted_swiglu``), the same bits.

The MMA column order: inside each 32-wide group, MMA column 16h + 4q + i holds natural column
8q + 2i + h (the even codes of a lane's 4 bytes, then the odd ones).  A dot does not depend on
the order of K when both operands share it.

Numerics: the products of e2m1 and e4m3 values are exact; the tensor cores add each group's 32
products with their own reduced-precision FP8 accumulation (~2.5e-5 of a GEMM's result on the
H100), then fp32 takes over.  That flips a few e4m3 roundings of the activation between the two
GEMMs, so the expert output is within ~1e-3 to 2.5e-3 of the twin (the prefill FP8-MMA path's
class, bound 5e-3), where the grouped bf16-MMA kernels are within ~1e-7.

Gluon has no interpreter (triton 3.6): the GEMM kernel runs on an sm_90 GPU and is compiled
offline for sm_90 by the CPU tests (``tests/kernels/sm90_cases.py``); the two Triton kernels
have interpreter tests, and the GPU tests check that the fused fill gives their chain's bits.
On unless :data:`WGMMA_DECODE` is off (``DSV4_MOE_WGMMA=0``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.torch_dense import ExpertWeights
from dsv4.ops import triton_moe as tm
from dsv4.ops.triton_dense import quantize_block_rows, round_to_bf16, splitk_counters
from dsv4.ops.triton_moe import weighted_swiglu

try:  # Gluon ships with triton >= 3.5; without its NVIDIA parts this path is off.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon._runtime import constexpr_function
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - older triton
    HAVE_GLUON = False

__all__ = ["WGMMA_DECODE", "FUSED_FILL", "MAX_TOKENS",
           "qualifies", "pairs_fit", "moe_experts_wgmma", "x_codes", "act_codes", "mma_column",
           "mma_columns", "GemvPlan", "pick_plan"]

# On by default for one-token decode calls on sm_90 (DSV4_MOE_WGMMA=0: Triton's grouped kernels).
# H100, docs/PERFORMANCE.md twenty-ninth session: the expert call 56.6 -> 44.3 µs at one token
# (80.9 against 85.6 at two, but the 43-layer B=2 step was 1% slower with it, so two tokens
# stay on the grouped kernels); all 43 V4-Flash layers (64 experts) B=1 8,356 -> 7,976 µs
# (-4.5%, interleaved graph replays; -2.1% in an earlier run); ~1e-3 of the twin where the
# grouped kernels are at 1e-7 (the FP8-MMA prefill experts' class, also on by default).
WGMMA_DECODE = os.environ.get("DSV4_MOE_WGMMA", "1") == "1"
# The token counts it serves (DSV4_MOE_WGMMA_MAX_TOKENS, for measurements past one token: at
# 16 / 64 tokens the 4-layer step was 10-22% slower on the H200, thirty-first session).
# From 9 tokens the products are 16 columns wide, the plan's blocks' 16 rows, so any number of
# pairs fits; up to 8 they are 8 wide and the call's pairs must fit them (one token).
MAX_TOKENS = int(os.environ.get("DSV4_MOE_WGMMA_MAX_TOKENS", "1"))
PLAN_BM = 16     # rows of the plan's blocks (triton_moe.moe_plan)
CHUNK = 128      # the K-chunk-major stacks' chunk and the activation's FP8 block
GROUP = 32       # MXFP4 scale group = one m64n8k32 product
# Where a GEMM's activation comes from (_wgmma_gemv_kernel's ACT): e4m3 codes + scales made by
# x_codes / act_codes; the tokens' bf16 rows; the gate / up sums (w · swiglu).  Quantized in the
# GEMMs' own fill by default (three launches a call, not five); FUSED_FILL = False (or
# DSV4_MOE_WGMMA_FUSED=0) launches the two Triton kernels instead (the same bits).
ACT_CODES, ACT_TOKENS, ACT_SWIGLU = 0, 1, 2
FUSED_FILL = os.environ.get("DSV4_MOE_WGMMA_FUSED", "1") == "1"
# (Measured and removed, thirty-third session, code at 03c170f: the w2 GEMM launched in plain
# stream order instead of with PDL, so that its programs would not park in the slots the up
# GEMM leaves free and the shared expert's w2 could take them.  Same bits; H100, interleaved
# graph replays: 4 layers B=1 1,028.9 against 1,033.5 µs, 43 layers 8,027.3 against 8,008.1.)
# (Measured and removed, thirty-first session, code at 14ded44: the first weight chunk
# requested before the fill, neutral; the weights through a cp.async shared-memory ring, H200
# -0.5% / H100 +2% at 43 layers B=1.  The loads go straight into the A fragments' registers.)


def mma_column(k: torch.Tensor | int) -> torch.Tensor | int:
    """Position of natural column k in the MMA column order (see the module docstring)."""
    r = k % GROUP
    return k - r + 16 * (r % 2) + r // 2


# ------------------------------------------------------------------------------ Triton kernels
@triton.jit
def _codes_store(codes_ptr, scale_ptr, row, kb, v, NKB):
    """One row's 128 columns ``v`` [1, 128] (fp32) FP8-quantized: e4m3 codes at their MMA
    columns of block kb, the power of two at scale[row, kb]."""
    q, s = quantize_block_rows(v)
    rk = tl.arange(0, 128)
    pos = kb * 128 + (rk // 32) * 32 + 16 * (rk % 2) + (rk % 32) // 2
    tl.store(codes_ptr + row.to(tl.int64) * (NKB * 128) + pos[None, :],
             q.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
    tl.store(scale_ptr + row.to(tl.int64) * NKB + kb + tl.arange(0, 1), s)


@triton.jit
def _x_codes_kernel(x_ptr, codes_ptr, scale_ptr, stride_x, NKB, PDL: tl.constexpr = False):
    """Grid (T, D / 128): one 128-column block of one token row."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0)
    kb = tl.program_id(1)
    v = tl.load(x_ptr + t.to(tl.int64) * stride_x + kb * 128 + tl.arange(0, 128)[None, :])
    _codes_store(codes_ptr, scale_ptr, t, kb, v.to(tl.float32), NKB)


@triton.jit
def _act_codes_kernel(h_ptr, pair_ptr, bexp_ptr, wt_ptr, codes_ptr, scale_ptr, P, E, R, limit,
                      NKB, BM: tl.constexpr, HAS_LIMIT: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (rows of the plan, I / 128): act = w · swiglu(g, u) of one row's 128 columns (g, u
    rounded to bf16, the V4 clamp, the product rounded to bf16, as the twin), FP8-quantized
    into codes.  Padding rows and unused blocks are skipped."""
    grid_dependency_sync(PDL)
    r = tl.program_id(0)
    kb = tl.program_id(1)
    pair = tl.load(pair_ptr + r)
    e = tl.load(bexp_ptr + r // BM)
    if (pair < P) & (e >= 0) & (e < E):
        cols = kb * 128 + tl.arange(0, 128)[None, :]
        base = h_ptr + r.to(tl.int64) * (NKB * 128)
        wt = tl.load(wt_ptr + pair + tl.arange(0, 1))
        a = weighted_swiglu(tl.load(base + cols), tl.load(base + R * (NKB * 128) + cols), wt,
                            limit, tl.bfloat16, HAS_LIMIT)
        _codes_store(codes_ptr, scale_ptr, r, kb, round_to_bf16(a), NKB)


def x_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] (bf16) -> (e4m3 codes uint8 [T, D] in the MMA column order, fp32 scales
    [T, D / 128]): the FP8 fake quantization of ``formats.act_quant`` (block 128)."""
    T, D = x.shape
    if D % CHUNK or x.stride(1) != 1:
        raise ValueError(f"x_codes: x must be row-contiguous with D a multiple of {CHUNK}; "
                         f"found {tuple(x.shape)} strides {x.stride()}")
    codes = torch.empty(T, D, dtype=torch.uint8, device=x.device)
    scale = torch.empty(T, D // CHUNK, dtype=torch.float32, device=x.device)
    if T:
        _x_codes_kernel[(T, D // CHUNK)](x, codes, scale, x.stride(0), D // CHUNK, num_warps=4,
                                         **pdl_args(x))
    return codes, scale


def act_codes(h: torch.Tensor, pairs: torch.Tensor, block_expert: torch.Tensor,
              weights: torch.Tensor, P: int, E: int, BM: int, limit: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """h [2, R, I] fp32 (the gate and up GEMMs per plan row) -> the down GEMM's activation:
    (codes uint8 [R, I] in the MMA column order, fp32 scales [R, I / 128]); rows of padding or
    unused blocks are left unwritten."""
    _, R, inter = h.shape
    codes = torch.empty(R, inter, dtype=torch.uint8, device=h.device)
    scale = torch.empty(R, inter // CHUNK, dtype=torch.float32, device=h.device)
    _act_codes_kernel[(R, inter // CHUNK)](
        h, pairs, block_expert, weights, codes, scale, P, E, R, float(limit), inter // CHUNK,
        BM=BM, HAS_LIMIT=limit > 0, num_warps=4, **pdl_args(h))
    return codes, scale


# ------------------------------------------------------------------------------ Gluon kernel
def byte_layout(warps: int, mtiles: int) -> "gl.DistributedLinearLayout":
    """[16·warps·mtiles, 16] packed bytes of one scale group, each lane holding what its wgmma
    A fragment wants: lane (r, q) the 4 bytes 4q..4q+3 of rows r and r + 8 of each 16-row
    slice (a warp's 16 rows; warps stacked, then the row tiles).  Built in the kernel from its
    integer constexprs (a layout object as a launch argument would not serialize into the
    kernel manifest's JSON, nor through any Triton compile hook)."""
    if min(warps, mtiles) < 1 or warps & (warps - 1) or mtiles & (mtiles - 1):
        raise ValueError(f"warps and row tiles must be powers of two; found {warps}, {mtiles}")
    rows = 16 * warps * mtiles
    regs = [[0, 1], [0, 2], [8, 0]] + [[16 * warps << j, 0]
                                       for j in range(mtiles.bit_length() - 1)]
    lanes = [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]]
    wbases = [[16 << j, 0] for j in range(warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(regs, lanes, wbases, [], [rows, 16])


if HAVE_GLUON:
    # Four packed bytes (8 e2m1 codes, lo nibble = even column) -> the e4m3 bytes of
    # e2m1 · 2^-6 of the even codes ($0) and of the odd ones ($1): sign to bit 7, the
    # magnitude's 3 bits to bits 2-4 (an e4m3 subnormal for e2m1's 0.5, exact).
    _E2M1X8_TO_E4M3 = gl.constexpr("""{
    .reg .b32 a, b;
    shl.b32 a, $2, 4;
    shl.b32 b, $2, 2;
    and.b32 a, a, 0x80808080;
    and.b32 b, b, 0x1C1C1C1C;
    or.b32 $0, a, b;
    shr.b32 b, $2, 2;
    and.b32 a, $2, 0x80808080;
    and.b32 b, b, 0x1C1C1C1C;
    or.b32 $1, a, b;
    }""")
    _byte_layout = constexpr_function(byte_layout)
    _GROUP = gl.constexpr(GROUP)
    _CHUNK = gl.constexpr(CHUNK)
    _ACT_CODES = gl.constexpr(ACT_CODES)
    _ACT_TOKENS = gl.constexpr(ACT_TOKENS)
    _ACT_SWIGLU = gl.constexpr(ACT_SWIGLU)

    @gluon.jit
    def _load_chunk(w_base, s_base, c, N: gl.constexpr):
        """Chunk c's packed bytes group by group ([BN, 16] each, the byte layout) and the four
        scale bytes of each row as one int32 ([BN], the accumulator's row layout)."""
        w = w_base + c * (N * 64)
        return (gl.load(w), gl.load(w + 16), gl.load(w + 32), gl.load(w + 48),
                gl.load((s_base + c * (N * 4)).to(gl.pointer_type(gl.int32), bitcast=True)))

    @gluon.jit
    def _decode(byte, BN: gl.constexpr, a_l: gl.constexpr):
        """Packed bytes [BN, 16] of one group -> e4m3 codes [BN, 32] in the A operand layout
        (MMA column 16h + 4q + i)."""
        lo, hi = gl.inline_asm_elementwise(_E2M1X8_TO_E4M3, "=r,=r,r", [byte],
                                           dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4)
        codes = gl.reshape(gl.permute(gl.reshape(gl.join(lo, hi), [BN, 4, 4, 2]),
                                      [0, 3, 1, 2]), [BN, _GROUP])
        return gl.convert_layout(codes.to(gl.float8e4nv, bitcast=True), a_l,
                                 assert_trivial=True)

    @gluon.jit
    def _pow2_group(sw, g: gl.constexpr):
        """2^(s - 127) · 2^6 of scale byte g of each row's word (the codes are e2m1 · 2^-6)."""
        return ((((sw >> (8 * g)) & 255) + 6) << 23).to(gl.float32, bitcast=True)[:, None]

    @gluon.jit
    def _chunk_sum(ch, xc, zero, BN: gl.constexpr, a_l: gl.constexpr):
        """Σ_g 2^s_g · (codes_g · x_g) of one loaded chunk ``ch`` (4 byte tiles + the scale
        words) against the activation chunk ``xc`` [8|16, 128] in shared memory: four
        asynchronous products, then their scaled sum in fp32."""
        p0 = warpgroup_mma(_decode(ch[0], BN, a_l),
                           xc.slice(0, _GROUP, dim=1).permute((1, 0)), zero, use_acc=False,
                           is_async=True)
        p1 = warpgroup_mma(_decode(ch[1], BN, a_l),
                           xc.slice(_GROUP, _GROUP, dim=1).permute((1, 0)), zero,
                           use_acc=False, is_async=True)
        p2 = warpgroup_mma(_decode(ch[2], BN, a_l),
                           xc.slice(2 * _GROUP, _GROUP, dim=1).permute((1, 0)), zero,
                           use_acc=False, is_async=True)
        p3 = warpgroup_mma(_decode(ch[3], BN, a_l),
                           xc.slice(3 * _GROUP, _GROUP, dim=1).permute((1, 0)), zero,
                           use_acc=False, is_async=True)
        d0, d1, d2, d3 = warpgroup_mma_wait(num_outstanding=0, deps=(p0, p1, p2, p3))
        acc = d0 * _pow2_group(ch[4], 0)
        acc = gl.fma(d1, _pow2_group(ch[4], 1), acc)
        acc = gl.fma(d2, _pow2_group(ch[4], 2), acc)
        return gl.fma(d3, _pow2_group(ch[4], 3), acc)

    @gluon.jit
    def _quantize_fill(x_s, s_s, a_ptr, wt_ptr, pair_ptr, blk, c0, P, R, stride_a, limit,
                       K: gl.constexpr, TOPK: gl.constexpr, ACT: gl.constexpr,
                       HAS_LIMIT: gl.constexpr, BM: gl.constexpr, NT: gl.constexpr,
                       WARPS: gl.constexpr, CPS: gl.constexpr):
        """Row j < (the block's pairs) of x_s [NT, CPS·128]: the split's CPS activation chunks
        of pair j FP8-quantized (a warp a chunk; MMA column order: each lane loads the natural
        columns of its MMA positions, so no register moves), their powers of two into column
        j of s_s [CPS, NT].  The pairs are a prefix of the block (triton_moe.moe_plan), so
        one token's call quantizes one row, not NT; rows past them are left unwritten (their
        MMA columns are never stored)."""
        f_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [WARPS, 1], [1, 0])
        ch = gl.arange(0, CPS, layout=gl.SliceLayout(1, f_l))
        m = gl.arange(0, _CHUNK, layout=gl.SliceLayout(0, f_l))
        natural = m - m % 32 + 8 * ((m % 16) // 4) + 2 * (m % 4) + (m % 32) // 16
        cols = (c0 + ch)[:, None] * _CHUNK + natural[None, :]
        pairs = gl.load(pair_ptr + blk * BM + gl.arange(0, NT, layout=gl.SliceLayout(0, f_l)))
        count = gl.sum((pairs < P).to(gl.int32), axis=0)
        for j in gl.static_range(NT):
            if j < count:
                pair = gl.load(pair_ptr + blk * BM + j)
                if ACT == _ACT_TOKENS:
                    v = gl.load(a_ptr + (pair // TOPK).to(gl.int64) * stride_a + cols)
                    v = v.to(gl.float32)
                else:
                    row = a_ptr + (blk * BM + j).to(gl.int64) * K + cols
                    wt = gl.load(wt_ptr + pair + ch * 0)
                    v = round_to_bf16(weighted_swiglu(gl.load(row), gl.load(row + R * K), wt,
                                                      limit, gl.bfloat16, HAS_LIMIT))
                q, sc = quantize_block_rows(v)
                x_s.slice(j, 1, dim=0).store(gl.reshape(q.to(gl.float8e4nv), [1, CPS * _CHUNK]))
                s_s.slice(j, 1, dim=1).store(gl.reshape(sc, [CPS, 1]))

    @gluon.jit
    def _wgmma_gemv_kernel(w1_ptr, s1_ptr, w3_ptr, s3_ptr, a_ptr, as_ptr, wt_ptr, pair_ptr,
                           bexp_ptr, part_ptr, arrivals_ptr, out_ptr, P, E, R, stride_a, limit,
                           N: gl.constexpr, K: gl.constexpr, TOPK: gl.constexpr,
                           TWO: gl.constexpr, ACT: gl.constexpr, TOKEN_ROWS: gl.constexpr,
                           HAS_LIMIT: gl.constexpr, BM: gl.constexpr, NT: gl.constexpr,
                           WARPS: gl.constexpr, MT: gl.constexpr, CPS: gl.constexpr,
                           PF: gl.constexpr, S: gl.constexpr, PDL: gl.constexpr = False):
        """One N tile of BN = 64·WARPS/4·MT rows of expert e = bexp[blk] (w1 and, with TWO,
        w3) against the block's pairs (columns j < NT: plan rows blk·BM + j), over K split
        ``program_id(2)`` of CPS chunks.  The activation (its split's columns into shared
        memory as MMA-ordered e4m3 codes, once):

        * ACT_CODES: read as codes (a) + scales (as), rows the pairs' tokens (TOKEN_ROWS) or
          the plan rows (``x_codes`` / ``act_codes`` made them);
        * ACT_TOKENS: the pairs' token rows of x (a, bf16, row stride ``stride_a``),
          FP8-quantized here;
        * ACT_SWIGLU: w · swiglu of the plan rows of h (a, fp32 [2, R, K]; w = wt[pair], the
          V4 clamp under HAS_LIMIT), rounded to bf16 and FP8-quantized here.

        The last two run the Triton kernels' own functions (``weighted_swiglu``,
        ``quantize_block_rows``), so they give ``x_codes`` / ``act_codes``' bits.  Result (last
        split to arrive, in split order): TWO -> h[st, row, n] fp32 (out [2, R, N]); else
        y[pair, n] bf16."""
        grid_dependency_sync(PDL)
        BN: gl.constexpr = 16 * WARPS * MT
        BYTE_L: gl.constexpr = _byte_layout(WARPS, MT)
        NS: gl.constexpr = 2 if TWO else 1
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, NT, 32])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=4)
        x_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8,
                                                  rank=2)
        xl_l: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0])
        s_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
        KR: gl.constexpr = CPS * _CHUNK
        pid_n = gl.program_id(0)
        blk = gl.program_id(1)
        split = gl.program_id(2)
        nblk = gl.num_programs(1)
        e = gl.load(bexp_ptr + blk)
        if (e >= 0) & (e < E):
            e64 = e.to(gl.int64)
            c0 = split * CPS
            # Columns of the accumulator: their pairs, activation rows and scales.
            pc = gl.load(pair_ptr + blk * BM + gl.arange(0, NT, layout=gl.SliceLayout(0, acc_l)))
            valid = pc < P
            rc = blk * BM + gl.arange(0, NT, layout=gl.SliceLayout(0, acc_l))
            if TOKEN_ROWS:
                rc = pc // TOPK
            xs_base = as_ptr + rc.to(gl.int64) * (K // _CHUNK)
            # This program's weight rows: bytes in the byte layout, scales by accumulator row.
            rb = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, BYTE_L))
            cb = gl.arange(0, 16, layout=gl.SliceLayout(0, BYTE_L))
            w_off = e64 * (N * (K // 2)) + rb[:, None] * 64 + cb[None, :]
            rs = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_l))
            s_off = e64 * (N * (K // 32)) + rs * 4
            zero = gl.zeros([BN, NT], gl.float32, acc_l)
            acc1 = gl.zeros([BN, NT], gl.float32, acc_l)
            acc3 = gl.zeros([BN, NT], gl.float32, acc_l)
            # The split's activation rows into shared memory, once.  (The fill comes before
            # the weight loads: with all PF chunks of w1 and w3 in flight across it, the up
            # GEMM needs 150 registers, not 72, and an SM holds half the programs.)
            x_s = gl.allocate_shared_memory(gl.float8e4nv, [NT, KR], x_sl)
            if ACT == _ACT_CODES:
                px = gl.load(pair_ptr + blk * BM
                             + gl.arange(0, NT, layout=gl.SliceLayout(1, xl_l)))
                rx = blk * BM + gl.arange(0, NT, layout=gl.SliceLayout(1, xl_l))
                if TOKEN_ROWS:
                    rx = px // TOPK
                kx = gl.arange(0, KR, layout=gl.SliceLayout(0, xl_l))
                xv = gl.load(a_ptr + rx.to(gl.int64)[:, None] * K + c0 * _CHUNK + kx[None, :],
                             mask=(px < P)[:, None] & (kx >= 0)[None, :], other=0)
                x_s.store(xv.to(gl.float8e4nv, bitcast=True))
            else:
                # Quantized row by row into a plain buffer (a swizzled one cannot be split by
                # row), then copied into x_s whole.
                f_s = gl.allocate_shared_memory(gl.float8e4nv, [NT, KR], s_sl)
                s_s = gl.allocate_shared_memory(gl.float32, [CPS, NT], s_sl)
                _quantize_fill(f_s, s_s, a_ptr, wt_ptr, pair_ptr, blk, c0, P, R, stride_a,
                               limit, K, TOPK, ACT, HAS_LIMIT, BM, NT, WARPS, CPS)
                gl.thread_barrier()
                x_s.store(f_s.load(xl_l))
            fence_async_shared()
            gl.thread_barrier()
            # Chunk c + PF is loaded before chunk c's products are issued (PF chunks in flight
            # a thread: the loads' latency is what bounds a one-token call).
            cur1 = _load_chunk(w1_ptr + w_off, s1_ptr + s_off, c0, N)
            if TWO:
                cur3 = _load_chunk(w3_ptr + w_off, s3_ptr + s_off, c0, N)
            if PF >= 2:
                if CPS > 1:
                    nxt1 = _load_chunk(w1_ptr + w_off, s1_ptr + s_off, c0 + 1, N)
                    if TWO:
                        nxt3 = _load_chunk(w3_ptr + w_off, s3_ptr + s_off, c0 + 1, N)
            for ci in gl.static_range(CPS):
                c = c0 + ci
                if ci + PF < CPS:
                    new1 = _load_chunk(w1_ptr + w_off, s1_ptr + s_off, c + PF, N)
                    if TWO:
                        new3 = _load_chunk(w3_ptr + w_off, s3_ptr + s_off, c + PF, N)
                if ACT == _ACT_CODES:
                    xs = gl.load(xs_base + c, mask=valid, other=0.0)[None, :]
                else:
                    xs = s_s.slice(ci, 1, dim=0).load(acc_l)
                xc = x_s.slice(ci * _CHUNK, _CHUNK, dim=1)
                acc1 = gl.fma(_chunk_sum(cur1, xc, zero, BN, a_l), xs, acc1)
                if TWO:
                    acc3 = gl.fma(_chunk_sum(cur3, xc, zero, BN, a_l), xs, acc3)
                if PF == 1:
                    if ci + 1 < CPS:
                        cur1 = new1
                        if TWO:
                            cur3 = new3
                if PF == 2:
                    if ci + 1 < CPS:
                        cur1 = nxt1
                        if TWO:
                            cur3 = nxt3
                    if ci + 2 < CPS:
                        nxt1 = new1
                        if TWO:
                            nxt3 = new3
            rn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_l))
            cols = gl.arange(0, NT, layout=gl.SliceLayout(0, acc_l))
            if S > 1:
                # fp32 partials [S, blocks, NS, N, NT]; the last split sums them in split order.
                tile = (blk * NS * N + rn.to(gl.int64))[:, None] * NT + cols[None, :]
                gl.store(part_ptr + (split * nblk) * (NS * N * NT) + tile, acc1)
                if TWO:
                    gl.store(part_ptr + (split * nblk) * (NS * N * NT) + N * NT + tile, acc3)
                gl.thread_barrier()
                count = arrivals_ptr + blk * gl.num_programs(0) + pid_n
                old = gl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
                if old == S - 1:
                    gl.thread_barrier()
                    acc1 = gl.load(part_ptr + tile, cache_modifier=".cg")
                    if TWO:
                        acc3 = gl.load(part_ptr + N * NT + tile, cache_modifier=".cg")
                    for s in range(1, S):
                        acc1 += gl.load(part_ptr + (s * nblk) * (NS * N * NT) + tile,
                                        cache_modifier=".cg")
                        if TWO:
                            acc3 += gl.load(part_ptr + (s * nblk) * (NS * N * NT) + N * NT
                                            + tile, cache_modifier=".cg")
                    gl.store(count, 0)
                    _store_result(out_ptr, acc1, acc3, pc, valid, blk, cols, rn, R, N, BM, TWO)
            else:
                _store_result(out_ptr, acc1, acc3, pc, valid, blk, cols, rn, R, N, BM, TWO)

    @gluon.jit
    def _store_result(out_ptr, acc1, acc3, pc, valid, blk, cols, rn, R, N: gl.constexpr,
                      BM: gl.constexpr, TWO: gl.constexpr):
        """TWO: the gate and up sums at h[0 / 1, plan row, n] (fp32); else each pair's row
        y[pair, n] rounded to bf16."""
        m = valid[None, :] & (rn >= 0)[:, None]
        if TWO:
            h = out_ptr + (blk * BM + cols)[None, :].to(gl.int64) * N + rn[:, None]
            gl.store(h, acc1, mask=m)
            gl.store(h + R * N, acc3, mask=m)
        else:
            gl.store(out_ptr + pc[None, :].to(gl.int64) * N + rn[:, None],
                     acc1.to(gl.bfloat16), mask=m)


# ------------------------------------------------------------------------------ host side
@dataclass(frozen=True)
class GemvPlan:
    """Tile plan of one GEMM: warps (one warpgroup of 64 rows per 4), row tiles a warp (MT),
    K chunks a split (CPS) and chunks in flight (PF, 1 or 2: in registers)."""

    warps: int = 4
    mt: int = 1
    cps: int = 8
    pf: int = 2

    @property
    def rows(self) -> int:
        return 16 * self.warps * self.mt


def pick_plan(n: int, k: int, two: bool = True) -> GemvPlan:
    """The plan of an [n, k] GEMM (H100 sweeps, docs/PERFORMANCE.md twenty-eighth and
    twenty-ninth sessions: 64-row tiles, 8 chunks a split; 2 chunks in flight for the w1 + w3
    GEMM (``two``), 1 for w2, whose loads of one matrix need fewer registers); fewer chunks
    where K is short."""
    return GemvPlan(cps=min(8, k // CHUNK), pf=2 if two else 1)


def mma_columns(tokens: int) -> int:
    """The products' N (columns = pairs of one expert's block): 8 up to 8 tokens, else 16.  An
    expert holds at most one pair a token when no token picks it twice."""
    return 8 if tokens <= 8 else 16


def pairs_fit(tokens: int, pairs: int) -> bool:
    """Whether every plan block of a call's ``pairs`` fits the products' columns
    (:func:`mma_columns`): all of them do when the columns are as wide as the blocks; narrower
    ones hold a block whatever the routing only if they hold all the pairs (a token may pick
    one expert twice)."""
    nt = mma_columns(tokens)
    return pairs > 0 and (pairs <= nt or nt >= PLAN_BM)


def qualifies(x: torch.Tensor, topk_ids: torch.Tensor, experts: ExpertWeights) -> bool:
    """Whether :func:`moe_experts_wgmma` serves this call (the flag, Gluon, an sm_90 GPU, a
    decode call of bf16 tokens, K-chunk-major MXFP4 stacks with e8m0 scales, FP8 activations
    per 128 columns, widths the tiles divide)."""
    if not (WGMMA_DECODE and HAVE_GLUON and x.is_cuda and x.dtype == torch.bfloat16):
        return False
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        return False
    P = topk_ids.numel()
    D, inter = x.shape[1], experts.inter_dim
    up, down = pick_plan(inter, D), pick_plan(D, inter, two=False)
    return (x.shape[0] <= MAX_TOKENS and pairs_fit(x.shape[0], P)
            and experts.fmt == "fp4"
            and experts.kchunk == CHUNK and experts.act_block == CHUNK and experts.s1 is not None
            and experts.s1.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", None))
            and inter % up.rows == 0 and D % down.rows == 0
            and D % (up.cps * CHUNK) == 0 and inter % (down.cps * CHUNK) == 0)


def _gemv(w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor | None, s3: torch.Tensor | None,
          act: torch.Tensor, act_mode: int, pairs: torch.Tensor, block_expert: torch.Tensor,
          out: torch.Tensor, P: int, E: int, N: int, K: int, topk: int, NT: int,
          plan: GemvPlan, act_scale: torch.Tensor | None = None, token_rows: bool = False,
          weights: torch.Tensor | None = None, limit: float = 0.0) -> None:
    """One launch of ``_wgmma_gemv_kernel`` (w1 alone, or w1 and w3) on the activation
    ``act`` of kind ``act_mode`` (ACT_CODES with ``act_scale`` and ``token_rows``;
    ACT_TOKENS; ACT_SWIGLU with ``weights`` and ``limit``)."""
    nb = block_expert.numel()
    tiles = N // plan.rows
    splits = K // (plan.cps * CHUNK)
    two = w3 is not None
    dev = act.device
    part = (torch.empty(splits, nb, 2 if two else 1, N, NT, dtype=torch.float32, device=dev)
            if splits > 1 else out)
    arrivals = (splitk_counters(dev, nb * tiles, "moe_experts_wgmma") if splits > 1
                else block_expert)
    R = pairs.numel()
    _wgmma_gemv_kernel[(tiles, nb, splits)](
        w1, s1, w3 if two else w1, s3 if two else s1, act,
        act if act_scale is None else act_scale, out if weights is None else weights, pairs,
        block_expert, part, arrivals, out, P, E, R, act.stride(-2), float(limit), N=N, K=K,
        TOPK=topk, TWO=two, ACT=act_mode, TOKEN_ROWS=token_rows, HAS_LIMIT=limit > 0,
        BM=PLAN_BM, NT=NT, WARPS=plan.warps, MT=plan.mt, CPS=plan.cps, PF=plan.pf, S=splits,
        num_warps=plan.warps, **pdl_args(act))


def moe_experts_wgmma(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      experts: ExpertWeights, swiglu_limit: float,
                      pairs: torch.Tensor | None = None, block_expert: torch.Tensor | None = None,
                      shared: torch.Tensor | None = None,
                      wait_shared: Callable[[], None] | None = None) -> torch.Tensor:
    """:func:`dsv4.ops.triton_moe.moe_experts_with_config` of a decode call that
    :func:`qualifies`: fp32 [T, D], or with ``shared`` the routed + shared sum in x's dtype.
    ``pairs`` / ``block_expert``: the plan of 16-row blocks (:func:`triton_moe.moe_plan`, or
    the gate's), made here when not given; ``wait_shared`` runs before ``shared`` is read.
    An expert's pairs must fit :func:`mma_columns` (true when no token picks an expert twice,
    or when T·k does, as :func:`qualifies` requires)."""
    T, D = x.shape
    k = topk_ids.shape[1]
    E, inter = experts.num_experts, experts.inter_dim
    P = T * k
    BM = PLAN_BM
    ids = topk_ids.contiguous()
    if pairs is None or block_expert is None:
        pairs, block_expert = tm.moe_plan(ids, E, BM)
    x = x if x.stride(1) == 1 else x.contiguous()
    wts = topk_weights.reshape(-1).float().contiguous()
    NT = mma_columns(T)
    R = pairs.numel()
    u8 = torch.uint8
    h = torch.empty(2, R, inter, dtype=torch.float32, device=x.device)
    y = torch.empty(P, D, dtype=x.dtype, device=x.device)
    up, down = pick_plan(inter, D), pick_plan(D, inter, two=False)
    w1, s1, w3, s3, w2, s2 = (t.view(u8) for t in (experts.w1, experts.s1, experts.w3,
                                                    experts.s3, experts.w2, experts.s2))
    if FUSED_FILL:   # each GEMM quantizes its own activation
        _gemv(w1, s1, w3, s3, x, ACT_TOKENS, pairs, block_expert, h, P, E, inter, D, k, NT, up)
        _gemv(w2, s2, None, None, h, ACT_SWIGLU, pairs, block_expert, y, P, E, D, inter, k, NT,
              down, weights=wts, limit=swiglu_limit)
    else:
        xq, xsc = x_codes(x)
        _gemv(w1, s1, w3, s3, xq, ACT_CODES, pairs, block_expert, h, P, E, inter, D, k, NT, up,
              act_scale=xsc, token_rows=True)
        aq, asc = act_codes(h, pairs, block_expert, wts, P, E, BM, swiglu_limit)
        _gemv(w2, s2, None, None, aq, ACT_CODES, pairs, block_expert, y, P, E, D, inter, k, NT,
              down, act_scale=asc)
    out = torch.empty(T, D, dtype=torch.float32 if shared is None else x.dtype,
                      device=x.device)
    if shared is not None:
        if wait_shared is not None:
            wait_shared()
        tm._check_shared(x, shared)
    BD = min(1024, triton.next_power_of_2(D))
    tm._moe_combine_kernel[(T, triton.cdiv(D, BD))](
        y, ids, out, out if shared is None else shared.contiguous(), D, E, TOPK=k, BD=BD,
        SHARED=shared is not None, num_warps=4, **pdl_args(y))
    return out
