"""GPU checks of ``compress_entries`` at decode sizes (dsv4/ops/triton_compress.py): both plans
(loop; split with its default tiles and the alternatives bench/compress_sass.py times) at the
V4-Flash compressors' shapes, static decode steps of E = 1, 16, 64 entries (all valid, all
masked, mixed), against the torch twin; NaN-poisoned output memory (every element written),
the arrival counters clean after each call, CUDA-graph replays with fresh inputs.  Skipped
without CUDA (the CPU coverage is tests/kernels/test_triton_compress.py's interpreter tests).

    python -m pytest -q tests/kernels/test_compress_decode.py
"""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.ops import torch_compress as twin
from tests.kernels.test_triton_compress import assert_within_ulp

needs_cuda = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1"
                                or not torch.cuda.is_available(), reason="needs CUDA")

# (ratio, overlap, d): the CSA attention / indexer compressors, the HCA one, V4.1's ratio 2.
SHAPES = [(4, True, 512), (4, True, 128), (128, False, 512), (2, False, 512)]
PLANS = [("loop", None), ("split", None), ("split", "64,2"), ("split", "16,1"),
         ("split", "512,16"), ("split", "128,8"), ("split", "32,1"), ("split", "16,4")]


def _decode_args(ratio: int, overlap: bool, d: int, E: int, mode: str, seed: int,
                 out_dtype: torch.dtype) -> tuple:
    """compress_entries arguments of a static decode step of E sequences on the GPU (one
    candidate entry each): ``mode`` "live" (all complete), "masked" (none) or "mixed"."""
    gen = torch.Generator().manual_seed(seed)
    coff = 2 if overlap else 1
    W = coff * d
    base = torch.randint(1, 2000, (E,), generator=gen) * ratio
    if mode == "live":
        starts = base + ratio - 1
    elif mode == "masked":
        starts = base + torch.randint(0, ratio - 1, (E,), generator=gen)
    else:
        starts = base + torch.randint(0, ratio, (E,), generator=gen)
    n_slots = E + 3
    kv = torch.randn(E, W, generator=gen)
    score = torch.randn(E, W, generator=gen) * 2
    state_kv = torch.randn(n_slots, coff * ratio, W, generator=gen)
    state_score = torch.randn(n_slots, coff * ratio, W, generator=gen) * 2
    empty = torch.rand(n_slots, coff * ratio, generator=gen) < 0.1
    state_score[empty] = float("-inf")
    state_kv[empty] = 0.0
    slots = torch.randperm(n_slots, generator=gen)[:E]
    req = torch.arange(E)
    ent = torch.clamp((starts + 1) // ratio - 1, min=0)
    valid = (starts + 1) % ratio == 0
    rope = 0 if ratio == 2 else 32
    angles = torch.rand(E, max(rope, 1), generator=gen) * 6.3
    weight = torch.rand(d, generator=gen) + 0.5
    cos = torch.cos(angles).cuda() if rope else None
    sin = torch.sin(angles).cuda() if rope else None
    t = [x.cuda() for x in (kv, score, state_kv, state_score, req, ent, valid, starts,
                            torch.arange(E + 1), slots)]
    return (*t, ratio, overlap, weight.cuda(), 1e-6, cos, sin, out_dtype)


def _set_plan(monkeypatch: pytest.MonkeyPatch, plan: str, tile: str | None) -> None:
    monkeypatch.setenv("DSV4_COMPRESS_PLAN", plan)
    monkeypatch.setenv("DSV4_COMPRESS_TILE", tile or "")


def _check(got: torch.Tensor, want: torch.Tensor, valid: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not got.float().isnan().any(), "NaN: an element was not written (or a bad pool)"
    assert (got[~valid] == 0).all()
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert_within_ulp(got, want)


def _counters_clean() -> None:
    from dsv4.ops.triton_dense import splitk_counters

    torch.cuda.synchronize()
    assert not splitk_counters(torch.device("cuda"), 1).any(), "arrival counters left dirty"


@needs_cuda
@pytest.mark.parametrize("plan,tile", PLANS, ids=[p if t is None else f"{p}-{t}"
                                                  for p, t in PLANS])
@pytest.mark.parametrize("ratio,overlap,d", SHAPES)
@pytest.mark.parametrize("E", [1, 16, 64])
def test_gpu_decode_sizes(plan: str, tile: str | None, ratio: int, overlap: bool, d: int,
                          E: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from dsv4.ops import triton_compress as tri

    _set_plan(monkeypatch, plan, tile)
    if tile:
        s_block, block_d, _, warps = tri.split_tiles(ratio, overlap, d)
        if s_block * block_d > 16 * 32 * warps:
            pytest.skip(f"tile {tile}: {s_block}x{block_d} float64 tiles spill (not a plan)")
    for k, (mode, dtype) in enumerate([("live", torch.bfloat16), ("mixed", torch.bfloat16),
                                       ("masked", torch.bfloat16), ("live", torch.float32)]):
        args = _decode_args(ratio, overlap, d, E, mode, seed=100 * E + k, out_dtype=dtype)
        want = twin.compress_entries(*args)
        # NaN-poison the block the caching allocator hands the output next.
        torch.full((E, d), float("nan"), dtype=dtype, device="cuda")
        got = tri.compress_entries(*args)
        _check(got, want, args[6])
        _counters_clean()


@needs_cuda
@pytest.mark.parametrize("plan,tile", [("loop", None), ("split", None), ("split", "512,16")])
@pytest.mark.parametrize("ratio,overlap,d", SHAPES[:3])
def test_gpu_decode_graph_replays(plan: str, tile: str | None, ratio: int, overlap: bool,
                                  d: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA graph of two back-to-back calls (the second reuses the counters the first
    reset), replayed with fresh inputs copied into the captured tensors: twin results each
    time, counters clean."""
    from dsv4.ops import triton_compress as tri

    _set_plan(monkeypatch, plan, tile)
    E = 16
    args = list(_decode_args(ratio, overlap, d, E, "mixed", seed=1, out_dtype=torch.bfloat16))
    tri.compress_entries(*args)                     # warm-up: compiles, sizes the counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out1 = tri.compress_entries(*args)
        out2 = tri.compress_entries(*args)
    for seed in (2, 3, 4):
        fresh = _decode_args(ratio, overlap, d, E, "mixed", seed=seed, out_dtype=torch.bfloat16)
        for dst, src in zip(args, fresh):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        want = twin.compress_entries(*args)
        _check(out1, want, args[6])
        assert torch.equal(out1, out2)
        _counters_clean()
