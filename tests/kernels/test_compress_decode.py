"""GPU checks of ``compress_entries`` at decode sizes (dsv4/ops/triton_compress.py): both plans
(loop; split with its default tiles and the alternatives bench/compress_sass.py times) at the
V4-Flash compressors' shapes, static decode steps of E = 1, 16, 64 entries (all valid, all
masked, mixed), against the torch twin; NaN-poisoned output memory (every element written),
the arrival counters clean after each call, CUDA-graph replays with fresh inputs; the fused
``ape`` add (HAS_APE) of every plan and of the state update against scores biased in torch
before the call: bit-equal; the compact C128 state (float64 pseudo-rows) at decode sizes, in
driven sequences and in graph replays: the raw state's entries bit for bit, the twin's
pseudo-rows to float64 rounding.  Skipped without CUDA (the CPU coverage is
tests/kernels/test_triton_compress.py's interpreter tests).

    python -m pytest -q tests/kernels/test_compress_decode.py
"""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.ops import torch_compress as twin
from tests.kernels.test_triton_compress import (_entry_args, assert_within_ulp, make_ape,
                                                make_case, prebiased, with_score)

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


def _skip_spilling_tile(ratio: int, overlap: bool, d: int, tile: str | None) -> None:
    from dsv4.ops import triton_compress as tri

    if tile:
        s_block, block_d, _, warps = tri.split_tiles(ratio, overlap, d)
        if s_block * block_d > 16 * 32 * warps:
            pytest.skip(f"tile {tile}: {s_block}x{block_d} float64 tiles spill (not a plan)")


@needs_cuda
@pytest.mark.parametrize("plan,tile", PLANS, ids=[p if t is None else f"{p}-{t}"
                                                  for p, t in PLANS])
@pytest.mark.parametrize("ratio,overlap,d", SHAPES)
@pytest.mark.parametrize("E", [1, 16, 64])
def test_gpu_decode_sizes(plan: str, tile: str | None, ratio: int, overlap: bool, d: int,
                          E: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from dsv4.ops import triton_compress as tri

    _set_plan(monkeypatch, plan, tile)
    _skip_spilling_tile(ratio, overlap, d, tile)
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


@needs_cuda
@pytest.mark.parametrize("plan,tile", PLANS, ids=[p if t is None else f"{p}-{t}"
                                                  for p, t in PLANS])
@pytest.mark.parametrize("ratio,overlap,d", SHAPES)
@pytest.mark.parametrize("E", [1, 16, 64])
def test_gpu_decode_ape_fused(plan: str, tile: str | None, ratio: int, overlap: bool, d: int,
                              E: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every plan with ``ape`` fused (gate open) gives the bits of the same plan on scores
    biased in torch on the GPU (the model's old add), entries and state; the twin's entries
    within tolerance.  Decode steps, as the model runs them: score a column slice of the
    stacked wkv + wgate output."""
    from dsv4.ops import triton_compress as tri

    _set_plan(monkeypatch, plan, tile)
    monkeypatch.setenv("DSV4_UNVERIFIED_KERNELS", "1")
    assert tri.ape_fused()
    _skip_spilling_tile(ratio, overlap, d, tile)
    gen = torch.Generator().manual_seed(7 * E + ratio)
    for k, (mode, dtype) in enumerate([("mixed", torch.bfloat16), ("live", torch.float32)]):
        args = list(_decode_args(ratio, overlap, d, E, mode, seed=500 + 100 * E + k,
                                 out_dtype=dtype))
        W = args[0].shape[1]
        wide = torch.cat((args[0], args[1], torch.randn(E, 8, generator=gen).cuda()), dim=1)
        args[0], args[1] = wide[:, :W], wide[:, W:2 * W]
        ape = (torch.randn(ratio, W, generator=gen) * 3).cuda()
        starts = args[7]
        biased = list(args)
        biased[1] = args[1] + ape[starts % ratio]          # one token per request: pos = start
        want = tri.compress_entries(*biased)
        torch.full((E, d), float("nan"), dtype=dtype, device="cuda")
        got = tri.compress_entries(*args, ape=ape)
        assert torch.equal(got, want), "fused ape: not the pre-biased bits"
        _check(got, twin.compress_entries(*args, ape=ape), args[6])
        _counters_clean()
        geo = (args[7], args[8], args[9], ratio, overlap)
        skv, ssc = args[2].clone(), args[3].clone()
        tri.compress_update_state(args[0], args[1], skv, ssc, *geo, ape=ape)
        bkv, bsc = args[2].clone(), args[3].clone()
        tri.compress_update_state(biased[0], biased[1], bkv, bsc, *geo)
        assert torch.equal(skv, bkv) and torch.equal(ssc, bsc)


@needs_cuda
@pytest.mark.parametrize("plan", ["loop", "split"])
@pytest.mark.parametrize("ratio,overlap,d", SHAPES)
def test_gpu_prefill_ape_fused(plan: str, ratio: int, overlap: bool, d: int,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed step (prefill chunks across groups, decode rows, several requests) with ``ape``
    fused: the bits of pre-biased scores (entries and state), the twin within tolerance."""
    from dsv4.ops import triton_compress as tri

    _set_plan(monkeypatch, plan, None)
    monkeypatch.setenv("DSV4_UNVERIFIED_KERNELS", "1")
    gen = torch.Generator().manual_seed(ratio + d)
    starts = [0, ratio + 3] + torch.randint(0, 40 * ratio, (30,), generator=gen).tolist()
    lens = [3 * ratio + 5, 2 * ratio, 1, 17] + [1] * 28
    case = make_case(ratio, overlap, d, starts, lens, rope=0 if ratio == 2 else 64,
                     device="cuda", seed=3)
    ape = make_ape(case, seed=ratio)
    biased = with_score(case, prebiased(case, ape))
    for dtype in (torch.bfloat16, torch.float32):
        got = tri.compress_entries(*_entry_args(case, dtype), ape=ape)
        assert torch.equal(got, tri.compress_entries(*_entry_args(biased, dtype)))
        want = twin.compress_entries(*_entry_args(case, dtype), ape=ape)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert_within_ulp(got, want)
    geo = (case.start_pos, case.cu_seqlens, case.slots, ratio, overlap)
    skv, ssc = case.state_kv.clone(), case.state_score.clone()
    tri.compress_update_state(case.kv, case.score, skv, ssc, *geo, ape=ape)
    twin.compress_update_state(biased.kv, biased.score, case.state_kv, case.state_score, *geo)
    assert torch.equal(skv, case.state_kv) and torch.equal(ssc, case.state_score)


# ------------------------------------------------------------------ the compact C128 state
def _compact_args(args: tuple) -> tuple:
    """compress_entries arguments with the raw state replaced by its compact form (float64
    pseudo-rows of each request's open group before its start)."""
    from tests.kernels.test_compress_compact import compact_of

    a = list(args)
    a[2], a[3] = compact_of(a[2], a[3], a[7], a[9], a[10])
    return tuple(a)


def _states_close(got: tuple, want: tuple, slots: torch.Tensor) -> None:
    """Pseudo-rows to float64 rounding (the kernel's reductions add in another order)."""
    for g, w in zip(got, want):
        g, w = g[slots], w[slots]
        assert g.dtype == w.dtype == torch.float64
        assert torch.equal(torch.isneginf(g), torch.isneginf(w))
        torch.testing.assert_close(g, w, rtol=1e-13, atol=1e-13)


@needs_cuda
@pytest.mark.parametrize("plan,tile", PLANS, ids=[p if t is None else f"{p}-{t}"
                                                  for p, t in PLANS])
@pytest.mark.parametrize("E", [1, 16, 64])
@pytest.mark.parametrize("fused_ape", [False, True], ids=["no-ape", "ape"])
def test_gpu_compact_decode_sizes(plan: str, tile: str | None, E: int, fused_ape: bool,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """V4-Flash's C128 compressor (ratio 128, d 512) with the compact state at decode sizes:
    entries bit-equal to the raw-state kernels' (the same pooled fp32 bits), the twin's within
    tolerance, NaN-poisoned outputs fully written, counters clean; the state update's
    pseudo-rows the twin's to float64 rounding."""
    from dsv4.ops import triton_compress as tri

    ratio, overlap, d = 128, False, 512
    _set_plan(monkeypatch, plan, tile)
    monkeypatch.setenv("DSV4_UNVERIFIED_KERNELS", "1")
    assert tri.compact_kernels()
    _skip_spilling_tile(ratio, overlap, d, tile)
    gen = torch.Generator().manual_seed(11 * E)
    for k, (mode, dtype) in enumerate([("live", torch.bfloat16), ("mixed", torch.bfloat16),
                                       ("masked", torch.bfloat16), ("mixed", torch.float32)]):
        raw = _decode_args(ratio, overlap, d, E, mode, seed=900 + 100 * E + k, out_dtype=dtype)
        comp = _compact_args(raw)
        ape = (torch.randn(ratio, d, generator=gen) * 3).cuda() if fused_ape else None
        want = tri.compress_entries(*raw, ape=ape)
        torch.full((E, d), float("nan"), dtype=dtype, device="cuda")
        got = tri.compress_entries(*comp, ape=ape)
        assert torch.equal(got, want), "compact state: not the raw state's entries"
        _check(got, twin.compress_entries(*comp, ape=ape), raw[6])
        _counters_clean()
        geo = (raw[7], raw[8], raw[9], ratio, overlap)
        st = (comp[2].clone(), comp[3].clone())
        tri.compress_update_state(raw[0], raw[1], *st, *geo, ape=ape)
        ref = (comp[2].clone(), comp[3].clone())
        twin.compress_update_state(raw[0], raw[1], *ref, *geo, ape=ape)
        _states_close(st, ref, raw[9])


@needs_cuda
@pytest.mark.parametrize("plan", ["loop", "split"])
def test_gpu_compact_sequences(plan: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequences at V4-Flash's C128 shape (d 512, rope 64) driven through prefill chunks,
    decode rows and batched steps (tests/kernels/test_compress_compact.py's schedules), with
    the fused ape: the compact-state kernels store the raw-state kernels' entries, bit for
    bit, and the compact twin's within tolerance; final pseudo-rows the twin's."""
    from types import SimpleNamespace

    from dsv4.ops import triton_compress as tri
    from tests.kernels.test_compress_compact import (TWIN, drive, make_seqs, schedules,
                                                     seq_lengths)

    _set_plan(monkeypatch, plan, None)
    monkeypatch.setenv("DSV4_UNVERIFIED_KERNELS", "1")
    ops = SimpleNamespace(compress_entries=tri.compress_entries,
                          compress_update_state=tri.compress_update_state)
    r, n, d = 128, 3 * 128 + 40, 512
    seqs = make_seqs(4, seq_lengths(r, n), d, seed=2, device="cuda")
    ape = (torch.randn(r, d, generator=torch.Generator().manual_seed(3)) * 3).cuda()
    scheds = schedules(r, n)
    for name in ("odd", "batched", "prefill+decode"):
        for dtype in (torch.bfloat16, torch.float32):
            raw, _ = drive(ops, seqs, scheds[name], r, False, ape, dtype, rope=64)
            comp, state = drive(ops, seqs, scheds[name], r, True, ape, dtype, rope=64)
            keys = sorted(raw)
            assert comp.keys() == raw.keys()
            g = torch.stack([comp[k] for k in keys])
            assert torch.equal(g, torch.stack([raw[k] for k in keys])), (name, dtype)
            ref, ref_state = drive(TWIN, seqs, scheds[name], r, True, ape, dtype, rope=64)
            w = torch.stack([ref[k] for k in keys])
            if dtype == torch.float32:
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
            else:
                assert_within_ulp(g, w)
            _states_close(state, ref_state, torch.arange(state[0].shape[0], device="cuda"))


@needs_cuda
@pytest.mark.parametrize("plan", ["loop", "split"])
def test_gpu_compact_graph_replays(plan: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA graph of a static decode step's entries + state update on the compact state,
    replayed with fresh inputs: the twin's entries and pseudo-rows each time."""
    from dsv4.ops import triton_compress as tri

    _set_plan(monkeypatch, plan, None)
    monkeypatch.setenv("DSV4_UNVERIFIED_KERNELS", "1")
    E, ratio = 16, 128
    args = list(_compact_args(_decode_args(ratio, False, 512, E, "mixed", seed=1,
                                           out_dtype=torch.bfloat16)))
    geo = (args[7], args[8], args[9], ratio, False)
    tri.compress_entries(*args)                         # warm-up: compiles, sizes counters
    tri.compress_update_state(args[0], args[1], args[2].clone(), args[3].clone(), *geo)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.compress_entries(*args)
        tri.compress_update_state(args[0], args[1], args[2], args[3], *geo)
    for seed in (2, 3):
        fresh = _compact_args(_decode_args(ratio, False, 512, E, "mixed", seed=seed,
                                           out_dtype=torch.bfloat16))
        for dst, src in zip(args, fresh):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        before = (args[2].clone(), args[3].clone())
        graph.replay()
        torch.cuda.synchronize()
        want = twin.compress_entries(*args[:2], *before, *args[4:])
        _check(out, want, args[6])
        _counters_clean()
        ref = (before[0].clone(), before[1].clone())
        twin.compress_update_state(args[0], args[1], *ref, *geo)
        _states_close((args[2], args[3]), ref, args[9])
