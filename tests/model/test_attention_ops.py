"""The torch attention ops against direct formulas: sparse attention with a sink, indexer
scores, top-k selection."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.ops.torch_attn import indexer_scores, sparse_attn, topk_indices


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _dense_reference(q, kv_a, idx_a, kv_b, idx_b, sink, scale):
    """Per token and head: a masked softmax over the union of selected rows plus a sink column
    whose value is zero, written with float64 and Python-side index handling."""
    T, H, d = q.shape
    out = torch.zeros(T, H, d, dtype=torch.float64)
    for t in range(T):
        rows = [kv_a[i] for i in idx_a[t].tolist() if i >= 0]
        if kv_b is not None:
            rows += [kv_b[i] for i in idx_b[t].tolist() if i >= 0]
        K = torch.stack(rows).double() if rows else torch.zeros(0, d, dtype=torch.float64)
        for h in range(H):
            logits = torch.cat([K @ q[t, h].double() * scale, sink[h:h + 1].double()])
            p = torch.softmax(logits, 0)[:-1]
            out[t, h] = p @ K
    return out


def _case(seed: int, T=9, H=3, d=16, Na=20, Nb=11, Ka=6, Kb=5):
    g = _gen(seed)
    q = torch.randn(T, H, d, generator=g)
    kv_a = torch.randn(Na, d, generator=g)
    kv_b = torch.randn(Nb, d, generator=g)
    idx_a = torch.randint(0, Na, (T, Ka), generator=g, dtype=torch.int64).to(torch.int32)
    idx_b = torch.randint(0, Nb, (T, Kb), generator=g, dtype=torch.int64).to(torch.int32)
    idx_a[torch.rand(T, Ka, generator=g) < 0.3] = -1
    idx_b[torch.rand(T, Kb, generator=g) < 0.3] = -1
    idx_a[0] = -1          # a token that only sees the second source
    idx_b[1] = -1          # and one that only sees the first
    sink = torch.randn(H, generator=g)
    return q, kv_a, idx_a, kv_b, idx_b, sink, d ** -0.5


def test_sparse_attn_matches_dense_softmax_with_sink() -> None:
    args = _case(0)
    ref = _dense_reference(*args)
    out = sparse_attn(*args)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)


def test_sparse_attn_single_source_and_sink_only() -> None:
    q, kv_a, idx_a, _, _, sink, scale = _case(1)
    ref = _dense_reference(q, kv_a, idx_a, None, None, sink, scale)
    torch.testing.assert_close(sparse_attn(q, kv_a, idx_a, None, None, sink, scale).double(),
                               ref, rtol=0, atol=1e-5)
    # a token that selects nothing attends only to the sink: zero output, no NaN
    idx_none = torch.full_like(idx_a, -1)
    out = sparse_attn(q, kv_a, idx_none, None, None, sink, scale)
    assert torch.equal(out, torch.zeros_like(out))


def test_sparse_attn_sink_lowers_the_weights() -> None:
    q, kv_a, idx_a, _, _, sink, scale = _case(2)
    big = sparse_attn(q, kv_a, idx_a, None, None, sink + 30.0, scale)
    assert big.abs().max() < 1e-6  # a huge sink takes all the probability mass


def test_sparse_attn_online_blocks_equal_exact_softmax() -> None:
    """The blocked online-softmax emulation (used in official numerics) with fp32 P is the
    same math; with bf16 P it stays within bf16 rounding."""
    args = _case(3, T=5, Ka=150, Kb=70, Na=300, Nb=100)
    exact = sparse_attn(*args)
    blocked = sparse_attn(*args, p_dtype=torch.float32)
    torch.testing.assert_close(blocked, exact, rtol=0, atol=2e-6)
    coarse = sparse_attn(*args, p_dtype=torch.bfloat16)
    err = (coarse - exact).abs().max().item()
    assert 0 < err < 2e-2


def test_sparse_attn_bf16_inputs() -> None:
    q, kv_a, idx_a, kv_b, idx_b, sink, scale = _case(4)
    out = sparse_attn(q.bfloat16(), kv_a.bfloat16(), idx_a, kv_b.bfloat16(), idx_b, sink, scale)
    assert out.dtype == torch.bfloat16
    ref = _dense_reference(q.bfloat16().float(), kv_a.bfloat16().float(), idx_a,
                           kv_b.bfloat16().float(), idx_b, sink, scale)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-2)


def test_sparse_attn_rejects_mismatched_sources() -> None:
    q, kv_a, idx_a, kv_b, idx_b, sink, scale = _case(5)
    with pytest.raises(ValueError, match="kv_b and idx_b"):
        sparse_attn(q, kv_a, idx_a, kv_b, None, sink, scale)
    with pytest.raises(ValueError, match="T="):
        sparse_attn(q, kv_a, idx_a[:-1], None, None, sink, scale)


def test_indexer_scores_match_formula() -> None:
    g = _gen(6)
    T, h, dI, Nk, L = 7, 4, 8, 30, 6
    q = torch.randn(T, h, dI, generator=g)
    w = torch.randn(T, h, generator=g)
    keys = torch.randn(Nk, dI, generator=g)
    key_rows = torch.randint(0, Nk, (T, L), generator=g)
    n_visible = torch.tensor([0, 1, 3, 6, 6, 2, 5])
    key_rows[0] = -1  # rows past n_visible may hold anything (here invalid ids)
    s = indexer_scores(q, w, keys, key_rows, n_visible)
    assert s.shape == (T, L) and s.dtype == torch.float32
    for t in range(T):
        for j in range(L):
            if j >= n_visible[t]:
                assert s[t, j] == float("-inf")
            else:
                k = keys[key_rows[t, j]]
                want = sum(w[t, hh] * torch.relu(q[t, hh] @ k) for hh in range(h))
                assert math.isclose(s[t, j].item(), want.item(), rel_tol=1e-5, abs_tol=1e-5)


def test_topk_indices_picks_best_ascending_with_padding() -> None:
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.7, float("-inf")],
                           [3.0, 2.0, 1.0, 0.0, -1.0],
                           [1.0, 2.0, float("-inf"), float("-inf"), float("-inf")]])
    n_visible = torch.tensor([4, 5, 2])
    out = topk_indices(scores, n_visible, 3)
    assert out.dtype == torch.int64
    assert out.tolist() == [[1, 2, 3], [0, 1, 2], [0, 1, -1]]


def test_topk_indices_ties_break_to_lowest_entry() -> None:
    # exact-zero scores (ReLU) tie at the cutoff: the lowest entry ids win
    scores = torch.tensor([[0.0, 5.0, 0.0, 0.0, 0.0, 0.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    out = topk_indices(scores, torch.tensor([6, 6]), 3)
    assert out.tolist() == [[0, 1, 2], [0, 1, 2]]
    # the same row as part of a wider batch gives the same picks
    wide = torch.cat([scores, torch.rand(5, 6)])
    assert topk_indices(wide, torch.full((7,), 6), 3)[:2].tolist() == out.tolist()


def test_topk_indices_k_larger_than_entries() -> None:
    scores = torch.tensor([[2.0, 1.0]])
    assert topk_indices(scores, torch.tensor([2]), 4).tolist() == [[0, 1, -1, -1]]
    assert topk_indices(scores, torch.tensor([0]), 2).tolist() == [[-1, -1]]
    assert topk_indices(torch.zeros(3, 0), torch.zeros(3, dtype=torch.long), 2).tolist() == \
        [[-1, -1]] * 3
