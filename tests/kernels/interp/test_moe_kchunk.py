"""K-chunk-major MXFP4 stacks (ExpertWeights.kchunk, the GPU layout of the routed experts) in
the Triton interpreter at tiny shapes: the twin un-permutes them, the grouped MMA kernels (split
and unsplit) and the FP8-MMA path read them in place with the row-major stacks' results bit for
bit; the layout helpers invert each other; bad chunk widths and the paths that cannot read the
layout are refused.

Run with TRITON_INTERPRET=1 (tests/kernels/test_interpreter.py does that in a child process).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by conftest
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)

from dsv4.ops import torch_dense as ref  # noqa: E402
from dsv4.ops import triton_moe as tri  # noqa: E402

E8M0 = torch.float8_e8m0fnu


def _experts(E: int, D: int, inter: int, gen: torch.Generator) -> ref.ExpertWeights:
    def stack(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randint(0, 256, (E, n, k // 2), generator=gen, dtype=torch.uint8)
        s = torch.randint(118, 124, (E, n, k // 32), generator=gen).to(torch.uint8)
        return w.view(torch.int8), s.view(E8M0)

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, D), stack(inter, D), stack(D, inter)
    return ref.ExpertWeights(w1, w3, w2, 128, "fp4", s1, s3, s2)


def _routing(T: int, E: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen) + 0.1
    return ids, w / w.sum(-1, keepdim=True) * 1.5


def _chunked(ex: ref.ExpertWeights) -> ref.ExpertWeights:
    return ref.kchunk_experts(ex, 128)


def test_layout_helpers_invert_each_other() -> None:
    t = torch.arange(3 * 4 * 16, dtype=torch.int32).reshape(3, 4, 16)
    c = ref.rows_kchunk(t, 8)
    assert c.shape == t.shape and torch.equal(ref.kchunk_rows(c, 8), t)
    # Chunk 1 of expert 0 holds every row's columns 8..15 in turn.
    assert torch.equal(c[0].reshape(-1)[32:64], t[0, :, 8:].reshape(-1))


@pytest.mark.parametrize("T,split", [(1, 1), (2, 2), (5, 1)])
def test_kchunk_matches_rows(T: int, split: int) -> None:
    gen = torch.Generator().manual_seed(21 + T)
    E, D, inter, k = 6, 256, 256, 4
    ex = _experts(E, D, inter, gen)
    ch = _chunked(ex)
    assert torch.equal(ref.kchunk_rows(ch.w1, 64), ex.w1)
    x = torch.randn(T, D, generator=gen)
    ids, w = _routing(T, E, k, gen)
    assert torch.equal(ref.moe_experts(x, ids, w, ch, 10.0), ref.moe_experts(x, ids, w, ex, 10.0))
    cfg = tri.MoeConfig(BM=16, BN_up=32, BN_down=64, split_up=split, split_down=split)
    y = tri.moe_experts_with_config(x, ids, w, ch, 10.0, cfg)
    assert torch.equal(y, tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg))
    assert torch.equal(tri.moe_experts(x, ids, w, ch, 10.0), tri.moe_experts(x, ids, w, ex, 10.0))


def test_kchunk_refused_where_unsupported() -> None:
    gen = torch.Generator().manual_seed(3)
    ex = _experts(4, 256, 128, gen)
    ch = _chunked(ex)
    with pytest.raises(ValueError, match="kchunk"):
        ref.ExpertWeights(ch.w1, ch.w3, ch.w2, 128, "fp4", ch.s1, ch.s3, ch.s2, kchunk=48)
    with pytest.raises(ValueError, match="kchunk"):
        ref.ExpertWeights(ch.w1.float(), ch.w3.float(), ch.w2.float(), None, "dense", kchunk=128)
    with pytest.raises(ValueError, match="kchunk"):
        tri.dequant_experts(ch, "w1", torch.empty(4, 128, 256))
    bad = ref.ExpertWeights(ch.w1, ch.w3, ch.w2, None, "fp4", ch.s1, ch.s3, ch.s2, kchunk=64)
    with pytest.raises(ValueError, match="kchunk"):       # K step 128 != chunk 64
        tri.moe_experts_with_config(torch.randn(1, 256), torch.zeros(1, 2, dtype=torch.long),
                                    torch.ones(1, 2), bad, 10.0, None)


@pytest.mark.parametrize("predecode", [False, True])
def test_kchunk_fp8mma_matches_rows(predecode: bool) -> None:
    """The FP8-MMA path (its in-loop decode and its predecode kernel) reads the chunked codes
    and scales in place: the row-major stacks' output bit for bit."""
    from dsv4.ops import triton_moe_fp8 as f8
    gen = torch.Generator().manual_seed(40 + predecode)
    E, D, inter, k, T = 4, 256, 256, 2, 9
    ex = _experts(E, D, inter, gen)
    ch = _chunked(ex)
    x = torch.randn(T, D, generator=gen).to(torch.bfloat16)
    ids, w = _routing(T, E, k, gen)
    y = f8.moe_experts_fp8mma(x, ids, w, ch, 10.0, predecode=predecode)
    assert torch.isfinite(y).all()
    assert torch.equal(y, f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, predecode=predecode))
