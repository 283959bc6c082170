"""Torch twins of the attention-side hot ops (the oracle for the Triton kernels; used on CPU).

Signatures follow docs/ARCHITECTURE.md; a Triton kernel of the same name must accept the same
arguments and return the same shapes/dtypes.  Math is fp32 inside, vectorized over tokens; the
big ops work through blocks of tokens so that their temporaries stay bounded.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["rms_norm", "apply_rope", "sparse_attn", "indexer_scores", "topk_indices"]

# Temporaries of the blocked ops stay near this many fp32 elements.
_BLOCK_ELEMS = 1 << 24
# The reference sparse-attention kernel walks its index list in blocks of 64 (online softmax).
_ATTN_BLOCK = 64
# The index lists are padded with masked columns to a multiple of this: CPU kernels round a
# column's GEMM result, or a row's sum, differently when it falls in a narrow tail (panel or
# vector remainder), so without the pad a token's result would depend on how many masked
# columns its step carries.  With it (and the float64 q·k of sparse_attn) trailing masked
# columns change no bit: a static-shape (CUDA-graph) decode step, whose lists are padded to
# engine constants, gives the dynamic step's exact result (tests/model/test_static_shapes.py).
_COL_PAD = 64


def _pad_cols(n: int) -> int:
    return -(-n // _COL_PAD) * _COL_PAD


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """``weight · x · rsqrt(mean(x²) + eps)`` over the last dim, fp32 math, x.dtype out.

    x [..., d]; weight [d] (fp32) or None for an unweighted norm.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False,
               inplace: bool = False) -> Tensor:
    """Rotate the last ``2·cos.shape[-1]`` channels of x by interleaved pairs (GPT-J style).

    x [T, ..., d]; cos, sin [T, rd/2] fp32.  Pair i = channels (2i, 2i+1) of the tail is the
    complex number a + ib, multiplied by (cos + i·sin) (the conjugate when ``inverse``).  Math in
    fp32, result in x.dtype; the leading "nope" channels are returned unchanged.  Returns a new
    tensor, or (``inplace``) x with its tail rotated (only the tail is written).
    """
    half = cos.shape[-1]
    rd = 2 * half
    if x.shape[-1] < rd or x.shape[0] != cos.shape[0]:
        raise ValueError(f"apply_rope: x of shape {tuple(x.shape)} does not fit cos/sin of shape "
                         f"{tuple(cos.shape)} (need x[0] == T and x[-1] >= {rd})")
    view = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c = cos.reshape(view)
    s = sin.reshape(view)
    if inverse:
        s = -s
    tail = x[..., -rd:].float().unflatten(-1, (half, 2))
    a, b = tail[..., 0], tail[..., 1]
    rot = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).to(x.dtype)
    if inplace:
        x[..., -rd:] = rot
        return x
    return torch.cat((x[..., :-rd], rot), dim=-1)


def _gather_rows(kv: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """rows [t, K, d] fp32 of kv at idx [t, K] (−1 → zero row) and the validity mask."""
    valid = idx >= 0
    rows = kv.index_select(0, idx.clamp_min(0).reshape(-1).long()).float()
    return rows.view(*idx.shape, kv.shape[-1]), valid


def sparse_attn(q: Tensor, kv_a: Tensor, idx_a: Tensor, kv_b: Tensor | None,
                idx_b: Tensor | None, sink: Tensor, scale: float,
                p_dtype: torch.dtype | None = None,
                rope_out: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Attention of each token over selected rows of one or two KV sources, with a sink.

    q [T, H, d]; kv_a [Na, d] with idx_a [T, Ka] int rows (−1 = skip); kv_b [Nb, d] with
    idx_b [T, Kb] the same for a second source (both None when absent); sink [H] fp32.
    K = V (one shared KV head).  Logits ``z = (q·kv)·scale``; one softmax over both sources
    with ``exp(sink[h])`` added to the denominator only:  ``o = Σ_i p_i kv_i``.
    fp32 math; returns o [T, H, d] in q.dtype.

    ``p_dtype`` (official numerics): emulate the reference kernel, which walks the concatenated
    index list in blocks of 64 with an online softmax and rounds the probabilities to
    ``p_dtype`` (bf16) before the P·V product (fp32 accumulation).

    ``rope_out`` (cos, sin) [T, rd/2]: the output's inverse RoPE (spec §3.6 item 6) too, i.e.
    ``apply_rope(o, cos, sin, inverse=True)`` of the returned o.
    """
    if rope_out is not None:
        o = sparse_attn(q, kv_a, idx_a, kv_b, idx_b, sink, scale, p_dtype)
        return apply_rope(o, rope_out[0], rope_out[1], inverse=True)
    T, H, d = q.shape
    if idx_a.shape[0] != T or (idx_b is not None and idx_b.shape[0] != T):
        raise ValueError(f"sparse_attn: index lists must have T={T} rows; got idx_a "
                         f"{tuple(idx_a.shape)}, idx_b "
                         f"{None if idx_b is None else tuple(idx_b.shape)}")
    if (kv_b is None) != (idx_b is None):
        raise ValueError("sparse_attn: kv_b and idx_b must both be given or both be None")
    K = idx_a.shape[1] + (0 if idx_b is None else idx_b.shape[1])
    out = torch.empty(T, H, d, dtype=q.dtype, device=q.device)
    step = max(1, _BLOCK_ELEMS // max(1, K * (d + H)))
    sink_f = sink.float()
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        rows, valid = _gather_rows(kv_a, idx_a[t0:t1])
        if kv_b is not None:
            rows_b, valid_b = _gather_rows(kv_b, idx_b[t0:t1])
            rows = torch.cat((rows, rows_b), dim=1)
            valid = torch.cat((valid, valid_b), dim=1)
        if rows.shape[1] % _COL_PAD:
            extra = _pad_cols(rows.shape[1]) - rows.shape[1]
            rows = torch.cat((rows, rows.new_zeros(t1 - t0, extra, d)), dim=1)
            valid = torch.cat((valid, valid.new_zeros(t1 - t0, extra)), dim=1)
        # q·k in float64 (exact products, one rounding): a column's score does not depend on
        # how many columns the GEMM holds.
        z = torch.einsum("thd,tkd->thk", q[t0:t1].double(), rows.double()).float() * scale
        z = z.masked_fill(~valid[:, None, :], float("-inf"))
        if p_dtype is None:
            out[t0:t1] = _softmax_sink_pv(z, rows, sink_f).to(q.dtype)
        else:
            out[t0:t1] = _online_softmax_sink_pv(z, rows, sink_f, p_dtype).to(q.dtype)
    return out


def _softmax_sink_pv(z: Tensor, rows: Tensor, sink: Tensor) -> Tensor:
    """Exact softmax-with-sink then P·V, fp32.  z [t, H, K], rows [t, K, d]."""
    m = torch.maximum(z.amax(dim=-1), sink[None, :])             # [t, H], finite via the sink
    p = torch.exp(z - m[..., None])
    denom = p.sum(dim=-1) + torch.exp(sink[None, :] - m)
    return torch.einsum("thk,tkd->thd", p, rows) / denom[..., None]


def _online_softmax_sink_pv(z: Tensor, rows: Tensor, sink: Tensor, p_dtype: torch.dtype) -> Tensor:
    """The reference kernel's blocked online softmax with P rounded to ``p_dtype``."""
    t, H, K = z.shape
    acc = torch.zeros(t, H, rows.shape[-1], dtype=torch.float32, device=z.device)
    run_max = torch.full((t, H), float("-inf"), dtype=torch.float32, device=z.device)
    run_sum = torch.zeros(t, H, dtype=torch.float32, device=z.device)
    for k0 in range(0, K, _ATTN_BLOCK):
        zb = z[..., k0:k0 + _ATTN_BLOCK]
        new_max = torch.maximum(run_max, zb.amax(dim=-1))
        # A still-empty row (max −inf) keeps zero state: avoid exp(−inf − (−inf)) = NaN.
        safe = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
        rescale = torch.exp(run_max - safe)
        p = torch.exp(zb - safe[..., None])
        run_sum = run_sum * rescale + p.sum(dim=-1)
        acc = acc * rescale[..., None] + torch.einsum(
            "thk,tkd->thd", p.to(p_dtype).float(), rows[:, k0:k0 + _ATTN_BLOCK])
        run_max = new_max
    safe = torch.where(torch.isfinite(run_max), run_max, torch.zeros_like(run_max))
    run_sum = run_sum + torch.exp(sink[None, :] - safe)
    return acc / run_sum[..., None]


def indexer_scores(q: Tensor, w: Tensor, keys: Tensor, key_rows: Tensor,
                   n_visible: Tensor) -> Tensor:
    """Lightning-indexer scores ``s[t, j] = Σ_h w[t,h] · ReLU(q[t,h] · keys[key_rows[t,j]])``.

    q [T, h, dI]; w [T, h] fp32 (already scaled); keys [Nk, dI] (a flat key pool);
    key_rows [T, L] int64 rows of ``keys`` holding entries 0..L−1 of the token's request (any
    value where the entry does not exist); n_visible [T] int64.  Returns [T, L] fp32 with −inf
    where ``j >= n_visible[t]``.
    """
    T, h, dI = q.shape
    L = key_rows.shape[1]
    out = torch.full((T, L), float("-inf"), dtype=torch.float32, device=q.device)
    if L == 0 or T == 0:
        return out
    Lp = _pad_cols(L)   # masked pad columns: see _COL_PAD
    step = max(1, _BLOCK_ELEMS // max(1, Lp * (h + dI)))
    entry = torch.arange(Lp, device=q.device)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        rows = key_rows[t0:t1]
        if Lp > L:
            rows = torch.cat((rows, rows.new_zeros(t1 - t0, Lp - L)), dim=1)
        visible = entry[None, :] < n_visible[t0:t1, None]
        k = keys.index_select(0, torch.where(visible, rows, 0).reshape(-1).long()).float()
        k = k.view(t1 - t0, Lp, dI)
        dots = torch.einsum("thd,tld->thl", q[t0:t1].float(), k).relu_()
        s = torch.einsum("thl,th->tl", dots, w[t0:t1].float())
        out[t0:t1] = s.masked_fill(~visible, float("-inf"))[:, :L]
    return out


def topk_indices(scores: Tensor, n_visible: Tensor, k: int) -> Tensor:
    """The ``min(k, n_visible[t])`` best entries of each row, as entry ids in ascending order.

    scores [T, L] fp32; n_visible [T].  Ties are broken by the lowest entry id (a stable sort),
    so the choice does not depend on how the batch was split.  Returns [T, k] int64 with the
    picks first (ascending entry id) and −1 after them.
    """
    T, L = scores.shape
    if k == 0 or L == 0:
        return torch.full((T, k), -1, dtype=torch.int64, device=scores.device)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    kk = order.shape[1]
    # Column c is dropped when c >= min(k, n_visible) (c < kk <= k: the k bound never drops).
    drop = torch.arange(kk, device=scores.device)[None, :] >= n_visible[:, None]
    # Sort the kept ids ascending (dropped ones pushed past the end) then blank them; in-place
    # fills, so that a decode step launches few kernels.
    big = torch.iinfo(torch.int64).max
    picked = torch.sort(order.masked_fill(drop, big), dim=-1).values
    picked = picked.masked_fill_(picked == big, -1)
    if kk == k:
        return picked
    out = torch.full((T, k), -1, dtype=torch.int64, device=scores.device)
    out[:, :kk] = picked
    return out
