"""The FP8-MMA routed-expert path (dsv4.ops.triton_moe_fp8) on the GPU at V4-Flash widths (D 4096,
I 2048, 256 experts, top-6), official numerics, bf16: against the torch twin and the bf16 kernel
of triton_moe under both prefill tile plans (skipped without CUDA).  Outputs are allocated over
NaN-poisoned memory so an element the kernels never write shows up.  Off the GPU (no
interpreter): the op runs the torch twin, after the same argument checks."""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.test_gpu_kernels import _poison, _rel

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")

DEV = "cuda"
E, D, INTER, TOPK = 256, 4096, 2048, 6


def _stacks(gen: torch.Generator):
    from dsv4.ops.torch_dense import ExpertWeights

    def stack(n: int, k: int):
        w = torch.randint(-128, 128, (E, n, k // 2), generator=gen, device=DEV, dtype=torch.int8)
        s = torch.randint(118, 123, (E, n, k // 32), generator=gen, device=DEV)
        return w, s.to(torch.uint8).view(torch.float8_e8m0fnu)

    (w1, s1), (w3, s3), (w2, s2) = stack(INTER, D), stack(INTER, D), stack(D, INTER)
    return ExpertWeights(w1, w3, w2, 128, "fp4", s1, s3, s2, 128)


def _routing(T: int, gen: torch.Generator):
    ids = torch.rand(T, E, generator=gen, device=DEV).topk(TOPK, dim=-1).indices
    w = torch.rand(T, TOPK, generator=gen, device=DEV) + 0.1
    return ids, w / w.sum(-1, keepdim=True) * 1.5


@needs_gpu
@pytest.mark.parametrize("plan", ["pick", "bm64", "bm128"])
def test_fp8mma_prefill_gpu(plan: str) -> None:
    """2048 tokens (a skipped pick, an id of another shard): finite everywhere, the twin and
    triton_moe.moe_experts to the bf16 bound (same exact products, other fp32 orders: the bf16
    roundings of the intermediates may flip)."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri
    from dsv4.ops import triton_moe_fp8 as f8
    cfg = {"pick": None, "bm64": f8.pick_fp8mma_config(2048 * TOPK, E),
           "bm128": f8.pick_fp8mma_config(8192 * TOPK, E)}[plan]
    T = 2048
    gen = torch.Generator(device=DEV).manual_seed(31)
    ex = _stacks(gen)
    x = (torch.randn(T, D, generator=gen, device=DEV) * 2).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    ids[3, 1] = -1
    ids[5, 0] = E + 7
    _poison()
    y = f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, cfg)
    assert y.shape == (T, D) and bool(torch.isfinite(y).all())
    assert _rel(y, ref.moe_experts(x, ids, w, ex, 10.0)) < 1e-2
    assert _rel(y, tri.moe_experts(x, ids, w, ex, 10.0)) < 1e-2
    # Bit-reproducible run to run (no atomics, fixed order).
    assert torch.equal(y, f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, cfg))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the interpreter runs the kernels on CPU tensors")
def test_cpu_runs_the_twin() -> None:
    """CPU tensors without the interpreter: exactly the twin; the path's requirements still
    raise (it would not apply on the GPU either)."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe_fp8 as f8
    gen = torch.Generator().manual_seed(0)
    e, d, inter = 4, 64, 64

    def stack(n: int, k: int):
        w = torch.randint(-128, 128, (e, n, k // 2), generator=gen, dtype=torch.int8)
        s = torch.randint(120, 126, (e, n, k // 32), generator=gen)
        return w, s.to(torch.uint8).view(torch.float8_e8m0fnu)

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, d), stack(inter, d), stack(d, inter)
    ex = ref.ExpertWeights(w1, w3, w2, 32, "fp4", s1, s3, s2)
    x = torch.randn(5, d, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, -1], [3, 3], [1, 0], [2, 1]])
    w = torch.rand(5, 2, generator=gen)
    assert torch.equal(f8.moe_experts_fp8mma(x, ids, w, ex, 10.0),
                       ref.moe_experts(x, ids, w, ex, 10.0))
    with pytest.raises(ValueError, match="bf16"):
        f8.moe_experts_fp8mma(x.float(), ids, w, ex, 10.0)
