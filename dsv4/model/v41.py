"""V4.1-only building blocks (spec §4.2–4.6, §4.8), as self-contained functions.

* run-time quantization sites of V4.1 attention (``numerics="official"``): window KV, compressed
  latent, index keys / queries (§4.2, §4.3, §4.5);
* indexer v2: keys from the compressed latent, queries, scores, the two-level candidate filter and
  the position-sorted top-k (§4.5);
* single-pass mHC: pre/post/comb mixes, the identity pre-mix of layer 0, the collapse with the
  previous sublayer's pre-mix, one block's stream update and the final collapse (§4.6);
* V4.1 MoE routing: ``gate_temp``, ``bias_vl`` for image tokens, ``+1e-20`` normalization (§4.8).

The attention / transformer code calls these; ``docs/V41.md`` says who calls what.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "quant_window_kv", "quant_compressed_latent", "quant_index_keys", "quant_index_queries",
    "index_keys_from_latent", "index_queries", "indexer_v2_scores", "select_candidate_blocks",
    "restrict_to_candidates", "topk_sorted",
    "identity_pre_mix", "hc_mixes", "hc_collapse", "hc_final_collapse", "single_pass_block",
    "route_v41",
]

NUMERICS = ("bf16", "official")

# Quantization formats of the V4.1 sites (spec §4.1 table, §4.3, §4.5).
WINDOW_KV_BLOCK = 32       # fp8 e4m3, power-of-two (ue8m0) scales, all head_dim channels
LATENT_BLOCK = 16          # fp4 e2m1 with e4m3 (non-power-of-two) scales
INDEX_BLOCK = 32           # fp4 e2m1 with e8m0 scales, keys and queries
# Added to the sum of the top-k routing weights before normalizing (V4.1 reference).
ROUTE_NORM_EPS = 1e-20


def _check_numerics(numerics: str) -> None:
    if numerics not in NUMERICS:
        raise ValueError(f"numerics={numerics!r} is not supported; allowed: {NUMERICS}")


def _torch_ops() -> SimpleNamespace:
    from dsv4.ops import get_ops
    return get_ops("torch")


# ------------------------------------------------------------------------ quantization sites
def quant_window_kv(kv: Tensor, numerics: str) -> Tensor:
    """Window KV after RoPE: fp8 fake quant over all channels, block 32 (official numerics)."""
    _check_numerics(numerics)
    if numerics == "bf16":
        return kv
    from dsv4.formats import fake_quant_fp8
    return fake_quant_fp8(kv, WINDOW_KV_BLOCK)


def quant_compressed_latent(latent: Tensor, numerics: str) -> Tensor:
    """Compressed latent after RoPE: fp4 e2m1, block 16, e4m3 scales (official numerics)."""
    _check_numerics(numerics)
    if numerics == "bf16":
        return latent
    from dsv4.formats import fake_quant_fp4
    return fake_quant_fp4(latent, LATENT_BLOCK, scale_dtype="e4m3")


def quant_index_keys(keys: Tensor, numerics: str) -> Tensor:
    """Index keys after RoPE: fp4 e2m1, block 32, e8m0 scales; no Hadamard (official)."""
    _check_numerics(numerics)
    if numerics == "bf16":
        return keys
    from dsv4.formats import fake_quant_fp4
    return fake_quant_fp4(keys, INDEX_BLOCK, scale_dtype="e8m0")


# The index queries use the same format as the keys.
quant_index_queries = quant_index_keys


# ------------------------------------------------------------------------ indexer v2
def index_keys_from_latent(latent: Tensor, wk: nn.Module | Tensor, k_norm: nn.Module | Tensor,
                           cos: Tensor, sin: Tensor, numerics: str, norm_eps: float = 1e-20,
                           ops: SimpleNamespace | None = None) -> Tensor:
    """Index keys of new compressed entries (spec §4.5 "Key production").

    ``latent`` [N, head_dim] is the compressor's **pre-RoPE** latent; ``wk`` the [dI, head_dim]
    projection (module or weight), ``k_norm`` the RMSNorm (module or [dI] weight, then
    ``norm_eps`` is used); ``cos``/``sin`` [N, rd/2] the rotation at positions ``j·r``.
    Returns ``k_norm(wk(latent))`` with RoPE on its last rd channels, fake-quantized in official
    numerics; [N, dI] in ``latent.dtype``.
    """
    ops = ops or _torch_ops()
    if latent.dim() != 2:
        raise ValueError(f"index_keys_from_latent: latent must be [N, head_dim]; found "
                         f"{tuple(latent.shape)}")
    k = F.linear(latent, wk.to(latent.dtype)) if isinstance(wk, Tensor) else wk(latent)
    k = ops.rms_norm(k, k_norm, norm_eps) if isinstance(k_norm, Tensor) else k_norm(k)
    k = ops.apply_rope(k, cos, sin)
    return quant_index_keys(k, numerics)


def index_queries(q_flat: Tensor, n_heads: int, head_dim: int, cos: Tensor, sin: Tensor,
                  numerics: str, ops: SimpleNamespace | None = None) -> Tensor:
    """Index queries ``[T, h, dI]`` from ``wq_b(qr)`` [T, h·dI] (spec §4.5 scoring step 1):
    RoPE on the last rd channels of every head at the token's position, then fp4 fake quant
    (block 32, e8m0) in official numerics; no Hadamard rotation."""
    ops = ops or _torch_ops()
    T = q_flat.shape[0]
    if q_flat.shape[-1] != n_heads * head_dim:
        raise ValueError(f"index_queries: expected [T, {n_heads}·{head_dim}] projections; found "
                         f"{tuple(q_flat.shape)}")
    q = ops.apply_rope(q_flat.view(T, n_heads, head_dim), cos, sin)
    return quant_index_queries(q, numerics)


def indexer_v2_scores(q: Tensor, w: Tensor, keys: Tensor, n_visible: Tensor,
                      key_rows: Tensor | None = None,
                      ops: SimpleNamespace | None = None) -> Tensor:
    """Scores ``s[t, j] = Σ_h w[t,h] · ReLU(q[t,h] · k_j)``, −inf where ``j >= n_visible[t]``.

    ``q`` [T, h, dI]; ``w`` [T, h] already scaled by ``dI^-0.5 · h^-0.5``; ``keys`` either
    per token [T, L, dI] or a flat pool [Nk, dI] addressed by ``key_rows`` [T, L] (the op
    ``indexer_scores`` of docs/ARCHITECTURE.md); ``n_visible`` [T].  Returns [T, L] fp32.
    """
    T, h, d = q.shape
    if tuple(w.shape) != (T, h):
        raise ValueError(f"indexer_v2_scores: w has shape {tuple(w.shape)}; expected [{T}, {h}]")
    if tuple(n_visible.shape) != (T,):
        raise ValueError(f"indexer_v2_scores: n_visible has shape {tuple(n_visible.shape)}; "
                         f"expected [{T}]")
    if keys.dim() == 2:
        if key_rows is None or key_rows.dim() != 2 or key_rows.shape[0] != T:
            raise ValueError("indexer_v2_scores: a flat key pool [Nk, dI] needs key_rows [T, L]")
        ops = ops or _torch_ops()
        return ops.indexer_scores(q, w, keys, key_rows, n_visible)
    if keys.dim() != 3 or keys.shape[0] != T or keys.shape[2] != d:
        raise ValueError(f"indexer_v2_scores: keys has shape {tuple(keys.shape)}; expected "
                         f"[{T}, L, {d}] or a flat pool [Nk, {d}]")
    dots = torch.einsum("thd,tld->thl", q.float(), keys.float()).relu()
    scores = torch.einsum("thl,th->tl", dots, w.float())
    entry = torch.arange(keys.shape[1], device=q.device)
    return scores.masked_fill(entry[None, :] >= n_visible[:, None], float("-inf"))


def select_candidate_blocks(scores: Tensor, n_visible: Tensor, topk_blocks: int,
                            block_size: int) -> Tensor:
    """The candidate source's position mask [T, L] bool (spec §4.5 item 5).

    Pad the entries with −inf to a multiple of ``block_size``; block score = max over the block;
    the block of the newest visible entry, ``(n_visible − 1) // block_size``, is forced to +inf
    when ``n_visible > 0``; keep the best ``min(topk_blocks, n_blocks)`` blocks (ties: lowest
    block first), drop picks scoring −inf; expand back to entries and truncate to L.
    """
    if topk_blocks <= 0 or block_size <= 0:
        raise ValueError(f"select_candidate_blocks: topk_blocks ({topk_blocks}) and block_size "
                         f"({block_size}) must be positive")
    if scores.dim() != 2 or tuple(n_visible.shape) != (scores.shape[0],):
        raise ValueError(f"select_candidate_blocks: expected scores [T, L] and n_visible [T]; "
                         f"found {tuple(scores.shape)} and {tuple(n_visible.shape)}")
    T, L = scores.shape
    if n_visible.device.type == "cpu" and T and int(n_visible.max()) > L:
        raise ValueError(f"select_candidate_blocks: n_visible reaches {int(n_visible.max())} but "
                         f"scores cover only L={L} entries")
    n_blocks = -(-L // block_size)
    padded = F.pad(scores.float(), (0, n_blocks * block_size - L), value=float("-inf"))
    block = padded.view(T, n_blocks, block_size).amax(-1)
    newest = torch.div(n_visible.long() - 1, block_size, rounding_mode="floor")
    force = (n_visible > 0)[:, None] & (torch.arange(n_blocks, device=scores.device)[None, :]
                                        == newest[:, None])
    block = block.masked_fill(force, float("inf"))
    k = min(topk_blocks, n_blocks)
    order = torch.sort(block, dim=-1, descending=True, stable=True).indices[:, :k]
    picked = torch.gather(block, 1, order) > float("-inf")
    keep = torch.zeros(T, n_blocks, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, order, picked)
    return keep.repeat_interleave(block_size, dim=1)[:, :L]


def restrict_to_candidates(scores: Tensor, candidates: Tensor) -> Tensor:
    """A candidate consumer's scores: −inf outside the published candidate mask (item 6)."""
    if scores.shape != candidates.shape:
        raise ValueError(f"restrict_to_candidates: scores {tuple(scores.shape)} and candidates "
                         f"{tuple(candidates.shape)} must have the same shape")
    return scores.masked_fill(~candidates, float("-inf"))


def topk_sorted(scores: Tensor, n_visible: Tensor, k: int,
                ops: SimpleNamespace | None = None) -> Tensor:
    """Top-``min(k, n_visible)`` entry ids per token, sorted by entry id, −1 after them
    (spec §4.5 item 7); ties go to the lowest entry id.  [T, k] int64.

    Visible entries scored −inf (outside the candidates) can still be picked when fewer than
    ``k`` entries score higher, as in the reference.
    """
    if k < 0:
        raise ValueError(f"topk_sorted: k must be >= 0, got {k}")
    ops = ops or _torch_ops()
    # Entries past n_visible never qualify, whatever the caller left in their scores.
    entry = torch.arange(scores.shape[-1], device=scores.device)
    scores = scores.masked_fill(entry[None, :] >= n_visible[:, None], float("-inf"))
    return ops.topk_indices(scores, n_visible, k)


# ------------------------------------------------------------------------ single-pass mHC
def identity_pre_mix(n_hc: int, num_tokens: int | None = None,
                     device: torch.device | str | None = None) -> Tensor:
    """The pre-mix of layer 0's attention: one-hot on stream 0, fp32, [n_hc] or [T, n_hc]."""
    if n_hc <= 0:
        raise ValueError(f"identity_pre_mix: n_hc must be positive, got {n_hc}")
    pre = torch.zeros(n_hc, dtype=torch.float32, device=device)
    pre[:1].fill_(1.0)   # a fill kernel, not a host-to-device copy: CUDA-graph capturable
    return pre if num_tokens is None else pre.expand(num_tokens, n_hc).contiguous()


def hc_mixes(x: Tensor, fn: Tensor, scale: Tensor, base: Tensor, norm_eps: float,
             hc_eps: float, iters: int) -> tuple[Tensor, Tensor, Tensor]:
    """(pre [T, n], post [T, n], comb [T, n, n]) fp32 of ``x`` [T, n, D], as V4's ``hc_pre``
    steps 1–4 compute them (the pre is returned instead of being applied)."""
    from dsv4.ops.torch_dense import sinkhorn

    if x.dim() != 3:
        raise ValueError(f"hc_mixes: x must be [T, n_hc, D]; found {tuple(x.shape)}")
    T, n, D = x.shape
    if tuple(fn.shape) != ((2 + n) * n, n * D):
        raise ValueError(f"hc_mixes: fn must be [{(2 + n) * n}, {n * D}]; found {tuple(fn.shape)}")
    flat = x.reshape(T, -1).float()
    mixes = F.linear(flat, fn.float()) * torch.rsqrt(flat.square().mean(-1, keepdim=True)
                                                     + norm_eps)
    scale, base = scale.float(), base.float()
    pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * torch.sigmoid(mixes[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = sinkhorn((mixes[:, 2 * n:] * scale[2] + base[2 * n:]).view(T, n, n), hc_eps, iters)
    return pre, post, comb


def hc_collapse(x: Tensor, pre_mix: Tensor) -> Tensor:
    """``Σ_j pre_mix_j · x_j`` in fp32, cast to x.dtype: [T, n, D] with [T, n] or [n] -> [T, D]."""
    if x.dim() != 3 or pre_mix.shape[-1] != x.shape[1] or pre_mix.dim() not in (1, 2):
        raise ValueError(f"hc_collapse: expected x [T, n, D] and pre_mix [T, n] or [n]; found "
                         f"{tuple(x.shape)} and {tuple(pre_mix.shape)}")
    return (pre_mix.float().unsqueeze(-1) * x.float()).sum(dim=-2).to(x.dtype)


def hc_final_collapse(x: Tensor, pre_mix: Tensor) -> Tensor:
    """V4.1's final collapse before ``norm`` and ``head``: the last layer's FFN pre-mix applied
    to the streams (V4.1 has no ``hc_head`` parameters)."""
    return hc_collapse(x, pre_mix)


class _Mixes:
    """Protocol of a block side's mHC parameters: ``fn``, ``scale``, ``base`` tensors."""

    fn: Tensor
    scale: Tensor
    base: Tensor


def single_pass_block(x: Tensor, pre_mix: Tensor, hc_attn: _Mixes, hc_ffn: _Mixes,
                      attn: Callable[[Tensor], Tensor], ffn: Callable[[Tensor], Tensor],
                      norm_eps: float, hc_eps: float, iters: int,
                      hc_post: Callable[..., Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """One V4.1 block on the streams (spec §4.6): returns ``(x, pre_mix for the next block)``.

    ``attn`` / ``ffn`` map the collapsed [T, D] input (before their norms: they include
    ``attn_norm`` / ``ffn_norm``) to the sublayer output [T, D].  The attention side collapses
    with the pre-mix of the previous block's FFN mixes (the identity at layer 0), the FFN side
    with the attention mixes' pre.
    """
    post_fn = hc_post or _torch_ops().hc_post
    a_pre, a_post, a_comb = hc_mixes(x, hc_attn.fn, hc_attn.scale, hc_attn.base, norm_eps,
                                     hc_eps, iters)
    x = post_fn(attn(hc_collapse(x, pre_mix)), x, a_post, a_comb)
    f_pre, f_post, f_comb = hc_mixes(x, hc_ffn.fn, hc_ffn.scale, hc_ffn.base, norm_eps,
                                     hc_eps, iters)
    x = post_fn(ffn(hc_collapse(x, a_pre)), x, f_post, f_comb)
    return x, f_pre


# ------------------------------------------------------------------------ MoE routing
def route_v41(x: Tensor, gate_w: Tensor, bias: Tensor, bias_vl: Tensor | None,
              image_mask: Tensor | None, top_k: int, route_scale: float, gate_temp: float = 1.0,
              norm_topk_prob: bool = True, ops: SimpleNamespace | None = None
              ) -> tuple[Tensor, Tensor]:
    """V4.1 routing (spec §4.8): ``(ids [T, k] int64, weights [T, k] fp32)``.

    ``s = sqrt(softplus(x·W_gateᵀ / gate_temp))`` in fp32; the top-k of ``s + bias`` (or
    ``s + bias_vl`` for tokens with ``image_mask`` True) are picked; the weights are the unbiased
    ``s`` of the picks, divided by ``Σ + 1e-20`` when ``norm_topk_prob`` and ``top_k > 1``, times
    ``route_scale``.  ``ops``: the op table whose ``linear_fp32`` runs the gate GEMM (default:
    ``F.linear``, the same fp32 GEMM).
    """
    if x.dim() != 2 or gate_w.dim() != 2 or x.shape[1] != gate_w.shape[1]:
        raise ValueError(f"route_v41: expected x [T, D] and gate_w [E, D]; found "
                         f"{tuple(x.shape)} and {tuple(gate_w.shape)}")
    E = gate_w.shape[0]
    if not 0 < top_k <= E:
        raise ValueError(f"route_v41: top_k must be in 1..{E}, got {top_k}")
    if gate_temp <= 0:
        raise ValueError(f"route_v41: gate_temp must be positive, got {gate_temp}")
    # linear_fp32 takes a bf16 gate_w as it is (exact widening inside, no per-call copy).
    logits = (F.linear(x.float(), gate_w.float()) if ops is None
              else ops.linear_fp32(x, gate_w if gate_w.dtype == torch.bfloat16
                                   else gate_w.float()))
    scores = F.softplus(logits / gate_temp).sqrt()
    sel_bias = bias.float()[None, :]
    if image_mask is not None and bias_vl is not None:
        if tuple(image_mask.shape) != (x.shape[0],):
            raise ValueError(f"route_v41: image_mask has shape {tuple(image_mask.shape)}; "
                             f"expected [{x.shape[0]}]")
        sel_bias = torch.where(image_mask.bool()[:, None], bias_vl.float()[None, :], sel_bias)
    ids = (scores + sel_bias).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob and top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + ROUTE_NORM_EPS)
    return ids, weights * route_scale
