"""The routed experts as K-step units (dsv4.ops.triton_moe_units, one or two tokens) on the GPU
at V4-Flash shapes: against the twin and the split-K plan, every output element written
(NaN-poisoned memory), bit-reproducible, a CUDA-graph replay equal to the eager call (skipped
without CUDA)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.kernels.test_gpu_kernels import _poison, _rel
from tests.kernels.test_moe_fast import (D, DEV, E, INTER, TOPK, _routing, _stacks,
                                         replays_match_eager)
from tests.kernels.test_moe_kchunk_gpu import _kchunk

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")


@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("per_sm", [2, 4, 6])
def test_units_gpu(T: int, per_sm: int) -> None:
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri
    gen = torch.Generator(device=DEV).manual_seed(800 + T * 10 + per_sm)
    ex = _kchunk(_stacks(gen, 128))
    x = torch.randn(T, D, generator=gen, device=DEV).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    if T == 2:
        ids[1, :2] = ids[0, :2]
        ids[1, 5] = -1
    base = tri.pick_moe_config(T * TOPK, E, D, INTER, 128)
    cfg = dataclasses.replace(base, units=per_sm)
    _poison()
    y = tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)
    assert bool(torch.isfinite(y).all())
    assert _rel(y, ref.moe_experts(x, ids, w, ex, 10.0)) < 1e-2
    assert _rel(y, tri.moe_experts_with_config(x, ids, w, ex, 10.0, base)) < 1e-2
    assert torch.equal(y, tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg))


def test_units_in_a_cuda_graph() -> None:
    from dsv4.ops import triton_moe as tri
    ex = _kchunk(_stacks(torch.Generator(device=DEV).manual_seed(900), 128))
    cfg = dataclasses.replace(tri.pick_moe_config(TOPK, E, D, INTER, 128), units=4)
    replays_match_eager(ex, cfg, 900)
