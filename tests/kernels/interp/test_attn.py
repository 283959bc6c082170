"""Triton attention kernels (sparse attention with sink, indexer scores) against their torch
twins, in the Triton interpreter (TRITON_INTERPRET=1; see tests/kernels/test_interpreter.py)."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by conftest
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)

from dsv4.ops import torch_attn as ref  # noqa: E402
from dsv4.ops import triton_attn as tri  # noqa: E402
from interp_helpers import random_indices, rel_err  # noqa: E402


@pytest.mark.parametrize("two_sources", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attn_matches_twin(two_sources: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(int(two_sources) * 2 + (dtype == torch.bfloat16))
    T, H, d = 3, 20, 48  # H not a multiple of the 16-head block, d not a power of two
    q = torch.randn(T, H, d, generator=gen).to(dtype)
    kv_a = torch.randn(37, d, generator=gen).to(dtype)
    idx_a = random_indices(T, 70, 37, gen, 0.3)  # 70: a partial second block of 64
    idx_a[0] = -1  # a token with nothing in source a
    kv_b = idx_b = None
    if two_sources:
        kv_b = torch.randn(11, d, generator=gen).to(dtype)
        idx_b = random_indices(T, 9, 11, gen, 0.2).long()
    sink = torch.randn(H, generator=gen)
    scale = d ** -0.5
    o = tri.sparse_attn(q, kv_a, idx_a, kv_b, idx_b, sink, scale)
    assert o.shape == (T, H, d) and o.dtype == dtype
    assert torch.isfinite(o.float()).all()
    if dtype == torch.float32:
        assert rel_err(o, ref.sparse_attn(q, kv_a, idx_a, kv_b, idx_b, sink, scale)) < 1e-5
        # official numerics: P rounded to bf16 before P·V, as the reference kernel.
        o_p = tri.sparse_attn(q, kv_a, idx_a, kv_b, idx_b, sink, scale, p_dtype=torch.bfloat16)
        o_pr = ref.sparse_attn(q, kv_a, idx_a, kv_b, idx_b, sink, scale, p_dtype=torch.bfloat16)
        assert rel_err(o_p, o_pr) < 3e-3
    else:
        o_r = ref.sparse_attn(q, kv_a, idx_a, kv_b, idx_b, sink, scale, p_dtype=torch.bfloat16)
        assert rel_err(o.float(), o_r.float()) < 3e-3


def test_sparse_attn_sink_only_and_errors() -> None:
    # No valid index at all: the output is 0 (the sink takes the whole mass, V is empty).
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 16, 32, generator=gen)
    kv = torch.randn(4, 32, generator=gen)
    idx = torch.full((2, 8), -1, dtype=torch.int32)
    o = tri.sparse_attn(q, kv, idx, None, None, torch.zeros(16), 0.1)
    assert torch.equal(o, torch.zeros_like(o))
    with pytest.raises(ValueError, match="sink"):
        tri.sparse_attn(q, kv, idx, None, None, torch.zeros(3), 0.1)
    with pytest.raises(ValueError, match="both"):
        tri.sparse_attn(q, kv, idx, kv, None, torch.zeros(16), 0.1)
    with pytest.raises(ValueError, match="kv_a"):
        tri.sparse_attn(q, kv[:, :16], idx, None, None, torch.zeros(16), 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_scores_matches_twin(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    T, h, dI, Nk, L = 4, 8, 32, 50, 150
    q = torch.randn(T, h, dI, generator=gen).to(dtype)
    w = torch.randn(T, h, generator=gen)
    keys = torch.randn(Nk, dI, generator=gen).to(dtype)
    rows = torch.randint(0, Nk, (T, L), generator=gen)
    n_vis = torch.tensor([0, 1, 70, 150])
    rows[1, 1:] = 10 ** 9  # rows past n_visible may hold anything: must not be read
    s = tri.indexer_scores(q, w, keys, rows, n_vis)
    s_ref = ref.indexer_scores(q, w, keys, rows, n_vis)
    assert s.shape == (T, L) and s.dtype == torch.float32
    vis = torch.arange(L)[None, :] < n_vis[:, None]
    assert torch.equal(torch.isinf(s), ~vis) and bool((s[~vis] < 0).all())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(s[vis], s_ref[vis]) < tol


@pytest.mark.parametrize("cfg", [
    tri.AttnConfig(BH=16, BN=16, split_kv=3),          # split-KV + combine (S not a power of 2)
    tri.AttnConfig(BH=32, BN=16, dv=32),                # value columns split across programs
    tri.AttnConfig(BH=16, BN=32, split_kv=4, dv=16),    # both
    tri.AttnConfig(BH=64, BN=64, num_warps=8, num_stages=2),  # bf16-row prefill plan
])
def test_sparse_attn_plans_agree(cfg: tri.AttnConfig) -> None:
    gen = torch.Generator().manual_seed(cfg.split_kv * 10 + cfg.dv)
    T, H, d = 2, 20, 48
    q = torch.randn(T, H, d, generator=gen)
    kv_a = torch.randn(30, d, generator=gen)
    kv_b = torch.randn(25, d, generator=gen)
    idx_a = random_indices(T, 40, 30, gen, 0.25)
    idx_b = random_indices(T, 7, 25, gen, 0.25)
    idx_a[1, :] = -1  # token 1: all of source a (and so some slices) empty
    sink = torch.randn(H, generator=gen)
    o = tri.sparse_attn_with_config(q, kv_a, idx_a, kv_b, idx_b, sink, 0.2, None, cfg)
    o_ref = ref.sparse_attn(q, kv_a, idx_a, kv_b, idx_b, sink, 0.2)
    assert torch.isfinite(o).all()
    assert rel_err(o, o_ref) < 1e-5
    ob = tri.sparse_attn_with_config(q.bfloat16(), kv_a.bfloat16(), idx_a, kv_b.bfloat16(),
                                     idx_b, sink, 0.2, None, cfg)
    ob_ref = ref.sparse_attn(q.bfloat16(), kv_a.bfloat16(), idx_a, kv_b.bfloat16(), idx_b, sink,
                             0.2, p_dtype=torch.bfloat16)
    assert rel_err(ob.float(), ob_ref.float()) < 4e-3


@pytest.mark.parametrize("BN", [16, 64])
def test_sparse_attn_one_loop_same_bits(BN: int) -> None:
    """Two bf16 row sources in one loop (AttnConfig.one_loop): the bits of the two loops —
    lists not multiples of BN (a's padded steps), a token whose source a is all skipped, one
    source only and fp32 rows (the flag ignored there) — and the twin to bf16."""
    gen = torch.Generator().manual_seed(BN)
    T, H, d = 3, 20, 48
    q = torch.randn(T, H, d, generator=gen).bfloat16()
    kv_a = torch.randn(30, d, generator=gen).bfloat16()
    kv_b = torch.randn(25, d, generator=gen).bfloat16()
    idx_a = random_indices(T, 40, 30, gen, 0.25)
    idx_b = random_indices(T, 7, 25, gen, 0.25)
    idx_a[1, :] = -1
    sink = torch.randn(H, generator=gen)
    plain = tri.AttnConfig(BH=16, BN=BN, num_warps=4, num_stages=2)
    one = tri.AttnConfig(BH=16, BN=BN, num_warps=4, num_stages=2, one_loop=True)
    cases = [(q, kv_a, idx_a, kv_b, idx_b), (q, kv_a, idx_a, None, None),
             (q.float(), kv_a.float(), idx_a, kv_b.float(), idx_b)]
    for case in cases:
        got = tri.sparse_attn_with_config(*case, sink, 0.2, None, one)
        want = tri.sparse_attn_with_config(*case, sink, 0.2, None, plain)
        assert torch.equal(got, want)
    o_ref = ref.sparse_attn(q, kv_a, idx_a, kv_b, idx_b, sink, 0.2, p_dtype=torch.bfloat16)
    got = tri.sparse_attn_with_config(q, kv_a, idx_a, kv_b, idx_b, sink, 0.2, None, one)
    assert rel_err(got.float(), o_ref.float()) < 4e-3


def test_sparse_attn_split_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """ATTN_SPLIT_MIN_ROWS (off by default): decode slices of at least that many index rows —
    V4-Flash's window (128 rows) and HCA (192) decode unsplit, the CSA layer's 640 rows in 5;
    the picked plan's output equals the twin's either way."""
    monkeypatch.setattr(tri, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    plans = {K: tri.pick_attn_config(1, 64, 512, K, cpu, records=True).split_kv
             for K in (128, 192, 640)}
    assert plans == {128: 2, 192: 3, 640: 8}
    monkeypatch.setattr(tri, "ATTN_SPLIT_MIN_ROWS", 128)
    plans = {K: tri.pick_attn_config(1, 64, 512, K, cpu, records=True).split_kv
             for K in (128, 192, 640)}
    assert plans == {128: 1, 192: 1, 640: 5}
    monkeypatch.setattr(tri, "sm_count", lambda device: 4)
    gen = torch.Generator().manual_seed(8)
    T, H, d = 1, 20, 48
    q = torch.randn(T, H, d, generator=gen)
    kv_a = torch.randn(60, d, generator=gen)
    idx_a = random_indices(T, 200, 60, gen, 0.2)
    sink = torch.randn(H, generator=gen)
    want = ref.sparse_attn(q, kv_a, idx_a, None, None, sink, 0.2)
    for floor, split in ((0, 4), (64, 3), (256, 1)):              # 200 rows
        monkeypatch.setattr(tri, "ATTN_SPLIT_MIN_ROWS", floor)
        assert tri.pick_attn_config(T, H, d, 200, cpu).split_kv == split
        o = tri.sparse_attn(q, kv_a, idx_a, None, None, sink, 0.2)
        assert rel_err(o, want) < 1e-5, floor


def test_dense_prefill_plan_rule() -> None:
    """bf16 queries over bf16 rows from DENSE_WIDE_MIN_T tokens: the 64-head, 64-row, two-stage
    plan; fp32 (its shared memory would not fit), records and short steps keep theirs."""
    cpu = torch.device("cpu")
    n = tri.DENSE_WIDE_MIN_T
    wide = tri.AttnConfig(BH=64, BN=64, num_warps=8, num_stages=2, one_loop=tri.ATTN_ONE_LOOP)
    assert tri.pick_attn_config(n, 64, 512, 640, cpu, bf16=True) == wide
    assert tri.ATTN_ONE_LOOP or os.environ.get("DSV4_ATTN_ONE_LOOP") == "0"  # on by default
    assert tri.pick_attn_config(n - 1, 64, 512, 640, cpu, bf16=True).BH == 16
    assert tri.pick_attn_config(n, 64, 512, 640, cpu).BH == 16
    for t in (n, tri.RECORD_WIDE_MIN_T):   # records: their own rule, whatever bf16 says
        assert (tri.pick_attn_config(t, 64, 512, 640, cpu, records=True, bf16=True)
                == tri.pick_attn_config(t, 64, 512, 640, cpu, records=True))
    assert tri.pick_attn_config(n, 8, 512, 640, cpu, bf16=True).BH == 16   # a TP-8 shard


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,half,split,in_combine", [
    (48, 8, 3, True),       # the tail inside the merge's one column block
    (160, 16, 4, True),     # several column blocks, the tail in the last (V4: 448..511)
    (160, 48, 4, False),    # the tail across two blocks: the separate launch
    (160, 16, 1, False),    # unsplit: the separate launch
])
def test_sparse_attn_rope_out_same_bits(dtype: torch.dtype, d: int, half: int, split: int,
                                        in_combine: bool,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``rope_out``: the attention output's inverse RoPE in the split-KV merge (or the separate
    launch where the merge cannot take it) is the bits of ``apply_rope(o, inverse=True)`` of
    the unrotated output — also with the merge's rotation switched off — and the twin's
    ``rope_out`` agrees to rounding."""
    gen = torch.Generator().manual_seed(d + half + split)
    T, H = 3, 20
    q = torch.randn(T, H, d, generator=gen).to(dtype)
    kv_a = torch.randn(37, d, generator=gen).to(dtype)
    idx_a = random_indices(T, 70, 37, gen, 0.3)
    idx_a[0] = -1
    sink = torch.randn(H, generator=gen)
    ang = torch.randn(T, half, generator=gen) * 3
    cos, sin = ang.cos(), ang.sin()
    cfg = tri.AttnConfig(BH=16, BN=16, split_kv=split)
    o = tri.sparse_attn_with_config(q, kv_a, idx_a, None, None, sink, 0.2, None, cfg)
    want = ref.apply_rope(o, cos, sin, inverse=True)
    got = tri.sparse_attn_with_config(q, kv_a, idx_a, None, None, sink, 0.2, None, cfg,
                                      (cos, sin))
    assert torch.equal(got, want)
    assert not torch.equal(got[..., -2 * half:], o[..., -2 * half:])   # it did rotate
    assert torch.equal(got[..., :-2 * half], o[..., :-2 * half])
    monkeypatch.setattr(tri, "ROPE_IN_COMBINE", 0)
    assert torch.equal(tri.sparse_attn_with_config(q, kv_a, idx_a, None, None, sink, 0.2, None,
                                                   cfg, (cos, sin)), want)
    o_ref = ref.sparse_attn(q, kv_a, idx_a, None, None, sink, 0.2,
                            p_dtype=torch.bfloat16 if dtype == torch.bfloat16 else None,
                            rope_out=(cos, sin))
    assert rel_err(got.float(), o_ref.float()) < (1e-5 if dtype == torch.float32 else 4e-3)
    with pytest.raises(ValueError, match="cos"):
        tri.sparse_attn(q, kv_a, idx_a, None, None, sink, 0.2, rope_out=(cos[:, :2], sin))
