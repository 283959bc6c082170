"""The routed-expert Triton kernel (MXFP4 / FP8-block / dense stacks) against its torch twin, in
the Triton interpreter at tiny shapes.

Run with TRITON_INTERPRET=1 (tests/kernels/test_interpreter.py does that in a child process).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by conftest
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)

from dsv4 import formats  # noqa: E402
from dsv4.ops import torch_dense as ref  # noqa: E402
from dsv4.ops import triton_moe as tri  # noqa: E402
from interp_helpers import record_grids, rel_err  # noqa: E402

E8M0 = torch.float8_e8m0fnu


def _stack(fmt: str, E: int, n: int, k: int, gen: torch.Generator, block: int = 128,
           fp32_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A random [E, n, k] expert matrix stack in ``fmt`` (codes and scales drawn directly)."""
    if fmt == "fp4":
        w = torch.randint(0, 256, (E, n, k // 2), generator=gen, dtype=torch.uint8).view(torch.int8)
        s = torch.randint(120, 126, (E, n, k // 32), generator=gen).to(torch.uint8).view(E8M0)
        return w, s
    if fmt == "fp8":
        w = (torch.randn(E, n, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
        shape = (E, -(-n // block), -(-k // block))
        exps = torch.randint(116, 121, shape, generator=gen)
        if fp32_scale:
            return w, torch.exp2(exps.float() - 127) * (1 + torch.rand(shape, generator=gen))
        return w, exps.to(torch.uint8).view(E8M0)
    return torch.randn(E, n, k, generator=gen) * k ** -0.5, None


def _experts(fmt: str, E: int, D: int, inter: int, gen: torch.Generator, act_block=None,
             block: int = 128, fp32_scale: bool = False) -> ref.ExpertWeights:
    w1, s1 = _stack(fmt, E, inter, D, gen, block, fp32_scale)
    w3, s3 = _stack(fmt, E, inter, D, gen, block, fp32_scale)
    w2, s2 = _stack(fmt, E, D, inter, gen, block, fp32_scale)
    return ref.ExpertWeights(w1, w3, w2, act_block, fmt, s1, s3, s2, block)


def _routing(T: int, E: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen) + 0.1
    return ids, w / w.sum(-1, keepdim=True) * 1.5


def test_e2m1_planes_decode_every_code_and_scale() -> None:
    """Every byte value (both nibbles) with several scales decodes as formats.dequant_mxfp4."""
    E, D, inter = 1, 512, 32
    gen = torch.Generator().manual_seed(0)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8)
    w1 = codes.repeat(inter, 1).view(1, inter, D // 2)
    s1 = torch.randint(100, 140, (1, inter, D // 32), generator=gen).to(torch.uint8).view(E8M0)
    ex = _experts("fp4", E, D, inter, gen)
    ex = ref.ExpertWeights(w1, w1.clone(), ex.w2, None, "fp4", s1, s1.clone(), ex.s2)
    x = torch.randn(3, D, generator=gen)
    ids = torch.zeros(3, 1, dtype=torch.int64)
    w = torch.ones(3, 1)
    y = tri.moe_experts(x, ids, w, ex, 0.0)
    y_ref = ref.moe_experts(x, ids, w, ex, 0.0)
    assert rel_err(y, y_ref) < 1e-5


@pytest.mark.parametrize("fmt", ["fp4", "fp8", "dense"])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_moe_experts_matches_twin(fmt: str, T: int) -> None:
    gen = torch.Generator().manual_seed(T * 3 + len(fmt))
    E, D, inter, k = 8, 128, 128 if fmt == "fp8" else 64, 3
    ex = _experts(fmt, E, D, inter, gen, fp32_scale=(T == 5))
    x = torch.randn(T, D, generator=gen) * 2
    ids, w = _routing(T, E, k, gen)
    y = tri.moe_experts(x, ids, w, ex, 10.0)
    y_ref = ref.moe_experts(x, ids, w, ex, 10.0)
    assert y.shape == (T, D) and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    assert rel_err(y, y_ref) < 1e-5


def test_moe_clamp_is_active_and_matches() -> None:
    """Large activations: the SwiGLU clamp (u in ±limit, g <= limit) changes the result."""
    gen = torch.Generator().manual_seed(11)
    E, D, inter, k, T = 4, 64, 64, 2, 6
    ex = _experts("fp4", E, D, inter, gen)
    x = torch.randn(T, D, generator=gen) * 20
    ids, w = _routing(T, E, k, gen)
    y = tri.moe_experts(x, ids, w, ex, 1.0)
    assert rel_err(y, ref.moe_experts(x, ids, w, ex, 1.0)) < 1e-5
    assert rel_err(y, ref.moe_experts(x, ids, w, ex, 0.0)) > 1e-2


def test_moe_official_act_quant_bf16_and_skipped_ids() -> None:
    """bf16 compute, FP8 fake-quantized activations (act_block), ids of other shards (-1, E)."""
    gen = torch.Generator().manual_seed(5)
    E, D, inter, k, T = 6, 128, 128, 3, 9
    ex = _experts("fp4", E, D, inter, gen, act_block=128)
    x = (torch.randn(T, D, generator=gen) * 3).to(torch.bfloat16)
    ids, w = _routing(T, E, k, gen)
    ids[0, 1] = -1
    ids[4, 0] = E
    ids[4, 2] = E + 3
    y = tri.moe_experts(x, ids, w, ex, 10.0)
    y_ref = ref.moe_experts(x, ids, w, ex, 10.0)
    assert torch.isfinite(y).all()
    # bf16 intermediates: a one-ulp difference in one activation moves the output by ~4e-3 rel.
    assert rel_err(y, y_ref) < 1e-2
    no_quant = ref.ExpertWeights(ex.w1, ex.w3, ex.w2, None, "fp4", ex.s1, ex.s3, ex.s2)
    assert rel_err(y, ref.moe_experts(x, ids, w, no_quant, 10.0)) > rel_err(y, y_ref)


def test_moe_fp8_official_block_scales() -> None:
    gen = torch.Generator().manual_seed(9)
    E, D, inter, k, T = 4, 256, 128, 2, 7
    ex = _experts("fp8", E, D, inter, gen, act_block=128, fp32_scale=True)
    x = torch.randn(T, D, generator=gen)
    ids, w = _routing(T, E, k, gen)
    y = tri.moe_experts(x, ids, w, ex, 10.0)
    assert rel_err(y, ref.moe_experts(x, ids, w, ex, 10.0)) < 1e-5


def test_moe_plan_blocks_cover_every_pair_once() -> None:
    gen = torch.Generator().manual_seed(2)
    T, E, k, BM = 40, 8, 3, 16
    ids, _ = _routing(T, E, k, gen)
    ids[3, 0] = -1
    pairs, bexp = tri.moe_plan(ids, E, BM)
    P = T * k
    assert pairs.shape == (bexp.shape[0] * BM,)
    real = pairs[pairs < P].long()
    flat = ids.reshape(-1)
    want = torch.nonzero((flat >= 0) & (flat < E)).squeeze(1)
    assert torch.equal(real.sort().values, want)
    # Every row of a block belongs to the block's expert; unused blocks are marked E.
    for b in range(bexp.shape[0]):
        rows = pairs[b * BM:(b + 1) * BM].long()
        rows = rows[rows < P]
        if int(bexp[b]) == E:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and bool((flat[rows] == int(bexp[b])).all())


def test_moe_rejects_bad_shapes() -> None:
    gen = torch.Generator().manual_seed(1)
    ex = _experts("fp4", 4, 64, 64, gen)
    ids, w = _routing(2, 4, 2, gen)
    with pytest.raises(ValueError, match="w1"):
        tri.moe_experts(torch.randn(2, 128), ids, w, ex, 10.0)
    with pytest.raises(ValueError, match="topk_ids"):
        tri.moe_experts(torch.randn(2, 64), ids[:1], w, ex, 10.0)


def test_dequant_reference_is_exact_for_bf16() -> None:
    """The twin's bf16 dequantization of MXFP4 loses nothing (the kernel relies on it)."""
    gen = torch.Generator().manual_seed(4)
    w, s = _stack("fp4", 1, 16, 64, gen)
    assert torch.equal(formats.dequant_mxfp4(w[0], s[0], torch.bfloat16).float(),
                       formats.dequant_mxfp4(w[0], s[0], torch.float32))


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_dequant_experts_is_the_twins_dequantization(fmt: str) -> None:
    gen = torch.Generator().manual_seed(12)
    ex = _experts(fmt, 3, 256, 128, gen, fp32_scale=True)
    for which, (n, k) in (("w1", (128, 256)), ("w2", (256, 128))):
        for dtype in (torch.float32, torch.bfloat16):
            out = tri.dequant_experts(ex, which, torch.full((3, n, k), float("nan"), dtype=dtype))
            for e in range(3):
                assert torch.equal(out[e], ex.matrix(e, which, dtype)), (which, dtype, e)


@pytest.mark.parametrize("fmt,act_block", [("fp4", None), ("fp4", 128), ("fp8", 128)])
def test_grouped_prefill_path_matches_twin(fmt: str, act_block) -> None:
    """The dequantize + grouped-GEMM path (large calls) against the twin; an id of another
    shard is skipped; moe_experts dispatches there above DEQUANT_GEMM_MIN_ROWS pairs/expert."""
    gen = torch.Generator().manual_seed(21)
    E, D, inter, k, T = 4, 128, 128, 2, 30
    ex = _experts(fmt, E, D, inter, gen, act_block=act_block)
    x = torch.randn(T, D, generator=gen).to(torch.bfloat16)
    ids, w = _routing(T, E, k, gen)
    ids[2, 1] = -1
    y = tri.moe_experts_grouped(x, ids, w, ex, 10.0)
    y_ref = ref.moe_experts(x, ids, w, ex, 10.0)
    assert torch.isfinite(y).all()
    assert rel_err(y, y_ref) < 1e-2
    y32 = tri.moe_experts_grouped(x.float(), ids, w, ex, 10.0)
    assert rel_err(y32, ref.moe_experts(x.float(), ids, w, ex, 10.0)) < 1e-5
    old = tri.DEQUANT_GEMM_MIN_ROWS
    try:
        tri.DEQUANT_GEMM_MIN_ROWS = 10  # 60 pairs over 4 experts: the grouped path
        assert torch.equal(tri.moe_experts(x.float(), ids, w, ex, 10.0), y32)
    finally:
        tri.DEQUANT_GEMM_MIN_ROWS = old


@pytest.mark.parametrize("plan", [(16, 64, 128), (16, 128, 128), (32, 128, 128), (64, 128, 128)])
def test_moe_tile_plans_of_the_defaults(plan) -> None:
    """Every tile plan pick_moe_config chooses (decode to prefill), forced at a small shape."""
    bm, bn_up, bn_down = plan
    gen = torch.Generator().manual_seed(bm + bn_up)
    E, D, inter, k, T = 4, 128, 128, 2, 40
    ex = _experts("fp4", E, D, inter, gen, act_block=128)
    x = torch.randn(T, D, generator=gen)
    ids, w = _routing(T, E, k, gen)
    cfg = tri.MoeConfig(BM=bm, BN_up=bn_up, BN_down=bn_down)
    y = tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)
    assert rel_err(y, ref.moe_experts(x, ids, w, ex, 10.0)) < 1e-5


def test_pick_moe_config_regimes() -> None:
    assert tri.pick_moe_config(6, 256, 4096, 2048, 128).BM == 16        # decode, one token
    assert tri.pick_moe_config(384, 256, 4096, 2048, 128).BN_up == 128  # decode, batch 64
    mid = tri.pick_moe_config(12288, 256, 4096, 2048, 128)              # 2K prefill (48 rows)
    assert (mid.BM, mid.stages) == (64, 2)
    big = tri.pick_moe_config(49152, 256, 4096, 2048, 128)              # 8K prefill (192 rows)
    assert (big.BM, big.warps_up, big.warps_down) == (128, 8, 8)


@pytest.mark.parametrize("fmt,act_block,dtype", [
    ("fp4", 128, torch.bfloat16),     # V4 official numerics: FP8 act quant + MXFP4 split
    ("fp4", None, torch.bfloat16),    # the split alone
    ("fp8", 128, torch.float32),      # FP8 experts, act quant alone
])
@pytest.mark.parametrize("T,split", [(1, 1), (1, 2), (9, 1)])
def test_moe_act_prep_in_up_kernel_same_bits(fmt: str, act_block, dtype: torch.dtype, T: int,
                                             split: int,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """UP_PREP_ACT: the up kernel stores the activation GEMM-ready (its 128-wide N tile is one
    K step of the down GEMM) instead of a prep launch over the stored act — the same output
    bits, unsplit and with the up GEMM's K split (the epilogue in the last split)."""
    gen = torch.Generator().manual_seed(T * 10 + split + (act_block or 0))
    E, D, inter, k = 5, 256, 256, 3
    ex = _experts(fmt, E, D, inter, gen, act_block=act_block, fp32_scale=fmt == "fp8")
    x = (torch.randn(T, D, generator=gen) * 3).to(dtype)
    ids, w = _routing(T, E, k, gen)
    cfg = tri.MoeConfig(BM=16, BN_up=128, BN_down=128, split_up=split)
    monkeypatch.setattr(tri, "UP_PREP_ACT", 0)
    want = tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)
    monkeypatch.setattr(tri, "UP_PREP_ACT", 1)
    preps = []
    real_prep = tri.moe_prep
    monkeypatch.setattr(tri, "moe_prep", lambda *a, **kw: preps.append(a[7]) or real_prep(*a, **kw))
    got = tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)
    assert False not in preps      # no prep launch over the act (gather=False) was made
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    # The one-token plan takes 128-wide up tiles with it (64 without), so the fusion applies.
    assert tri.pick_moe_config(6, 256, 4096, 2048, 128).BN_up == 128
    monkeypatch.setattr(tri, "UP_PREP_ACT", 0)
    assert tri.pick_moe_config(6, 256, 4096, 2048, 128).BN_up == 64


@pytest.mark.parametrize("T,split,with_shared", [(1, 2, True), (1, 1, False), (4, 1, True),
                                                 (9, 2, False)])
def test_moe_combine_in_down_kernel_same_bits(T: int, split: int, with_shared: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """DOWN_COMBINE: the block that finishes a down N tile last sums the tokens' picks (+ the
    shared expert) there — the bits of the combine launch, with skipped ids (other shards),
    split and unsplit down GEMMs, and the counters left at zero for the next call."""
    from dsv4.ops.triton_dense import splitk_counters
    gen = torch.Generator().manual_seed(T * 7 + split)
    E, D, inter, k = 5, 256, 128, 3
    ex = _experts("fp4", E, D, inter, gen, act_block=128)
    x = (torch.randn(T, D, generator=gen) * 3).to(torch.bfloat16)
    ids, w = _routing(T, E, k, gen)
    ids[0, 1] = -1
    if T > 1:
        ids[1, 2] = E
    shared = (torch.randn(T, D, generator=gen) * 0.1).to(torch.bfloat16) if with_shared else None
    cfg = tri.MoeConfig(BM=16, BN_up=64, BN_down=64, split_up=split, split_down=split)
    monkeypatch.setattr(tri, "DOWN_COMBINE", 0)
    want = tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg, shared=shared)
    monkeypatch.setattr(tri, "DOWN_COMBINE", 1)
    launched = record_grids(monkeypatch, tri, "_moe_combine_kernel")
    for _ in range(2):      # a second call finds the counters at zero
        got = tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg, shared=shared)
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert not launched
    assert int(splitk_counters(x.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("fmt,act_block,split", [("fp4", 128, 1), ("fp4", 128, 2),
                                                 ("fp8", 128, 1), ("dense", None, 2)])
def test_moe_n_tiles_first_same_bits(fmt: str, act_block, split: int,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """N_FIRST: a prefill plan (N_FIRST_MIN_BM-row blocks) walking each row block's N tiles
    first gives the block-first bits, unsplit and with both GEMMs' K split (the split arrivals'
    tile ids are the same); a decode plan (16-row blocks) keeps the block-first grid."""
    gen = torch.Generator().manual_seed(17 + split)
    E, D, inter, k, T = 4, 256, 256, 3, 30
    ex = _experts(fmt, E, D, inter, gen, act_block=act_block, fp32_scale=fmt == "fp8")
    x = (torch.randn(T, D, generator=gen) * 3).to(torch.bfloat16 if fmt == "fp4" else
                                                  torch.float32)
    ids, w = _routing(T, E, k, gen)
    ids[3, 1] = -1
    cfg = tri.MoeConfig(BM=tri.N_FIRST_MIN_BM, BN_up=64, BN_down=128, split_up=split,
                        split_down=split)
    monkeypatch.setattr(tri, "N_FIRST", 0)
    want = tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)
    monkeypatch.setattr(tri, "N_FIRST", 1)
    grids = record_grids(monkeypatch, tri, "_moe_up_kernel")
    got = tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    (grid,) = grids
    assert grid[0] == inter // 64 and grid[2] == split     # N tiles on axis 0
    grids.clear()
    tri.moe_experts_with_config(x, ids, w, ex, 10.0, replace(cfg, BM=16))
    assert grids[0][1] == inter // 64


def test_tile_grid_orders_and_limit() -> None:
    assert tri.tile_grid(7, 16, 2, n_first=True) == ((16, 7, 2), True)
    assert tri.tile_grid(7, 16, 2, n_first=False) == ((7, 16, 2), False)
    assert tri.tile_grid(70000, 16, n_first=True) == ((70000, 16), False)
