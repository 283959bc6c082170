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

Large calls (prefill: at least ``DEQUANT_GEMM_MIN_ROWS`` pairs per expert on average; off by
default until measured on the GPU) can take :func:`moe_experts_grouped` instead: every expert dequantized once by ``_dequant_experts_kernel``
into a scratch, then ``torch._grouped_mm`` (cuBLAS) for the two GEMMs, the same combine.

MXFP4 bytes pack k = 2j (low nibble) and k = 2j + 1 (high nibble): the kernels multiply the even
and the odd columns of the activation by the two nibble planes separately, so the codes never need
interleaving.  Under official numerics (``act_block``) the activations are FP8 fake-quantized in
the kernels while loading, block by block (BK = act_block).

Two MXFP4 GEMM variants (``MoeConfig.fp4_path``):

* ``"dequant"`` (default): every weight element decoded to fp32, times its 2^scale, rounded to
  the compute dtype, then a compute-dtype MMA (~8 ALU ops per weight element);
* ``"group_scaled"`` (official numerics only): the e2m1 codes stay fp16 bit patterns (value ×
  2^-14, exact), the FP8-quantized activation is split exactly into its e4m3 value (exact in
  fp16) and its per-row power of two; fp16 MMAs per 32-wide K group (16 even + 16 odd codes)
  give a [BM, BN] fp32 partial, scaled once per group by the e8m0 scale × 2^14 and once per
  activation block by the row's 2^e.  Every scaling is by a power of two, so the result is the
  same sum of the same exact products; only the fp32 accumulation order differs.  Under bf16
  numerics the activation is not exact in fp16 (8 exponent bits), so that case keeps the
  dequant path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from dsv4.ops.torch_dense import ExpertWeights
from dsv4.ops.triton_moe_plan import moe_plan, moe_plan_torch
from dsv4.ops.triton_dense import (INTERPRET, mma, pow2_from_exp,
                                   round_to_bf16, round_to_e4m3, store_rne, torch_twin_off_gpu,
                                   ue8m0_exponent)

__all__ = ["moe_experts", "moe_experts_with_config", "moe_experts_grouped", "dequant_experts",
           "MoeConfig", "pick_moe_config", "moe_plan", "moe_plan_torch", "DEQUANT_GEMM_MIN_ROWS",
           "FP4_PATHS", "FP4_PATH", "resolve_fp4_path"]

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
                      BK: tl.constexpr, OUT: tl.constexpr, SW_E8M0: tl.constexpr):
    """One [BN, BK] weight tile of expert e at K offset k0, dequantized into ``OUT``.

    FMT 1 (fp4): returns the (even-k, odd-k) planes [BN, BK/2]; FMT 2 (fp8) and 0 (dense):
    returns the tile twice (the second value unused)."""
    # 64-bit expert offsets: E × (N·K) passes 2^31 elements for V4-Pro stacks and for the
    # bf16 w1|w3 scratch of V4-Flash (255 × 16.8M).
    e = e.to(tl.int64)
    if FMT == 1:
        rj = tl.arange(0, BK // 2)
        byte = tl.load(w_ptr + e * stride_we + rn[:, None] * stride_wn + (k0 // 2 + rj)[None, :],
                       mask=n_mask[:, None], other=0)
        rs = tl.arange(0, BK // 32)
        sc = tl.load(s_ptr + e * stride_se + rn[:, None] * stride_sn + (k0 // 32 + rs)[None, :],
                     mask=n_mask[:, None], other=127)
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
def _load_act_tile(a_ptr, rows, m_mask, k0, stride_am, FMT: tl.constexpr, BK: tl.constexpr,
                   QUANT: tl.constexpr, OUT: tl.constexpr):
    """Activation rows [BM, BK] at K offset k0: fp4 weights want the (even, odd) column halves,
    the others the tile itself (returned twice).  QUANT: FP8 fake quantization (BK = block)."""
    if FMT == 1:
        rj = tl.arange(0, BK // 2)
        base = a_ptr + rows[:, None] * stride_am + (k0 + 2 * rj)[None, :]
        ev = tl.load(base, mask=m_mask[:, None], other=0.0)
        od = tl.load(base + 1, mask=m_mask[:, None], other=0.0)
        if QUANT:
            qe, qo = _fake_quant_pair(ev.to(tl.float32), od.to(tl.float32))
            ev, od = qe.to(OUT), qo.to(OUT)
        return ev, od
    else:
        rk = k0 + tl.arange(0, BK)
        t = tl.load(a_ptr + rows[:, None] * stride_am + rk[None, :], mask=m_mask[:, None],
                    other=0.0)
        if QUANT:
            tf = t.to(tl.float32)
            q, _ = _fake_quant_pair(tf, tf)
            t = q.to(OUT)
        return t, t


@triton.jit
def _dot_tile(acc, a_ev, a_od, w_ev, w_od, FMT: tl.constexpr):
    """acc += A · Wᵀ for one K step (fp4: even and odd planes separately)."""
    acc += mma(a_ev, tl.trans(w_ev), "ieee")
    if FMT == 1:
        acc += mma(a_od, tl.trans(w_od), "ieee")
    return acc


# ------------------------------------------------------------ group-scaled MXFP4 (fp16 MMAs)
@triton.jit
def _act_block_exponent(a_ptr, rows, m_mask, k0, stride_am, BK: tl.constexpr):
    """ue8m0 exponent e [BM] of the FP8 activation quantization of block k0 .. k0+BK of each
    row (amax floor 1e-4, spec §2.5): the same exponent :func:`_fake_quant_pair` uses."""
    rk = k0 + tl.arange(0, BK)
    t = tl.load(a_ptr + rows[:, None] * stride_am + rk[None, :], mask=m_mask[:, None],
                other=0.0).to(tl.float32)
    return ue8m0_exponent(tl.maximum(tl.max(tl.abs(t), axis=1), 1e-4))


@triton.jit
def _act_group_e4m3(a_ptr, rows, m_mask, kg, stride_am, inv):
    """The e4m3 values (even-k, odd-k) [BM, 16] of the 32-wide K group at kg, as fp16 (exact:
    e4m3 has 3 mantissa bits and exponents -9..8): round(clamp(x · 2^-e, ±448))."""
    rj = tl.arange(0, 16)
    base = a_ptr + rows[:, None] * stride_am + (kg + 2 * rj)[None, :]
    ev = tl.load(base, mask=m_mask[:, None], other=0.0).to(tl.float32)
    od = tl.load(base + 1, mask=m_mask[:, None], other=0.0).to(tl.float32)
    qe = round_to_e4m3(tl.clamp(ev * inv[:, None], -448.0, 448.0))
    qo = round_to_e4m3(tl.clamp(od * inv[:, None], -448.0, 448.0))
    return qe.to(tl.float16), qo.to(tl.float16)


@triton.jit
def _fp4_block_fetch(w_ptr, s_ptr, e, rn, n_mask, k0, K, stride_we, stride_wn, stride_se,
                     stride_sn, G: tl.constexpr):
    """The packed bytes [BN, 16] and e8m0 exponents [BN] of the G 32-wide K groups from k0 of
    one MXFP4 stack, as a tuple (bytes_0, scales_0, bytes_1, ...).  Groups at or past K load
    nothing (the loop fetches one block ahead: the loads of block k+1 are in flight while
    block k is decoded and multiplied)."""
    e = e.to(tl.int64)
    rj = tl.arange(0, 16)
    w_rows = w_ptr + e * stride_we + rn[:, None] * stride_wn
    s_rows = s_ptr + e * stride_se + rn * stride_sn
    t = ()
    for g in tl.static_range(G):
        kg = k0 + g * 32
        ok = n_mask & (kg < K)
        t = t + (tl.load(w_rows + (kg // 2 + rj)[None, :], mask=ok[:, None], other=0),
                 tl.load(s_rows + kg // 32, mask=ok, other=127))
    return t


@triton.jit
def _fp4_group_dot(acc, a_ev, a_od, byte, sc):
    """acc + (A_group · W_groupᵀ) · 2^(scale-127) for one 32-wide K group of an MXFP4 stack
    (byte [BN, 16], sc [BN] from :func:`_fp4_block_fetch`).

    The codes enter the fp16 MMA as value × 2^-14; the product sum (fp32) is scaled once by
    2^(scale - 113) per output column, which restores both powers of two exactly."""
    lo, hi = _e2m1_fp16_planes(byte)
    p = tl.dot(a_ev, tl.trans(lo))
    p = tl.dot(a_od, tl.trans(hi), acc=p)
    f = ((sc.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)      # 2^(s - 113)
    return acc + p * f[None, :]


@triton.jit
def _act_scale_and_inverse(ex):
    """(2^e, 2^-e) fp32 of an exponent vector."""
    return pow2_from_exp(ex), pow2_from_exp(-ex)


# ------------------------------------------------------------------------------ kernels
@triton.jit
def _moe_up_kernel(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, pair_ptr, bexp_ptr, wt_ptr, act_ptr,
                   P, N, K, E, TOPK, stride_xm, stride_actm,
                   stride_we, stride_wn, stride_se, stride_sn, limit,
                   FMT: tl.constexpr, SB: tl.constexpr, SW_E8M0: tl.constexpr,
                   QUANT_X: tl.constexpr, HAS_LIMIT: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   GROUP_SCALED: tl.constexpr = False):
    """act[row] = w · swiglu(w1 x, w3 x) for the pairs of one row block and N tile.

    Rows of ``act`` follow the padded sorted layout of the plan (row = block·BM + i).
    GROUP_SCALED (MXFP4 with QUANT_X only): fp16 MMAs per 32-wide K group (module docstring)."""
    blk = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + blk)
    if e < E:
        rm = blk * BM + tl.arange(0, BM)
        pair = tl.load(pair_ptr + rm)
        m_mask = pair < P
        tok = pair // TOPK
        rn = pid_n * BN + tl.arange(0, BN)
        n_mask = rn < N
        OUT: tl.constexpr = x_ptr.dtype.element_ty
        acc1 = tl.zeros((BM, BN), dtype=tl.float32)
        acc3 = tl.zeros((BM, BN), dtype=tl.float32)
        if GROUP_SCALED:
            G: tl.constexpr = BK // 32
            nxt1 = _fp4_block_fetch(w1_ptr, s1_ptr, e, rn, n_mask, 0, K, stride_we, stride_wn,
                                    stride_se, stride_sn, G)
            nxt3 = _fp4_block_fetch(w3_ptr, s3_ptr, e, rn, n_mask, 0, K, stride_we, stride_wn,
                                    stride_se, stride_sn, G)
            for k0 in range(0, K, BK):
                cur1 = nxt1
                cur3 = nxt3
                nxt1 = _fp4_block_fetch(w1_ptr, s1_ptr, e, rn, n_mask, k0 + BK, K, stride_we,
                                        stride_wn, stride_se, stride_sn, G)
                nxt3 = _fp4_block_fetch(w3_ptr, s3_ptr, e, rn, n_mask, k0 + BK, K, stride_we,
                                        stride_wn, stride_se, stride_sn, G)
                sx, inv = _act_scale_and_inverse(
                    _act_block_exponent(x_ptr, tok, m_mask, k0, stride_xm, BK))
                part1 = tl.zeros((BM, BN), dtype=tl.float32)
                part3 = tl.zeros((BM, BN), dtype=tl.float32)
                for g in tl.static_range(G):
                    a_ev, a_od = _act_group_e4m3(x_ptr, tok, m_mask, k0 + g * 32, stride_xm, inv)
                    part1 = _fp4_group_dot(part1, a_ev, a_od, cur1[2 * g], cur1[2 * g + 1])
                    part3 = _fp4_group_dot(part3, a_ev, a_od, cur3[2 * g], cur3[2 * g + 1])
                # The activation's 2^e, once per block (exact).
                acc1 += part1 * sx[:, None]
                acc3 += part3 * sx[:, None]
        else:
            for k0 in range(0, K, BK):
                x_ev, x_od = _load_act_tile(x_ptr, tok, m_mask, k0, stride_xm, FMT, BK, QUANT_X,
                                            OUT)
                g_ev, g_od = _load_weight_tile(w1_ptr, s1_ptr, e, rn, n_mask, k0, stride_we,
                                               stride_wn, stride_se, stride_sn, FMT, SB, BN, BK,
                                               OUT, SW_E8M0)
                acc1 = _dot_tile(acc1, x_ev, x_od, g_ev, g_od, FMT)
                u_ev, u_od = _load_weight_tile(w3_ptr, s3_ptr, e, rn, n_mask, k0, stride_we,
                                               stride_wn, stride_se, stride_sn, FMT, SB, BN, BK,
                                               OUT, SW_E8M0)
                acc3 = _dot_tile(acc3, x_ev, x_od, u_ev, u_od, FMT)
        # The twin's w1/w3 GEMMs return the compute dtype: round there before the SwiGLU.
        g = acc1
        u = acc3
        if OUT == tl.bfloat16:
            g = round_to_bf16(g)
            u = round_to_bf16(u)
        if HAS_LIMIT:
            u = tl.clamp(u, -limit, limit)
            g = tl.minimum(g, limit)
        wt = tl.load(wt_ptr + pair, mask=m_mask, other=0.0)
        a = g * tl.sigmoid(g) * u * wt[:, None]
        store_rne(act_ptr + rm[:, None] * stride_actm + rn[None, :], a,
                  m_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_down_kernel(act_ptr, w2_ptr, s2_ptr, pair_ptr, bexp_ptr, y_ptr,
                     P, N, K, E, stride_actm, stride_ym,
                     stride_we, stride_wn, stride_se, stride_sn,
                     FMT: tl.constexpr, SB: tl.constexpr, SW_E8M0: tl.constexpr,
                     QUANT_A: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, GROUP_SCALED: tl.constexpr = False):
    """y[pair] = w2 · act[row] for the pairs of one row block and N tile (compute dtype).
    GROUP_SCALED: as in :func:`_moe_up_kernel`."""
    blk = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + blk)
    if e < E:
        rm = blk * BM + tl.arange(0, BM)
        pair = tl.load(pair_ptr + rm)
        m_mask = pair < P
        rn = pid_n * BN + tl.arange(0, BN)
        n_mask = rn < N
        OUT: tl.constexpr = act_ptr.dtype.element_ty
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if GROUP_SCALED:
            G: tl.constexpr = BK // 32
            nxt = _fp4_block_fetch(w2_ptr, s2_ptr, e, rn, n_mask, 0, K, stride_we, stride_wn,
                                   stride_se, stride_sn, G)
            for k0 in range(0, K, BK):
                cur = nxt
                nxt = _fp4_block_fetch(w2_ptr, s2_ptr, e, rn, n_mask, k0 + BK, K, stride_we,
                                       stride_wn, stride_se, stride_sn, G)
                sa, inv = _act_scale_and_inverse(
                    _act_block_exponent(act_ptr, rm, m_mask, k0, stride_actm, BK))
                part = tl.zeros((BM, BN), dtype=tl.float32)
                for g in tl.static_range(G):
                    a_ev, a_od = _act_group_e4m3(act_ptr, rm, m_mask, k0 + g * 32, stride_actm,
                                                 inv)
                    part = _fp4_group_dot(part, a_ev, a_od, cur[2 * g], cur[2 * g + 1])
                acc += part * sa[:, None]
        else:
            for k0 in range(0, K, BK):
                a_ev, a_od = _load_act_tile(act_ptr, rm, m_mask, k0, stride_actm, FMT, BK,
                                            QUANT_A, OUT)
                w_ev, w_od = _load_weight_tile(w2_ptr, s2_ptr, e, rn, n_mask, k0, stride_we,
                                               stride_wn, stride_se, stride_sn, FMT, SB, BN, BK,
                                               OUT, SW_E8M0)
                acc = _dot_tile(acc, a_ev, a_od, w_ev, w_od, FMT)
        store_rne(y_ptr + pair.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc,
                  m_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_combine_kernel(y_ptr, ids_ptr, out_ptr, D, E, TOPK: tl.constexpr, BD: tl.constexpr):
    """out[t] = Σ_j y[t·k + j] in fp32 over the picks j whose expert id is in 0..E-1."""
    t = tl.program_id(0)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    d_mask = rd < D
    acc = tl.zeros((BD,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        e = tl.load(ids_ptr + t * TOPK + j)
        ok = (e >= 0) & (e < E)
        v = tl.load(y_ptr + (t * TOPK + j).to(tl.int64) * D + rd, mask=d_mask & ok, other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * D + rd, acc, mask=d_mask)


@triton.jit
def _dequant_experts_kernel(w_ptr, s_ptr, out_ptr, N, stride_we, stride_wn, stride_se,
                            stride_sn, stride_oe, stride_on, FMT: tl.constexpr,
                            SB: tl.constexpr, SW_E8M0: tl.constexpr, BR: tl.constexpr,
                            BK: tl.constexpr):
    """out[e, n, k] = the dequantized weight (exact for MXFP4) for one [BR, BK] tile."""
    rn = tl.program_id(0) * BR + tl.arange(0, BR)
    k0 = tl.program_id(1) * BK
    e = tl.program_id(2)
    n_mask = rn < N
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    e = e.to(tl.int64)
    ev, od = _load_weight_tile(w_ptr, s_ptr, e, rn, n_mask, k0, stride_we, stride_wn, stride_se,
                               stride_sn, FMT, SB, BR, BK, OUT, SW_E8M0)
    base = out_ptr + e * stride_oe + rn[:, None] * stride_on
    if FMT == 1:
        rj = tl.arange(0, BK // 2)
        tl.store(base + (k0 + 2 * rj)[None, :], ev, mask=n_mask[:, None])
        tl.store(base + (k0 + 2 * rj + 1)[None, :], od, mask=n_mask[:, None])
    else:
        tl.store(base + (k0 + tl.arange(0, BK))[None, :], ev, mask=n_mask[:, None])


# ------------------------------------------------------------------------------ host side
FP4_PATHS = ("dequant", "group_scaled")
# The MXFP4 GEMM variant pick_moe_config chooses.  "dequant" until "group_scaled" is measured
# faster on the GPU (bench/moe_decode.py); not measured yet.
FP4_PATH = "dequant"


@dataclass(frozen=True)
class MoeConfig:
    """Tile plan of one expert call: BM rows per block (each block one expert), N tiles of the
    up (gate+up) and down GEMMs, K step (= the FP8 act-quant block under official numerics)."""

    BM: int
    BN_up: int
    BN_down: int
    BK: int = 128
    warps_up: int = 4
    warps_down: int = 4
    stages: int = 3
    # "dequant" or "group_scaled" (module docstring); group_scaled applies to MXFP4 experts
    # under official numerics (act_block set) and falls back to dequant otherwise.
    fp4_path: str = "dequant"

    def __post_init__(self) -> None:
        if self.fp4_path not in FP4_PATHS:
            raise ValueError(f"MoeConfig: fp4_path={self.fp4_path!r} is not supported; "
                             f"allowed: {FP4_PATHS}")
        for name in ("BM", "BN_up", "BN_down"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoeConfig: {name} must be a power of two >= 16; found {v}")


def pick_moe_config(num_pairs: int, num_experts: int, dim: int, inter: int, block_k: int
                    ) -> MoeConfig:
    """Tile plan by the average rows per active expert (decode: ~1; 8K prefill: ~190).

    From the H200 sweep (docs/PERFORMANCE.md, V4-Flash shapes): 16-row blocks for decode with
    wide N tiles (64/128 at one token, 128/128 from 16 tokens up), 64-row blocks with 128-wide
    tiles and 4 warps beyond (the kernel path of prefill; large calls take
    :func:`moe_experts_grouped` by default)."""
    active = max(1, min(num_experts, num_pairs))
    rows = num_pairs / active
    path = FP4_PATH
    if rows <= 16:
        if num_pairs <= 8:
            return MoeConfig(BM=16, BN_up=64, BN_down=128, BK=block_k, stages=3, fp4_path=path)
        return MoeConfig(BM=16, BN_up=128, BN_down=128, BK=block_k, stages=3, fp4_path=path)
    if rows <= 32:
        return MoeConfig(BM=32, BN_up=128, BN_down=128, BK=block_k, stages=3, fp4_path=path)
    return MoeConfig(BM=64, BN_up=128, BN_down=128, BK=block_k, stages=3, fp4_path=path)


# Shared memory the pipelined operand buffers of one program may take (the H200: 227 KB).
_SMEM_BUDGET = 224 * 1024


def _fit_stages(stages: int, rows: int, cols: int, BK: int, itemsize: int) -> int:
    """Pipeline depth for dense stacks, whose operand tiles (``rows`` activation rows and
    ``cols`` weight rows of BK elements) the compiler buffers in shared memory once per stage:
    at most ``stages``, fewer where they would not fit (bf16 BM 64 × 2·128 at 3 stages needs
    240 KB).  Quantized stacks are decoded in registers and are not buffered this way."""
    per_stage = (rows + cols) * BK * itemsize
    return max(1, min(stages, _SMEM_BUDGET // per_stage))


def resolve_fp4_path(cfg: MoeConfig, experts: ExpertWeights) -> str:
    """The GEMM variant a call runs: ``cfg.fp4_path`` for MXFP4 experts under official numerics
    (``act_block`` set, a multiple of 32); "dequant" otherwise (a bf16 or fp32 activation is
    not exact in fp16, and FP8 / dense stacks have no e2m1 codes)."""
    if (cfg.fp4_path == "group_scaled" and experts.fmt == "fp4" and experts.act_block
            and experts.act_block % 32 == 0):
        return "group_scaled"
    return "dequant"


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
    if experts.act_block:
        bk = experts.act_block
    elif experts.fmt == "fp8":
        bk = experts.block
    else:
        bk = 128
        while bk > 32 and (D % bk or inter % bk):
            bk //= 2
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
        SB=experts.block if experts.fmt == "fp8" else 32, SW_E8M0=e8m0, BR=BR, BK=bk,
        num_warps=4)
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
    _moe_combine_kernel[(T, triton.cdiv(D, BD))](y, ids, out, D, E, TOPK=k, BD=BD, num_warps=4)
    return out


def moe_experts_with_config(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                            experts: ExpertWeights, swiglu_limit: float,
                            cfg: MoeConfig | None = None) -> torch.Tensor:
    """:func:`moe_experts` with an explicit tile plan (``None``: :func:`pick_moe_config`)."""
    _check_experts(x, topk_ids, topk_weights, experts)
    T, D = x.shape
    E, inter, k = experts.num_experts, experts.inter_dim, topk_ids.shape[1]
    out = torch.empty(T, D, dtype=torch.float32, device=x.device)
    if T == 0 or k == 0:
        return out.zero_()
    bk = _block_k(experts, D, inter)
    P = T * k
    if cfg is None:
        cfg = pick_moe_config(P, E, D, inter, bk)
    if cfg.BK != bk:
        cfg = replace(cfg, BK=bk)
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.contiguous()
    wts = topk_weights.reshape(-1).float().contiguous()
    pairs, block_expert = moe_plan(ids, E, cfg.BM)
    nb = block_expert.shape[0]
    fmt = _FMT_CODE[experts.fmt]
    quant = bool(experts.act_block)
    w1, s1, e8m0 = _weight_args(experts, "w1")
    w3, s3, _ = _weight_args(experts, "w3")
    w2, s2, _ = _weight_args(experts, "w2")
    sb = experts.block if experts.fmt == "fp8" else 32
    gs = resolve_fp4_path(cfg, experts) == "group_scaled"
    stages_up, stages_down = cfg.stages, cfg.stages
    if experts.fmt == "dense":
        size = experts.w1.element_size()
        stages_up = _fit_stages(cfg.stages, cfg.BM, 2 * cfg.BN_up, cfg.BK, size)
        stages_down = _fit_stages(cfg.stages, cfg.BM, cfg.BN_down, cfg.BK, size)
    act = torch.empty(nb * cfg.BM, inter, dtype=x.dtype, device=x.device)
    _moe_up_kernel[(nb, triton.cdiv(inter, cfg.BN_up))](
        x, w1, w3, s1, s3, pairs, block_expert, wts, act,
        P, inter, D, E, k, x.stride(0), act.stride(0),
        w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), float(swiglu_limit),
        FMT=fmt, SB=sb, SW_E8M0=e8m0, QUANT_X=quant, HAS_LIMIT=swiglu_limit > 0,
        BM=cfg.BM, BN=cfg.BN_up, BK=cfg.BK, GROUP_SCALED=gs, num_warps=cfg.warps_up,
        num_stages=stages_up)
    y = torch.empty(P, D, dtype=x.dtype, device=x.device)
    _moe_down_kernel[(nb, triton.cdiv(D, cfg.BN_down))](
        act, w2, s2, pairs, block_expert, y, P, D, inter, E, act.stride(0), y.stride(0),
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        FMT=fmt, SB=sb, SW_E8M0=e8m0, QUANT_A=quant,
        BM=cfg.BM, BN=cfg.BN_down, BK=cfg.BK, GROUP_SCALED=gs, num_warps=cfg.warps_down,
        num_stages=stages_down)
    BD = min(1024, triton.next_power_of_2(D))
    _moe_combine_kernel[(T, triton.cdiv(D, BD))](y, ids, out, D, E, TOPK=k, BD=BD, num_warps=4)
    return out


@torch_twin_off_gpu("dsv4.ops.torch_dense")
def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                experts: ExpertWeights, swiglu_limit: float) -> torch.Tensor:
    """Weighted sum of the routed experts picked per token (spec §3.9), fp32 [T, D].

    x [T, D] (bf16 / fp32); topk_ids [T, k] (ids outside 0..E-1 are skipped); topk_weights
    [T, k] fp32; ``experts`` dense, MXFP4 or FP8-block stacks (:class:`ExpertWeights`).  Each
    pick computes ``w2((w · swiglu(w1 x, w3 x)).to(x.dtype))`` with the clamp of ``swiglu_limit``;
    the picks are summed in fp32.
    """
    pairs = topk_ids.numel()
    if (DEQUANT_GEMM_MIN_ROWS is not None and experts.fmt != "dense"
            and hasattr(torch, "_grouped_mm")
            and pairs >= DEQUANT_GEMM_MIN_ROWS * experts.num_experts):
        return moe_experts_grouped(x, topk_ids, topk_weights, experts, swiglu_limit)
    return moe_experts_with_config(x, topk_ids, topk_weights, experts, swiglu_limit, None)
