"""Triton kernels of the mHC mixes (spec §3.4, §3.10): ``hc_pre`` (split-K mixes + RMS statistic,
then gates, Sinkhorn and the collapse), ``hc_post``, ``hc_head`` and ``hc_post_pre`` (a
sublayer's post fused with the next sublayer's pre), with their tile plans (:class:`HcPlan`).

Same signatures as the torch twins in ``dsv4/ops/torch_dense.py``.  The kernels run on Hopper
GPUs and, at tiny shapes, in the Triton interpreter (``TRITON_INTERPRET=1``) on CPU tensors.

The collapse of n = 4 streams (every V4 model) is ``_hc_collapse4_kernel``: gates and Sinkhorn
in per-thread scalars (no cross-thread sums), and, given the sublayer's input norm weight
(``norm_weight``), the RMSNorm of y in the same kernel below :data:`HC_NORM_FUSED_T` tokens —
the bits of the collapse followed by ``triton_norm.rms_norm``.  Other n take the general
``_hc_collapse_kernel`` and a separate norm launch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.streams import comb_lane, comb_lane_active, join_comb_lane
from dsv4.ops.triton_dense import (
    _dot_bf16x3,
    round_as,
    round_to_bf16,
    sm_count,
    store_rne,
    torch_twin_off_gpu,
)
from dsv4.ops import triton_norm

__all__ = ["hc_pre", "hc_post", "hc_post_pre", "hc_head", "HcPlan", "pick_hc_plan",
           "hc_pre_with_plan", "hc_head_with_plan", "hc_post_with_plan", "hc_post_pre_with_plan",
           "HC_PREFILL_T", "HC_NORM_FUSED_T", "HC_POST_PRE_MID_T", "HC_POST_PRE_WIDE_T"]


# ------------------------------------------------------------------------------ mHC
# Why the prefill launches were slow (dsv4 issue #5; register counts from the offline sm_90
# compile of the real launches, T = 8192, bf16 streams): the fused post + mixes kernel ran
# BT 64 × BD 32 at 4 warps with a tf32x3 dot: 255 registers + 624 B of spills and 114 KB of
# shared memory, so one 4-warp program per SM; a 32-column chunk gives each thread one bf16
# (2-byte accesses); tf32x3 splits the fp32 A tile into two more register tiles.  The plain
# mixes kernel (hc_pre) at BT 64 spilled too.  The fused kernel now computes each output stream
# as its own 2-D tile with its own dot (no 3-D tile reshaped into an MMA operand), and the
# prefill plans take more warps and, for bf16 streams, the "bf16x3" mix: the bf16 activation
# is exact as an MMA operand and fn is split exactly into three bf16 parts, so three bf16 MMAs
# give the fp32 products exactly (fp32 sums; tf32x3 drops a lo·lo term) with no split of the
# activation tile.
@dataclass(frozen=True)
class HcPlan:
    """Tile plan of one mHC launch.

    BT tokens per program (``hc_post``: 1, one token per program); BD columns of each of the n
    streams per chunk (the mixes dot runs over n·BD columns of flatten(x)); num_warps /
    num_stages of the launch; per_sm: the D (K) split aims at this many programs per SM;
    mix: "fp32" (tf32x3 on the GPU, ieee where rejected and in the interpreter) or "bf16x3"
    (bf16 streams only: three exact bf16 parts of fn against the bf16 activation; fp32 streams
    take "fp32"); gates_once (the fused post + mixes only): load the post / comb gates once
    before the D loop instead of each chunk (fewer instructions a chunk, more registers; the
    same bits)."""

    BT: int
    BD: int
    num_warps: int = 4
    num_stages: int = 3
    per_sm: int = 2
    mix: str = "fp32"
    gates_once: bool = False

    def __post_init__(self) -> None:
        for name in ("BT", "BD", "num_warps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"HcPlan: {name} must be a power of two; found {v!r}")
        if self.num_stages < 1 or self.per_sm < 1:
            raise ValueError(f"HcPlan: num_stages and per_sm must be >= 1; found "
                             f"{self.num_stages}, {self.per_sm}")
        if self.mix not in ("fp32", "bf16x3"):
            raise ValueError(f"HcPlan: mix must be 'fp32' or 'bf16x3'; found {self.mix!r}")

    def label(self) -> str:
        """Short text for tables: BTxBD/warps/stages/per_sm/mix."""
        return (f"BT{self.BT} BD{self.BD} w{self.num_warps} s{self.num_stages} "
                f"sm{self.per_sm} {self.mix}" + (" g1" if self.gates_once else ""))


# From this many tokens the prefill plans apply; below, the decode plans of before (unchanged).
HC_PREFILL_T = 1024
# The fused post + mixes between decode and prefill sizes (a short prompt, a mixed step): from
# HC_POST_PRE_MID_T tokens the decode tiles on 2 warps, from HC_POST_PRE_WIDE_T the prefill plan
# (H100 sweep, twenty-fourth session: 64 tokens 30.7 → 13.1 µs, 128 36.1 → 19.8, 256 45.9 →
# 37.6, 512 96.6 → 64.2; x_new the same bits, the mixes within fp32 rounding).
# (DSV4_HC_POST_PRE_MID_T=1024 restores the decode plan below HC_PREFILL_T, for A/B runs.)
HC_POST_PRE_MID_T = int(os.environ.get("DSV4_HC_POST_PRE_MID_T", "64"))
HC_POST_PRE_WIDE_T = 256
# Below this many tokens a collapse given a norm weight (n = 4) runs the norm in its own kernel
# (grid (T,), one program per token holding the whole row: one launch less, the latency-bound
# decode case); from it on, the D-split collapse (at its bytes floor at 8,192 tokens) then
# ``rms_norm``.  Whether the fused form also holds the floor at prefill is not measured yet
# (bench/sweep_glue.py times both at T = 8192); the threshold stays at the decode side until it is.
HC_NORM_FUSED_T = HC_PREFILL_T
# For A/B runs: "per_sm[,g1]" replaces the wide fused post + mixes plan's per_sm and gates_once
# (e.g. DSV4_HC_WIDE_PLAN=1,g1).
_WIDE_PLAN_ENV = os.environ.get("DSV4_HC_WIDE_PLAN", "")


def pick_hc_plan(op: str, T: int, n: int, D: int, dtype: torch.dtype) -> HcPlan:
    """Default plan of ``op`` ("pre": hc_pre / hc_head mixes, "post_pre": the fused post +
    mixes, "post": hc_post) for T tokens of n streams of width D.

    The H200 sweep (bench/sweep_glue.py, docs/PERFORMANCE.md fifth session, V4-Flash widths):
    bf16 streams take the "bf16x3" mixes at every T (exact products; 4–8% faster than the
    fp32 path at decode, ~2× at prefill), so decode and prefill sum the same products.  Decode
    (T < HC_PREFILL_T) keeps the tile sizes the kernels had before plans existed.  Prefill: the
    fused post + mixes on 16-column chunks with 4 warps and ~4 programs per SM (8,192 tokens:
    577 µs against 795 for 32-column chunks at 8 warps, 1,255 before plans); the mixes alone on
    64-token tiles at 4 warps (259 µs, 187 registers, no spills)."""
    mix = "bf16x3" if dtype == torch.bfloat16 else "fp32"
    chunk = max(triton.cdiv(16, n), min(128 // n, triton.next_power_of_2(D)))
    if op == "post":
        return HcPlan(BT=1, BD=min(512, triton.next_power_of_2(D)), num_warps=4, num_stages=3)
    if op not in ("pre", "post_pre"):
        raise ValueError(f"pick_hc_plan: op must be 'pre', 'post_pre' or 'post'; found {op!r}")
    per_sm, gates_once = 4, False
    if _WIDE_PLAN_ENV:
        head, _, tail = _WIDE_PLAN_ENV.partition(",")
        if not head.isdigit() or int(head) < 1 or tail not in ("", "g1"):
            raise ValueError(f"DSV4_HC_WIDE_PLAN must be 'per_sm' or 'per_sm,g1' (per_sm >= 1); "
                             f"found {_WIDE_PLAN_ENV!r}")
        per_sm, gates_once = int(head), tail == "g1"
    wide_post_pre = HcPlan(BT=64, BD=max(triton.cdiv(16, n), chunk // 2), num_warps=4,
                           num_stages=3, per_sm=per_sm, mix=mix, gates_once=gates_once)
    if op == "post_pre" and HC_POST_PRE_MID_T <= T < HC_PREFILL_T:
        if T >= HC_POST_PRE_WIDE_T:
            return wide_post_pre
        return HcPlan(BT=16, BD=chunk, num_warps=2, num_stages=3, mix=mix)
    if T < HC_PREFILL_T:
        return HcPlan(BT=16, BD=chunk, num_warps=4, num_stages=3, mix=mix)
    if op == "pre":
        return HcPlan(BT=64, BD=chunk, num_warps=4, num_stages=3, per_sm=2, mix=mix)
    return wide_post_pre


@triton.jit
def _hc_mix_partial_kernel(x_ptr, fn_ptr, part_ptr, sq_ptr, T, KTOT, k_per_split,
                           NJ: tl.constexpr, NJP: tl.constexpr, BT: tl.constexpr,
                           BK: tl.constexpr, PRECISION: tl.constexpr, BF16X3: tl.constexpr,
                           PDL: tl.constexpr = False):
    """Split-K partials of ``flatten(x) @ fn^T`` [T, NJ] and of Σ x² [T] (fp32).

    BF16X3 (bf16 x): the x tile is the MMA operand as loaded, fn in three exact bf16 parts."""
    grid_dependency_sync(PDL)
    pid_t = tl.program_id(0)
    split = tl.program_id(1)
    rt = pid_t * BT + tl.arange(0, BT)
    rj = tl.arange(0, NJP)
    t_mask = rt < T
    j_mask = rj < NJ
    acc = tl.zeros((BT, NJP), dtype=tl.float32)
    sq = tl.zeros((BT,), dtype=tl.float32)
    k0 = split * k_per_split
    for kk in range(0, k_per_split, BK):
        rk = k0 + kk + tl.arange(0, BK)
        k_mask = (rk < KTOT) & (kk + tl.arange(0, BK) < k_per_split)
        xl = tl.load(x_ptr + rt[:, None] * KTOT + rk[None, :],
                     mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        xv = xl.to(tl.float32)
        fv = tl.load(fn_ptr + rj[None, :] * KTOT + rk[:, None],
                     mask=k_mask[:, None] & j_mask[None, :], other=0.0)
        if BF16X3:
            acc = _dot_bf16x3(acc, xl, fv)
        else:
            acc += tl.dot(xv, fv, input_precision=PRECISION)
        sq += tl.sum(xv * xv, axis=1)
    base = split * T
    tl.store(part_ptr + (base + rt[:, None]) * NJP + rj[None, :], acc,
             mask=t_mask[:, None] & j_mask[None, :])
    tl.store(sq_ptr + base + rt, sq, mask=t_mask)


@triton.jit
def _hc_sum_vec(part_ptr, t, T, NJP: tl.constexpr, offs, SPLITS, SP: tl.constexpr):
    """Σ over splits of the partial mixes at the [n] columns ``offs`` of token t (one load)."""
    rs = tl.arange(0, SP)
    v = tl.load(part_ptr + (rs[:, None] * T + t) * NJP + offs[None, :],
                mask=(rs < SPLITS)[:, None], other=0.0)
    return tl.sum(v, axis=0)


@triton.jit
def _hc_sum_mat(part_ptr, t, T, NJP: tl.constexpr, offs, SPLITS, SP: tl.constexpr):
    """Σ over splits of the partial mixes at the [n, n] columns ``offs`` of token t."""
    rs = tl.arange(0, SP)
    v = tl.load(part_ptr + (rs[:, None, None] * T + t) * NJP + offs[None, :, :],
                mask=(rs < SPLITS)[:, None, None], other=0.0)
    return tl.sum(v, axis=0)


@triton.jit
def _hc_collapse_kernel(x_ptr, part_ptr, sq_ptr, scale_ptr, base_ptr, y_ptr, post_ptr, comb_ptr,
                        T, D, SPLITS, norm_eps, hc_eps, ITERS: tl.constexpr, N: tl.constexpr,
                        NJP: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr,
                        HEAD: tl.constexpr, PDL: tl.constexpr = False):
    """Per token: RMS factor, sigmoid gates, Sinkhorn (in registers), collapse Σ_j pre_j·x_j.
    The general-n kernel (n = 4 runs ``_hc_collapse4_kernel``).

    HEAD: the final hc_head (mixes are the n pre gates only; no post / Sinkhorn).
    Grid (T, D blocks); every D block recomputes the tiny gate math, block 0 writes post/comb.
    (At T = 8192 it moved 335 MB in 83 µs on the H200, ~4 TB/s: at its bytes floor already.)
    """
    grid_dependency_sync(PDL)
    t = tl.program_id(0)
    pid_d = tl.program_id(1)
    rs = tl.arange(0, SP)
    sq = tl.sum(tl.load(sq_ptr + rs * T + t, mask=rs < SPLITS, other=0.0), axis=0)
    rstd = 1.0 / tl.sqrt(sq / (N * D) + norm_eps)
    rn = tl.arange(0, N)
    pre_mix = _hc_sum_vec(part_ptr, t, T, NJP, rn, SPLITS, SP) * rstd
    pre = tl.sigmoid(pre_mix * tl.load(scale_ptr) + tl.load(base_ptr + rn)) + hc_eps
    if not HEAD:
        if pid_d == 0:
            post_mix = _hc_sum_vec(part_ptr, t, T, NJP, N + rn, SPLITS, SP) * rstd
            post = 2.0 * tl.sigmoid(post_mix * tl.load(scale_ptr + 1)
                                    + tl.load(base_ptr + N + rn))
            tl.store(post_ptr + t * N + rn, post)
            cidx = 2 * N + rn[:, None] * N + rn[None, :]
            c = (_hc_sum_mat(part_ptr, t, T, NJP, cidx, SPLITS, SP) * rstd * tl.load(scale_ptr + 2)
                 + tl.load(base_ptr + cidx))
            # softmax over k (axis 1), + eps, column normalization, then (row, column) rounds.
            c = tl.exp(c - tl.max(c, axis=1)[:, None])
            c = c / tl.sum(c, axis=1)[:, None] + hc_eps
            c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
            for _ in range(ITERS - 1):
                c = c / (tl.sum(c, axis=1)[:, None] + hc_eps)
                c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
            tl.store(comb_ptr + t * N * N + rn[:, None] * N + rn[None, :], c)
    rd = pid_d * BD + tl.arange(0, BD)
    d_mask = rd < D
    xv = tl.load(x_ptr + t * N * D + rn[:, None] * D + rd[None, :], mask=d_mask[None, :],
                 other=0.0).to(tl.float32)
    y = tl.sum(pre[:, None] * xv, axis=0)
    store_rne(y_ptr + t * D + rd, y, d_mask)


# ------------------------------------------------- the collapse of n = 4 streams (every V4 model)
# Why: at decode the old collapse was latency-bound on its Sinkhorn, 20 rounds of row / column
# sums of a 4x4 tile spread over 128 threads, each sum a cross-thread reduction (shuffles,
# shared memory, barriers), ~40 in a chain.  Here the split-K sums are one [SP, 32] reduction,
# then the 24 mixes (and the RMS statistic, in column NJ) become per-thread scalars through
# reshape / split (one layout conversion); the Sinkhorn is then scalar code, a row or column
# sum 3 adds in one thread, no communication at all.
@triton.jit
def _halves(v, M: tl.constexpr):
    """Even / odd elements of a [M] vector ([M/2] each)."""
    return tl.split(tl.reshape(v, [M // 2, 2]))


@triton.jit
def _unpack4(v):
    """The 4 elements of a [4] vector as scalars, in order."""
    e, o = _halves(v, 4)
    e0, e1 = tl.split(e)
    o0, o1 = tl.split(o)
    return e0, o0, e1, o1


@triton.jit
def _unpack8(v):
    """The 8 elements of a [8] vector as scalars, in order."""
    e, o = _halves(v, 8)
    e0, e1, e2, e3 = _unpack4(e)
    o0, o1, o2, o3 = _unpack4(o)
    return e0, o0, e1, o1, e2, o2, e3, o3


@triton.jit
def _groups8(v):
    """A [32] vector as its four [8] groups (elements 0-7, 8-15, 16-23, 24-31)."""
    w = tl.reshape(tl.trans(tl.reshape(v, [4, 8])), [8, 2, 2])  # w[i, g // 2, g % 2]
    a, b = tl.split(w)
    g0, g2 = tl.split(a)
    g1, g3 = tl.split(b)
    return g0, g1, g2, g3


@triton.jit
def _softmax4(a, b, c, d, eps):
    """Softmax of one row (4 scalars) + eps, the reference's first Sinkhorn step."""
    m = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    a = tl.exp(a - m)
    b = tl.exp(b - m)
    c = tl.exp(c - m)
    d = tl.exp(d - m)
    s = a + b + c + d
    return a / s + eps, b / s + eps, c / s + eps, d / s + eps


@triton.jit
def _normalize4(a, b, c, d, eps):
    """One row or column of 4 scalars divided by (its sum + eps)."""
    s = a + b + c + d + eps
    return a / s, b / s, c / s, d / s


@triton.jit
def _sinkhorn4(c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23,
               c30, c31, c32, c33, eps, ITERS: tl.constexpr):
    """The reference Sinkhorn of a 4x4 (rows j, columns k) held as 16 scalars: softmax over
    k + eps, a column normalization, then ITERS - 1 (row, column) rounds."""
    c00, c01, c02, c03 = _softmax4(c00, c01, c02, c03, eps)
    c10, c11, c12, c13 = _softmax4(c10, c11, c12, c13, eps)
    c20, c21, c22, c23 = _softmax4(c20, c21, c22, c23, eps)
    c30, c31, c32, c33 = _softmax4(c30, c31, c32, c33, eps)
    c00, c10, c20, c30 = _normalize4(c00, c10, c20, c30, eps)
    c01, c11, c21, c31 = _normalize4(c01, c11, c21, c31, eps)
    c02, c12, c22, c32 = _normalize4(c02, c12, c22, c32, eps)
    c03, c13, c23, c33 = _normalize4(c03, c13, c23, c33, eps)
    for _ in range(ITERS - 1):
        c00, c01, c02, c03 = _normalize4(c00, c01, c02, c03, eps)
        c10, c11, c12, c13 = _normalize4(c10, c11, c12, c13, eps)
        c20, c21, c22, c23 = _normalize4(c20, c21, c22, c23, eps)
        c30, c31, c32, c33 = _normalize4(c30, c31, c32, c33, eps)
        c00, c10, c20, c30 = _normalize4(c00, c10, c20, c30, eps)
        c01, c11, c21, c31 = _normalize4(c01, c11, c21, c31, eps)
        c02, c12, c22, c32 = _normalize4(c02, c12, c22, c32, eps)
        c03, c13, c23, c33 = _normalize4(c03, c13, c23, c33, eps)
    return (c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23,
            c30, c31, c32, c33)


@triton.jit
def _comb_logit(m, rstd, scale2, base_ptr, i: tl.constexpr):
    return m * rstd * scale2 + tl.load(base_ptr + i)


@triton.jit
def _hc_collapse4_kernel(x_ptr, part_ptr, sq_ptr, scale_ptr, base_ptr, y_ptr, post_ptr,
                         comb_ptr, w_ptr, mix_ptr, T, D, SPLITS, norm_eps, hc_eps, rms_eps,
                         ITERS: tl.constexpr, NJ: tl.constexpr, NJP: tl.constexpr,
                         SP: tl.constexpr, BD: tl.constexpr, HEAD: tl.constexpr,
                         NORM: tl.constexpr, MODE: tl.constexpr = 0, PDL: tl.constexpr = False):
    """``_hc_collapse_kernel`` for n = 4 streams, gates and Sinkhorn in per-thread scalars.

    Grid (T, D blocks of BD).  NORM (one D block, BD >= D): y is rounded as its store would
    round it, then RMS-normed with weight ``w_ptr`` exactly as ``triton_norm._norm_rope_kernel``
    does (same [1, BD] tile, warps and reduction, IEEE div / sqrt; the launch compiles without
    FMA contraction, as the norm kernel's does), so the result is the bits of
    ``rms_norm(collapse(x))``.  HEAD: the final hc_head (4 pre gates only).  MODE (not HEAD):
    0 everything; 1 the collapse and the post gates, no comb, and the split-K sums of the
    mixes into ``mix_ptr`` [T, 32]; 2 comb alone from those sums (grid (T, 1), any warps: no
    reduction, no stream read): 1 then 2 write the bits of 0 (the comb lane, ``_collapse``)."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0)
    pid_d = tl.program_id(1)
    # The streams first: their loads are in flight during the gate math.
    rd = pid_d * BD + tl.arange(0, BD)[None, :]
    d_mask = rd < D
    row = x_ptr + t * (4 * D) + rd
    if MODE != 2:
        x0 = tl.load(row, mask=d_mask, other=0.0).to(tl.float32)
        x1 = tl.load(row + D, mask=d_mask, other=0.0).to(tl.float32)
        x2 = tl.load(row + 2 * D, mask=d_mask, other=0.0).to(tl.float32)
        x3 = tl.load(row + 3 * D, mask=d_mask, other=0.0).to(tl.float32)
    if MODE == 2:
        sums = tl.load(mix_ptr + t * 32 + tl.arange(0, 32))
    else:
        # Σ over splits of the mixes and (column NJ) of Σ x²: one reduction for all of them.
        rs = tl.arange(0, SP)[:, None]
        rj = tl.arange(0, 32)[None, :]
        s_mask = rs < SPLITS
        v = tl.load(part_ptr + (rs * T + t) * NJP + rj, mask=s_mask & (rj < NJ), other=0.0)
        # (Addressed like the mixes, column NJ hitting sq[s, t]: the load then gets their
        # layout and the compiler reduces in place instead of first moving the whole tile
        # through shared memory into a threads-along-splits layout — 160 shuffles where 2 do.)
        v += tl.load(sq_ptr + (rs * T + t) + (rj - NJ), mask=s_mask & (rj == NJ), other=0.0)
        sums = tl.sum(v, axis=0)
        if MODE == 1:
            if pid_d == 0:
                tl.store(mix_ptr + t * 32 + tl.arange(0, 32), sums)
    g0, g1, g2, g3 = _groups8(sums)
    m0, m1, m2, m3, m4, m5, m6, m7 = _unpack8(g0)
    if HEAD:
        sq = m4
    else:
        sq = _unpack8(g3)[0]
    rstd = 1.0 / tl.sqrt(sq / (4 * D) + norm_eps)
    s0 = tl.load(scale_ptr)
    p0 = tl.sigmoid(m0 * rstd * s0 + tl.load(base_ptr)) + hc_eps
    p1 = tl.sigmoid(m1 * rstd * s0 + tl.load(base_ptr + 1)) + hc_eps
    p2 = tl.sigmoid(m2 * rstd * s0 + tl.load(base_ptr + 2)) + hc_eps
    p3 = tl.sigmoid(m3 * rstd * s0 + tl.load(base_ptr + 3)) + hc_eps
    if not HEAD:
        if pid_d == 0 and MODE != 2:
            s1 = tl.load(scale_ptr + 1)
            tl.store(post_ptr + t * 4, 2.0 * tl.sigmoid(m4 * rstd * s1 + tl.load(base_ptr + 4)))
            tl.store(post_ptr + t * 4 + 1,
                     2.0 * tl.sigmoid(m5 * rstd * s1 + tl.load(base_ptr + 5)))
            tl.store(post_ptr + t * 4 + 2,
                     2.0 * tl.sigmoid(m6 * rstd * s1 + tl.load(base_ptr + 6)))
            tl.store(post_ptr + t * 4 + 3,
                     2.0 * tl.sigmoid(m7 * rstd * s1 + tl.load(base_ptr + 7)))
        if pid_d == 0 and MODE != 1:
            s2 = tl.load(scale_ptr + 2)
            a0, a1, a2, a3, a4, a5, a6, a7 = _unpack8(g1)
            b0, b1, b2, b3, b4, b5, b6, b7 = _unpack8(g2)
            c = _sinkhorn4(
                _comb_logit(a0, rstd, s2, base_ptr, 8), _comb_logit(a1, rstd, s2, base_ptr, 9),
                _comb_logit(a2, rstd, s2, base_ptr, 10), _comb_logit(a3, rstd, s2, base_ptr, 11),
                _comb_logit(a4, rstd, s2, base_ptr, 12), _comb_logit(a5, rstd, s2, base_ptr, 13),
                _comb_logit(a6, rstd, s2, base_ptr, 14), _comb_logit(a7, rstd, s2, base_ptr, 15),
                _comb_logit(b0, rstd, s2, base_ptr, 16), _comb_logit(b1, rstd, s2, base_ptr, 17),
                _comb_logit(b2, rstd, s2, base_ptr, 18), _comb_logit(b3, rstd, s2, base_ptr, 19),
                _comb_logit(b4, rstd, s2, base_ptr, 20), _comb_logit(b5, rstd, s2, base_ptr, 21),
                _comb_logit(b6, rstd, s2, base_ptr, 22), _comb_logit(b7, rstd, s2, base_ptr, 23),
                hc_eps, ITERS)
            for i in tl.static_range(16):
                tl.store(comb_ptr + t * 16 + i, c[i])
    if MODE != 2:
        y = p0 * x0 + p1 * x1 + p2 * x2 + p3 * x3
        if NORM:
            # rms_norm of the stored y: fp32 statistics over the rounded values, weight,
            # rounding.
            y = round_as(y, y_ptr)
            mean_sq = tl.div_rn(tl.sum(y * y, axis=1), D.to(tl.float32))
            r = tl.div_rn(1.0, tl.sqrt_rn(mean_sq + rms_eps))
            y = y * r[:, None]
            w = tl.load(w_ptr + rd, mask=d_mask, other=0.0).to(tl.float32)
            y = w * y
        store_rne(y_ptr + t * D + rd, y, d_mask)


# fp32 mixes as the reference computes them: "tf32x3" keeps ~fp32 accuracy on tensor cores;
# "ieee" (FMA) is the fallback if this Triton build rejects it, and the interpreter's choice.
_HC_PRECISIONS = ["tf32x3", "ieee"]


def _check_plan(name: str, plan: HcPlan, n: int, dot: bool) -> None:
    if dot and (plan.BT < 16 or n * plan.BD < 16):
        raise ValueError(f"{name}: the mixes dot needs BT >= 16 and n·BD >= 16; found BT "
                         f"{plan.BT}, n·BD {n * plan.BD}")


def _launch_mixes(kernel: Any, grid: tuple[int, int], args: tuple, device: torch.device,
                  plan: HcPlan, bf16x3: bool, **constexprs: Any) -> None:
    """Launch a mixes kernel with the first fp32 dot precision this Triton build accepts."""
    precisions = _HC_PRECISIONS if device.type == "cuda" else ["ieee"]
    for i, prec in enumerate(precisions):
        try:
            kernel[grid](*args, **constexprs, PRECISION=prec, BF16X3=bf16x3,
                         num_warps=plan.num_warps, num_stages=plan.num_stages,
                         **pdl_args(args[0]))
            return
        except Exception:  # compile-time rejection of the precision: drop it for good
            if i + 1 == len(precisions):
                raise
            _HC_PRECISIONS.remove(prec)


def _splits(length: int, chunk: int, tiles: int, plan: HcPlan, device: torch.device
            ) -> tuple[int, int]:
    """(per_split, splits): split ``length`` in multiples of ``chunk`` until the launch has
    ~plan.per_sm programs per SM (decode: T is tiny, the reduction long)."""
    want = max(1, triton.cdiv(plan.per_sm * sm_count(device), tiles))
    per_split = max(chunk, triton.cdiv(triton.cdiv(length, want), chunk) * chunk)
    return per_split, triton.cdiv(length, per_split)


def _hc_mix(x: torch.Tensor, fn: torch.Tensor, rows: int, name: str, plan: HcPlan | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    if x.dim() != 3:
        raise ValueError(f"{name}: x must be [T, n_hc, D]; found shape {tuple(x.shape)}")
    T, n, D = x.shape
    if n < 1 or n & (n - 1):
        raise ValueError(f"{name}: n_hc must be a power of two for the Triton kernel; found {n}")
    if tuple(fn.shape) != (rows, n * D):
        raise ValueError(f"{name}: fn must be [{rows}, {n * D}] for x {tuple(x.shape)}; "
                         f"found {tuple(fn.shape)}")
    plan = plan or pick_hc_plan("pre", T, n, D, x.dtype)
    _check_plan(name, plan, n, dot=True)
    x = x.contiguous()
    fn = fn.float().contiguous()
    ktot = n * D
    njp = max(16, triton.next_power_of_2(rows))
    BT, BK = plan.BT, n * plan.BD
    tiles = triton.cdiv(T, BT)
    k_per_split, splits = _splits(ktot, BK, tiles, plan, x.device)
    part = torch.empty(splits, T, njp, dtype=torch.float32, device=x.device)
    sq = torch.empty(splits, T, dtype=torch.float32, device=x.device)
    if T:
        _launch_mixes(_hc_mix_partial_kernel, (tiles, splits),
                      (x, fn, part, sq, T, ktot, k_per_split), x.device, plan,
                      plan.mix == "bf16x3" and x.dtype == torch.bfloat16,
                      NJ=rows, NJP=njp, BT=BT, BK=BK)
    return x, part, sq, splits, njp


def _check_norm_weight(name: str, norm_weight: torch.Tensor | None, D: int) -> None:
    if norm_weight is not None and tuple(norm_weight.shape) != (D,):
        raise ValueError(f"{name}: norm_weight must have shape ({D},); found "
                         f"{tuple(norm_weight.shape)}")


def _collapse(x: torch.Tensor, part: torch.Tensor, sq: torch.Tensor, splits: int, njp: int,
              scale: torch.Tensor, base: torch.Tensor, post: torch.Tensor | None,
              comb: torch.Tensor | None, norm_eps: float, hc_eps: float, iters: int,
              norm_weight: torch.Tensor | None, rms_eps: float | None,
              fuse_norm: bool | None) -> torch.Tensor:
    """Gates (+ Sinkhorn, post / comb into ``post`` / ``comb`` unless they are None: hc_head)
    and the collapse of x [T, n, D] from the mixes' split-K partials; then, with
    ``norm_weight``, ``rms_norm(y, norm_weight, rms_eps)`` (fused into the collapse for n = 4
    below :data:`HC_NORM_FUSED_T` tokens, or when ``fuse_norm`` says so)."""
    T, n, D = x.shape
    head = post is None
    y = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if not T:
        return y
    scale, base = scale.float().contiguous(), base.float().contiguous()
    if norm_weight is not None:
        rms_eps = norm_eps if rms_eps is None else rms_eps
        if fuse_norm is None:
            fuse_norm = T < HC_NORM_FUSED_T
    # Fused: one program per token holding the norm kernel's tile (the whole row, its warps).
    # Only where that is 4 warps (D <= 4096: V4-Flash), the warps of the unfused collapse: the
    # split-K sums then reduce in the same order both ways and the gates are the same bits.
    fused = (norm_weight is not None and fuse_norm and n == 4
             and triton_norm._tile(1, D, 0)["num_warps"] == 4)
    SP = triton.next_power_of_2(splits)
    if n == 4:
        BD = triton.next_power_of_2(D) if fused else min(1024, triton.next_power_of_2(D))
        w = norm_weight.float().contiguous() if fused else y
        # Inside a model step the Sinkhorn (comb) runs on the comb lane, next to the sublayer
        # that does not read it (dsv4.ops.streams.deferred_comb); same kernel, same bits.
        lane = not head and comb_lane_active(x.device)
        mix = torch.empty(T, 32, dtype=torch.float32, device=x.device) if lane else part
        args = (x, part, sq, scale, base, y, y if head else post, y if head else comb, w, mix,
                T, D, splits, float(norm_eps), float(hc_eps), float(rms_eps or 0.0))
        consts = dict(ITERS=int(iters), NJ=n if head else (2 + n) * n, NJP=njp, SP=SP, BD=BD,
                      HEAD=head, NORM=fused, enable_fp_fusion=False)
        _hc_collapse4_kernel[(T, triton.cdiv(D, BD))](*args, **consts, MODE=1 if lane else 0,
                                                      num_warps=4, **pdl_args(x))
        if lane:
            # One warp: it then fits on an SM next to a GEMV's full wave (four warps took a
            # wave slot and sent one of its programs into a second wave: no gain on the H200,
            # docs/PERFORMANCE.md ninth session).
            with comb_lane(x.device, keep=(mix, scale, base, comb)):
                _hc_collapse4_kernel[(T, 1)](*args, **consts, MODE=2, num_warps=1,
                                             **pdl_args(x))
    else:
        BD = min(1024, triton.next_power_of_2(D))
        _hc_collapse_kernel[(T, triton.cdiv(D, BD))](
            x, part, sq, scale, base, y, y if head else post, y if head else comb,
            T, D, splits, float(norm_eps), float(hc_eps), ITERS=int(iters), N=n, NJP=njp,
            SP=SP, BD=BD, HEAD=head, num_warps=4, **pdl_args(x))
    if norm_weight is not None and not fused:
        y = triton_norm.rms_norm(y, norm_weight, rms_eps)
    return y


def hc_pre_with_plan(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                     norm_eps: float, hc_eps: float, iters: int, plan: HcPlan | None = None,
                     norm_weight: torch.Tensor | None = None, rms_eps: float | None = None,
                     fuse_norm: bool | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`hc_pre` with an explicit mixes plan (``None``: :func:`pick_hc_plan`);
    ``fuse_norm`` forces (True) or forbids (False) the norm inside the collapse kernel
    (``None``: below :data:`HC_NORM_FUSED_T` tokens); same bits either way."""
    n = x.shape[1] if x.dim() == 3 else 0
    if iters < 1:
        raise ValueError(f"hc_pre: iters must be >= 1; found {iters}")
    x, part, sq, splits, njp = _hc_mix(x, fn, (2 + n) * n, "hc_pre", plan)
    T, n, D = x.shape
    _check_norm_weight("hc_pre", norm_weight, D)
    post = torch.empty(T, n, dtype=torch.float32, device=x.device)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=x.device)
    y = _collapse(x, part, sq, splits, njp, scale, base, post, comb, norm_eps, hc_eps, iters,
                  norm_weight, rms_eps, fuse_norm)
    return y, post, comb


@torch_twin_off_gpu("dsv4.ops.torch_dense")
def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           norm_eps: float, hc_eps: float, iters: int, norm_weight: torch.Tensor | None = None,
           rms_eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre-mix (spec §3.4): split-K mixes + RMS statistic, then gates, Sinkhorn, collapse.

    x [T, n, D]; fn [(2+n)·n, n·D]; scale [3]; base [(2+n)·n].  Returns y [T, D] (x.dtype),
    post [T, n] fp32, comb [T, n, n] fp32 (rows j = input stream, columns k = output stream).
    With ``norm_weight`` [D], y is the sublayer's normed input ``rms_norm(y, norm_weight,
    rms_eps)`` (``rms_eps`` None: norm_eps), the bits of the collapse then ``rms_norm``.
    """
    return hc_pre_with_plan(x, fn, scale, base, norm_eps, hc_eps, iters, None, norm_weight,
                            rms_eps)


def hc_head_with_plan(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                      norm_eps: float, hc_eps: float, plan: HcPlan | None = None,
                      norm_weight: torch.Tensor | None = None, rms_eps: float | None = None,
                      fuse_norm: bool | None = None) -> torch.Tensor:
    """:func:`hc_head` with an explicit mixes plan (``None``: :func:`pick_hc_plan`) and
    ``fuse_norm`` as :func:`hc_pre_with_plan`."""
    n = x.shape[1] if x.dim() == 3 else 0
    x, part, sq, splits, njp = _hc_mix(x, fn, n, "hc_head", plan)
    _check_norm_weight("hc_head", norm_weight, x.shape[2])
    return _collapse(x, part, sq, splits, njp, scale, base, None, None, norm_eps, hc_eps, 1,
                     norm_weight, rms_eps, fuse_norm)


@torch_twin_off_gpu("dsv4.ops.torch_dense")
def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            norm_eps: float, hc_eps: float, norm_weight: torch.Tensor | None = None,
            rms_eps: float | None = None) -> torch.Tensor:
    """Final collapse of the n streams (spec §3.10): ``Σ_j pre_j x_j``; x [T, n, D] → [T, D];
    with ``norm_weight`` [D], followed by the model's final ``rms_norm`` (as :func:`hc_pre`)."""
    return hc_head_with_plan(x, fn, scale, base, norm_eps, hc_eps, None, norm_weight, rms_eps)


@triton.jit
def _hc_post_kernel(out_ptr, xr_ptr, post_ptr, comb_ptr, y_ptr, D,
                    N: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = False):
    """new[k, :] = post[k]·out + Σ_j comb[j, k]·x_res[j, :] for one token and D block (fp32)."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    d_mask = rd < D
    rn = tl.arange(0, N)
    o = tl.load(out_ptr + t * D + rd, mask=d_mask, other=0.0).to(tl.float32)
    xr = tl.load(xr_ptr + t * N * D + rn[:, None] * D + rd[None, :], mask=d_mask[None, :],
                 other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * N + rn)
    comb = tl.load(comb_ptr + t * N * N + rn[:, None] * N + rn[None, :])  # [j, k]
    mixed = tl.sum(comb[:, :, None] * xr[:, None, :], axis=0)  # [k, BD]
    new = post[:, None] * o[None, :] + mixed
    store_rne(y_ptr + t * N * D + rn[:, None] * D + rd[None, :], new, d_mask[None, :])


def hc_post_with_plan(out: torch.Tensor, x_res: torch.Tensor, post: torch.Tensor,
                      comb: torch.Tensor, plan: HcPlan | None = None) -> torch.Tensor:
    """:func:`hc_post` with an explicit plan (``None``: :func:`pick_hc_plan`); one token per
    program (plan.BT must be 1), plan.BD columns of the n streams, plan.num_warps."""
    _check_post_args("hc_post", out, x_res, post, comb)
    join_comb_lane(x_res.device)            # comb may come from the comb lane
    T, n, D = x_res.shape
    plan = plan or pick_hc_plan("post", T, n, D, x_res.dtype)
    if plan.BT != 1:
        raise ValueError(f"hc_post: the kernel takes one token per program (plan BT 1); "
                         f"found BT {plan.BT}")
    y = torch.empty_like(x_res, memory_format=torch.contiguous_format)
    if T:
        _hc_post_kernel[(T, triton.cdiv(D, plan.BD))](
            out.contiguous(), x_res.contiguous(), post.float().contiguous(),
            comb.float().contiguous(), y, D, N=n, BD=plan.BD, num_warps=plan.num_warps,
            num_stages=plan.num_stages, **pdl_args(out))
    return y


@torch_twin_off_gpu("dsv4.ops.torch_dense")
def hc_post(out: torch.Tensor, x_res: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    """Expand a sublayer output back to n streams (spec §3.4), fp32 math, x_res.dtype out.

    ``new_k = post_k · out + Σ_j comb[j, k] · x_res_j``; out [T, D]; x_res [T, n, D];
    post [T, n]; comb [T, n, n].
    """
    return hc_post_with_plan(out, x_res, post, comb, None)


# ------------------------------------------------------------ mHC post fused with the next pre
@triton.jit
def _load_stream(xr_ptr, rt, j: tl.constexpr, N: tl.constexpr, D, rd, m2):
    """x_res stream j of the BT tokens, columns rd: [BT, BD] fp32."""
    return tl.load(xr_ptr + rt[:, None] * (N * D) + j * D + rd[None, :], mask=m2,
                   other=0.0).to(tl.float32)


@triton.jit
def _comb_col(comb_ptr, rt, t_mask, j: tl.constexpr, k, N: tl.constexpr):
    """comb[t, j, k] of the BT tokens: [BT, 1]."""
    return tl.load(comb_ptr + rt * (N * N) + j * N + k, mask=t_mask, other=0.0)[:, None]


@triton.jit
def _gates(post_ptr, comb_ptr, rt, t_mask, k: tl.constexpr, N: tl.constexpr):
    """post[t, k] and comb[t, j, k] for j = 0..3 of the BT tokens, each [BT] (fp32; the j past
    n_hc repeat j = 0 and are never used)."""
    p = tl.load(post_ptr + rt * N + k, mask=t_mask, other=0.0)
    c0 = tl.load(comb_ptr + rt * (N * N) + k, mask=t_mask, other=0.0)
    c1 = c0
    c2 = c0
    c3 = c0
    if N > 1:
        c1 = tl.load(comb_ptr + rt * (N * N) + N + k, mask=t_mask, other=0.0)
    if N > 2:
        c2 = tl.load(comb_ptr + rt * (N * N) + 2 * N + k, mask=t_mask, other=0.0)
        c3 = tl.load(comb_ptr + rt * (N * N) + 3 * N + k, mask=t_mask, other=0.0)
    return p, c0, c1, c2, c3


@triton.jit
def _post_stream(o, x0, x1, x2, x3, p, c0, c1, c2, c3, N: tl.constexpr):
    """Output stream k of hc_post: ``post_k·out`` then + comb[j, k]·x_j for j = 0..n-1, one
    explicit fused multiply-add each in this order: the same bits under every tile plan (left
    to the compiler, the contraction of ``a·b + c·d`` may take either product)."""
    new = p[:, None] * o
    new = tl.fma(c0[:, None], x0, new)
    if N > 1:
        new = tl.fma(c1[:, None], x1, new)
    if N > 2:
        new = tl.fma(c2[:, None], x2, new)
        new = tl.fma(c3[:, None], x3, new)
    return new


@triton.jit
def _hc_post_mix_kernel(out_ptr, xr_ptr, post_ptr, comb_ptr, fn_ptr, xnew_ptr, part_ptr, sq_ptr,
                        T, D, d_per_split, N: tl.constexpr, NJ: tl.constexpr,
                        NJP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                        PRECISION: tl.constexpr, BF16X3: tl.constexpr,
                        GATES_ONCE: tl.constexpr = False, PDL: tl.constexpr = False):
    """hc_post for BT tokens and one D range of all n (1, 2 or 4) streams, stored once, plus
    the next pre's split-K partials (Σ x_new² and x_new @ fn^T over that range) from the
    stored values.

    Partials go to ``part [splits, T, NJP]`` / ``sq [splits, T]`` exactly as
    ``_hc_mix_partial_kernel`` writes them, so ``_hc_collapse_kernel`` finishes the pre.
    Each output stream k is its own 2-D [BT, BD] tile (the n input streams are loaded once per
    chunk) and its own dot against fn's columns k·D + d: no 3-D tile to reshape into an MMA
    operand.  Every x_new element is ``post_k·out`` then + comb[j, k]·x_res_j for j = 0..n-1
    (one explicit fused multiply-add each), whatever the plan: the stored streams are the same
    bits under every tile plan.  BF16X3 (bf16 streams): the stored bf16 tile is the MMA
    operand, fn in three exact bf16 parts.
    """
    grid_dependency_sync(PDL)
    pid_t = tl.program_id(0)
    split = tl.program_id(1)
    rt = pid_t * BT + tl.arange(0, BT)
    t_mask = rt < T
    rj = tl.arange(0, NJP)
    j_mask = rj < NJ
    rb = tl.arange(0, BD)
    acc = tl.zeros((BT, NJP), dtype=tl.float32)
    sq = tl.zeros((BT,), dtype=tl.float32)
    d0 = split * d_per_split
    # GATES_ONCE: the gates are the same for every chunk, so load them once here (loads in the
    # loop are issued again each chunk, 20 of them for n = 4).  Stream k's are pK, cK0..cK3.
    if GATES_ONCE:
        p0, c00, c01, c02, c03 = _gates(post_ptr, comb_ptr, rt, t_mask, 0, N)
        p1, c10, c11, c12, c13 = p0, c00, c01, c02, c03
        p2, c20, c21, c22, c23 = p0, c00, c01, c02, c03
        p3, c30, c31, c32, c33 = p0, c00, c01, c02, c03
        if N > 1:
            p1, c10, c11, c12, c13 = _gates(post_ptr, comb_ptr, rt, t_mask, 1, N)
        if N > 2:
            p2, c20, c21, c22, c23 = _gates(post_ptr, comb_ptr, rt, t_mask, 2, N)
            p3, c30, c31, c32, c33 = _gates(post_ptr, comb_ptr, rt, t_mask, 3, N)
    for dd in range(0, d_per_split, BD):
        rd = d0 + dd + rb
        d_mask = (rd < D) & (dd + rb < d_per_split)
        m2 = t_mask[:, None] & d_mask[None, :]
        o = tl.load(out_ptr + rt[:, None] * D + rd[None, :], mask=m2, other=0.0).to(tl.float32)
        x0 = _load_stream(xr_ptr, rt, 0, N, D, rd, m2)
        x1 = x0     # (stand-ins past n_hc, never used)
        x2 = x0
        x3 = x0
        if N > 1:
            x1 = _load_stream(xr_ptr, rt, 1, N, D, rd, m2)
        if N > 2:
            x2 = _load_stream(xr_ptr, rt, 2, N, D, rd, m2)
            x3 = _load_stream(xr_ptr, rt, 3, N, D, rd, m2)
        for k in tl.static_range(N):
            if not GATES_ONCE:
                # (_post_stream's chain, its loads beside their uses: as one helper call with
                # the five loads first, the 8K plan needs 171 registers, past 3 blocks an SM.)
                new = tl.load(post_ptr + rt * N + k, mask=t_mask, other=0.0)[:, None] * o
                new = tl.fma(_comb_col(comb_ptr, rt, t_mask, 0, k, N), x0, new)
                if N > 1:
                    new = tl.fma(_comb_col(comb_ptr, rt, t_mask, 1, k, N), x1, new)
                if N > 2:
                    new = tl.fma(_comb_col(comb_ptr, rt, t_mask, 2, k, N), x2, new)
                    new = tl.fma(_comb_col(comb_ptr, rt, t_mask, 3, k, N), x3, new)
            elif k == 0:
                new = _post_stream(o, x0, x1, x2, x3, p0, c00, c01, c02, c03, N)
            elif k == 1:
                new = _post_stream(o, x0, x1, x2, x3, p1, c10, c11, c12, c13, N)
            elif k == 2:
                new = _post_stream(o, x0, x1, x2, x3, p2, c20, c21, c22, c23, N)
            else:
                new = _post_stream(o, x0, x1, x2, x3, p3, c30, c31, c32, c33, N)
            # The next pre reads the streams as stored: round first (RNE, as store_rne does),
            # so its statistics see the same values hc_pre(x_new) would.
            if xnew_ptr.dtype.element_ty == tl.bfloat16:
                new = round_to_bf16(new)
            stored = new.to(xnew_ptr.dtype.element_ty)
            new = stored.to(tl.float32)
            tl.store(xnew_ptr + rt[:, None] * (N * D) + k * D + rd[None, :], stored, mask=m2)
            sq += tl.sum(new * new, axis=1)
            fv = tl.load(fn_ptr + rj[None, :] * (N * D) + (k * D + rd)[:, None],
                         mask=d_mask[:, None] & j_mask[None, :], other=0.0)
            if BF16X3:
                acc = _dot_bf16x3(acc, stored, fv)
            else:
                acc += tl.dot(new, fv, input_precision=PRECISION)
    base = split * T
    tl.store(part_ptr + (base + rt[:, None]) * NJP + rj[None, :], acc,
             mask=t_mask[:, None] & j_mask[None, :])
    tl.store(sq_ptr + base + rt, sq, mask=t_mask)


def _check_post_args(name: str, out: torch.Tensor, x_res: torch.Tensor, post: torch.Tensor,
                     comb: torch.Tensor) -> None:
    if x_res.dim() != 3 or out.shape != (x_res.shape[0], x_res.shape[2]):
        raise ValueError(f"{name}: out must be [T, D] and x_res [T, n, D]; found "
                         f"{tuple(out.shape)} and {tuple(x_res.shape)}")
    T, n, _ = x_res.shape
    if tuple(post.shape) != (T, n) or tuple(comb.shape) != (T, n, n):
        raise ValueError(f"{name}: post must be [{T}, {n}] and comb [{T}, {n}, {n}]; found "
                         f"{tuple(post.shape)} and {tuple(comb.shape)}")
    if n < 1 or n & (n - 1):
        raise ValueError(f"{name}: n_hc must be a power of two for the Triton kernel; found {n}")


def hc_post_pre_with_plan(out: torch.Tensor, x_res: torch.Tensor, post: torch.Tensor,
                          comb: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
                          base: torch.Tensor, norm_eps: float, hc_eps: float, iters: int,
                          plan: HcPlan | None = None, norm_weight: torch.Tensor | None = None,
                          rms_eps: float | None = None, fuse_norm: bool | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`hc_post_pre` with an explicit plan of the post + mixes kernel (``None``:
    :func:`pick_hc_plan`) and ``fuse_norm`` as :func:`hc_pre_with_plan`.  x_new is the same
    bits under every plan; the mixes (and through the gates, y) agree to fp32 rounding (other
    split / dot orders)."""
    _check_post_args("hc_post_pre", out, x_res, post, comb)
    if iters < 1:
        raise ValueError(f"hc_post_pre: iters must be >= 1; found {iters}")
    T, n, D = x_res.shape
    rows = (2 + n) * n
    if tuple(fn.shape) != (rows, n * D):
        raise ValueError(f"hc_post_pre: fn must be [{rows}, {n * D}] for x_res "
                         f"{tuple(x_res.shape)}; found {tuple(fn.shape)}")
    _check_norm_weight("hc_post_pre", norm_weight, D)
    if n > 4:
        # The fused kernel holds n_hc <= 4 input streams (every V4 model has 4): compose.
        x_new = hc_post_with_plan(out, x_res, post, comb, None)
        return (x_new, *hc_pre_with_plan(x_new, fn, scale, base, norm_eps, hc_eps, iters, plan,
                                         norm_weight, rms_eps, fuse_norm))
    plan = plan or pick_hc_plan("post_pre", T, n, D, x_res.dtype)
    _check_plan("hc_post_pre", plan, n, dot=True)
    dev = x_res.device
    join_comb_lane(dev)                     # comb may come from the comb lane
    x_new = torch.empty(T, n, D, dtype=x_res.dtype, device=dev)
    post_n = torch.empty(T, n, dtype=torch.float32, device=dev)
    comb_n = torch.empty(T, n, n, dtype=torch.float32, device=dev)
    if not T:
        return x_new, torch.empty(T, D, dtype=x_res.dtype, device=dev), post_n, comb_n
    njp = max(16, triton.next_power_of_2(rows))
    tiles = triton.cdiv(T, plan.BT)
    d_per_split, splits = _splits(D, plan.BD, tiles, plan, dev)
    part = torch.empty(splits, T, njp, dtype=torch.float32, device=dev)
    sq = torch.empty(splits, T, dtype=torch.float32, device=dev)
    args = (out.contiguous(), x_res.contiguous(), post.float().contiguous(),
            comb.float().contiguous(), fn.float().contiguous(), x_new, part, sq, T, D,
            d_per_split)
    _launch_mixes(_hc_post_mix_kernel, (tiles, splits), args, dev, plan,
                  plan.mix == "bf16x3" and x_res.dtype == torch.bfloat16,
                  N=n, NJ=rows, NJP=njp, BT=plan.BT, BD=plan.BD, GATES_ONCE=plan.gates_once)
    y = _collapse(x_new, part, sq, splits, njp, scale, base, post_n, comb_n, norm_eps, hc_eps,
                  iters, norm_weight, rms_eps, fuse_norm)
    return x_new, y, post_n, comb_n


@torch_twin_off_gpu("dsv4.ops.torch_dense")
def hc_post_pre(out: torch.Tensor, x_res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
                hc_eps: float, iters: int, norm_weight: torch.Tensor | None = None,
                rms_eps: float | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hc_post`` of one sublayer fused with the ``hc_pre`` of the next (spec §3.4, §3.5).

    out [T, D]; x_res [T, n, D]; post [T, n]; comb [T, n, n] (this sublayer's);
    fn [(2+n)·n, n·D], scale [3], base [(2+n)·n] (the next sublayer's); norm_weight [D] /
    rms_eps (optional: the next sublayer's input norm, as :func:`hc_pre`).  Returns
    ``(x_new [T, n, D] x_res.dtype, y [T, D], post' [T, n] fp32, comb' [T, n, n] fp32)`` =
    ``(x_new, *hc_pre(x_new, ...))`` with ``x_new = hc_post(out, x_res, post, comb)``.

    Two launches instead of three (four with the norm): one kernel writes x_new and the next
    pre's split-K partials (RMS statistic and 24-wide projection), then the collapse kernel of
    hc_pre finishes (with the norm, at decode).
    """
    return hc_post_pre_with_plan(out, x_res, post, comb, fn, scale, base, norm_eps, hc_eps,
                                 iters, None, norm_weight, rms_eps)
