"""The CUDA-core GEMV plan of the FP8 block GEMM for 1-4 rows (``_fp8_gemv_kernel`` in
``dsv4/ops/triton_dense.py``).

* plain CPU: the plan rule (``pick_fp8_gemv_config``), the dispatch switch ``GEMV_MAX_M`` of
  ``pick_fp8_config`` (off by default) and the plan checks;
* ``test_interp_*``: the kernel in the Triton interpreter at tiny shapes, re-run in a child
  process with ``TRITON_INTERPRET=1`` by :func:`test_kernels_in_interpreter`: M = 1..4, K of one
  128-block and of several, split and unsplit K (also splits that do not divide the K steps),
  e8m0 and fp32 weight scales, blocks 128 and 32, ragged N, bf16 / fp32 activations and outputs,
  against the torch twin ``fp8_linear`` (fp32 summation-order tolerance) and the MMA kernel;
* ``test_gpu_*``: the five V4-Flash decode shapes at M = 1, 2, 4 on the GPU (skipped without
  CUDA): fresh random inputs, NaN-poisoned allocator (every output element written), against the
  twin and the MMA kernel, run-to-run bits and CUDA-graph replays of the split plans.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.gpu_helpers import poison_allocator as _poison
from tests.kernels.interp_child import run_in_interpreter

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(
    not INTERP, reason="interpreter test: run by test_kernels_in_interpreter in a child process")
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or INTERP, reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")

E8M0 = torch.float8_e8m0fnu
# fp32 output against the twin: the same exact products, fp32 sums in another order (e8m0
# scales), plus one fp32 rounding per activation element with fp32 scales (x8·sx·sw).
FP32_BOUND = 2e-6
# bf16 output: at most one bf16 rounding step apart per element.
BF16_BOUND = 4e-3
# V4-Flash decode GEMMs (name, N, K): fused wq_a+wkv, wq_b, wo_b, fused shared w1+w3, w2.
V4_FLASH_SHAPES = [("wq_a+wkv", 1536, 4096), ("wq_b", 32768, 1024), ("wo_b", 4096, 8192),
                   ("shared_w1+w3", 4096, 4096), ("shared_w2", 4096, 2048)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _fp8_weight(n: int, k: int, block: int, scale_dtype: torch.dtype, gen: torch.Generator,
                device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    w8 = (torch.randn(n, k, generator=gen, device=device) * 40).clamp(-448, 448)
    w8 = w8.to(torch.float8_e4m3fn)
    exps = torch.randint(115, 124, (-(-n // block), k // block), generator=gen, device=device)
    if scale_dtype == E8M0:
        return w8, exps.to(torch.uint8).view(E8M0)
    # fp32 (the *-Base checkpoints): not powers of two.
    return w8, torch.exp2(exps.float() - 127) * (
        1 + torch.rand(exps.shape, generator=gen, device=device))


# ------------------------------------------------------------------------------ plain CPU
def test_gemv_plans_for_v4_flash(monkeypatch: pytest.MonkeyPatch) -> None:
    """The swept plan rules at the V4-Flash shapes on 132 SMs.  One row with GEMV_WIDE_ONE_ROW
    on: no K split, 16-row tiles (32 above 8192 rows) with 2-8 warps along K, 8 weight vectors
    a thread per step (the eighteenth session's wide sweep; wo_a's grouped shape too); the
    default rule: K steps of 512, ~8 programs per SM.  Two rows: 64-row tiles, K steps of
    256."""
    from dsv4.ops import triton_dense as td
    monkeypatch.setattr(td, "sm_count", lambda device: 132)
    monkeypatch.setattr(td, "GEMV_WIDE_ONE_ROW", True)
    cpu = torch.device("cpu")
    wide = {"wq_a+wkv": (16, 2048, 8), "wq_b": (32, 512, 4), "wo_b": (16, 2048, 8),
            "shared_w1+w3": (16, 2048, 8), "shared_w2": (16, 2048, 8), "wo_a": (16, 1024, 4)}
    for name, N, K in V4_FLASH_SHAPES + [("wo_a", 8192, 4096)]:
        cfg = td.pick_fp8_gemv_config(1, N, K, 128, cpu)
        assert cfg.gemv and cfg.split_k == 1 and 128 % cfg.BN == 0, cfg
        assert (cfg.BN, cfg.BK, cfg.num_warps) == wide[name], (name, cfg)
        assert cfg.BN * cfg.BK // 16 == 8 * 32 * cfg.num_warps
    monkeypatch.setattr(td, "GEMV_WIDE_ONE_ROW", False)
    want = {"wq_a+wkv": (16, 8, 2), "wq_b": (32, 1, 4), "wo_b": (16, 4, 2),
            "shared_w1+w3": (16, 4, 2), "shared_w2": (16, 4, 2)}
    for name, N, K in V4_FLASH_SHAPES:
        cfg = td.pick_fp8_gemv_config(1, N, K, 128, cpu)
        assert cfg.gemv and cfg.BK == 512 and 128 % cfg.BN == 0, cfg
        assert (cfg.BN, cfg.split_k, cfg.num_warps) == want[name], (name, cfg)
        assert -(-N // cfg.BN) * cfg.split_k >= 5.8 * 132 and cfg.split_k <= K // cfg.BK
    two = {name: td.pick_fp8_gemv_config(2, N, K, 128, cpu) for name, N, K in V4_FLASH_SHAPES}
    assert {n: (c.BN, c.BK, c.split_k, c.num_warps) for n, c in two.items()} == {
        "wq_a+wkv": (64, 256, 16, 4), "wq_b": (64, 256, 1, 4), "wo_b": (64, 256, 8, 4),
        "shared_w1+w3": (64, 256, 8, 4), "shared_w2": (64, 256, 8, 4)}


def test_gemv_plan_small_k_and_block_32() -> None:
    from dsv4.ops import triton_dense as td
    cpu = torch.device("cpu")
    one = td.pick_fp8_gemv_config(1, 64, 128, 128, cpu)           # one K block
    assert one.BK == 128 and one.split_k == 1 and one.BN <= 64
    assert one.BN * one.BK // 16 >= 32 * one.num_warps            # a vector for every lane
    v41_one = td.pick_fp8_gemv_config(1, 1024, 5120, 32, cpu)     # 32-blocks, one row
    assert v41_one.BN == 16 and v41_one.BK % 32 == 0 and v41_one.split_k == 1
    v41 = td.pick_fp8_gemv_config(4, 1024, 5120, 32, cpu)         # V4.1: 32-blocks
    assert v41.BN == 32 and v41.BK == 256 and v41.split_k <= 16


def test_gemv_dispatch_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """GEMV_MAX_M = 0 keeps the MMA plans; set (2 by default, from the H200 timings), it serves
    1..min(GEMV_MAX_M, 4) rows and nothing above."""
    from dsv4.ops import triton_dense as td
    cpu = torch.device("cpu")
    monkeypatch.setattr(td, "GEMV_MAX_M", 0)
    assert not any(td.pick_fp8_config(M, 4096, 4096, 128, cpu).gemv for M in (1, 2, 4))
    monkeypatch.setattr(td, "GEMV_MAX_M", 2)
    assert [td.pick_fp8_config(M, 4096, 4096, 128, cpu).gemv for M in (1, 2, 3)] == \
        [True, True, False]
    monkeypatch.setattr(td, "GEMV_MAX_M", 64)
    assert [td.pick_fp8_config(M, 4096, 4096, 128, cpu).gemv for M in (4, 5)] == [True, False]


def test_gemv_plan_checks() -> None:
    from dsv4.ops import triton_dense as td
    x = torch.zeros(2, 256)
    w8 = torch.zeros(64, 256).to(torch.float8_e4m3fn)
    ws = torch.ones(1, 2)
    for cfg, msg in ((td.Fp8GemmConfig(BM=4, BN=256, gemv=True, BK=128), "BN must be"),
                     (td.Fp8GemmConfig(BM=4, BN=48, gemv=True, BK=128), "BN must be"),
                     (td.Fp8GemmConfig(BM=4, BN=32, gemv=True, BK=64), "BK must be"),
                     (td.Fp8GemmConfig(BM=4, BN=32, gemv=True, BK=384), "BK must be")):
        with pytest.raises(ValueError, match=msg):
            td._check_gemv_plan(cfg, 2, 128)
    with pytest.raises(ValueError, match="at most 4 rows"):
        td._check_gemv_plan(td.Fp8GemmConfig(BM=8, BN=32, gemv=True, BK=128), 5, 128)
    assert x.shape[1] == w8.shape[1] and ws.shape == (1, 2)


def test_kernels_in_interpreter() -> None:
    if INTERP:
        pytest.skip("already in the interpreter")
    run_in_interpreter(__file__, "interp_", min_passed=22)


# ------------------------------------------------------------------------------ interpreter
def _gemv(bn: int, bk: int, split: int, warps: int = 4):
    from dsv4.ops import triton_dense as td
    return td.Fp8GemmConfig(BM=4, BN=bn, split_k=split, num_warps=warps, num_stages=1,
                            gemv=True, BK=bk)


# (N, K, block, BN, BK, split): one 128-block; ragged N (not a multiple of BN nor of the block);
# several K steps unsplit; splits of 1 step; 3 splits over 8 blocks in 256-wide steps (the last
# split short, steps straddling split ends); V4.1-style 32-blocks with BK > block.
INTERP_CASES = [(64, 128, 128, 32, 128, 1), (136, 256, 128, 64, 128, 2),
                (96, 1024, 128, 32, 256, 1), (128, 1024, 128, 32, 128, 8),
                (128, 1024, 128, 32, 256, 3), (72, 256, 32, 32, 128, 1),
                (48, 512, 32, 16, 64, 4)]


@interp_only
@pytest.mark.parametrize("scale_dtype", [E8M0, torch.float32], ids=["e8m0", "fp32"])
@pytest.mark.parametrize("case", INTERP_CASES, ids=lambda c: "N{}-K{}-b{}-BN{}-BK{}-s{}".format(*c))
def test_interp_gemv_matches_twin(case: tuple, scale_dtype: torch.dtype) -> None:
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_dense as tri
    N, K, block, bn, bk, split = case
    gen = torch.Generator().manual_seed(N + K + split)
    w8, ws = _fp8_weight(N, K, block, scale_dtype, gen)
    for M in (1, 2, 3, 4):
        x = torch.randn(M, K, generator=gen) * 3
        x[:, :block] *= 1e-3                               # blocks of very different scales
        y = tri.fp8_linear_with_config(x, w8, ws, block, torch.float32, _gemv(bn, bk, split))
        y_ref = ref.fp8_linear(x, w8, ws, block, torch.float32)
        assert y.shape == (M, N) and torch.isfinite(y).all()
        assert _rel(y, y_ref) < FP32_BOUND, (M, _rel(y, y_ref))


# (G, R, K, block, scale dtype): the grouped, unquantized form (attn.wo_a) at toy widths.
GROUPED_CASES = [(2, 32, 256, 128, E8M0), (4, 16, 128, 128, torch.float32),
                 (3, 64, 256, 32, E8M0)]


@interp_only
@pytest.mark.parametrize("case", GROUPED_CASES, ids=lambda c: "G{}-R{}-K{}-b{}".format(*c[:4]))
def test_interp_grouped_linear_matches_twin(case: tuple) -> None:
    """fp8_grouped_linear at 1-2 rows (the GEMV kernel, groups reading their own K-slice of x,
    no activation quantization) against its torch twin; 3 rows take the twin itself."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_dense as tri
    G, R, K, block, scale_dtype = case
    gen = torch.Generator().manual_seed(G * R + K)
    w8, ws = _fp8_weight(G * R, K, block, scale_dtype, gen)
    for T in (1, 2, 3):
        x = (torch.randn(T, G, K, generator=gen) * 2).to(torch.bfloat16)
        for out_dtype, bound in ((torch.float32, FP32_BOUND), (torch.bfloat16, BF16_BOUND)):
            y = tri.fp8_grouped_linear(x, w8, ws, block, out_dtype)
            y_ref = ref.fp8_grouped_linear(x, w8, ws, block, out_dtype)
            assert y.shape == (T, G, R) and y.dtype == out_dtype
            assert _rel(y, y_ref) < bound, (T, out_dtype, _rel(y, y_ref))
        # Each group reads its own slice of x: zeroing group 0's input zeroes only its rows.
        x[:, 0] = 0
        y = tri.fp8_grouped_linear(x, w8, ws, block, torch.float32)
        assert not y[:, 0].any() and y[:, 1:].abs().sum() > 0


def test_grouped_linear_rejects_bad_inputs() -> None:
    from dsv4.ops import torch_dense as ref
    gen = torch.Generator().manual_seed(0)
    w8, ws = _fp8_weight(64, 256, 128, E8M0, gen)
    x = torch.randn(1, 2, 256)
    for bad, msg in ((x[0], "x must be"), (torch.randn(1, 3, 256), "w8 must be"),
                     (torch.randn(1, 2, 128), "w8 must be")):
        with pytest.raises(ValueError, match=msg):
            ref.fp8_grouped_linear(bad, w8, ws, 128)
    with pytest.raises(ValueError, match="w_scale must be"):
        ref.fp8_grouped_linear(x, w8, ws[:, :1], 128)


@interp_only
@pytest.mark.parametrize("M", [1, 3, 4])
def test_interp_gemv_matches_mma_kernel(M: int) -> None:
    """Against the QUANT_A MMA kernel (fp32 out): the same quantized products, sums in another
    order; and the default GEMV plan of the shape."""
    from dsv4.ops import triton_dense as tri
    gen = torch.Generator().manual_seed(40 + M)
    N, K, block = 96, 512, 128
    w8, ws = _fp8_weight(N, K, block, E8M0, gen)
    x = torch.randn(M, K, generator=gen) * 2
    y_mma = tri.fp8_linear_with_config(x, w8, ws, block, torch.float32,
                                       tri.Fp8GemmConfig(BM=16, BN=32, split_k=2))
    plan = tri.pick_fp8_gemv_config(M, N, K, block, x.device)
    for cfg in (plan, _gemv(32, 256, 2)):
        y = tri.fp8_linear_with_config(x, w8, ws, block, torch.float32, cfg)
        assert _rel(y, y_mma) < FP32_BOUND, cfg


@interp_only
def test_interp_gemv_bf16_leading_dims_and_bits() -> None:
    """bf16 activations and output (rounded to nearest-even, as store_rne), leading dims, and
    the same bits on a second call (fixed split order)."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_dense as tri
    gen = torch.Generator().manual_seed(7)
    N, K, block = 64, 512, 128
    w8, ws = _fp8_weight(N, K, block, E8M0, gen)
    x = (torch.randn(2, 2, K, generator=gen) * 2).to(torch.bfloat16)
    cfg = _gemv(32, 128, 4)
    y = tri.fp8_linear_with_config(x, w8, ws, block, torch.bfloat16, cfg)
    y2 = tri.fp8_linear_with_config(x, w8, ws, block, torch.bfloat16, cfg)
    y32 = tri.fp8_linear_with_config(x, w8, ws, block, torch.float32, cfg)
    assert y.shape == (2, 2, N) and y.dtype == torch.bfloat16 and torch.equal(y, y2)
    # The bf16 store is the RNE rounding of the fp32 result (the same kernel, same sums).
    assert torch.equal(y, y32.to(torch.bfloat16))
    assert _rel(y32, ref.fp8_linear(x, w8, ws, block, torch.float32)) < FP32_BOUND
    assert _rel(y, ref.fp8_linear(x, w8, ws, block, torch.bfloat16)) < BF16_BOUND


@interp_only
@pytest.mark.parametrize("M", [2, 3, 4])
def test_interp_gemv_row_forms_same_bits(M: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """GEMV_SPLIT_ROWS False (each row quantized on its own) gives the bits of the default form
    (rows quantized together, split off in registers): the same values, the same sums."""
    from dsv4.ops import triton_dense as tri
    gen = torch.Generator().manual_seed(11 + M)
    N, K, block = 64, 768, 128
    w8, ws = _fp8_weight(N, K, block, torch.float32, gen)
    x = torch.randn(M, K, generator=gen) * 2
    cfg = _gemv(32, 256, 2)
    y = tri.fp8_linear_with_config(x, w8, ws, block, torch.float32, cfg)
    monkeypatch.setattr(tri, "GEMV_SPLIT_ROWS", False)
    assert torch.equal(tri.fp8_linear_with_config(x, w8, ws, block, torch.float32, cfg), y)


@interp_only
def test_interp_gemv_zero_and_tiny_rows() -> None:
    """A zero row and a row under the 1e-4 amax floor quantize like act_quant (zeros out)."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_dense as tri
    gen = torch.Generator().manual_seed(9)
    N, K, block = 32, 256, 128
    w8, ws = _fp8_weight(N, K, block, E8M0, gen)
    x = torch.randn(3, K, generator=gen)
    x[1] = 0.0
    x[2] *= 1e-7
    y = tri.fp8_linear_with_config(x, w8, ws, block, torch.float32, _gemv(32, 256, 1))
    y_ref = ref.fp8_linear(x, w8, ws, block, torch.float32)
    assert torch.equal(y[1], torch.zeros(N)) and _rel(y, y_ref) < FP32_BOUND


# ------------------------------------------------------------------------------ GPU

@pytest.fixture
def _no_tf32():
    # The twin is the fp32 oracle: keep cuBLAS off TF32 for it.
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@needs_gpu
@pytest.mark.usefixtures("_no_tf32")
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("groups", [8, 4], ids=["wo_a", "wo_a_tp2"])
def test_gpu_grouped_linear_wo_a(T: int, groups: int) -> None:
    """attn.wo_a of V4-Flash (8 groups of 1024 rows over 4096 columns; 4 under TP=2) through
    the grouped GEMV: against the twin and the bf16 einsum the model runs otherwise (the same
    exact products), every element written."""
    from dsv4.formats import dequant_fp8_block
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_dense as tri
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
    assert bool(torch.isfinite(y32).all()) and bool(torch.isfinite(y.float()).all())
    assert _rel(y32, y_ref) < FP32_BOUND, _rel(y32, y_ref)
    assert torch.equal(y, y32.to(torch.bfloat16))
    assert _rel(y, einsum) < BF16_BOUND, _rel(y, einsum)


@needs_gpu
@pytest.mark.usefixtures("_no_tf32")
@pytest.mark.parametrize("M", [1, 2, 4])
@pytest.mark.parametrize("name,N,K", V4_FLASH_SHAPES)
def test_gpu_gemv_v4_flash_shapes(name: str, N: int, K: int, M: int) -> None:
    """The default GEMV plan at a V4-Flash shape: against the twin (fp32: summation order;
    bf16: one rounding) and the MMA kernel's default plan; every element written."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_dense as tri
    gen = torch.Generator(device="cuda").manual_seed(M * 7 + N + K)
    scale_dtype = torch.float32 if name == "wo_b" else E8M0    # one shape with fp32 scales
    w8, ws = _fp8_weight(N, K, 128, scale_dtype, gen, "cuda")
    x = (torch.randn(M, K, generator=gen, device="cuda") * 2).to(torch.bfloat16)
    plan = tri.pick_fp8_gemv_config(M, N, K, 128, x.device)
    y_ref = ref.fp8_linear(x, w8, ws, 128, torch.float32)
    _poison()
    y32 = tri.fp8_linear_with_config(x, w8, ws, 128, torch.float32, plan)
    _poison()
    y = tri.fp8_linear_with_config(x, w8, ws, 128, torch.bfloat16, plan)
    mma = tri.Fp8GemmConfig(**{**tri.pick_fp8_config(M, N, K, 128, x.device).__dict__,
                               "gemv": False})
    if mma.BM < 16:                     # a GEMV_MAX_M plan: the MMA plan of M
        mma = tri.Fp8GemmConfig(BM=16, BN=128, split_k=4, num_warps=8)
    y_mma = tri.fp8_linear_with_config(x, w8, ws, 128, torch.float32, mma)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    assert bool(torch.isfinite(y32).all()) and bool(torch.isfinite(y.float()).all())
    assert _rel(y32, y_ref) < FP32_BOUND, _rel(y32, y_ref)
    assert _rel(y, y_ref) < BF16_BOUND
    assert torch.equal(y, y32.to(torch.bfloat16))
    # The MMA kernel's Hopper FP8 MMA partial sums carry less than fp32 precision (its own
    # GPU tests bound it by 4e-3 against the twin); a wrong block or scale would be O(1).
    assert _rel(y32, y_mma) < 1e-3, _rel(y32, y_mma)


@needs_gpu
@pytest.mark.parametrize("M", [2, 3, 4])
@pytest.mark.parametrize("name,N,K", [V4_FLASH_SHAPES[0], V4_FLASH_SHAPES[2]])
def test_gpu_gemv_row_forms_same_bits(name: str, N: int, K: int, M: int,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The two forms of the 2-4 row step (GEMV_SPLIT_ROWS) give the same bits and the twin's
    result: if only the split form fails here, set GEMV_SPLIT_ROWS = False."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_dense as tri
    gen = torch.Generator(device="cuda").manual_seed(M + N)
    w8, ws = _fp8_weight(N, K, 128, E8M0, gen, "cuda")
    x = (torch.randn(M, K, generator=gen, device="cuda") * 2).to(torch.bfloat16)
    cfg = tri.pick_fp8_gemv_config(M, N, K, 128, x.device)
    y_ref = ref.fp8_linear(x, w8, ws, 128, torch.float32)
    got = {}
    for split_rows in (True, False):
        monkeypatch.setattr(tri, "GEMV_SPLIT_ROWS", split_rows)
        _poison()
        got[split_rows] = tri.fp8_linear_with_config(x, w8, ws, 128, torch.float32, cfg)
    errs = {k: _rel(v, y_ref) for k, v in got.items()}
    assert all(e < FP32_BOUND for e in errs.values()), errs
    assert torch.equal(got[True], got[False])


@needs_gpu
@pytest.mark.parametrize("plan", [dict(BN=64, split_k=8, num_warps=8, BK=512),
                                  dict(BN=32, split_k=16, num_warps=4, BK=256),
                                  dict(BN=16, split_k=5, num_warps=2, BK=512),
                                  dict(BN=128, split_k=3, num_warps=8, BK=1024),
                                  dict(BN=32, split_k=1, num_warps=4, BK=512)],
                         ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_gpu_gemv_plans_bits_and_graphs(plan: dict) -> None:
    """Other plans (the sweep's), wo_b at M = 1..4: the twin's result, the same bits on every
    call and every CUDA-graph replay (fixed split order, counters reset by each launch)."""
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_dense as tri
    gen = torch.Generator(device="cuda").manual_seed(len(plan) + plan["split_k"])
    N, K = 4096, 8192
    w8, ws = _fp8_weight(N, K, 128, E8M0, gen, "cuda")
    cfg = tri.Fp8GemmConfig(BM=4, num_stages=1, gemv=True, **plan)
    for M in (1, 2, 3, 4):
        x = (torch.randn(M, K, generator=gen, device="cuda") * 2).to(torch.bfloat16)
        y_ref = ref.fp8_linear(x, w8, ws, 128, torch.float32)
        _poison()
        y1 = tri.fp8_linear_with_config(x, w8, ws, 128, torch.float32, cfg)
        _poison()
        y2 = tri.fp8_linear_with_config(x, w8, ws, 128, torch.float32, cfg)
        assert bool(torch.isfinite(y1).all()) and torch.equal(y1, y2)
        assert _rel(y1, y_ref) < FP32_BOUND
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_g = tri.fp8_linear_with_config(x, w8, ws, 128, torch.float32, cfg)
        for _ in range(3):
            y_g.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y_g, y1)
        del graph
    assert not tri._splitk_counter_cache[x.device].any(), "arrival counters left non-zero"
