"""V4.1 indexer v2 helpers and quantization sites (spec §4.2, §4.3, §4.5), by hand."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dsv4.model.v41 import (index_keys_from_latent, index_queries, indexer_v2_scores,
                            quant_compressed_latent, quant_index_keys, quant_window_kv,
                            restrict_to_candidates, select_candidate_blocks, topk_sorted)

NEG = float("-inf")


# ------------------------------------------------------------------ quantization sites
def test_bf16_numerics_leave_tensors_alone() -> None:
    x = torch.randn(3, 64)
    for f in (quant_window_kv, quant_compressed_latent, quant_index_keys):
        assert f(x, "bf16") is x
    with pytest.raises(ValueError, match="numerics"):
        quant_window_kv(x, "fp8")


def test_window_kv_fp8_block_32() -> None:
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1] = 1792.0, 1.0   # block 0: s = 4
    x[0, 40] = 0.01                  # alone in block 1: s = 2^-15, 327.68 -> e4m3 320
    y = quant_window_kv(x, "official")
    assert y[0, 0] == 1792.0 and y[0, 1] == 1.0
    assert y[0, 40] == 320 * 2.0 ** -15  # a block of 64 would give 0.0078125


def test_compressed_latent_fp4_block_16_e4m3_scales() -> None:
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 1.0, 0.5      # s = e4m3(1/6) = 0.171875; 5.82 -> 6, 2.91 -> 3
    x[0, 16] = 0.1                   # own block: s = e4m3(0.1/6) = 0.017578125; 5.69 -> 6
    y = quant_compressed_latent(x, "official")
    assert y[0, 0] == 6 * 0.171875 and y[0, 1] == 3 * 0.171875
    assert y[0, 16] == 6 * 0.017578125  # a block of 32 would give 0.5 * 0.171875


def test_index_keys_fp4_block_32_e8m0() -> None:
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1] = 1.0, 0.3      # s = 2^ceil(log2(1/6)) = 1/4; 4 -> 4, 1.2 -> 1
    x[0, 32] = 0.01                  # own block: s = 2^-9; 5.12 -> 6
    y = quant_index_keys(x, "official")
    assert y[0, 0] == 1.0 and y[0, 1] == 0.25 and y[0, 32] == 6 * 2.0 ** -9


# ------------------------------------------------------------------ keys and queries
def test_index_keys_from_latent_by_hand() -> None:
    latent = torch.tensor([[1.0, 1.0, 1.0, 1.0], [2.0, 0.0, 0.0, 0.0]])
    wk = torch.eye(4)
    k_norm = torch.ones(4)
    cos = torch.tensor([[0.0], [1.0]])  # token 0 rotated by 90°, token 1 not at all
    sin = torch.tensor([[1.0], [0.0]])
    k = index_keys_from_latent(latent, wk, k_norm, cos, sin, "bf16")
    # rms of row 1 is 1: [2, 0, 0, 0] -> [2, 0, 0, 0]; row 0: pair (1, 1) -> (-1, 1)
    assert k.tolist() == [[1.0, 1.0, -1.0, 1.0], [2.0, 0.0, 0.0, 0.0]]
    # module forms give the same keys
    lin = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        lin.weight.copy_(wk * 3)   # a scale the norm removes
    norm = lambda t: t * torch.rsqrt(t.square().mean(-1, keepdim=True))  # noqa: E731
    assert torch.allclose(index_keys_from_latent(latent, lin, norm, cos, sin, "bf16"), k)
    # official numerics quantize the rotated keys (block 32: pad the width)
    wide = torch.randn(3, 8)
    wk8 = torch.randn(32, 8)
    c, s = torch.ones(3, 4), torch.zeros(3, 4)
    kq = index_keys_from_latent(wide, wk8, torch.ones(32), c, s, "official")
    kb = index_keys_from_latent(wide, wk8, torch.ones(32), c, s, "bf16")
    assert torch.equal(kq, quant_index_keys(kb, "official")) and not torch.equal(kq, kb)


def test_index_queries_rotate_each_head_tail() -> None:
    q = torch.arange(8, dtype=torch.float32).view(1, 8)  # 2 heads of 4
    cos, sin = torch.tensor([[0.0]]), torch.tensor([[1.0]])
    out = index_queries(q, 2, 4, cos, sin, "bf16")
    # (a, b) -> (-b, a) on the last pair of every head
    assert out.tolist() == [[[0.0, 1.0, -3.0, 2.0], [4.0, 5.0, -7.0, 6.0]]]
    with pytest.raises(ValueError, match="index_queries"):
        index_queries(q, 3, 4, cos, sin, "bf16")


# ------------------------------------------------------------------ scores
def test_scores_by_hand() -> None:
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])             # T=1, h=2, d=2
    w = torch.tensor([[0.5, 2.0]])
    keys = torch.tensor([[[1.0, 1.0], [-1.0, 2.0], [3.0, -1.0], [9.0, 9.0]]])
    s = indexer_v2_scores(q, w, keys, torch.tensor([3]))
    # entry 0: .5*1 + 2*1; entry 1: .5*relu(-1) + 2*2; entry 2: .5*3 + 2*relu(-1); entry 3 hidden
    assert s.tolist() == [[2.5, 4.0, 1.5, NEG]]


def test_flat_pool_form_equals_per_token_form() -> None:
    g = torch.Generator().manual_seed(0)
    T, h, d, L = 3, 4, 8, 5
    q, w = torch.randn(T, h, d, generator=g), torch.rand(T, h, generator=g)
    pool = torch.randn(20, d, generator=g)
    rows = torch.randint(0, 20, (T, L), generator=g)
    n_vis = torch.tensor([5, 2, 0])
    flat = indexer_v2_scores(q, w, pool, n_vis, key_rows=rows)
    dense = indexer_v2_scores(q, w, pool[rows], n_vis)
    torch.testing.assert_close(flat, dense)
    assert torch.isinf(dense[2]).all() and torch.isfinite(dense[0]).all()
    with pytest.raises(ValueError, match="key_rows"):
        indexer_v2_scores(q, w, pool, n_vis)


# ------------------------------------------------------------------ candidates and top-k
def test_candidate_blocks_by_hand() -> None:
    r = [0.1, 0.9, 0.3, 0.2, 0.8, 0.05, 0.4]
    scores = torch.tensor([
        r,                                     # blocks .9 .3 .8 .4(newest, forced)
        [0.5, 0.7, 0.2, NEG, NEG, NEG, NEG],   # 3 visible: newest block 1 forced, then block 0
        [0.3, NEG, NEG, NEG, NEG, NEG, NEG],   # 1 visible: block 0 forced; next pick is -inf
        [NEG] * 7,                             # nothing visible: nothing kept
        [0.5] * 7,                             # ties: the lowest block wins
    ])
    n_vis = torch.tensor([7, 3, 1, 0, 7])
    mask = select_candidate_blocks(scores, n_vis, topk_blocks=2, block_size=2)
    assert mask.int().tolist() == [
        [1, 1, 0, 0, 0, 0, 1],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 1],
    ]
    # more blocks allowed than exist: every block with a finite score, and the newest
    many = select_candidate_blocks(scores, n_vis, topk_blocks=10, block_size=2)
    assert many.int().tolist()[0] == [1] * 7 and many.int().tolist()[1] == [1, 1, 1, 1, 0, 0, 0]
    # the newest block is kept even when it scores worst
    low = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -9.0]])
    assert select_candidate_blocks(low, torch.tensor([7]), 1, 2).int().tolist() == \
        [[0, 0, 0, 0, 0, 0, 1]]


def test_candidate_blocks_errors() -> None:
    s = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="topk_blocks"):
        select_candidate_blocks(s, torch.tensor([4]), 0, 2)
    with pytest.raises(ValueError, match="n_visible"):
        select_candidate_blocks(s, torch.tensor([5]), 1, 2)


def test_restricted_topk_by_hand() -> None:
    scores = torch.tensor([[0.1, 0.9, 0.3, 0.2, 0.8, 0.05, 0.4]])
    cand = torch.tensor([[1, 1, 0, 0, 0, 0, 1]], dtype=torch.bool)
    restricted = restrict_to_candidates(scores, cand)
    assert torch.equal(restricted, torch.tensor([[0.1, 0.9, NEG, NEG, NEG, NEG, 0.4]]))
    seven = torch.tensor([7])
    assert topk_sorted(restricted, seven, 2).tolist() == [[1, 6]]
    # fewer candidates than k: visible non-candidates fill up, lowest entry id first
    assert topk_sorted(restricted, seven, 4).tolist() == [[0, 1, 2, 6]]
    assert topk_sorted(scores, seven, 3).tolist() == [[1, 4, 6]]
    assert topk_sorted(scores, torch.tensor([2]), 4).tolist() == [[0, 1, -1, -1]]
    assert topk_sorted(torch.tensor([[0.0, 0.0, 0.0]]), torch.tensor([3]), 2).tolist() == [[0, 1]]
    with pytest.raises(ValueError, match="restrict_to_candidates"):
        restrict_to_candidates(scores, cand[:, :3])


def test_candidate_pipeline_matches_bruteforce() -> None:
    """Random rows: the mask is the union of the chosen blocks, found by brute force."""
    g = torch.Generator().manual_seed(3)
    T, L, bs, kb = 6, 23, 4, 3
    n_vis = torch.tensor([23, 1, 0, 9, 16, 17])
    scores = torch.randn(T, L, generator=g)
    scores = scores.masked_fill(torch.arange(L)[None] >= n_vis[:, None], NEG)
    mask = select_candidate_blocks(scores, n_vis, kb, bs)
    for t in range(T):
        n = int(n_vis[t])
        blocks = [max(scores[t, b * bs:(b + 1) * bs].tolist() + [NEG]) for b in range(math.ceil(L / bs))]
        if n > 0:
            blocks[(n - 1) // bs] = math.inf
        order = sorted(range(len(blocks)), key=lambda b: (-blocks[b], b))[:kb]
        keep = {b for b in order if blocks[b] > NEG}
        assert mask[t].tolist() == [j // bs in keep for j in range(L)]
