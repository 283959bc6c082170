"""K-chunk-major MXFP4 stacks (ExpertWeights.kchunk, the GPU layout of the routed experts) on the
GPU at V4-Flash shapes: the grouped MMA kernels (decode split-K plans, prefill plans) and the
FP8-MMA path (in-loop decode and predecode) read them in place and give the row-major stacks'
output bit for bit; every output element written (NaN-poisoned memory); the twin agrees; a
CUDA-graph replay equals the eager call (skipped without CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.test_gpu_kernels import _poison, _rel
from tests.kernels.test_moe_fast import (D, DEV, E, INTER, TOPK, _counters_clean, _routing,
                                         _stacks, replays_match_eager)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")


def _kchunk(ex):
    from dsv4.ops import torch_dense as ref
    return ref.kchunk_experts(ex, 128)


@pytest.mark.parametrize("T", [1, 2, 4, 16, 64, 1024, 2048])
def test_kchunk_grouped_gpu(T: int) -> None:
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri
    gen = torch.Generator(device=DEV).manual_seed(500 + T)
    ex = _stacks(gen, 128)
    ch = _kchunk(ex)
    x = torch.randn(T, D, generator=gen, device=DEV).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    if T >= 4:
        ids[2, 1] = -1
    cfg = tri.pick_moe_config(T * TOPK, E, D, INTER, 128)
    _poison()
    y = tri.moe_experts_with_config(x, ids, w, ch, 10.0, cfg)
    assert bool(torch.isfinite(y).all())
    assert torch.equal(y, tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg))
    if cfg.BM == 64:   # 2,048 tokens: the pipeline depth changes no bit
        import dataclasses
        three = dataclasses.replace(cfg, stages=3)
        assert torch.equal(y, tri.moe_experts_with_config(x, ids, w, ch, 10.0, three))
    n = min(T, 64)
    assert _rel(y[:n], ref.moe_experts(x[:n], ids[:n], w[:n], ex, 10.0)) < 1e-2
    assert _counters_clean()


@pytest.mark.parametrize("predecode", [False, True])
def test_kchunk_fp8mma_gpu(predecode: bool) -> None:
    from dsv4.ops import triton_moe_fp8 as f8
    gen = torch.Generator(device=DEV).manual_seed(700 + predecode)
    ex = _stacks(gen, 128)
    ch = _kchunk(ex)
    T = 2048
    x = torch.randn(T, D, generator=gen, device=DEV).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    _poison()
    y = f8.moe_experts_fp8mma(x, ids, w, ch, 10.0, predecode=predecode)
    assert bool(torch.isfinite(y).all())
    assert torch.equal(y, f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, predecode=predecode))


def test_kchunk_in_a_cuda_graph() -> None:
    from dsv4.ops import triton_moe as tri
    ex = _kchunk(_stacks(torch.Generator(device=DEV).manual_seed(600), 128))
    replays_match_eager(ex, tri.pick_moe_config(TOPK, E, D, INTER, 128), 600)


@pytest.mark.parametrize("T", [1, 2, 10])
def test_act_prep_in_up_kernel_gpu(T: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """UP_PREP_ACT: the up kernel stores the activation GEMM-ready for the down kernel (no
    prep launch): the bits of the separate prep, V4-Flash K-chunk-major stacks under official
    act quant, NaN-poisoned memory, the default plans (one token: 128-wide up tiles with it)."""
    from dsv4.ops import triton_moe as tri
    gen = torch.Generator(device=DEV).manual_seed(900 + T)
    ch = _kchunk(_stacks(gen, 128))
    x = torch.randn(T, D, generator=gen, device=DEV).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    monkeypatch.setattr(tri, "UP_PREP_ACT", 1)
    cfg = tri.pick_moe_config(T * TOPK, E, D, INTER, 128)
    assert cfg.BN_up == 128
    _poison()
    got = tri.moe_experts_with_config(x, ids, w, ch, 10.0, cfg)
    monkeypatch.setattr(tri, "UP_PREP_ACT", 0)
    assert bool(torch.isfinite(got).all())
    assert torch.equal(got, tri.moe_experts_with_config(x, ids, w, ch, 10.0, cfg))
    assert _counters_clean()


@pytest.mark.parametrize("T", [1, 2, 10])
def test_combine_in_down_kernel_gpu(T: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """DOWN_COMBINE: the decode combine (+ the shared expert) in the down kernel: the bits of
    the combine launch, V4-Flash K-chunk-major stacks, default decode plans, NaN-poisoned
    memory, twice (the counters reset), and under UP_PREP_ACT too."""
    from dsv4.ops import triton_moe as tri
    gen = torch.Generator(device=DEV).manual_seed(950 + T)
    ch = _kchunk(_stacks(gen, 128))
    x = torch.randn(T, D, generator=gen, device=DEV).to(torch.bfloat16)
    shared = (torch.randn(T, D, generator=gen, device=DEV) * 0.1).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    cfg = tri.pick_moe_config(T * TOPK, E, D, INTER, 128)
    want = tri.moe_experts_with_config(x, ids, w, ch, 10.0, cfg, shared=shared)
    monkeypatch.setattr(tri, "DOWN_COMBINE", 1)
    for prep in (0, 1, 1):
        monkeypatch.setattr(tri, "UP_PREP_ACT", prep)
        cfg = tri.pick_moe_config(T * TOPK, E, D, INTER, 128)
        _poison()
        got = tri.moe_experts_with_config(x, ids, w, ch, 10.0, cfg, shared=shared)
        assert torch.equal(got, want)
    assert _counters_clean()
