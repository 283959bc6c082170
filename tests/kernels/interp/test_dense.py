"""Triton dense kernels (FP8 GEMM, mHC) against their torch twins, in the Triton interpreter.

Run with TRITON_INTERPRET=1 (tests/kernels/test_interpreter.py does that in a child process).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
from collections.abc import Iterator

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by conftest
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)

from dsv4 import formats  # noqa: E402
from dsv4.ops import torch_dense as ref  # noqa: E402
from dsv4.ops import triton_dense as tri  # noqa: E402
from dsv4.ops import triton_mhc  # noqa: E402
from interp_helpers import rel_err  # noqa: E402

E8M0 = torch.float8_e8m0fnu


def _fp8_weight(n: int, k: int, block: int, scale_dtype: torch.dtype, gen: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    w8 = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    exps = torch.randint(118, 124, (-(-n // block), k // block), generator=gen)
    if scale_dtype == E8M0:
        return w8, exps.to(torch.uint8).view(E8M0)
    # fp32 (the *-Base checkpoints): not powers of two.
    return w8, torch.exp2(exps.float() - 127) * (1 + torch.rand(exps.shape, generator=gen))


def test_act_quant_bit_exact() -> None:
    gen = torch.Generator().manual_seed(0)
    # Mixed magnitudes per block, including exact powers of two times 448 (scale boundaries),
    # tiny blocks (the 1e-4 amax floor) and values that land in the e4m3 subnormal range.
    x = torch.randn(7, 256, generator=gen) * torch.logspace(-6, 3, 7)[:, None]
    x[0, :64] = 0.0
    x[1, 0] = 448.0 * 2.0 ** -3
    x[2, 5] = -448.0 * 2.0 ** 4 * (1 + 2 ** -20)
    q, s = tri.act_quant(x, 64)
    q_ref, s_ref = formats.act_quant(x, 64)
    assert torch.equal(s, s_ref), (s - s_ref).abs().max()
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("scale_dtype", [E8M0, torch.float32])
@pytest.mark.parametrize("M", [1, 5, 70])
def test_fp8_linear_matches_twin(M: int, scale_dtype: torch.dtype, block: int) -> None:
    gen = torch.Generator().manual_seed(M * 7 + block)
    N, K = 72 if block == 32 else 136, 256  # N not a multiple of the block: ragged scale rows
    w8, ws = _fp8_weight(N, K, block, scale_dtype, gen)
    x = torch.randn(M, K, generator=gen) * 3
    y = tri.fp8_linear(x, w8, ws, block, torch.float32)
    y_ref = ref.fp8_linear(x, w8, ws, block, torch.float32)
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    assert rel_err(y, y_ref) < 1e-6


def test_fp8_linear_split_k_leading_dims_and_bf16() -> None:
    gen = torch.Generator().manual_seed(3)
    N, K, block = 64, 512, 128
    w8, ws = _fp8_weight(N, K, block, E8M0, gen)
    x = (torch.randn(2, 3, K, generator=gen) * 2).to(torch.bfloat16)
    y_ref = ref.fp8_linear(x, w8, ws, block, torch.bfloat16)
    for cfg in (tri.Fp8GemmConfig(BM=16, BN=32, split_k=3),
                tri.Fp8GemmConfig(BM=16, BN=64, split_k=1, fuse_quant=False)):
        y = tri.fp8_linear_with_config(x, w8, ws, block, torch.bfloat16, cfg)
        assert y.shape == (2, 3, N) and y.dtype == torch.bfloat16
        # bf16 output: at most one rounding step apart.
        assert rel_err(y, y_ref) < 1e-2
        assert rel_err(y.float(), y_ref.float()) < 4e-3


# ------------------------------------------------------------- split-K reduced in the kernel
def _counters() -> torch.Tensor:
    """The split-K arrival counters of the CPU device (the interpreter's)."""
    return tri._splitk_counter_cache[torch.device("cpu")]


@contextlib.contextmanager
def _program_order(monkeypatch: pytest.MonkeyPatch, order: str) -> Iterator[None]:
    """Run the interpreter's programs of each launch in ``order`` ("reversed", or "shuffled"
    with a fixed seed) instead of grid order, so a split other than the last arrives last."""
    from triton.runtime import interpreter as interp

    builder = interp.interpreter_builder
    real_dim, real_idx = builder.set_grid_dim, builder.set_grid_idx
    rng = random.Random(0)
    pending: list[tuple[int, int, int]] = []

    def set_grid_dim(nx: int, ny: int, nz: int) -> None:
        real_dim(nx, ny, nz)
        pending[:] = itertools.product(range(nx), range(ny), range(nz))
        if order == "reversed":
            pending.reverse()
        else:
            rng.shuffle(pending)

    def set_grid_idx(x: int, y: int, z: int) -> None:
        real_idx(*pending.pop(0))  # a bijection: each program still runs exactly once

    with monkeypatch.context() as mp:
        mp.setattr(builder, "set_grid_dim", set_grid_dim)
        mp.setattr(builder, "set_grid_idx", set_grid_idx)
        yield
    assert not pending, "the interpreter ran fewer programs than the grid has"


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 values (8 significant bits) at the magnitude of ``v`` (fp32)."""
    _, e = torch.frexp(v.abs())
    return torch.ldexp(torch.ones_like(v), e - 8)


@pytest.mark.parametrize("M", [1, 5, 64])
def test_fp8_split_k_matches_one_split_and_twin(M: int) -> None:
    gen = torch.Generator().manual_seed(100 + M)
    # 7 K blocks: splits 2 (4+3), 3 (3+3+1), 4 (2+2+2+1) have a short last split; 7 one each.
    # N = 80 with BN = 32: the last N tile is ragged too.
    N, K, block = 80, 224, 32
    w8, ws = _fp8_weight(N, K, block, E8M0, gen)
    x = (torch.randn(M, K, generator=gen) * 2).to(torch.bfloat16)
    bm = max(16, 1 << (M - 1).bit_length())
    one = tri.fp8_linear_with_config(x, w8, ws, block, torch.float32,
                                     tri.Fp8GemmConfig(BM=bm, BN=32, split_k=1))
    twin = ref.fp8_linear(x, w8, ws, block, torch.float32)
    # Σ|terms| per output: the fp32 rounding of any summation order is bounded by it.
    magnitude = ref.fp8_linear(x.abs(), w8.abs(), ws, block, torch.float32)
    for split in (2, 3, 4, 7):
        cfg = tri.Fp8GemmConfig(BM=bm, BN=32, split_k=split)
        y32 = tri.fp8_linear_with_config(x, w8, ws, block, torch.float32, cfg)
        y16 = tri.fp8_linear_with_config(x, w8, ws, block, torch.bfloat16, cfg)
        assert y32.shape == (M, N) and y32.dtype == torch.float32 and y16.dtype == torch.bfloat16
        assert torch.isfinite(y32).all()
        bound = 2 * (split + 7) * 2.0 ** -24 * magnitude
        assert ((y32 - one).abs() <= bound).all(), (split, (y32 - one).abs().max())
        assert rel_err(y32, one) < 2e-6 and rel_err(y32, twin) < 2e-6
        # The bf16 output is the same fp32 sum rounded to nearest-even, and so within one bf16
        # ulp of the one-split result.
        assert torch.equal(y16, y32.to(torch.bfloat16)), split
        assert ((y16.float() - one).abs() <= _bf16_ulp(one)).all(), split
        assert not _counters().any(), "a tile's arrival counter was left non-zero"


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_fp8_split_k_bits_do_not_depend_on_arrival_order(monkeypatch: pytest.MonkeyPatch,
                                                         order: str) -> None:
    gen = torch.Generator().manual_seed(7)
    N, K, block = 96, 320, 32  # 10 K blocks, split 4 -> 3+3+3+1
    w8, ws = _fp8_weight(N, K, block, torch.float32, gen)
    x = torch.randn(5, K, generator=gen) * 3
    cfg = tri.Fp8GemmConfig(BM=16, BN=32, split_k=4)
    first = tri.fp8_linear_with_config(x, w8, ws, block, torch.float32, cfg)
    again = tri.fp8_linear_with_config(x, w8, ws, block, torch.float32, cfg)
    assert torch.equal(first, again)  # run to run
    with _program_order(monkeypatch, order):
        other = tri.fp8_linear_with_config(x, w8, ws, block, torch.float32, cfg)
    # A different split arrived last in every tile, yet the sum order (0..3) is the same.
    assert torch.equal(first, other)
    assert not _counters().any()
    assert rel_err(first, ref.fp8_linear(x, w8, ws, block, torch.float32)) < 2e-6


def test_fp8_split_k_consecutive_calls_and_counter_growth(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    # A fresh cache starting from a tiny buffer, so that a launch with more tiles must grow it.
    monkeypatch.setattr(tri, "_SPLITK_MIN_COUNTERS", 1)
    monkeypatch.setattr(tri, "_splitk_counter_cache", {})
    monkeypatch.setattr(tri, "_splitk_retired", [])
    gen = torch.Generator().manual_seed(21)
    K, block = 256, 32
    cfg = tri.Fp8GemmConfig(BM=16, BN=32, split_k=3)
    outs = []
    # Two calls at 2 tiles (the second only works if the first reset its counters), then
    # 3 × 4 = 12 tiles (the buffer grows from 2 to 16 counters), then 2 tiles again.
    for M, N in ((3, 64), (3, 64), (40, 128), (2, 40)):
        w8, ws = _fp8_weight(N, K, block, E8M0, gen)
        x = torch.randn(M, K, generator=gen) * 2  # fresh inputs: stale outputs cannot pass
        y = tri.fp8_linear_with_config(x, w8, ws, block, torch.float32, cfg)
        assert rel_err(y, ref.fp8_linear(x, w8, ws, block, torch.float32)) < 2e-6, (M, N)
        buf = _counters()
        assert buf.dtype == torch.int32 and not buf.any()
        outs.append((buf.numel(), len(tri._splitk_retired)))
    assert outs == [(2, 0), (2, 0), (16, 1), (16, 1)]


def test_fp8_linear_rejects_bad_inputs() -> None:
    w8 = torch.zeros(64, 128).to(torch.float8_e4m3fn)
    ws = torch.ones(1, 1)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="scale"):
        tri.fp8_linear(x, w8, torch.ones(2, 1), 128, torch.float32)
    with pytest.raises(ValueError, match="input features"):
        tri.fp8_linear(torch.randn(2, 64), w8, ws, 128, torch.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        tri.fp8_linear(x, w8.float(), ws, 128, torch.float32)


def _hc_inputs(T: int, n: int, D: int, gen: torch.Generator, rows: int):
    x = torch.randn(T, n, D, generator=gen)
    fn = torch.randn(rows, n * D, generator=gen) * 0.1
    scale = torch.rand(3, generator=gen) + 0.5
    base = torch.randn(rows, generator=gen) * 0.5
    return x, fn, scale, base


@pytest.mark.parametrize("T", [1, 19])
def test_hc_pre_matches_twin(T: int) -> None:
    gen = torch.Generator().manual_seed(T)
    n, D = 4, 96  # D not a power of two: masked D blocks
    x, fn, scale, base = _hc_inputs(T, n, D, gen, (2 + n) * n)
    y, post, comb = triton_mhc.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20)
    y_r, post_r, comb_r = ref.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20)
    assert y.shape == (T, D) and post.shape == (T, n) and comb.shape == (T, n, n)
    assert rel_err(y, y_r) < 1e-5
    assert rel_err(post, post_r) < 1e-5
    assert rel_err(comb, comb_r) < 1e-5
    # Sinkhorn output is (near) doubly stochastic: a property, independent of the twin.
    assert torch.allclose(comb.sum(-2), torch.ones(T, n), atol=1e-3)
    # bf16 streams: y rounded once.
    yb, _, _ = triton_mhc.hc_pre(x.bfloat16(), fn, scale, base, 1e-6, 1e-6, 20)
    yb_r, _, _ = ref.hc_pre(x.bfloat16(), fn, scale, base, 1e-6, 1e-6, 20)
    assert yb.dtype == torch.bfloat16 and rel_err(yb.float(), yb_r.float()) < 4e-3


def test_hc_post_and_head_match_twin() -> None:
    gen = torch.Generator().manual_seed(11)
    T, n, D = 5, 4, 80
    x_res = torch.randn(T, n, D, generator=gen)
    out = torch.randn(T, D, generator=gen)
    post = torch.rand(T, n, generator=gen) * 2
    comb = torch.rand(T, n, n, generator=gen)  # not symmetric: the direction is checked
    y = triton_mhc.hc_post(out, x_res, post, comb)
    assert rel_err(y, ref.hc_post(out, x_res, post, comb)) < 1e-6
    yb = triton_mhc.hc_post(out.bfloat16(), x_res.bfloat16(), post, comb)
    assert yb.dtype == torch.bfloat16
    assert rel_err(yb.float(), ref.hc_post(out.bfloat16(), x_res.bfloat16(), post, comb).float()) < 4e-3
    x, fn, _, base = _hc_inputs(T, n, D, gen, n)
    scale1 = torch.rand(1, generator=gen) + 0.5
    h = triton_mhc.hc_head(x, fn, scale1, base, 1e-6, 1e-6)
    assert h.shape == (T, D)
    assert rel_err(h, ref.hc_head(x, fn, scale1, base, 1e-6, 1e-6)) < 1e-5


def test_hc_rejects_bad_shapes() -> None:
    x = torch.randn(2, 4, 32)
    with pytest.raises(ValueError, match="fn"):
        triton_mhc.hc_pre(x, torch.randn(24, 64), torch.ones(3), torch.zeros(24), 1e-6, 1e-6, 20)
    with pytest.raises(ValueError, match="x_res"):
        triton_mhc.hc_post(torch.randn(2, 16), x, torch.ones(2, 4), torch.ones(2, 4, 4))
