"""The stream-K decode expert GEMMs (dsv4.ops.triton_moe_streamk) and K-chunk-major MXFP4 stacks
(ExpertWeights.kchunk) on the GPU at V4-Flash shapes: against the twin and the grouped kernels,
every output element written (NaN-poisoned memory), bit-reproducible, CUDA-graph replays equal
to eager calls, counters left clean (skipped without CUDA)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.kernels.test_gpu_kernels import _poison, _rel
from tests.kernels.test_moe_fast import D, DEV, E, INTER, TOPK, _counters_clean, _routing, _stacks

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")


def _kchunk(ex):
    from dsv4.ops import torch_dense as ref
    w = [ref.rows_kchunk(t.view(torch.uint8), 64).view(t.dtype) for t in (ex.w1, ex.w3, ex.w2)]
    s = [ref.rows_kchunk(t.view(torch.uint8), 4).view(t.dtype) for t in (ex.s1, ex.s3, ex.s2)]
    return dataclasses.replace(ex, w1=w[0], w3=w[1], w2=w[2], s1=s[0], s3=s[1], s2=s[2],
                               kchunk=128)


@pytest.mark.parametrize("T", [1, 2, 4, 16, 64])
@pytest.mark.parametrize("per_sm", [2, 4])
def test_streamk_and_kchunk_gpu(T: int, per_sm: int) -> None:
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri
    gen = torch.Generator(device=DEV).manual_seed(500 + T + per_sm)
    ex = _stacks(gen, 128)
    ch = _kchunk(ex)
    x = torch.randn(T, D, generator=gen, device=DEV).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    if T >= 4:
        ids[1] = ids[0]                     # shared experts: fewer used blocks
        ids[2, 1] = -1
    base = tri.pick_moe_config(T * TOPK, E, D, INTER, 128)
    sk = dataclasses.replace(base, streamk=per_sm)
    y_ref = ref.moe_experts(x, ids, w, ex, 10.0)
    y_grouped = tri.moe_experts_with_config(x, ids, w, ex, 10.0, base)
    for stacks, cfg in ((ex, sk), (ch, base), (ch, sk)):
        _poison()
        y = tri.moe_experts_with_config(x, ids, w, stacks, 10.0, cfg)
        assert bool(torch.isfinite(y).all()), cfg
        assert _rel(y, y_ref) < 1e-2, cfg
        assert _rel(y, y_grouped) < 1e-2, cfg
        assert torch.equal(y, tri.moe_experts_with_config(x, ids, w, stacks, 10.0, cfg)), cfg
    # The layout changes only where the bytes are: same kernel, same plan, same bits.
    assert torch.equal(tri.moe_experts_with_config(x, ids, w, ch, 10.0, sk),
                       tri.moe_experts_with_config(x, ids, w, ex, 10.0, sk))
    assert _counters_clean()


def test_streamk_in_a_cuda_graph() -> None:
    from dsv4.ops import triton_moe as tri
    gen = torch.Generator(device=DEV).manual_seed(600)
    ex = _kchunk(_stacks(gen, 128))
    x = torch.randn(1, D, generator=gen, device=DEV).to(torch.bfloat16)
    ids, w = _routing(1, gen)
    cfg = dataclasses.replace(tri.pick_moe_config(TOPK, E, D, INTER, 128), streamk=4)
    tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)
    for seed in (601, 602, 603):
        g = torch.Generator(device=DEV).manual_seed(seed)
        x.copy_(torch.randn(1, D, generator=g, device=DEV).to(torch.bfloat16))
        new_ids, new_w = _routing(1, g)
        if seed == 602:
            new_ids[0, 3] = new_ids[0, 0]   # a repeated pick: one block fewer than captured
        ids.copy_(new_ids)
        w.copy_(new_w)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)), seed
    assert _counters_clean()
