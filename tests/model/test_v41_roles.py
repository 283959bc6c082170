"""V4.1 CSA2 roles in the full model, against hand computations from the spec (§4.3–4.5):

* Full (KV source): its pools hold RoPE(norm(pooled kv)) at j·r and keys k_norm(wk(latent));
  its indexer scores its OWN keys, also on decode steps that close no group (spec §6.13);
* Reuse: attends to its KV source's pool with its index source's top-k, verbatim;
* Reindex: its own picks over the candidate source's keys, inside the published candidate blocks;
* candidate source: the published block mask.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.model.context import StepContext
from dsv4.model.indexer import CANDIDATES_MEMO, TOPK_MEMO
from dsv4.model.layers import rope_cos_sin
from test_v41_helpers import (FULL1, FULL2, PAGE, REINDEX, REUSE1, REUSE2, REUSE_RI, S,
                              AttendRecorder, new_cache, prompt, v41_model)


pytestmark = pytest.mark.usefixtures("one_thread")


def _rope(x: torch.Tensor, positions: torch.Tensor, cfg, layer: int) -> torch.Tensor:
    """Interleaved-pair rotation of the last rd channels, written with complex numbers."""
    cos, sin = rope_cos_sin(cfg, layer, positions)
    rd = 2 * cos.shape[-1]
    f = torch.complex(cos.double(), sin.double())
    f = f.view(f.shape[0], *([1] * (x.dim() - 2)), f.shape[-1])
    tail = torch.view_as_complex(x[..., -rd:].double().unflatten(-1, (rd // 2, 2)).contiguous())
    return torch.cat((x[..., :-rd].double(), torch.view_as_real(tail * f).flatten(-2)), dim=-1)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return w.double() * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class _Capture:
    """Records, per step, the attention input x and the query latent qr of chosen layers."""

    def __init__(self, model, layers) -> None:
        self.x: dict[int, list[torch.Tensor]] = {L: [] for L in layers}
        self.qr: dict[int, list[torch.Tensor]] = {L: [] for L in layers}
        self.hooks = []
        for L in layers:
            att = model.layers[L].attn
            self.hooks.append(att.register_forward_pre_hook(
                lambda m, inp, L=L: self.x[L].append(inp[0].clone())))
            self.hooks.append(att.q_norm.register_forward_hook(
                lambda m, inp, out, L=L: self.qr[L].append(out.clone())))

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def _prefill(model, ids: torch.Tensor, layers=()):
    """One-shot step with an identity block table (flat pool row == entry id)."""
    cache = new_cache(model)
    cap = _Capture(model, layers)
    ctx = StepContext.build(ids, [len(ids)], [0], [0], [list(range(cache.num_pages))])
    try:
        with AttendRecorder(model) as rec:
            model.forward(ctx, cache)
    finally:
        cap.remove()
    return ctx, cache, cap, rec


def _hand_scores(att, x, qr, keys, positions, n_visible) -> torch.Tensor:
    """score[t, s] = Σ_h w_h ReLU(q_h · k_s) for s < n_visible[t] (−inf elsewhere), fp64."""
    cfg = att.cfg
    idx = att.indexer
    h, dI = idx.n_heads, idx.head_dim
    q = (qr.double() @ idx.wq_b.weight.double().T).view(-1, h, dI)
    q = _rope(q, positions, cfg, att.layer_id)
    w = (x.double() @ idx.weights_proj.weight.double().T) * (dI * h) ** -0.5
    s = torch.einsum("thd,sd->ths", q, keys.double()).relu()
    s = torch.einsum("ths,th->ts", s, w)
    j = torch.arange(keys.shape[0])
    return s.masked_fill(j[None, :] >= n_visible[:, None], float("-inf"))


def _picks(ids_row: torch.Tensor) -> list[int]:
    return [int(i) for i in ids_row if i >= 0]


def _check_topk_form(ids: torch.Tensor, n_visible: torch.Tensor, k: int) -> None:
    for t in range(ids.shape[0]):
        p = _picks(ids[t])
        assert len(p) == min(k, int(n_visible[t])), (t, ids[t])
        assert p == sorted(set(p)) and all(0 <= i < int(n_visible[t]) for i in p)
        assert (ids[t, len(p):] == -1).all()


def test_full_sources_store_hand_computed_entries_and_keys() -> None:
    model = v41_model("bf16")
    cfg = model.cfg
    ids = prompt(11)
    ctx, cache, cap, _ = _prefill(model, ids, (FULL2, FULL1))
    assert sorted(cache.compressed) == [FULL2, FULL1] == sorted(cache.index_keys)
    for L in (FULL2, FULL1):
        att = model.layers[L].attn
        r = cfg.ratio(L)
        comp, idx = att.compressor, att.indexer
        x = cap.x[L][0].double()
        kv = x @ comp.wkv.weight.double().T
        if r == 2:
            g = (x @ comp.wgate.weight.double().T).view(S // 2, 2, -1)
            pooled = (torch.softmax(g, dim=1) * kv.view(S // 2, 2, -1)).sum(1)
        else:
            assert not hasattr(comp, "wgate")   # ratio 1: no gate, no pooling
            pooled = kv
        latent = _rms(pooled, comp.norm.weight, cfg.norm_eps)
        pos = torch.arange(S // r) * r                                  # entry j at j·r
        entries = _rope(latent, pos, cfg, L)
        keys = _rope(_rms(latent @ idx.wk.weight.double().T, idx.k_norm.weight, cfg.norm_eps),
                     pos, cfg, L)
        n = S // r
        stored = cache.compressed[L].view(-1, cfg.head_dim)[:n]
        torch.testing.assert_close(stored.double(), entries, rtol=0, atol=2e-5)
        stored_k = cache.index_keys[L].view(-1, cfg.index_head_dim)[:n]
        torch.testing.assert_close(stored_k.double(), keys, rtol=0, atol=2e-5)
        assert cache.compressed[L].view(-1, cfg.head_dim)[n:].abs().max() == 0  # nothing more


def test_full_source_indexer_scores_its_own_keys_in_decode() -> None:
    """Decode steps of the ratio-2 source that close no group still score its own keys (spec
    §6.13), and every source's top-k equals the hand top-k (ties to the lowest entry)."""
    model = v41_model("bf16")
    cfg = model.cfg
    ids = prompt(12, 21)
    cache = new_cache(model)
    cap = _Capture(model, (FULL2, FULL1))
    pages = list(range(cache.num_pages))
    try:
        for pos in range(21):
            ctx = StepContext.build(ids[pos:pos + 1], [1], [pos], [0], [pages])
            model.forward(ctx, cache)
            for L in (FULL2, FULL1):
                r = cfg.ratio(L)
                att = model.layers[L].attn
                n_vis = torch.tensor([(pos + 1) // r])
                keys = cache.index_keys[L].view(-1, cfg.index_head_dim)[:max(1, int(n_vis))]
                scores = _hand_scores(att, cap.x[L][-1], cap.qr[L][-1], keys,
                                      torch.tensor([pos]), n_vis)
                order = sorted(range(int(n_vis)), key=lambda j: (-float(scores[0, j]), j))
                want = sorted(order[:cfg.index_topk])
                assert _picks(ctx.memo[(TOPK_MEMO, L)][0]) == want, (L, pos)
    finally:
        cap.remove()


def test_reuse_layers_attend_to_the_sources_pool_with_its_topk() -> None:
    model = v41_model("bf16")
    cfg = model.cfg
    ctx, cache, _, rec = _prefill(model, prompt(13))
    pairs = ((REUSE2, FULL2), (REUSE1, FULL1), (REUSE_RI, REINDEX))
    for reuse, src in pairs:
        assert model.layers[reuse].attn.compressor is None
        assert model.layers[reuse].attn.indexer is None
        kv_b, idx_b = rec.calls[reuse][0]
        kv_src, idx_src = rec.calls[src][0]
        assert torch.equal(idx_b, idx_src)
        pool = cache.compressed[cfg.kv_source_of(reuse)]
        assert kv_b.data_ptr() == pool.data_ptr() == kv_src.data_ptr()
    # The attended rows are exactly the published entry ids (identity block table).
    for layer in (FULL2, FULL1, REINDEX):
        ids = ctx.memo[(TOPK_MEMO, layer)]
        n_vis = (ctx.positions + 1) // cfg.ratio(layer)
        _check_topk_form(ids, n_vis, cfg.index_topk)
        assert torch.equal(rec.calls[layer][0][1].long(), ids)


def test_reindex_picks_inside_the_candidate_blocks() -> None:
    model = v41_model("bf16")
    cfg = model.cfg
    ids = prompt(14)
    ctx, cache, cap, rec = _prefill(model, ids, (FULL1, REINDEX))
    k, bs, nb = cfg.index_topk, cfg.candidate_block_size, cfg.candidate_topk_blocks
    assert cache.index_key_pool(REINDEX) is cache.index_keys[FULL1]
    assert model.layers[REINDEX].attn.compressor is None
    cand = ctx.memo[(CANDIDATES_MEMO, FULL1)]                      # [T, L] bool
    n_vis = ctx.positions + 1
    # The candidate source's mask, recomputed from its unrestricted hand scores.
    att = model.layers[FULL1].attn
    keys = cache.index_keys[FULL1].view(-1, cfg.index_head_dim)[:S]
    scores = _hand_scores(att, cap.x[FULL1][0], cap.qr[FULL1][0], keys, ctx.positions, n_vis)
    restricted_somewhere = False
    for t in range(S):
        v = int(n_vis[t])
        blocks = -(-v // bs)
        best = [max(float(scores[t, j]) for j in range(b * bs, min(v, (b + 1) * bs)))
                for b in range(blocks)]
        newest = (v - 1) // bs
        order = sorted(range(blocks), key=lambda b: (b != newest, -best[b], b))[:nb]
        want = [any(j // bs == b for b in order) for j in range(v)]
        assert cand[t, :v].tolist() == want, t        # (entries past v never qualify anyway)
        # The reindex picks: every candidate when there are at most k, else only candidates.
        picks = _picks(ctx.memo[(TOPK_MEMO, REINDEX)][t])
        c = int(cand[t, :v].sum())
        in_cand = sum(bool(cand[t, j]) for j in picks)
        assert in_cand == min(c, min(k, v)), (t, picks, cand[t, :v])
        restricted_somewhere |= c < v
    assert restricted_somewhere
    # Reindex scores with its own queries: its picks differ from the source's somewhere.
    assert not torch.equal(ctx.memo[(TOPK_MEMO, REINDEX)], ctx.memo[(TOPK_MEMO, FULL1)])
    # ... over the candidate source's pool.
    assert rec.calls[REINDEX][0][0].data_ptr() == cache.compressed[FULL1].data_ptr()


def test_a_consumer_without_its_source_in_the_step_is_an_error() -> None:
    model = v41_model("bf16")
    cache = new_cache(model)
    ctx = StepContext.build(prompt(1, 4), [4], [0], [0], [[0]])
    x = torch.zeros(4, model.cfg.dim)
    with pytest.raises(ValueError, match="reuses the top-k of layer 2"):
        model.layers[REUSE2].attn(x, ctx, cache)
    with pytest.raises(ValueError, match="candidate source layer 4 has not run"):
        model.layers[REINDEX].attn(x, ctx, cache)
    assert PAGE % 2 == 0


@pytest.mark.parametrize("numerics", ["bf16", "official"])
def test_cache_formats_follow_the_numerics(numerics) -> None:
    """"official": the window ring is on the FP8 block-32 grid (all channels), compressed entries
    on the FP4 block-16 e4m3-scale grid, index keys on the FP4 block-32 e8m0 grid, and the
    quantized GEMMs take FP8 block-32 activations; "bf16": none of it."""
    from dsv4.formats import fake_quant_fp4, fake_quant_fp8

    model = v41_model(numerics)
    cfg = model.cfg
    _, cache, _, _ = _prefill(model, prompt(15))
    official = numerics == "official"
    ring = cache.window_ring(FULL2)[0]
    entries = cache.compressed[FULL1].view(-1, cfg.head_dim)[:S]
    keys = cache.index_keys[FULL2].view(-1, cfg.index_head_dim)[:S // 2]
    for t, q in ((ring, fake_quant_fp8(ring, 32)),
                 (entries, fake_quant_fp4(entries, 16, scale_dtype="e4m3")),
                 (keys, fake_quant_fp4(keys, 32, scale_dtype="e8m0"))):
        assert torch.equal(t, q) == official
    # a coarser grid than the official one would also pass the checks above: not this one
    if official:
        assert not torch.equal(entries, fake_quant_fp4(entries, 16, scale_dtype="e8m0"))
    att = model.layers[REINDEX].attn
    for lin in (att.wq_a, att.wq_b, att.wkv, att.wo_b, att.indexer.wq_b,
                model.layers[1].engram.wkv, model.layers[0].ffn.shared_experts.w1):
        assert lin.block == 32 and lin.quantizes_input == official
    assert not att.wo_a.quantizes_input and not att.indexer.weights_proj.quantizes_input
    assert model.layers[0].ffn.experts.act_block == (32 if official else None)
