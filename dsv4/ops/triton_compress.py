"""Triton kernels of the compressor ops (spec §3.7, §4.3); same signatures and row conventions as
the torch twin ``dsv4/ops/torch_compress.py`` (read its header for where a group's rows live).

* ``compress_entries``: locates an entry's group rows (this step's tokens or the slot's
  carry-over state), pools them with the per-channel softmax (overlap and ``ape`` included),
  casts to the output dtype, applies the RMSNorm and the RoPE of the rope channels: the whole
  finish of an entry in one launch instead of ~20 small torch kernels.  Two plans (same
  numerics, :func:`entries_plan` picks one by the entry count):

  - ``"loop"`` (many entries, prefill): one program per entry walks the channel blocks in a
    serial loop, then a second pass applies the norm and RoPE;
  - ``"split"`` (few entries: decode steps, where the loop's serial chain of dependent loads,
    float64 exps and cross-warp reductions is the whole time): one program per (entry, channel
    block), grid (E, d / BLOCK_D), so the float64 pooling of an entry runs on many SMs at once;
    each program stores its pooled block, and the program that arrives last at the entry's
    arrival counter (``triton_dense.splitk_counters``, acq_rel atomics; it resets the counter
    for the next launch and CUDA-graph replays) reads the row back from L2 and applies the norm
    and RoPE (an entry of one block, d <= 128: finished in registers).  The group's row
    locations are read speculatively at index ``e`` together with the entry (a static decode
    step has request e = entry e), the norm weight and RoPE rows before the pooling, so the
    chain is: entry → group rows → pooled block → arrival → finish.

  ``DSV4_COMPRESS_PLAN=loop|split`` forces a plan (A/B on the GPU; ``DSV4_COMPRESS_TILE``
  the split plan's block, see :func:`split_tiles`); ``auto`` (default) takes the split plan for
  few entries once it is GPU-verified (:data:`SPLIT_PLAN_VERIFIED`; before that only with
  ``DSV4_UNVERIFIED_KERNELS=1``).
* ``compress_update_state``: one program per (request, channel block) rewrites the request's
  slot with the rows of its open group (and, with overlap, of the last complete group).
* The compact carry-over (``COMPACT``, a float64 ``state_kv``: one pseudo-row per slot, the
  twin header's second form; V4's C128 compressors): ``_locate`` maps only the open group's
  first position before the step to the slot's row (its other positions are empty), the pooling
  tile then holds [pseudo-row, step rows] in float64 as before; the state update reduces its
  tile of the group's rows over the slots (float64 max, exp, sum, log) into the new pseudo-row.
  GPU-gated by :data:`COMPACT_KERNELS_VERIFIED` (:func:`compact_kernels`; True since its GPU
  checks): when False the wrappers run the twin for a compact state unless
  ``DSV4_UNVERIFIED_KERNELS=1``.
* ``ape`` (both ops, optional): the position bias ``ape[pos % r]`` added in fp32 to the scores
  read from the step's rows (``HAS_APE``), which saves the model its gather and add launches
  per compressor call (twin header: the same bits as scores biased before the call).  A step
  row's slot s in the tile has ``pos % r == s % r`` (groups start at multiples of r), so the
  bias row is ``s % r``.  GPU-gated by :data:`APE_FUSED_VERIFIED` (True since its GPU
  checks): when False the wrappers add it in torch first (the twin's add) unless
  ``DSV4_UNVERIFIED_KERNELS=1``; :func:`ape_fused` says which (the model asks it, through the
  ops' ``ape_fused`` attribute, before passing ``ape``).

Numerics: the softmax pooling runs in float64 and is rounded once to fp32, as the twin does, so
pooled values agree with the twin to the last fp32 bit but for rare rounding ties; the norm's
sum of squares is reduced in another order than torch's, so finished fp32 entries agree to
~1e-6 relative and bf16 entries to 1 ulp (a pre-rounding difference of a few fp32 ulps can only
flip a bf16 rounding).  Every bf16 value is rounded to nearest-even by hand (the interpreter's
own cast truncates).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dsv4.ops import torch_compress as twin
from dsv4.ops.pdl import grid_dependency_sync, pdl_args
from dsv4.ops.specialize import lengths
from dsv4.ops.triton_dense import round_to_bf16, splitk_counters, torch_twin_off_gpu

__all__ = ["compress_entries", "compress_update_state", "entries_tiles", "state_tiles",
           "split_tiles", "entries_plan", "ape_fused", "APE_FUSED_VERIFIED", "compact_kernels",
           "COMPACT_KERNELS_VERIFIED"]


@triton.jit
def _locate(pos, p0, cu0, slot, T, R: tl.constexpr, OVERLAP: tl.constexpr,
            COMPACT: tl.constexpr):
    """(from_step, step_row, state_row) of positions ``pos`` of one request (twin: locate_rows);
    step rows are clamped into the step, state_row is −1 where the state holds nothing.
    COMPACT: the slot's one pseudo-row stands at the open group's first position g0."""
    from_step = pos >= p0
    step_row = tl.minimum(tl.maximum(cu0 + pos - p0, 0), T - 1)
    g0 = (p0 // R) * R
    if COMPACT:
        state_row = tl.where((pos == g0) & (pos < p0), slot, -1)
    else:
        base = slot * ((2 if OVERLAP else 1) * R)
        # pos % R is taken only where pos >= 0 (Triton's % truncates towards zero).
        in_partial = (pos >= g0) & (pos < p0)
        state_row = tl.where(in_partial, base + (R if OVERLAP else 0) + pos % R, -1)
        if OVERLAP:
            in_prev = (pos >= g0 - R) & (pos < g0) & (pos >= 0)
            state_row = tl.where(in_prev, base + pos % R, state_row)
    return from_step, step_row, state_row


@triton.jit
def _group_rows(ent, p0, cu0, slot, T, D, W, SKV, SSC, R: tl.constexpr, OVERLAP: tl.constexpr,
                COMPACT: tl.constexpr, S_BLOCK: tl.constexpr):
    """Where the S_BLOCK slots of entry ``ent``'s group live for one request (start p0, first
    step row cu0, state slot): (from_step, use_step, use_state, kv_base, sc_base, state_base,
    ape_base) [S_BLOCK], the row offsets of the step's kv / score rows (row strides SKV / SSC:
    column slices of a wider GEMM output are read in place), of the W-wide state rows and of
    the ape rows (pos % R == slot % R)."""
    s = tl.arange(0, S_BLOCK)
    if OVERLAP:
        # slots 0..R-1: the previous group's channels [:d]; R..2R-1: this group's [d:]
        n_slots = 2 * R
        pos = ent * R - R + s
        ch_off = tl.where(s < R, 0, D)
    else:
        n_slots = R
        pos = ent * R + s
        ch_off = s * 0
    from_step, step_row, state_row = _locate(pos, p0, cu0, slot, T, R, OVERLAP, COMPACT)
    slot_ok = s < n_slots
    use_step = slot_ok & from_step
    use_state = slot_ok & (pos < p0) & (state_row >= 0)
    kv_base = step_row.to(tl.int64) * SKV + ch_off
    sc_base = step_row.to(tl.int64) * SSC + ch_off
    state_base = tl.maximum(state_row, 0).to(tl.int64) * W + ch_off
    return from_step, use_step, use_state, kv_base, sc_base, state_base, (s % R) * W + ch_off


@triton.jit
def _pool_block(kv_ptr, score_ptr, skv_ptr, ssc_ptr, ape_ptr, c, cm, from_step, use_step,
                use_state, kv_base, sc_base, state_base, ape_base, HAS_APE: tl.constexpr,
                OUT_BF16: tl.constexpr, COMPACT: tl.constexpr):
    """Channels ``c`` (mask ``cm``) of one entry: the float64 softmax over its group's slots of
    the scores (step rows + ape when HAS_APE; state rows as stored) pooling the kv rows, rounded
    once to fp32 (and to bf16 with OUT_BF16, the output's rounding); 0 where ``cm`` is False.
    COMPACT: the state rows are float64 pseudo-rows (read as such, never rounded to fp32)."""
    m_step = use_step[:, None] & cm[None, :]
    m_state = use_state[:, None] & cm[None, :]
    k_step = tl.load(kv_ptr + kv_base[:, None] + c[None, :], mask=m_step, other=0.0)
    k_state = tl.load(skv_ptr + state_base[:, None] + c[None, :], mask=m_state, other=0.0)
    g_step = tl.load(score_ptr + sc_base[:, None] + c[None, :], mask=m_step,
                     other=float("-inf"))
    if HAS_APE:
        # One fp32 add (what the model's score + ape gives); -inf + 0 where masked.
        g_step = g_step + tl.load(ape_ptr + ape_base[:, None] + c[None, :], mask=m_step,
                                  other=0.0)
    g_state = tl.load(ssc_ptr + state_base[:, None] + c[None, :], mask=m_state,
                      other=float("-inf"))
    if COMPACT:
        # Both sides float64 before the select: the pseudo-row keeps its float64 bits.
        kv = tl.where(from_step[:, None], k_step.to(tl.float64), k_state.to(tl.float64))
        g = tl.where(from_step[:, None], g_step.to(tl.float64), g_state.to(tl.float64))
    else:
        kv = tl.where(from_step[:, None], k_step, k_state).to(tl.float64)
        g = tl.where(from_step[:, None], g_step, g_state).to(tl.float64)
    p = tl.exp(g - tl.max(g, axis=0)[None, :])
    p = p / tl.sum(p, axis=0)[None, :]
    pooled = tl.sum(p * kv, axis=0).to(tl.float32)
    if OUT_BF16:
        pooled = round_to_bf16(pooled)
    return tl.where(cm, pooled, 0.0)


@triton.jit
def _norm_rope_pairs(x_e, x_o, w_e, w_o, rstd, cs, sn, rm, HAS_ROPE: tl.constexpr,
                     OUT_BF16: tl.constexpr):
    """The finish of (even, odd) channel pairs of a pooled entry: ``w · (x · rstd)`` (rounded
    to bf16 with OUT_BF16), then the RoPE rotation by (cs, sn) where ``rm`` (the rope pairs)."""
    y_e = w_e * (x_e * rstd)
    y_o = w_o * (x_o * rstd)
    if OUT_BF16:
        y_e = round_to_bf16(y_e)
        y_o = round_to_bf16(y_o)
    if HAS_ROPE:
        r_e = y_e * cs - y_o * sn
        r_o = y_e * sn + y_o * cs
        if OUT_BF16:
            r_e = round_to_bf16(r_e)
            r_o = round_to_bf16(r_o)
        y_e = tl.where(rm, r_e, y_e)
        y_o = tl.where(rm, r_o, y_o)
    return y_e, y_o


@triton.jit(**lengths("T"))
def _compress_entries_kernel(kv_ptr, score_ptr, skv_ptr, ssc_ptr, ape_ptr, req_ptr, ent_ptr,
                             valid_ptr, start_ptr, cu_ptr, slot_ptr, w_ptr, cos_ptr, sin_ptr,
                             out_ptr, T, D, W, SKV, SSC, HALF, eps,
                             R: tl.constexpr, OVERLAP: tl.constexpr, HAS_VALID: tl.constexpr,
                             HAS_ROPE: tl.constexpr, HAS_APE: tl.constexpr,
                             OUT_BF16: tl.constexpr, COMPACT: tl.constexpr,
                             S_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                             PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)
    e = tl.program_id(0)
    req = tl.load(req_ptr + e)
    ent = tl.load(ent_ptr + e)
    live = True
    if HAS_VALID:
        live = tl.load(valid_ptr + e) != 0
    out_row = out_ptr + e.to(tl.int64) * D
    if live:
        p0 = tl.load(start_ptr + req)
        cu0 = tl.load(cu_ptr + req)
        slot = tl.load(slot_ptr + req)
        from_step, use_step, use_state, kv_base, sc_base, state_base, ape_base = _group_rows(
            ent, p0, cu0, slot, T, D, W, SKV, SSC, R, OVERLAP, COMPACT, S_BLOCK)
        # Pass 1: pool channel blocks (float64 softmax over the slots), store them rounded to
        # the output dtype (the norm's input) and sum their squares.
        ss = tl.zeros([BLOCK_D], dtype=tl.float32)
        for c0 in range(0, D, BLOCK_D):
            c = c0 + tl.arange(0, BLOCK_D)
            cm = c < D
            pooled = _pool_block(kv_ptr, score_ptr, skv_ptr, ssc_ptr, ape_ptr, c, cm,
                                 from_step, use_step, use_state, kv_base, sc_base, state_base,
                                 ape_base, HAS_APE, OUT_BF16, COMPACT)
            ss += pooled * pooled
            tl.store(out_row + c, pooled.to(out_ptr.dtype.element_ty), mask=cm)
        # torch's order: mean = sum / d, then 1 / sqrt(mean + eps), each rounded (IEEE ops).
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(ss, axis=0), D.to(tl.float32)) + eps))
        # Every thread's pass-1 stores must be visible before pass 2 reads them back.
        tl.debug_barrier()
        # Pass 2: norm and RoPE over (even, odd) channel pairs; rope pairs are the last HALF.
        for h0 in range(0, D // 2, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            hm = h < D // 2
            x_e = tl.load(out_row + 2 * h, mask=hm, other=0.0).to(tl.float32)
            x_o = tl.load(out_row + 2 * h + 1, mask=hm, other=0.0).to(tl.float32)
            w_e = tl.load(w_ptr + 2 * h, mask=hm, other=0.0)
            w_o = tl.load(w_ptr + 2 * h + 1, mask=hm, other=0.0)
            i = h - (D // 2 - HALF)
            rm = hm & (i >= 0)
            cs = tl.full([BLOCK_H], 1.0, tl.float32)        # (unused without RoPE)
            sn = tl.zeros([BLOCK_H], tl.float32)
            if HAS_ROPE:
                cs = tl.load(cos_ptr + e.to(tl.int64) * HALF + i, mask=rm, other=1.0)
                sn = tl.load(sin_ptr + e.to(tl.int64) * HALF + i, mask=rm, other=0.0)
            y_e, y_o = _norm_rope_pairs(x_e, x_o, w_e, w_o, rstd, cs, sn, rm, HAS_ROPE,
                                        OUT_BF16)
            # A pair is read and written by the same block: all reads first.
            tl.debug_barrier()
            tl.store(out_row + 2 * h, y_e.to(out_ptr.dtype.element_ty), mask=hm)
            tl.store(out_row + 2 * h + 1, y_o.to(out_ptr.dtype.element_ty), mask=hm)
    else:
        for c0 in range(0, D, BLOCK_D):
            c = c0 + tl.arange(0, BLOCK_D)
            tl.store(out_row + c, tl.zeros([BLOCK_D], dtype=tl.float32)
                     .to(out_ptr.dtype.element_ty), mask=c < D)


@triton.jit(**lengths("T", "NREQ"))
def _compress_entries_split_kernel(kv_ptr, score_ptr, skv_ptr, ssc_ptr, ape_ptr, req_ptr,
                                   ent_ptr, valid_ptr, start_ptr, cu_ptr, slot_ptr, w_ptr,
                                   cos_ptr, sin_ptr, out_ptr, arrivals_ptr,
                                   T, D, W, SKV, SSC, HALF, NREQ, eps,
                                   R: tl.constexpr, OVERLAP: tl.constexpr,
                                   HAS_VALID: tl.constexpr, HAS_ROPE: tl.constexpr,
                                   HAS_APE: tl.constexpr, OUT_BF16: tl.constexpr,
                                   COMPACT: tl.constexpr, SPLIT: tl.constexpr,
                                   S_BLOCK: tl.constexpr,
                                   BLOCK_D: tl.constexpr,
                                   BLOCK_F: tl.constexpr, PDL: tl.constexpr = False):
    """The "split" plan of ``compress_entries``: program (e, b) pools channel block b of entry
    e (the loop plan's pass 1 for one block: the same tile code and float64 softmax).  SPLIT
    (several blocks per entry): each stores its pooled block and the last one to arrive at the
    entry's counter reads the row back and finishes it (norm, RoPE); one block (BLOCK_D = BLOCK_F
    >= d): the program finishes its row in registers.  BLOCK_F = next_power_of_2(d)."""
    grid_dependency_sync(PDL)
    e = tl.program_id(0)
    b = tl.program_id(1)
    req = tl.load(req_ptr + e)
    ent = tl.load(ent_ptr + e)
    live = True
    if HAS_VALID:
        live = tl.load(valid_ptr + e) != 0
    # Speculative: the request's rows at index e, read with the entry (no dependent round trip
    # where request e is e, as in a static decode step); re-read below otherwise.
    spec = e < NREQ
    p0 = tl.load(start_ptr + e, mask=spec, other=0)
    cu0 = tl.load(cu_ptr + e, mask=spec, other=0)
    slot = tl.load(slot_ptr + e, mask=spec, other=0)
    # The finish's operands, read before the pooling (with SPLIT only the last program uses
    # them), as (even, odd) channel pairs; rope pairs are the last HALF.
    cf = tl.arange(0, BLOCK_F)
    fm = cf < D
    w_e, w_o = tl.split(tl.reshape(tl.load(w_ptr + cf, mask=fm, other=0.0),
                                   [BLOCK_F // 2, 2]))
    h = tl.arange(0, BLOCK_F // 2)
    i = h - (D // 2 - HALF)
    rm = (h < D // 2) & (i >= 0)
    if HAS_ROPE:
        cs = tl.load(cos_ptr + e.to(tl.int64) * HALF + i, mask=rm, other=1.0)
        sn = tl.load(sin_ptr + e.to(tl.int64) * HALF + i, mask=rm, other=0.0)
    out_row = out_ptr + e.to(tl.int64) * D
    c = b * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = c < D
    if live:
        if req != e:
            p0 = tl.load(start_ptr + req)
            cu0 = tl.load(cu_ptr + req)
            slot = tl.load(slot_ptr + req)
        from_step, use_step, use_state, kv_base, sc_base, state_base, ape_base = _group_rows(
            ent, p0, cu0, slot, T, D, W, SKV, SSC, R, OVERLAP, COMPACT, S_BLOCK)
        pooled = _pool_block(kv_ptr, score_ptr, skv_ptr, ssc_ptr, ape_ptr, c, cm, from_step,
                             use_step, use_state, kv_base, sc_base, state_base, ape_base,
                             HAS_APE, OUT_BF16, COMPACT)
        if SPLIT:
            tl.store(out_row + c, pooled.to(out_ptr.dtype.element_ty), mask=cm)
            # Every thread's pooled stores are issued before the arrival, whose release
            # publishes them to the last program's acquire.
            tl.debug_barrier()
            old = tl.atomic_add(arrivals_ptr + e, 1, sem="acq_rel", scope="gpu")
            if old == tl.num_programs(1) - 1:
                # One thread did the acquire: the barrier orders every thread's reads after it;
                # .cg reads L2, never an L1 line older than the other programs' stores.
                tl.debug_barrier()
                x = tl.load(out_row + cf, mask=fm, other=0.0, cache_modifier=".cg")
                y = _finish_row(x.to(tl.float32), w_e, w_o, cs if HAS_ROPE else w_e,
                                sn if HAS_ROPE else w_o, rm, D, eps, HAS_ROPE, OUT_BF16, BLOCK_F)
                # Other threads' reads of the row land before this program overwrites it.
                tl.debug_barrier()
                tl.store(out_row + cf, y.to(out_ptr.dtype.element_ty), mask=fm)
                # Clean for the next launch (and CUDA-graph replays): no per-call zeroing.
                tl.store(arrivals_ptr + e, 0)
        else:
            y = _finish_row(pooled, w_e, w_o, cs if HAS_ROPE else w_e, sn if HAS_ROPE else w_o,
                            rm, D, eps, HAS_ROPE, OUT_BF16, BLOCK_F)
            tl.store(out_row + cf, y.to(out_ptr.dtype.element_ty), mask=fm)
    else:
        tl.store(out_row + c, tl.zeros([BLOCK_D], dtype=tl.float32)
                 .to(out_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _finish_row(x, w_e, w_o, cs, sn, rm, D, eps, HAS_ROPE: tl.constexpr,
                OUT_BF16: tl.constexpr, BLOCK_F: tl.constexpr):
    """RMSNorm and RoPE of one pooled row ``x`` [BLOCK_F] fp32 (zeros beyond d), as the loop
    plan's pass 2 computes each pair; returns the finished row [BLOCK_F] fp32."""
    x_e, x_o = tl.split(tl.reshape(x, [BLOCK_F // 2, 2]))
    # torch's order: mean = sum / d, then 1 / sqrt(mean + eps), each rounded (IEEE ops).
    ss = tl.sum(x_e * x_e + x_o * x_o, axis=0)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, D.to(tl.float32)) + eps))
    y_e, y_o = _norm_rope_pairs(x_e, x_o, w_e, w_o, rstd, cs, sn, rm, HAS_ROPE, OUT_BF16)
    return tl.reshape(tl.join(y_e, y_o), [BLOCK_F])


@triton.jit
def _compress_state_kernel(kv_ptr, score_ptr, skv_ptr, ssc_ptr, ape_ptr, start_ptr, cu_ptr,
                           slot_ptr, T, W, SKV, SSC, R: tl.constexpr, OVERLAP: tl.constexpr,
                           HAS_APE: tl.constexpr, COMPACT: tl.constexpr, S_BLOCK: tl.constexpr,
                           BLOCK_W: tl.constexpr, PDL: tl.constexpr = False):
    """Program (i, b): channel block b of request i's slot.  The tile holds the rows the slot
    keeps after the step (open group; with overlap, the last complete group before it) over
    the block's channels; raw states store them row by row, COMPACT ones reduce them (float64)
    to the group's one pseudo-row (twin: summarize_rows)."""
    grid_dependency_sync(PDL)
    i = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    cm = c < W
    p0 = tl.load(start_ptr + i)
    cu0 = tl.load(cu_ptr + i)
    end = p0 + (tl.load(cu_ptr + i + 1) - cu0)
    slot = tl.load(slot_ptr + i)
    g_end = (end // R) * R                                   # first position of the open group
    s = tl.arange(0, S_BLOCK)
    if OVERLAP:
        n_rows = 2 * R
        pos = g_end - R + s                                  # last complete group, open group
    else:
        n_rows = R
        pos = g_end + s
    pos = tl.where(pos < end, pos, -1)                       # open-group rows not yet seen
    from_step, step_row, state_row = _locate(pos, p0, cu0, slot, T, R, OVERLAP, COMPACT)
    row_ok = s < n_rows
    use_step = row_ok & from_step
    use_state = row_ok & (pos < p0) & (state_row >= 0)
    kv_off = step_row.to(tl.int64)[:, None] * SKV + c[None, :]   # row strides: see above
    sc_off = step_row.to(tl.int64)[:, None] * SSC + c[None, :]
    state_off = tl.maximum(state_row, 0).to(tl.int64)[:, None] * W + c[None, :]
    m_step = use_step[:, None] & cm[None, :]
    m_state = use_state[:, None] & cm[None, :]
    k_step = tl.load(kv_ptr + kv_off, mask=m_step, other=0.0)
    k_state = tl.load(skv_ptr + state_off, mask=m_state, other=0.0)
    g_step = tl.load(score_ptr + sc_off, mask=m_step, other=float("-inf"))
    if HAS_APE:
        # The state holds biased scores: a step row's is score + ape[pos % R], pos % R = s % R.
        g_step = g_step + tl.load(ape_ptr + ((s % R) * W)[:, None] + c[None, :], mask=m_step,
                                  other=0.0)
    g_state = tl.load(ssc_ptr + state_off, mask=m_state, other=float("-inf"))
    if COMPACT:
        kv = tl.where(from_step[:, None], k_step.to(tl.float64), k_state.to(tl.float64))
        g = tl.where(from_step[:, None], g_step.to(tl.float64), g_state.to(tl.float64))
        # The pseudo-row (k*, g*) of the group's rows: m = max g, l = Σ exp(g − m),
        # k* = Σ exp(g − m)·k / l, g* = m + log l; an empty channel (m = −inf) stays kv 0,
        # score −inf (m taken as 0 there: no −inf − (−inf)).
        m = tl.max(g, axis=0)
        empty = m == float("-inf")
        m = tl.where(empty, 0.0, m)
        p = tl.exp(g - m[None, :])
        den = tl.sum(p, axis=0)
        k_new = tl.where(empty, 0.0, tl.sum(p * kv, axis=0) / den)
        g_new = tl.where(empty, float("-inf"), m + tl.log(den))
        # Every read of the slot's pseudo-row lands before it is rewritten.
        tl.debug_barrier()
        dst = slot.to(tl.int64) * W + c
        tl.store(skv_ptr + dst, k_new, mask=cm)
        tl.store(ssc_ptr + dst, g_new, mask=cm)
    else:
        kv = tl.where(from_step[:, None], k_step, k_state)
        g = tl.where(from_step[:, None], g_step, g_state)
        # The slot's rows are read and rewritten by this block (rows move between the open and
        # the previous group): every read lands before any write.
        tl.debug_barrier()
        dst = (slot.to(tl.int64) * n_rows + s)[:, None] * W + c[None, :]
        m_dst = row_ok[:, None] & cm[None, :]
        tl.store(skv_ptr + dst, kv, mask=m_dst)
        tl.store(ssc_ptr + dst, g, mask=m_dst)


def entries_tiles(ratio: int, overlap: bool, d: int) -> tuple[int, int, int, int]:
    """(S_BLOCK, BLOCK_D, BLOCK_H, num_warps) of ``compress_entries``: the slot tile holds ~1K
    float64 values per channel block (a ratio-128 group: 16 channels at a time, over 16 warps),
    which keeps ptxas below ~110 registers and without spills for sm_90."""
    s_block = triton.next_power_of_2(2 * ratio if overlap else ratio)
    block_d = min(triton.next_power_of_2(d), max(16, 1024 // s_block))
    block_h = min(triton.next_power_of_2(max(d // 2, 1)), 256)
    return s_block, block_d, block_h, 16 if s_block >= 64 else 8


def split_tiles(ratio: int, overlap: bool, d: int) -> tuple[int, int, int, int]:
    """(S_BLOCK, BLOCK_D, BLOCK_F, num_warps) of the split plan: one [S_BLOCK, BLOCK_D] tile
    per program.  Groups of up to 16 rows (ratio 4): blocks of 32 channels over one warp (d
    512: 16 programs an entry, d 128: 4; no cross-warp reductions); ratio-128 groups: blocks
    of 16 channels over 4 warps (d 512: 32 programs).  A row of one block (d <= the block) is
    finished in registers.  From the H200 timing (bench/compress_sass.py --time, docs/
    PERFORMANCE.md ninth session): d 128 one block over 8 warps took 5.8 µs an entry, 3.5 in
    32-channel blocks; ratio 128 at 16 entries 10.5 µs in 8-channel blocks, 8.0 in 16-channel
    ones.  ``DSV4_COMPRESS_TILE=BLOCK_D,WARPS`` overrides the block (GPU A/B)."""
    s_block = triton.next_power_of_2(2 * ratio if overlap else ratio)
    block_f = triton.next_power_of_2(d)
    if os.environ.get("DSV4_COMPRESS_TILE"):
        block_d, num_warps = (int(v) for v in os.environ["DSV4_COMPRESS_TILE"].split(","))
        return s_block, min(block_f, block_d), block_f, num_warps
    if s_block <= 16:
        return s_block, min(block_f, 32), block_f, 1
    return s_block, min(block_f, 16), block_f, 4


# Entry counts up to this take the split plan (every static decode step of up to 256
# sequences; prefill chunks of few entries, e.g. a ratio-128 compressor's).
SPLIT_MAX_ENTRIES = 256
# The split plan passed its GPU checks (tests/kernels/test_compress_decode.py, every tile above,
# H200, 2026-12-01).  A new plan starts False: "auto" then picks it only with
# DSV4_UNVERIFIED_KERNELS=1 (as dsv4.ops does for kernels).
SPLIT_PLAN_VERIFIED = True
# The fused ``ape`` add (HAS_APE) of both ops passed its GPU checks (tests/kernels/
# test_compress_decode.py's ape cases: 89 passed; the model's side-lane bits tests: 5; H200,
# 2026-12-01, bench/sessions/gpu_session_s10a.sh) and was faster at B=1 (955.8 vs 964.4 µs a
# 4-layer step).  Set False for a new form: the wrappers then add ``ape`` in torch first unless
# DSV4_UNVERIFIED_KERNELS=1.
APE_FUSED_VERIFIED = True
# The COMPACT form of the three kernels (the float64 pseudo-row carry-over of V4's C128
# compressors, dsv4.cache.tensors.CompressorSpec.compact) passed its GPU checks
# (tests/kernels/test_compress_decode.py -k compact: 22 passed, entries bit-equal to the
# raw-state kernels' at V4-Flash's C128 shape, graph replays; the model's lanes bits test: 5;
# H100, 2026-12-06, bench/sessions/gpu_session_s22b.sh).  Set False for a new form: a compact
# state then runs the torch twin on the GPU (same results, more launches) unless
# DSV4_UNVERIFIED_KERNELS=1.
COMPACT_KERNELS_VERIFIED = True


def compact_kernels() -> bool:
    """True when the kernels take a compact (float64) state themselves
    (:data:`COMPACT_KERNELS_VERIFIED`, or ``DSV4_UNVERIFIED_KERNELS=1``); otherwise the
    wrappers run the torch twin for it."""
    from dsv4.ops import unverified_kernels_enabled
    return COMPACT_KERNELS_VERIFIED or unverified_kernels_enabled()


def ape_fused() -> bool:
    """True when the kernels add ``ape`` themselves (:data:`APE_FUSED_VERIFIED`, or
    ``DSV4_UNVERIFIED_KERNELS=1``); otherwise the wrappers add it in torch before the launch
    (the same bits, more launches), and the model does its own add instead of passing it."""
    from dsv4.ops import unverified_kernels_enabled
    return APE_FUSED_VERIFIED or unverified_kernels_enabled()


def entries_plan(E: int) -> str:
    """The plan of ``compress_entries`` for E entries: ``DSV4_COMPRESS_PLAN`` (``loop`` /
    ``split``) when set, else ``split`` for up to :data:`SPLIT_MAX_ENTRIES` entries."""
    plan = os.environ.get("DSV4_COMPRESS_PLAN", "auto")
    if plan in ("loop", "split"):
        return plan
    if plan != "auto":
        raise ValueError(f"DSV4_COMPRESS_PLAN must be auto, loop or split; found {plan!r}")
    from dsv4.ops import unverified_kernels_enabled
    if E <= SPLIT_MAX_ENTRIES and (SPLIT_PLAN_VERIFIED or unverified_kernels_enabled()):
        return "split"
    return "loop"


def state_tiles(ratio: int, overlap: bool, width: int) -> tuple[int, int, int]:
    """(S_BLOCK, BLOCK_W, num_warps) of ``compress_update_state``: ~2K fp32 values per tile and
    array over 8 warps (no spills, < ~110 registers for sm_90)."""
    s_block = triton.next_power_of_2(2 * ratio if overlap else ratio)
    return s_block, min(triton.next_power_of_2(width), max(16, 2048 // s_block)), 8


def _index(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.long().contiguous()


def _ape_operand(score: torch.Tensor, ape: torch.Tensor | None, start_pos: torch.Tensor,
                 cu_seqlens: torch.Tensor, ratio: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(score, ape) as the kernels take them: ``ape`` contiguous for the fused add, or, until
    that add is GPU-verified (:func:`ape_fused`), the twin's biased scores and no ``ape``."""
    if ape is None:
        return score, None
    if not ape_fused():
        return twin.bias_step_scores(score, ape, start_pos, cu_seqlens, ratio), None
    return score, ape.contiguous()


def _unit_cols(t: torch.Tensor) -> torch.Tensor:
    """``t`` [T, W] as the kernels read it: any row stride (a column slice of a wider GEMM
    output is read in place), unit column stride (a copy only otherwise)."""
    return t if t.stride(1) == 1 or t.shape[1] <= 1 else t.contiguous()


@torch_twin_off_gpu("dsv4.ops.torch_compress")
def compress_entries(kv: torch.Tensor, score: torch.Tensor, state_kv: torch.Tensor,
                     state_score: torch.Tensor, request: torch.Tensor, entry: torch.Tensor,
                     valid: torch.Tensor | None, start_pos: torch.Tensor,
                     cu_seqlens: torch.Tensor, slots: torch.Tensor, ratio: int, overlap: bool,
                     norm_weight: torch.Tensor, norm_eps: float, cos: torch.Tensor | None,
                     sin: torch.Tensor | None, out_dtype: torch.dtype,
                     ape: torch.Tensor | None = None) -> torch.Tensor:
    """Finished entries [E, d] in ``out_dtype`` (fp32 or bf16; other dtypes run the twin):
    pooled, cast, RMSNorm, RoPE, zeros where ``valid`` is False; ``ape`` [r, W] fp32: added to
    the step's scores (fused when :func:`ape_fused`).  See the torch twin."""
    d = twin.check_compress_args("compress_entries", kv, score, state_kv, state_score,
                                 start_pos, cu_seqlens, slots, ratio, overlap)
    twin.check_entry_args(request, entry, valid, norm_weight, d, cos, sin)
    twin.check_ape("compress_entries", ape, score, ratio)
    state_kv, state_score = state_kv.contiguous(), state_score.contiguous()
    if (out_dtype not in (torch.float32, torch.bfloat16) or d % 2
            or (twin.is_compact(state_kv) and not compact_kernels())):
        return twin.compress_entries(kv, score, state_kv, state_score, request, entry, valid,
                                     start_pos, cu_seqlens, slots, ratio, overlap, norm_weight,
                                     norm_eps, cos, sin, out_dtype, ape)
    E = request.shape[0]
    out = torch.empty(E, d, dtype=out_dtype, device=kv.device)
    if E == 0:
        return out
    has_rope = cos is not None
    half = cos.shape[1] if has_rope else 0
    cos_t = cos.float().contiguous() if has_rope else out
    sin_t = sin.float().contiguous() if has_rope else out
    valid_t = valid if valid is not None else out          # bool: read as i1, no conversion
    score, ape = _ape_operand(score, ape, start_pos, cu_seqlens, ratio)
    kv, score = _unit_cols(kv), _unit_cols(score)
    args = (kv, score, state_kv, state_score, ape if ape is not None else score, _index(request),
            _index(entry), valid_t, _index(start_pos), _index(cu_seqlens), _index(slots),
            norm_weight.float().contiguous(), cos_t, sin_t, out)
    consts = dict(R=ratio, OVERLAP=bool(overlap), HAS_VALID=valid is not None,
                  HAS_ROPE=has_rope, HAS_APE=ape is not None,
                  OUT_BF16=out_dtype == torch.bfloat16, COMPACT=twin.is_compact(state_kv))
    if entries_plan(E) == "split":
        s_block, block_d, block_f, num_warps = split_tiles(ratio, overlap, d)
        blocks = triton.cdiv(d, block_d)
        arrivals = splitk_counters(kv.device, E, "compress_entries") if blocks > 1 else out
        _compress_entries_split_kernel[(E, blocks)](
            *args, arrivals, kv.shape[0], d, kv.shape[1], kv.stride(0), score.stride(0), half,
            start_pos.shape[0], float(norm_eps), **consts, SPLIT=blocks > 1, S_BLOCK=s_block,
            BLOCK_D=block_d, BLOCK_F=block_f, num_warps=num_warps, **pdl_args(kv))
        return out
    s_block, block_d, block_h, num_warps = entries_tiles(ratio, overlap, d)
    _compress_entries_kernel[(E,)](
        *args, kv.shape[0], d, kv.shape[1], kv.stride(0), score.stride(0), half,
        float(norm_eps), **consts, S_BLOCK=s_block, BLOCK_D=block_d, BLOCK_H=block_h,
        num_warps=num_warps, **pdl_args(kv))
    return out


@torch_twin_off_gpu("dsv4.ops.torch_compress")
def compress_update_state(kv: torch.Tensor, score: torch.Tensor, state_kv: torch.Tensor,
                          state_score: torch.Tensor, start_pos: torch.Tensor,
                          cu_seqlens: torch.Tensor, slots: torch.Tensor, ratio: int,
                          overlap: bool, ape: torch.Tensor | None = None) -> None:
    """Rewrite every request's slot with its open group (and the last complete group with
    overlap; a compact state: the group's pseudo-row), in place; ``ape``: the step's scores
    are stored biased.  See the torch twin."""
    twin.check_compress_args("compress_update_state", kv, score, state_kv, state_score,
                             start_pos, cu_seqlens, slots, ratio, overlap)
    twin.check_ape("compress_update_state", ape, score, ratio)
    if not (state_kv.is_contiguous() and state_score.is_contiguous()):
        raise ValueError("compress_update_state: state_kv and state_score must be contiguous "
                         "(they are updated in place)")
    R, W = start_pos.shape[0], kv.shape[1]
    if R == 0:
        return
    compact = twin.is_compact(state_kv)
    if compact and not compact_kernels():
        twin.compress_update_state(kv, score, state_kv, state_score, start_pos, cu_seqlens,
                                   slots, ratio, overlap, ape)
        return
    s_block, block_w, num_warps = state_tiles(ratio, overlap, W)
    score, ape = _ape_operand(score, ape, start_pos, cu_seqlens, ratio)
    kv, score = _unit_cols(kv), _unit_cols(score)
    _compress_state_kernel[(R, triton.cdiv(W, block_w))](
        kv, score, state_kv, state_score, ape if ape is not None else score, _index(start_pos),
        _index(cu_seqlens), _index(slots), kv.shape[0], W, kv.stride(0), score.stride(0),
        R=ratio, OVERLAP=bool(overlap), HAS_APE=ape is not None, COMPACT=compact,
        S_BLOCK=s_block, BLOCK_W=block_w, num_warps=num_warps, **pdl_args(kv))


# The model asks the ops whether to pass ``ape`` (dsv4.model.compressor); the twins, which have
# no such attribute, always take it.
compress_entries.ape_fused = ape_fused            # type: ignore[attr-defined]
compress_update_state.ape_fused = ape_fused       # type: ignore[attr-defined]
