"""The swapped-operand FP8 block GEMM for 1-16 rows (``dsv4/ops/triton_fp8_swap.py``).

* plain CPU: the plan rule (``pick_swap_config``), the dispatch switch ``SWAP_MAX_M`` of
  ``pick_fp8_config`` (off by default) and the plan checks;
* ``test_interp_*`` (in a child process with ``TRITON_INTERPRET=1``): 1-16 rows, one and
  several K blocks, split and unsplit K (splits that do not divide the blocks), ragged N, e8m0
  and fp32 weight scales, blocks 128 and 32, bf16 / fp32 in and out, the grouped unquantized
  form (``attn.wo_a``), against the torch twins (fp32 summation-order tolerance: the same exact
  products) and the other FP8 kernels;
* ``test_gpu_*``: the V4-Flash decode shapes at 1 / 2 / 16 rows (skipped without CUDA): fresh
  random inputs, NaN-poisoned allocator (every output element written), against the twin with
  the FP8 tensor-core bound (Hopper's FP8 MMA keeps fewer bits than fp32 inside a K block),
  run-to-run bits of the split plans and CUDA-graph replays on new inputs.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.gpu_helpers import poison_allocator as _poison
from tests.kernels.interp_child import run_in_interpreter
from tests.kernels.test_fp8_gemv import (BF16_BOUND, E8M0, FP32_BOUND, V4_FLASH_SHAPES,
                                         _fp8_weight, _rel)

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(
    not INTERP, reason="interpreter test: run by test_kernels_in_interpreter in a child process")
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or INTERP, reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")

# The FP8 wgmma against the fp32 twin (its partial sums inside a 128-wide K block keep fewer
# bits; the bound of the MMA kernel's 64-row plans, tests/kernels/test_gpu_kernels.py).
TC_BOUND = 5e-4


def _swap(bn: int, split: int, stages: int = 2):
    from dsv4.ops import triton_dense as td
    return td.Fp8GemmConfig(BM=16, BN=bn, split_k=split, num_warps=4, num_stages=stages,
                            swap=True)


# ------------------------------------------------------------------------------ plain CPU
def test_swap_plans_for_v4_flash(monkeypatch: pytest.MonkeyPatch) -> None:
    """64-row tiles, 4 stages, K splits of >= 2 blocks reaching ~4 programs per SM (132 SMs)."""
    from dsv4.ops import triton_dense as td
    from dsv4.ops import triton_fp8_swap as swap
    monkeypatch.setattr(swap, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    got = {name: swap.pick_swap_config(1, N, K, 128, cpu) for name, N, K in V4_FLASH_SHAPES}
    assert all(c.swap and c.BN == 64 and c.num_stages == 4 and c.BM == 16 for c in got.values())
    assert {n: c.split_k for n, c in got.items()} == {
        "wq_a+wkv": 16, "wq_b": 1, "wo_b": 8, "shared_w1+w3": 8, "shared_w2": 8}
    assert swap.pick_swap_config(1, 64, 128, 128, cpu).split_k == 1      # one K block
    assert swap.pick_swap_config(1, 1024, 4096, 32, cpu).BN == 32        # V4.1: 32-blocks
    assert isinstance(td.pick_fp8_config(1, 4096, 4096, 128, cpu), td.Fp8GemmConfig)


def test_swap_dispatch_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """SWAP_MAX_M = 0 (the default until measured) keeps the other plans; set, it serves
    1..min(SWAP_MAX_M, 16) rows ahead of the GEMV and nothing above."""
    from dsv4.ops import triton_dense as td
    from dsv4.ops import triton_fp8_swap as swap
    cpu = torch.device("cpu")
    monkeypatch.setattr(swap, "SWAP_MAX_M", 0)
    assert not any(td.pick_fp8_config(M, 4096, 4096, 128, cpu).swap for M in (1, 2, 16))
    monkeypatch.setattr(swap, "SWAP_MAX_M", 64)
    assert [td.pick_fp8_config(M, 4096, 4096, 128, cpu).swap for M in (1, 2, 16, 17)] == \
        [True, True, True, False]


def test_swap_plan_checks() -> None:
    from dsv4.ops import triton_dense as td
    from dsv4.ops import triton_fp8_swap as swap
    for cfg, M, msg in ((_swap(256, 1), 1, "BN must be"), (_swap(48, 1), 1, "BN must be"),
                        (_swap(8, 1), 1, "BN must be"), (_swap(64, 0), 1, "must be >= 1"),
                        (_swap(64, 1), 17, "1..16 rows")):
        with pytest.raises(ValueError, match=msg):
            swap.check_swap_plan(cfg, M, 128)
    x = torch.zeros(1, 8 * 256)
    w8 = torch.zeros(8 * 48, 256).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="rows per group"):
        swap.fp8_swap_linear(x, w8, torch.ones(3, 2), False, 128, torch.float32, _swap(32, 1),
                             groups=8)
    assert td.Fp8GemmConfig(BM=16, BN=64).swap is False


def test_kernels_in_interpreter() -> None:
    if INTERP:
        pytest.skip("already in the interpreter")
    run_in_interpreter(__file__, "interp_", min_passed=12)


# ------------------------------------------------------------------------------ interpreter
# (N, K, block, BN, split): one 128-block; ragged N with 3 splits over 4 blocks (the last split
# short); several blocks unsplit; one block per split; 32-blocks (V4.1) with 16 / 32-row tiles.
INTERP_CASES = [(64, 128, 128, 64, 1), (136, 512, 128, 32, 3), (96, 1024, 128, 64, 1),
                (128, 512, 128, 128, 4), (72, 256, 32, 16, 2), (64, 512, 32, 32, 16)]


@interp_only
@pytest.mark.parametrize("scale_dtype", [E8M0, torch.float32], ids=["e8m0", "fp32"])
@pytest.mark.parametrize("case", INTERP_CASES, ids=lambda c: "N{}-K{}-b{}-BN{}-s{}".format(*c))
def test_interp_swap_matches_twin(case: tuple, scale_dtype: torch.dtype) -> None:
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_dense as tri
    N, K, block, bn, split = case
    gen = torch.Generator().manual_seed(N + K + split)
    w8, ws = _fp8_weight(N, K, block, scale_dtype, gen)
    for M in (1, 3, 16):
        x = torch.randn(M, K, generator=gen) * 3
        x[:, :block] *= 1e-3                               # blocks of very different scales
        y = tri.fp8_linear_with_config(x, w8, ws, block, torch.float32, _swap(bn, split))
        y_ref = ref.fp8_linear(x, w8, ws, block, torch.float32)
        assert y.shape == (M, N) and torch.isfinite(y).all()
        assert _rel(y, y_ref) < FP32_BOUND, (M, _rel(y, y_ref))


@interp_only
def test_interp_swap_bf16_bits_and_other_kernels() -> None:
    """bf16 in and out (the RNE rounding of the fp32 result), leading dims, the same bits on a
    second call, zero and sub-floor rows as act_quant; against the GEMV and the MMA kernel."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_dense as tri
    gen = torch.Generator().manual_seed(5)
    N, K, block = 96, 512, 128
    w8, ws = _fp8_weight(N, K, block, E8M0, gen)
    x = (torch.randn(2, 2, K, generator=gen) * 2).to(torch.bfloat16)
    x[0, 1] = 0.0
    x[1, 0] *= 1e-7
    cfg = _swap(32, 2)
    y = tri.fp8_linear_with_config(x, w8, ws, block, torch.bfloat16, cfg)
    y32 = tri.fp8_linear_with_config(x, w8, ws, block, torch.float32, cfg)
    assert y.shape == (2, 2, N) and torch.equal(y, y32.to(torch.bfloat16))
    assert torch.equal(y, tri.fp8_linear_with_config(x, w8, ws, block, torch.bfloat16, cfg))
    assert not y32[0, 1].any()
    assert _rel(y32, ref.fp8_linear(x, w8, ws, block, torch.float32)) < FP32_BOUND
    gemv = tri.Fp8GemmConfig(BM=4, BN=32, split_k=2, num_stages=1, gemv=True, BK=256)
    mma = tri.Fp8GemmConfig(BM=16, BN=32, split_k=2)
    for other in (gemv, mma):
        assert _rel(y32, tri.fp8_linear_with_config(x, w8, ws, block, torch.float32, other)) \
            < FP32_BOUND, other


@interp_only
@pytest.mark.parametrize("case", [(2, 32, 256, 128, E8M0), (4, 16, 128, 128, torch.float32),
                                  (3, 64, 256, 32, E8M0)],
                         ids=lambda c: "G{}-R{}-K{}-b{}".format(*c[:4]))
def test_interp_swap_grouped_matches_twin(case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_grouped_linear through this kernel (SWAP_MAX_M set): each group reads its own
    K-slice of x, no activation quantization (exact bf16 × e4m3 products); against the twin."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_dense as tri
    from dsv4.ops import triton_fp8_swap as swap
    monkeypatch.setattr(swap, "SWAP_MAX_M", 16)
    monkeypatch.setattr(swap, "pick_swap_config",
                        lambda M, N, K, block, device: _swap(min(16, block), 2))
    G, R, K, block, scale_dtype = case
    gen = torch.Generator().manual_seed(G * R + K)
    w8, ws = _fp8_weight(G * R, K, block, scale_dtype, gen)
    for T in (1, 2):
        x = (torch.randn(T, G, K, generator=gen) * 2).to(torch.bfloat16)
        for out_dtype, bound in ((torch.float32, FP32_BOUND), (torch.bfloat16, BF16_BOUND)):
            y = tri.fp8_grouped_linear(x, w8, ws, block, out_dtype)
            y_ref = ref.fp8_grouped_linear(x, w8, ws, block, out_dtype)
            assert y.shape == (T, G, R) and y.dtype == out_dtype
            assert _rel(y, y_ref) < bound, (T, out_dtype, _rel(y, y_ref))
        x[:, 0] = 0
        y = tri.fp8_grouped_linear(x, w8, ws, block, torch.float32)
        assert not y[:, 0].any() and y[:, 1:].abs().sum() > 0


# ------------------------------------------------------------------------------ GPU
@pytest.fixture
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@needs_gpu
@pytest.mark.usefixtures("_no_tf32")
@pytest.mark.parametrize("M", [1, 2, 16])
@pytest.mark.parametrize("name,N,K", V4_FLASH_SHAPES)
def test_gpu_swap_v4_flash_shapes(name: str, N: int, K: int, M: int) -> None:
    """The default plan at a V4-Flash shape against the twin (fp32 out: the FP8 tensor-core
    bound; bf16 out: the RNE rounding of the fp32 result), every element written, no NaN; the
    split plans give the same bits run to run."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_dense as tri
    from dsv4.ops import triton_fp8_swap as swap
    gen = torch.Generator(device="cuda").manual_seed(M * 7 + N + K)
    scale_dtype = torch.float32 if name == "wo_b" else E8M0    # one shape with fp32 scales
    w8, ws = _fp8_weight(N, K, 128, scale_dtype, gen, "cuda")
    x = (torch.randn(M, K, generator=gen, device="cuda") * 2).to(torch.bfloat16)
    plan = swap.pick_swap_config(M, N, K, 128, x.device)
    y_ref = ref.fp8_linear(x, w8, ws, 128, torch.float32)
    _poison()
    y32 = tri.fp8_linear_with_config(x, w8, ws, 128, torch.float32, plan)
    _poison()
    y = tri.fp8_linear_with_config(x, w8, ws, 128, torch.bfloat16, plan)
    assert bool(torch.isfinite(y32).all()) and bool(torch.isfinite(y.float()).all())
    assert _rel(y32, y_ref) < TC_BOUND, (plan, _rel(y32, y_ref))
    assert torch.equal(y, y32.to(torch.bfloat16))
    assert torch.equal(y32, tri.fp8_linear_with_config(x, w8, ws, 128, torch.float32, plan))


@needs_gpu
@pytest.mark.usefixtures("_no_tf32")
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("groups", [8, 4], ids=["wo_a", "wo_a_tp2"])
def test_gpu_swap_grouped_wo_a(T: int, groups: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """attn.wo_a of V4-Flash (8 groups of 1024 rows over 4096 columns; 4 under TP=2): bf16
    products on the tensor cores against the twin and the model's bf16 einsum."""
    from dsv4.formats import dequant_fp8_block
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_dense as tri
    from dsv4.ops import triton_fp8_swap as swap
    monkeypatch.setattr(swap, "SWAP_MAX_M", 16)
    gen = torch.Generator(device="cuda").manual_seed(T + groups)
    R, K = 1024, 4096
    w8, ws = _fp8_weight(groups * R, K, 128, E8M0, gen, "cuda")
    x = (torch.randn(T, groups, K, generator=gen, device="cuda") * 2).to(torch.bfloat16)
    y_ref = ref.fp8_grouped_linear(x, w8, ws, 128, torch.float32)
    _poison()
    y32 = tri.fp8_grouped_linear(x, w8, ws, 128, torch.float32)
    _poison()
    y = tri.fp8_grouped_linear(x, w8, ws, 128, torch.bfloat16)
    w = dequant_fp8_block(w8, ws, 128, torch.bfloat16).view(groups, R, K)
    einsum = torch.einsum("tgd,grd->tgr", x, w)
    assert bool(torch.isfinite(y32).all())
    assert _rel(y32, y_ref) < 1e-5, _rel(y32, y_ref)      # bf16 MMA: fp32 sums
    assert torch.equal(y, y32.to(torch.bfloat16))
    assert _rel(y, einsum) < BF16_BOUND, _rel(y, einsum)


@needs_gpu
def test_gpu_swap_graph_replay_new_inputs() -> None:
    """A captured split plan replayed on new inputs gives the eager bits (counters reset)."""
    from dsv4.ops import triton_dense as tri
    gen = torch.Generator(device="cuda").manual_seed(3)
    N, K = 4096, 8192
    w8, ws = _fp8_weight(N, K, 128, E8M0, gen, "cuda")
    plan = _swap(64, 8, 4)
    x = torch.randn(2, K, generator=gen, device="cuda").bfloat16()
    tri.fp8_linear_with_config(x, w8, ws, 128, torch.bfloat16, plan)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = tri.fp8_linear_with_config(x, w8, ws, 128, torch.bfloat16, plan)
    for _ in range(3):
        x.copy_(torch.randn(2, K, generator=gen, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, tri.fp8_linear_with_config(x, w8, ws, 128, torch.bfloat16, plan))
