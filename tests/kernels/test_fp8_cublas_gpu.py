"""Prefill-sized FP8 block GEMMs through cuBLAS (``triton_dense.fp8_linear`` ->
``torch._scaled_mm`` with 1×128 / 128×128 block scales): on the GPU the same bits as the Triton
GEMM (``fp8_linear_with_config``) at V4-Flash's prefill shapes, row counts that are not a
multiple of 4 (padded), and the fused wq_a + wkv weight; everywhere, the rule of when it
applies (CPU tensors, other blocks, fp32 scales, small M, odd widths never take it)."""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.ops import triton_dense as td

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")
E8M0 = torch.float8_e8m0fnu


def _weight(N: int, K: int, gen: torch.Generator, device: str, fp32: bool = False):
    w8 = (torch.randn(N, K, generator=gen, device=device) * 2).to(torch.float8_e4m3fn)
    exps = torch.randint(118, 128, (N // 128, K // 128), generator=gen, device=device)
    if fp32:
        return w8, torch.exp2(exps.float() - 127)
    return w8, exps.to(torch.uint8).view(E8M0)


def test_cublas_rule_off_gpu() -> None:
    gen = torch.Generator().manual_seed(0)
    w8, s = _weight(256, 512, gen, "cpu")
    x = torch.randn(1024, 512, generator=gen).to(torch.bfloat16)
    assert not td.cublas_fp8_applies(x, w8, s, 128, torch.bfloat16)      # a CPU tensor
    assert isinstance(td.FP8_CUBLAS, bool) and td.FP8_CUBLAS_MIN_M >= 1


@needs_gpu
@pytest.mark.parametrize("M,N,K", [(8192, 1536, 4096), (1002, 4096, 8192), (513, 32768, 1024),
                                   (2048, 4096, 2048)])
def test_cublas_fp8_linear_same_bits_gpu(M: int, N: int, K: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(M + N)
    w8, s = _weight(N, K, gen, "cuda")
    x = (torch.randn(M, K, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    assert td.cublas_fp8_applies(x, w8, s, 128, torch.bfloat16), "this torch lacks it?"
    got = td.fp8_linear(x, w8, s, 128, torch.bfloat16)
    want = td.fp8_linear_with_config(x, w8, s, 128, torch.bfloat16, None)
    assert got.shape == (M, N) and bool(torch.isfinite(got).all())
    assert torch.equal(got, want)
    # A 3-D x (the model's [T, ..., K] inputs) keeps its leading dims.
    assert torch.equal(td.fp8_linear(x.view(2, M // 2, K) if M % 2 == 0 else x[None], w8, s,
                                     128, torch.bfloat16).reshape(-1, N), want)


@needs_gpu
def test_cublas_rule_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator(device="cuda").manual_seed(3)
    w8, s = _weight(1024, 4096, gen, "cuda")
    x = torch.randn(td.FP8_CUBLAS_MIN_M, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    assert td.cublas_fp8_applies(x, w8, s, 128, torch.bfloat16)
    assert not td.cublas_fp8_applies(x[:td.FP8_CUBLAS_MIN_M - 1], w8, s, 128, torch.bfloat16)
    assert not td.cublas_fp8_applies(x, w8, s, 128, torch.float32)
    _, s32 = _weight(1024, 4096, gen, "cuda", fp32=True)
    assert not td.cublas_fp8_applies(x, w8, s32, 128, torch.bfloat16)
    assert not td.cublas_fp8_applies(x[:, :3968], w8[:, :3968], s[:, :31], 128, torch.bfloat16)
    monkeypatch.setattr(td, "FP8_CUBLAS", False)
    assert not td.cublas_fp8_applies(x, w8, s, 128, torch.bfloat16)
