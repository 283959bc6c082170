"""Triton kernels of the attention-side hot ops: gather-based sparse attention with a per-head
sink (spec §3.6 item 5) and the Lightning-indexer scores (spec §3.8).

Same signatures as the torch twins in ``dsv4/ops/torch_attn.py``.  Ops without a kernel here
(rms_norm, apply_rope) fall back to the twins through ``dsv4.ops.get_ops``; ``topk_indices``
has its kernel in ``dsv4/ops/triton_topk.py``.

A KV source (``kv_a`` / ``kv_b``) or the key pool may be a :class:`dsv4.cache.formats.
PackedRows` (kv_cache_dtype "fp8"): the kernels then read the uint8 records in place and
dequantize the gathered rows in registers (:func:`load_rows`): V4's 584-byte record (e4m3 nope
+ ue8m0 per 64 + bf16 RoPE tail), V4.1's e4m3 window (ue8m0 per 32), its e2m1 compressed
entries (e4m3 scale per 16) and the e2m1 index keys (ue8m0 per 32).  The dequantized values
are exact in the query's dtype, so a record source gives what a bf16 / fp32 pool holding the
fake-quantized rows gives.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4.cache.formats import PackedRows, RecordFormat
from dsv4.ops import triton_norm
from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.specialize import lengths
from dsv4.ops.torch_norm import check_rope_args
from dsv4.ops.triton_dense import (INTERPRET, mma, round_as, round_to_bf16, sm_count, store_rne,
                                   torch_twin_off_gpu)

__all__ = ["sparse_attn", "sparse_attn_with_config", "indexer_scores", "AttnConfig",
           "pick_attn_config", "load_rows", "load_fp8_records_chunked", "chunked_records_ok",
           "record_meta"]

_LOG2E = 1.4426950408889634
# Decode split-KV: at least this many index rows a slice (0: no floor).  With a floor of 128 a
# V4-Flash window-only or HCA layer's decode (128 / 192 rows) runs unsplit, without the merge
# launch.  Not measured yet (bench/flash_bench.py --launch-ab, "pdl, unsplit short
# attention"): 0, the swept default; DSV4_ATTN_SPLIT_MIN_ROWS overrides it.
ATTN_SPLIT_MIN_ROWS = int(os.environ.get("DSV4_ATTN_SPLIT_MIN_ROWS", "0"))
# Prefill over fp8 records: the 64-head plan of pick_attn_config from this many tokens (H100,
# V4-Flash CSA shapes, twenty-third session: 124.9 against the 16-head plan's 228.4 µs at 128
# tokens, 234.8 / 450.0 at 256, 459.2 / 870.5 at 512; 1,024 before).
RECORD_WIDE_MIN_T = int(os.environ.get("DSV4_ATTN_RECORD_WIDE_MIN_T", "128"))
# Prefill over bf16 rows (bf16 queries): the 64-head, 64-row, two-stage plan from this many
# tokens (a prefill's dense copy of the cache rows, attention.dense_prefill_pays).  H100,
# V4-Flash CSA shapes (docs/PERFORMANCE.md, twenty-second session): faster than the 16-head
# plan from 128 tokens on (65 against 90 µs at 128, 233 against 362 at 512).
DENSE_WIDE_MIN_T = int(os.environ.get("DSV4_ATTN_DENSE_WIDE_MIN_T", "128"))
# That plan walks its two sources in one loop (AttnConfig.one_loop, _attn_two_sources; the
# same bits; no spills where two loops spill 152 bytes): on since its H100 GPU tests and sweep
# (twenty-third session: 220 against 234 µs at 512 tokens, 1,733 against 1,787 at 4,096).
# DSV4_ATTN_ONE_LOOP=0 restores the two loops.
ATTN_ONE_LOOP = os.environ.get("DSV4_ATTN_ONE_LOOP", "1") == "1"
# sparse_attn(rope_out=...): the output's inverse RoPE in the split-KV merge kernel (decode
# steps of few tokens: one launch less on the layer's chain), where the rotated tail lies in
# one of the merge's column blocks; otherwise (unsplit steps) the separate apply_rope launch,
# in place on the output.
# Same bits either way.  H100, 4 layers, interleaved graph replays (docs/PERFORMANCE.md,
# twenty-seventh session): B=1 1,087.6 against 1,085.4 µs, B=2 1,233.9 against 1,241.2 — within
# noise; on for the launch it saves.  DSV4_ATTN_ROPE_IN_COMBINE=0 keeps the separate launch.
ROPE_IN_COMBINE = int(os.environ.get("DSV4_ATTN_ROPE_IN_COMBINE", "1"))

# Source layouts of load_rows (FMT): rows of a float tensor, or records of dsv4.cache.formats.
FMT_DENSE, FMT_FP8_E8M0, FMT_FP4_E4M3, FMT_FP4_E8M0 = 0, 1, 2, 3
# (FMT, NQ, QB, SC_OFF, TAIL_OFF) of a dense source (TAIL_OFF −1: no bf16 tail).
_DENSE_META = (FMT_DENSE, 0, 1, 0, -1)


def record_meta(fmt: RecordFormat) -> tuple[int, int, int, int, int]:
    """The constexprs ``(FMT, NQ, QB, SC_OFF, TAIL_OFF)`` with which :func:`load_rows` reads
    ``fmt`` records: layout kind, quantized channels, channels per scale, byte offset of the
    scales, byte offset of the bf16 tail (−1: none)."""
    if fmt.quant == "fp8":
        if fmt.scale != "e8m0":
            raise ValueError(f"record_meta: {fmt.name}: fp8 records need e8m0 scales")
        kind = FMT_FP8_E8M0
    else:
        kind = FMT_FP4_E4M3 if fmt.scale == "e4m3" else FMT_FP4_E8M0
    return kind, fmt.quant_dims, fmt.block, fmt.scale_offset, \
        (fmt.tail_offset if fmt.tail_dims else -1)


@triton.jit
def _e2m1_to_f32(code):
    """int32 e2m1 codes (sign in bit 3) -> fp32: 0, 0.5 (subnormal) or 2^(e−1)·(1 + m/2)."""
    mag = code & 7
    e = mag >> 1
    m = mag & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def load_rows(ptr, rows, cols, mask, stride, FMT: tl.constexpr, NQ: tl.constexpr,
              QB: tl.constexpr, SC_OFF: tl.constexpr, TAIL_OFF: tl.constexpr):
    """Tile [BN, BC]: channels ``cols`` of the rows ``rows`` (int64 [BN]) of a flat source.

    FMT_DENSE: ``ptr`` is the row tensor (stride in elements), the tile keeps its dtype.
    Records (``ptr`` uint8, stride = record bytes): channels < NQ are e4m3 bytes (FMT_FP8_E8M0)
    or e2m1 nibbles, low nibble first (FMT_FP4_*), times the scale byte ``SC_OFF + c // QB``
    (e8m0, or e4m3 for FMT_FP4_E4M3); channels >= NQ are bf16 at byte ``TAIL_OFF``.  fp32 out.
    """
    base = ptr + rows[:, None] * stride
    # One return only: the compiler rejects returns of different dtypes even across a
    # constexpr branch (the interpreter does not check this).
    if FMT == 0:
        val = tl.load(base + cols[None, :], mask=mask, other=0.0)
    else:
        c = cols[None, :]
        in_q = c < NQ
        qmask = mask & in_q
        sb = tl.load(base + SC_OFF + c // QB, mask=qmask, other=0)
        if FMT == 1:
            val = tl.load(base + c, mask=qmask, other=0).to(tl.float8e4nv, bitcast=True)
            val = val.to(tl.float32)
        else:
            byte = tl.load(base + c // 2, mask=qmask, other=0).to(tl.int32)
            val = _e2m1_to_f32((byte >> ((c & 1) * 4)) & 15)
        if FMT == 2:
            scale = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            scale = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # e8m0: 2^(b − 127)
        val = val * scale
        if TAIL_OFF >= 0:
            tail_ptr = ptr.to(tl.pointer_type(tl.bfloat16))
            tail = tl.load(tail_ptr + rows[:, None] * (stride // 2) + TAIL_OFF // 2 + (c - NQ),
                           mask=mask & (c >= NQ), other=0.0)
            val = tl.where(in_q, val, tail.to(tl.float32))
    return val


@triton.jit
def load_fp8_records_chunked(ptr, rows, valid, stride, NQ: tl.constexpr, QB: tl.constexpr,
                             SC_OFF: tl.constexpr, TAIL_OFF: tl.constexpr, BN: tl.constexpr,
                             BD: tl.constexpr):
    """fp32 tile [BN, BD] of whole fp8/e8m0 records (V4's 584-byte layout), as ``load_rows``
    gives it, read chunk-wise: the row is BD // QB chunks of QB channels, chunk c < NQ // QB
    holds e4m3 bytes with one scale byte, the last one (when NQ < BD) is the bf16 tail.

    ``load_rows`` reads each channel's scale byte and code separately (a byte gather per
    element); here the codes come as contiguous 8-byte vectors (``stride`` % 8 == 0, checked by
    the caller), one scale per chunk, and the tail as bf16 vectors: ~8x fewer load
    instructions, which is what bounds the decode attention over records.
    """
    NCH: tl.constexpr = BD // QB
    NQC: tl.constexpr = NQ // QB
    rc = tl.arange(0, NCH)
    rq = tl.arange(0, QB)
    row_off = tl.multiple_of(rows * stride, 8)
    in_q = rc < NQC
    col = rc[None, :, None] * QB + rq[None, None, :]           # [1, NCH, QB]
    code = tl.load(ptr + row_off[:, None, None] + col,
                   mask=valid[:, None, None] & in_q[None, :, None], other=0)
    sb = tl.load(ptr + row_off[:, None] + SC_OFF + rc[None, :],
                 mask=valid[:, None] & in_q[None, :], other=0)  # [BN, NCH]
    scale = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # e8m0: 2^(b − 127)
    val = code.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
    if NQ < BD:  # the bf16 tail: exactly the last chunk
        tail_ptr = ptr.to(tl.pointer_type(tl.bfloat16))
        tail_off = tl.multiple_of(rows * (stride // 2), 4) + TAIL_OFF // 2
        tail = tl.load(tail_ptr + tail_off[:, None] + rq[None, :], mask=valid[:, None],
                       other=0.0)                               # [BN, QB]
        val = tl.where(in_q[None, :, None], val, tail.to(tl.float32)[:, None, :])
    return tl.reshape(val, (BN, BD))


def chunked_records_ok(meta: tuple[int, int, int, int, int], d: int, stride: int) -> bool:
    """Whether :func:`load_fp8_records_chunked` can read records of layout ``meta`` holding
    ``d`` channels (power of two) with row ``stride`` bytes."""
    fmt, nq, qb, _, tail_off = meta
    return (fmt == FMT_FP8_E8M0 and d & (d - 1) == 0 and qb & (qb - 1) == 0 and d % qb == 0
            and nq % qb == 0 and (nq == d or (nq == d - qb and tail_off >= 0))
            and stride % 8 == 0)


# ------------------------------------------------------------------------------ sparse attention
@triton.jit
def _attn_source(q, m_i, l_i, acc, kv_ptr, stride_kv, idx_ptr, n_idx, rd, d_mask, rdv, dv_mask,
                 qk_scale, BN: tl.constexpr, SPLIT_DV: tl.constexpr, P_BF16: tl.constexpr,
                 DOT_PREC: tl.constexpr, FMT: tl.constexpr, NQ: tl.constexpr,
                 QB: tl.constexpr, SC_OFF: tl.constexpr, TAIL_OFF: tl.constexpr,
                 CHUNKED: tl.constexpr = False, BD: tl.constexpr = 0):
    """Fold ``n_idx`` indices of one source into the online-softmax state (log2 domain).

    SPLIT_DV: this program accumulates only the value columns ``rdv`` (a slice of the head dim);
    the logits still use the whole row, and the slice is re-read (an L1/L2 hit).
    FMT != 0: the source is records (:func:`load_rows`), dequantized into q's dtype (exact).
    CHUNKED (fp8 records, whole rows, no SPLIT_DV): read by :func:`load_fp8_records_chunked`,
    same values.
    """
    for start in range(0, n_idx, BN):
        rj = start + tl.arange(0, BN)
        rows = tl.load(idx_ptr + rj, mask=rj < n_idx, other=-1)
        valid = rows >= 0
        row64 = rows.to(tl.int64)
        if CHUNKED:
            kv = load_fp8_records_chunked(kv_ptr, row64, valid, stride_kv, NQ, QB, SC_OFF,
                                          TAIL_OFF, BN, BD)
        else:
            kv = load_rows(kv_ptr, row64, rd, valid[:, None] & d_mask[None, :], stride_kv,
                           FMT, NQ, QB, SC_OFF, TAIL_OFF)  # [BN, BD]
        if FMT != 0:
            kv = kv.to(q.dtype)
        if q.dtype == kv.dtype:
            s = mma(q, tl.trans(kv), DOT_PREC)
        else:
            s = mma(q.to(tl.float32), tl.trans(kv.to(tl.float32)), DOT_PREC)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # [BH, BN]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if SPLIT_DV:
            v = load_rows(kv_ptr, row64, rdv, valid[:, None] & dv_mask[None, :], stride_kv,
                          FMT, NQ, QB, SC_OFF, TAIL_OFF)  # [BN, BDV]
            if FMT != 0:
                v = v.to(q.dtype)
        else:
            v = kv
        if v.dtype == tl.bfloat16:
            # bf16 rows: P rounded to bf16 for the tensor-core P·V (fp32 accumulation), which
            # is also what the reference kernel does.
            pv = mma(round_to_bf16(p).to(tl.bfloat16), v, DOT_PREC)
        else:
            if P_BF16:
                p = round_to_bf16(p)
            pv = mma(p, v.to(tl.float32), DOT_PREC)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _attn_two_sources(q, m_i, l_i, acc, kva_ptr, stride_a, idxa_ptr, n_a, kvb_ptr, stride_b,
                      idxb_ptr, n_b, rd, d_mask, qk_scale, BN: tl.constexpr,
                      DOT_PREC: tl.constexpr):
    """Both dense sources in ONE loop (:attr:`AttnConfig.one_loop`): the steps of source a
    (its list padded to whole BN steps), then those of source b, each picking its source's
    row pointer, stride and index list by a scalar select.  The same steps, rows, masks and
    arithmetic in the same order as two :func:`_attn_source` loops (the same bits), but one
    loop body for the compiler to pipeline: the first rows of b are in flight during a's last
    step, and the loop's state is not kept twice (ptxas, sm_90, the 64-head plan over two
    sources: 152 bytes of spill with two loops)."""
    na = tl.cdiv(n_a, BN) * BN
    for start in range(0, na + n_b, BN):
        in_a = start < na
        off = tl.where(in_a, start, start - na)
        n = tl.where(in_a, n_a, n_b)
        rj = off + tl.arange(0, BN)
        rows = tl.load(tl.where(in_a, idxa_ptr, idxb_ptr) + rj, mask=rj < n, other=-1)
        valid = rows >= 0
        stride = tl.where(in_a, stride_a, stride_b)
        kv = tl.load(tl.where(in_a, kva_ptr, kvb_ptr) + rows.to(tl.int64)[:, None] * stride
                     + rd[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0)
        s = mma(q, tl.trans(kv), DOT_PREC)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # [BH, BN]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # bf16 rows: P rounded to bf16 for the tensor-core P·V, as _attn_source does.
        pv = mma(round_to_bf16(p).to(tl.bfloat16), kv, DOT_PREC)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(**lengths("T", "Ka", "Kb", "chunk_a", "chunk_b", "stride_ia", "stride_ib"))
def _sparse_attn_kernel(q_ptr, kva_ptr, idxa_ptr, kvb_ptr, idxb_ptr, sink_ptr, o_ptr, ml_ptr,
                        T, H, D, Ka, Kb, chunk_a, chunk_b, stride_qt, stride_qh, stride_kva,
                        stride_kvb, stride_ia, stride_ib, stride_ot, stride_oh, qk_scale,
                        HAS_B: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr,
                        BDV: tl.constexpr, N_DV: tl.constexpr, BN: tl.constexpr,
                        SPLIT_KV: tl.constexpr, P_BF16: tl.constexpr, DOT_PREC: tl.constexpr,
                        FMT_A: tl.constexpr, NQ_A: tl.constexpr, QB_A: tl.constexpr,
                        SCO_A: tl.constexpr, TLO_A: tl.constexpr,
                        FMT_B: tl.constexpr, NQ_B: tl.constexpr, QB_B: tl.constexpr,
                        SCO_B: tl.constexpr, TLO_B: tl.constexpr,
                        CHUNK_A: tl.constexpr = False, CHUNK_B: tl.constexpr = False,
                        ONE_LOOP: tl.constexpr = False, PDL: tl.constexpr = False):
    """One token × BH heads × BDV value columns × one slice of the index lists.

    ``*_A`` / ``*_B``: each source's layout for :func:`load_rows` (dense rows or records);
    ``CHUNK_*``: that source's fp8 records are read by :func:`load_fp8_records_chunked`.
    ``ONE_LOOP`` (two bf16 row sources, one slice, whole head dim): :func:`_attn_two_sources`.

    Not SPLIT_KV: the sink starts the running max (m = sink, l = 1 = exp(sink - m), acc = 0),
    so it enters the denominator only, and o = acc / l is stored in o's dtype.
    SPLIT_KV (decode, few tokens): grid axis 2 is the slice; this program takes slice s of
    each index list, starts from the empty state and stores the unnormalized fp32 acc into
    o_ptr (laid out [S, T, H, D]) and (m, l) into ml_ptr ([S, T, H, 2]); a combine kernel adds
    the sink and normalizes.
    """
    grid_dependency_sync(PDL)
    t = tl.program_id(0)
    hb = tl.program_id(1) // N_DV
    dv = tl.program_id(1) % N_DV
    sp = tl.program_id(2)
    rh = hb * BH + tl.arange(0, BH)
    rd = tl.arange(0, BD)
    rdv = dv * BDV + tl.arange(0, BDV)
    h_mask = rh < H
    d_mask = rd < D
    dv_mask = rdv < D
    t64 = t.to(tl.int64)
    q = tl.load(q_ptr + t64 * stride_qt + rh[:, None] * stride_qh + rd[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if SPLIT_KV:
        m_i = tl.full((BH,), -1.0e30, tl.float32)
        l_i = tl.zeros((BH,), tl.float32)
    else:
        sink = tl.load(sink_ptr + rh, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        # A −inf sink (a padded head) must not make the first rescale NaN: a finite start.
        m_i = tl.maximum(sink, -1.0e30)
        l_i = tl.exp2(sink - m_i)
    acc = tl.zeros((BH, BDV), dtype=tl.float32)
    a0 = sp * chunk_a
    if ONE_LOOP:
        m_i, l_i, acc = _attn_two_sources(q, m_i, l_i, acc, kva_ptr, stride_kva,
                                          idxa_ptr + t64 * stride_ia, Ka, kvb_ptr, stride_kvb,
                                          idxb_ptr + t64 * stride_ib, Kb, rd, d_mask,
                                          qk_scale, BN, DOT_PREC)
    else:
        m_i, l_i, acc = _attn_source(q, m_i, l_i, acc, kva_ptr, stride_kva,
                                     idxa_ptr + t64 * stride_ia + a0,
                                     tl.minimum(chunk_a, Ka - a0), rd, d_mask, rdv, dv_mask,
                                     qk_scale, BN, N_DV > 1, P_BF16, DOT_PREC, FMT_A, NQ_A,
                                     QB_A, SCO_A, TLO_A, CHUNK_A, BD)
        if HAS_B:
            b0 = sp * chunk_b
            m_i, l_i, acc = _attn_source(q, m_i, l_i, acc, kvb_ptr, stride_kvb,
                                         idxb_ptr + t64 * stride_ib + b0,
                                         tl.minimum(chunk_b, Kb - b0), rd, d_mask, rdv,
                                         dv_mask, qk_scale, BN, N_DV > 1, P_BF16, DOT_PREC,
                                         FMT_B, NQ_B, QB_B, SCO_B, TLO_B, CHUNK_B, BD)
    hd_mask = h_mask[:, None] & dv_mask[None, :]
    if SPLIT_KV:
        base = (sp * T + t64) * H
        tl.store(o_ptr + (base + rh[:, None]) * D + rdv[None, :], acc, mask=hd_mask)
        if dv == 0:
            tl.store(ml_ptr + (base + rh) * 2, m_i, mask=h_mask)
            tl.store(ml_ptr + (base + rh) * 2 + 1, l_i, mask=h_mask)
    else:
        o = acc / l_i[:, None]
        store_rne(o_ptr + t64 * stride_ot + rh[:, None] * stride_oh + rdv[None, :], o, hd_mask)


@triton.jit
def _rn_mul(a, b):
    """a · b rounded once, never contracted into an FMA with a neighbouring add: the
    explicit-rounding PTX multiply, which the compilers leave alone (the interpreter does not
    contract)."""
    if INTERPRET:
        return a * b
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _inverse_rope_tail(o, col0, cos_row, sin_row, nope, half, BH: tl.constexpr,
                       BD: tl.constexpr):
    """o [BH, BD] (columns col0.. of each head, values already rounded as stored) with the
    channels from ``nope`` on rotated back by pairs (2i, 2i+1) = a + ib times cos − i·sin of
    the token (its rows of cos / sin), as ``apply_rope(o, cos, sin, inverse=True)`` computes
    them; other channels unchanged."""
    a, b = tl.split(tl.reshape(o, (BH, BD // 2, 2)))
    ch = col0 + 2 * tl.arange(0, BD // 2)                  # the even channel of each pair
    pair = (ch - nope) // 2
    tail = (ch >= nope) & (pair < half)
    c = tl.load(cos_row + pair, mask=tail, other=1.0)[None, :]
    s = -tl.load(sin_row + pair, mask=tail, other=0.0)[None, :]
    ra = _rn_mul(a, c) - _rn_mul(b, s)
    rb = _rn_mul(a, s) + _rn_mul(b, c)
    ra = tl.where(tail[None, :], ra, a)
    rb = tl.where(tail[None, :], rb, b)
    return tl.reshape(tl.join(ra, rb), (BH, BD))


@triton.jit
def _attn_combine_kernel(part_ptr, ml_ptr, sink_ptr, o_ptr, S, T, H, D, stride_ot, stride_oh,
                         cos_ptr=None, sin_ptr=None, stride_c=0, nope=0, half=0,
                         SP: tl.constexpr = 2, BH: tl.constexpr = 16, BD: tl.constexpr = 128,
                         ROPE: tl.constexpr = False, PDL: tl.constexpr = False):
    """Merge the S slices of a split-KV attention with the sink: o = Σ_s w_s acc_s / l.

    ROPE: o's channels from ``nope`` on (within this program's column block) are then rotated
    back by the token's rows of ``cos`` / ``sin`` [T, half], from o rounded as stored."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0)
    rh = tl.program_id(1) * BH + tl.arange(0, BH)
    rd = tl.program_id(2) * BD + tl.arange(0, BD)
    h_mask = rh < H
    d_mask = rd < D
    t64 = t.to(tl.int64)
    rs = tl.arange(0, SP)
    sh_mask = (rs[:, None] < S) & h_mask[None, :]
    ml_off = ((rs[:, None] * T + t64) * H + rh[None, :]) * 2
    m_s = tl.load(ml_ptr + ml_off, mask=sh_mask, other=-1.0e30)  # [SP, BH]
    l_s = tl.load(ml_ptr + ml_off + 1, mask=sh_mask, other=0.0)
    sink = tl.load(sink_ptr + rh, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    m = tl.maximum(tl.maximum(sink, -1.0e30), tl.max(m_s, axis=0))  # [BH]
    l_tot = tl.exp2(sink - m) + tl.sum(tl.exp2(m_s - m[None, :]) * l_s, axis=0)
    acc = tl.zeros((BH, BD), tl.float32)
    for s in range(S):
        w = tl.exp2(tl.load(ml_ptr + ((s * T + t64) * H + rh) * 2, mask=h_mask, other=-1.0e30)
                    - m)
        a = tl.load(part_ptr + ((s * T + t64) * H + rh[:, None]) * D + rd[None, :],
                    mask=h_mask[:, None] & d_mask[None, :], other=0.0)
        acc += w[:, None] * a
    o = acc / l_tot[:, None]
    if ROPE:
        o = _inverse_rope_tail(round_as(o, o_ptr), tl.program_id(2) * BD,
                               cos_ptr + t64 * stride_c, sin_ptr + t64 * stride_c, nope, half,
                               BH, BD)
    store_rne(o_ptr + t64 * stride_ot + rh[:, None] * stride_oh + rd[None, :], o,
              h_mask[:, None] & d_mask[None, :])


@dataclass(frozen=True)
class AttnConfig:
    """Tile plan of the sparse-attention kernel.

    BH heads per program, BN gathered rows per step, ``split_kv`` slices of the index lists
    run by separate programs then merged (decode: few tokens would leave most SMs idle),
    ``dv`` value columns per program (0: the whole head dim; else the head dim is split and
    each program recomputes the logits, which lets BH grow without spilling registers);
    ``chunked``: read fp8 records by chunks (:func:`load_fp8_records_chunked`) where they allow
    it (whole rows, ``dv`` 0), else element by element (:func:`load_rows`); ``one_loop``: two
    bf16 row sources in one loop (:func:`_attn_two_sources`; unsplit, whole head dim, else
    ignored).
    """

    BH: int = 16
    BN: int = 64
    num_warps: int = 4
    num_stages: int = 2
    split_kv: int = 1
    dv: int = 0
    chunked: bool = True
    one_loop: bool = False


def pick_attn_config(T: int, H: int, D: int, K: int, device: torch.device,
                     records: bool = False, bf16: bool = False) -> AttnConfig:
    """Default plan (tuned on the H200, docs/PERFORMANCE.md); K = indices per token, both lists.

    16 heads × the whole head dim per program, 64 rows per step.  With fewer programs than SMs
    (decode), the index lists are split into a power-of-two number of slices (<= 8) so that
    about two programs per SM run; the merge costs an fp32 partial per slice, so no more.
    ``records`` (a source is fp8 records, dequantized in registers): 8 warps, which keeps the
    dequantized [64, 512] tile out of local memory (ptxas: 4 warps spill); from
    :data:`RECORD_WIDE_MIN_T` tokens all 64 heads in one program over 32-row steps, one stage
    (each row is gathered and dequantized once a token, not once per 16 heads): H200, V4-Flash
    CSA shapes at 4,096 tokens, 3.61 against 7.33 ms (docs/PERFORMANCE.md, twentieth session),
    and 1.8-1.9× at 128-512 tokens on an H100 (twenty-third).
    ``bf16`` (bf16 queries and bf16 rows, no records): from :data:`DENSE_WIDE_MIN_T` tokens all
    64 heads over 64-row steps, two stages (the rows' loads of the next step in flight; its
    shared memory, 2 × 64 KB of rows + 64 KB of queries, fits only in bf16): V4-Flash CSA
    shapes at 4,096 tokens 1.76 against 2.84 ms (twenty-first session), and already at 128
    tokens on an H100 (twenty-second); with 64 heads or more (a tensor-parallel shard of fewer
    would pad the MMA rows; not measured).
    """
    bh, bn = 16, 64
    programs = T * triton.cdiv(H, bh)
    sms = sm_count(device)
    split = 1
    if programs < sms:
        want = max(1, (2 * sms) // programs)
        split = min(8, 1 << (want.bit_length() - 1), max(1, triton.cdiv(K, bn)))
        if ATTN_SPLIT_MIN_ROWS > 0:
            split = max(1, min(split, K // ATTN_SPLIT_MIN_ROWS))
    if records and T >= RECORD_WIDE_MIN_T:
        return AttnConfig(BH=64, BN=32, num_warps=8, num_stages=1)
    if bf16 and not records and T >= DENSE_WIDE_MIN_T and H >= 64:
        return AttnConfig(BH=64, BN=64, num_warps=8, num_stages=2, one_loop=ATTN_ONE_LOOP)
    return AttnConfig(BH=bh, BN=bn, num_warps=8 if records else 4, num_stages=2,
                      split_kv=split)


def _source_args(name: str, kv: torch.Tensor | PackedRows, idx: torch.Tensor | None, T: int,
                 d: int, op: str = "sparse_attn"
                 ) -> tuple[torch.Tensor, tuple[int, int, int, int, int]]:
    """Check one source (and its index list, when given); returns (the tensor the kernel
    reads: the rows or the uint8 records, and its :func:`load_rows` layout)."""
    if isinstance(kv, PackedRows):
        if kv.fmt.dim != d:
            raise ValueError(f"{op}: {name} records hold {kv.fmt.dim} channels; expected {d}")
        data, meta = kv.data, record_meta(kv.fmt)
    else:
        data, meta = kv, _DENSE_META
        if kv.dim() != 2 or kv.shape[1] != d:
            raise ValueError(f"{op}: {name} must be [N, {d}]; found {tuple(kv.shape)}")
    if idx is not None:
        _check_index(name, idx, T)
    if data.stride(1) != 1:
        raise ValueError(f"{op}: {name} rows must be contiguous (stride 1 on the last dim)")
    return data, meta


def _check_index(name: str, idx: torch.Tensor, T: int) -> None:
    if idx.dim() != 2 or idx.shape[0] != T:
        raise ValueError(f"sparse_attn: the index list of {name} must be [{T}, K]; found "
                         f"{tuple(idx.shape)}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse_attn: the index list of {name} must be int32/int64; found "
                         f"{idx.dtype}")


def sparse_attn_with_config(q: torch.Tensor, kv_a: torch.Tensor | PackedRows,
                            idx_a: torch.Tensor, kv_b: torch.Tensor | PackedRows | None,
                            idx_b: torch.Tensor | None,
                            sink: torch.Tensor, scale: float,
                            p_dtype: torch.dtype | None = None,
                            cfg: AttnConfig | None = None,
                            rope_out: tuple[torch.Tensor, torch.Tensor] | None = None
                            ) -> torch.Tensor:
    """:func:`sparse_attn` with an explicit tile plan (``None``: :func:`pick_attn_config`)."""
    if q.dim() != 3:
        raise ValueError(f"sparse_attn: q must be [T, H, d]; found {tuple(q.shape)}")
    T, H, d = q.shape
    if rope_out is not None:
        check_rope_args("sparse_attn", q, *rope_out, min_dim=3)
    if (kv_b is None) != (idx_b is None):
        raise ValueError("sparse_attn: kv_b and idx_b must both be given or both be None")
    kv_a, meta_a = _source_args("kv_a", kv_a, idx_a, T, d)
    meta_b = _DENSE_META
    if kv_b is not None:
        kv_b, meta_b = _source_args("kv_b", kv_b, idx_b, T, d)
    if sink.shape != (H,):
        raise ValueError(f"sparse_attn: sink must be [{H}]; found {tuple(sink.shape)}")
    if q.stride(2) != 1:
        q = q.contiguous()
    o = torch.empty(T, H, d, dtype=q.dtype, device=q.device)
    if T == 0:
        return o
    Kb = idx_b.shape[1] if kv_b is not None else 0
    records = meta_a[0] != FMT_DENSE or meta_b[0] != FMT_DENSE
    bf16 = (q.dtype == torch.bfloat16 and kv_a.dtype == torch.bfloat16
            and (kv_b is None or kv_b.dtype == torch.bfloat16))
    cfg = cfg or pick_attn_config(T, H, d, idx_a.shape[1] + Kb, q.device, records=records,
                                  bf16=bf16)
    idx_a = idx_a if idx_a.stride(1) == 1 else idx_a.contiguous()
    has_b = kv_b is not None
    if has_b:
        idx_b = idx_b if idx_b.stride(1) == 1 else idx_b.contiguous()
    else:
        kv_b, idx_b = kv_a, idx_a  # placeholders, never read
    p_bf16 = p_dtype == torch.bfloat16
    # Record rows are dequantized into q's dtype; dense rows keep theirs.
    any_f32 = (q.dtype == torch.float32
               or (meta_a[0] == FMT_DENSE and kv_a.dtype == torch.float32)
               or (has_b and meta_b[0] == FMT_DENSE and kv_b.dtype == torch.float32))
    dot_prec = "ieee" if any_f32 else "tf32"
    Ka = idx_a.shape[1]
    BD = triton.next_power_of_2(d)
    BDV = BD if cfg.dv <= 0 else min(BD, triton.next_power_of_2(cfg.dv))
    split = max(1, min(cfg.split_kv, max(Ka, Kb)))
    chunk_a, chunk_b = triton.cdiv(Ka, split), triton.cdiv(Kb, split)
    sink = sink.float().contiguous()
    grid = (T, triton.cdiv(H, cfg.BH) * (BD // BDV), split)

    def chunk_ok(meta: tuple[int, int, int, int, int], data: torch.Tensor) -> bool:
        return cfg.chunked and BDV == BD and chunked_records_ok(meta, d, data.stride(0))

    if split > 1:
        part = torch.empty(split, T, H, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(split, T, H, 2, dtype=torch.float32, device=q.device)
        dst, dst_t, dst_h = part, 0, 0
    else:
        part = ml = None
        dst, dst_t, dst_h = o, o.stride(0), o.stride(1)
    _sparse_attn_kernel[grid](
        q, kv_a, idx_a, kv_b, idx_b, sink, dst, ml if ml is not None else sink,
        T, H, d, Ka, Kb, chunk_a, chunk_b,
        q.stride(0), q.stride(1), kv_a.stride(0), kv_b.stride(0),
        idx_a.stride(0), idx_b.stride(0), dst_t, dst_h, float(scale) * _LOG2E,
        HAS_B=has_b, BH=cfg.BH, BD=BD, BDV=BDV, N_DV=BD // BDV, BN=cfg.BN, SPLIT_KV=split > 1,
        P_BF16=p_bf16, DOT_PREC=dot_prec,
        FMT_A=meta_a[0], NQ_A=meta_a[1], QB_A=meta_a[2], SCO_A=meta_a[3], TLO_A=meta_a[4],
        FMT_B=meta_b[0], NQ_B=meta_b[1], QB_B=meta_b[2], SCO_B=meta_b[3], TLO_B=meta_b[4],
        CHUNK_A=chunk_ok(meta_a, kv_a), CHUNK_B=has_b and chunk_ok(meta_b, kv_b),
        ONE_LOOP=cfg.one_loop and has_b and bf16 and not records and split == 1 and BDV == BD,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(q))
    rope_here = False
    if split > 1:
        bd_c = min(BD, 128)
        extra = {}
        if rope_out is not None and ROPE_IN_COMBINE:
            half = rope_out[0].shape[1]
            nope = d - 2 * half
            # The rotated channels in one column block of the merge (V4: 448..511 of 384..511).
            rope_here = nope // bd_c == (d - 1) // bd_c
        if rope_here:
            # (No copy on the model's path, whose cos / sin are fp32 rows already: a copy
            # would be one more launch on the chain.)
            cos, sin = rope_out
            if (cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.stride(1) != 1
                    or sin.stride(1) != 1 or cos.stride(0) != sin.stride(0)):
                cos, sin = cos.float().contiguous(), sin.float().contiguous()
            extra = dict(cos_ptr=cos, sin_ptr=sin, stride_c=cos.stride(0), nope=nope,
                         half=half, ROPE=True)
        _attn_combine_kernel[(T, triton.cdiv(H, 16), triton.cdiv(d, bd_c))](
            part, ml, sink, o, split, T, H, d, o.stride(0), o.stride(1), **extra,
            SP=triton.next_power_of_2(split), BH=16, BD=bd_c, num_warps=4, **pdl_args(part))
    if rope_out is not None and not rope_here:
        # o is this call's own tensor: its tail rotated where it lies (an 8K-token V4 prefill
        # moves 64 of the 512 channels instead of copying 512 MiB).
        triton_norm.apply_rope(o, rope_out[0], rope_out[1], inverse=True, inplace=True)
    return o


@torch_twin_off_gpu("dsv4.ops.torch_attn")
def sparse_attn(q: torch.Tensor, kv_a: torch.Tensor | PackedRows, idx_a: torch.Tensor,
                kv_b: torch.Tensor | PackedRows | None, idx_b: torch.Tensor | None,
                sink: torch.Tensor, scale: float,
                p_dtype: torch.dtype | None = None,
                rope_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of each token over selected rows of one or two KV sources, with a sink.

    q [T, H, d]; kv_a [Na, d], idx_a [T, Ka] int rows of kv_a (−1 = skip); kv_b / idx_b the
    same for a second source (both None when absent); sink [H] fp32.  A source may be
    PackedRows (cache records, read in place and dequantized in the kernel).  K = V; logits
    ``(q·kv)·scale``; one softmax over both sources with ``exp(sink[h])`` in the denominator.
    fp32 accumulation; with bf16 rows (or ``p_dtype=bf16``) P is rounded to bf16 before P·V,
    as the reference kernel does (blocks of 64 indices per source).  Returns o [T, H, d] in q.dtype.
    ``rope_out`` (cos, sin) [T, rd/2]: o's tail rotated back too, as ``apply_rope(o, cos, sin,
    inverse=True)`` (in the split-KV merge where it can: :data:`ROPE_IN_COMBINE`).
    """
    return sparse_attn_with_config(q, kv_a, idx_a, kv_b, idx_b, sink, scale, p_dtype, None,
                                   rope_out)


# ------------------------------------------------------------------------------ indexer scores
@triton.jit
def _indexer_scores_kernel(q_ptr, w_ptr, k_ptr, rows_ptr, nvis_ptr, out_ptr,
                           NH, DI, L, stride_qt, stride_qh, stride_wt, stride_k, stride_rt,
                           stride_ot, BHI: tl.constexpr, BDI: tl.constexpr, BL: tl.constexpr,
                           DOT_PREC: tl.constexpr, FMT: tl.constexpr, NQ: tl.constexpr,
                           QB: tl.constexpr, SC_OFF: tl.constexpr, TAIL_OFF: tl.constexpr,
                           PDL: tl.constexpr = False):
    """scores[t, l] = Σ_h w[t,h]·ReLU(q[t,h]·keys[rows[t,l]]), −inf for l >= n_visible[t];
    the keys are dense rows or records (FMT..TAIL_OFF: :func:`load_rows`)."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0)
    rl = tl.program_id(1) * BL + tl.arange(0, BL)
    t64 = t.to(tl.int64)
    n_vis = tl.load(nvis_ptr + t).to(tl.int32)
    l_mask = rl < L
    vis = rl < n_vis
    out_ptrs = out_ptr + t64 * stride_ot + rl
    if tl.program_id(1) * BL >= n_vis:
        # Nothing visible in this block: skip the gather entirely.
        tl.store(out_ptrs, tl.full((BL,), float("-inf"), tl.float32), mask=l_mask)
    else:
        rh = tl.arange(0, BHI)
        rd = tl.arange(0, BDI)
        h_mask = rh < NH
        d_mask = rd < DI
        q = tl.load(q_ptr + t64 * stride_qt + rh[:, None] * stride_qh + rd[None, :],
                    mask=h_mask[:, None] & d_mask[None, :], other=0.0)
        w = tl.load(w_ptr + t64 * stride_wt + rh, mask=h_mask, other=0.0).to(tl.float32)
        rows = tl.load(rows_ptr + t64 * stride_rt + rl, mask=vis & l_mask, other=0)
        k = load_rows(k_ptr, rows.to(tl.int64), rd, (vis & l_mask)[:, None] & d_mask[None, :],
                      stride_k, FMT, NQ, QB, SC_OFF, TAIL_OFF)  # [BL, DI]
        s = mma(q, tl.trans(k.to(q.dtype)), DOT_PREC)  # [BHI, BL]
        s = tl.maximum(s, 0.0) * w[:, None]
        score = tl.sum(s, axis=0)
        score = tl.where(vis, score, float("-inf"))
        tl.store(out_ptrs, score, mask=l_mask)


@torch_twin_off_gpu("dsv4.ops.torch_attn")
def indexer_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor | PackedRows,
                   key_rows: torch.Tensor, n_visible: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer scores ``s[t, j] = Σ_h w[t,h] · ReLU(q[t,h] · keys[key_rows[t,j]])``.

    q [T, h, dI]; w [T, h] fp32; keys [Nk, dI] or PackedRows (fp4 records, read in place);
    key_rows [T, L] int rows of ``keys`` (any value where the entry does not exist);
    n_visible [T].  Returns [T, L] fp32, −inf where ``j >= n_visible[t]``.
    """
    if q.dim() != 3:
        raise ValueError(f"indexer_scores: q must be [T, h, dI]; found {tuple(q.shape)}")
    T, NH, DI = q.shape
    if tuple(w.shape) != (T, NH):
        raise ValueError(f"indexer_scores: w must be [{T}, {NH}]; found {tuple(w.shape)}")
    if not isinstance(keys, PackedRows) and keys.dim() == 2 and keys.stride(1) != 1:
        keys = keys.contiguous()
    keys, meta = _source_args("keys", keys, None, T, DI, op="indexer_scores")
    if key_rows.dim() != 2 or key_rows.shape[0] != T:
        raise ValueError(f"indexer_scores: key_rows must be [{T}, L]; found "
                         f"{tuple(key_rows.shape)}")
    if n_visible.shape != (T,):
        raise ValueError(f"indexer_scores: n_visible must be [{T}]; found "
                         f"{tuple(n_visible.shape)}")
    L = key_rows.shape[1]
    out = torch.empty(T, L, dtype=torch.float32, device=q.device)
    if T == 0 or L == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    key_rows = key_rows if key_rows.stride(1) == 1 else key_rows.contiguous()
    w = w.float()
    if meta[0] == FMT_DENSE and keys.dtype != q.dtype:
        # One dot dtype: bf16 keys with bf16 queries on the GPU; fp32 on the CPU path.
        keys = keys.to(q.dtype)
    BHI = max(16, triton.next_power_of_2(NH))
    BDI = max(16, triton.next_power_of_2(DI))
    BL = 64
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    _indexer_scores_kernel[(T, triton.cdiv(L, BL))](
        q, w, keys, key_rows, n_visible.contiguous(), out, NH, DI, L,
        q.stride(0), q.stride(1), w.stride(0), keys.stride(0), key_rows.stride(0), out.stride(0),
        BHI=BHI, BDI=BDI, BL=BL, DOT_PREC=dot_prec, FMT=meta[0], NQ=meta[1], QB=meta[2],
        SC_OFF=meta[3], TAIL_OFF=meta[4], num_warps=4, num_stages=2, **pdl_args(q))
    return out
