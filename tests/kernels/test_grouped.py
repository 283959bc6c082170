"""The grouped FP8-weight GEMM of ``attn.wo_a`` (``grouped_dequant_linear``): the torch twin
against the loader's dequantization + einsum (exact), the Triton kernel against the twin in the
interpreter at tiny shapes (``test_interp_*``, run in a child process by
:func:`test_kernels_in_interpreter`) and on the GPU at V4-Flash shapes (skipped without CUDA),
and the model with wo_a kept FP8 against the model with the dense wo_a.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dsv4.formats import QuantWeight, dequant_fp8_block, quant_fp8_block
from tests.kernels.interp_child import run_in_interpreter

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(
    not INTERP, reason="interpreter test: run by test_kernels_in_interpreter in a child process")
gpu_only = pytest.mark.skipif(
    INTERP or not torch.cuda.is_available(), reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")

SCALES = ("e8m0", torch.float32)


def _weights(G: int, N: int, K: int, block: int, scale, seed: int, device: str = "cpu"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 block weight [G·N, K] (codes spread over the e4m3 range, subnormals included) and
    its scales, quantized the way the checkpoints are."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(G * N, K, generator=gen) * torch.rand(G * N, 1, generator=gen) * 0.1
    w8, s = quant_fp8_block(w, block, scale)
    return w8.to(device), s.to(device)


def _x(T: int, G: int, K: int, seed: int, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, G, K, generator=gen).to(device=device, dtype=torch.bfloat16)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------ torch twin (exact)
@pytest.mark.parametrize("block,scale", [(128, "e8m0"), (128, torch.float32), (32, "e8m0")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_twin_is_the_dequantized_einsum(block: int, scale, dtype: torch.dtype) -> None:
    from dsv4.ops.torch_grouped import grouped_dequant_linear
    G, N, K, T = 4, 64, 256, 5
    w8, s = _weights(G, N, K, block, scale, 1)
    x = _x(T, G, K, 2).to(dtype)
    dense = dequant_fp8_block(w8, s, block, dtype).view(G, N, K)     # what the loader holds
    ref = torch.einsum("tgd,grd->tgr", x, dense)                    # the model's dense path
    out = grouped_dequant_linear(x, w8, s, block, G)
    assert out.dtype == dtype and out.shape == (T, G, N)
    assert torch.equal(out, ref)


def test_twin_rejects_bad_arguments() -> None:
    from dsv4.ops.torch_grouped import grouped_dequant_linear
    w8, s = _weights(2, 64, 256, 128, "e8m0", 0)
    x = _x(3, 2, 256, 0)
    with pytest.raises(ValueError, match="groups"):
        grouped_dequant_linear(x, w8, s, 128, 4)
    with pytest.raises(ValueError, match=r"\[T, G, K\]"):
        grouped_dequant_linear(x[0], w8, s, 128, 2)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        grouped_dequant_linear(x, w8.float(), s, 128, 2)
    with pytest.raises(ValueError, match="scale must be"):
        grouped_dequant_linear(x, w8, s[:, :1], 128, 2)
    with pytest.raises(ValueError, match="not \\[groups"):
        grouped_dequant_linear(_x(3, 2, 128, 0), w8, s, 128, 2)


def test_op_table_has_the_op_and_falls_back_off_gpu() -> None:
    """Both tables carry ``grouped_dequant_linear``; the Triton one runs the twin on CPU tensors
    (outside the interpreter)."""
    if INTERP:
        pytest.skip("the interpreter runs the kernel itself on CPU")
    pytest.importorskip("triton")
    from dsv4.ops import get_ops, torch_grouped, triton_grouped
    assert get_ops("torch").grouped_dequant_linear is torch_grouped.grouped_dequant_linear
    w8, s = _weights(2, 64, 256, 128, "e8m0", 3)
    x = _x(3, 2, 256, 4)
    assert torch.equal(triton_grouped.grouped_dequant_linear(x, w8, s, 128, 2),
                       torch_grouped.grouped_dequant_linear(x, w8, s, 128, 2))


def test_plans_fill_the_h200_at_decode() -> None:
    """V4-Flash wo_a (G 8, N 1024, K 4096): the decode plans give >= ~2 programs per SM of 132,
    the prefill sizes no split, and the dequantize + bmm path from DEQUANT_MIN_T tokens."""
    pytest.importorskip("triton")
    from unittest import mock

    from dsv4.ops import triton_grouped as tg
    with mock.patch.object(tg, "sm_count", lambda device: 132):
        for T in (1, 16, 64, 128):
            p = tg.pick_grouped_plan(T, 8, 1024, 4096, 128, True, torch.device("cpu"))
            tiles = -(-T // p.BM) * 8 * (1024 // p.BN)
            assert p.scale_after and p.BK == 128 and tiles * p.split_k >= 2 * 132 * 0.9, (T, p)
            assert 4096 // p.BK // p.split_k >= 2
        p = tg.pick_grouped_plan(2048, 8, 1024, 4096, 128, False, torch.device("cpu"))
        assert p.split_k == 1 and not p.scale_after
        p32 = tg.pick_grouped_plan(1, 8, 1024, 4096, 32, True, torch.device("cpu"))
        assert p32.BK == 128 and not p32.scale_after
        assert tg.pick_grouped_plan(tg.DEQUANT_MIN_T, 8, 1024, 4096, 128, True,
                                    torch.device("cpu")) is None


def test_dequant_weight_equals_the_loader() -> None:
    """The prefill path's bf16 temporary is the loader's dequantization, bit for bit."""
    pytest.importorskip("triton")
    from dsv4.ops.triton_grouped import dequant_weight
    for block, scale in ((128, "e8m0"), (128, torch.float32), (32, "e8m0"), (32, torch.float32)):
        w8, s = _weights(2, 64, 256, block, scale, 5)
        assert torch.equal(dequant_weight(w8, s, block),
                           dequant_fp8_block(w8, s, block, torch.bfloat16))


# ---------------------------------------------------------------------- model (torch twins)
@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from dsv4.tiny import make_tiny_checkpoint
    root = tmp_path_factory.mktemp("grouped_wo_a")
    return {v: make_tiny_checkpoint(root / v, variant=v, seed=3) for v in ("v4", "v4-base", "v41")}


def _quantize_wo_a(model, path: str) -> int:
    """Swap every attention's dense wo_a for a Linear holding the checkpoint's FP8 QuantWeight
    (the storage of a GPU model); returns how many were swapped."""
    from dsv4.checkpoint import load_checkpoint
    from dsv4.model.layers import Linear
    sd = load_checkpoint(path, keep_quantized=True, progress=False)
    swapped = 0
    for name, module in model.named_modules():
        wo_a = getattr(module, "wo_a", None)
        if not isinstance(wo_a, Linear):
            continue
        qw = sd[f"{name}.wo_a.weight"]
        assert isinstance(qw, QuantWeight) and qw.fmt == "fp8"
        lin = Linear(wo_a.in_features, wo_a.out_features, fmt="fp8", block=wo_a.block,
                     numerics="bf16", dtype=wo_a.weight.dtype, keep_quantized=True)
        lin.load_weight(qw)
        assert lin.holds_quantized and not lin.quantizes_input
        module.wo_a = lin
        swapped += 1
    return swapped


def _forward_pair(path: str, numerics: str, ops_patch=None, ids=None):
    from dsv4.model.transformer import load_model
    ids = torch.arange(3, 60) if ids is None else ids
    dense = load_model(path, dtype=torch.bfloat16, numerics=numerics)
    quant = load_model(path, dtype=torch.bfloat16, numerics=numerics)
    assert _quantize_wo_a(quant, path) > 0
    if ops_patch is not None:
        ops_patch(quant)
    with torch.no_grad():
        return dense.forward_full(ids), quant.forward_full(ids)


@pytest.mark.parametrize("variant,numerics", [("v4", "bf16"), ("v4", "official"),
                                              ("v4-base", "bf16"), ("v41", "official")])
def test_model_with_fp8_wo_a_equals_dense_wo_a(tiny_paths, variant: str, numerics: str) -> None:
    """On the torch path the kept-FP8 wo_a (the twin: dequantize + einsum) gives the logits of
    the loader-dequantized wo_a exactly."""
    torch.set_num_threads(1)   # one batch-invariant order for both models
    dense, quant = _forward_pair(tiny_paths[variant], numerics)
    assert torch.isfinite(dense).all()
    assert torch.equal(dense, quant)


def test_loaded_gpu_style_model_keeps_wo_a_fp8(tiny_paths) -> None:
    """``build_model(keep_quantized=True)`` + a keep_quantized load (what load_model does on
    CUDA) leaves every wo_a FP8 (half the bytes of bf16), run through the op table."""
    from dsv4.checkpoint import open_checkpoint
    from dsv4.config import ModelConfig
    from dsv4.model.transformer import build_model
    path = tiny_paths["v4"]
    cfg = ModelConfig.from_file(path)
    model = build_model(cfg, keep_quantized=True)
    reader = open_checkpoint(path, cfg, device="cpu", keep_quantized=True, progress=False)
    model.load_stream(reader.names, reader)
    attn = [m for m in model.modules() if hasattr(m, "wo_a")]
    assert attn and all(a.wo_a.holds_quantized for a in attn)
    assert all(a.wo_a.qweight.weight.dtype == torch.float8_e4m3fn for a in attn)
    assert all(a.wo_a.weight.numel() == 0 for a in attn)


# ---------------------------------------------------------------- interpreter (child process)
@interp_only
@pytest.mark.parametrize("block,scale", [(128, "e8m0"), (128, torch.float32), (32, "e8m0"),
                                         (32, torch.float32)])
@pytest.mark.parametrize("T,G", [(1, 2), (5, 4), (17, 2), (70, 2)])
def test_interp_kernel_matches_twin(block: int, scale, T: int, G: int) -> None:
    from dsv4.ops import torch_grouped, triton_grouped
    N, K = 64, 256
    w8, s = _weights(G, N, K, block, scale, T + G)
    x = _x(T, G, K, T * G)
    ref = torch_grouped.grouped_dequant_linear(x, w8, s, block, G)
    out = triton_grouped.grouped_dequant_linear(x, w8, s, block, G)
    assert out.shape == (T, G, N) and out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()
    # Same bf16 products, fp32 sums in another order, one bf16 rounding of the output.
    assert _rel(out, ref) < 4e-3


@interp_only
@pytest.mark.parametrize("block,scale", [(128, "e8m0"), (128, torch.float32), (32, "e8m0"),
                                         (32, torch.float32)])
@pytest.mark.parametrize("scale_after", [True, False])
def test_interp_dequantized_values_are_the_loaders_bits(block: int, scale,
                                                        scale_after: bool) -> None:
    """One-hot activations read single weight values out exactly: every output is the loader's
    bf16 dequantization of one weight (fp32 scales: the fp32 product rounded to nearest-even),
    through the split-K reduction too."""
    from dsv4.ops import triton_grouped as tg
    G, N, K = 2, 64, 256
    if scale_after and (scale != "e8m0" or block != 128):
        pytest.skip("scale_after needs e8m0 scales and a K step of one block")
    w8, s = _weights(G, N, K, block, scale, 11)
    ks = torch.tensor([0, 37, 128, 200, 255, 31, 96])
    x = torch.zeros(len(ks), G, K, dtype=torch.bfloat16)
    x[torch.arange(len(ks)), :, ks] = 1.0
    dense = dequant_fp8_block(w8, s, block, torch.bfloat16).view(G, N, K)
    want = dense[:, :, ks].permute(2, 0, 1)                         # [T, G, N]
    bk = block if block >= 64 else 128
    for split in (1, 2):
        plan = tg.GroupedPlan(BM=16, BN=32, BK=bk, split_k=split, scale_after=scale_after)
        out = tg.grouped_dequant_linear_with_plan(x, w8, s, block, G, plan)
        assert torch.equal(out, want), (split, (out.float() - want.float()).abs().max())


@interp_only
@pytest.mark.parametrize("plan", [dict(BM=16, BN=32, BK=128, split_k=3),
                                  dict(BM=16, BN=64, BK=128, split_k=2, scale_after=False),
                                  dict(BM=32, BN=16, BK=64, split_k=4, scale_after=False),
                                  dict(BM=16, BN=32, BK=256, split_k=1, scale_after=False)])
def test_interp_split_k_plans(plan: dict) -> None:
    """Forced plans: uneven K splits (the last split shorter), several blocks per K step, a
    column tile narrower than a scale block; deterministic (two runs are equal bit for bit)."""
    from dsv4.ops import torch_grouped
    from dsv4.ops import triton_grouped as tg
    G, N, K, T = 2, 96, 512, 20
    w8, s = _weights(G, N, K, 128, "e8m0", 7)
    x = _x(T, G, K, 8)
    p = tg.GroupedPlan(**plan)
    out = tg.grouped_dequant_linear_with_plan(x, w8, s, 128, G, p)
    again = tg.grouped_dequant_linear_with_plan(x, w8, s, 128, G, p)
    assert torch.equal(out, again)
    assert _rel(out, torch_grouped.grouped_dequant_linear(x, w8, s, 128, G)) < 4e-3


@interp_only
def test_interp_dequant_path_is_the_twin() -> None:
    from dsv4.ops import torch_grouped
    from dsv4.ops import triton_grouped as tg
    w8, s = _weights(2, 64, 256, 128, torch.float32, 9)
    x = _x(6, 2, 256, 9)
    assert torch.equal(tg.grouped_dequant_linear_with_plan(x, w8, s, 128, 2, "dequant"),
                       torch_grouped.grouped_dequant_linear(x, w8, s, 128, 2))


@interp_only
@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_interp_model_with_kernel_wo_a_matches_dense(tiny_paths, variant: str) -> None:
    """The tiny model with its wo_a kept FP8 and run by the kernel gives the dense model's
    logits up to bf16 summation order."""
    from types import SimpleNamespace

    from dsv4.ops import triton_grouped

    def use_kernel(model) -> None:
        for m in model.modules():
            if hasattr(m, "wo_a"):
                table = dict(vars(m.ops))
                table["grouped_dequant_linear"] = triton_grouped.grouped_dequant_linear
                m.ops = SimpleNamespace(**table)

    torch.set_num_threads(1)
    dense, quant = _forward_pair(tiny_paths[variant], "bf16", use_kernel, torch.arange(3, 20))
    assert torch.isfinite(quant).all()
    assert _rel(quant, dense) < 2e-2
    assert (quant.argmax(-1) == dense.argmax(-1)).float().mean() > 0.9


def test_kernels_in_interpreter() -> None:
    """Run this file's interpreter tests with ``TRITON_INTERPRET=1`` in a child."""
    if INTERP:
        pytest.skip("TRITON_INTERPRET is set: the interp tests run directly")
    run_in_interpreter(__file__, "interp_", min_passed=28)


# ------------------------------------------------------------------------ GPU (V4-Flash shapes)
def _poison() -> None:
    """Fill the caching allocator's free blocks with NaN so unwritten outputs show up."""
    torch.cuda.synchronize()
    for mb in (1, 8, 64, 512):
        t = torch.full((mb << 18,), float("nan"), dtype=torch.float32, device="cuda")
        del t
    torch.cuda.synchronize()


def _gpu_weights(G: int, N: int, K: int, block: int, fp32: bool, gen: torch.Generator):
    """Random FP8 codes and scales made on the GPU (fill_random's distribution)."""
    w8 = (torch.randn(G * N, K, generator=gen, device="cuda") * 64).clamp(-448, 448)
    w8 = w8.to(torch.float8_e4m3fn)
    exps = torch.randint(114, 117, (G * N // block, K // block), generator=gen, device="cuda")
    if fp32:
        s = torch.exp2(exps.float() - 127) * (1 + torch.rand(exps.shape, generator=gen,
                                                             device="cuda"))
        return w8, s
    return w8, exps.to(torch.uint8).view(torch.float8_e8m0fnu)


@gpu_only
@pytest.mark.parametrize("T", [1, 16, 64, 1024, 4096])
@pytest.mark.parametrize("block,fp32", [(128, False), (128, True), (32, False)])
def test_gpu_v4_flash_wo_a(T: int, block: int, fp32: bool) -> None:
    """V4-Flash wo_a (G 8, N 1024, K 4096; V4.1's block 32): fresh random inputs, NaN-poisoned
    allocator, against the fp32 GEMM of the loader's bf16 weight and against the twin."""
    from dsv4.ops import torch_grouped
    from dsv4.ops import triton_grouped as tg
    G, N, K = 8, 1024, 4096
    gen = torch.Generator(device="cuda").manual_seed(T * 7 + block + fp32)
    w8, s = _gpu_weights(G, N, K, block, fp32, gen)
    x = torch.randn(T, G, K, generator=gen, device="cuda").to(torch.bfloat16)
    _poison()
    out = tg.grouped_dequant_linear(x, w8, s, block, G)
    torch.cuda.synchronize()
    assert out.shape == (T, G, N) and out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()                         # every element written
    w = dequant_fp8_block(w8, s, block, torch.bfloat16).float().view(G, N, K)
    ref = torch.einsum("tgd,grd->tgr", x.float(), w)
    assert _rel(out, ref) < 4e-3
    assert _rel(out, torch_grouped.grouped_dequant_linear(x, w8, s, block, G)) < 4e-3
    assert torch.equal(out, tg.grouped_dequant_linear(x, w8, s, block, G))   # deterministic


@gpu_only
@pytest.mark.parametrize("block,fp32,scale_after", [(128, False, True), (128, False, False),
                                                    (128, True, False), (32, True, False)])
def test_gpu_dequantized_values_are_the_loaders_bits(block: int, fp32: bool,
                                                     scale_after: bool) -> None:
    """One-hot rows read the in-register dequantization out exactly (V4-Flash shapes)."""
    from dsv4.ops import triton_grouped as tg
    G, N, K = 8, 1024, 4096
    gen = torch.Generator(device="cuda").manual_seed(block + fp32)
    w8, s = _gpu_weights(G, N, K, block, fp32, gen)
    ks = torch.randint(0, K, (16,), generator=gen, device="cuda")
    x = torch.zeros(16, G, K, dtype=torch.bfloat16, device="cuda")
    x[torch.arange(16, device="cuda"), :, ks] = 1.0
    want = dequant_fp8_block(w8, s, block, torch.bfloat16).view(G, N, K)[:, :, ks]
    bk = block if block >= 64 else 128
    plan = tg.GroupedPlan(BM=16, BN=128, BK=bk, split_k=8, num_warps=8, scale_after=scale_after)
    out = tg.grouped_dequant_linear_with_plan(x, w8, s, block, G, plan)
    assert torch.equal(out, want.permute(2, 0, 1))


@gpu_only
def test_gpu_model_fp8_wo_a_matches_dense_wo_a(tmp_path: Path) -> None:
    """A tiny V4 model loaded on CUDA keeps wo_a FP8 (the kernel runs it); swapping in the
    dense bf16 wo_a (the former path, cuBLAS einsum) changes the logits only by the bf16
    summation order."""
    from dsv4.model.layers import Linear
    from dsv4.model.transformer import load_model
    from dsv4.tiny import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / "v4", variant="v4", seed=3)
    model = load_model(path, device="cuda", numerics="official", backend="triton")
    attn = [m for m in model.modules() if hasattr(m, "wo_a")]
    assert attn and all(a.wo_a.holds_quantized for a in attn)
    ids = torch.arange(3, 60)
    with torch.no_grad():
        got = model.forward_full(ids).float()
        for a in attn:
            lin = Linear(a.wo_a.in_features, a.wo_a.out_features, fmt="fp8", block=a.wo_a.block,
                         numerics="bf16", dtype=torch.bfloat16, keep_quantized=False)
            with torch.device("cuda"):
                lin.load_weight(a.wo_a.qweight)
            assert not lin.holds_quantized and lin.weight.is_cuda
            a.wo_a = lin
        ref = model.forward_full(ids).float()
    assert torch.isfinite(got).all()
    assert _rel(got, ref) < 2e-2
