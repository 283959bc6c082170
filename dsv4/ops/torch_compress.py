"""Plain-torch twin of the compressor ops (spec §3.7, §4.3): gated softmax pooling of a group's
rows (``ape`` in the scores or added by the ops, and the ratio-4 overlap), RMSNorm, RoPE of the
rope channels, and the carry-over state update.  It is the oracle of ``triton_compress.py`` and
what runs on CPU; its numerics are those of the model since the first version (bit for bit).

Where the rows of a group live
------------------------------
Every token of a step gives fp32 rows ``kv`` / ``score`` [T, W] (W = coff·d; coff = 2 for the
overlapping compressor).  The rows of positions before the step are in the request's state slot,
in one of two forms (the ops tell them apart by the state's dtype):

* raw (fp32): ``state_kv`` / ``state_score`` [num_slots, coff·r, W]: rows ``[0:r]`` hold the
  previous complete group (overlap only), the next ``r`` rows the open group, at row ``pos % r``;
* compact (float64, non-overlapping compressors only; the cache uses it for ratio >= 8, V4's
  C128: dsv4.cache.tensors.CompressorSpec.compact): ``state_kv`` / ``state_score``
  [num_slots, 1, W] hold ONE pseudo-row summarizing the open group's positions seen so far,
  ``m = max g_i``, ``l = Σ exp(g_i − m)``, ``k* = Σ exp(g_i − m)·k_i / l``, ``g* = m + log l``
  (empty: kv 0, score −inf).  Since ``exp(g* − M)·k* = exp(m − M)·Σ exp(g_i − m)·k_i`` for any
  M, the per-channel softmax of a group over [pseudo-row, later rows] is the softmax over all its
  rows; computed in float64 and rounded once to fp32 (:func:`_softmax_pool`), an entry gets the
  raw form's bits but for astronomically rare rounding ties (float64 errors ~1e-16 against the
  fp32 half-ulp 6e-8: the argument torch and Triton already agree by).  The pseudo-row stands
  at the group's first position ``g0``; the group's other positions before the step are empty.

Entry j of a request pools the positions ``j·r .. j·r + r − 1`` (and, with overlap, the previous
group ``j·r − r ..``): each position is a row of this step (``pos >= start_pos``) or of the
state, or empty (kv 0, score −inf) when the state does not hold it (before the sequence; in the
compact form every position of the open group but its first).

Ops (same signatures in the Triton module)::

    compress_entries(kv, score, state_kv, state_score, request, entry, valid, start_pos,
                     cu_seqlens, slots, ratio, overlap, norm_weight, norm_eps, cos, sin,
                     out_dtype, ape=None) -> [E, d]
    compress_update_state(kv, score, state_kv, state_score, start_pos, cu_seqlens, slots,
                          ratio, overlap, ape=None) -> None      # in place

The position bias ``ape``
-------------------------
``score`` is either biased already (``ape=None``: the rows' scores include ``ape[pos % r]``) or
unbiased with ``ape`` [r, W] fp32 given: both ops then add ``ape[pos % r]`` (one fp32 add) to
every score they read from this step's rows, pos = ``start_pos[i] + (row − cu_seqlens[i])``
the row's absolute position; never to state rows, which hold biased scores (the state update
stores the biased score).  A single fp32 add of the same two values is the same wherever it
runs, so both forms give the same bits (:func:`bias_step_scores` is the twin's add).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4.ops.torch_attn import apply_rope, rms_norm

__all__ = ["compress_entries", "compress_update_state", "compress_pool", "locate_rows",
           "check_compress_args", "check_entry_args", "check_ape", "step_positions",
           "bias_step_scores", "is_compact", "summarize_rows"]

# Gathered group rows per block of entries stay near this many fp32 elements.
BLOCK_ELEMS = 1 << 24


def is_compact(state_kv: Tensor) -> bool:
    """True for the compact carry-over form (float64 pseudo-rows, see the header)."""
    return state_kv.dtype == torch.float64


def check_compress_args(name: str, kv: Tensor, score: Tensor, state_kv: Tensor,
                        state_score: Tensor, start_pos: Tensor, cu_seqlens: Tensor,
                        slots: Tensor, ratio: int, overlap: bool) -> int:
    """Validate the shared arguments of the compressor ops (either state form); returns the
    entry width d."""
    coff = 2 if overlap else 1
    compact = is_compact(state_kv)
    if compact and overlap:
        raise ValueError(f"{name}: the compact (float64) state is for non-overlapping "
                         f"compressors only")
    if not isinstance(ratio, int) or ratio < 1 or (overlap and ratio < 2):
        raise ValueError(f"{name}: ratio must be an integer >= 1 (>= 2 with overlap); got "
                         f"{ratio!r}")
    if kv.dim() != 2 or score.shape != kv.shape or kv.shape[1] % coff:
        raise ValueError(f"{name}: kv and score must be the same [T, coff·d] (coff={coff}); "
                         f"found {tuple(kv.shape)} and {tuple(score.shape)}")
    W = kv.shape[1]
    want = (1 if compact else coff * ratio, W)
    if (state_kv.dim() != 3 or tuple(state_kv.shape[1:]) != want
            or state_score.shape != state_kv.shape):
        raise ValueError(f"{name}: state_kv / state_score must be [num_slots, {want[0]}, {W}]"
                         f"{' (compact form)' if compact else ''}; found "
                         f"{tuple(state_kv.shape)} and {tuple(state_score.shape)}")
    state_dtype = torch.float64 if compact else torch.float32
    for t, what, dt in ((kv, "kv", torch.float32), (score, "score", torch.float32),
                        (state_kv, "state_kv", state_dtype),
                        (state_score, "state_score", state_dtype)):
        if t.dtype != dt:
            raise ValueError(f"{name}: {what} must be {str(dt).removeprefix('torch.')} "
                             f"(state: float32 raw rows or float64 compact); found {t.dtype}")
    R = start_pos.shape[0]
    if tuple(cu_seqlens.shape) != (R + 1,) or tuple(slots.shape) != (R,):
        raise ValueError(f"{name}: start_pos [R], cu_seqlens [R+1], slots [R] expected; found "
                         f"{tuple(start_pos.shape)}, {tuple(cu_seqlens.shape)}, "
                         f"{tuple(slots.shape)}")
    return W // coff


def check_ape(name: str, ape: Tensor | None, score: Tensor, ratio: int) -> None:
    """Validate the optional position bias ``ape`` [ratio, W] fp32 of the step's scores."""
    if ape is None:
        return
    want = (ratio, score.shape[1])
    if ape.dim() != 2 or tuple(ape.shape) != want or ape.dtype != torch.float32:
        raise ValueError(f"{name}: ape must be a float32 [{want[0]}, {want[1]}] (ratio, W) or "
                         f"None; found {ape.dtype} {tuple(ape.shape)}")
    if ape.device != score.device:
        raise ValueError(f"{name}: ape is on {ape.device}, score on {score.device}")


def step_positions(start_pos: Tensor, cu_seqlens: Tensor, T: int) -> Tensor:
    """[T] absolute position of each of this step's rows: ``start_pos[i] + (row −
    cu_seqlens[i])`` with i the row's request (rows beyond ``cu_seqlens[-1]``, which no op
    reads, count as the last request's)."""
    R = start_pos.shape[0]
    rows = torch.arange(T, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    if R == 0:
        return rows
    req = torch.searchsorted(cu_seqlens[1:].contiguous(), rows, right=True).clamp_(max=R - 1)
    return start_pos[req] + (rows - cu_seqlens[req])


def bias_step_scores(score: Tensor, ape: Tensor | None, start_pos: Tensor, cu_seqlens: Tensor,
                     ratio: int) -> Tensor:
    """``score + ape[pos % ratio]`` over this step's rows (fp32, the model's unfused add);
    ``score`` itself when ``ape`` is None."""
    if ape is None:
        return score
    pos = step_positions(start_pos, cu_seqlens, score.shape[0])
    return score + ape[pos % ratio]


def check_entry_args(request: Tensor, entry: Tensor, valid: Tensor | None, norm_weight: Tensor,
                     d: int, cos: Tensor | None, sin: Tensor | None) -> None:
    """Validate the per-entry arguments of ``compress_entries`` (entries of width d)."""
    E = request.shape[0]
    if request.dim() != 1 or tuple(entry.shape) != (E,):
        raise ValueError(f"compress_entries: request and entry must be [E]; found "
                         f"{tuple(request.shape)} and {tuple(entry.shape)}")
    if valid is not None and (tuple(valid.shape) != (E,) or valid.dtype != torch.bool):
        raise ValueError(f"compress_entries: valid must be a bool [E={E}] or None; found "
                         f"{valid.dtype} {tuple(valid.shape)}")
    if tuple(norm_weight.shape) != (d,):
        raise ValueError(f"compress_entries: norm_weight must be [{d}]; found "
                         f"{tuple(norm_weight.shape)}")
    if (cos is None) != (sin is None):
        raise ValueError("compress_entries: pass both cos and sin, or neither (no RoPE)")
    if cos is not None and (cos.dim() != 2 or cos.shape[0] != E or sin.shape != cos.shape
                            or 2 * cos.shape[1] > d):
        raise ValueError(f"compress_entries: cos / sin must be [E={E}, rd/2] with rd <= {d}; "
                         f"found {tuple(cos.shape)} and {tuple(sin.shape)}")


def locate_rows(request: Tensor, pos: Tensor, start_pos: Tensor, cu_seqlens: Tensor,
                slots: Tensor, ratio: int, overlap: bool, compact: bool = False
                ) -> tuple[Tensor, Tensor, Tensor]:
    """Where the row of position ``pos`` of request ``request`` lives (same shapes in/out).

    Returns ``(from_step, step_row, state_row)``: this step's token row when ``from_step``, else
    a row of the flattened state (−1 when the position holds nothing: before the sequence, or a
    group that is no longer kept).  ``compact``: the state is the one-pseudo-row form, which
    stands at the open group's first position (the group's later positions before the step
    are empty).
    """
    r = ratio
    p0 = start_pos[request]
    from_step = pos >= p0
    step_row = cu_seqlens[request] + (pos - p0)
    g0 = torch.div(p0, r, rounding_mode="floor") * r           # first position of p0's group
    if compact:
        return from_step, step_row, torch.where((pos == g0) & ~from_step, slots[request], -1)
    base = slots[request] * ((2 if overlap else 1) * r)
    in_partial = (pos >= g0) & ~from_step
    state_row = torch.where(in_partial, base + (r if overlap else 0) + pos % r, -1)
    if overlap:
        in_prev = (pos >= g0 - r) & (pos < g0) & (pos >= 0)
        state_row = torch.where(in_prev, base + pos % r, state_row)
    return from_step, step_row, state_row


def _gather(step_rows: Tensor, state_rows: Tensor, fill: float, where: tuple[Tensor, ...]
            ) -> Tensor:
    """Rows [..., w] picked from this step's rows or the flat state; ``fill`` where empty
    (float64 when the state is: the compact form's pseudo-rows).

    A step row beyond the step (only the never-stored candidates of a static-shape step ask for
    one) is clamped into it, which keeps the read in bounds."""
    from_step, step_row, state_row = where
    a = step_rows.index_select(0, step_row.clamp(0, max(step_rows.shape[0] - 1, 0)).reshape(-1))
    b = state_rows.index_select(0, state_row.clamp_min(0).reshape(-1))
    shape = (*from_step.shape, step_rows.shape[-1])
    a, b = a.view(shape), b.view(shape)
    out = torch.where(from_step[..., None], a, b)
    empty = (~from_step & (state_row < 0))[..., None]
    return out.masked_fill(empty, fill)


def _softmax_pool(rows_kv: Tensor, rows_score: Tensor) -> Tensor:
    """Per-channel softmax over the slots (dim 1) weighting the kv rows: [e, slots, d] -> [e, d].

    Computed in float64 and rounded once to fp32: CPU kernels pick vector or scalar code (exp)
    and reduction orders by tensor shape and thread count, which would make an entry's fp32 bits
    depend on how many entries the step pools; in float64 those differences vanish in the final
    rounding, so an entry is the same whatever the split of the sequence into steps.
    """
    score = rows_score.double()
    p = torch.exp(score - score.amax(dim=1, keepdim=True))
    p = p / p.sum(dim=1, keepdim=True)
    return (p * rows_kv.double()).sum(dim=1).float()


def summarize_rows(rows_kv: Tensor, rows_score: Tensor) -> tuple[Tensor, Tensor]:
    """The compact state's pseudo-row (k*, g*) [e, d] float64 of rows [e, slots, d] (dim 1):
    ``m = max g``, ``l = Σ exp(g − m)``, ``k* = Σ exp(g − m)·k / l``, ``g* = m + log l``;
    kv 0 and score −inf where every row is empty (no −inf − (−inf) NaN)."""
    kv, score = rows_kv.double(), rows_score.double()
    m = score.amax(dim=1)
    empty = torch.isneginf(m)
    m = m.masked_fill(empty, 0.0)
    p = torch.exp(score - m[:, None])
    l = p.sum(dim=1)
    k = ((p * kv).sum(dim=1) / l).masked_fill(empty, 0.0)
    g = (m + torch.log(l)).masked_fill(empty, float("-inf"))
    return k, g


def compress_pool(kv: Tensor, score: Tensor, state_kv: Tensor, state_score: Tensor,
                  request: Tensor, entry: Tensor, start_pos: Tensor, cu_seqlens: Tensor,
                  slots: Tensor, ratio: int, overlap: bool, block_elems: int = BLOCK_ELEMS
                  ) -> Tensor:
    """The pooled entries [E, d] fp32 (before the norm) of entries ``entry`` of requests
    ``request``; reads the state, does not change it.  ``block_elems`` bounds the rows gathered
    at once (the result does not depend on it)."""
    d = check_compress_args("compress_pool", kv, score, state_kv, state_score, start_pos,
                            cu_seqlens, slots, ratio, overlap)
    r, W = ratio, kv.shape[1]
    compact = is_compact(state_kv)
    flat_kv, flat_score = state_kv.view(-1, W), state_score.view(-1, W)
    E = request.shape[0]
    pooled = kv.new_empty(E, d)
    n_slots = 2 * r if overlap else r
    step = max(1, block_elems // (n_slots * W))
    k = torch.arange(r, device=kv.device)
    for e0 in range(0, E, step):
        ent = entry[e0:e0 + step]
        cur_pos = ent[:, None] * r + k[None, :]                              # [e, r]
        req = request[e0:e0 + step, None].expand_as(cur_pos)
        if overlap:
            pos = torch.cat((cur_pos - r, cur_pos), dim=1)                    # [e, 2r]
            req = torch.cat((req, req), dim=1)
        else:
            pos = cur_pos
        where = locate_rows(req, pos, start_pos, cu_seqlens, slots, r, overlap, compact)
        rows_kv = _gather(kv, flat_kv, 0.0, where)
        rows_score = _gather(score, flat_score, float("-inf"), where)
        if overlap:
            # previous group: channels [:d]; current group: channels [d:]
            rows_kv = torch.cat((rows_kv[:, :r, :d], rows_kv[:, r:, d:]), dim=1)
            rows_score = torch.cat((rows_score[:, :r, :d], rows_score[:, r:, d:]), dim=1)
        pooled[e0:e0 + step] = _softmax_pool(rows_kv, rows_score)
    return pooled


def compress_entries(kv: Tensor, score: Tensor, state_kv: Tensor, state_score: Tensor,
                     request: Tensor, entry: Tensor, valid: Tensor | None, start_pos: Tensor,
                     cu_seqlens: Tensor, slots: Tensor, ratio: int, overlap: bool,
                     norm_weight: Tensor,
                     norm_eps: float, cos: Tensor | None, sin: Tensor | None,
                     out_dtype: torch.dtype, ape: Tensor | None = None) -> Tensor:
    """Finished entries [E, d] in ``out_dtype``: pooled (fp32) → cast to ``out_dtype`` →
    RMSNorm with ``norm_weight`` → RoPE of the last ``2·cos.shape[1]`` channels (none when
    ``cos`` is None: the V4.1 pre-RoPE latent).

    kv / score [T, W] fp32 (score with ``ape`` already, or without it and ``ape`` [r, W] fp32
    given: see the header), state_kv / state_score [slots, coff·r, W] fp32 (or the compact
    form: [slots, 1, W] float64), request / entry [E] int64 (request index, entry id in the
    request), start_pos [R], cu_seqlens [R+1], slots [R] int64; cos / sin [E, rd/2] fp32 at
    the entries' positions j·r.  ``valid`` [E] bool or None: entries marked False (the
    candidates of a static-shape step that do not complete) come out as zeros.  Call it before
    :func:`compress_update_state` of the same step (it reads the old state).
    """
    d = check_compress_args("compress_entries", kv, score, state_kv, state_score, start_pos,
                            cu_seqlens, slots, ratio, overlap)
    check_entry_args(request, entry, valid, norm_weight, d, cos, sin)
    check_ape("compress_entries", ape, score, ratio)
    score = bias_step_scores(score, ape, start_pos, cu_seqlens, ratio)
    pooled = compress_pool(kv, score, state_kv, state_score, request, entry, start_pos,
                           cu_seqlens, slots, ratio, overlap)
    out = rms_norm(pooled.to(out_dtype), norm_weight, norm_eps)
    if cos is not None:
        out = apply_rope(out, cos, sin)
    if valid is not None:
        out = torch.where(valid[:, None], out, 0.0)
    return out


def compress_update_state(kv: Tensor, score: Tensor, state_kv: Tensor, state_score: Tensor,
                          start_pos: Tensor, cu_seqlens: Tensor, slots: Tensor, ratio: int,
                          overlap: bool, ape: Tensor | None = None) -> None:
    """Keep, in every request's slot, the rows of its open group (and with overlap the last
    complete group) after this step; other rows become empty (kv 0, score −inf).  With ``ape``
    the step's rows are stored biased (``score + ape[pos % r]``), as the state always holds.
    A compact (float64) state gets the open group's pseudo-row (:func:`summarize_rows`)."""
    check_compress_args("compress_update_state", kv, score, state_kv, state_score, start_pos,
                        cu_seqlens, slots, ratio, overlap)
    check_ape("compress_update_state", ape, score, ratio)
    score = bias_step_scores(score, ape, start_pos, cu_seqlens, ratio)
    r, R, W = ratio, start_pos.shape[0], kv.shape[1]
    end = start_pos + (cu_seqlens[1:] - cu_seqlens[:-1])
    g_end = torch.div(end, r, rounding_mode="floor") * r                     # open group start
    k = torch.arange(r, device=kv.device)
    pos = g_end[:, None] + k[None, :]                                         # [R, r]
    pos = torch.where(pos < end[:, None], pos, -1)
    if overlap:
        prev = g_end[:, None] - r + k[None, :]
        pos = torch.cat((prev, pos), dim=1)                                   # [R, 2r]
    req = torch.arange(R, device=kv.device)[:, None].expand_as(pos)
    compact = is_compact(state_kv)
    where = locate_rows(req, pos, start_pos, cu_seqlens, slots, r, overlap, compact)
    new_kv = _gather(kv, state_kv.view(-1, W), 0.0, where)
    new_score = _gather(score, state_score.view(-1, W), float("-inf"), where)
    if compact:
        # The group's rows (old pseudo-row first, then this step's) become one pseudo-row.
        new_kv, new_score = (t[:, None] for t in summarize_rows(new_kv, new_score))
    state_kv.index_copy_(0, slots, new_kv)
    state_score.index_copy_(0, slots, new_score)
