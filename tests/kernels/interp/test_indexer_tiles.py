"""The token-tile indexer-scores kernel (``_indexer_tile_kernel``: keys gathered once for a tile
of tokens that share their key rows) against the torch twin and the one-token kernel, in the
Triton interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by conftest
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)

from dsv4.cache import formats as cf  # noqa: E402
from dsv4.ops import torch_attn as ref  # noqa: E402
from dsv4.ops import triton_attn as tri  # noqa: E402
from interp_helpers import rel_err  # noqa: E402

TILE = tri.IndexerConfig(BT=4, BL=16, num_warps=4)
ONE_TOKEN = tri.IndexerConfig()


def _prefill_rows(lengths: list[int], ratio: int, n_keys: int, gen: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_rows [T, L], n_visible [T]) of a prefill step of requests of ``lengths`` tokens
    from position 0, as the model builds them: each token repeats its request's rows (distinct
    pool rows per request), rows past a request's entries hold garbage never to be read."""
    L = max(lengths) // ratio
    perm = torch.randperm(n_keys, generator=gen)
    rows, n_vis, used = [], [], 0
    for n in lengths:
        req = torch.full((L,), 10 ** 9, dtype=torch.int64)
        ne = n // ratio
        req[:ne] = perm[used:used + ne]
        used += ne
        rows.append(req.expand(n, L))
        n_vis.append((torch.arange(n) + 1) // ratio)
    return torch.cat(rows).contiguous(), torch.cat(n_vis)


def _check(q, w, keys, rows, n_vis, tol: float) -> None:
    s = tri.indexer_scores_with_config(q, w, keys, rows, n_vis, TILE)
    L = rows.shape[1]
    vis = torch.arange(L)[None, :] < n_vis[:, None]
    assert s.shape == rows.shape and s.dtype == torch.float32
    assert torch.equal(torch.isinf(s), ~vis) and bool((s[~vis] < 0).all())
    s_ref = ref.indexer_scores(q, w, keys, rows, n_vis)
    assert rel_err(s[vis], s_ref[vis]) < tol
    s_one = tri.indexer_scores_with_config(q, w, keys, rows, n_vis, ONE_TOKEN)
    assert rel_err(s[vis], s_one[vis]) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_of_one_request_and_straddling_tiles(dtype: torch.dtype) -> None:
    # Requests of 23, 6 and 41 tokens: tiles of 4 tokens straddle both boundaries; entries past
    # 16 cover a second and a third block of BL = 16; the last tile is partial (T = 70).
    gen = torch.Generator().manual_seed(3)
    h, dI, ratio = 8, 32, 1
    rows, n_vis = _prefill_rows([23, 6, 41], ratio, 90, gen)
    T = rows.shape[0]
    q = torch.randn(T, h, dI, generator=gen).to(dtype)
    w = torch.randn(T, h, generator=gen)
    keys = torch.randn(90, dI, generator=gen).to(dtype)
    _check(q, w, keys, rows, n_vis, 1e-5 if dtype == torch.float32 else 1e-2)


def test_tiles_of_unrelated_rows() -> None:
    # Every token with rows of its own (the decode layout, or any caller): each tile takes its
    # tokens one by one; some tokens see nothing, one sees every entry.
    gen = torch.Generator().manual_seed(4)
    T, h, dI, Nk, L = 9, 8, 32, 50, 40
    q = torch.randn(T, h, dI, generator=gen)
    w = torch.randn(T, h, generator=gen)
    keys = torch.randn(Nk, dI, generator=gen)
    rows = torch.randint(0, Nk, (T, L), generator=gen)
    n_vis = torch.tensor([0, 1, 17, 40, 3, 0, 33, 16, 25])
    rows[1, 1:] = 10 ** 9  # past n_visible: must not be read
    _check(q, w, keys, rows, n_vis, 1e-5)


def test_tiles_read_fp4_keys_in_place() -> None:
    # The V4 key pool's records (e2m1, ue8m0 per 32): the same scores as the unpacked rows.
    gen = torch.Generator().manual_seed(5)
    h, dI, ratio = 8, 64, 4
    fmt = cf.fp4_record(dI, 32, "e8m0")
    rows, n_vis = _prefill_rows([37, 30], ratio, 40, gen)
    T = rows.shape[0]
    q = torch.randn(T, h, dI, generator=gen)
    w = torch.randn(T, h, generator=gen)
    keys = cf.PackedRows(fmt.pack(torch.randn(40, dI, generator=gen)), fmt)
    _check(q, w, keys, rows, n_vis, 1e-5)
    vis = torch.arange(rows.shape[1])[None, :] < n_vis[:, None]
    s = tri.indexer_scores_with_config(q, w, keys, rows, n_vis, TILE)
    s_rows = tri.indexer_scores_with_config(q, w, fmt.unpack(keys.data, torch.float32), rows,
                                            n_vis, TILE)
    assert torch.equal(s[vis], s_rows[vis])


def test_plan_rule() -> None:
    n = max(1, tri.INDEXER_TILE_MIN_T)
    assert tri.pick_indexer_config(1, 64).BT == 0
    assert tri.pick_indexer_config(n - 1, 64).BT == 0
    assert tri.pick_indexer_config(n, 64, rows_shared=False).BT == 0   # decode: a token a request
    assert tri.pick_indexer_config(n, 64).BT * 64 == 256


def test_hint_only_picks_the_kernel() -> None:
    # rows_shared on rows that are not shared: the tiles check the rows, same scores.
    gen = torch.Generator().manual_seed(6)
    T, h, dI, Nk, L = max(1, tri.INDEXER_TILE_MIN_T), 8, 16, 40, 20
    q = torch.randn(T, h, dI, generator=gen)
    w = torch.randn(T, h, generator=gen)
    keys = torch.randn(Nk, dI, generator=gen)
    rows = torch.randint(0, Nk, (T, L), generator=gen)
    n_vis = torch.randint(0, L + 1, (T,), generator=gen)
    vis = torch.arange(L)[None, :] < n_vis[:, None]
    s = tri.indexer_scores(q, w, keys, rows, n_vis, rows_shared=True)
    s_one = tri.indexer_scores(q, w, keys, rows, n_vis)
    assert torch.equal(torch.isinf(s), ~vis)
    assert rel_err(s[vis], s_one[vis]) < 1e-5
